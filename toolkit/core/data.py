"""The data layer every trainer shares: detect a dataset's format, validate it, tokenize it once.

Formats are the ones TRL users already have (docs/datasets.md has a table):

==========================  =============================================  ==========================
kind                        plain text                                     conversational
==========================  =============================================  ==========================
language_modeling           ``text``                                       ``messages``
prompt_only                 ``prompt``                                     ``prompt`` (list of turns)
prompt_completion           ``prompt``, ``completion``                     both lists of turns
preference                  ``prompt``?, ``chosen``, ``rejected``          lists of turns
unpaired_preference         ``prompt``, ``completion``, ``label``          lists of turns
==========================  =============================================  ==========================

Pre-tokenized rows (what Axolotl-style wrappers hand over) are their own kind, `tokenized`: `input_ids`
and optionally `completion_mask` (1 = in the loss), `labels` (-100 = not in the loss) and
`attention_mask`, validated (ids in the vocabulary, masks as long as the ids) and trained on as given.
SFT accepts them. Pre-tokenized preference pairs (TRL's column names) are `tokenized_preference`:
`prompt_ids`, `chosen_ids` and `rejected_ids` (or the older `prompt_input_ids`, `chosen_input_ids`,
`rejected_input_ids`; the answers' ids after the prompt's), read by DPO; without the prompt column (each
answer a whole sequence), by the reward trainer. The RL trainers need prompts as text (rewards and chat templates read it) and say so.

ShareGPT-style ``conversations`` with ``from``/``value`` keys is read as ``messages``.

Validation runs before any model is loaded and raises :class:`DataError` naming the column, the
row and the fix. Tokenization happens once: trainers compute their loss on the very ids rendered
here, never on decoded-and-re-tokenized text.
"""

from __future__ import annotations

__all__ = [
    "KINDS",
    "ROLES",
    "DatasetFormat",
    "SFTCollator",
    "TokenizationReport",
    "as_rows",
    "detect_format",
    "is_stream",
    "normalize_rows",
    "pack_bins",
    "prompt_rows",
    "split_preference",
    "tokenize_for_preference",
    "tokenize_for_sft",
    "tokenize_prompts",
    "validate",
]

import difflib
import json
import logging
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import DataError

logger = logging.getLogger(__name__)

KINDS = ("language_modeling", "prompt_only", "prompt_completion", "preference", "unpaired_preference", "tokenized",
         "tokenized_preference")
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names -> chat roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool", "function": "tool", "chatgpt": "assistant", "bing": "assistant"}
_KNOWN_COLUMNS = ("text", "messages", "conversations", "prompt", "completion", "chosen", "rejected", "label")
_MAX_ROWS_IN_MESSAGE = 5
_TOKENIZED_COLUMNS = ("input_ids", "completion_mask", "labels", "attention_mask")
_TOKENIZED_PAIR_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
# TRL's current names (DPOTrainer >= 0.2x); the *_input_ids ones are its older names. Both are read.
_TOKENIZED_PAIR_NAMES = (_TOKENIZED_PAIR_COLUMNS, ("prompt_ids", "chosen_ids", "rejected_ids"))


@dataclass(frozen=True)
class DatasetFormat:
    """What a dataset holds. `columns` are the columns the format uses; other columns are kept as extras."""

    kind: str
    conversational: bool
    columns: tuple[str, ...]
    extra_columns: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "tokenized":
            return f"pre-tokenized ({', '.join(self.columns)})"
        if self.kind == "tokenized_preference":
            return f"pre-tokenized preference ({', '.join(self.columns)})"
        style = "conversational" if self.conversational else "plain-text"
        return f"{style} {self.kind.replace('_', '-')} ({', '.join(self.columns)})"


# --------------------------------------------------------------------------------------------------
# Loading and normalising rows
# --------------------------------------------------------------------------------------------------


def as_rows(data: Any) -> list[dict[str, Any]]:
    """Accept a `datasets.Dataset`, a list of dicts, a dict of columns, or a .json/.jsonl path."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.exists():
            raise DataError(f"dataset: file '{path}' does not exist.")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # a BOM some editors write is not part of the data
        except UnicodeDecodeError as e:
            line = raw[:e.start].count(b"\n") + 1
            raise DataError(f"dataset: line {line} of '{path}' is not UTF-8 (byte {raw[e.start]:#04x}); re-save the "
                            "file as UTF-8 (e.g. iconv -f latin1 -t utf-8).") from None
        if path.suffix == ".jsonl":
            rows = []
            for i, line in enumerate(text.splitlines()):
                if line.strip():
                    where = f"line {i + 1} of '{path}'"
                    row = _load_json(line, where)
                    if not isinstance(row, Mapping):
                        raise DataError(f"dataset: {where} is a JSON {type(row).__name__}, not an object of columns; "
                                        'each line must look like {"prompt": ..., "completion": ...}.')
                    rows.append(row)
            return rows
        return as_rows(_load_json(text, f"'{path}'"))
    if is_stream(data):
        # Reading a stream whole would hold it all in memory (or never end); say so instead.
        raise DataError(f"dataset: a streamed {type(data).__name__} is not supported by this trainer (it would be "
                        "read whole into memory; SFTTrainer streams). Materialise the part to train on, e.g. "
                        "datasets.Dataset.from_list(list(stream.take(10_000))), or pass a datasets.Dataset / list of "
                        "dicts / .jsonl path.")
    if isinstance(data, Mapping) and data and all(hasattr(v, "column_names") for v in data.values()):
        # a datasets.DatasetDict: its values are splits, not columns
        raise DataError(f"dataset: got a DatasetDict with splits {sorted(data)}; pass one split, e.g. "
                        f"dataset['{'train' if 'train' in data else sorted(data)[0]}'].")
    if isinstance(data, Mapping):
        lengths = {k: len(v) for k, v in data.items()}
        if len(set(lengths.values())) > 1:
            raise DataError(f"dataset: the columns have different lengths {lengths}; every column needs one value per row.")
        n = next(iter(lengths.values()), 0)
        return [{k: data[k][i] for k in data} for i in range(n)]
    if hasattr(data, "column_names") and hasattr(data, "__getitem__"):  # datasets.Dataset
        return [dict(r) for r in data]
    if isinstance(data, Sequence):
        for i, r in enumerate(data):
            if not isinstance(r, Mapping):
                raise DataError(f"dataset: row {i} is a {type(r).__name__}, not a dict of columns. "
                                f"Pass a list of dicts such as {{'prompt': ..., 'completion': ...}}.")
        return [dict(r) for r in data]
    raise DataError(f"dataset: cannot read a {type(data).__name__}; pass a datasets.Dataset, a list of dicts, "
                    "a dict of columns or a .json/.jsonl path.")


def is_stream(data: Any) -> bool:
    """True for data read row by row with no length: a `datasets.IterableDataset`, a generator, any iterator."""
    return type(data).__name__ == "IterableDataset" or (
        hasattr(data, "__iter__") and not hasattr(data, "__len__") and not isinstance(data, (str, bytes, Mapping)))


def _load_json(text: str, where: str) -> Any:
    """json.loads that refuses duplicate keys (json keeps the last one silently, so a column would vanish)."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise DataError(f"dataset: {where} has the key '{key}' twice in one object; JSON keeps only the "
                                "last value, so one of them would be lost. Rename or remove the duplicate.")
            seen[key] = value
        return seen

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise DataError(f"dataset: {where} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}).") from None


def _normalize_sharegpt(turns: Any, row: int, column: str) -> Any:
    if not isinstance(turns, list):
        return turns
    out = []
    for j, t in enumerate(turns):
        if isinstance(t, Mapping) and "from" in t and "role" not in t:
            speaker = str(t["from"]).lower()
            if speaker not in _SHAREGPT_ROLES:
                raise DataError(f"column '{column}', row {row}, turn {j}: unknown speaker from='{t['from']}'. "
                                f"Use one of {sorted(set(_SHAREGPT_ROLES))} (or 'role' with {list(ROLES)}).")
            out.append({"role": _SHAREGPT_ROLES[speaker], "content": t.get("value")})
        else:
            out.append(t)
    return out


def normalize_rows(rows: list[dict[str, Any]], first_row: int = 0) -> list[dict[str, Any]]:
    """Rename aliases: `conversations` -> `messages` and ShareGPT `from`/`value` -> `role`/`content`."""
    if rows and "conversations" in rows[0] and "messages" not in rows[0]:
        rows = [{("messages" if k == "conversations" else k): v for k, v in r.items()} for r in rows]
    conv_cols = ("messages", "prompt", "completion", "chosen", "rejected")
    return [{k: (_normalize_sharegpt(v, i, k) if k in conv_cols else v) for k, v in r.items()}
            for i, r in enumerate(rows, start=first_row)]


# --------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------


def _is_conversation(value: Any) -> bool:
    # Any list counts: validation then names the turn that is not a {'role', 'content'} dict.
    return isinstance(value, list)


def _suggest(columns: Iterable[str]) -> str:
    hints = []
    for c in columns:
        if c in _KNOWN_COLUMNS:
            continue
        close = difflib.get_close_matches(c, _KNOWN_COLUMNS, n=1, cutoff=0.6)
        if close:
            hints.append(f"'{c}' -> '{close[0]}'")
    return f" Did you mean to rename {', '.join(hints)}?" if hints else ""


def detect_format(rows: list[dict[str, Any]], *, tokenized: bool = False) -> DatasetFormat:
    """Tell which of the known formats `rows` are in, from their columns and the type of the first row.

    `tokenized=True` (SFT) reads an `input_ids` column as pre-tokenized rows; elsewhere it is an extra column
    like any other (a `Dataset.map(tokenize)` keeps the text next to it, and reward functions may use it)."""
    if not rows:
        raise DataError("dataset: it has no rows. Pass at least one example.")
    columns = list(rows[0].keys())
    cols = set(columns)
    if "text" in cols and "messages" in cols:
        raise DataError("dataset: it has both 'text' and 'messages' columns, so it is ambiguous. "
                        "Keep one of them (remove_columns) before training.")
    if "text" in cols and ({"prompt", "completion"} & cols or {"chosen", "rejected"} & cols):
        other = sorted(({"prompt", "completion", "chosen", "rejected"} & cols))
        raise DataError(f"dataset: it has a 'text' column and {other}, so it is ambiguous (language modeling or "
                        "not?). Keep one format (remove_columns) before training.")
    if ("chosen" in cols) != ("rejected" in cols):
        raise DataError(f"dataset: columns {columns} have '{'chosen' if 'chosen' in cols else 'rejected'}' but not "
                        f"'{'rejected' if 'chosen' in cols else 'chosen'}'; preference data needs both 'chosen' "
                        "and 'rejected' (and optionally 'prompt').")
    if tokenized and "input_ids" in cols:
        text_like = sorted(cols & set(_KNOWN_COLUMNS))
        if text_like:
            raise DataError(f"dataset: it has 'input_ids' and {text_like}, so it is ambiguous (pre-tokenized or "
                            "text?). Keep one (remove_columns) before training.")
        used = [c for c in _TOKENIZED_COLUMNS if c in cols]
        extras = tuple(c for c in columns if c not in used)
        return DatasetFormat(kind="tokenized", conversational=False, columns=tuple(used), extra_columns=extras)
    for names in _TOKENIZED_PAIR_NAMES:
        if not (set(names[1:]) & cols) or {"chosen", "rejected"} & cols:
            continue  # text columns next to the ids win (a Dataset.map(tokenize) keeps both)
        if names[0] not in cols and cols & {"prompt", "text", "messages", "completion"}:
            continue  # e.g. a prompt dataset with a 'chosen_ids' column for its rewards: an extra column
        if not set(names[1:]) <= cols:
            have = [c for c in names if c in cols]
            raise DataError(f"dataset: pre-tokenized preference rows need {list(names[1:])} (and optionally "
                            f"'{names[0]}', the answers' ids then follow the prompt's); these rows have only {have}.")
        # without a prompt column each answer's ids are the whole sequence (TRL's reward-model layout)
        used = tuple(c for c in names if c in cols)
        return DatasetFormat(kind="tokenized_preference", conversational=False, columns=used,
                             extra_columns=tuple(c for c in columns if c not in used))
    if {"chosen", "rejected"} <= cols:
        kind, used = "preference", [c for c in ("prompt", "chosen", "rejected") if c in cols]
        probe = rows[0]["chosen"]
    elif {"prompt", "completion", "label"} <= cols:
        kind, used, probe = "unpaired_preference", ["prompt", "completion", "label"], rows[0]["completion"]
    elif {"prompt", "completion"} <= cols:
        kind, used, probe = "prompt_completion", ["prompt", "completion"], rows[0]["prompt"]
    elif "text" in cols:
        kind, used, probe = "language_modeling", ["text"], rows[0]["text"]
    elif "messages" in cols:
        kind, used, probe = "language_modeling", ["messages"], rows[0]["messages"]
    elif "prompt" in cols:
        kind, used, probe = "prompt_only", ["prompt"], rows[0]["prompt"]
    else:
        partial = ""
        if "completion" in cols:
            partial = " There is a 'completion' column but no 'prompt' column to go with it."
        elif "chosen" in cols or "rejected" in cols:
            partial = " Preference data needs both 'chosen' and 'rejected'."
        elif "input_ids" in cols or "prompt_input_ids" in cols or "prompt_ids" in cols:
            partial = (" Pre-tokenized 'input_ids' rows are read by SFTTrainer; DPOTrainer reads "
                       f"{list(_TOKENIZED_PAIR_COLUMNS)} (or {list(_TOKENIZED_PAIR_NAMES[1])}); the RL trainers need "
                       "each prompt as text in a 'prompt' column (reward functions and the chat template read it).")
        raise DataError(
            f"dataset: no known format in columns {columns}.{partial}{_suggest(columns)} Known formats: "
            "'text' or 'messages' (language modeling), 'prompt' (prompt-only), 'prompt'+'completion', "
            "'chosen'+'rejected' with optional 'prompt' (preference), 'prompt'+'completion'+'label' "
            "(unpaired preference). See docs/datasets.md."
        )
    # A 'messages' column is conversational by definition, whatever row 0 holds (validation names it).
    conversational = used == ["messages"] or _is_conversation(probe)
    extras = tuple(c for c in columns if c not in used)
    return DatasetFormat(kind=kind, conversational=conversational, columns=tuple(used), extra_columns=extras)


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


class _Problems:
    """Collects row-level problems of one kind so the error lists a few rows instead of stopping at the first."""

    def __init__(self) -> None:
        self.by_key: dict[str, list[int]] = {}
        self.first_msg: dict[str, str] = {}

    def add(self, key: str, row: int, message: str) -> None:
        self.by_key.setdefault(key, []).append(row)
        self.first_msg.setdefault(key, message)

    def raise_if_any(self, n_rows: int | str, *, where: str = "dataset") -> None:
        """`where`: the dataset the rows come from, as the user named it (dataset, eval_dataset)."""
        if not self.by_key:
            return
        lines = []
        for key, rws in self.by_key.items():
            shown = ", ".join(str(r) for r in rws[:_MAX_ROWS_IN_MESSAGE])
            more = f" and {len(rws) - _MAX_ROWS_IN_MESSAGE} more" if len(rws) > _MAX_ROWS_IN_MESSAGE else ""
            lines.append(f"{self.first_msg[key]} (rows {shown}{more} of {n_rows})")
        raise DataError(f"{where} is invalid:\n  - " + "\n  - ".join(lines))


def _blank(text: str) -> bool:
    """Empty to a reader: only whitespace and invisible format characters (Unicode category Cf: zero-width
    spaces and joiners, BOM, soft hyphen, bidi marks and controls)."""
    return all(c.isspace() or unicodedata.category(c) == "Cf" for c in text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(text: str) -> int | None:
    """Index of the first unpaired UTF-16 surrogate (a broken \\ud800-style escape); no tokenizer can encode one."""
    found = _SURROGATE.search(text)
    return found.start() if found else None


def _check_string(p: _Problems, value: str, column: str, row: int, where: str, empty: str) -> bool:
    """Problems any string cell can have; True when it is fine. `empty` is "<what>; <fix>" for a blank value."""
    k = _lone_surrogate(value)
    if k is not None:
        p.add(f"{column}:surrogate", row, f"{where} holds a lone surrogate (U+{ord(value[k]):04X} at character {k}), "
                                          "text that no tokenizer can encode, usually a broken \\u escape in the "
                                          "source file; fix or drop the row")
        return False
    if _blank(value):
        head, fix = empty.split("; ", 1)
        if value.strip():  # a separate kind, so the message is right for every row listed under it
            p.add(f"{column}:invisible", row, f"{head} (it holds only invisible characters such as zero-width "
                                              f"spaces); {fix}")
        else:
            p.add(f"{column}:empty", row, f"{head}; {fix}")
        return False
    return True


def _check_text(p: _Problems, value: Any, column: str, row: int) -> None:
    if value is None:
        p.add(f"{column}:none", row, f"column '{column}' is empty (None) in row {row}; fill it or drop the row")
    elif not isinstance(value, str):
        p.add(f"{column}:type", row, f"column '{column}' must hold a string in row {row}, got "
                                     f"{type(value).__name__}; convert it or use the conversational form (list of turns)")
    else:
        _check_string(p, value, column, row, f"column '{column}' in row {row}",
                      f"column '{column}' is an empty string in row {row}; drop empty rows (dataset.filter) before "
                      "training")


def _check_turns(p: _Problems, value: Any, column: str, row: int, *, part: str, vision: bool = False) -> None:
    """`part`: "full" conversation, "prompt" (ends with a user/tool turn) or "completion" (assistant turns).

    `vision`: content may be a list of image/text parts (checked part by part in `vision.validate_vision`)."""
    if value is None:
        p.add(f"{column}:none", row, f"column '{column}' is empty (None) in row {row}; fill it or drop the row")
        return
    if not isinstance(value, list):
        p.add(f"{column}:type", row, f"column '{column}' must hold a list of {{'role', 'content'}} turns in row {row}, "
                                     f"got {type(value).__name__}")
        return
    if not value:
        p.add(f"{column}:emptylist", row, f"column '{column}' has no turns in row {row}; drop the row")
        return
    for j, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            p.add(f"{column}:turntype", row, f"column '{column}', row {row}, turn {j} is a {type(turn).__name__}, "
                                             "not a {'role': ..., 'content': ...} dict")
            return
        if "role" not in turn or "content" not in turn:
            p.add(f"{column}:turnkeys", row, f"column '{column}', row {row}, turn {j} has keys {sorted(turn)}; "
                                             "each turn needs 'role' and 'content'")
            return
        if turn["role"] not in ROLES:
            p.add(f"{column}:role", row, f"column '{column}', row {row}, turn {j} has role '{turn['role']}'; "
                                         f"use one of {list(ROLES)}")
            return
        content = turn["content"]
        if isinstance(content, list) and vision:
            continue
        if isinstance(content, list):
            p.add(f"{column}:parts", row, f"column '{column}', row {row}, turn {j}: content is a list of parts (a "
                                          "vision-language row), but processing_class is a text tokenizer; pass the "
                                          "vision-language model with its AutoProcessor, or make each content a string")
            return
        if not isinstance(content, str):
            p.add(f"{column}:contenttype", row, f"column '{column}', row {row}, turn {j}: content must be a string, "
                                                f"got {type(content).__name__}")
            return
        if _lone_surrogate(content) is not None or (_blank(content) and turn["role"] != "system"):
            where = f"column '{column}', row {row}, turn {j} ({turn['role']})"
            _check_string(p, content, column, row, where, f"{where} has empty content; drop the turn or the row")
            return
    roles = [t["role"] for t in value]
    if part in ("full", "prompt"):
        for j, r in enumerate(roles):
            if r == "system" and j != 0:
                p.add(f"{column}:system", row, f"column '{column}', row {row}: a system turn at position {j}; "
                                               "the system turn must come first")
                return
        body = [r for r in roles if r != "system"]
        if body and body[0] == "assistant" and part == "full":
            p.add(f"{column}:order", row, f"column '{column}', row {row}: the conversation starts with an assistant "
                                          "turn; it must start with a user turn (after an optional system turn)")
            return
        for a, b in zip(body, body[1:]):
            if a == b and a in ("user", "assistant"):
                p.add(f"{column}:order", row, f"column '{column}', row {row}: two '{a}' turns in a row; user and "
                                              "assistant turns must alternate (merge the two turns)")
                return
    if part == "full" and "assistant" not in roles:
        p.add(f"{column}:noassistant", row, f"column '{column}', row {row} has no assistant turn, so there is "
                                            "nothing to learn from it; add the answer or drop the row")
    if part == "prompt" and roles[-1] == "assistant":
        p.add(f"{column}:promptend", row, f"column '{column}', row {row}: the prompt ends with an assistant turn; "
                                          "a prompt must end with the user (or tool) turn the model answers")
    if part == "completion" and any(r != "assistant" for r in roles):
        p.add(f"{column}:completionrole", row, f"column '{column}', row {row}: a completion may only hold assistant "
                                               f"turns, got roles {roles}")


def _int_list(value: Any) -> list[int] | None:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _check_tokenized(p: _Problems, rows: list[dict[str, Any]], fmt: DatasetFormat, tokenizer: Any,
                     first_row: int = 0) -> None:
    """Pre-tokenized rows: ids are whole numbers inside the vocabulary, every mask is as long as the ids."""
    vocab = len(tokenizer) if tokenizer is not None else None
    for i, r in enumerate(rows, start=first_row):
        ids = _int_list(r.get("input_ids"))
        if not ids:
            p.add("input_ids:type", i, f"column 'input_ids' must hold a non-empty list of token ids in row {i}, got "
                                       f"{type(r.get('input_ids')).__name__}")
            continue
        if vocab is not None and not all(0 <= t < vocab for t in ids):
            bad = next(t for t in ids if not 0 <= t < vocab)
            p.add("input_ids:vocab", i, f"column 'input_ids', row {i}: token id {bad} is outside the tokenizer's "
                                        f"vocabulary (0..{vocab - 1}); the rows were tokenized with another tokenizer")
        for c in ("completion_mask", "labels", "attention_mask"):
            if c not in fmt.columns:
                continue
            values = _int_list(r.get(c))
            if values is None or len(values) != len(ids):
                got = len(values) if values is not None else type(r.get(c)).__name__
                p.add(f"{c}:length", i, f"column '{c}', row {i} has {got} values for {len(ids)} input_ids; a mask "
                                        "needs one value per token")
            elif c != "labels" and any(v not in (0, 1) for v in values):
                p.add(f"{c}:values", i, f"column '{c}', row {i} holds values other than 0/1")
            elif c == "labels" and any(v != -100 and v != t for v, t in zip(values, ids)):
                p.add("labels:shift", i, f"column 'labels', row {i}: a label differs from its input id (labels here "
                                         "are the ids themselves or -100, unshifted, as transformers expects)")


def _check_tokenized_pairs(p: _Problems, rows: list[dict[str, Any]], fmt: DatasetFormat, tokenizer: Any) -> None:
    """Pre-tokenized pairs: each id column a non-empty list of ids inside the vocabulary."""
    vocab = len(tokenizer) if tokenizer is not None else None
    for i, r in enumerate(rows):
        for c in fmt.columns:
            ids = _int_list(r.get(c))
            if not ids:
                p.add(f"{c}:type", i, f"column '{c}' must hold a non-empty list of token ids in row {i}, got "
                                      f"{r.get(c)!r:.40}")
            elif vocab is not None and not all(0 <= t < vocab for t in ids):
                bad = next(t for t in ids if not 0 <= t < vocab)
                p.add(f"{c}:vocab", i, f"column '{c}', row {i}: token id {bad} is outside the tokenizer's vocabulary "
                                       f"(0..{vocab - 1}); the rows were tokenized with another tokenizer")


def validate(rows: list[dict[str, Any]], fmt: DatasetFormat, *, tokenizer: Any = None, first_row: int = 0,
             vision: bool = False) -> None:
    """Check every row of `rows` against `fmt`; raise one DataError listing every kind of problem found.

    `first_row` is the index of `rows[0]` in the whole dataset (a stream is checked a row at a time).
    `vision`: turns may hold lists of image/text parts (`vision.validate_vision` checks them and the images)."""
    p = _Problems()
    n_rows = len(rows) if first_row == 0 else f"the rows read so far, {first_row + len(rows)}"
    if fmt.kind == "tokenized":
        _check_tokenized(p, rows, fmt, tokenizer, first_row)
        p.raise_if_any(n_rows)
        return
    if fmt.kind == "tokenized_preference":
        _check_tokenized_pairs(p, rows, fmt, tokenizer)
        p.raise_if_any(n_rows)
        return
    for i, r in enumerate(rows, start=first_row):
        for c in fmt.columns:
            if c not in r:
                p.add(f"{c}:missing", i, f"column '{c}' is missing from row {i} (row has {sorted(r)})")
        if fmt.kind == "language_modeling":
            if fmt.conversational:
                _check_turns(p, r.get("messages"), "messages", i, part="full", vision=vision)
            else:
                _check_text(p, r.get("text"), "text", i)
            continue
        for c in fmt.columns:
            if c == "label":
                if not isinstance(r.get("label"), bool):
                    p.add("label:type", i, f"column 'label' must be True/False in row {i}, got {r.get('label')!r}")
                continue
            value = r.get(c)
            conv = _is_conversation(value)
            if fmt.conversational:
                if isinstance(value, str):
                    p.add(f"{c}:mixed", i, f"column '{c}' is plain text in row {i} but the dataset is conversational "
                                           "(row 0 holds a list of turns); use one form for all rows and columns")
                    continue
                part = "prompt" if c == "prompt" else ("full" if fmt.kind == "preference" and "prompt" not in fmt.columns
                                                        else "completion")
                _check_turns(p, value, c, i, part=part, vision=vision)
            else:
                if conv:
                    p.add(f"{c}:mixed", i, f"column '{c}' is a list of turns in row {i} but the dataset is plain text "
                                           "(row 0 holds a string); use one form for all rows and columns")
                    continue
                _check_text(p, value, c, i)
    p.raise_if_any(n_rows)
    if fmt.conversational and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"dataset is conversational ({', '.join(fmt.columns)} hold lists of turns) but the tokenizer has no chat "
            "template. Set `tokenizer.chat_template` (e.g. copy one from an instruct model) or convert the rows to "
            "plain text."
        )


# --------------------------------------------------------------------------------------------------
# Tokenization (once; ids kept end to end)
# --------------------------------------------------------------------------------------------------


@dataclass
class TokenizationReport:
    """What tokenization did to the dataset; logged at start-up so nothing happens silently."""

    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated_rows: int = 0
    longest: int = 0
    non_prefix_rows: int = 0
    empty_mask_rows: list[int] = field(default_factory=list)

    def summary(self, max_length: int | None) -> str:
        s = (f"{self.rows} rows, {self.tokens} tokens, {self.loss_tokens} loss tokens "
             f"({100.0 * self.loss_tokens / max(self.tokens, 1):.1f}%), longest {self.longest}")
        if self.truncated_rows:
            s += (f"; {self.truncated_rows} rows ({100.0 * self.truncated_rows / max(self.rows, 1):.1f}%) TRUNCATED to "
                  f"max_length={max_length} (raise max_length to keep them whole)")
        if self.non_prefix_rows:
            s += (f"; {self.non_prefix_rows} rows whose rendered prompt was not a token prefix of prompt+completion "
                  "(tokenized as prompt ids + completion ids instead)")
        return s


def _render(tokenizer: Any, turns: list[dict[str, Any]], *, add_generation_prompt: bool,
            template_kwargs: Mapping[str, Any] | None = None, row: int | None = None) -> str:
    """The chat template's text for `turns`. A template that refuses a row (many raise on a system turn, on
    roles out of order, on a missing tool id) becomes a DataError naming the row, before any model loads."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **dict(template_kwargs or {}))
    except TemplateError as e:
        roles = [t.get("role") for t in turns if isinstance(t, Mapping)]
        fix = (" This template has no system role: merge the system text into the first user turn." if "system" in
               roles and "system" in str(e).lower() else " Change the row or use a template that accepts it.")
        raise DataError(f"row {row}: the tokenizer's chat template refused this conversation (roles {roles}): "
                        f"{type(e).__name__}: {e}.{fix}") from None


def _ids(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _join_prompt_completion(prompt_ids: list[int], full_ids: list[int], completion_ids_fn) -> tuple[list[int], int, bool]:
    """Return (ids, completion start, prompt_was_prefix).

    BPE may merge across the prompt/completion boundary, so the prompt's own ids are not always a
    prefix of the jointly tokenized text. The prompt the model will see at generation time is the
    prompt rendered alone, so we keep those ids and append the completion tokenized on its own.
    """
    n = len(prompt_ids)
    if full_ids[:n] == prompt_ids:
        return full_ids, n, True
    return prompt_ids + completion_ids_fn(), n, False


def _assistant_mask(tokenizer: Any, messages: list[dict[str, Any]], ids: list[int],
                    template_kwargs: Mapping[str, Any] | None, row: int | None = None) -> list[int] | None:
    """Mark the tokens of assistant turns by rendering growing prefixes of the conversation.

    Works with any template whose rendering of turns[:k] is a text prefix of turns[:k+1] (no
    `{% generation %}` markers needed). Returns None when a template breaks that assumption.
    """
    mask = [0] * len(ids)
    for k, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], add_generation_prompt=True, template_kwargs=template_kwargs,
                         row=row) if k else ""
        upto = _render(tokenizer, messages[: k + 1], add_generation_prompt=False, template_kwargs=template_kwargs,
                       row=row)
        b_ids = _ids(tokenizer, before, special=False) if before else []
        u_ids = _ids(tokenizer, upto, special=False)
        if ids[: len(b_ids)] != b_ids or ids[: len(u_ids)] != u_ids:
            return None
        for t in range(len(b_ids), len(u_ids)):
            mask[t] = 1
    return mask


def _finish_example(ids: list[int], mask: list[int], max_length: int | None, report: TokenizationReport,
                    row: int) -> tuple[list[int], list[int]]:
    """Truncate to `max_length`, take position 0 out of the loss, and count the row in `report` (the one place
    SFT's loss mask is finished, for text and pre-tokenized rows alike)."""
    report.longest = max(report.longest, len(ids))
    if max_length is not None and len(ids) > max_length:
        report.truncated_rows += 1
        ids, mask = ids[:max_length], mask[:max_length]
    # Position 0 is never predicted (nothing precedes it); the loss mask must say so, so that the
    # token count Trainer uses for normalisation equals the number of predicted tokens.
    if mask:
        mask = [0, *mask[1:]]
    if sum(mask) == 0:
        report.empty_mask_rows.append(row)
    report.tokens += len(ids)
    report.loss_tokens += sum(mask)
    return ids, mask


def _how_many(bad: list[int], rows: list[Any], first_row: int) -> str:
    """'3 of 100 rows' for a whole dataset; for rows of a stream (first_row > 0) the total is not known."""
    return f"{len(bad)} of {len(rows)} rows" if first_row == 0 else f"{len(bad)} streamed row(s)"


def tokenize_for_sft(
    rows: list[dict[str, Any]],
    fmt: DatasetFormat,
    tokenizer: Any,
    *,
    max_length: int | None,
    completion_only_loss: bool,
    assistant_only_loss: bool,
    template_kwargs: Mapping[str, Any] | None = None,
    keep_extra_columns: bool = False,
    first_row: int = 0,
) -> tuple[list[dict[str, list[int]]], TokenizationReport]:
    """Tokenize SFT rows into `input_ids` and `completion_mask` (1 where the loss applies).

    EOS: plain-text examples get the tokenizer's EOS appended when it is not already there; the
    mask covers it, so the model learns to stop even when pad == eos (the collator never derives
    the loss mask from token ids, only from lengths and this mask).
    """
    if fmt.kind == "tokenized":
        if assistant_only_loss:
            raise DataError("assistant_only_loss=True needs conversational 'messages' rows; pre-tokenized rows carry "
                            "their loss mask in 'completion_mask' or 'labels'.")
        return _tokenized_for_sft(rows, fmt, max_length=max_length, keep_extra_columns=keep_extra_columns,
                                  first_row=first_row)
    if fmt.kind not in ("language_modeling", "prompt_completion"):
        hint = {"preference": "DPOTrainer", "tokenized_preference": "DPOTrainer",
                "unpaired_preference": "a KTO-style trainer",
                "prompt_only": "GRPOTrainer (RL needs only prompts)"}.get(fmt.kind, "another trainer")
        raise DataError(f"SFT needs language-modeling ('text'/'messages') or prompt-completion data; this dataset is "
                        f"{fmt.describe()}. Use {hint}, or add a 'completion' column.")
    if assistant_only_loss and not (fmt.kind == "language_modeling" and fmt.conversational):
        raise DataError("assistant_only_loss=True needs conversational 'messages' rows; this dataset is "
                        f"{fmt.describe()}. For prompt-completion data use completion_only_loss instead.")
    eos = tokenizer.eos_token_id
    if eos is None and not fmt.conversational:
        # Plain text gets EOS appended so the model learns to stop; without one it never would, silently.
        raise DataError("SFT: the tokenizer has no EOS token, so plain-text examples cannot end with one and the "
                        "model would never learn to stop; set tokenizer.eos_token (e.g. to its end-of-turn token).")
    report = TokenizationReport(rows=len(rows))
    out: list[dict[str, list[int]]] = []
    for i, r in enumerate(rows, start=first_row):
        if fmt.kind == "language_modeling" and not fmt.conversational:
            ids = _ids(tokenizer, r["text"], special=True)
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            mask = [1] * len(ids)
        elif fmt.kind == "language_modeling":
            text = _render(tokenizer, r["messages"], add_generation_prompt=False, template_kwargs=template_kwargs, row=i)
            ids = _ids(tokenizer, text, special=False)
            if assistant_only_loss:
                m = _assistant_mask(tokenizer, r["messages"], ids, template_kwargs, row=i)
                if m is None:
                    raise DataError(
                        f"assistant_only_loss: row {i}: the chat template does not render conversations "
                        "incrementally (turns[:k] is not a prefix of turns[:k+1]), so assistant tokens cannot be "
                        "located. Use prompt-completion rows with completion_only_loss instead."
                    )
                mask = m
            else:
                mask = [1] * len(ids)
        elif not fmt.conversational:
            prompt_ids = _ids(tokenizer, r["prompt"], special=True)
            completion = r["completion"]
            full_ids = _ids(tokenizer, r["prompt"] + completion, special=True)
            ids, start, prefix = _join_prompt_completion(
                prompt_ids, full_ids, lambda: _ids(tokenizer, completion, special=False))
            report.non_prefix_rows += 0 if prefix else 1
            if eos is not None and ids[-1] != eos:
                ids = ids + [eos]
            mask = [0] * start + [1] * (len(ids) - start) if completion_only_loss else [1] * len(ids)
        else:
            ids, start, prefix = _conversational_prompt_completion(tokenizer, r, template_kwargs, i)
            report.non_prefix_rows += 0 if prefix else 1
            mask = [0] * start + [1] * (len(ids) - start) if completion_only_loss else [1] * len(ids)
        ids, mask = _finish_example(ids, mask, max_length, report, i)
        out.append({"input_ids": ids, "completion_mask": mask})
    if report.empty_mask_rows:
        rws = report.empty_mask_rows
        shown = ", ".join(map(str, rws[:_MAX_ROWS_IN_MESSAGE]))
        why = (f"the prompt fills max_length={max_length}" if report.truncated_rows else
               "no token is marked for the loss (no assistant turn, or an empty completion)")
        raise DataError(
            f"dataset: {_how_many(rws, rows, first_row)} would have an empty loss mask (rows {shown}): {why}. "
            "Raise max_length, shorten or drop those rows, or set completion_only_loss/assistant_only_loss to False."
        )
    return out, report


def _conversational_prompt_completion(tokenizer: Any, r: dict[str, Any], template_kwargs: Mapping[str, Any] | None,
                                      i: int) -> tuple[list[int], int, bool]:
    """A conversational prompt-completion row's ids, where its completion starts, and whether the rendered prompt
    is a token prefix of the rendered whole."""
    prompt_text = _render(tokenizer, r["prompt"], add_generation_prompt=True, template_kwargs=template_kwargs, row=i)
    full_text = _render(tokenizer, r["prompt"] + r["completion"], add_generation_prompt=False,
                        template_kwargs=template_kwargs, row=i)
    prompt_ids = _ids(tokenizer, prompt_text, special=False)
    full_ids = _ids(tokenizer, full_text, special=False)
    if full_text.startswith(prompt_text):
        return _join_prompt_completion(prompt_ids, full_ids,
                                       lambda: _ids(tokenizer, full_text[len(prompt_text):], special=False))
    # Templates that rewrite earlier turns (e.g. drop <think> blocks): the longest common token prefix is the part
    # the model conditions on.
    start = 0
    while start < min(len(prompt_ids), len(full_ids)) and prompt_ids[start] == full_ids[start]:
        start += 1
    return full_ids, start, False


def _tokenized_for_sft(rows: list[dict[str, Any]], fmt: DatasetFormat, *, max_length: int | None,
                       keep_extra_columns: bool = False,
                       first_row: int = 0) -> tuple[list[dict[str, Any]], TokenizationReport]:
    """Pre-tokenized rows as given: the loss mask from `completion_mask`, else `labels != -100`, else every token
    (position 0 never, as for tokenized text); `attention_mask` zeros (padding a wrapper left in) are dropped."""
    report = TokenizationReport(rows=len(rows))
    out = []
    for i, r in enumerate(rows, start=first_row):
        ids = _int_list(r["input_ids"])
        if "completion_mask" in fmt.columns:
            mask = _int_list(r["completion_mask"])
        elif "labels" in fmt.columns:
            mask = [int(v != -100) for v in _int_list(r["labels"])]
        else:
            mask = [1] * len(ids)
        if "attention_mask" in fmt.columns:
            keep = _int_list(r["attention_mask"])
            ids = [t for t, k in zip(ids, keep) if k]
            mask = [m for m, k in zip(mask, keep) if k]
        ids, mask = _finish_example(ids, mask, max_length, report, i)
        out.append({"input_ids": ids, "completion_mask": mask,
                    **({c: r[c] for c in fmt.extra_columns} if keep_extra_columns else {})})
    if report.empty_mask_rows:
        rws = report.empty_mask_rows
        raise DataError(f"dataset: {_how_many(rws, rows, first_row)} (pre-tokenized) have no token in the loss (rows "
                        f"{', '.join(map(str, rws[:_MAX_ROWS_IN_MESSAGE]))}); check their completion_mask/labels.")
    return out, report


# --------------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------------


class SFTCollator:
    """Turn tokenized examples into a batch. Labels come from `completion_mask`, never from `input_ids == pad`.

    padding_free=False: right-padded [B, T] batch with `attention_mask`.
    padding_free=True: one [1, sum(L)] row; `position_ids` restart at 0 for each example and
    `cu_seq_lens` marks the boundaries, so packed examples cannot attend to each other.
    """

    def __init__(self, pad_token_id: int, *, padding_free: bool = False, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.padding_free = padding_free
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, Any]:
        import torch

        if self.padding_free:
            ids, labels, pos, cu = [], [], [], [0]
            for ex in examples:
                x, m = list(ex["input_ids"]), list(ex["completion_mask"])
                ids += x
                labels += [t if k else -100 for t, k in zip(x, m)]
                # A packed row (from `packing`) carries the lengths of the examples inside it.
                for n in ex.get("seq_lens") or [len(x)]:
                    pos += list(range(n))
                    cu.append(cu[-1] + n)
            return {
                "input_ids": torch.tensor([ids], dtype=torch.long),
                "labels": torch.tensor([labels], dtype=torch.long),
                "position_ids": torch.tensor([pos], dtype=torch.long),
                "cu_seq_lens": torch.tensor(cu, dtype=torch.int32),
            }
        longest = max(len(ex["input_ids"]) for ex in examples)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        n = len(examples)
        input_ids = torch.full((n, longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, longest), -100, dtype=torch.long)
        attention_mask = torch.zeros((n, longest), dtype=torch.long)
        for b, ex in enumerate(examples):
            x = torch.as_tensor(ex["input_ids"], dtype=torch.long)
            m = torch.as_tensor(ex["completion_mask"], dtype=torch.bool)
            input_ids[b, : len(x)] = x
            labels[b, : len(x)] = torch.where(m, x, torch.full_like(x, -100))
            attention_mask[b, : len(x)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of example indices into bins of at most `capacity` tokens.

    Deterministic (ties broken by index), so a resumed run sees the same bins.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    space: list[int] = []
    for i in order:
        n = lengths[i]
        best, best_left = -1, None
        for b, left in enumerate(space):
            if n <= left and (best_left is None or left - n < best_left):
                best, best_left = b, left - n
        if best < 0:
            bins.append([i])
            space.append(capacity - n)
        else:
            bins[best].append(i)
            space[best] -= n
    return bins


# --------------------------------------------------------------------------------------------------
# Preference data (DPO)
# --------------------------------------------------------------------------------------------------


def split_preference(row: dict[str, Any], fmt: DatasetFormat, i: int) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a preference row; an implicit prompt is taken from the shared start.

    Conversational rows without a 'prompt' column must differ only in their last (assistant) turn;
    otherwise the two sides answer different conversations, which is a data error, not a preference.
    """
    if "prompt" in fmt.columns:
        return row["prompt"], row["chosen"], row["rejected"]
    chosen, rejected = row["chosen"], row["rejected"]
    if fmt.conversational:
        if chosen[:-1] != rejected[:-1]:
            at = next(j for j, (a, b) in enumerate(zip(chosen, rejected)) if a != b) if any(
                a != b for a, b in zip(chosen[:-1], rejected[:-1])) else min(len(chosen), len(rejected)) - 1
            raise DataError(
                f"row {i}: 'chosen' and 'rejected' have different prompts (they differ at turn {at}, before the last "
                "turn). Both must be the same conversation up to the final assistant turn; or give an explicit "
                "'prompt' column.")
        if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
            raise DataError(f"row {i}: the last turn of 'chosen' and 'rejected' must be the assistant's answer.")
        return chosen[:-1], [chosen[-1]], [rejected[-1]]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    cut = chosen.rfind(" ", 0, n) + 1 if n < len(chosen) or n < len(rejected) else n  # back to a word boundary
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _finish_pair(prompt_ids: list[int], sides: list[list[int]], max_length: int | None, report: TokenizationReport,
                 row: int) -> dict[str, list[int]]:
    """Truncate a pair to `max_length` (the prompt kept whole, the answers' ends cut) and count it in `report`."""
    longest = len(prompt_ids) + max(len(s) for s in sides)
    report.longest = max(report.longest, longest)
    if max_length is not None and longest > max_length:
        report.truncated_rows += 1
        room = max_length - len(prompt_ids)
        if room < 1:
            report.empty_mask_rows.append(row)
            room = 1
        sides = [s[:room] for s in sides]
    report.tokens += 2 * len(prompt_ids) + sum(len(s) for s in sides)
    report.loss_tokens += sum(len(s) for s in sides)
    return {"prompt_ids": prompt_ids, "chosen_ids": sides[0], "rejected_ids": sides[1]}


def tokenize_for_preference(
    rows: list[dict[str, Any]],
    fmt: DatasetFormat,
    tokenizer: Any,
    *,
    max_length: int | None,
    template_kwargs: Mapping[str, Any] | None = None,
    allow_empty_prompt: bool = False,
    encode: Any = None,
) -> tuple[list[dict[str, Any]], TokenizationReport, list[int]]:
    """Preference rows -> {prompt_ids, chosen_ids, rejected_ids} (completion ids after the shared prompt).

    Returns (examples, report, identical_rows): identical_rows lists rows whose chosen equals their
    rejected (no preference to learn; the caller warns). Truncation keeps the prompt and cuts the
    completions' ends, and is reported. `encode(row, text) -> ids` turns a conversational row's rendered text
    into ids (default: the tokenizer; vision rows: the processor, which expands the row's images).
    """
    if encode is None:
        def encode(row: int, text: str) -> list[int]:
            return _ids(tokenizer, text, special=False)
    if fmt.kind not in ("preference", "tokenized_preference"):
        raise DataError(f"DPO needs preference data ('chosen' and 'rejected', optional 'prompt'); this dataset is "
                        f"{fmt.describe()}.")
    eos = getattr(tokenizer, "tokenizer", tokenizer).eos_token_id  # (a processor's is its tokenizer's)
    report = TokenizationReport(rows=len(rows))
    out, identical = [], []
    for i, r in enumerate(rows):
        if fmt.kind == "tokenized_preference":
            # as given: no template, no EOS added (a wrapper's ids are what it wants trained on); without a prompt
            # column the prompt is empty and each answer is a whole sequence (allow_empty_prompt: a reward model)
            names = dict(zip(("prompt", "chosen", "rejected"),
                             next(n for n in _TOKENIZED_PAIR_NAMES if n[1] in fmt.columns)))
            prompt_ids = _int_list(r[names["prompt"]]) if names["prompt"] in fmt.columns else []
            sides = [_int_list(r[names["chosen"]]), _int_list(r[names["rejected"]])]
            if not prompt_ids and not allow_empty_prompt:
                raise DataError(f"row {i}: no prompt ids (column '{names['prompt']}' missing or empty); DPO compares "
                                "the answers' log-probs given their prompt, so it needs the prompt's ids apart from "
                                f"the answers'; add a '{names['prompt']}' column.")
            if sides[0] == sides[1]:
                identical.append(i)
            out.append(_finish_pair(prompt_ids, sides, max_length, report, i))
            continue
        prompt, chosen, rejected = split_preference(r, fmt, i)
        if chosen == rejected:
            identical.append(i)
        sides = []
        if fmt.conversational:
            prompt_text = _render(tokenizer, prompt, add_generation_prompt=True, template_kwargs=template_kwargs,
                                  row=i) if prompt else ""
            prompt_ids = encode(i, prompt_text) if prompt_text else []
            for completion in (chosen, rejected):
                full_text = _render(tokenizer, list(prompt) + list(completion), add_generation_prompt=False,
                                    template_kwargs=template_kwargs, row=i)
                if not full_text.startswith(prompt_text):
                    raise DataError(f"row {i}: the chat template does not render the prompt as a prefix of "
                                    "prompt + answer; give plain-text rows or a template that renders incrementally.")
                full_ids = encode(i, full_text)
                rest = full_text[len(prompt_text):]
                ids, start, prefix = _join_prompt_completion(prompt_ids, full_ids, lambda rest=rest: encode(i, rest))
                report.non_prefix_rows += 0 if prefix else 1
                sides.append(ids[start:])
        else:
            prompt_ids = _ids(tokenizer, prompt, special=True) if prompt else (
                [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else [])
            for completion in (chosen, rejected):
                full_ids = _ids(tokenizer, prompt + completion, special=True)
                ids, start, prefix = _join_prompt_completion(
                    prompt_ids, full_ids, lambda completion=completion: _ids(tokenizer, completion, special=False))
                report.non_prefix_rows += 0 if prefix else 1
                comp = ids[start:]
                if eos is not None and (not comp or comp[-1] != eos):
                    comp = comp + [eos]
                sides.append(comp)
        if not prompt_ids:
            raise DataError(f"row {i}: the prompt is empty, so the first completion token has no context; give a "
                            "'prompt' column or rows whose chosen and rejected share a beginning.")
        out.append(_finish_pair(prompt_ids, sides, max_length, report, i))
    if report.empty_mask_rows:
        rws = report.empty_mask_rows
        raise DataError(f"dataset: {len(rws)} rows have prompts of max_length={max_length} tokens or more (rows "
                        f"{', '.join(map(str, rws[:_MAX_ROWS_IN_MESSAGE]))}), leaving no room for the answers. Raise "
                        "max_length or shorten those prompts.")
    return out, report, identical


# ------------------------------------------------------------------------------------------------
# Prompt datasets for RL trainers (GRPO, PPO, async GRPO)
# ------------------------------------------------------------------------------------------------


def prompt_rows(dataset: Any, tokenizer: Any, *, trainer: str) -> tuple[list[dict[str, Any]], DatasetFormat]:
    """Rows of an RL prompt dataset, validated: a 'prompt' column (plain or conversational); every
    other column is passed to the reward functions. A completion column, if any, is ignored."""
    rows = normalize_rows(as_rows(dataset))
    fmt = detect_format(rows)
    if "prompt" not in fmt.columns:
        raise DataError(f"{trainer} needs a 'prompt' column; this dataset is {fmt.describe()}. Rename the column "
                        "that holds the prompts to 'prompt' (other columns are passed to reward functions).")
    prompt_fmt = DatasetFormat("prompt_only", fmt.conversational, ("prompt",),
                               tuple(c for c in rows[0] if c != "prompt"))
    # Extra columns reach the reward functions as keyword arguments next to these three.
    clash = sorted(set(prompt_fmt.extra_columns) & {"prompts", "completions", "completion_ids"})
    if clash:
        raise DataError(f"{trainer}: the dataset has a column named {clash}, which is also an argument every reward "
                        "function receives (prompts, completions, completion_ids); rename the column.")
    vision = getattr(tokenizer, "image_processor", None) is not None  # a processor (vision.is_vision_processor)
    if getattr(tokenizer, "tokenizer", tokenizer).eos_token_id is None:
        raise DataError(f"{trainer}: the tokenizer has no EOS token, so no completion could ever end (and the default "
                        "stop token would be None); set tokenizer.eos_token, or a chat template's end token.")
    validate(rows, prompt_fmt, tokenizer=tokenizer, vision=vision)
    if prompt_fmt.conversational:
        for i, r in enumerate(rows):
            if not any(m.get("role") == "user" for m in r["prompt"]):
                raise DataError(f"{trainer}: row {i}'s prompt has no user turn (roles "
                                f"{[m.get('role') for m in r['prompt']]}); the model would answer a system message "
                                "alone. Add the user's message.")
    return rows, prompt_fmt


def tokenize_prompts(rows: list[dict[str, Any]], tokenizer: Any, *, max_prompt_length: int | None,
                     chat_template_kwargs: dict | None = None) -> tuple[list[list[int]], int]:
    """Prompt token ids, rendered once (chat template with the generation prompt for conversations);
    prompts longer than `max_prompt_length` keep their last tokens. Returns (ids, number cut)."""
    out, cut = [], 0
    for i, r in enumerate(rows):
        if isinstance(r["prompt"], list):
            text = _render(tokenizer, r["prompt"], add_generation_prompt=True, template_kwargs=chat_template_kwargs,
                           row=i)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(tokenizer(r["prompt"], add_special_tokens=True)["input_ids"])
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids, cut = ids[-max_prompt_length:], cut + 1
        out.append(ids)
    return out, cut
