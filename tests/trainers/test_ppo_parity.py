"""Parity with TRL's experimental PPOTrainer (TRL 1.8, the last release that has it) on one fixed rollout.

TRL's own code runs in a subprocess (tests/reference/trl_ppo_fixed_rollout.py) against the copy of
TRL 1.8 that scripts/setup.sh installs into .venv/trl-1.8.0; generation is replaced by the same fixed
completions on both sides. The definitions match when completions have no stop token (TRL moves the
score one step past an EOS; docs/ppo.md), so the fixed completions run to max length. Compared: the
KL reward, scores, entropy, both losses after two epochs (so the first optimizer step is checked
too), approximate KL and both clip fractions.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import HELPERS
from transformers import LlamaForSequenceClassification

from toolkit.core.generation import Completion
from toolkit.core.ppo import PPOConfig, PPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
TRL18 = REPO / ".venv" / "trl-1.8.0"
SETTINGS = {"num_ppo_epochs": 2, "kl_coef": 0.1, "kl_estimator": "k1", "cliprange": 0.2, "cliprange_value": 0.2,
            "vf_coef": 0.1, "gamma": 1.0, "lam": 0.95, "learning_rate": 2e-3}
C = 5


class FixedBackend:
    def __init__(self, responses):
        self.responses = responses

    def sync_weights(self, model):
        pass

    def generate(self, prompts, params, *, n=1, seed=None):
        return [[Completion(list(self.responses[tuple(p)]), [0.0] * C, "length")] for p in prompts]


def classifier(seed):
    torch.manual_seed(seed)
    config = tiny_model().config
    config.num_labels, config.pad_token_id = 1, tiny_tokenizer().pad_token_id
    return LlamaForSequenceClassification(config)


@pytest.mark.skipif(not TRL18.exists(), reason="TRL 1.8 reference copy not installed (scripts/setup.sh installs it)")
@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_one_update_equals_trl_experimental_ppo(tmp_path, kl_estimator):
    settings = {**SETTINGS, "kl_estimator": kl_estimator}
    tok = tiny_tokenizer()
    tiny_model().save_pretrained(tmp_path / "policy")
    tiny_model(seed=7).save_pretrained(tmp_path / "ref")  # a reference unlike the policy, so the KL term is not 0
    tok.save_pretrained(tmp_path / "policy")
    classifier(1).save_pretrained(tmp_path / "value")
    classifier(2).save_pretrained(tmp_path / "reward")

    rows = [{"prompt": f"Count {i}"} for i in range(1, 5)]
    g = torch.Generator().manual_seed(0)
    special = {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}
    cfg = PPOConfig(output_dir=str(tmp_path / "ours"), per_device_train_batch_size=4, num_mini_batches=1,
                    num_ppo_epochs=settings["num_ppo_epochs"], max_completion_length=C, temperature=1.0,
                    beta=settings["kl_coef"], kl_estimator=kl_estimator, epsilon=settings["cliprange"],
                    cliprange_value=settings["cliprange_value"], vf_coef=settings["vf_coef"], gamma=settings["gamma"],
                    lam=settings["lam"], learning_rate=settings["learning_rate"], lr_scheduler_type="constant",
                    optim="adamw_torch", max_grad_norm=0.0, max_steps=1, save_strategy="no", report_to="none",
                    disable_tqdm=True)
    backend = FixedBackend({})
    ours = PPOTrainer(str(tmp_path / "policy"), (), cfg, train_dataset=rows, processing_class=tok,
                      reward_model=str(tmp_path / "reward"), value_model=str(tmp_path / "value"),
                      generation_backend=backend, ref_model=tiny_model(seed=7))
    prompts = ours.prompt_ids
    assert len({len(p) for p in prompts}) == 1, "equal prompt lengths keep TRL's left padding out of the comparison"
    responses = []
    for p in prompts:
        r = [t for t in torch.randint(3, 380, (3 * C,), generator=g).tolist() if t not in special][:C]
        backend.responses[tuple(p)] = r
        responses.append(r)
    (tmp_path / "spec.json").write_text(json.dumps({"prompts": prompts, "responses": responses,
                                                    "settings": settings}))
    ours.train()
    mine = [h for h in ours.state.log_history if "loss/policy_avg" in h][0]

    env = {**os.environ, "PYTHONPATH": str(TRL18), "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(HELPERS / "reference" / "trl_ppo_fixed_rollout.py"),
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.split("TRL_METRICS ", 1)[1].splitlines()[0])
    keys = ["objective/kl", "objective/non_score_reward", "objective/scores", "objective/rlhf_reward",
            "objective/entropy", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg",
            "val/clipfrac_avg"]
    for k in keys:
        assert mine[k] == pytest.approx(theirs[k], abs=1e-5, rel=1e-5), (k, mine[k], theirs[k])
    # the check has teeth: a real KL term, and the second epoch's log-probs moved away from pi_old
    assert abs(theirs["objective/kl"]) > 1e-2 and theirs["policy/approxkl_avg"] > 1e-4
