"""Vision-language SFT on two tiny model families (Qwen2-VL: dynamic resolution and M-RoPE; Idefics3: fixed
image tokens): parity with TRL's SFTTrainer, vision tokens out of the loss, the frozen tower, LoRA in the
language model only, exact resume, loading by path, and bad vision inputs refused by row."""

import copy
import io
import math

import pytest
import torch
from builders import StopAt
from PIL import Image

from toolkit import ConfigError, DataError, SFTConfig, SFTTrainer
from toolkit.core import vision
from toolkit.core.checkpoint import COMPLETE_MARKER
from toolkit.testing import tiny_idefics3, tiny_llava_next, tiny_model, tiny_qwen2_vl, tiny_tokenizer

FAMILIES = {"qwen2_vl": tiny_qwen2_vl, "idefics3": tiny_idefics3}
COLOURS = [((255, 0, 0), "red"), ((0, 160, 0), "green"), ((0, 0, 255), "blue")]


def image(i: int, size=None) -> Image.Image:
    # different sizes, so Qwen2-VL rows get different numbers of image tokens
    return Image.new("RGB", size or (60 + 10 * (i % 4), 50 + 7 * (i % 3)), COLOURS[i % 3][0])


def pc_rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
             "completion": [{"role": "assistant", "content": [{"type": "text", "text": COLOURS[i % 3][1]}]}],
             "images": [image(i)]} for i in range(n)]


def messages_rows(n: int) -> list[dict]:
    # two images in the first user turn, a second exchange without images
    return [{"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yes" if i % 2 else "no"}]},
        {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        {"role": "assistant", "content": "Look at them."}],
        "images": [image(i), image(i if i % 2 else i + 1)]} for i in range(n)]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=3, logging_steps=1,
                learning_rate=1e-3, save_strategy="no", seed=0, report_to="none", disable_tqdm=True)
    base.update(kw)
    return SFTConfig(**base)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_trains_with_the_vision_tower_frozen(tmp_path, family):
    model, processor = FAMILIES[family]()
    before = {k: v.clone() for k, v in model.named_parameters()}
    t = SFTTrainer(model, cfg(tmp_path, max_steps=6), train_dataset=pc_rows(6), processing_class=processor)
    t.train()
    ls = losses(t)
    assert all(math.isfinite(x) for x in ls) and ls[-1] < ls[0]
    changed = {k for k, v in model.named_parameters() if not torch.equal(v, before[k])}
    tower = {k for k in before if ".visual." in k or ".vision_model." in k}
    projector = {k for k in tower | set(before) if ".merger." in k or ".connector." in k}
    assert tower and projector
    assert not (changed & (tower - projector)), "the frozen vision tower changed"
    assert projector <= changed, "the projector should train (train_projector=True)"
    assert {k for k in before if "language_model" in k or "text_model" in k} <= changed | {
        k for k in before if "rotary" in k}


def test_unfreezing_the_tower_trains_it(tmp_path):
    model, processor = tiny_qwen2_vl()
    before = {k: v.clone() for k, v in model.named_parameters()}
    SFTTrainer(model, cfg(tmp_path, max_steps=2, freeze_vision_tower=False), train_dataset=pc_rows(6),
               processing_class=processor).train()
    assert not torch.equal(dict(model.named_parameters())["model.visual.patch_embed.proj.weight"],
                           before["model.visual.patch_embed.proj.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_trl(tmp_path, family):
    """TRL's own SFTTrainer (its vision collator, its compute_loss) on the same rows: same ids, loss and grads."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    model, processor = FAMILIES[family]()
    reference = copy.deepcopy(model)
    rows = pc_rows(3)
    ours = SFTTrainer(model, cfg(tmp_path, freeze_vision_tower=False), train_dataset=rows, processing_class=processor)
    batch = ours.data_collator([ours.train_dataset[i] for i in range(3)])
    model.train()
    model.zero_grad()
    logps, _ = ours.compute_token_logps(model, batch)
    loss = ours.compute_sft_loss(logps, None)
    loss.backward()

    theirs = trl.SFTTrainer(model=reference, train_dataset=Dataset.from_list(rows), processing_class=processor,
                            args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", max_length=None,
                                               bf16=False, use_cpu=True))
    trl_batch = theirs.data_collator([theirs.train_dataset[i] for i in range(3)])
    reference.train()
    reference.zero_grad()
    trl_loss = theirs.compute_loss(reference, trl_batch)
    trl_loss.backward()

    for b in range(3):  # the same expanded ids per row (TRL left-pads prompts, then flushes left)
        ours_ids = batch["input_ids"][b][batch["attention_mask"][b].bool()]
        trl_ids = trl_batch["input_ids"][b][trl_batch["attention_mask"][b].bool()]
        assert torch.equal(ours_ids, trl_ids)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-6, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def vision_tokens_in_the_loss(trainer, ids) -> int:
    """How many labels of a batch of the whole dataset are vision tokens (must be 0)."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    labels = batch["labels"]
    return int(sum(((labels == t)).sum() for t in ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tokens_are_never_in_the_loss_and_the_check_catches_it(tmp_path, family, monkeypatch):
    _, processor = FAMILIES[family]()
    ids = vision.vision_token_ids(processor)
    assert processor.image_token_id in ids and len(ids) >= 2  # the image token and its markers
    # full loss on 'messages' rows: every token is a target except the vision tokens
    t = SFTTrainer(FAMILIES[family]()[0], cfg(tmp_path), train_dataset=messages_rows(4), processing_class=processor)
    batch = t.data_collator([t.train_dataset[0]])
    assert (batch["input_ids"] == processor.image_token_id).sum() > 0
    assert vision_tokens_in_the_loss(t, ids) == 0
    # mutation: without the vision-token mask, the same check must see them
    monkeypatch.setattr(vision, "vision_token_ids", lambda p: frozenset())
    mutated = SFTTrainer(FAMILIES[family]()[0], cfg(tmp_path), train_dataset=messages_rows(4),
                         processing_class=processor)
    assert vision_tokens_in_the_loss(mutated, ids) > 0


def test_assistant_only_loss_with_images_marks_only_assistant_text(tmp_path):
    model, processor = tiny_qwen2_vl()
    t = SFTTrainer(model, cfg(tmp_path, assistant_only_loss=True), train_dataset=messages_rows(2),
                   processing_class=processor)
    ex = t.train_dataset[0]
    tok = processor.tokenizer
    targets = [i for i, m in zip(ex["input_ids"], ex["completion_mask"]) if m]
    text = tok.decode(targets)
    assert "no" in text and "Look at them." in text
    assert "Same colour?" not in text and "Why?" not in text
    t.train()
    assert all(math.isfinite(x) for x in losses(t))


def test_qwen2_vl_token_count_follows_the_image_size(tmp_path):
    _, processor = tiny_qwen2_vl()
    small, large = pc_rows(1), pc_rows(1)
    small[0]["images"] = [image(0, (56, 56))]
    large[0]["images"] = [image(0, (112, 112))]
    counts = []
    for rows in (small, large):
        t = SFTTrainer(tiny_qwen2_vl()[0], cfg(tmp_path), train_dataset=rows, processing_class=processor)
        counts.append(t.train_dataset[0]["input_ids"].count(processor.image_token_id))
    assert counts == [4, 16]


def test_lora_stays_in_the_language_model_and_the_projector_trains(tmp_path):
    from peft import LoraConfig

    model, processor = tiny_idefics3()  # its vision layers share the text layers' module names (q_proj, ...)
    t = SFTTrainer(model, cfg(tmp_path, max_steps=3, learning_rate=1e-2), train_dataset=pc_rows(6),
                   processing_class=processor,
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    named = dict(t.model.named_parameters())
    lora = [k for k in named if "lora_" in k]
    assert lora and all("text_model" in k for k in lora)
    trainable = {k for k, p in named.items() if p.requires_grad}
    assert any("connector" in k for k in trainable)
    assert not any("vision_model" in k for k in trainable)
    t.train()
    assert all(math.isfinite(x) for x in losses(t))


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_resume_equals_uninterrupted(tmp_path, family):
    build = FAMILIES[family]
    rows = pc_rows(12)
    kw = dict(max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2, num_train_epochs=1)
    _, processor = build()
    straight = SFTTrainer(build()[0], cfg(tmp_path / "a", **kw), train_dataset=rows, processing_class=processor)
    straight.train()
    first = SFTTrainer(build()[0], cfg(tmp_path / "b", **kw), train_dataset=rows, processing_class=processor,
                       callbacks=[StopAt(2)])
    first.train()
    assert (tmp_path / "b" / "out" / "checkpoint-2" / COMPLETE_MARKER).exists()
    second = SFTTrainer(build(seed=7)[0], cfg(tmp_path / "b", **kw), train_dataset=rows, processing_class=processor)
    second.train(resume_from_checkpoint=True)
    assert losses(first) + losses(second)[2:] == pytest.approx(losses(straight), rel=1e-6)
    for (k, p), (_, q) in zip(straight.model.named_parameters(), second.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=k)


def test_a_saved_vision_model_loads_by_path_with_its_processor(tmp_path):
    model, processor = tiny_idefics3()
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    t = SFTTrainer(str(tmp_path / "vlm"), cfg(tmp_path, max_steps=1), train_dataset=pc_rows(3))
    assert type(t.model).__name__ == "Idefics3ForConditionalGeneration"
    assert vision.is_vision_processor(t.processing_class)
    t.train()


# ------------------------------------------------------------------------------------------ bad inputs

def png_bytes(mode="RGB", size=(30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def _with(row_changes=None, n=3, rows=None):
    rows = rows if rows is not None else pc_rows(n)
    if row_changes:
        row_changes(rows[1])
    return rows


def _set(key, value):
    return lambda r: r.__setitem__(key, value)


def _prompt_parts(parts):
    return lambda r: r.__setitem__("prompt", [{"role": "user", "content": parts}])


BAD_VISION = {
    "missing image": (_set("images", []), "1 image placeholder(s) in the turns but 'images' holds 0"),
    "no images column": (lambda r: r.pop("images"), "there is no 'images' column"),
    "two placeholders one image": (_prompt_parts([{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]),
                                   "2 image placeholder(s)"),
    "unreadable file": (_set("images", ["/nonexistent/cat.png"]), "no file '/nonexistent/cat.png'"),
    "bytes that are not an image": (_set("images", [b"not a png"]), "cannot be used as an image"),
    "a number for an image": (_set("images", [42]), "a int is not an image"),
    "16-bit image": (_set("images", [Image.new("I;16", (30, 30))]), "mode 'I;16'"),
    "zero-size image": (_set("images", [Image.new("RGB", (0, 0))]), "no pixels"),
    "video part": (_prompt_parts([{"type": "video"}, {"type": "text", "text": "?"}]), "type 'video'"),
    "text part without text": (_prompt_parts([{"type": "image"}, {"type": "text"}]), "needs a 'text' string"),
    "part not a dict": (_prompt_parts(["an image", {"type": "image"}]), "is not a {'type': ...} dict"),
    "empty parts": (_prompt_parts([]), "empty list of parts"),
    "image in the completion": (lambda r: r.__setitem__("completion", [{"role": "assistant", "content": [
        {"type": "image"}, {"type": "text", "text": "x"}]}]), "an image part in the completion"),
    "truncated png": (_set("images", [png_bytes()[:60]]), "cannot be used as an image"),
}


@pytest.mark.parametrize("case", BAD_VISION)
def test_bad_vision_rows_are_refused_by_row_before_anything_is_written(tmp_path, case):
    change, words = BAD_VISION[case]
    _, processor = tiny_qwen2_vl()
    # a model name that cannot load: the error must come before the model is looked at
    with pytest.raises(DataError) as e:
        SFTTrainer("no-such/vision-model", cfg(tmp_path), train_dataset=_with(change), processing_class=processor)
    assert words in str(e.value) and "row 1" in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_images_with_a_text_model_are_refused(tmp_path):
    rows = [{"prompt": "What colour?", "completion": "red", "images": [image(0)]}] * 2
    with pytest.raises(DataError, match="carry images .* text tokenizer"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=rows, processing_class=tiny_tokenizer())
    with pytest.raises(DataError, match="content is a list of parts .* text tokenizer"):
        SFTTrainer(tiny_model(), cfg(tmp_path), train_dataset=pc_rows(2), processing_class=tiny_tokenizer())
    assert not (tmp_path / "out").exists()


def test_a_processor_without_chat_template_and_plain_text_vision_rows_are_refused(tmp_path):
    _, processor = tiny_idefics3()
    processor.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        SFTTrainer("no-such/vision-model", cfg(tmp_path), train_dataset=pc_rows(2), processing_class=processor)
    _, processor = tiny_idefics3()
    with pytest.raises(DataError, match="must be conversational"):
        SFTTrainer("no-such/vision-model", cfg(tmp_path), processing_class=processor,
                   train_dataset=[{"prompt": "<image>What?", "completion": "red", "images": [image(0)]}] * 2)
    assert not (tmp_path / "out").exists()


def test_images_cut_by_max_length_and_packing_are_refused(tmp_path):
    model, processor = tiny_qwen2_vl()
    with pytest.raises(DataError, match="image tokens beyond max_length=6"):
        SFTTrainer(model, cfg(tmp_path, max_length=6), train_dataset=pc_rows(2), processing_class=processor)
    with pytest.raises(ConfigError, match="packing/padding_free: not available for vision"):
        SFTTrainer(model, cfg(tmp_path, packing=True, max_length=256), train_dataset=pc_rows(2),
                   processing_class=processor)


def test_mixed_modes_and_datasets_image_dicts_are_read(tmp_path):
    """Palette, greyscale and RGBA images are converted to RGB; datasets.Image(decode=False) dicts and file
    paths are opened (the refusals above are for what cannot be read without changing meaning)."""
    path = tmp_path / "grey.png"
    Image.new("L", (40, 40), 128).save(path)
    rows = pc_rows(4)
    rows[0]["images"] = [Image.new("P", (40, 40))]
    rows[1]["images"] = [{"bytes": png_bytes("RGBA"), "path": None}]
    rows[2]["images"] = [str(path)]
    _, processor = tiny_idefics3()
    t = SFTTrainer(tiny_idefics3()[0], cfg(tmp_path, max_steps=1), train_dataset=rows, processing_class=processor)
    assert all(im.mode == "RGB" for ex in t.train_dataset.examples for im in ex["images"])
    t.train()


# ------------------------------------------------------------------------------------------------ DPO

def pref_rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": COLOURS[i % 3][1]}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": COLOURS[(i + 1) % 3][1]}]}],
             "images": [image(i)]} for i in range(n)]


def dpo_cfg(tmp_path, **kw):
    from toolkit import DPOConfig

    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
                learning_rate=1e-3, save_strategy="no", seed=0, report_to="none", disable_tqdm=True, beta=0.3)
    base.update(kw)
    return DPOConfig(**base)


class CountEncodes:
    """Counts the images that go through the vision tower (the model's own get_image_features)."""

    def __init__(self, model):
        self.images = 0
        base = vision._vision_base(model)
        original = base.get_image_features

        def counted(*args, **kwargs):
            out = original(*args, **kwargs)
            pooled = out.pooler_output
            self.images += len(pooled) if isinstance(pooled, (tuple, list)) else pooled.shape[0]
            return out

        base.get_image_features = counted


@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_equals_trl_and_encodes_each_pairs_images_once(tmp_path, family):
    from datasets import Dataset

    from toolkit import DPOTrainer

    trl = pytest.importorskip("trl")
    model, processor = FAMILIES[family]()
    reference = copy.deepcopy(model)
    ours = DPOTrainer(model, args=dpo_cfg(tmp_path, freeze_vision_tower=False), train_dataset=pref_rows(4),
                      processing_class=processor)
    batch = ours.data_collator([ours.train_dataset[i] for i in range(3)])
    g = torch.Generator().manual_seed(0)
    ref_c, ref_r = -torch.rand(3, generator=g) * 20 - 5, -torch.rand(3, generator=g) * 20 - 5
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_c, ref_r
    counter = CountEncodes(model)
    model.train()
    model.zero_grad()
    loss = ours.compute_loss(model, batch)
    loss.backward()
    assert counter.images == 3  # three pairs, one image each: chosen and rejected share the encoding

    theirs = trl.DPOTrainer(model=reference, ref_model=copy.deepcopy(reference), processing_class=processor,
                            args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, use_cpu=True, bf16=False,
                                               report_to="none", max_length=None),
                            train_dataset=Dataset.from_list(pref_rows(4)))
    theirs.precompute_ref_logps = True
    trl_batch = theirs.data_collator([theirs.train_dataset[i] for i in range(3)])
    trl_counter = CountEncodes(reference)
    reference.train()
    reference.zero_grad()
    trl_loss = theirs._compute_loss(reference, {**trl_batch, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r},
                                    return_outputs=False)
    trl_loss = trl_loss[0] if isinstance(trl_loss, tuple) else trl_loss
    trl_loss.backward()
    assert trl_counter.images == 6  # TRL encodes each pair's image twice
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_trains_and_resumes_exactly(tmp_path, family):
    from toolkit import DPOTrainer

    build = FAMILIES[family]
    _, processor = build()
    before = {k: v.clone() for k, v in build()[0].named_parameters()}
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    straight = DPOTrainer(build()[0], args=dpo_cfg(tmp_path / "a", **kw), train_dataset=pref_rows(8),
                          processing_class=processor)
    straight.train()
    assert all(math.isfinite(h["loss"]) for h in straight.state.log_history if "loss" in h)
    changed = [k for k, v in straight.model.named_parameters() if not torch.equal(v, before[k])]
    assert changed and not any(".visual.blocks" in k or "vision_model.encoder" in k for k in changed)
    first = DPOTrainer(build()[0], args=dpo_cfg(tmp_path / "b", **kw), train_dataset=pref_rows(8),
                       processing_class=processor, callbacks=[StopAt(2)])
    first.train()
    # the same base model (DPO's reference is a copy of it); that the checkpoint's weights are loaded at all is
    # shown by the SFT resume test, which starts from another seed
    second = DPOTrainer(build()[0], args=dpo_cfg(tmp_path / "b", **kw), train_dataset=pref_rows(8),
                        processing_class=processor)
    second.train(resume_from_checkpoint=True)
    for (k, p), (_, q) in zip(straight.model.named_parameters(), second.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=k)


def test_a_third_family_llava_next_trains_with_sft_dpo_and_grpo(tmp_path):
    """LLaVA-NeXT (any-resolution crops, [images, crops, C, H, W] pixel values, a different token count per image
    shape): SFT, DPO and GRPO train with the tower frozen and the projector trained."""
    from toolkit import DPOTrainer, GRPOTrainer

    for name, make in (
        ("sft", lambda m, p: SFTTrainer(m, cfg(tmp_path / "sft", max_steps=3), train_dataset=pc_rows(6),
                                        processing_class=p)),
        ("dpo", lambda m, p: DPOTrainer(m, args=dpo_cfg(tmp_path / "dpo", max_steps=3), train_dataset=pref_rows(6),
                                        processing_class=p)),
        ("grpo", lambda m, p: GRPOTrainer(m, reward_funcs=length_reward, args=grpo_cfg(tmp_path / "grpo"),
                                          train_dataset=prompt_rows_with_images(4), processing_class=p)),
    ):
        model, processor = tiny_llava_next()
        before = {k: v.clone() for k, v in model.named_parameters()}
        t = make(model, processor)
        t.train()
        logged = [h["loss"] for h in t.state.log_history if "loss" in h]
        assert logged and all(math.isfinite(x) for x in logged), name
        changed = {k for k, v in model.named_parameters() if not torch.equal(v, before[k])}
        assert not any("vision_tower" in k for k in changed), name
        assert any("multi_modal_projector" in k for k in changed) and any("language_model" in k for k in changed), name


def test_dpo_precomputed_reference_with_images(tmp_path):
    from toolkit import DPOTrainer

    model, processor = tiny_idefics3()
    live = DPOTrainer(tiny_idefics3()[0], args=dpo_cfg(tmp_path / "live"), train_dataset=pref_rows(4),
                      processing_class=processor)
    batch = live.data_collator([live.train_dataset[i] for i in range(4)])
    expected_chosen, expected_rejected = live.compute_reference_logps(batch)
    t = DPOTrainer(model, args=dpo_cfg(tmp_path, precompute_ref_log_probs=True), train_dataset=pref_rows(4),
                   processing_class=processor)
    assert t.ref_model is None
    stored = torch.tensor([[e["ref_chosen_logps"], e["ref_rejected_logps"]] for e in t.train_dataset.examples])
    torch.testing.assert_close(stored, torch.stack([expected_chosen, expected_rejected], 1), rtol=1e-5, atol=1e-5)
    t.train()


def test_dpo_and_grpo_refuse_image_rows_for_a_text_model(tmp_path):
    from toolkit import DPOTrainer, GRPOTrainer

    with pytest.raises(DataError, match="content is a list of parts"):
        DPOTrainer(tiny_model(), args=dpo_cfg(tmp_path), train_dataset=pref_rows(2),
                   processing_class=tiny_tokenizer())
    text_pairs = [{"prompt": "What colour?", "chosen": "red", "rejected": "blue", "image": image(0)}] * 2
    with pytest.raises(DataError, match="carry images \\(column 'image'\\) but processing_class is a text"):
        DPOTrainer(tiny_model(), args=dpo_cfg(tmp_path), train_dataset=text_pairs, processing_class=tiny_tokenizer())
    text_prompts = [{"prompt": "What colour?", "images": ["a.png"]}] * 4
    with pytest.raises(DataError, match="carry images \\(column 'images'\\)"):
        GRPOTrainer(tiny_model(), reward_funcs=length_reward, args=grpo_cfg(tmp_path),
                    train_dataset=text_prompts, processing_class=tiny_tokenizer())
    assert not (tmp_path / "out").exists()
    # a column of strings a reward function reads (a URL, an id) is not taken for pictures
    urls = [{"prompt": "What colour?", "images": ["https://example.org/a.png", "id-17"]}] * 4
    GRPOTrainer(tiny_model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                args=grpo_cfg(tmp_path), train_dataset=urls, processing_class=tiny_tokenizer())


# ------------------------------------------------------------------------------------------------ GRPO

def prompt_rows_with_images(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
             "answer": COLOURS[i % 3][1], "images": [image(i)]} for i in range(n)]


def grpo_cfg(tmp_path, **kw):
    from toolkit import GRPOConfig

    base = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, logging_steps=1, learning_rate=1e-3, report_to="none", disable_tqdm=True,
                save_strategy="no", seed=0, beta=0.04)
    base.update(kw)
    return GRPOConfig(**base)


SEEN_IMAGES: list = []


def length_reward(completions, images, **kw):
    SEEN_IMAGES.extend(images)  # the rewards get each row's images as a column
    return [float(len(c[0]["content"]) % 3) for c in completions]


def _prompt(processor, i):
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                            "text": "Colour?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    return vision._expand(processor, text, [image(i)])


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_trains_with_images_and_rewards_see_them(tmp_path, family):
    from toolkit import GRPOTrainer

    model, processor = FAMILIES[family]()
    before = {k: v.clone() for k, v in model.named_parameters()}
    SEEN_IMAGES.clear()
    t = GRPOTrainer(model, reward_funcs=length_reward, args=grpo_cfg(tmp_path, max_steps=3),
                    train_dataset=prompt_rows_with_images(6), processing_class=processor)
    t.train()
    logged = [h for h in t.state.log_history if "reward" in h]
    assert len(logged) == 3 and all(math.isfinite(h["loss"]) for h in logged)
    changed = {k for k, v in model.named_parameters() if not torch.equal(v, before[k])}
    assert changed and not any(".visual.blocks" in k or "vision_model.encoder" in k for k in changed)
    assert len(SEEN_IMAGES) == 3 * 4 and all(isinstance(x, list) and isinstance(x[0], Image.Image)
                                             for x in SEEN_IMAGES)


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_is_token_exact_and_encodes_each_groups_images_once(tmp_path, family):
    """The ids the loss sees are the expanded prompt (image tokens as the processor made them) + the sampled ids;
    the vision tower runs once per prompt at generation and once per group in each training forward."""
    from toolkit import GRPOTrainer

    model, processor = FAMILIES[family]()
    t = GRPOTrainer(model, reward_funcs=length_reward, args=grpo_cfg(tmp_path, per_device_train_batch_size=8),
                    train_dataset=prompt_rows_with_images(4), processing_class=processor)
    sampled = []
    generate = t.generation_backend.generate

    def recording(prompts, params, **kw):
        out = generate(prompts, params, **kw)
        sampled.extend((list(p), list(c.token_ids)) for p, g in zip(prompts, out) for c in g)
        return out

    t.generation_backend.generate = recording
    counter = CountEncodes(model)
    rollout = t.generate_rollout([0, 1])
    assert counter.images == 2  # two prompts, one image each, for 8 samples
    assert [(rollout.prompt_ids[r], rollout.completion_ids[r]) for r in range(8)] == sampled
    assert all(rollout.prompt_ids[r] == t.prompt_ids[[0, 1][r // 4]] for r in range(8))
    assert sum(1 for x in t.prompt_ids[0] if x == processor.image_token_id) >= 4
    counter.images = 0
    micro = t._split(rollout)[0]
    batch = vision.attach_image_features(model, micro, processor)
    assert counter.images == 2  # the training forward: once per group, not once per completion
    for r in range(len(micro["row_example"])):
        row = batch["input_ids"][r][batch["attention_mask"][r].bool()].tolist()
        assert row == rollout.prompt_ids[r] + rollout.completion_ids[r]
    assert not any(t_ in vision.vision_token_ids(processor) for c in rollout.completion_ids for t_ in c)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampler_and_trainer_log_probs_agree_with_images(family):
    """Generation with images (Qwen2-VL: M-RoPE positions, continued from each row's largest after the image;
    left-padded prompts of different lengths) gives the log-probs a training forward gives. Vision tokens are
    banned from sampling, which renormalises the sampler's distribution, so the check runs with the ban off."""
    from toolkit.core.generation import SamplingParams, TransformersBackend
    from toolkit.core.packing import completion_logps, pack_completions

    model, processor = FAMILIES[family]()
    prompts, images = [_prompt(processor, i) for i in range(3)], [[image(i)] for i in range(3)]
    backend = TransformersBackend(model, pad_token_id=processor.tokenizer.pad_token_id, processor=processor)
    backend._banned = torch.tensor([], dtype=torch.long)
    out = backend.generate(prompts, SamplingParams(max_tokens=6), n=2, seed=0, images=images)
    batch = pack_completions([p for p in prompts for _ in range(2)], [c.token_ids for g in out for c in g],
                             pad_token_id=processor.tokenizer.pad_token_id, padding_free=False)
    batch.update({"pixels": vision.pixel_inputs(processor, images), "images_per_example": [1, 1, 1],
                  "row_example": [0, 0, 1, 1, 2, 2]})
    model.eval()
    with torch.no_grad():
        logps = completion_logps(model, vision.attach_image_features(model, batch, processor))
    sampler = torch.tensor([x for g in out for c in g for x in c.logprobs])
    torch.testing.assert_close(logps, sampler, rtol=0, atol=1e-4)


def test_vision_tokens_are_never_sampled(tmp_path):
    """A model that prefers its image token above all: with the ban, never sampled; without it, sampled (so the
    check can fail)."""
    from toolkit.core.generation import SamplingParams, TransformersBackend

    model, processor = tiny_qwen2_vl()
    ids = torch.tensor(sorted(vision.vision_token_ids(processor)))
    model.lm_head.register_forward_hook(lambda m, i, o: o.index_add(-1, ids, torch.full((*o.shape[:-1], len(ids)),
                                                                                       50.0)))
    prompts, images = [_prompt(processor, 0)], [[image(0)]]
    banned = TransformersBackend(model, pad_token_id=processor.tokenizer.pad_token_id, processor=processor)
    out = banned.generate(prompts, SamplingParams(max_tokens=5), n=4, seed=0, images=images)
    assert not any(t in ids.tolist() for c in out[0] for t in c.token_ids)
    free = TransformersBackend(model, pad_token_id=processor.tokenizer.pad_token_id, processor=processor)
    free._banned = torch.tensor([], dtype=torch.long)
    out = free.generate(prompts, SamplingParams(max_tokens=5), n=4, seed=0, images=images)
    assert any(t in ids.tolist() for c in out[0] for t in c.token_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_loss_and_gradients_equal_trl(tmp_path, family):
    """TRL's GRPOTrainer._compute_loss on the same completions of image prompts (its layout: left-padded prompts,
    each row's images encoded for that row) against ours (right-padded rows, each group's images once)."""
    from datasets import Dataset

    from toolkit import GRPOTrainer
    from toolkit.testing import fixed_rollout, trl_grpo_inputs

    trl = pytest.importorskip("trl")
    model, processor = FAMILIES[family]()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    prompts = [_prompt(processor, i) for i in (0, 0, 2, 2)]
    lengths = [6, 4, 5, 3]
    completions = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])
    old = [(torch.randn(n, generator=g) * 0.1 - 3.0) for n in lengths]
    common = dict(per_device_train_batch_size=4, max_completion_length=6, temperature=0.7, beta=0.0,
                  loss_type="dapo", epsilon=0.2, report_to="none", learning_rate=1e-3)

    ours = GRPOTrainer(model, [length_reward], grpo_cfg(tmp_path, num_generations=2, importance_sampling_cap=None,
                                                        zero_variance_filter=False, freeze_vision_tower=False,
                                                        **common),
                       train_dataset=prompt_rows_with_images(4), processing_class=processor)
    ours.model.train()
    ours.current_gradient_accumulation_steps = 1
    rollout = fixed_rollout(prompts, completions, advantages, old, 2)
    rollout.prompt_images = [[image(0)], [image(2)]]
    our_loss = ours.compute_loss(ours.model, ours._split(rollout)[0])

    theirs = trl.GRPOTrainer(model=reference, reward_funcs=length_reward, processing_class=processor,
                             args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=2, use_cpu=True,
                                                 bf16=False, **common),
                             train_dataset=Dataset.from_list(prompt_rows_with_images(4)))
    theirs.model.train()
    if not hasattr(theirs, "current_gradient_accumulation_steps"):
        theirs.current_gradient_accumulation_steps = 1
    inputs = trl_grpo_inputs(prompts, completions, advantages, old, processor.tokenizer.pad_token_id, 6)
    inputs.update(vision.pixel_inputs(processor, [[image(i)] for i in (0, 0, 2, 2)]))
    inputs["num_images"] = [1, 1, 1, 1]
    if "mm_token_type_ids" in processor.model_input_names:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        inputs["mm_token_type_ids"] = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))
    trl_loss = theirs._compute_loss(reference, inputs)
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-5, rel=1e-5)
    our_loss.backward()
    trl_loss.backward()
    for (k, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_grpo_refuses_a_prompt_that_max_prompt_length_would_cut_through_its_image(tmp_path):
    from toolkit import GRPOTrainer

    _, processor = tiny_qwen2_vl()
    with pytest.raises(DataError, match="cutting them would cut an image"):
        GRPOTrainer("no-such/vision-model", reward_funcs=length_reward, processing_class=processor,
                    args=grpo_cfg(tmp_path, max_prompt_length=8), train_dataset=prompt_rows_with_images(4))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_resumes_exactly_with_images(tmp_path, family):
    from toolkit import GRPOTrainer

    build = FAMILIES[family]
    _, processor = build()
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    straight = GRPOTrainer(build()[0], reward_funcs=length_reward, args=grpo_cfg(tmp_path / "a", **kw),
                           train_dataset=prompt_rows_with_images(6), processing_class=processor)
    straight.train()
    first = GRPOTrainer(build()[0], reward_funcs=length_reward, args=grpo_cfg(tmp_path / "b", **kw),
                        train_dataset=prompt_rows_with_images(6), processing_class=processor, callbacks=[StopAt(2)])
    first.train()
    # the same base model: GRPO's reference (beta > 0) is a copy of it
    second = GRPOTrainer(build()[0], reward_funcs=length_reward, args=grpo_cfg(tmp_path / "b", **kw),
                         train_dataset=prompt_rows_with_images(6), processing_class=processor)
    second.train(resume_from_checkpoint=True)
    for (k, p), (_, q) in zip(straight.model.named_parameters(), second.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=k)


def test_online_dpo_trains_on_image_prompts_and_gkd_says_it_does_not(tmp_path):
    from toolkit.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    model, processor = tiny_idefics3()
    t = OnlineDPOTrainer(model, reward_funcs=length_reward, processing_class=processor,
                         args=OnlineDPOConfig(output_dir=str(tmp_path / "od"), max_steps=2,
                                              per_device_train_batch_size=4,
                                              num_generations=2, max_completion_length=6, logging_steps=1,
                                              report_to="none", disable_tqdm=True, save_strategy="no"),
                         train_dataset=prompt_rows_with_images(4))
    counter = CountEncodes(model)
    t.train()
    assert all(math.isfinite(h["loss"]) for h in t.state.log_history if "loss" in h)
    # generation encodes 2 prompts' images per step (4 in all); the rest are the training forwards' (the groups in
    # the loss, once each): the images reach its loss too
    assert counter.images > 2 * 2
    from toolkit.experimental.gkd import GKDConfig, GKDTrainer

    # a teacher given by name: refused before its tokenizer is compared with the processor (which has no vocabulary)
    with pytest.raises(ConfigError, match="GKDTrainer does not take vision-language models yet"):
        GKDTrainer(model, teacher_model="smollm2-135m-instruct", processing_class=processor,
                   args=GKDConfig(output_dir=str(tmp_path / "gkd"), per_device_train_batch_size=4, num_generations=4),
                   train_dataset=prompt_rows_with_images(4))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_async_grpo_with_images_at_staleness_zero_equals_synchronous_grpo(tmp_path, family):
    """The rollout worker (a spawned process) builds the policy's own vision-language class, gets each prompt's
    images and samples with them in context: at max_staleness 0 its rounds are synchronous GRPO's, so the rewards,
    losses and weights are equal."""
    from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOTrainer

    common = {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 6,
              "logging_steps": 1, "learning_rate": 1e-3, "report_to": "none", "disable_tqdm": True,
              "save_strategy": "no", "seed": 0, "beta": 0.04}
    model, processor = FAMILIES[family]()
    sync = GRPOTrainer(copy.deepcopy(model), reward_funcs=length_reward, processing_class=processor,
                       args=grpo_cfg(tmp_path / "sync", **common), train_dataset=prompt_rows_with_images(4))
    sync.train()
    t = AsyncGRPOTrainer(model, reward_funcs=length_reward, processing_class=processor,
                         args=AsyncGRPOConfig(output_dir=str(tmp_path / "async"), max_staleness=0, warm_start=False,
                                              worker_threads=torch.get_num_threads(), heartbeat_timeout=60, **common),
                         train_dataset=prompt_rows_with_images(4))
    t.train()

    def logged(trainer, key):
        return [h[key] for h in trainer.state.log_history if key in h]

    assert logged(t, "reward") == pytest.approx(logged(sync, "reward"), abs=1e-6) and len(logged(t, "reward")) == 2
    assert logged(t, "loss") == pytest.approx(logged(sync, "loss"), abs=2e-6)
    for (k, v), (_, w) in zip(sync.model.state_dict().items(), t.model.state_dict().items()):
        torch.testing.assert_close(w, v, atol=1e-6, rtol=1e-5, msg=k)
    assert logged(t, "async/staleness_max") == [0.0, 0.0]
    # the worker's sampler log-probs are the synchronous sampler's (the images in context; what gap there is, is the
    # banned vision tokens' renormalisation, the same on both sides)
    assert logged(t, "sampler/logp_abs_diff_max") == pytest.approx(logged(sync, "sampler/logp_abs_diff_max"),
                                                                    abs=1e-5)


def test_async_grpo_with_images_refuses_what_its_worker_cannot_sample_with_them(tmp_path):
    from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer

    model, processor = tiny_qwen2_vl()
    for name, kw, match in (("vllm", {"generation_backend": "vllm"}, "generation_backend: 'vllm' takes no images"),
                            ("inflight", {"inflight_weight_updates": True}, "inflight_weight_updates"),
                            ("static", {"generation_backend_kwargs": {"static_decode": True}}, "static_decode")):
        with pytest.raises(ConfigError, match=match):
            AsyncGRPOTrainer(model, reward_funcs=length_reward, processing_class=processor,
                             args=AsyncGRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                                                  num_generations=4, report_to="none", **kw),
                             train_dataset=prompt_rows_with_images(4))
        assert not (tmp_path / name).exists()


# ------------------------------------------------------------------------------------- the shapes task

def test_shapes_rows_are_pictures_of_the_answer_and_the_splits_are_disjoint():
    from toolkit.core.tasks import shapes_image, task_splits

    from collections import Counter

    train, held_out = task_splits("shapes", 512, 128, kind="prompt_only")
    key = lambda r: tuple(tuple(q) for q in r["squares"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held_out}
    for r in train[:32]:
        picture = r["images"][0]
        assert picture.size == (56, 56) and r["prompt"][0]["content"][0] == {"type": "image"}
        red_cells = {(x // 14) + 4 * (y // 14) for x in range(56) for y in range(56)
                     if picture.getpixel((x, y)) == (220, 30, 30)}
        assert red_cells == {q[0] for q in r["squares"]} and str(len(red_cells)) == r["answer"]
    # every count about equally often (no skew from drawing distinct pictures), in both splits
    for rows in (train, held_out):
        counts = Counter(r["answer"] for r in rows)
        assert set(counts) == {"1", "2", "3", "4"} and max(counts.values()) < 0.35 * len(rows), counts
    one = shapes_image(((5, 2, 3, 8),))  # cell 5: x 14..27, y 14..27; the square from (16, 17), 8 wide
    assert one.getpixel((16, 17)) == one.getpixel((23, 24)) == (220, 30, 30)
    assert one.getpixel((15, 17)) == one.getpixel((24, 24)) == (255, 255, 255)
    sft, _ = task_splits("shapes", 4, 2, kind="prompt_completion")
    assert sft[0]["completion"] == [{"role": "assistant", "content": sft[0]["answer"]}]


def test_heldout_accuracy_generates_with_the_images(tmp_path):
    """The CLI's held-out accuracy (report.heldout_accuracy) on image prompts: a reward that reads the images
    column and the completions scores them; the prompts reach the model with their pictures."""
    from toolkit.core.report import heldout_accuracy

    model, processor = tiny_idefics3()
    seen = []

    def has_picture(completions, images, **kw):
        seen.extend(images)
        return [1.0 if isinstance(x[0], Image.Image) else 0.0 for x in images]

    counter = CountEncodes(model)
    accuracy, mean = heldout_accuracy(model, processor, prompt_rows_with_images(5), [has_picture], max_new_tokens=4)
    assert accuracy == 1.0 and len(seen) == 5 and counter.images == 5


def test_a_pipeline_checks_image_rows_as_its_vision_model_reads_them(tmp_path):
    from toolkit.core.cli import _check_stage_data, _is_vision_model

    model, processor = tiny_idefics3()
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    assert _is_vision_model(str(tmp_path / "vlm")) and not _is_vision_model("no-such/model")
    _check_stage_data("grpo", prompt_rows_with_images(2), [], [], train=True, vision=True)
    with pytest.raises(DataError, match="text tokenizer"):
        _check_stage_data("grpo", prompt_rows_with_images(2), [], [], train=True, vision=False)


def two_image_and_no_image_prompts(n: int) -> list[dict]:
    """Prompts with two images, one, and none, mixed in one batch (features are per example or per image by
    family; a row's images must reach that row)."""
    rows = []
    for i in range(n):
        k = [2, 0, 1][i % 3]
        content = [{"type": "image"}] * k + [{"type": "text", "text": f"How many pictures? {i}"}]
        rows.append({"prompt": [{"role": "user", "content": content}], "images": [image(i + j) for j in range(k)]})
    return rows


@pytest.mark.parametrize("family", [*FAMILIES, "llava_next"])
def test_rows_with_two_images_or_none_get_their_own_features(tmp_path, family):
    """Each row's log-probs with images encoded once per prompt (GRPO's path) equal those of a forward given the
    row's own pixels alone, for prompts with 2, 0 and 1 images in one batch, several completions each; and
    generation over such a batch runs (a chunk without images included). LLaVA-NeXT's pixel values are per image
    ([images, crops, C, H, W]), its features split by each example's image tokens."""
    from toolkit import GRPOTrainer
    from toolkit.core.packing import completion_logps, pack_completions

    model, processor = {**FAMILIES, "llava_next": tiny_llava_next}[family]()
    rows = two_image_and_no_image_prompts(3)
    t = GRPOTrainer(model, reward_funcs=lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
                    args=grpo_cfg(tmp_path, per_device_train_batch_size=6, num_generations=2,
                                  generation_batch_size=2, zero_variance_filter=False),
                    train_dataset=rows, processing_class=processor)
    rollout = t.generate_rollout([0, 1, 2])  # generation_batch_size 2: the chunk of prompt 2 alone has one image
    micro = t._split(rollout)[0]
    model.eval()
    with torch.no_grad():
        together = completion_logps(model, vision.attach_image_features(model, micro, processor))
        alone = []
        for r in range(6):
            one = pack_completions([rollout.prompt_ids[r]], [rollout.completion_ids[r]],
                                   pad_token_id=processor.tokenizer.pad_token_id, padding_free=False)
            imgs = rows[r // 2]["images"]
            if imgs:
                one.update({"pixels": vision.pixel_inputs(processor, [imgs]), "images_per_example": [len(imgs)],
                            "row_example": [0]})
            alone.append(completion_logps(model, vision.attach_image_features(model, one, processor)))
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-4, atol=1e-5)


def test_grpo_micro_batches_with_and_without_images_train(tmp_path):
    """One prompt per micro-batch (gradient accumulation 3): the one without images trains as text."""
    from toolkit import GRPOTrainer

    model, processor = tiny_qwen2_vl()
    t = GRPOTrainer(model, reward_funcs=lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
                    args=grpo_cfg(tmp_path, max_steps=1, per_device_train_batch_size=2, num_generations=2,
                                  gradient_accumulation_steps=3, zero_variance_filter=False),
                    train_dataset=two_image_and_no_image_prompts(3), processing_class=processor)
    rollout = t.generate_rollout([0, 1, 2])
    micros = t._split(rollout)
    assert [bool(m.get("pixels")) for m in micros] == [True, False, True]
    t.train()
    assert all(math.isfinite(h["loss"]) for h in t.state.log_history if "loss" in h)


def test_which_saved_types_load_as_vision_language_models(tmp_path):
    from transformers import Gemma3Config, LlamaConfig, Qwen2VLConfig

    from toolkit.core.models import is_vision_language

    for name, config, expected in (("qwen2_vl", Qwen2VLConfig(), True),
                                   ("gemma3", Gemma3Config(), False),  # a causal LM too: keeps loading as text
                                   ("llama", LlamaConfig(), False)):
        config.save_pretrained(tmp_path / name)
        assert is_vision_language(str(tmp_path / name)) is expected, name
    assert is_vision_language(str(tmp_path / "missing")) is False  # the loader says what is wrong, not this check


def test_grpo_with_images_refuses_a_backend_that_takes_no_images_before_training(tmp_path):
    from toolkit import GRPOConfig, GRPOTrainer

    model, processor = tiny_qwen2_vl()
    for backend in ("vllm-server",):  # the colocated 'vllm' engine takes images (tests/integration/test_vllm.py)
        with pytest.raises(ConfigError, match=f"generation_backend: '{backend}' takes no images yet"):
            GRPOTrainer(model, reward_funcs=length_reward, processing_class=processor,
                        args=GRPOConfig(output_dir=str(tmp_path / backend), per_device_train_batch_size=4,
                                        num_generations=4, generation_backend=backend, report_to="none"),
                        train_dataset=prompt_rows_with_images(4))
    assert not (tmp_path / "vllm-server").exists()


def test_grpo_evaluates_held_out_prompts_with_their_images(tmp_path):
    """TRL's GRPO evaluation with images: each held-out prompt is sampled with its own pictures in context (the
    backend receives them), and the reward functions get them as a column; a bad held-out row is a DataError that
    names it, before anything is written."""
    from toolkit import GRPOTrainer

    model, processor = tiny_qwen2_vl()
    held_out = prompt_rows_with_images(5)[2:]  # other sizes than the first training rows
    calls = []
    t = GRPOTrainer(model, reward_funcs=length_reward, args=grpo_cfg(tmp_path), train_dataset=prompt_rows_with_images(4),
                    eval_dataset=held_out, processing_class=processor)
    generate = t.generation_backend.generate

    def recording(prompts, params, **kw):
        calls.append((len(prompts), kw.get("images")))
        return generate(prompts, params, **kw)

    t.generation_backend.generate = recording
    SEEN_IMAGES.clear()
    metrics = t.evaluate()
    assert math.isfinite(metrics["eval_reward"]) and metrics["eval_completions/mean_length"] > 0
    (n, images), = calls
    assert n == 3 and [[im.size for im in row] for row in images] == [[r["images"][0].size] for r in held_out]
    assert [[im.size for im in x] for x in SEEN_IMAGES] == [[r["images"][0].size] for r in held_out for _ in range(4)]
    assert all(sum(1 for x in ids if x == processor.image_token_id) >= 4 for ids in t.eval_prompt_ids)
    bad = held_out[:1] + [dict(held_out[1], images=[])]
    with pytest.raises(DataError, match="eval_dataset is invalid:\n  - row 1: 1 image placeholder"):
        GRPOTrainer(model, reward_funcs=length_reward, args=grpo_cfg(tmp_path / "bad"),
                    train_dataset=prompt_rows_with_images(4), eval_dataset=bad, processing_class=processor)
    assert not (tmp_path / "bad").exists()


def test_the_renamed_weights_reload_is_skipped_and_said_under_fsdp_or_deepspeed(monkeypatch, caplog):
    from types import SimpleNamespace

    from toolkit.core import lifecycle

    calls = []
    monkeypatch.setattr(lifecycle, "reload_renamed_weights", lambda model, folder: calls.append(folder))
    reload = lifecycle.TrainerLifecycle._reload_renamed
    with caplog.at_level("INFO", logger="toolkit.core.lifecycle"):
        reload(SimpleNamespace(is_fsdp_enabled=True, is_deepspeed_enabled=False), object(), "ckpt-1")
        reload(SimpleNamespace(is_fsdp_enabled=False, is_deepspeed_enabled=True), object(), "ckpt-2")
    assert calls == [] and caplog.text.count("skipped under FSDP/DeepSpeed") == 2
    reload(SimpleNamespace(is_fsdp_enabled=False, is_deepspeed_enabled=False), object(), "ckpt-3")
    assert calls == ["ckpt-3"]  # a whole model: the check runs
