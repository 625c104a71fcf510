"""Does vLLM's CPU engine sample a tiny vision-language model as transformers does? (run in .venv-vllm)

    bash scripts/setup-vllm.sh && .venv-vllm/bin/python scripts/vllm_vision_probe.py

Builds toolkit.testing's tiny Idefics3 with head_dim 32 (the CPU attention refuses 16), saves it with its
processor, and greedily decodes three prompts with an image each in vLLM: the prompt ids as toolkit renders
them (image tokens already expanded) plus `multi_modal_data`. Prints, per prompt, the largest gap between vLLM's
log-probs and a transformers forward over the same ids and pixels, and the same gap for a text-only prompt.
What it measured (vLLM 0.32 CPU, 2026-12-07) is in docs/vision.md, "Not yet".
"""

import os
import tempfile

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    import torch
    import vllm
    from PIL import Image
    from transformers import Idefics3ForConditionalGeneration

    from toolkit.core import vision
    from toolkit.testing import tiny_idefics3

    _, processor = tiny_idefics3()
    config = tiny_idefics3()[0].config
    config.text_config.num_attention_heads, config.text_config.num_key_value_heads = 2, 1
    config.text_config.head_dim = 32
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    folder = tempfile.mkdtemp(prefix="tiny-idefics3-")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    colours = [(255, 0, 0), (0, 160, 0), (0, 0, 255)]
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Colour {i}?"}]}]}
            for i in range(3)]
    images = [[Image.new("RGB", (60 + 10 * i, 50), colours[i])] for i in range(3)]
    ids, _ = vision.tokenize_vision_prompts(rows, images, processor, max_prompt_length=None)
    llm = vllm.LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
                   limit_mm_per_prompt={"image": 1}, logprobs_mode="processed_logprobs")
    greedy = vllm.SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)

    def gap(prompt, output, pixels):
        if sum(t == config.image_token_id for t in prompt) != 4 * len(pixels.get("pixel_values", [])):
            return float("nan")  # the ids hold other image positions than transformers' 4 per image
        completion = list(output.token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion]), **pixels).logits[0]
        logps = torch.log_softmax(logits.float(), -1)
        ours = [logps[len(prompt) - 1 + k, t].item() for k, t in enumerate(completion)]
        return max(abs(a - next(iter(d.values())).logprob) for a, d in zip(ours, output.logprobs))

    outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": im[0]}}
                         for p, im in zip(ids, images)], greedy)
    for p, im, o in zip(ids, images, outs):
        print(f"expanded ids in: prompt {len(p)} ids, vLLM's {len(o.prompt_token_ids)}, the same: "
              f"{list(o.prompt_token_ids) == p}; largest log-prob gap over toolkit's ids "
              f"{gap(p, o.outputs[0], vision.pixel_inputs(processor, [im])):.2e}")
        if list(o.prompt_token_ids) != p:
            print("  toolkit:", processor.tokenizer.convert_ids_to_tokens(p))
            print("  vLLM:   ", processor.tokenizer.convert_ids_to_tokens(list(o.prompt_token_ids)))
    # the template's text with one placeholder per image, left for vLLM to expand
    raw = [processor.tokenizer(processor.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)["input_ids"] for r in rows]
    outs = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": im[0]}}
                         for p, im in zip(raw, images)], greedy)
    for p, r, im, o in zip(ids, raw, images, outs):
        print(f"placeholders in: {len(r)} ids, vLLM's {len(o.prompt_token_ids)}, equal to toolkit's expansion: "
              f"{list(o.prompt_token_ids) == p}; largest log-prob gap "
              f"{gap(list(o.prompt_token_ids), o.outputs[0], vision.pixel_inputs(processor, [im])):.2e}")
    text = processor.tokenizer("Colour of the sky is")["input_ids"]
    out = llm.generate([{"prompt_token_ids": text}], greedy)[0]
    print(f"text only: largest log-prob gap {gap(text, out.outputs[0], {}):.2e}")


if __name__ == "__main__":
    main()
