"""toolkit.experimental.kto: KTO from unpaired feedback. Loss, gradients and metrics equal TRL's KTOTrainer on a
fixed batch (TRL's own collator and loss on our token ids); the loss formula against a naive loop; learning;
exact resume; paired data unpaired; errors named before any model loads."""

import os

import pytest
import torch
from builders import StopAt

from toolkit.core.errors import ConfigError, DataError
from toolkit.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
from toolkit.experimental.kto import KTOConfig, KTOTrainer, _KTOCollator, kto_losses  # noqa: E402

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def unpaired(n=16):
    return [{"prompt": [U(f"What is {i} + 1?")],
             "completion": [A(str(i + 1) if i % 3 else f"{i + 3} maybe " * (1 + i % 2))], "label": bool(i % 3)}
            for i in range(n)]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")
    base.update(kw)
    return KTOConfig(**base)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def test_kto_losses_match_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(7, generator=g, dtype=torch.float64)
    labels = torch.tensor([True, False, True, True, False, False, True])
    z = torch.tensor(0.3, dtype=torch.float64)
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    for loss_type in ("kto", "apo_zero_unpaired"):
        out = kto_losses(r, labels, z, beta=0.5, desirable_weight=1.5, undesirable_weight=0.7, loss_type=loss_type)
        expected = []
        for want in (True, False):
            for ri, li in zip(r, labels):
                if bool(li) != want:
                    continue
                if loss_type == "kto":
                    v = 1 - sig(0.5 * (ri - z)) if want else 1 - sig(0.5 * (z - ri))
                else:
                    v = 1 - sig(0.5 * ri) if want else sig(0.5 * ri)
                expected.append((1.5 if want else 0.7) * float(v))
        torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


def test_a_few_steps_learn_and_log_kto_metrics(tmp_path):
    t = KTOTrainer(tiny_model(), args=cfg(tmp_path, max_steps=8, beta=0.5), train_dataset=unpaired(),
                   processing_class=tiny_tokenizer())
    assert t.ref_model is not None
    t.train()
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        assert logged(t, key), key
    # desirable completions move up against the reference, undesirable ones down
    assert logged(t, "rewards/margins")[-1] > logged(t, "rewards/margins")[0]
    assert logged(t, "loss")[-1] < logged(t, "loss")[0]


def sharp_reference():
    """A reference whose output distribution is sharper than the tiny policy's: on completions neither model
    prefers it gives lower log-probs, so KTO's KL estimate is clearly positive (a negative one is clamped to 0
    and would hide the KL term from the comparison)."""
    ref = tiny_model(seed=7)
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(6.0)
    return ref


@pytest.mark.parametrize("loss_type, beta, weights", [("kto", 0.1, (1.0, 1.0)), ("kto", 0.5, (1.3, 0.8)),
                                                      ("apo_zero_unpaired", 0.3, (1.0, 1.0))])
def test_loss_gradients_and_metrics_equal_trl(tmp_path, loss_type, beta, weights):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = tiny_tokenizer()
    rows = unpaired(4)
    ours = KTOTrainer(tiny_model(), ref_model=sharp_reference(),
                      args=cfg(tmp_path / "ours", loss_type=loss_type, beta=beta, desirable_weight=weights[0],
                               undesirable_weight=weights[1]),
                      train_dataset=rows, processing_class=tok)
    examples = [ours.train_dataset[i] for i in range(4)]
    batch = _KTOCollator()(examples)
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, batch)

    tiny_model().save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    theirs = trl.KTOTrainer(
        model=str(tmp_path / "policy"), ref_model=sharp_reference(), processing_class=tok,
        args=trl.KTOConfig(output_dir=str(tmp_path / "trl"), loss_type=loss_type, beta=beta,
                           desirable_weight=weights[0], undesirable_weight=weights[1], per_device_train_batch_size=4,
                           use_cpu=True, bf16=False, report_to="none", model_init_kwargs={"dtype": torch.float32}),
        train_dataset=Dataset.from_list(rows))
    theirs.model.train()
    # TRL's collator and loss on our token ids, with our mismatched (KL) completions
    trl_examples = [{"prompt_ids": list(e["prompt_ids"]), "completion_ids": list(e["completion_ids"]),
                     "KL_completion_ids": kl, "label": e["label"]} for e, kl in zip(examples, batch["rejected_ids"])]
    trl_batch = theirs.data_collator(trl_examples)
    # the token ids agree with TRL's own tokenization of the same rows
    trl_rows = [theirs.train_dataset[i] for i in range(4)]
    assert [r["prompt_ids"] for r in trl_rows] == [e["prompt_ids"] for e in examples]
    assert [r["completion_ids"] for r in trl_rows] == [e["completion_ids"] for e in examples]
    if loss_type == "kto":
        assert [r["KL_completion_ids"] for r in trl_rows] == batch["rejected_ids"]  # TRL's rotation by one
    trl_loss = theirs.compute_loss(theirs.model, trl_batch)
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-5, rel=1e-5)
    if loss_type == "kto":
        assert ours.recorded_metrics()["kl"][-1] > 0.1  # the KL term is in play, not clamped away
        assert ours.recorded_metrics()["kl"][-1] == pytest.approx(theirs._metrics["train"]["kl"][-1], abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert ours.recorded_metrics()[key][-1] == pytest.approx(theirs._metrics["train"][key][-1], abs=1e-4), key
    trl_loss.backward()
    our_loss.backward()
    for (k, p), (_, q) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_paired_preference_data_is_unpaired(tmp_path):
    pairs = [{"prompt": [U(f"What is {i} + 1?")], "chosen": [A(str(i + 1))], "rejected": [A("no idea")]}
             for i in range(4)]
    t = KTOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=pairs, processing_class=tiny_tokenizer())
    # TRL's order: every chosen answer, then every rejected one, so in-order neighbours (an eval batch's KL
    # pairs) never share a prompt
    assert len(t.train_dataset) == 8 and [t.train_dataset[i]["label"] for i in range(8)] == [True] * 4 + [False] * 4
    batch = _KTOCollator()([t.train_dataset[i] for i in range(8)])
    assert all(p != q for p, q in zip(batch["prompt_ids"], batch["prompt_ids"][-1:] + batch["prompt_ids"][:-1]))


@pytest.mark.slow
def test_exact_resume_equals_uninterrupted(tmp_path):
    full = KTOTrainer(tiny_model(), args=cfg(tmp_path / "a", max_steps=4), train_dataset=unpaired(),
                      processing_class=tiny_tokenizer())
    full.train()
    first = KTOTrainer(tiny_model(), args=cfg(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2),
                       train_dataset=unpaired(), processing_class=tiny_tokenizer(), callbacks=[StopAt(2)])
    first.train()
    resumed = KTOTrainer(tiny_model(), args=cfg(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2),
                         train_dataset=unpaired(), processing_class=tiny_tokenizer())
    resumed.train(resume_from_checkpoint=True)
    assert logged(resumed, "loss") == pytest.approx(logged(full, "loss"), abs=1e-6)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(w, v, rtol=0, atol=1e-6, msg=k)


def test_errors_name_the_field_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="loss_type: KTO takes one of"):
        cfg(tmp_path, loss_type="sigmoid")
    with pytest.raises(ConfigError, match="per_device_train_batch_size: KTO's KL reference point"):
        cfg(tmp_path, per_device_train_batch_size=1)
    with pytest.raises(ConfigError, match="undesirable_weight: must be > 0"):
        cfg(tmp_path, undesirable_weight=0)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs"):
        cfg(tmp_path, precompute_ref_log_probs=True)
    with pytest.raises(ConfigError, match="reference_free: KTO's rewards"):
        cfg(tmp_path, reference_free=True)
    with pytest.raises(ConfigError, match="label_smoothing: KTO has its own loss"):
        cfg(tmp_path, label_smoothing=0.1)
    with pytest.raises(ConfigError, match="per_device_eval_batch_size: KTO's KL"):
        cfg(tmp_path, per_device_eval_batch_size=1)
    assert cfg(tmp_path, loss_type="apo_zero_unpaired").loss_type == "apo_zero_unpaired"  # the card shows it
    # a model name that cannot load proves these fail before loading it
    bad_label = unpaired(4)
    bad_label[2]["label"] = "yes"
    with pytest.raises(DataError, match=r"column 'label' must be True/False in row 2"):
        KTOTrainer("no-such/model", args=cfg(tmp_path), train_dataset=bad_label, processing_class=tiny_tokenizer())
    with pytest.raises(DataError, match="KTO needs unpaired feedback"):
        KTOTrainer("no-such/model", args=cfg(tmp_path), train_dataset=[{"prompt": "a", "completion": "b"}] * 4,
                   processing_class=tiny_tokenizer())
    with pytest.raises(DataError, match="without a 'prompt' column"):
        KTOTrainer("no-such/model", args=cfg(tmp_path), train_dataset=[{"chosen": "a", "rejected": "b"}] * 4,
                   processing_class=tiny_tokenizer())


def test_one_label_data_is_named_in_a_warning(tmp_path, caplog):
    """Every row desirable (or every row undesirable) trained without a word; KTO learns from the two together."""
    import logging

    rows = [dict(r, label=True) for r in unpaired()]
    with caplog.at_level(logging.WARNING, logger="toolkit.experimental.kto"):
        KTOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer())
    assert "KTO train data: every one of its 16 rows has label=True (desirable)" in caplog.text
    assert "Add rows with label=False" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="toolkit.experimental.kto"):
        KTOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=unpaired(), processing_class=tiny_tokenizer())
    assert "every one of its" not in caplog.text  # mixed labels: no warning
