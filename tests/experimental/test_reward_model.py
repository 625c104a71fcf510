"""toolkit.experimental.reward.RewardTrainer: learning, TRL parity on a fixed batch, the trained model consumed
unchanged by GRPO (RewardModelReward) and PPO (reward_model=), bad input, exact resume, the pair report."""

import math
import os

import pytest
import torch
from builders import StopAt

from toolkit.core.errors import ConfigError, DataError
from toolkit.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
from toolkit.experimental.reward import RewardConfig, RewardTrainer  # noqa: E402

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def pairs(n=16, margin=False):
    rows = [{"prompt": [U(f"What is {i} + 1?")], "chosen": [A(str(i + 1))], "rejected": [A(f"{i + 7} or so")]}
            for i in range(n)]
    if margin:
        for i, r in enumerate(rows):
            r["margin"] = 0.5 * (i % 3)
    return rows


@pytest.fixture
def classifier_dir(tmp_path):
    """The tiny model as a sequence classifier (score head initialised once, so every load is the same)."""
    from transformers import AutoModelForSequenceClassification

    tiny_model().save_pretrained(tmp_path / "lm")
    torch.manual_seed(0)
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=1)
    clf.config.pad_token_id = tiny_tokenizer().pad_token_id
    clf.save_pretrained(tmp_path / "clf")
    tiny_tokenizer().save_pretrained(tmp_path / "clf")
    return str(tmp_path / "clf")


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")
    base.update(kw)
    return RewardConfig(**base)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def test_a_few_steps_learn_to_rank_and_change_the_parameters(tmp_path, classifier_dir):
    t = RewardTrainer(classifier_dir, cfg(tmp_path, max_steps=12), train_dataset=pairs(),
                      processing_class=tiny_tokenizer())
    before = {k: v.clone() for k, v in t.model.named_parameters()}
    t.train()
    assert all(torch.isfinite(torch.tensor(logged(t, "loss"))))
    assert logged(t, "loss")[-1] < logged(t, "loss")[0]
    assert logged(t, "accuracy")[-1] == 1.0
    assert any(not torch.equal(v, before[k]) for k, v in t.model.named_parameters())


def test_a_causal_lm_name_gets_a_score_head_and_a_causal_lm_object_is_refused(tmp_path):
    tiny_model().save_pretrained(tmp_path / "lm")
    t = RewardTrainer(str(tmp_path / "lm"), cfg(tmp_path, max_steps=1), train_dataset=pairs(4),
                      processing_class=tiny_tokenizer())
    assert type(t.model).__name__.endswith("ForSequenceClassification") and t.model.config.num_labels == 1
    with pytest.raises(ConfigError, match="RewardTrainer trains a sequence classifier; got LlamaForCausalLM"):
        RewardTrainer(tiny_model(), cfg(tmp_path), train_dataset=pairs(4), processing_class=tiny_tokenizer())


trl = pytest.importorskip("trl")


@pytest.mark.parametrize("center, margin", [(None, False), (0.01, True)])
def test_loss_and_metrics_equal_trl(tmp_path, classifier_dir, center, margin):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    tok = tiny_tokenizer()
    rows = pairs(4, margin=margin)
    ours = RewardTrainer(classifier_dir, cfg(tmp_path, center_rewards_coefficient=center), train_dataset=rows,
                         processing_class=tok)
    examples = [ours.train_dataset[i] for i in range(4)]
    batch = ours.data_collator(examples)
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, batch)
    # as log() reports them: the mean of what one step recorded (per pair for accuracy, margin, mean_reward)
    our_metrics = {k: sum(v) / len(v) for k, v in ours.recorded_metrics().items()}

    theirs_model = AutoModelForSequenceClassification.from_pretrained(classifier_dir, num_labels=1)
    theirs = trl.RewardTrainer(model=theirs_model, processing_class=tok,
                               args=trl.RewardConfig(output_dir=str(tmp_path / "trl"), center_rewards_coefficient=center,
                                                     use_cpu=True, bf16=False, report_to="none"),
                               train_dataset=Dataset.from_list([{k: v for k, v in r.items() if k != "margin"}
                                                                for r in rows]))
    theirs.model.train()
    # transformers pools at the last non-pad token: pad with an id no sequence holds, so it reads the same token
    unused = next(i for i in range(len(tok)) if all(i not in s for s in batch["input_ids"].tolist()))
    theirs.model.config.pad_token_id = unused
    inputs = {"input_ids": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, unused),
              "attention_mask": batch["attention_mask"]}
    if margin:
        inputs["margin"] = batch["margin"]
    trl_loss = theirs.compute_loss(theirs.model, inputs)
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    for key in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert our_metrics[key] == pytest.approx(theirs._metrics["train"][key][-1], rel=1e-5, abs=1e-6), key
    # and the gradients of the two losses
    our_loss.backward()
    trl_loss.backward()
    ours_g = dict(ours.model.named_parameters())
    compared = 0
    for name, p in theirs.model.named_parameters():
        assert ours_g[name].grad is not None and p.grad is not None, name
        torch.testing.assert_close(ours_g[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        compared += 1
    assert compared == len(ours_g) and abs(our_loss.item() - math.log(2)) > 1e-3  # a real, non-trivial batch


def test_the_trained_model_is_read_the_same_way_by_grpo_and_ppo(tmp_path, classifier_dir):
    """The score the trainer optimises equals what GRPO's RewardModelReward and PPO's reward_model= compute for the
    same prompt + completion ids, after a save and a load."""
    from toolkit.core.data import tokenize_prompts
    from toolkit.core.ppo import PPOConfig, PPOTrainer
    from toolkit.core.rewards import RewardModelReward

    tok = tiny_tokenizer()
    t = RewardTrainer(classifier_dir, cfg(tmp_path, max_steps=3), train_dataset=pairs(8), processing_class=tok)
    t.train()
    t.save_model(str(tmp_path / "rm"))
    t.model.eval()
    examples = [t.train_dataset[i] for i in range(4)]
    chosen, _ = t.compute_rewards(t.model, t.data_collator(examples))

    rows = pairs(4)
    prompt_ids, _ = tokenize_prompts(rows, tok, max_prompt_length=None)
    assert prompt_ids == [e["prompt_ids"] for e in examples]  # GRPO renders the prompt as the trainer did
    completion_ids = [e["chosen_ids"] for e in examples]
    # what a policy samples: the answer up to the EOS it stops at (the template's "\n" after it is not sampled,
    # and the trainer cut it, so the score is trained where it is read)
    assert all(c[-1] == tok.eos_token_id and tok.eos_token_id not in c[:-1] for c in completion_ids)
    grpo_scores = RewardModelReward(str(tmp_path / "rm"))([r["prompt"] for r in rows], [None] * 4, completion_ids)
    assert grpo_scores == pytest.approx(chosen.tolist(), rel=1e-4, abs=1e-5)

    ppo = PPOTrainer(tiny_model(), [], PPOConfig(output_dir=str(tmp_path / "ppo"), report_to="none",
                                                 rollout_batch_size=4, per_device_train_batch_size=4,
                                                 disable_tqdm=True),
                     train_dataset=[{"prompt": r["prompt"]} for r in rows], processing_class=tok,
                     reward_model=str(tmp_path / "rm"))
    ppo_scores = ppo.compute_rewards([{"prompt": r["prompt"]} for r in rows], prompt_ids, completion_ids)
    assert ppo_scores.tolist() == pytest.approx(chosen.tolist(), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("rows,words", [
    ([{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}], ["column 'margin'", "rows 0", "'big'"]),
    ([{"prompt": "What is 1 + 1?"}], ["needs preference pairs", "prompt-only"]),
    ([{"prompt": "a", "chosen": "", "rejected": "c"}], ["column 'chosen' is an empty string in row 0"]),
    ([{"prompt": "a", "chosen": "b", "rejected": "b"}], ["every one of its 1 rows chosen == rejected"]),
])
def test_bad_input_is_named_before_any_model_loads(tmp_path, rows, words):
    with pytest.raises(DataError) as e:
        RewardTrainer("no-such/model", cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer())
    for w in words:
        assert w in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="center_rewards_coefficient: must be >= 0"):
        cfg(tmp_path, center_rewards_coefficient=-1.0)


def test_exact_resume_equals_uninterrupted(tmp_path, classifier_dir):
    kw = dict(max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3)
    straight = RewardTrainer(classifier_dir, cfg(tmp_path / "a", **kw), train_dataset=pairs(24),
                             processing_class=tiny_tokenizer())
    straight.train()
    first = RewardTrainer(classifier_dir, cfg(tmp_path / "b", **kw), train_dataset=pairs(24),
                          processing_class=tiny_tokenizer(), callbacks=[StopAt(3)])
    first.train()
    second = RewardTrainer(classifier_dir, cfg(tmp_path / "b", **kw), train_dataset=pairs(24),
                           processing_class=tiny_tokenizer())
    second.train(resume_from_checkpoint=True)
    assert logged(first, "loss") + logged(second, "loss")[3:] == pytest.approx(logged(straight, "loss"), rel=1e-6)


def test_pair_report_names_the_pairs_ranked_wrong(tmp_path, classifier_dir):
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in pairs(4)]
    t = RewardTrainer(classifier_dir, cfg(tmp_path, max_steps=1, learning_rate=0.0, per_device_eval_batch_size=4),
                      train_dataset=pairs(8), eval_dataset=pairs(6) + swapped, processing_class=tiny_tokenizer())
    report = t.pair_report()
    assert report["pairs"] == 10 and 0.0 < report["accuracy"] < 1.0
    examples = [t.eval_dataset[i] for i in range(10)]
    chosen, rejected = t.compute_rewards(t.model.eval(), t.data_collator(examples))
    assert report["failed_rows"] == [i for i in range(10) if not chosen[i] > rejected[i]]
    # batches of 4, 4 and 2 pairs: the logged accuracy is the mean over pairs, not over batches
    assert t.evaluate()["eval_accuracy"] == pytest.approx(report["accuracy"])


def test_lora_trains_the_adapters_and_the_score_head_and_a_frozen_head_is_refused(tmp_path, classifier_dir):
    from peft import LoraConfig

    t = RewardTrainer(classifier_dir, cfg(tmp_path, max_steps=2),
                      peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"),
                      train_dataset=pairs(8), processing_class=tiny_tokenizer())
    head = {k: v.clone() for k, v in t.model.named_parameters() if "score" in k and v.requires_grad}
    assert head
    t.train()
    assert any(not torch.equal(v, dict(t.model.named_parameters())[k]) for k, v in head.items())
    with pytest.raises(ConfigError, match="would leave the score head frozen"):
        RewardTrainer(classifier_dir, cfg(tmp_path), train_dataset=pairs(4), processing_class=tiny_tokenizer(),
                      peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))


def test_batch_8x1_equals_4x2_with_accumulation(tmp_path, classifier_dir):
    trained = []
    for batch, accumulation in ((8, 1), (4, 2)):
        t = RewardTrainer(classifier_dir, cfg(tmp_path / f"{batch}", max_steps=2, per_device_train_batch_size=batch,
                                             gradient_accumulation_steps=accumulation, optim="sgd",
                                             lr_scheduler_type="constant", max_grad_norm=0.0),
                          train_dataset=pairs(8), processing_class=tiny_tokenizer())
        # one optimizer step sees all 8 pairs in both layouts (whatever order they are sampled in)
        t.train()
        trained.append(dict(t.model.named_parameters()))
    for name, p in trained[0].items():
        torch.testing.assert_close(p, trained[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_pre_tokenized_whole_sequence_pairs_score_like_the_text_pairs(tmp_path, classifier_dir):
    """TRL's reward layout: chosen_ids / rejected_ids each a whole sequence, no prompt column."""
    tok = tiny_tokenizer()
    text = RewardTrainer(classifier_dir, cfg(tmp_path / "a"), train_dataset=pairs(4), processing_class=tok)
    examples = [text.train_dataset[i] for i in range(4)]
    whole = [{"chosen_ids": e["prompt_ids"] + e["chosen_ids"], "rejected_ids": e["prompt_ids"] + e["rejected_ids"]}
             for e in examples]
    ids = RewardTrainer(classifier_dir, cfg(tmp_path / "b"), train_dataset=whole, processing_class=tok)
    assert ids.train_dataset[0]["prompt_ids"] == []
    a = text.compute_rewards(text.model.eval(), text.data_collator(examples))
    b = ids.compute_rewards(ids.model.eval(), ids.data_collator([ids.train_dataset[i] for i in range(4)]))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_the_answer_loses_only_the_templates_suffix_never_a_truncated_end(tmp_path, classifier_dir):
    """Chat answers end at EOS (the template's newline after it is cut); an answer cut by max_length, and
    pre-tokenized ids, are kept as they are (no earlier EOS is taken for the end)."""
    from toolkit.experimental.reward import _template_suffix

    tok = tiny_tokenizer()
    suffix = _template_suffix(tok, None)
    assert suffix and tok.eos_token_id not in suffix
    full = RewardTrainer(classifier_dir, cfg(tmp_path / "a"), train_dataset=pairs(4), processing_class=tok)
    e = full.train_dataset[0]
    assert e["chosen_ids"][-1] == tok.eos_token_id
    # max_length cuts into the answers: nothing is stripped, the pair stays different
    cut = RewardTrainer(classifier_dir, cfg(tmp_path / "b", max_length=len(e["prompt_ids"]) + 2),
                        train_dataset=pairs(4), processing_class=tok)
    c = cut.train_dataset[0]
    assert len(c["chosen_ids"]) == 2 and c["chosen_ids"] != c["rejected_ids"]
    # prompt-less pre-tokenized pairs, truncated: the user turn's EOS is not mistaken for the answer's end
    whole = [{"chosen_ids": x["prompt_ids"] + x["chosen_ids"] + suffix,
              "rejected_ids": x["prompt_ids"] + x["rejected_ids"] + suffix} for x in full.train_dataset]
    ids = RewardTrainer(classifier_dir, cfg(tmp_path / "c", max_length=len(e["prompt_ids"]) + 2),
                        train_dataset=whole, processing_class=tok)
    keep = len(e["prompt_ids"]) + 2
    for x, y in zip(ids.train_dataset, whole):
        assert x["chosen_ids"] == y["chosen_ids"][:keep] and x["rejected_ids"] == y["rejected_ids"][:keep]


def test_the_cli_trains_a_lora_reward_model_with_its_head(tmp_path):
    import json

    from toolkit.cli import main as script_main

    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} + 1? ", "chosen": str(i + 1),
                                          "rejected": f"{i + 5} maybe"}) for i in range(8)))
    rc = script_main(["reward", "--model", str(tmp_path / "m"), "--dataset", str(data), "--max_steps", "2",
                      "--output_dir", str(tmp_path / "out"), "--save_strategy", "no", "--disable_tqdm", "true",
                      "--lora_r", "4", "--lora_target_modules", '["q_proj"]'])
    assert rc == 0
    config = json.loads((tmp_path / "out" / "final" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "score" in str(config.get("modules_to_save"))


def test_a_reward_model_loaded_by_path_goes_to_this_process_gpu(tmp_path, monkeypatch):
    # scored on the CPU beside a GPU policy, the reward model would be the slowest part of every step
    from transformers import LlamaForSequenceClassification

    from toolkit.core import rewards
    from toolkit.core.rewards import RewardModelReward

    config = tiny_model().config
    config.num_labels, config.pad_token_id = 1, tiny_tokenizer().pad_token_id
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tiny_tokenizer().save_pretrained(tmp_path / "rm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert {p.device.type for p in RewardModelReward(str(tmp_path / "rm")).model.parameters()} == {"cpu"}
    placed = RewardModelReward(str(tmp_path / "rm"), device="meta")  # any device asked for (no GPU here)
    assert {p.device.type for p in placed.model.parameters()} == {"meta"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rewards._default_device() == torch.device("cuda", 1)


def test_a_dataset_smaller_than_one_batch_is_named_in_a_warning(tmp_path, classifier_dir, caplog):
    """A reward model trained on one pair without a word (every step saw the same pair)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="toolkit.core.lifecycle"):
        RewardTrainer(classifier_dir, cfg(tmp_path), train_dataset=pairs(1), processing_class=tiny_tokenizer())
    assert ("train_dataset: 1 row(s), fewer than one optimizer step takes (per_device_train_batch_size 4 x "
            "gradient_accumulation_steps 1 x 1 process(es) = 4): every step trains on the same 1 row(s)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="toolkit.core.lifecycle"):
        RewardTrainer(classifier_dir, cfg(tmp_path), train_dataset=pairs(8), processing_class=tiny_tokenizer())
    assert "fewer than one optimizer step" not in caplog.text
