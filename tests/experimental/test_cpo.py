"""toolkit.experimental.cpo: CPO and SimPO. Loss, gradients and metrics equal TRL's CPOTrainer on a fixed batch;
no reference model; learning; exact resume; config errors."""

import os

import pytest
import torch
from builders import StopAt

from toolkit.core.errors import ConfigError
from toolkit.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
from toolkit.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def pairs(n=16):
    return [{"prompt": [U(f"What is {i} + 1?")], "chosen": [A(str(i + 1))],
             "rejected": [A(f"{i + 3} maybe " * (1 + i % 3))]} for i in range(n)]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")
    base.update(kw)
    return CPOConfig(**base)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def trl_cpo_batch(examples, pad_token_id):
    """Our tokenized pairs in TRL CPOTrainer's batch layout: prompt + answer right-padded, labels -100 on the
    prompt and the padding."""
    out = {}
    for side in ("chosen", "rejected"):
        seqs = [(list(e["prompt_ids"]), list(e[f"{side}_ids"])) for e in examples]
        T = max(len(p) + len(c) for p, c in seqs)
        ids = torch.full((len(seqs), T), pad_token_id)
        mask = torch.zeros((len(seqs), T), dtype=torch.long)
        labels = torch.full((len(seqs), T), -100)
        for i, (p, c) in enumerate(seqs):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            mask[i, :len(p) + len(c)] = 1
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        out.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels})
    return out


def test_no_reference_model_is_held_and_a_few_steps_learn(tmp_path):
    t = CPOTrainer(tiny_model(), cfg(tmp_path, max_steps=8, loss_type="simpo", cpo_alpha=0.0, beta=2.0),
                   train_dataset=pairs(), processing_class=tiny_tokenizer())
    assert t.ref_model is None and t.args.reference_free
    before = {k: v.clone() for k, v in t.model.named_parameters()}
    t.train()
    assert logged(t, "loss")[-1] < logged(t, "loss")[0]
    assert any(not torch.equal(v, before[k]) for k, v in t.model.named_parameters())


trl = pytest.importorskip("trl")


@pytest.mark.parametrize("loss_type, cpo_alpha, beta, label_smoothing", [
    ("sigmoid", 1.0, 0.1, 0.0), ("sigmoid", 1.0, 0.3, 0.1), ("hinge", 0.5, 0.2, 0.0), ("ipo", 1.0, 0.5, 0.0),
    ("simpo", 0.0, 2.0, 0.0), ("simpo", 1.0, 2.0, 0.1),
])
def test_loss_gradients_and_metrics_equal_trl(tmp_path, loss_type, cpo_alpha, beta, label_smoothing):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.cpo import CPOConfig as TRLConfig
    from trl.experimental.cpo import CPOTrainer as TRLTrainer

    tok = tiny_tokenizer()
    rows = pairs(4)
    settings = dict(loss_type=loss_type, cpo_alpha=cpo_alpha, beta=beta, label_smoothing=label_smoothing,
                    simpo_gamma=0.7)
    ours = CPOTrainer(tiny_model(), cfg(tmp_path, **settings), train_dataset=rows, processing_class=tok)
    examples = [ours.train_dataset[i] for i in range(4)]
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, ours.data_collator(examples))
    our_metrics = {k: v[-1] for k, v in ours.recorded_metrics().items()}

    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = TRLTrainer(model=AutoModelForCausalLM.from_pretrained(tmp_path / "tiny"), processing_class=tok,
                        args=TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                                       **settings),
                        train_dataset=Dataset.from_list(rows))
    theirs.model.train()
    trl_loss, trl_metrics = theirs.get_batch_loss_metrics(theirs.model, trl_cpo_batch(examples, tok.pad_token_id))
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    keys = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"]
    # TRL logs nll_loss 0 when cpo_alpha is 0 (it skips computing it); ours logs the chosen answers' NLL always
    keys += ["nll_loss"] if cpo_alpha > 0 else []
    for key in keys:
        assert our_metrics[key] == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-5), key
    our_loss.backward()
    trl_loss.backward()
    ours_params = dict(ours.model.named_parameters())
    for name, p in theirs.model.named_parameters():
        assert ours_params[name].grad is not None and p.grad is not None, name
        torch.testing.assert_close(ours_params[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_exact_resume_equals_uninterrupted(tmp_path):
    kw = dict(max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2, loss_type="simpo")
    straight = CPOTrainer(tiny_model(), cfg(tmp_path / "a", **kw), train_dataset=pairs(), processing_class=tiny_tokenizer())
    straight.train()
    first = CPOTrainer(tiny_model(), cfg(tmp_path / "b", **kw), train_dataset=pairs(), processing_class=tiny_tokenizer(),
                       callbacks=[StopAt(2)])
    first.train()
    second = CPOTrainer(tiny_model(seed=123), cfg(tmp_path / "b", **kw), train_dataset=pairs(),
                        processing_class=tiny_tokenizer())
    second.train(resume_from_checkpoint=True)
    assert logged(first, "loss") + logged(second, "loss")[2:] == pytest.approx(logged(straight, "loss"), rel=1e-6)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="loss_type: CPO takes one of"):
        cfg(tmp_path, loss_type="robust")
    with pytest.raises(ConfigError, match="cpo_alpha: must be >= 0"):
        cfg(tmp_path, cpo_alpha=-1.0)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs: CPO has no reference model"):
        cfg(tmp_path, precompute_ref_log_probs=True)
