"""What TRL users and wrappers hand SFTTrainer besides text rows: pre-tokenized rows, their own collator,
TRL's formatting_func, and streams (tokenized as read, never materialised)."""

import pytest
import torch
from datasets import IterableDataset
from transformers import DataCollatorForSeq2Seq

from toolkit.core.errors import ConfigError, DataError
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

COMMON = dict(max_steps=2, learning_rate=1e-2, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
              logging_steps=1, per_device_train_batch_size=4)


def cfg(tmp_path, **kw):
    return SFTConfig(output_dir=str(tmp_path / "out"), **{**COMMON, **kw})


def text_rows(n=8):
    return [{"prompt": f"What is {i} + 1? ", "completion": str(i + 1)} for i in range(n)]


def tokenized_like_text(tok, rows):
    """What a wrapper would hand over for `rows`: ids of prompt + completion + eos, labels -100 on the prompt."""
    out = []
    for r in rows:
        p = tok(r["prompt"])["input_ids"]
        c = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": p + c, "labels": [-100] * len(p) + c, "attention_mask": [1] * (len(p) + len(c))})
    return out


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_pre_tokenized_rows_train_like_the_same_text(tmp_path):
    tok = tiny_tokenizer()
    a = SFTTrainer(tiny_model(), cfg(tmp_path / "a"), train_dataset=text_rows(), processing_class=tok)
    b = SFTTrainer(tiny_model(), cfg(tmp_path / "b"), train_dataset=tokenized_like_text(tok, text_rows()),
                   processing_class=tok)
    assert b.dataset_format.kind == "tokenized"
    assert [e["input_ids"] for e in a.train_dataset] == [e["input_ids"] for e in b.train_dataset]
    assert [e["completion_mask"] for e in a.train_dataset] == [e["completion_mask"] for e in b.train_dataset]
    a.train()
    b.train()
    assert losses(a) == pytest.approx(losses(b), rel=1e-6)


@pytest.mark.parametrize("row,words", [
    ({"input_ids": [1, 2, 9999]}, ["'input_ids', row 0", "9999", "vocabulary"]),
    ({"input_ids": [1, 2, 3], "labels": [-100, 2]}, ["'labels', row 0", "2 values for 3"]),
    ({"input_ids": [1, 2, 3], "labels": [-100, 5, 3]}, ["'labels', row 0", "differs from its input id"]),
    ({"input_ids": [1, 2, 3], "completion_mask": [0, 2, 1]}, ["'completion_mask', row 0", "0/1"]),
    ({"input_ids": "1 2 3"}, ["'input_ids' must hold a non-empty list", "row 0"]),
    ({"input_ids": [1, 2], "text": "hi"}, ["'input_ids' and ['text']", "ambiguous"]),
    ({"input_ids": [1, 2], "labels": [-100, -100]}, ["no token in the loss", "rows 0"]),
])
def test_bad_pre_tokenized_rows_are_named(tmp_path, row, words):
    with pytest.raises(DataError) as e:
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=[row], processing_class=tiny_tokenizer())
    for w in words:
        assert w in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_collator_of_your_own_is_used_and_gets_standard_keys(tmp_path):
    tok = tiny_tokenizer()
    seen = []
    base = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)

    def collator(features):
        seen.append(sorted(features[0]))
        return base(features)

    t = SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=text_rows(), processing_class=tok, data_collator=collator)
    assert not t.padding_free and t.data_collator is collator
    t.train()
    assert seen and seen[-1] == ["attention_mask", "input_ids", "labels"] and len(losses(t)) == 2
    reference = SFTTrainer(tiny_model(), cfg(tmp_path / "ref", padding_free=False), train_dataset=text_rows(),
                           processing_class=tok)
    reference.train()
    assert losses(t) == pytest.approx(losses(reference), rel=1e-5)


def test_a_collator_missing_keys_or_meeting_packing_is_refused(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ConfigError, match=r"data_collator: its batch lacks \['labels'\]"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=text_rows(), processing_class=tok,
                   data_collator=lambda f: {"input_ids": torch.zeros(1, 1), "attention_mask": torch.ones(1, 1)})
    with pytest.raises(ConfigError, match="data_collator: a collator of your own pads"):
        SFTTrainer(tiny_model(), cfg(tmp_path, packing=True), train_dataset=text_rows(), processing_class=tok,
                   data_collator=lambda f: f)


def test_formatting_func_turns_rows_into_text(tmp_path):
    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(8)]
    t = SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer(),
                   formatting_func=lambda r: f"Q: {r['question']} A: {r['answer']}")
    assert t.dataset_format.kind == "language_modeling"
    t.train()
    with pytest.raises(DataError, match=r"formatting_func: failed on train_dataset row 0 \(KeyError"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer(),
                   formatting_func=lambda r: r["missing"])
    with pytest.raises(DataError, match="formatting_func: returned int for train_dataset row 0"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer(),
                   formatting_func=lambda r: 3)


class CountingStream:
    """A re-iterable stream with no length that counts the rows handed out (proof nothing is read whole)."""

    def __init__(self, rows):
        self.rows, self.read = rows, 0

    def __iter__(self):
        for r in self.rows:
            self.read += 1
            yield r


def test_a_stream_trains_like_the_same_rows_in_a_list(tmp_path):
    # batch = all 8 rows, so every step sees the same examples whatever order the list run samples them in
    kw = dict(per_device_train_batch_size=8, max_steps=3)
    listed = SFTTrainer(tiny_model(), cfg(tmp_path / "a", **kw), train_dataset=text_rows(), processing_class=tiny_tokenizer())
    stream = IterableDataset.from_generator(lambda: iter(text_rows()))
    streamed = SFTTrainer(tiny_model(), cfg(tmp_path / "b", **kw), train_dataset=stream, processing_class=tiny_tokenizer())
    assert streamed.dataset_format.kind == "prompt_completion" and streamed.padding_free
    listed.train()
    streamed.train()
    assert len(losses(streamed)) == 3
    assert losses(streamed) == pytest.approx(losses(listed), rel=1e-5)


def test_a_stream_is_read_as_training_needs_it_not_whole(tmp_path):
    rows = CountingStream([{"prompt": f"What is {i} + 1? ", "completion": str(i + 1)} for i in range(100_000)])
    t = SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer())
    assert rows.read == 64  # the rows checked before the model loads
    t.train()
    assert len(losses(t)) == 2
    assert rows.read < 200, rows.read  # 2 steps x 4 rows, plus the check and the DataLoader's read-ahead


def test_a_bad_row_deep_in_a_stream_stops_the_run_by_its_index(tmp_path):
    rows = text_rows(200)
    rows[150] = {"prompt": "What is 1 + 1? ", "completion": ""}
    t = SFTTrainer(tiny_model(), cfg(tmp_path, per_device_train_batch_size=50, max_steps=4),
                   train_dataset=CountingStream(rows), processing_class=tiny_tokenizer())
    with pytest.raises(DataError, match=r"column 'completion'.*rows 150 of the rows read so far"):
        t.train()


def test_a_stream_needs_max_steps_and_refuses_packing(tmp_path):
    stream = IterableDataset.from_generator(lambda: iter(text_rows()))
    with pytest.raises(ConfigError, match="max_steps: a streamed train_dataset has no length"):
        SFTTrainer(tiny_model(), cfg(tmp_path, max_steps=-1), train_dataset=stream, processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="packing: fills rows best-fit from the whole dataset"):
        SFTTrainer(tiny_model(), cfg(tmp_path, packing=True), train_dataset=stream, processing_class=tiny_tokenizer())
    with pytest.raises(DataError, match="train_dataset: the stream yielded no rows"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=iter([]), processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="eval_dataset: a one-shot iterator"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=stream, eval_dataset=iter(text_rows()),
                   processing_class=tiny_tokenizer())


def test_a_generator_streams_once_with_formatting_func_and_a_streamed_eval_set(tmp_path, caplog):
    gen = ({"question": f"{i}+1", "answer": str(i + 1)} for i in range(12))
    evals = IterableDataset.from_generator(lambda: iter([{"question": "2+2", "answer": "4"}] * 3))
    t = SFTTrainer(tiny_model(), cfg(tmp_path, max_steps=10), train_dataset=gen, eval_dataset=evals,
                   processing_class=tiny_tokenizer(), formatting_func=lambda r: f"Q: {r['question']} A: {r['answer']}")
    assert "one-shot iterator" in caplog.text
    t.train()
    # 12 rows in batches of 4: three steps, then the generator is spent and training ends before max_steps
    assert len(losses(t)) == 3
    assert "eval_loss" in t.evaluate()


def test_other_trainers_refuse_a_stream_by_name():
    from toolkit.core.data import as_rows

    with pytest.raises(DataError, match="a streamed IterableDataset is not supported by this trainer"):
        as_rows(IterableDataset.from_generator(lambda: iter(text_rows())))
    with pytest.raises(DataError, match="streamed generator"):
        as_rows(r for r in text_rows())


def test_a_streamed_run_resumes_exactly(tmp_path):
    from builders import StopAt

    kw = dict(max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3, learning_rate=1e-3)
    make = lambda: IterableDataset.from_generator(lambda: iter(text_rows(24)))  # noqa: E731
    straight = SFTTrainer(tiny_model(), cfg(tmp_path / "a", **kw), train_dataset=make(), processing_class=tiny_tokenizer())
    straight.train()
    first = SFTTrainer(tiny_model(), cfg(tmp_path / "b", **kw), train_dataset=make(), processing_class=tiny_tokenizer(),
                       callbacks=[StopAt(3)])
    first.train()
    second = SFTTrainer(tiny_model(seed=123), cfg(tmp_path / "b", **kw), train_dataset=make(),
                        processing_class=tiny_tokenizer())
    second.train(resume_from_checkpoint=True)
    assert losses(first) + losses(second)[3:] == pytest.approx(losses(straight), rel=1e-6)


def test_input_ids_next_to_text_is_only_pre_tokenized_for_sft():
    """A Dataset.map(tokenize) keeps the text next to its ids: RL and preference trainers read the text (the ids
    are an extra column for rewards), only SFT reads `input_ids` as its data (and refuses the mix)."""
    from toolkit.core.data import detect_format, prompt_rows

    rows, fmt = prompt_rows([{"prompt": "What is 1 + 1?", "input_ids": [1, 2]}] * 2, tiny_tokenizer(), trainer="GRPO")
    assert fmt.kind == "prompt_only" and "input_ids" in fmt.extra_columns
    pref = detect_format([{"prompt": "a", "chosen": "b", "rejected": "c", "input_ids": [1]}])
    assert pref.kind == "preference"
    assert detect_format([{"input_ids": [1, 2]}], tokenized=True).kind == "tokenized"
    with pytest.raises(DataError, match="ambiguous"):
        detect_format([{"prompt": "a", "input_ids": [1]}], tokenized=True)


def test_set_epoch_reaches_the_streamed_source():
    from toolkit.core.sft import _SFTStream

    class Source(CountingStream):
        epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    source = Source(text_rows())
    _SFTStream(source, None, None, None, {}, "train_dataset", standard_keys=False).set_epoch(3)
    assert source.epochs == [3]
