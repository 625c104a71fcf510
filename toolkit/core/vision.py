"""Vision-language data: images next to conversational turns, validated, tokenized once, batched per processor.

The format is TRL's: conversational turns whose `content` is a list of parts, `{"type": "image"}` or
`{"type": "text", "text": ...}`, and an `images` column holding the row's images in the order their
placeholders appear (PIL images, file paths, bytes, or the `{"bytes", "path"}` dicts of a
`datasets.Image` column). A single image may come in an `image` column instead.

What happens to a row, once, before any model loads:

1. `validate_vision`: every part, every image (opens, has pixels, a mode RGB can represent without loss
   of meaning) and the count of image placeholders against the count of images; each problem is a
   `DataError` naming the row and the fix.
2. `tokenize_vision_for_sft`: the chat template renders the turns, the processor expands each image
   placeholder to the tokens the model sees for that image (their number depends on the image's size
   for dynamic-resolution models such as Qwen2-VL), and the loss mask is built on those expanded ids.
   Vision tokens (the image tokens and the markers around them) are never in the loss.
3. `VisionCollator`: right-pads the ids and runs the processor's image processor on the batch's
   images, which returns pixel tensors in the layout that model family expects (Qwen2-VL's flattened
   patches with `image_grid_thw`, Idefics3's `[batch, images, C, H, W]` with a pixel mask).

Images are kept as decoded RGB images between tokenization and batching; the pixel tensors are
recomputed per batch (they are much larger than the images) rather than stored.
"""

from __future__ import annotations

__all__ = [
    "IMAGE_INPUT_KEYS",
    "ListDataset",
    "VisionCollator",
    "attach_image_features",
    "collapse_images",
    "encode_images",
    "freeze_vision_tower",
    "image_inputs_for_rows",
    "image_tokens_per_example",
    "is_vision_processor",
    "pixel_inputs",
    "prompt_image_inputs",
    "row_images",
    "text_tokenizer",
    "tokenize_vision_for_preference",
    "tokenize_vision_for_sft",
    "tokenize_vision_prompts",
    "validate_vision",
    "vision_token_ids",
]

import io
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .data import DatasetFormat, SFTCollator, TokenizationReport, _finish_example, _Problems, _render
from .errors import ConfigError, DataError, ToolkitError

logger = logging.getLogger(__name__)

# Model inputs a processor may add for images; the trainers pass exactly these to the model's forward.
IMAGE_INPUT_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes", "mm_token_type_ids",
                    "image_attention_mask", "mm_encoder_outputs")
IMAGE_COLUMNS = ("images", "image")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Modes RGB represents without changing what the picture means. 16-bit and float images ("I;16", "I", "F") would
# be clipped to 8 bits, silently; they are refused so the user chooses the scaling.
_CONVERTIBLE_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "RGBX", "La")


def is_vision_processor(processing_class: Any) -> bool:
    """True for a multimodal processor (an image processor next to a tokenizer), False for a tokenizer."""
    return getattr(processing_class, "image_processor", None) is not None and \
        getattr(processing_class, "tokenizer", None) is not None


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer inside a processor, or the tokenizer itself: where pad/eos ids and decoding live."""
    return processing_class.tokenizer if is_vision_processor(processing_class) else processing_class


def _image_column(row: Mapping[str, Any]) -> str | None:
    return next((c for c in IMAGE_COLUMNS if c in row), None)


def _placeholders(turns: Any) -> int:
    """Image parts in a list of turns."""
    if not isinstance(turns, list):
        return 0
    n = 0
    for turn in turns:
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if isinstance(content, list):
            n += sum(1 for part in content if isinstance(part, Mapping) and part.get("type") == "image")
    return n


def _open(value: Any) -> Any:
    """A PIL image from what a dataset may hold; raises ValueError/OSError with the reason."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):  # datasets.Image(decode=False)
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    elif isinstance(value, (str, os.PathLike)):
        if not os.path.exists(value):
            raise FileNotFoundError(f"no file '{value}'")
        image = Image.open(value)
    else:
        raise TypeError(f"a {type(value).__name__} is not an image (give a PIL image, a file path or bytes)")
    image.load()  # decode now: a truncated file fails here, not in the middle of training
    return image


def _rgb(image: Any, where: str) -> Any:
    if image.width == 0 or image.height == 0:
        raise ValueError(f"{where} has no pixels ({image.width}x{image.height})")
    if image.mode not in _CONVERTIBLE_MODES:
        raise ValueError(f"{where} has mode '{image.mode}' (16-bit or float pixels), which RGB cannot hold without "
                         "clipping; scale it to 8 bits yourself (e.g. image.point(lambda v: v / 256).convert('L'))")
    return image if image.mode == "RGB" else image.convert("RGB")


def row_images(row: Mapping[str, Any], i: int) -> list[Any]:
    """The row's images as RGB PIL images, in placeholder order (a DataError names the row and the image)."""
    column = _image_column(row)
    if column is None or row[column] is None:
        return []
    value = row[column]
    values = [value] if column == "image" or not isinstance(value, (list, tuple)) else list(value)
    out = []
    for k, v in enumerate(values):
        where = f"row {i}, column '{column}', image {k}"
        try:
            out.append(_rgb(_open(v), where))
        except DataError:
            raise
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"{where}: cannot be used as an image ({type(e).__name__}: {e}); fix or drop the row.") \
                from None
    return out


def validate_vision(rows: list[dict[str, Any]], fmt: DatasetFormat, processing_class: Any, *, first_row: int = 0,
                    trainer: str = "SFT", where: str = "dataset") -> list[list[Any]]:
    """Check the image side of every row and return each row's decoded images (so they are opened once).

    A text tokenizer with image rows, a processor without a chat template, parts that are neither image nor
    text, images in a completion, placeholders that do not match the images, and images that do not open are
    each a DataError listing the rows."""
    vision = is_vision_processor(processing_class)
    columns = [c for c in fmt.columns if c in ("messages", "prompt", "completion", "chosen", "rejected")]
    if not vision:
        # a text model with pictures in an image column would ignore them silently; a column of strings (URLs,
        # ids a reward function reads) is left alone
        bad = [(i, _image_column(r)) for i, r in enumerate(rows, start=first_row)
               if _image_column(r) and _looks_like_images(r[_image_column(r)])]
        if bad:
            raise DataError(f"{trainer}: rows {[i for i, _ in bad[:5]]} carry images (column '{bad[0][1]}') but "
                            "processing_class is a text tokenizer, so the images would be ignored; train a "
                            "vision-language model with its AutoProcessor, or drop the column.")
        return [[] for _ in rows]
    if not fmt.conversational:
        raise DataError(f"{trainer}: vision-language rows must be conversational (turns whose content lists "
                        f"{{'type': 'image'}} and {{'type': 'text', ...}} parts); this dataset is {fmt.describe()}.")
    if not getattr(processing_class, "chat_template", None):
        raise DataError(f"{trainer}: the processor has no chat template, so image parts cannot be placed in the "
                        "text; set processor.chat_template (the model's own, from its Hub repository).")
    p = _Problems()
    images: list[list[Any]] = []
    for i, r in enumerate(rows, start=first_row):
        images.append([])
        bad_part = _bad_part(r, columns)
        if bad_part:
            p.add("vision:part", i, f"row {i}: {bad_part}")
            continue
        if "completion" in columns and _placeholders(r.get("completion")):
            p.add("vision:completion", i, f"row {i}: an image part in the completion; the model reads images, it "
                                          "does not write them: move the image into the prompt")
            continue
        column = _image_column(r)
        raw = r.get(column) if column else None
        n_images = 0 if raw is None else (1 if column == "image" or not isinstance(raw, (list, tuple)) else len(raw))
        n_parts = max(_placeholders(r.get(c)) for c in columns) if fmt.kind == "preference" else \
            sum(_placeholders(r.get(c)) for c in columns)
        if n_parts != n_images:
            held = f"'{column}' holds {n_images}" if column else "there is no 'images' column"
            p.add("vision:count", i, f"row {i}: {n_parts} image placeholder(s) in the turns but {held}; each "
                                     "{'type': 'image'} part takes the next image of the row, so the counts must match")
            continue
        try:
            images[-1] = row_images(r, i)
        except DataError as e:
            p.add("vision:open", i, str(e).rstrip("."))
    p.raise_if_any(len(rows) if first_row == 0 else f"the rows read so far, {first_row + len(rows)}", where=where)
    return images


def _looks_like_images(value: Any) -> bool:
    """A PIL image, encoded bytes, a datasets.Image dict, or a non-empty list of those or of file paths."""
    from PIL import Image

    if isinstance(value, (Image.Image, bytes, bytearray)) or isinstance(value, Mapping) and ("bytes" in value or
                                                                                             "path" in value):
        return True
    if isinstance(value, (str, os.PathLike)):  # a path to a picture; any other string (a URL, an id) is not
        return str(value).lower().endswith(_IMAGE_SUFFIXES) and "://" not in str(value)
    return isinstance(value, (list, tuple)) and bool(value) and all(_looks_like_images(v) for v in value)


def _bad_part(row: Mapping[str, Any], columns: list[str]) -> str | None:
    """What is wrong with the row's content parts, if anything."""
    for c in columns:
        turns = row.get(c)
        for j, turn in enumerate(turns if isinstance(turns, list) else []):
            content = turn.get("content") if isinstance(turn, Mapping) else None
            if not isinstance(content, list):
                continue
            if not content:
                return f"column '{c}', turn {j} has an empty list of parts"
            for k, part in enumerate(content):
                if not isinstance(part, Mapping) or "type" not in part:
                    return f"column '{c}', turn {j}, part {k} is not a {{'type': ...}} dict"
                if part["type"] == "text":
                    if not isinstance(part.get("text"), str):
                        return f"column '{c}', turn {j}, part {k}: a text part needs a 'text' string"
                elif part["type"] != "image":
                    return (f"column '{c}', turn {j}, part {k} has type '{part['type']}'; only 'image' and 'text' "
                            "parts are read (video and audio are not supported)")
            if turn.get("role") == "assistant" and any(part["type"] == "image" for part in content) and \
                    c in ("messages", "chosen", "rejected"):
                return f"column '{c}', turn {j}: an image in an assistant turn; the model does not write images"
    return None


def collapse_images(processor: Any, ids: Sequence[int], images: Sequence[Any]) -> list[int]:
    """`ids` with each image's expansion (as `_expand` makes it) put back to the processor's one placeholder
    token: the prompt an engine that expands images itself (vLLM's multimodal inputs) must be given, so that its
    expansion gives back `ids` exactly. An image whose tokens are not found is a ToolkitError."""
    token = getattr(processor, "image_token", None)
    if not token:
        raise ConfigError(f"vision: {type(processor).__name__} names no image_token, so its expanded images cannot "
                          "be handed to an engine that expands them itself; use the transformers backend.")
    placeholder = text_tokenizer(processor)(token, add_special_tokens=False)["input_ids"]
    out, start = list(ids), 0
    for k, image in enumerate(images):
        span = _expand(processor, token, [image])
        at = next((i for i in range(start, len(out) - len(span) + 1) if out[i:i + len(span)] == span), -1)
        if at < 0:
            raise ToolkitError(f"vision: image {k}'s {len(span)} tokens are not in the prompt's ids; the prompt was "
                               "not expanded by this processor.")
        out[at:at + len(span)] = placeholder
        start = at + len(placeholder)
    return out


def vision_token_ids(processor: Any) -> frozenset[int]:
    """Ids of the tokens an image expands to (image tokens and the markers around them), found by expanding one
    image through the processor: whatever family, none of them is ever a training target."""
    from PIL import Image

    tok = text_tokenizer(processor)
    with_image = _render(processor, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                         add_generation_prompt=False)
    without = _render(processor, [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                      add_generation_prompt=False)
    start = 0
    while start < min(len(with_image), len(without)) and with_image[start] == without[start]:
        start += 1
    end = 0
    while end < min(len(with_image), len(without)) - start and with_image[-1 - end] == without[-1 - end]:
        end += 1
    placeholder = with_image[start:len(with_image) - end]
    ids = processor(text=[placeholder], images=[[Image.new("RGB", (56, 56))]])["input_ids"][0]
    added = set(tok.added_tokens_decoder)
    found = {int(t) for t in ids if int(t) in added}
    found |= {t for t in (getattr(processor, "image_token_id", None),) if t is not None}
    return frozenset(found - {tok.eos_token_id, tok.pad_token_id, tok.bos_token_id})


def _expand(processor: Any, text: str, images: list[Any], row: int | None = None) -> list[int]:
    """The ids the model sees for `text`: each image placeholder replaced by that image's tokens (`text` may be a
    part of a row, e.g. the completion alone: it takes as many of the row's images as it has placeholders). What
    the processor refuses (an image of an extreme aspect ratio, a placeholder typed into a text part) is a
    DataError naming the row."""
    token = getattr(processor, "image_token", None)
    images = images[:text.count(token)] if token else images
    try:
        out = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
    except (ValueError, TypeError, RuntimeError, IndexError) as e:
        typed = f" (its text holds '{token}' {text.count(token)} times: type no placeholder into a text part)" \
            if token and token in text else ""
        raise DataError(f"row {row}: the processor could not expand the row's images into tokens{typed}: "
                        f"{type(e).__name__}: {e}") from None
    return [int(t) for t in out["input_ids"][0]]


def tokenize_vision_for_sft(rows: list[dict[str, Any]], images: list[list[Any]], fmt: DatasetFormat, processor: Any,
                            *, max_length: int | None, completion_only_loss: bool, assistant_only_loss: bool,
                            template_kwargs: Mapping[str, Any] | None = None,
                            first_row: int = 0) -> tuple[list[dict[str, Any]], TokenizationReport]:
    """Vision rows into `input_ids` (placeholders expanded), `completion_mask` (vision tokens never 1) and their
    `images`. Truncation that would cut into or drop an image is refused (the model would get pixels without
    their tokens); cutting text after the last image is reported like any truncation."""
    if fmt.kind not in ("language_modeling", "prompt_completion"):
        raise DataError(f"SFT needs 'messages' or prompt-completion rows; this dataset is {fmt.describe()}.")
    if assistant_only_loss and fmt.kind != "language_modeling":
        raise DataError("assistant_only_loss=True needs conversational 'messages' rows; for prompt-completion data "
                        "use completion_only_loss.")
    vision_ids = vision_token_ids(processor)
    report = TokenizationReport(rows=len(rows))
    out: list[dict[str, Any]] = []
    cut_images: list[int] = []
    for i, (r, imgs) in enumerate(zip(rows, images), start=first_row):
        if fmt.kind == "language_modeling":
            turns = r["messages"]
            ids = _expand(processor, _render(processor, turns, add_generation_prompt=False,
                                             template_kwargs=template_kwargs, row=i), imgs, i)
            mask = [1] * len(ids)
            if assistant_only_loss:
                mask = _assistant_mask(processor, turns, ids, imgs, template_kwargs, i)
        else:
            prompt_text = _render(processor, r["prompt"], add_generation_prompt=True, template_kwargs=template_kwargs,
                                  row=i)
            full_text = _render(processor, r["prompt"] + r["completion"], add_generation_prompt=False,
                                template_kwargs=template_kwargs, row=i)
            prompt_ids, ids = _expand(processor, prompt_text, imgs, i), _expand(processor, full_text, imgs, i)
            if ids[:len(prompt_ids)] != prompt_ids:
                raise DataError(f"row {i}: the rendered prompt is not a token prefix of prompt + completion, so "
                                "the completion cannot be located; check the chat template.")
            start = len(prompt_ids) if completion_only_loss else 0
            mask = [0] * start + [1] * (len(ids) - start)
        mask = [0 if t in vision_ids else m for t, m in zip(ids, mask)]
        last_vision = max((k for k, t in enumerate(ids) if t in vision_ids), default=-1)
        if max_length is not None and last_vision >= max_length:
            cut_images.append(i)
            continue
        ids, mask = _finish_example(ids, mask, max_length, report, i)
        out.append({"input_ids": ids, "completion_mask": mask, "images": imgs})
    if cut_images:
        raise DataError(f"dataset: rows {cut_images[:5]} ({len(cut_images)} in all) have image tokens beyond "
                        f"max_length={max_length}; truncating would leave an image without its tokens. Raise "
                        "max_length, use fewer or smaller images (the processor's max_pixels), or drop those rows.")
    if report.empty_mask_rows:
        raise DataError(f"dataset: rows {report.empty_mask_rows[:5]} would have no token in the loss (no assistant "
                        "text, or max_length cuts it all); fix those rows or raise max_length.")
    return out, report


def tokenize_vision_for_preference(rows: list[dict[str, Any]], images: list[list[Any]], fmt: DatasetFormat,
                                   processor: Any, *, max_length: int | None,
                                   template_kwargs: Mapping[str, Any] | None = None):
    """`data.tokenize_for_preference` with each row's images expanded into its prompt ids; every example keeps
    its `images` (the prompt's, shared by chosen and rejected)."""
    from .data import tokenize_for_preference

    if not fmt.conversational:
        raise DataError(f"DPO: vision-language rows must be conversational; this dataset is {fmt.describe()}.")
    examples, report, identical = tokenize_for_preference(
        rows, fmt, processor, max_length=max_length, template_kwargs=template_kwargs,
        encode=lambda i, text: _expand(processor, text, images[i], i))
    vision_ids = vision_token_ids(processor)
    for i, (e, imgs) in enumerate(zip(examples, images)):
        for side in ("chosen", "rejected"):
            if any(t in vision_ids for t in e[f"{side}_ids"]):
                raise DataError(f"row {i}, column '{side}': the answer holds image tokens (a placeholder typed into "
                                "its text?); images belong in the prompt.")
        e["images"] = imgs
    return examples, report, identical


def _assistant_mask(processor: Any, turns: list[dict[str, Any]], ids: list[int], images: list[Any],
                    template_kwargs: Mapping[str, Any] | None, row: int) -> list[int]:
    """1 on the tokens of assistant turns, found by expanding growing prefixes of the conversation (each with the
    images its turns hold)."""
    mask = [0] * len(ids)
    for k, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        n_before = _placeholders(turns[:k])
        before = _expand(processor, _render(processor, turns[:k], add_generation_prompt=True,
                                            template_kwargs=template_kwargs, row=row),
                         images[:n_before], row) if k else []
        upto = _expand(processor, _render(processor, turns[:k + 1], add_generation_prompt=False,
                                          template_kwargs=template_kwargs, row=row), images[:n_before], row)
        if ids[:len(before)] != before or ids[:len(upto)] != upto:
            raise DataError(f"assistant_only_loss: row {row}: the chat template does not render the conversation "
                            "incrementally, so assistant tokens cannot be located; use prompt-completion rows.")
        for t in range(len(before), len(upto)):
            mask[t] = 1
    return mask


class VisionCollator:
    """Right-padded ids, labels from `completion_mask` (never from pad ids), and the batch's pixel tensors from the
    processor's image processor in its family's layout; `mm_token_type_ids` where the model takes them."""

    def __init__(self, processor: Any, pad_token_id: int):
        self.processor = processor
        self.pad_token_id = pad_token_id
        self.text = SFTCollator(pad_token_id)  # the ids, labels and mask exactly as for text rows (padded)
        self.wants_token_types = "mm_token_type_ids" in getattr(processor, "model_input_names", ())

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, Any]:
        import torch

        batch: dict[str, Any] = self.text(examples)
        input_ids = batch["input_ids"]
        images = [list(ex["images"]) for ex in examples]
        if any(images):
            # The image processor batches per its family (rows without images included, where the family allows).
            pixels = self.processor.image_processor(images=images, return_tensors="pt")
            batch.update({k: v for k, v in pixels.items() if k in IMAGE_INPUT_KEYS})
        if self.wants_token_types:
            batch["mm_token_type_ids"] = torch.tensor(self.processor.create_mm_token_type_ids(input_ids.tolist()),
                                                      dtype=torch.long)
        return batch


class ListDataset:
    """Examples holding images, kept as Python objects (a `datasets.Dataset` would re-encode every image)."""

    def __init__(self, examples: list[dict[str, Any]]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[i]


# Where families keep their vision encoder and the projector into the language model (inside `model.model`
# for transformers >= 5). Qwen2-VL's projector (`merger`) lives inside its vision tower.
_TOWERS = ("visual", "vision_tower", "vision_model")
_PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector")
_LANGUAGE_MODELS = ("language_model", "text_model")


def _find(model: Any, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names]


def freeze_vision_tower(model: Any, peft_config: Any, *, freeze: bool, train_projector: bool) -> Any:
    """Fix the vision encoder's weights (and the projector's unless `train_projector`) and return the LoRA config
    with its targets kept inside the language model.

    Idefics3's vision layers use the same module names as the text layers (`q_proj`, ...), so a target list
    such as ["q_proj", "v_proj"] would put adapters into the vision tower too; with `freeze` it becomes a regex
    over the language model's modules (logged). A regex target of your own is used as given."""
    towers = _find(model, _TOWERS)
    if not towers:
        from .errors import ConfigError

        raise ConfigError(f"model: {type(model).__name__} has no vision tower under any of {_TOWERS}, but "
                          "processing_class is a vision-language processor; is the model a vision-language model? A "
                          "text model needs a tokenizer.")
    projectors = _find(model, _PROJECTORS)
    if freeze:
        for _, tower in towers:
            tower.requires_grad_(False)
        for _, projector in projectors:
            projector.requires_grad_(train_projector)
        trainable = "the projector stays trainable" if train_projector and projectors else "the projector frozen too"
        logger.info("vision: the vision tower (%s) is frozen (freeze_vision_tower=True); %s.",
                    ", ".join(n for n, _ in towers), trainable)
    elif not train_projector:
        for _, projector in projectors:
            projector.requires_grad_(False)
    if peft_config is None or not freeze:
        return peft_config
    targets = getattr(peft_config, "target_modules", None)
    language = [n for n, _ in _find(model, _LANGUAGE_MODELS)]
    if not language or targets is None or isinstance(targets, str) and targets != "all-linear":
        return peft_config
    import copy
    import re

    names = r"\w+_proj" if targets == "all-linear" else "|".join(re.escape(t) for t in sorted(targets))
    scope = "|".join(re.escape(n.rsplit(".", 1)[-1]) for n in language)
    regex = rf".*\.({scope})\.layers\.\d+\..*\.({names})"
    peft_config = copy.copy(peft_config)
    peft_config.target_modules = regex
    if train_projector and projectors:
        # a frozen base under LoRA: the projector trains as a whole module next to the adapters
        saved = list(getattr(peft_config, "modules_to_save", None) or [])
        peft_config.modules_to_save = saved + [n.rsplit(".", 1)[-1] for n, _ in projectors
                                               if n.rsplit(".", 1)[-1] not in saved]
    logger.info("vision: LoRA targets %s kept inside the language model: target_modules=%r%s.", targets, regex,
                f", modules_to_save={peft_config.modules_to_save}" if train_projector and projectors else "")
    return peft_config


# ------------------------------------------------------------------------------------------------
# Images encoded once, reused by every row that shows them (DPO: chosen and rejected; GRPO: a group).
# ------------------------------------------------------------------------------------------------

def pixel_inputs(processor: Any, images: list[list[Any]]) -> dict[str, Any]:
    """The image processor's tensors for one list of images per example (its family's layout)."""
    if not any(images):
        return {}
    out = processor.image_processor(images=[list(x) for x in images], return_tensors="pt")
    return {k: v for k, v in out.items() if k in IMAGE_INPUT_KEYS}


def _vision_base(model: Any) -> Any:
    """The model part with `get_image_features` (transformers >= 5: `model.model` of a *ForConditionalGeneration)."""
    from .models import unwrap_model

    base = unwrap_model(model)
    for candidate in (getattr(base, "model", None), base):
        if candidate is not None and hasattr(candidate, "get_image_features"):
            return candidate
    raise DataError(f"vision: {type(base).__name__} has no get_image_features; it is not a vision-language model "
                    "transformers knows how to encode images for.")


def image_tokens_per_example(model: Any, input_ids: Any, row_example: list[int], examples: int) -> list[int] | None:
    """How many image-feature positions each example's ids hold (the model's `image_token_id`, counted in the
    first row showing the example), or None when the model names no image token."""
    token = getattr(getattr(_vision_base(model), "config", None), "image_token_id", None)
    if token is None:
        return None
    first = {}
    for r, e in enumerate(row_example):
        first.setdefault(e, r)
    return [int((input_ids[first[e]] == token).sum()) if e in first else 0 for e in range(examples)]


def encode_images(model: Any, pixels: Mapping[str, Any], images_per_example: list[int],
                  tokens_per_example: list[int] | None = None) -> list[Any]:
    """Run the vision tower and projector once: one [tokens, H] feature tensor per example (all of its images'
    tokens, in order; empty for an example without images), as the forward takes them back through
    `mm_encoder_outputs`. `tokens_per_example` (`image_tokens_per_example`): the image positions each example's
    ids hold; the features are split by them whatever blocks the family returns (per image: Qwen2-VL, LLaVA,
    LLaVA-NeXT's crops packed per image; per example: Idefics3). Without it, by the shape of `pixel_values`."""
    import inspect

    base = _vision_base(model)
    params = inspect.signature(type(base).get_image_features).parameters  # (the class's: an instance may be wrapped)
    kwargs = {k: v for k, v in pixels.items() if k in params}
    pooled = base.get_image_features(**kwargs, return_dict=True).pooler_output
    pieces = list(pooled) if isinstance(pooled, (tuple, list)) else list(pooled.unbind(0))
    pieces = [p.reshape(-1, p.shape[-1]) for p in pieces]
    out = _Features(_split_features(pieces, pixels, images_per_example, tokens_per_example, type(base).__name__))
    # the forward takes back what its own get_image_features gave: a tuple, or (Idefics3 before transformers 5.20)
    # one tensor, which a tuple would not be
    out.as_tensor = not isinstance(pooled, (tuple, list))
    return out


class _Features(list):
    """Per-example image features (`encode_images`), and whether the family's forward wants them as one tensor."""

    as_tensor = False


def _split_features(pieces: list[Any], pixels: Mapping[str, Any], images_per_example: list[int],
                    tokens_per_example: list[int] | None, family: str) -> list[Any]:
    import torch

    if tokens_per_example is not None and sum(p.shape[0] for p in pieces) == sum(tokens_per_example):
        # the order of the features is the order of the image positions in the rows, example after example (what
        # the model's own masked scatter relies on): split by each example's count
        return list(torch.cat(pieces).split(tokens_per_example))
    # pixel values with an example dimension ([examples, images, C, H, W]: Idefics3) come back per example; flat
    # ones (Qwen2-VL's patches, LLaVA's [images, C, H, W]) per image
    per_example = getattr(pixels.get("pixel_values"), "dim", lambda: 0)() == 5
    if not per_example and len(pieces) == sum(images_per_example):  # per image: each example's images joined
        out, k = [], 0
        for n in images_per_example:
            out.append(torch.cat(pieces[k:k + n]) if n else pieces[0].new_zeros((0, pieces[0].shape[-1])))
            k += n
        return out
    if per_example and len(pieces) == len(images_per_example):
        return pieces
    raise ValueError(f"vision: {family}.get_image_features gave {len(pieces)} feature blocks for "
                     f"{len(images_per_example)} examples holding {sum(images_per_example)} images.")


def image_inputs_for_rows(features: list[Any], pixels: Mapping[str, Any], images_per_example: list[int],
                          row_example: list[int], input_ids: Any, processor: Any) -> dict[str, Any]:
    """Forward keyword arguments for rows that show already-encoded images: row r shows example
    `row_example[r]`'s images, whose features are `features[row_example[r]]` (`encode_images`). The features are
    reused, not recomputed (autograd sums their gradients)."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    starts = [0]
    for n in images_per_example:
        starts.append(starts[-1] + n)
    chosen = [k for e in row_example for k in range(starts[e], starts[e + 1])]  # the rows' images, in row order
    out: dict[str, Any] = {}
    if chosen:
        pooled: Any = tuple(features[e] for e in row_example if images_per_example[e])
        if getattr(features, "as_tensor", False):  # [1, tokens, H]: torch.cat over its first dimension is [tokens, H]
            pooled = torch.cat(pooled).unsqueeze(0)
        out["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=pooled)}
        if "image_grid_thw" in pixels:  # Qwen2-VL's 3-D positions need each image's grid
            out["image_grid_thw"] = pixels["image_grid_thw"][torch.tensor(chosen)]
    if "mm_token_type_ids" in getattr(processor, "model_input_names", ()):
        out["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(input_ids.tolist()),
                                                dtype=torch.long, device=input_ids.device)
    return out


def prompt_image_inputs(model: Any, processor: Any, images: list[list[Any]], ids: Any, mask: Any,
                        positions: Any) -> tuple[dict[str, Any], Any]:
    """(forward kwargs, position ids) for prefilling left-padded prompts `ids` that show `images` (one list per
    prompt): each prompt's images encoded once; for M-RoPE models (Qwen2-VL) the 3-D positions [3, B, T], where
    text after an image continues from the image's largest position (decoding then goes on from each row's
    largest position), else `positions` unchanged."""
    pixels = {k: v.to(ids.device) for k, v in pixel_inputs(processor, images).items()}
    counts = [len(x) for x in images]
    tokens = image_tokens_per_example(model, ids, list(range(len(images))), len(images))
    kwargs = image_inputs_for_rows(encode_images(model, pixels, counts, tokens), pixels, counts,
                                   list(range(len(images))), ids, processor)
    base = _vision_base(model)
    if hasattr(base, "get_rope_index") and "image_grid_thw" in kwargs:
        positions, _ = base.get_rope_index(ids, mm_token_type_ids=kwargs["mm_token_type_ids"],
                                           image_grid_thw=kwargs["image_grid_thw"], attention_mask=mask)
    return kwargs, positions


def attach_image_features(model: Any, batch: dict[str, Any], processor: Any) -> dict[str, Any]:
    """`batch` (rows of prompt + completion) with the forward's image inputs: the images of each distinct prompt
    (`pixels`, `images_per_example`) encoded once by `model`, reused by every row (`row_example`) that shows
    them. A batch without images is returned as it is."""
    if not batch.get("pixels"):
        return batch
    device = batch["input_ids"].device
    pixels = {k: v.to(device) for k, v in batch["pixels"].items()}
    counts = batch["images_per_example"]
    tokens = image_tokens_per_example(model, batch["input_ids"], batch["row_example"], len(counts))
    rows = image_inputs_for_rows(encode_images(model, pixels, counts, tokens), pixels, counts, batch["row_example"],
                                 batch["input_ids"], processor)
    return {**{k: v for k, v in batch.items() if k not in ("pixels", "images_per_example", "row_example")}, **rows}


def tokenize_vision_prompts(rows: list[dict[str, Any]], images: list[list[Any]], processor: Any, *,
                            max_prompt_length: int | None,
                            chat_template_kwargs: Mapping[str, Any] | None = None,
                            where: str = "dataset") -> tuple[list[list[int]], int]:
    """RL prompts with their images expanded, as the model sees them at generation and in the loss. A prompt
    longer than `max_prompt_length` is refused rather than cut from the left (the cut would take its image's
    tokens, or the image itself, away). Returns (ids, 0)."""
    out, long_rows = [], []
    for i, (r, imgs) in enumerate(zip(rows, images)):
        text = _render(processor, r["prompt"], add_generation_prompt=True, template_kwargs=chat_template_kwargs, row=i)
        ids = _expand(processor, text, imgs, i)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            long_rows.append((i, len(ids)))
        out.append(ids)
    if long_rows:
        raise DataError(f"{where}: rows {[i for i, _ in long_rows[:5]]} have prompts of up to "
                        f"{max(n for _, n in long_rows)} tokens with their images expanded, more than "
                        f"max_prompt_length={max_prompt_length}; cutting them would "
                        "cut an image. Raise max_prompt_length or use smaller images (the processor's max_pixels).")
    return out, 0
