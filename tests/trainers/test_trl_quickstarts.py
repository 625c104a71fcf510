"""TRL's own documentation quick-starts run with only the import changed (`from trl import` -> `from toolkit
import`). The snippets are TRL's text, kept here as data (docs/source/quickstart.md and the SFT/DPO/GRPO trainer
pages' "Quick start", TRL 1.x); the Hub model id is swapped for a tiny offline model and `datasets.load_dataset`
answers TRL's dataset ids with offline rows of the same columns. Everything else (default configs, a string
`ref_model`, TRL's own `accuracy_reward`) is what a TRL user's code passes."""

import math

import datasets
import pytest

from toolkit.testing import tiny_model, tiny_tokenizer

QUICKSTARTS = {
    "quickstart.md: SFT": '''
from trl import SFTTrainer
from datasets import load_dataset

trainer = SFTTrainer(
    model="Qwen/Qwen2.5-0.5B",
    train_dataset=load_dataset("trl-lib/Capybara", split="train"),
)
trainer.train()
''',
    "quickstart.md: GRPO": '''
from trl import GRPOTrainer
from datasets import load_dataset

# Define a simple reward function (count unique chars as example)
def reward_function(completions, **kwargs):
    return [len(set(completion.lower())) for completion in completions]

trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",  # Start from SFT model
    train_dataset=load_dataset("trl-lib/tldr", split="train"),
    reward_funcs=reward_function,
)
trainer.train()
''',
    "quickstart.md: DPO": '''
from trl import DPOTrainer
from datasets import load_dataset

trainer = DPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",  # Use your SFT model
    ref_model="Qwen/Qwen2.5-0.5B-Instruct",  # Original base model
    train_dataset=load_dataset("trl-lib/ultrafeedback_binarized", split="train"),
)
trainer.train()
''',
    "grpo_trainer.md: Quick start": '''
# train_grpo.py
from datasets import load_dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
''',
}


def offline_rows(name: str) -> list[dict]:
    """Rows with the columns of TRL's dataset `name`, made here."""
    if name == "trl-lib/Capybara":  # conversational language modeling
        return [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                              {"role": "assistant", "content": f"{i} + 1 = {i + 1}."}]} for i in range(8)]
    if name == "trl-lib/tldr":  # standard prompt-completion
        return [{"prompt": f"SUBREDDIT: r/test\nPOST: item {i} is here.\nTL;DR:", "completion": f" item {i}."}
                for i in range(4)]
    if name == "trl-lib/ultrafeedback_binarized":  # conversational preference with an implicit prompt
        return [{"chosen": [{"role": "user", "content": f"Name {i}?"}, {"role": "assistant", "content": f"It is {i}."}],
                 "rejected": [{"role": "user", "content": f"Name {i}?"}, {"role": "assistant", "content": "No."}],
                 "score_chosen": 8.0, "score_rejected": 2.0} for i in range(8)]
    if name == "trl-lib/DeepMath-103K":  # conversational prompt-only with a solution column
        return [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Put the answer in \\boxed{{}}."}],
                 "solution": str(2 * i)} for i in range(4)]
    raise AssertionError(f"no offline stand-in for {name}")


@pytest.mark.parametrize("name", list(QUICKSTARTS))
def test_trls_quickstart_runs_with_only_the_import_changed(name, tmp_path, monkeypatch):
    if "accuracy_reward" in QUICKSTARTS[name]:
        pytest.importorskip("math_verify")  # TRL's accuracy_reward needs it (the test extra installs it)
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    code = QUICKSTARTS[name].replace("from trl import", "from toolkit import")  # the one change a user makes
    for model_id in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2-0.5B-Instruct"):
        code = code.replace(f'"{model_id}"', repr(str(folder)))  # offline: no Hub here
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda path, split=None, **kw: datasets.Dataset.from_list(offline_rows(path)))
    monkeypatch.chdir(tmp_path)  # TRL's default output_dir is relative ("trainer_output")
    scope: dict = {}
    exec(compile(code, name, "exec"), scope)  # noqa: S102 (TRL's documented snippet, as data)
    trainer = scope["trainer"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step > 0 and losses and all(math.isfinite(loss) for loss in losses)
