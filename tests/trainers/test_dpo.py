"""DPOTrainer: TRL parity on a fixed batch, reference modes, invariances, resume, bad input."""

import logging
import math

import pytest
import torch
from builders import StopAt

from toolkit import ConfigError, DataError
from toolkit.core.dpo import DPOConfig, DPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer, trl_dpo_inputs

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def conv_rows(n=16):
    return [{"prompt": [U(f"What is {i} + 1?")], "chosen": [A(str(i + 1))], "rejected": [A(f"{i + 3} maybe not")]}
            for i in range(n)]


def implicit_rows(n=8):
    return [{"chosen": [U(f"What is {i} + 1?"), A(str(i + 1))], "rejected": [U(f"What is {i} + 1?"), A("no idea")]}
            for i in range(n)]


def plain_rows(n=8):
    return [{"prompt": f"What is {i} + 1? ", "chosen": str(i + 1), "rejected": "The quick brown fox"} for i in range(n)]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")
    base.update(kw)
    return DPOConfig(**base)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


@pytest.mark.parametrize("rows", [conv_rows(8), implicit_rows(8), plain_rows(8)], ids=["explicit", "implicit", "plain"])
def test_trains_on_every_preference_format(tmp_path, rows):
    t = DPOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer())
    before = {k: v.clone() for k, v in t.model.named_parameters()}
    t.train()
    assert logged(t, "loss")[0] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference at step 0
    assert logged(t, "rewards/margins")[-1] > 0
    assert any(not torch.equal(v, before[k]) for k, v in t.model.named_parameters())


def test_precomputed_reference_equals_live_reference_and_frees_it(tmp_path):
    live = DPOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=conv_rows(), processing_class=tiny_tokenizer())
    live.train()
    pre = DPOTrainer(tiny_model(), args=cfg(tmp_path, precompute_ref_log_probs=True), train_dataset=conv_rows(),
                     processing_class=tiny_tokenizer())
    assert pre.ref_model is None
    pre.train()
    assert logged(pre, "loss") == pytest.approx(logged(live, "loss"), rel=1e-5)


def test_peft_reference_is_the_adapter_free_base(tmp_path):
    from peft import LoraConfig

    t = DPOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=conv_rows(), processing_class=tiny_tokenizer(),
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert t.ref_model is None
    t.train()
    assert logged(t, "loss")[0] == pytest.approx(math.log(2), abs=1e-5)
    assert logged(t, "rewards/margins")[-1] != 0


def test_reference_free(tmp_path):
    t = DPOTrainer(tiny_model(), args=cfg(tmp_path, reference_free=True), train_dataset=conv_rows(),
                   processing_class=tiny_tokenizer())
    assert t.ref_model is None
    t.train()
    assert logged(t, "loss")[0] != pytest.approx(math.log(2), abs=1e-3)


def test_batch_8x1_equals_4x2(tmp_path):
    models = []
    for bs, ga in ((8, 1), (4, 2)):
        m = tiny_model()
        DPOTrainer(m, args=cfg(tmp_path, max_steps=1, per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                               optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                               weight_decay=0.0, reference_free=True),
                   train_dataset=conv_rows(8), processing_class=tiny_tokenizer()).train()
        models.append(m)
    for (k, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("layout", ["padded", "separate"])
def test_every_packed_layout_gives_the_shared_prompt_numbers(tmp_path, layout):
    """padded (attention that cannot pack), separate (flash-attention's layout, run here through toolkit_varlen)
    and shared_prompt compute the same sequence log-probs."""
    a = DPOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=conv_rows(), processing_class=tiny_tokenizer())
    b = DPOTrainer(tiny_model(), args=cfg(tmp_path), train_dataset=conv_rows(), processing_class=tiny_tokenizer())
    assert a.packed_layout == "shared_prompt"
    b.packed_layout = layout
    if layout == "padded":
        b.padding_free = False
    batch = a.data_collator([a.train_dataset[i] for i in range(4)])
    ca, ra, _ = a.compute_sequence_logps(a.model, batch)
    cb, rb, _ = b.compute_sequence_logps(b.model, batch)
    torch.testing.assert_close(ca, cb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ra, rb, rtol=1e-5, atol=1e-5)


def test_exact_resume(tmp_path):
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=2)
    straight = DPOTrainer(tiny_model(), args=cfg(tmp_path / "a", **kw), train_dataset=conv_rows(),
                          processing_class=tiny_tokenizer())
    straight.train()
    first = DPOTrainer(tiny_model(), args=cfg(tmp_path / "b", **kw), train_dataset=conv_rows(),
                       processing_class=tiny_tokenizer(), callbacks=[StopAt(2)])
    first.train()
    # the same starting model (it is also the reference); the checkpoint restores the trained policy
    second = DPOTrainer(tiny_model(), args=cfg(tmp_path / "b", **kw), train_dataset=conv_rows(),
                        processing_class=tiny_tokenizer())
    second.train(resume_from_checkpoint=True)
    assert logged(second, "loss")[2:] == pytest.approx(logged(straight, "loss")[2:], rel=1e-5)


def test_bad_preference_input(tmp_path, caplog):
    tok = tiny_tokenizer()
    with pytest.raises(DataError, match="column 'chosen' is an empty string in row 1"):
        DPOTrainer("no-such/model", args=cfg(tmp_path), processing_class=tok,
                   train_dataset=[{"prompt": "a", "chosen": "b", "rejected": "c"},
                                  {"prompt": "a", "chosen": "", "rejected": "c"}])
    with pytest.raises(DataError, match="have 'chosen' but not 'rejected'"):
        DPOTrainer("no-such/model", args=cfg(tmp_path), processing_class=tok,
                   train_dataset=[{"prompt": "a", "chosen": "b"}])
    with pytest.raises(DataError, match="row 0: 'chosen' and 'rejected' have different prompts"):
        DPOTrainer("no-such/model", args=cfg(tmp_path), processing_class=tok,
                   train_dataset=[{"chosen": [U("What is 1+1?"), A("2")], "rejected": [U("What is 2+2?"), A("5")]}])
    with caplog.at_level(logging.WARNING, logger="toolkit.core.dpo"):
        DPOTrainer(tiny_model(), args=cfg(tmp_path), processing_class=tok,
                   train_dataset=conv_rows(4) + [{"prompt": [U("x")], "chosen": [A("same")], "rejected": [A("same")]}])
    assert any("1 of 5 train rows have chosen == rejected (rows 4)" in r.getMessage() for r in caplog.records)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="loss_type: 'kto' is not a registered preference loss"):
        cfg(tmp_path, loss_type="kto")
    with pytest.raises(ConfigError, match="loss_weights: 1 weights for 2 loss types"):
        cfg(tmp_path, loss_type=["sigmoid", "ipo"], loss_weights=[1.0])
    with pytest.raises(ConfigError, match="label_smoothing: robust DPO"):
        cfg(tmp_path, loss_type="robust", label_smoothing=0.5)


def test_sft_term_is_the_chosen_nll_per_token(tmp_path):
    """["sigmoid", "sft"] adds the chosen answers' NLL, averaged over all their tokens, to the DPO loss."""
    tok = tiny_tokenizer()
    both = DPOTrainer(tiny_model(), args=cfg(tmp_path / "a", loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
                      train_dataset=conv_rows(4), processing_class=tok)
    batch = both.data_collator([both.train_dataset[i] for i in range(4)])
    both.model.train()
    total = both.compute_loss(both.model, batch)
    chosen, _, lengths = both.compute_sequence_logps(both.model, batch)
    nll = -chosen.sum() / lengths.chunk(2)[0].sum()
    only = DPOTrainer(tiny_model(), args=cfg(tmp_path / "b"), train_dataset=conv_rows(4), processing_class=tok)
    only.model.train()
    assert total.item() == pytest.approx(only.compute_loss(only.model, batch).item() + 0.5 * nll.item(), rel=1e-5)


# ------------------------------------------------------------------------------------ parity with TRL

trl = pytest.importorskip("trl")


# TRL 1.16's "sigmoid" ignores label_smoothing; ours applies conservative DPO (cDPO) when it is set, so
# parity is checked at label_smoothing=0 for sigmoid (and at 0.1 for robust, where both smooth).
@pytest.mark.parametrize("loss_type, label_smoothing", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0),
                                                        ("robust", 0.1), (["sigmoid", "sft"], 0.0)])
def test_loss_and_metrics_equal_trl(tmp_path, loss_type, label_smoothing):
    from datasets import Dataset

    tok = tiny_tokenizer()
    rows = conv_rows(4)
    ours = DPOTrainer(tiny_model(), args=cfg(tmp_path, loss_type=loss_type, label_smoothing=label_smoothing, beta=0.3),
                      train_dataset=rows, processing_class=tok)
    examples = [ours.train_dataset[i] for i in range(4)]
    g = torch.Generator().manual_seed(0)
    ref_c, ref_r = -torch.rand(4, generator=g) * 20 - 5, -torch.rand(4, generator=g) * 20 - 5
    batch = ours.data_collator(examples)
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_c, ref_r
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, batch)
    our_metrics = {k: v[-1] for k, v in ours.recorded_metrics().items()}

    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = trl.DPOTrainer(model=str(tmp_path / "tiny"), processing_class=tok,
                            args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3,
                                               loss_type=loss_type if isinstance(loss_type, list) else [loss_type],
                                               label_smoothing=label_smoothing, use_cpu=True, bf16=False,
                                               report_to="none", model_init_kwargs={"dtype": torch.float32}),
                            train_dataset=Dataset.from_list(rows))
    theirs.precompute_ref_logps = True
    theirs.model.train()
    inputs = {**trl_dpo_inputs(examples, tok.pad_token_id), "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    trl_loss = theirs._compute_loss(theirs.model, inputs, return_outputs=False)
    if isinstance(trl_loss, tuple):
        trl_loss = trl_loss[0]
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert our_metrics[key] == pytest.approx(theirs._metrics["train"][key][-1], rel=1e-5, abs=1e-5), key


def test_flat_margins_are_reported(tmp_path, caplog):
    t = DPOTrainer(tiny_model(), args=cfg(tmp_path, learning_rate=0.0, max_steps=4, flat_warn_steps=2),
                   train_dataset=conv_rows(), processing_class=tiny_tokenizer())
    with caplog.at_level(logging.WARNING, logger="toolkit.core.dpo"):
        t.train()
    assert any("reward margins stayed at ~0" in r.getMessage() for r in caplog.records)


def test_pre_tokenized_pairs_train_like_the_same_text(tmp_path):
    """TRL's pre-tokenized columns (prompt_input_ids, chosen_input_ids, rejected_input_ids) are trained on as
    given: the ids our own tokenization produced for text rows give the same losses."""
    tok = tiny_tokenizer()
    text = DPOTrainer(tiny_model(), args=cfg(tmp_path / "a"), train_dataset=conv_rows(8), processing_class=tok)
    ids = [{"prompt_input_ids": e["prompt_ids"], "chosen_input_ids": e["chosen_ids"],
            "rejected_input_ids": e["rejected_ids"], "source": "wrapper"} for e in text.train_dataset]
    given = DPOTrainer(tiny_model(), args=cfg(tmp_path / "b"), train_dataset=ids, processing_class=tok)
    assert [(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in given.train_dataset] == \
        [(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in text.train_dataset]
    # TRL's current names read the same
    current = [{"prompt_ids": r["prompt_input_ids"], "chosen_ids": r["chosen_input_ids"],
                "rejected_ids": r["rejected_input_ids"]} for r in ids]
    again = DPOTrainer(tiny_model(), args=cfg(tmp_path / "c"), train_dataset=current, processing_class=tok)
    assert [e["chosen_ids"] for e in again.train_dataset] == [e["chosen_ids"] for e in given.train_dataset]
    text.train()
    given.train()
    assert logged(given, "loss") == pytest.approx(logged(text, "loss"), rel=1e-6)


@pytest.mark.parametrize("row,words", [
    ({"prompt_input_ids": [1, 2], "chosen_input_ids": [3, 99999], "rejected_input_ids": [4]},
     ["'chosen_input_ids', row 0", "99999", "vocabulary"]),
    ({"prompt_input_ids": [], "chosen_input_ids": [3], "rejected_input_ids": [4]},
     ["'prompt_input_ids' must hold a non-empty list", "row 0"]),
    ({"prompt_input_ids": [1], "chosen_input_ids": [3]}, ["need ['chosen_input_ids', 'rejected_input_ids']",
                                                          "have only ['prompt_input_ids', 'chosen_input_ids']"]),
    ({"chosen_ids": [3, 4], "rejected_ids": [4, 5]}, ["row 0: no prompt ids", "'prompt_ids'"]),
])
def test_bad_pre_tokenized_pairs_are_named(tmp_path, row, words):
    with pytest.raises(DataError) as e:
        DPOTrainer("no-such/model", args=cfg(tmp_path), train_dataset=[row], processing_class=tiny_tokenizer())
    for w in words:
        assert w in str(e.value), str(e.value)


def test_pre_tokenized_rows_elsewhere_get_a_pointer_to_the_trainer_that_reads_them():
    from toolkit.core.data import prompt_rows

    with pytest.raises(DataError, match="the RL trainers need each prompt as text"):
        prompt_rows([{"prompt_input_ids": [1, 2]}], tiny_tokenizer(), trainer="GRPO")
    with pytest.raises(DataError, match="Pre-tokenized 'input_ids' rows are read by SFTTrainer"):
        DPOTrainer("no-such/model", args=DPOConfig(output_dir="unused", report_to="none"),
                   train_dataset=[{"input_ids": [1, 2]}], processing_class=tiny_tokenizer())


def test_a_collator_of_your_own_is_refused_with_what_to_do_instead(tmp_path):
    with pytest.raises(ConfigError, match="data_collator: DPOTrainer forms its own batches.*pre-tokenized pairs"):
        DPOTrainer("no-such/model", args=cfg(tmp_path), train_dataset=plain_rows(2), processing_class=tiny_tokenizer(),
                   data_collator=lambda f: f)


def test_id_columns_next_to_a_prompt_are_extras_not_a_pre_tokenized_format():
    from toolkit.core.data import detect_format, prompt_rows

    rows, fmt = prompt_rows([{"prompt": "What is 1 + 1?", "chosen_ids": [1, 2], "rejected_ids": [3]}] * 2,
                            tiny_tokenizer(), trainer="GRPO")
    assert fmt.kind == "prompt_only" and "chosen_ids" in fmt.extra_columns
    assert detect_format([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}]).kind == "tokenized_preference"
