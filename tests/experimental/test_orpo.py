"""toolkit.experimental.orpo: ORPO. Loss, gradients and metrics equal TRL's ORPOTrainer on a fixed batch (TRL's
own forward and loss on our token ids); the odds-ratio formula against a direct computation; no reference
model; learning; exact resume; config errors."""

import math
import os

import pytest
import torch
from builders import StopAt

from toolkit.core.errors import ConfigError
from toolkit.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
from test_cpo import pairs, trl_cpo_batch  # noqa: E402  (the same rows and TRL batch layout as CPO's tests)

from toolkit.experimental.orpo import ORPOConfig, ORPOTrainer, log1mexp, odds_ratio_terms  # noqa: E402


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")
    base.update(kw)
    return ORPOConfig(**base)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def test_odds_ratio_terms_match_the_definition():
    for lp in (-1e-6, -0.3, -0.69, -0.7, -5.0, -40.0):
        assert log1mexp(torch.tensor(lp, dtype=torch.float64)).item() == pytest.approx(math.log(1 - math.exp(lp)),
                                                                                      rel=1e-9)
    c, r = torch.tensor([-0.2, -3.0, -1.0]), torch.tensor([-1.5, -0.1, -1.0])
    ratio, log_odds = odds_ratio_terms(c, r)
    for i in range(3):
        pc, pr = math.exp(c[i]), math.exp(r[i])
        lo = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
        assert log_odds[i].item() == pytest.approx(lo, rel=1e-5, abs=1e-6)
        assert ratio[i].item() == pytest.approx(math.log(1 / (1 + math.exp(-lo))), rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_no_reference_and_a_few_steps_learn(tmp_path):
    t = ORPOTrainer(tiny_model(), cfg(tmp_path, max_steps=8, beta=0.5), train_dataset=pairs(),
                    processing_class=tiny_tokenizer())
    assert t.ref_model is None
    t.train()
    assert logged(t, "loss")[-1] < logged(t, "loss")[0]
    assert logged(t, "nll_loss")[-1] < logged(t, "nll_loss")[0]
    assert logged(t, "log_odds_chosen")[-1] > logged(t, "log_odds_chosen")[0]


@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_loss_gradients_and_metrics_equal_trl(tmp_path, beta):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.orpo import ORPOConfig as TRLConfig
    from trl.experimental.orpo import ORPOTrainer as TRLTrainer

    tok = tiny_tokenizer()
    rows = pairs(4)
    ours = ORPOTrainer(tiny_model(), cfg(tmp_path, beta=beta), train_dataset=rows, processing_class=tok)
    examples = [ours.train_dataset[i] for i in range(4)]
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, ours.data_collator(examples))
    our_metrics = {k: v[-1] for k, v in ours.recorded_metrics().items()}

    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = TRLTrainer(model=AutoModelForCausalLM.from_pretrained(tmp_path / "tiny"), processing_class=tok,
                        args=TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                                       beta=beta),
                        train_dataset=Dataset.from_list(rows))
    theirs.model.train()
    trl_loss, trl_metrics = theirs.get_batch_loss_metrics(theirs.model, trl_cpo_batch(examples, tok.pad_token_id))
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"):
        assert our_metrics[key] == pytest.approx(float(trl_metrics[key]), rel=1e-5, abs=1e-5), key
    our_loss.backward()
    trl_loss.backward()
    ours_params = dict(ours.model.named_parameters())
    for name, p in theirs.model.named_parameters():
        assert ours_params[name].grad is not None and p.grad is not None, name
        torch.testing.assert_close(ours_params[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_exact_resume_equals_uninterrupted(tmp_path):
    kw = dict(max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2)
    straight = ORPOTrainer(tiny_model(), cfg(tmp_path / "a", **kw), train_dataset=pairs(),
                           processing_class=tiny_tokenizer())
    straight.train()
    first = ORPOTrainer(tiny_model(), cfg(tmp_path / "b", **kw), train_dataset=pairs(),
                        processing_class=tiny_tokenizer(), callbacks=[StopAt(2)])
    first.train()
    second = ORPOTrainer(tiny_model(seed=123), cfg(tmp_path / "b", **kw), train_dataset=pairs(),
                         processing_class=tiny_tokenizer())
    second.train(resume_from_checkpoint=True)
    assert logged(first, "loss") + logged(second, "loss")[2:] == pytest.approx(logged(straight, "loss"), rel=1e-6)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="loss_type: ORPO has one loss"):
        cfg(tmp_path, loss_type="ipo")
    with pytest.raises(ConfigError, match="beta: must be > 0"):
        cfg(tmp_path, beta=0.0)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs: ORPO has no reference model"):
        cfg(tmp_path, precompute_ref_log_probs=True)
    with pytest.raises(ConfigError, match="loss_weights: ORPO has its own loss"):
        cfg(tmp_path, loss_weights=[1.0])
    assert cfg(tmp_path).loss_type == "orpo"
