"""The embedded SmolLM2-135M-Instruct, for real (marker: real_model; CI runs these in their own stage)."""

import math

import pytest
import torch

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm():
    from toolkit import embedded_model_path, load_model, load_tokenizer

    path = embedded_model_path()
    return path, load_model("smollm2-135m-instruct"), load_tokenizer("smollm2-135m-instruct")


def test_embedded_model_is_cached_and_reloads_identically(smollm):
    from toolkit import embedded_model_path, load_model

    path, model, tok = smollm
    assert embedded_model_path() == path and (path / "model.safetensors").exists()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    again = load_model(str(path))
    x = torch.tensor([tok("What is 12 + 7?").input_ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)
    for name in ("smollm2", "default"):
        assert load_model(name).config.vocab_size == 49152
    # The Hub id means the Hub's weights, never the embedded GGUF copy: offline (and not in the HF cache) it is
    # refused by name; where the Hub is reachable it loads the Hub's model.
    from toolkit import ConfigError
    from toolkit.core.models import is_embedded_checkpoint

    try:
        hub = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    except ConfigError as e:
        assert "model: could not load 'HuggingFaceTB/SmolLM2-135M-Instruct'" in str(e)
    else:
        assert not is_embedded_checkpoint(hub.config._name_or_path)
    assert tok.pad_token_id == tok.eos_token_id and tok.chat_template  # the pad == eos case, for real


def test_chunked_logps_equal_full_logits_on_the_real_model(smollm):
    from toolkit import chunked_token_logps

    _, model, tok = smollm
    ids = torch.tensor([tok("The capital of France is Paris. The capital of Italy is Rome.").input_ids])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        ref = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        ours = chunked_token_logps(out.hidden_states[-1][0, :-1], model.lm_head.weight, ids[0, 1:], chunk_size=5)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_sft_lowers_the_loss_on_the_real_model(tmp_path, smollm):
    from toolkit import SFTConfig, SFTTrainer
    from toolkit.core.tasks import arithmetic

    _, model, tok = smollm
    rows = arithmetic(16, seed=3)
    t = SFTTrainer(model, SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8,
                                    learning_rate=5e-5, logging_steps=1, save_strategy="no", padding_free=True,
                                    disable_tqdm=True),
                   train_dataset=rows, processing_class=tok)
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_grpo_steps_on_the_real_model(tmp_path, smollm):
    from toolkit import GRPOConfig, GRPOTrainer
    from toolkit.core.tasks import arithmetic

    _, model, tok = smollm
    t = GRPOTrainer(model, ["numeric_match"],
                    GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                               max_completion_length=8, temperature=0.7, learning_rate=1e-5, logging_steps=1,
                               save_strategy="no", disable_tqdm=True),
                    train_dataset=arithmetic(8, seed=1, kind="prompt_only"), processing_class=tok)
    t.train()
    hist = [h for h in t.state.log_history if "reward" in h]
    assert len(hist) == 2 and all(math.isfinite(h["loss"]) for h in hist)
    assert all(0.0 <= h["reward"] <= 1.0 for h in hist)
    assert hist[0]["importance_ratio/mean"] == pytest.approx(1.0, abs=0.05)  # sampler and trainer agree


def test_the_embedded_vision_model_is_smollm2_behind_a_vision_tower(tmp_path, smollm):
    """smollm2-135m-vision: the embedded SmolLM2 as the language model of a LLaVA-style model (text-only logits
    unchanged), loaded by name with its processor; a builtin:shapes picture expands to 16 image tokens, and the
    model's greedy answers to held-out pictures are scored (the number the vision pipeline starts from)."""
    from toolkit import load_model, load_tokenizer
    from toolkit.core import vision
    from toolkit.core.models import EMBEDDED_VISION_NAME
    from toolkit.core.report import heldout_accuracy
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import task_splits

    _, _, tok = smollm
    text_model = load_model("smollm2-135m-instruct")  # (not the fixture's: earlier tests in this module train it)
    model, processor = load_model(EMBEDDED_VISION_NAME), load_tokenizer(EMBEDDED_VISION_NAME)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and vision.is_vision_processor(processor)
    x = torch.tensor([tok("What is 12 + 7?").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits[..., :49152], text_model(x).logits, rtol=0, atol=1e-3)
    _, held_out = task_splits("shapes", 8, 16, kind="prompt_only")
    text = processor.apply_chat_template(held_out[0]["prompt"], tokenize=False, add_generation_prompt=True)
    ids = vision._expand(processor, text, held_out[0]["images"])
    assert ids.count(model.config.image_token_id) == 16
    accuracy, _ = heldout_accuracy(model, processor, held_out, [numeric_match], max_new_tokens=8)
    assert not math.isnan(accuracy)  # every greedy answer was judged (a number or not)


def test_the_embedded_vision_model_builds_the_same_into_an_empty_cache(tmp_path, smollm):
    """Built anew (a fresh machine's first run) it holds the very weights of the cached copy: the language model's
    from SmolLM2, the tower's and projector's from seed 0."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from toolkit import load_model
    from toolkit.core.models import EMBEDDED_VISION_NAME, embedded_vision_model_path

    text_path, _, _ = smollm
    (tmp_path / text_path.name).symlink_to(text_path)  # the converted text model; the vision model is built here
    built = embedded_vision_model_path(tmp_path)
    assert built.parent == tmp_path and (built / "toolkit_cache.json").exists()
    fresh, cached = AutoModelForImageTextToText.from_pretrained(built), load_model(EMBEDDED_VISION_NAME)
    assert type(AutoProcessor.from_pretrained(built)).__name__ == "LlavaProcessor"
    theirs = cached.state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, theirs[k]), k
