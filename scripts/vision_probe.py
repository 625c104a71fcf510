"""What the embedded vision-language model's random vision tower carries, and whether a short run reads it.

    python scripts/vision_probe.py                      # the linear probe only (about a minute)
    python scripts/vision_probe.py --steps 80 --vision-lr 1e-3 --lm-lr 0     # + a training loop

1. A linear probe: the projector's image features (random tower and projector, as built), averaged over the 16
   image tokens, fitted by ridge regression to the count of red squares on 512 builtin:shapes pictures and scored
   on the 128 held-out ones (rounded prediction == count).
2. With --steps: a plain training loop (AdamW, batches of 16, no trainer) on the answer digit's cross-entropy at
   the assistant's first position, the tower and projector at --vision-lr and the language model at --lm-lr (0:
   frozen), with held-out accuracy (argmax over the digits 1-4) every 40 steps. --image-last puts the picture
   after the question (nearer the answer). docs/vision.md has what it measured.
"""

import argparse
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--vision-lr", type=float, default=1e-3)
    ap.add_argument("--lm-lr", type=float, default=0.0)
    ap.add_argument("--image-last", action="store_true")
    a = ap.parse_args()
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from toolkit.core import models, tasks

    torch.manual_seed(0)
    path = models.embedded_vision_model_path()
    proc = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    train, held = tasks.task_splits("shapes", 512, 128, seed=0, kind="prompt_only")
    if a.image_last:
        for r in train + held:
            r["prompt"][0]["content"] = r["prompt"][0]["content"][::-1]
    digits = [proc.tokenizer.convert_tokens_to_ids(str(d)) for d in range(1, 5)]
    y_train = torch.tensor([int(r["answer"]) for r in train]).float()
    y_held = torch.tensor([int(r["answer"]) for r in held]).float()

    with torch.no_grad():
        def pooled(rows):
            pixels = proc.image_processor([r["images"][0] for r in rows], return_tensors="pt")["pixel_values"]
            out = model.get_image_features(pixel_values=pixels)
            feats = out.pooler_output if hasattr(out, "pooler_output") else out
            feats = torch.stack(list(feats)) if isinstance(feats, (list, tuple)) else feats
            return torch.cat([feats.mean(1), torch.ones(len(rows), 1)], 1)

        x_train, x_held = pooled(train), pooled(held)
    w = torch.linalg.solve(x_train.T @ x_train + 1e-3 * torch.eye(x_train.shape[1]), x_train.T @ y_train)
    constant = max((y_held == c).float().mean().item() for c in range(1, 5))
    print(f"linear probe on the mean image feature: held-out accuracy "
          f"{((x_held @ w).round() == y_held).float().mean().item():.3f} (a constant answer: {constant:.3f})")
    if not a.steps:
        return

    def encode(rows):
        texts = [proc.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
        return proc(text=texts, images=[r["images"][0] for r in rows], return_tensors="pt", padding=True,
                    padding_side="left")

    def vision_part(name):
        return "vision_tower" in name or "multi_modal_projector" in name

    tower = [p for n, p in model.named_parameters() if vision_part(n)]
    language = [p for n, p in model.named_parameters() if not vision_part(n)]
    for p in language:
        p.requires_grad_(a.lm_lr > 0)
    opt = torch.optim.AdamW([{"params": tower, "lr": a.vision_lr}] +
                            ([{"params": language, "lr": a.lm_lr}] if a.lm_lr > 0 else []), weight_decay=0.0)
    held_batch = encode(held)

    def accuracy():
        model.eval()
        hits = []
        with torch.no_grad():
            for i in range(0, len(held), 32):
                logits = model(**{k: v[i:i + 32] for k, v in held_batch.items()}).logits[:, -1, digits]
                hits.append((logits.argmax(-1) + 1 == y_held[i:i + 32]).float())
        model.train()
        return torch.cat(hits).mean().item()

    print(f"step 0 held-out accuracy {accuracy():.3f}", flush=True)
    rng, t0 = random.Random(0), time.time()
    for step in range(1, a.steps + 1):
        rows = rng.sample(train, 16)
        target = torch.tensor([digits[int(r["answer"]) - 1] for r in rows])
        loss = torch.nn.functional.cross_entropy(model(**encode(rows)).logits[:, -1], target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
        if step % 40 == 0:
            print(f"step {step} held-out accuracy {accuracy():.3f}", flush=True)


if __name__ == "__main__":
    main()
