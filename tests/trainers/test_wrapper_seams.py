"""A wrapper (think Unsloth or Axolotl) swaps log-probs, loss, advantages, sampler and generation backend
through public methods only: no patching of toolkit source. Each swap must take effect.

The two wrapper packages in tests/helpers/wrappers/ run end to end on toolkit's public seams and patch nothing."""

import inspect
import sys

import pytest
import torch
import torch.nn.functional as F
from builders import HELPERS

from toolkit import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, ToolkitDeprecationWarning
from toolkit.core.generation import TransformersBackend
from toolkit.core.models import unwrap_model
from toolkit.core.rollout import RoundSampler
from toolkit.testing import tiny_model, tiny_tokenizer


def sequences_of(batch):
    """(prompt ids, completion ids) per row from either toolkit layout (shared-prompt packed or per-row packed)."""
    flat = batch["input_ids"][0].tolist()
    if "shared_prefix" in batch:
        head = flat[slice(*batch["shared_context"])] if "shared_context" in batch else []  # the prompts' common start
        return [(head + flat[p0:p1], flat[c0:c1]) for p0, p1, spans in batch["shared_prefix"] for c0, c1 in spans]
    cu, lengths = batch["cu_seq_lens"].tolist(), batch["completion_lengths"].tolist()
    return [(flat[a:b - n], flat[b - n:b]) for a, b, n in zip(cu[:-1], cu[1:], lengths)]


def naive_completion_logps(model, batch, temperature):
    """A different implementation of the same quantity: each sequence on its own, full logits, log_softmax,
    gather (what a wrapper's fused kernel would replace)."""
    out = []
    for prompt, completion in sequences_of(batch):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return torch.cat(out)


class PromptOrder(RoundSampler):
    """A curriculum: always the same two prompts, in a fixed order."""

    def order(self):
        return [7, 6] * (self.n_rows // 2)


class RecordingBackend(TransformersBackend):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prompts = []

    def generate(self, prompts, params, *, n=1, seed=None):
        self.prompts.append([list(p) for p in prompts])
        return super().generate(prompts, params, n=n, seed=seed)


class WrapperGRPO(GRPOTrainer):
    calls: dict

    def build_prompt_sampler(self):
        self.calls["sampler"] += 1
        return PromptOrder(len(self.rows), self.prompts_per_round,
                           self.args.gradient_accumulation_steps * self.args.num_iterations, seed=self.args.seed)

    def compute_advantages(self, rewards):
        self.calls["advantages"] += 1
        G = self.args.num_generations
        adv = torch.tensor(([1.0] + [-1.0 / (G - 1)] * (G - 1)) * (len(rewards) // G))
        return adv, torch.zeros(len(rewards), dtype=torch.bool)

    def compute_token_logps(self, model, batch):
        self.calls["logps"] += 1
        ours = super().compute_token_logps(model, batch)
        theirs = naive_completion_logps(unwrap_model(model), batch, self.args.temperature)
        self.calls["logps_max_diff"] = max(self.calls["logps_max_diff"], float((ours - theirs).abs().max()))
        return theirs

    def compute_policy_loss(self, inputs):
        self.calls["loss"] += 1
        self.calls["advantages_seen"].append(inputs.advantages.clone())
        return -inputs.advantages[:, None] * inputs.logps, {}  # plain REINFORCE


class LegacySeamGRPO(GRPOTrainer):
    """A wrapper written against toolkit 0.1's seam signature (logps, old_logps, advantages, mask), which also
    calls the base implementation the 0.1 way."""

    def compute_policy_loss(self, logps, old_logps, advantages, mask):
        self.legacy_calls = getattr(self, "legacy_calls", 0) + 1
        base, info = super().compute_policy_loss(logps, old_logps, advantages, mask)
        return 0.5 * base, info


class LegacyOrder(RoundSampler):
    """A toolkit 0.1 curriculum: it overrode the then-private `_order`."""

    def _order(self):
        return [7, 6] * (self.n_rows // 2)


def test_grpo_wrapper_swaps_every_seam(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model()
    backend = RecordingBackend(model, pad_token_id=tok.pad_token_id)
    rows = [{"prompt": f"Prompt number {i}"} for i in range(8)]
    cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=6, learning_rate=1e-2, save_strategy="no", report_to="none",
                     disable_tqdm=True, importance_sampling_cap=None)
    t = WrapperGRPO(model, lambda prompts, completions, completion_ids, **kw: [0.0] * len(completions), cfg,
                    train_dataset=rows, processing_class=tok, generation_backend=backend)
    t.calls = {"sampler": 0, "advantages": 0, "logps": 0, "loss": 0, "logps_max_diff": 0.0, "advantages_seen": []}
    before = {k: v.clone() for k, v in model.named_parameters()}
    t.train()

    # sampler: the backend saw exactly the curriculum's prompts, in its order
    assert t.calls["sampler"] == 1
    expected = [t.prompt_ids[7], t.prompt_ids[6]]
    assert backend.prompts == [expected, expected]
    # advantages: the constant rewards would give zero advantages and no update; ours reached the loss
    assert t.calls["advantages"] == 2
    for adv in t.calls["advantages_seen"]:
        torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3] * 2))
    # loss and log-probs: both called per micro-step, and the naive log-probs equal toolkit's
    assert t.calls["loss"] == 2 and t.calls["logps"] >= 2
    assert t.calls["logps_max_diff"] < 1e-4
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())


def test_a_wrapper_on_the_old_policy_loss_seam_still_works_and_warns(tmp_path):
    tok = tiny_tokenizer()
    cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=4, learning_rate=1e-2, save_strategy="no", report_to="none",
                     disable_tqdm=True)
    reward = lambda prompts, completions, completion_ids, **kw: [float(sum(c) % 3) for c in completion_ids]  # noqa: E731
    with pytest.warns(ToolkitDeprecationWarning, match=r"LegacySeamGRPO.compute_policy_loss\(logps, old_logps"):
        t = LegacySeamGRPO(tiny_model(), reward, cfg, train_dataset=[{"prompt": f"P{i}"} for i in range(8)],
                           processing_class=tok)
    before = {k: v.clone() for k, v in t.model.named_parameters()}
    with pytest.warns(ToolkitDeprecationWarning, match="removed in 0.3"):  # the 0.1-style super() call
        t.train()
    assert t.legacy_calls == 1
    assert any(not torch.equal(before[k], v) for k, v in t.model.named_parameters())
    assert LegacySeamGRPO.__dict__["compute_policy_loss"].__code__.co_varnames[:5] == (
        "self", "logps", "old_logps", "advantages", "mask")  # the user's class is left as written


def test_a_curriculum_on_the_old_private_order_still_works_and_warns():
    sampler = LegacyOrder(8, 2, 1, seed=0)
    with pytest.warns(ToolkitDeprecationWarning, match=r"LegacyOrder._order\(\) is the toolkit 0.1 name"):
        assert sampler.order()[:4] == [7, 6, 7, 6]


class WrapperDPO(DPOTrainer):
    def compute_preference_loss(self, chosen_logratios, rejected_logratios, lengths):
        self.seen = getattr(self, "seen", 0) + 1
        # SLiC-style hinge on the margin, a loss toolkit does not ship
        return torch.relu(1.0 - (chosen_logratios - rejected_logratios)).mean()


class WrapperSFT(SFTTrainer):
    def compute_sft_loss(self, logps, num_items_in_batch):
        self.seen = getattr(self, "seen", 0) + 1
        return -(logps.clamp(max=-0.1)).sum() / max(logps.numel(), 1)  # a clipped NLL


def test_dpo_and_sft_wrappers_swap_the_loss(tmp_path):
    tok = tiny_tokenizer()
    pairs = [{"prompt": f"Q{i}?", "chosen": f" yes {i}", "rejected": f" no {i} no"} for i in range(8)]
    d = WrapperDPO(tiny_model(), args=DPOConfig(output_dir=str(tmp_path / "d"), max_steps=2,
                                                per_device_train_batch_size=4, save_strategy="no", report_to="none",
                                                learning_rate=1e-2, precompute_ref_log_probs=True,
                                                logging_steps=1),
                   train_dataset=pairs, processing_class=tok)
    d.train()
    assert d.seen == 2
    first = [h["loss"] for h in d.state.log_history if "loss" in h][0]
    # at step 0 the policy equals the reference: the hinge is relu(1 - 0) = 1, where sigmoid DPO gives ln 2
    assert abs(first - 1.0) < 1e-4

    s = WrapperSFT(tiny_model(), SFTConfig(output_dir=str(tmp_path / "s"), max_steps=2, per_device_train_batch_size=4,
                                           save_strategy="no", report_to="none"),
                   train_dataset=[{"prompt": f"Q{i}?", "completion": f" A{i}"} for i in range(8)], processing_class=tok)
    s.train()
    assert s.seen >= 2


def test_naive_logps_helper_is_a_real_reference():
    """The helper above must itself be right: compare with F.cross_entropy on one unpacked sequence."""
    from toolkit.core.packing import pack_completions

    model = tiny_model().eval()
    prompt, completion = [5, 9, 11], [13, 17, 19]
    batch = pack_completions([prompt], [completion], pad_token_id=0)
    got = naive_completion_logps(model, batch, 1.0)
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
    want = -F.cross_entropy(logits[2:5], torch.tensor(completion), reduction="none")
    torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------------------------------
# The two wrapper packages in tests/helpers/wrappers/ run end to end on toolkit's public seams and patch nothing.
# ----------------------------------------------------------------------------------------------------


WRAPPERS = str(HELPERS / "wrappers")

ROWS = [{"instruction": f"What is {i} + 1?", "output": str(i + 1)} for i in range(8)]
COMMON = dict(max_steps=3, learning_rate=5e-2, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
              logging_steps=1)


def toolkit_surface():
    """Every function and class attribute of every loaded toolkit module, by identity."""
    seen = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("toolkit.") or module is None:
            continue
        for attr, value in vars(module).items():
            if not callable(value):  # module state (a lazily built registry) may change; code may not
                continue
            seen[(name, attr)] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for member, v in vars(value).items():
                    if callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                        seen[(name, f"{attr}.{member}")] = id(v)
    return seen


@pytest.fixture
def unpatched():
    """The wrapper packages imported afresh after the snapshot: patches made at import time (how Unsloth patches
    TRL) would show too. Yields (unsloth_like, axolotl_like)."""
    import importlib

    before = toolkit_surface()
    for name in ("unsloth_like", "axolotl_like"):
        sys.modules.pop(name, None)
    sys.path.insert(0, WRAPPERS)
    try:
        yield importlib.import_module("unsloth_like"), importlib.import_module("axolotl_like")
    finally:
        sys.path.remove(WRAPPERS)
    after = toolkit_surface()
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    assert not changed, f"a wrapper replaced toolkit attributes: {changed[:5]}"


def lora_moved(model, before):
    moved = [k for k, v in model.named_parameters() if not torch.equal(before[k], v.detach())]
    return moved and all("lora_" in k for k in moved)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def length_reward(completion_ids, **kw):
    """Varies within every group (random completions differ in length), so every step has a signal."""
    return [float(len(ids)) + 0.01 * (sum(ids) % 7) for ids in completion_ids]


def sft_rows():
    return [{"prompt": r["instruction"] + " ", "completion": r["output"]} for r in ROWS]


def test_unsloth_like_sft_swaps_logps_and_loss_and_trains_its_own_adapters(tmp_path, unpatched):
    unsloth_like, _ = unpatched
    model, tok = unsloth_like.FastModel.from_pretrained()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    calls = dict(unsloth_like.CALLS)
    # SGD: Adam's first steps follow the sign of each gradient, so rounding-level differences between two ways
    # of computing the same log-probs would flip near-zero elements and hide what is being compared
    sgd = {**COMMON, "optim": "sgd", "learning_rate": 0.5}
    t = unsloth_like.FastSFTTrainer(model, SFTConfig(output_dir=str(tmp_path / "a"), **sgd), train_dataset=sft_rows(),
                                    processing_class=tok)
    t.train()
    assert unsloth_like.CALLS["sft_logps"] > calls["sft_logps"] and unsloth_like.CALLS["sft_loss"] > calls["sft_loss"]
    assert lora_moved(model, before)
    plain_model, _ = unsloth_like.FastModel.from_pretrained()
    plain = SFTTrainer(plain_model, SFTConfig(output_dir=str(tmp_path / "b"), **sgd), train_dataset=sft_rows(),
                       processing_class=tok)
    plain.train()
    assert losses(t) == pytest.approx(losses(plain), rel=1e-5)  # the wrapper's kernel computes the same numbers


def test_unsloth_like_grpo_replaces_the_log_prob_computation_entirely(tmp_path, unpatched):
    unsloth_like, _ = unpatched
    model, tok = unsloth_like.FastModel.from_pretrained()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    calls = dict(unsloth_like.CALLS)
    cfg = GRPOConfig(output_dir=str(tmp_path / "g"), per_device_train_batch_size=4, num_generations=2,
                     max_completion_length=6, beta=0.05, **COMMON)
    prompts = [{"prompt": [{"role": "user", "content": r["instruction"]}]} for r in ROWS]
    t = unsloth_like.FastGRPOTrainer(model, [length_reward], cfg, train_dataset=prompts, processing_class=tok)
    t.train()
    assert unsloth_like.CALLS["grpo_logps"] > calls["grpo_logps"] and unsloth_like.CALLS["grpo_loss"] > calls["grpo_loss"]
    assert t.state.global_step == 3 and all(x == x for x in losses(t))
    assert any(h.get("frac_rows_in_loss", 0) > 0 for h in t.state.log_history)  # there was a learning signal
    assert lora_moved(model, before)


def test_axolotl_like_sft_from_yaml_with_its_own_tokens_and_collator(tmp_path, unpatched):
    _, axolotl_like = unpatched
    config = """
base_model: {seed: 0}
datasets:
  - {path: inline, type: alpaca, prompt_template: "### Instruction: {instruction}\\n### Response: "}
training: {max_steps: 4, micro_batch_size: 4, optimizer: {name: adamw, lr: 0.05}}
rl: null
"""
    batches = axolotl_like.COLLATED["batches"]
    t = axolotl_like.build_trainer(config, ROWS, str(tmp_path / "x"))
    assert t.dataset_format.kind == "tokenized" and isinstance(t.data_collator, axolotl_like.WrapperCollator)
    t.train()
    assert axolotl_like.COLLATED["batches"] > batches
    ls = losses(t)
    assert len(ls) == 4 and ls[-1] < ls[0]


def test_axolotl_like_grpo_from_yaml(tmp_path, unpatched):
    _, axolotl_like = unpatched
    config = """
base_model: {seed: 1}
datasets:
  - {path: inline, type: plain, prompt_template: "{instruction} Answer: "}
training: {max_steps: 2, micro_batch_size: 4, optimizer: {name: adamw, lr: 0.01}}
rl: {rewards: ["format:\\\\d+"], num_generations: 2, max_new_tokens: 4}
"""
    t = axolotl_like.build_trainer(config, ROWS, str(tmp_path / "y"))
    assert isinstance(t, GRPOTrainer)
    t.train()
    assert t.state.global_step == 2
