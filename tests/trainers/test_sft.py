"""SFTTrainer on tiny models: learning, invariances (8x1 == 4x2, packed == padded), resume, PEFT, errors."""

import json
import math
from pathlib import Path

import pytest
import torch
from builders import StopAt, conv_pc, messages_rows, plain_pc, text_rows

from toolkit import ConfigError, DataError, SFTConfig, SFTTrainer, TrainingHealthError
from toolkit.core.checkpoint import COMPLETE_MARKER
from toolkit.testing import tiny_model, tiny_tokenizer


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                learning_rate=1e-3, save_strategy="no", seed=0, report_to="none", disable_tqdm=True)
    base.update(kw)
    return SFTConfig(**base)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_a_few_steps_change_the_parameters_and_lower_the_loss(tmp_path):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.named_parameters()}
    t = SFTTrainer(model, cfg(tmp_path, max_steps=12), train_dataset=conv_pc(8), processing_class=tiny_tokenizer())
    t.train()
    ls = losses(t)
    assert all(math.isfinite(x) for x in ls)
    assert ls[-1] < ls[0]
    changed = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)


@pytest.mark.parametrize("rows", [conv_pc(8), plain_pc(8), messages_rows(8), text_rows(8)],
                         ids=["conv-prompt-completion", "plain-prompt-completion", "messages", "text"])
def test_every_sft_format_trains(tmp_path, rows):
    t = SFTTrainer(tiny_model(), cfg(tmp_path, max_steps=2), train_dataset=rows, processing_class=tiny_tokenizer())
    t.train()
    assert all(math.isfinite(x) for x in losses(t))


def _batch_logps_and_grads(trainer, examples):
    model = trainer.model
    model.zero_grad()
    batch = trainer.data_collator(examples)
    logps, targets = trainer.compute_token_logps(model, batch)
    (-logps.sum()).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return logps.detach(), targets, grads


def test_padded_equals_padding_free_equals_packed(tmp_path):
    """Same data, three layouts: identical per-token log-probs and gradients (no cross-example attention)."""
    rows = conv_pc(6) + text_rows(0)
    results = {}
    for name, kw in {"padded": {"padding_free": False}, "padding_free": {"padding_free": True}, "packed": {"packing": True,
                                                                                      "max_length": 512}}.items():
        t = SFTTrainer(tiny_model(), cfg(tmp_path, **kw), train_dataset=rows, processing_class=tiny_tokenizer())
        data = [t.train_dataset[i] for i in range(len(t.train_dataset))]
        results[name] = _batch_logps_and_grads(t, data)
    ref_logps, ref_targets, ref_grads = results["padded"]
    for name in ("padding_free", "packed"):
        logps, targets, grads = results[name]
        if name == "packed":  # packing reorders examples inside the row: compare as multisets + total grads
            torch.testing.assert_close(logps.sort().values, ref_logps.sort().values, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(targets, ref_targets)
            torch.testing.assert_close(logps, ref_logps, rtol=1e-5, atol=1e-5)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5)


def test_packed_loss_equals_unpacked_loss_in_training(tmp_path):
    rows = conv_pc(8)
    a = SFTTrainer(tiny_model(), cfg(tmp_path, max_steps=1, per_device_train_batch_size=8, padding_free=False),
                   train_dataset=rows, processing_class=tiny_tokenizer())
    a.train()
    b = SFTTrainer(tiny_model(), cfg(tmp_path, max_steps=1, per_device_train_batch_size=8, padding_free=True),
                   train_dataset=rows, processing_class=tiny_tokenizer())
    b.train()
    assert losses(a)[0] == pytest.approx(losses(b)[0], rel=1e-5)


def test_batch_8x1_equals_4x2_with_accumulation(tmp_path):
    """Loss and gradients (seen through one SGD step) match; rows have different completion lengths."""
    rows = plain_pc(4) + [{"prompt": "Say a long thing: ", "completion": "The quick brown fox jumps " * (i + 1)}
                          for i in range(4)]
    models = []
    logged = []
    for bs, ga in ((8, 1), (4, 2)):
        m = tiny_model()
        t = SFTTrainer(m, cfg(tmp_path, max_steps=1, per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                              optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                              weight_decay=0.0),
                       train_dataset=rows, processing_class=tiny_tokenizer())
        t.train()
        models.append(m)
        logged.append(losses(t)[0])
    assert logged[0] == pytest.approx(logged[1], rel=1e-5)
    for (k, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


def test_exact_resume_equals_uninterrupted(tmp_path):
    rows = conv_pc(24)
    kw = dict(max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3, num_train_epochs=1)
    straight = SFTTrainer(tiny_model(), cfg(tmp_path / "a", **kw), train_dataset=rows, processing_class=tiny_tokenizer())
    straight.train()

    first = SFTTrainer(tiny_model(), cfg(tmp_path / "b", **kw), train_dataset=rows, processing_class=tiny_tokenizer(),
                       callbacks=[StopAt(3)])
    first.train()
    assert (tmp_path / "b" / "out" / "checkpoint-3" / COMPLETE_MARKER).exists()
    second = SFTTrainer(tiny_model(seed=123), cfg(tmp_path / "b", **kw), train_dataset=rows,
                        processing_class=tiny_tokenizer())
    second.train(resume_from_checkpoint=True)
    # The resumed trainer's history starts with the 3 losses stored in the checkpoint; the 3 after it are new.
    assert len(losses(first)) == 3 and len(losses(second)) == 6
    assert losses(first) + losses(second)[3:] == pytest.approx(losses(straight), rel=1e-6)


def test_resume_skips_an_incomplete_checkpoint(tmp_path):
    rows = conv_pc(8)
    kw = dict(max_steps=2, per_device_train_batch_size=2, save_strategy="steps", save_steps=1)
    t = SFTTrainer(tiny_model(), cfg(tmp_path, **kw), train_dataset=rows, processing_class=tiny_tokenizer())
    t.train()
    out = Path(t.args.output_dir)
    # simulate a crash while writing checkpoint-3: folder present, marker absent
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / "trainer_state.json").write_text("{")
    from toolkit import latest_complete_checkpoint

    assert latest_complete_checkpoint(out).endswith("checkpoint-2")
    t2 = SFTTrainer(tiny_model(), cfg(tmp_path, **kw), train_dataset=rows, processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="incomplete"):
        t2.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        SFTTrainer(tiny_model(), cfg(tmp_path / "empty", **kw), train_dataset=rows,
                   processing_class=tiny_tokenizer()).train(resume_from_checkpoint=True)


def test_lora_trains_only_the_adapters(tmp_path):
    from peft import LoraConfig

    model = tiny_model()
    base = {k: v.clone() for k, v in model.named_parameters()}
    t = SFTTrainer(model, cfg(tmp_path, max_steps=6, learning_rate=1e-2), train_dataset=conv_pc(8),
                   processing_class=tiny_tokenizer(),
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    t.train()
    ls = losses(t)
    assert ls[-1] < ls[0]
    named = dict(t.model.named_parameters())
    lora = [k for k, p in named.items() if "lora_" in k]
    assert lora and all(named[k].requires_grad for k in lora)
    for k, v in base.items():  # base weights untouched
        peft_key = next(n for n in named if n.endswith(k.replace(".weight", ".base_layer.weight")) or n.endswith(k))
        assert torch.equal(named[peft_key], v), k


def test_qlora_4bit_trains_on_cpu(tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from toolkit.testing import tiny_model as tm

    src = tmp_path / "tiny"
    tm(hidden_size=128).save_pretrained(src)
    t = SFTTrainer(str(src), cfg(tmp_path, max_steps=4, learning_rate=1e-2), train_dataset=conv_pc(8),
                   processing_class=tiny_tokenizer(),
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
                   model_init_kwargs={"quantization_config": BitsAndBytesConfig(
                       load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
                       "device_map": "cpu"})
    assert t.model.get_base_model().is_loaded_in_4bit
    t.train()
    ls = losses(t)
    assert all(math.isfinite(x) for x in ls) and ls[-1] < ls[0]


def test_evaluation_reports_loss(tmp_path):
    t = SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=conv_pc(8), eval_dataset=conv_pc(4, start=50),
                   processing_class=tiny_tokenizer())
    before = t.evaluate()["eval_loss"]
    t.train()
    after = t.evaluate()["eval_loss"]
    assert math.isfinite(before) and math.isfinite(after) and after != before


def test_bad_data_fails_before_the_model_loads(tmp_path):
    # The model name does not exist anywhere: if it were loaded first we would get a different error.
    with pytest.raises(DataError, match="column 'completion' is an empty string in row 1"):
        SFTTrainer("no-such/model-anywhere", cfg(tmp_path), processing_class=tiny_tokenizer(),
                   train_dataset=[{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}])


def test_eval_format_must_match_train(tmp_path):
    with pytest.raises(ConfigError, match="eval_dataset: it is plain-text language-modeling"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=conv_pc(4), eval_dataset=text_rows(2),
                   processing_class=tiny_tokenizer())


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="packing: needs max_length"):
        cfg(tmp_path, packing=True, max_length=None)
    with pytest.raises(ConfigError, match="completion_only_loss=True needs prompt-completion data"):
        SFTTrainer(tiny_model(), cfg(tmp_path, completion_only_loss=True), train_dataset=text_rows(2),
                   processing_class=tiny_tokenizer())


def test_nan_loss_stops_with_the_step_named(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    t = SFTTrainer(model, cfg(tmp_path), train_dataset=conv_pc(4), processing_class=tiny_tokenizer())
    with pytest.raises(TrainingHealthError, match="SFT loss is nan at step 0"):
        t.train()


def test_padding_free_is_automatic_where_attention_supports_it(tmp_path):
    t = SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=conv_pc(4), processing_class=tiny_tokenizer())
    assert t.padding_free and t.model.config._attn_implementation == "toolkit_varlen"
    assert t.args.gradient_checkpointing  # default on CPU
    t = SFTTrainer(tiny_model(attn_implementation="flex_attention"), cfg(tmp_path), train_dataset=conv_pc(4),
                   processing_class=tiny_tokenizer())
    assert not t.padding_free


def test_packing_refuses_attention_that_would_leak(tmp_path):
    model = tiny_model(attn_implementation="flex_attention")
    with pytest.raises(ConfigError, match="cannot keep packed examples apart"):
        SFTTrainer(model, cfg(tmp_path, padding_free=True), train_dataset=conv_pc(4), processing_class=tiny_tokenizer())


def test_final_model_saves_and_reloads(tmp_path):
    t = SFTTrainer(tiny_model(), cfg(tmp_path, max_steps=1), train_dataset=conv_pc(4), processing_class=tiny_tokenizer())
    t.train()
    t.save_model(str(tmp_path / "final"))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for (k, p), (_, q) in zip(t.model.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(p, q), k
    assert json.loads((tmp_path / "final" / "config.json").read_text())["model_type"] == "llama"
