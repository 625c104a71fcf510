"""Data layer: format detection, validation messages (each bad case asserts its message), tokenization."""

import json

import pytest
from builders import conv_pc, messages_rows, plain_pc, text_rows

from toolkit.core.data import (
    SFTCollator,
    as_rows,
    detect_format,
    normalize_rows,
    pack_bins,
    tokenize_for_sft,
    validate,
)
from toolkit.core.errors import DataError
from toolkit.testing import tiny_tokenizer

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731


# ------------------------------------------------------------------------------------ detection

@pytest.mark.parametrize("rows, kind, conversational", [
    ([{"text": "hello"}], "language_modeling", False),
    ([{"messages": [U("hi"), A("yo")]}], "language_modeling", True),
    ([{"prompt": "hi"}], "prompt_only", False),
    ([{"prompt": [U("hi")]}], "prompt_only", True),
    ([{"prompt": "hi", "completion": "yo"}], "prompt_completion", False),
    ([{"prompt": [U("hi")], "completion": [A("yo")]}], "prompt_completion", True),
    ([{"prompt": "hi", "chosen": "a", "rejected": "b"}], "preference", False),
    ([{"chosen": "hi a", "rejected": "hi b"}], "preference", False),
    ([{"chosen": [U("hi"), A("a")], "rejected": [U("hi"), A("b")]}], "preference", True),
    ([{"prompt": "hi", "completion": "yo", "label": True}], "unpaired_preference", False),
    ([{"prompt": [U("hi")], "completion": [A("yo")], "label": False}], "unpaired_preference", True),
])
def test_detects_every_format(rows, kind, conversational):
    fmt = detect_format(normalize_rows(rows))
    assert (fmt.kind, fmt.conversational) == (kind, conversational)
    validate(normalize_rows(rows), fmt)


def test_sharegpt_conversations_alias():
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
                               {"from": "gpt", "value": "yo"}], "id": 3}]
    norm = normalize_rows(rows)
    fmt = detect_format(norm)
    assert fmt.kind == "language_modeling" and fmt.conversational and fmt.extra_columns == ("id",)
    assert norm[0]["messages"] == [S("Be brief."), U("hi"), A("yo")]


def test_extra_columns_are_kept():
    fmt = detect_format([{"prompt": "a", "completion": "b", "answer": "1"}])
    assert fmt.extra_columns == ("answer",)


def test_reads_jsonl_and_dict_of_columns(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in plain_pc(3)))
    assert as_rows(p) == plain_pc(3)
    assert as_rows({"text": ["a", "b"]}) == [{"text": "a"}, {"text": "b"}]


# ------------------------------------------------------------------------------ bad input cases

BAD = [
    # (id, rows, expected message fragment)
    ("no rows", [], "has no rows"),
    ("misspelled prompt", [{"promt": "a", "completion": "b"}], "'promt' -> 'prompt'"),
    ("unknown columns listed", [{"question": "a", "answer": "b"}], "columns ['question', 'answer']"),
    ("completion without prompt", [{"completion": "b"}], "no 'prompt' column to go with it"),
    ("chosen without rejected", [{"prompt": "p", "chosen": "a"}], "needs both 'chosen' and 'rejected'"),
    ("text and messages", [{"text": "a", "messages": [U("a")]}], "ambiguous"),
    ("text is None", [{"text": "ok"}, {"text": None}], "column 'text' is empty (None) in row 1"),
    ("text wrong type", [{"text": "ok"}, {"text": 42}], "column 'text' must hold a string in row 1, got int"),
    ("text empty", [{"text": "ok"}, {"text": "   "}], "column 'text' is an empty string in row 1"),
    ("empty completion", [{"prompt": "p", "completion": "x"}, {"prompt": "p", "completion": ""}],
     "column 'completion' is an empty string in row 1"),
    ("messages not a list", [{"messages": [U("a"), A("b")]}, {"messages": "hi"}],
     "column 'messages' must hold a list of {'role', 'content'} turns in row 1, got str"),
    ("messages empty list", [{"messages": [U("a"), A("b")]}, {"messages": []}], "column 'messages' has no turns in row 1"),
    ("turn missing content", [{"messages": [U("a"), {"role": "assistant", "text": "b"}]}],
     "turn 1 has keys ['role', 'text']; each turn needs 'role' and 'content'"),
    ("unknown role", [{"messages": [U("a"), {"role": "bot", "content": "b"}]}], "has role 'bot'"),
    ("content not a string", [{"messages": [U("a"), {"role": "assistant", "content": 5}]}],
     "content must be a string, got int"),
    ("empty content", [{"messages": [U("a"), A("")]}], "turn 1 (assistant) has empty content"),
    ("two users in a row", [{"messages": [U("a"), U("b"), A("c")]}], "two 'user' turns in a row"),
    ("assistant first", [{"messages": [A("a"), U("b")]}], "starts with an assistant turn"),
    ("system not first", [{"messages": [U("a"), S("b"), A("c")]}], "a system turn at position 1"),
    ("no assistant turn", [{"messages": [S("x"), U("a")]}], "has no assistant turn"),
    ("prompt ends with assistant", [{"prompt": [U("a"), A("b")], "completion": [A("c")]}],
     "the prompt ends with an assistant turn"),
    ("completion with user role", [{"prompt": [U("a")], "completion": [U("c")]}], "may only hold assistant turns"),
    ("mixed plain and conversational", [{"prompt": [U("a")], "completion": [A("b")]},
                                        {"prompt": "a", "completion": [A("b")]}],
     "column 'prompt' is plain text in row 1 but the dataset is conversational"),
    ("conversational value in plain dataset", [{"prompt": "a", "completion": "b"},
                                               {"prompt": "a", "completion": [A("b")]}],
     "column 'completion' is a list of turns in row 1 but the dataset is plain text"),
    ("label not bool", [{"prompt": "a", "completion": "b", "label": "yes"}], "column 'label' must be True/False"),
    ("missing column in a later row", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}],
     "column 'completion' is missing from row 1"),
    ("sharegpt unknown speaker", [{"conversations": [{"from": "narrator", "value": "x"}]}], "unknown speaker from='narrator'"),
    ("messages is a string in row 0", [{"messages": "hi"}], "column 'messages' must hold a list"),
    ("turn not a dict", [{"messages": [U("a"), "b"]}], "turn 1 is a str"),
]


@pytest.mark.parametrize("rows, fragment", [(r, f) for _, r, f in BAD], ids=[i for i, _, _ in BAD])
def test_bad_input_is_named(rows, fragment):
    with pytest.raises(DataError) as e:
        norm = normalize_rows(rows)
        validate(norm, detect_format(norm))
    assert fragment in str(e.value), str(e.value)


def test_many_bad_rows_are_summarised_not_dumped():
    rows = [{"text": "ok"}] + [{"text": ""} for _ in range(40)]
    with pytest.raises(DataError) as e:
        validate(rows, detect_format(rows))
    assert "rows 1, 2, 3, 4, 5 and 35 more of 41" in str(e.value)


def test_conversational_data_needs_a_chat_template():
    rows = conv_pc(2)
    with pytest.raises(DataError, match="tokenizer has no chat template"):
        validate(rows, detect_format(rows), tokenizer=tiny_tokenizer(chat_template=False))


def test_wrong_kind_for_sft_points_to_the_right_trainer(tok):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    with pytest.raises(DataError, match="Use DPOTrainer"):
        tokenize_for_sft(rows, detect_format(rows), tok, max_length=64, completion_only_loss=True,
                         assistant_only_loss=False)


def test_empty_loss_mask_after_truncation_is_an_error(tok):
    rows = [{"prompt": "What is 1 + 2? " * 20, "completion": "3"}]
    with pytest.raises(DataError, match=r"empty loss mask \(rows 0\): the prompt fills max_length=16"):
        tokenize_for_sft(rows, detect_format(rows), tok, max_length=16, completion_only_loss=True,
                         assistant_only_loss=False)


def test_assistant_only_loss_needs_messages(tok):
    rows = plain_pc(2)
    with pytest.raises(DataError, match="assistant_only_loss=True needs conversational 'messages'"):
        tokenize_for_sft(rows, detect_format(rows), tok, max_length=64, completion_only_loss=False,
                         assistant_only_loss=True)


# ---------------------------------------------------------------------------------- tokenization

def _tok(rows, tok, **kw):
    kw = {"max_length": 256, "completion_only_loss": True, "assistant_only_loss": False, **kw}
    return tokenize_for_sft(rows, detect_format(rows), tok, **kw)


def test_conversational_prompt_is_a_token_prefix_and_mask_covers_completion_and_eos(tok):
    rows = conv_pc(4)
    out, report = _tok(rows, tok)
    for r, ex in zip(rows, out):
        prompt_ids = tok(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids
        assert ex["input_ids"][:len(prompt_ids)] == prompt_ids
        assert ex["completion_mask"][:len(prompt_ids)] == [0] * len(prompt_ids)
        completion = [t for t, m in zip(ex["input_ids"], ex["completion_mask"]) if m]
        assert tok.decode(completion).startswith(r["completion"][0]["content"])
        assert tok.eos_token_id in completion  # <|im_end|> closes the answer and is learned
    assert report.non_prefix_rows == 0 and report.truncated_rows == 0


def test_plain_completion_gets_eos_appended_and_learned(tok):
    out, _ = _tok(plain_pc(3), tok)
    for ex in out:
        assert ex["input_ids"][-1] == tok.eos_token_id and ex["completion_mask"][-1] == 1


def test_pad_equals_eos_does_not_mask_the_real_eos(tok):
    assert tok.pad_token_id == tok.eos_token_id
    out, _ = _tok(plain_pc(3), tok)
    batch = SFTCollator(tok.pad_token_id)(out)
    for b, ex in enumerate(out):
        n = len(ex["input_ids"])
        assert batch["labels"][b, n - 1].item() == tok.eos_token_id   # real EOS is a target
        assert (batch["labels"][b, n:] == -100).all()                  # padding (same id) is not


def test_boundary_merge_keeps_prompt_ids(tok):
    """When BPE merges across the prompt/completion boundary, the prompt keeps its own ids."""
    rows = [{"prompt": "The quick bro", "completion": "wn fox"}]
    out, report = _tok(rows, tok)
    prompt_ids = tok("The quick bro").input_ids
    assert out[0]["input_ids"][:len(prompt_ids)] == prompt_ids
    joint = tok("The quick brown fox").input_ids
    if joint[:len(prompt_ids)] != prompt_ids:
        assert report.non_prefix_rows == 1
    assert tok.decode(out[0]["input_ids"]).startswith("The quick brown fox")


def test_assistant_only_mask_marks_exactly_the_assistant_turns(tok):
    rows = messages_rows(2)
    out, _ = _tok(rows, tok, assistant_only_loss=True, completion_only_loss=False)
    for r, ex in zip(rows, out):
        learned = tok.decode([t for t, m in zip(ex["input_ids"], ex["completion_mask"]) if m])
        answers = [t["content"] for t in r["messages"] if t["role"] == "assistant"]
        assert learned == "".join(f"{a}<|im_end|>\n" for a in answers)


def test_truncation_is_reported(tok):
    out, report = _tok(text_rows(8), tok, max_length=12, completion_only_loss=False)
    assert report.truncated_rows > 0 and all(len(ex["input_ids"]) <= 12 for ex in out)
    assert "TRUNCATED to max_length=12" in report.summary(12)


def test_first_position_is_never_a_target(tok):
    out, _ = _tok(text_rows(3), tok, completion_only_loss=False)
    assert all(ex["completion_mask"][0] == 0 for ex in out)


def test_padding_free_collation_restarts_positions(tok):
    out, _ = _tok(conv_pc(3), tok)
    batch = SFTCollator(tok.pad_token_id, padding_free=True)(out)
    lens = [len(e["input_ids"]) for e in out]
    assert batch["input_ids"].shape == (1, sum(lens))
    assert batch["cu_seq_lens"].tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert batch["position_ids"][0, lens[0]].item() == 0


def test_pack_bins_respects_capacity_and_keeps_every_example():
    lengths = [5, 9, 3, 7, 2, 8, 1, 10]
    bins = pack_bins(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 5  # total 45 tokens -> at least 5 bins of 10
    assert pack_bins(lengths, 10) == bins  # deterministic


def test_template_whose_prompt_is_not_a_text_prefix(tok):
    """Like templates that open a <think> block in the generation prompt but not in rendered history."""
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\nthink: ' }}{% endif %}"
    )
    rows = conv_pc(2)
    out, report = _tok(rows, tok)
    assert report.non_prefix_rows == 2
    for r, ex in zip(rows, out):
        learned = tok.decode([t for t, m in zip(ex["input_ids"], ex["completion_mask"]) if m])
        # the boundary is the longest common token prefix: the answer and its end are learned, the prompt is not
        assert r["completion"][0]["content"] in learned and "What is" not in learned


# ------------------------------------------------------------------------ edge cases (issue 13)


def test_a_datasetdict_is_named_with_the_fix():
    from datasets import Dataset, DatasetDict

    from toolkit.core.data import as_rows

    dd = DatasetDict({"train": Dataset.from_list([{"text": "a"}]), "test": Dataset.from_list([{"text": "b"}])})
    with pytest.raises(DataError, match=r"got a DatasetDict with splits \['test', 'train'\]; pass one split, e\.g\. "
                                        r"dataset\['train'\]"):
        as_rows(dd)


def test_a_column_named_like_a_reward_argument_is_refused_before_any_model(tmp_path):
    from toolkit.core.data import prompt_rows
    from toolkit.testing import tiny_tokenizer

    with pytest.raises(DataError, match=r"GRPO: the dataset has a column named \['completions'\]"):
        prompt_rows([{"prompt": "p", "completions": "x"}], tiny_tokenizer(), trainer="GRPO")


def test_a_tokenizer_without_eos_is_refused_where_it_would_silently_break(tmp_path):
    from toolkit.core.data import detect_format, prompt_rows, tokenize_for_sft
    from toolkit.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.eos_token = None
    with pytest.raises(DataError, match=r"GRPO: the tokenizer has no EOS token"):
        prompt_rows([{"prompt": "p"}], tok, trainer="GRPO")
    rows = [{"text": "hello"}]
    with pytest.raises(DataError, match=r"SFT: the tokenizer has no EOS token"):
        tokenize_for_sft(rows, detect_format(rows), tok, max_length=64, completion_only_loss=None, assistant_only_loss=False)


def test_text_next_to_prompt_completion_is_ambiguous_and_named():
    from toolkit.core.data import detect_format

    with pytest.raises(DataError, match=r"it has a 'text' column and \['completion', 'prompt'\], so it is ambiguous"):
        detect_format([{"text": "a", "prompt": "b", "completion": "c"}])


def test_a_system_only_rl_prompt_names_its_row():
    from toolkit.core.data import prompt_rows

    rows = [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"role": "system", "content": "be brief"}]}]
    with pytest.raises(DataError, match=r"GRPO: row 1's prompt has no user turn \(roles \['system'\]\)"):
        prompt_rows(rows, tiny_tokenizer(), trainer="GRPO")
