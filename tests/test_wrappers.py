"""The two wrapper packages in tests/wrappers/ run end to end on toolkit's public seams and patch nothing."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

from toolkit import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

WRAPPERS = str(Path(__file__).parent / "wrappers")

ROWS = [{"instruction": f"What is {i} + 1?", "output": str(i + 1)} for i in range(8)]
COMMON = dict(max_steps=3, learning_rate=5e-2, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
              logging_steps=1)


def toolkit_surface():
    """Every function and class attribute of every loaded toolkit module, by identity."""
    seen = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("toolkit.") or module is None:
            continue
        for attr, value in vars(module).items():
            if not callable(value):  # module state (a lazily built registry) may change; code may not
                continue
            seen[(name, attr)] = id(value)
            if inspect.isclass(value) and value.__module__ == name:
                for member, v in vars(value).items():
                    if callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                        seen[(name, f"{attr}.{member}")] = id(v)
    return seen


@pytest.fixture
def unpatched():
    """The wrapper packages imported afresh after the snapshot: patches made at import time (how Unsloth patches
    TRL) would show too. Yields (unsloth_like, axolotl_like)."""
    import importlib

    before = toolkit_surface()
    for name in ("unsloth_like", "axolotl_like"):
        sys.modules.pop(name, None)
    sys.path.insert(0, WRAPPERS)
    try:
        yield importlib.import_module("unsloth_like"), importlib.import_module("axolotl_like")
    finally:
        sys.path.remove(WRAPPERS)
    after = toolkit_surface()
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    assert not changed, f"a wrapper replaced toolkit attributes: {changed[:5]}"


def lora_moved(model, before):
    moved = [k for k, v in model.named_parameters() if not torch.equal(before[k], v.detach())]
    return moved and all("lora_" in k for k in moved)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def length_reward(completion_ids, **kw):
    """Varies within every group (random completions differ in length), so every step has a signal."""
    return [float(len(ids)) + 0.01 * (sum(ids) % 7) for ids in completion_ids]


def sft_rows():
    return [{"prompt": r["instruction"] + " ", "completion": r["output"]} for r in ROWS]


def test_unsloth_like_sft_swaps_logps_and_loss_and_trains_its_own_adapters(tmp_path, unpatched):
    unsloth_like, _ = unpatched
    model, tok = unsloth_like.FastModel.from_pretrained()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    calls = dict(unsloth_like.CALLS)
    # SGD: Adam's first steps follow the sign of each gradient, so rounding-level differences between two ways
    # of computing the same log-probs would flip near-zero elements and hide what is being compared
    sgd = {**COMMON, "optim": "sgd", "learning_rate": 0.5}
    t = unsloth_like.FastSFTTrainer(model, SFTConfig(output_dir=str(tmp_path / "a"), **sgd), train_dataset=sft_rows(),
                                    processing_class=tok)
    t.train()
    assert unsloth_like.CALLS["sft_logps"] > calls["sft_logps"] and unsloth_like.CALLS["sft_loss"] > calls["sft_loss"]
    assert lora_moved(model, before)
    plain_model, _ = unsloth_like.FastModel.from_pretrained()
    plain = SFTTrainer(plain_model, SFTConfig(output_dir=str(tmp_path / "b"), **sgd), train_dataset=sft_rows(),
                       processing_class=tok)
    plain.train()
    assert losses(t) == pytest.approx(losses(plain), rel=1e-5)  # the wrapper's kernel computes the same numbers


def test_unsloth_like_grpo_replaces_the_log_prob_computation_entirely(tmp_path, unpatched):
    unsloth_like, _ = unpatched
    model, tok = unsloth_like.FastModel.from_pretrained()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    calls = dict(unsloth_like.CALLS)
    cfg = GRPOConfig(output_dir=str(tmp_path / "g"), per_device_train_batch_size=4, num_generations=2,
                     max_completion_length=6, beta=0.05, **COMMON)
    prompts = [{"prompt": [{"role": "user", "content": r["instruction"]}]} for r in ROWS]
    t = unsloth_like.FastGRPOTrainer(model, [length_reward], cfg, train_dataset=prompts, processing_class=tok)
    t.train()
    assert unsloth_like.CALLS["grpo_logps"] > calls["grpo_logps"] and unsloth_like.CALLS["grpo_loss"] > calls["grpo_loss"]
    assert t.state.global_step == 3 and all(x == x for x in losses(t))
    assert any(h.get("frac_rows_in_loss", 0) > 0 for h in t.state.log_history)  # there was a learning signal
    assert lora_moved(model, before)


def test_axolotl_like_sft_from_yaml_with_its_own_tokens_and_collator(tmp_path, unpatched):
    _, axolotl_like = unpatched
    config = """
base_model: {seed: 0}
datasets:
  - {path: inline, type: alpaca, prompt_template: "### Instruction: {instruction}\\n### Response: "}
training: {max_steps: 4, micro_batch_size: 4, optimizer: {name: adamw, lr: 0.05}}
rl: null
"""
    batches = axolotl_like.COLLATED["batches"]
    t = axolotl_like.build_trainer(config, ROWS, str(tmp_path / "x"))
    assert t.dataset_format.kind == "tokenized" and isinstance(t.data_collator, axolotl_like.WrapperCollator)
    t.train()
    assert axolotl_like.COLLATED["batches"] > batches
    ls = losses(t)
    assert len(ls) == 4 and ls[-1] < ls[0]


def test_axolotl_like_grpo_from_yaml(tmp_path, unpatched):
    _, axolotl_like = unpatched
    config = """
base_model: {seed: 1}
datasets:
  - {path: inline, type: plain, prompt_template: "{instruction} Answer: "}
training: {max_steps: 2, micro_batch_size: 4, optimizer: {name: adamw, lr: 0.01}}
rl: {rewards: ["format:\\\\d+"], num_generations: 2, max_new_tokens: 4}
"""
    t = axolotl_like.build_trainer(config, ROWS, str(tmp_path / "y"))
    assert isinstance(t, GRPOTrainer)
    t.train()
    assert t.state.global_step == 2
