"""A corpus of bad inputs, tried through the public API and the CLI the way a new user would.

Every case asserts three things: the exact error class (ConfigError for settings, DataError for data), that
the message names the field / column / row / line it is about (and, where one exists, the fix), and that
nothing was written to `output_dir` (the error comes before any model, checkpoint or summary file).

Cases are (id, build, error class, words the message must contain). `build(tmp)` does what the user did and
returns nothing; it must raise. CLI cases run `toolkit.core.cli.main` with --debug so the exception itself
(not the one-line message) reaches the test; test_cli.py checks the one-line form.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.core.cli import main
from toolkit.core.dpo import DPOConfig, DPOTrainer
from toolkit.core.errors import ConfigError, DataError
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.core.ppo import PPOConfig, PPOTrainer
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

FAST = dict(max_steps=2, report_to="none", save_strategy="no", disable_tqdm=True)
RL = dict(FAST, per_device_train_batch_size=4, max_completion_length=4)


def out_of(tmp: Path) -> str:
    return str(tmp / "out")


def conv(n=4):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(n)]


def plain(n=4):
    return [{"prompt": f"What is {i} + 1? ", "completion": str(i + 1)} for i in range(n)]


def pairs(n=4):
    return [{"prompt": f"What is {i} + 1? ", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(n)]


def prompts(n=4):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(n)]


def length_reward(completions, **kw):
    return [float(len(str(c))) for c in completions]


def sft(tmp, data=None, tok=None, **cfg):
    SFTTrainer(tiny_model(), SFTConfig(output_dir=out_of(tmp), **{**FAST, **cfg}),
               train_dataset=plain() if data is None else data, processing_class=tok or tiny_tokenizer())


def dpo(tmp, data=None, tok=None, **cfg):
    DPOTrainer(tiny_model(), args=DPOConfig(output_dir=out_of(tmp), **{**FAST, **cfg}),
               train_dataset=pairs() if data is None else data, processing_class=tok or tiny_tokenizer())


def grpo(tmp, data=None, rewards=None, tok=None, **cfg):
    GRPOTrainer(tiny_model(), [length_reward] if rewards is None else rewards,
                GRPOConfig(output_dir=out_of(tmp), **{**RL, "num_generations": 2, **cfg}),
                train_dataset=prompts() if data is None else data, processing_class=tok or tiny_tokenizer())


def async_grpo(tmp, **cfg):
    from toolkit.core.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    AsyncGRPOTrainer(tiny_model(), [length_reward], AsyncGRPOConfig(output_dir=out_of(tmp), **{**RL, "num_generations": 2,
                                                                                               **cfg}),
                     train_dataset=prompts(), processing_class=tiny_tokenizer())


def ppo(tmp, data=None, **cfg):
    PPOTrainer(tiny_model(), [length_reward], PPOConfig(output_dir=out_of(tmp), **{**RL, **cfg}),
               train_dataset=prompts() if data is None else data, processing_class=tiny_tokenizer())


def jsonl(tmp: Path, lines: list[str], name="data.jsonl") -> str:
    path = tmp / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    return str(path)


def cli(tmp: Path, *args: str, run_file: str | None = None) -> None:
    argv = [args[0]]
    if run_file is not None:
        (tmp / "run.toml").write_text(run_file)
        argv += ["--config", str(tmp / "run.toml")]
    argv += [*args[1:], "--debug"]
    if "--output_dir" not in argv:
        argv += ["--output_dir", out_of(tmp)]
    main(argv)


def no_eos_tokenizer():
    tok = tiny_tokenizer()
    tok.eos_token = None
    return tok


def no_system_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}" + tok.chat_template)
    return tok


def no_template_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = None
    return tok


CASES: list = []


def case(case_id: str, error: type, *words: str):
    def register(build):
        CASES.append(pytest.param(build, error, words, id=case_id))
        return build
    return register


# -- training numbers every trainer shares (checked before transformers or a model sees them) -------------
case("sft-learning-rate-negative", ConfigError, "learning_rate", "-0.001")(lambda t: sft(t, learning_rate=-1e-3))
case("sft-learning-rate-nan", ConfigError, "learning_rate", "nan")(lambda t: sft(t, learning_rate=float("nan")))
case("sft-learning-rate-inf", ConfigError, "learning_rate", "inf")(lambda t: sft(t, learning_rate=float("inf")))
case("sft-learning-rate-string", ConfigError, "learning_rate", "'fast'")(lambda t: sft(t, learning_rate="fast"))
case("sft-batch-size-zero", ConfigError, "per_device_train_batch_size", ">= 1")(
    lambda t: sft(t, per_device_train_batch_size=0))
case("sft-eval-batch-size-zero", ConfigError, "per_device_eval_batch_size", ">= 1")(
    lambda t: sft(t, per_device_eval_batch_size=0))
case("sft-accumulation-zero", ConfigError, "gradient_accumulation_steps", ">= 1")(
    lambda t: sft(t, gradient_accumulation_steps=0))
case("sft-accumulation-fraction", ConfigError, "gradient_accumulation_steps", "whole number")(
    lambda t: sft(t, gradient_accumulation_steps=1.5))
case("sft-max-steps-zero", ConfigError, "max_steps", "-1")(lambda t: sft(t, max_steps=0))
case("sft-max-steps-minus-two", ConfigError, "max_steps", "-2")(lambda t: sft(t, max_steps=-2))
case("sft-weight-decay-negative", ConfigError, "weight_decay", ">= 0")(lambda t: sft(t, weight_decay=-0.1))
case("sft-warmup-negative", ConfigError, "warmup_steps", ">= 0")(lambda t: sft(t, warmup_steps=-5))
case("sft-max-grad-norm-negative", ConfigError, "max_grad_norm", ">= 0")(lambda t: sft(t, max_grad_norm=-1.0))
case("sft-save-steps-zero", ConfigError, "save_steps", "save_strategy")(
    lambda t: sft(t, save_strategy="steps", save_steps=0))
case("sft-max-length-zero", ConfigError, "max_length", "0")(lambda t: sft(t, max_length=0))
case("sft-output-dir-is-a-file", ConfigError, "output_dir", "is a file")(
    lambda t: (t / "taken").write_text("x") and SFTTrainer(tiny_model(), SFTConfig(output_dir=str(t / "taken"), **FAST),
                                                            train_dataset=plain(), processing_class=tiny_tokenizer()))
case("dpo-learning-rate-negative", ConfigError, "learning_rate")(lambda t: dpo(t, learning_rate=-1e-6))
case("grpo-batch-size-zero", ConfigError, "per_device_train_batch_size")(lambda t: grpo(t, per_device_train_batch_size=0))
case("ppo-accumulation-zero", ConfigError, "gradient_accumulation_steps")(lambda t: ppo(t, gradient_accumulation_steps=0))

# -- method settings ----------------------------------------------------------------------------------------
case("dpo-beta-zero", ConfigError, "beta", "> 0")(lambda t: dpo(t, beta=0.0))
case("dpo-beta-negative", ConfigError, "beta")(lambda t: dpo(t, beta=-0.1))
case("dpo-label-smoothing-above-half", ConfigError, "label_smoothing", "0.9")(lambda t: dpo(t, label_smoothing=0.9))
case("dpo-label-smoothing-negative", ConfigError, "label_smoothing")(lambda t: dpo(t, label_smoothing=-0.1))
case("dpo-unknown-loss", ConfigError, "loss_type", "sigmoidd", "sigmoid")(lambda t: dpo(t, loss_type="sigmoidd"))
case("dpo-loss-weights-length", ConfigError, "loss_weights")(
    lambda t: dpo(t, loss_type=["sigmoid", "hinge"], loss_weights=[1.0]))
case("grpo-epsilon-negative", ConfigError, "epsilon", "-0.2")(lambda t: grpo(t, epsilon=-0.2))
case("grpo-epsilon-high-negative", ConfigError, "epsilon_high", "-0.1")(lambda t: grpo(t, epsilon_high=-0.1))
case("grpo-one-generation", ConfigError, "num_generations", "2")(lambda t: grpo(t, num_generations=1))
case("grpo-batch-not-divisible", ConfigError, "num_generations", "per_device_train_batch_size")(
    lambda t: grpo(t, per_device_train_batch_size=5, num_generations=2))
case("grpo-temperature-zero", ConfigError, "temperature")(lambda t: grpo(t, temperature=0.0))
case("grpo-top-p-above-one", ConfigError, "top_p")(lambda t: grpo(t, top_p=1.5))
case("grpo-top-k-negative", ConfigError, "top_k")(lambda t: grpo(t, top_k=-1))
case("grpo-min-p-above-one", ConfigError, "min_p")(lambda t: grpo(t, min_p=2.0))
case("grpo-max-completion-zero", ConfigError, "max_completion_length")(lambda t: grpo(t, max_completion_length=0))
case("grpo-max-prompt-zero", ConfigError, "max_prompt_length")(lambda t: grpo(t, max_prompt_length=0))
case("grpo-reward-timeout-zero", ConfigError, "reward_timeout")(lambda t: grpo(t, reward_timeout=0))
case("grpo-reward-failures-zero", ConfigError, "reward_max_consecutive_failures")(
    lambda t: grpo(t, reward_max_consecutive_failures=0))
case("grpo-beta-negative", ConfigError, "beta")(lambda t: grpo(t, beta=-0.1))
case("grpo-unknown-loss", ConfigError, "loss_type", "dappo", "dapo")(lambda t: grpo(t, loss_type="dappo"))
case("grpo-unknown-scale-rewards", ConfigError, "scale_rewards", "groups")(lambda t: grpo(t, scale_rewards="groups"))
case("grpo-unknown-advantage-estimator", ConfigError, "advantage_estimator", "gpro")(
    lambda t: grpo(t, advantage_estimator="gpro"))
case("grpo-unknown-backend", ConfigError, "generation_backend", "vlm")(lambda t: grpo(t, generation_backend="vlm"))
case("grpo-num-iterations-zero", ConfigError, "num_iterations")(lambda t: grpo(t, num_iterations=0))
case("grpo-reward-weights-length", ConfigError, "reward_weights", "1")(lambda t: grpo(t, reward_weights=[1.0, 2.0]))
case("grpo-importance-level", ConfigError, "importance_sampling_level", "tokens")(
    lambda t: grpo(t, importance_sampling_level="tokens"))
case("grpo-importance-mode", ConfigError, "importance_sampling_mode", "truncate | mask")(
    lambda t: grpo(t, importance_sampling_mode="clip"))
case("grpo-importance-min-above-cap", ConfigError, "importance_sampling_min", "below importance_sampling_cap")(
    lambda t: grpo(t, importance_sampling_min=3.0))
case("grpo-importance-mask-unbounded", ConfigError, "importance_sampling_mode", "both are None")(
    lambda t: grpo(t, importance_sampling_mode="mask", importance_sampling_cap=None))
case("grpo-off-policy-threshold", ConfigError, "off_policy_mask_threshold", ">= 0")(
    lambda t: grpo(t, off_policy_mask_threshold=-0.5))
case("grpo-scale-rewards", ConfigError, "scale_rewards", "batch_centred")(
    lambda t: grpo(t, scale_rewards="centred"))
case("grpo-no-reward-functions", ConfigError, "reward")(lambda t: grpo(t, rewards=[]))
case("grpo-unknown-reward-name", ConfigError, "accuracyy")(lambda t: grpo(t, rewards=["accuracyy"]))
case("grpo-reward-not-callable", ConfigError, "reward", "int")(lambda t: grpo(t, rewards=[42]))
case("ppo-epsilon-negative", ConfigError, "epsilon")(lambda t: ppo(t, epsilon=-0.1))
case("ppo-gamma-above-one", ConfigError, "gamma")(lambda t: ppo(t, gamma=1.5))
case("ppo-lam-negative", ConfigError, "lam")(lambda t: ppo(t, lam=-0.5))
case("ppo-vf-coef-negative", ConfigError, "vf_coef")(lambda t: ppo(t, vf_coef=-1.0))
case("ppo-epochs-zero", ConfigError, "num_ppo_epochs")(lambda t: ppo(t, num_ppo_epochs=0))
case("ppo-unknown-critic", ConfigError, "critic", "shared-ish")(lambda t: ppo(t, critic="shared-ish"))
case("ppo-unknown-kl-estimator", ConfigError, "kl_estimator", "k5")(lambda t: ppo(t, kl_estimator="k5"))

case("async-max-staleness-negative", ConfigError, "max_staleness")(lambda t: async_grpo(t, max_staleness=-1))
case("async-queue-size-zero", ConfigError, "queue_size")(lambda t: async_grpo(t, queue_size=0))
case("async-heartbeat-timeout-zero", ConfigError, "heartbeat_timeout")(lambda t: async_grpo(t, heartbeat_timeout=0))
case("async-worker-restarts-negative", ConfigError, "worker_restarts")(lambda t: async_grpo(t, worker_restarts=-1))

# -- data, through the trainers ------------------------------------------------------------------------------
case("data-empty", DataError, "no rows")(lambda t: sft(t, data=[]))
case("data-missing-column-in-a-row", DataError, "'completion'", "row 2")(
    lambda t: sft(t, data=plain()[:2] + [{"prompt": "hi "}] + plain()[3:]))
case("data-none-completion", DataError, "'completion'", "row 1", "None")(
    lambda t: sft(t, data=[plain()[0], {"prompt": "x ", "completion": None}]))
case("data-blank-completion", DataError, "'completion'", "row 1")(
    lambda t: sft(t, data=[plain()[0], {"prompt": "x ", "completion": "   "}]))
case("data-zero-width-only-text", DataError, "'text'", "row 1", "invisible")(
    lambda t: sft(t, data=[{"text": "hello"}, {"text": "\u200b\u200d\ufeff"}]))
case("data-zero-width-only-turn", DataError, "'completion'", "row 0", "invisible")(
    lambda t: sft(t, data=[{"prompt": [{"role": "user", "content": "hi"}],
                            "completion": [{"role": "assistant", "content": "\u200b"}]}]))
case("data-zero-width-between-spaces", DataError, "'text'", "row 0", "invisible")(
    lambda t: sft(t, data=[{"text": "\u200b \u200e\n\u2062"}]))
case("file-jsonl-with-bom-is-read", DataError, "'completion'", "row 0", "empty string")(
    lambda t: sft(t, data=jsonl(t, ['\ufeff{"prompt": "a", "completion": ""}'])))
case("data-lone-surrogate-in-list", DataError, "'text'", "row 1", "surrogate")(
    lambda t: sft(t, data=[{"text": "fine"}, {"text": "broken \ud800 text"}]))
case("data-number-as-text", DataError, "'completion'", "row 0", "int")(
    lambda t: sft(t, data=[{"prompt": "2+2=", "completion": 4}]))
case("data-unknown-role", DataError, "'prompt'", "row 0", "'human'")(
    lambda t: sft(t, data=[{"prompt": [{"role": "human", "content": "hi"}],
                            "completion": [{"role": "assistant", "content": "yo"}]}]))
case("data-turn-without-content", DataError, "'prompt'", "row 0", "'content'")(
    lambda t: sft(t, data=[{"prompt": [{"role": "user", "text": "hi"}],
                            "completion": [{"role": "assistant", "content": "yo"}]}]))
case("data-system-in-the-middle", DataError, "'messages'", "row 0", "system")(
    lambda t: sft(t, data=[{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                                         {"role": "assistant", "content": "c"}]}]))
case("data-two-user-turns", DataError, "'messages'", "row 0", "alternate")(
    lambda t: sft(t, data=[{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                         {"role": "assistant", "content": "c"}]}]))
case("data-no-assistant-turn", DataError, "'messages'", "row 0", "no assistant")(
    lambda t: sft(t, data=[{"messages": [{"role": "user", "content": "a"}]}]))
case("data-completion-holds-user-turn", DataError, "'completion'", "row 0", "assistant")(
    lambda t: sft(t, data=[{"prompt": [{"role": "user", "content": "a"}],
                            "completion": [{"role": "user", "content": "b"}]}]))
case("data-mixed-plain-and-conversational", DataError, "'prompt'", "row 1", "conversational")(
    lambda t: sft(t, data=conv(1) + plain(1)))
case("data-text-and-messages", DataError, "'text'", "'messages'", "ambiguous")(
    lambda t: sft(t, data=[{"text": "a", "messages": [{"role": "user", "content": "b"}]}]))
case("data-chosen-without-rejected", DataError, "'chosen'", "'rejected'")(
    lambda t: dpo(t, data=[{"prompt": "a", "chosen": "b"}]))
case("data-typo-column", DataError, "'promt'", "'prompt'")(lambda t: sft(t, data=[{"promt": "a", "completion": "b"}]))
case("data-conversational-without-template", DataError, "chat template")(
    lambda t: sft(t, data=conv(), tok=no_template_tokenizer()))
case("data-template-refuses-system", DataError, "row 0", "System role not supported")(
    lambda t: sft(t, data=[{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                                         {"role": "assistant", "content": "b"}]}], tok=no_system_tokenizer()))
case("data-template-refuses-system-grpo", DataError, "row 1", "System role not supported")(
    lambda t: grpo(t, data=prompts(1) + [{"prompt": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "a"}]}] + prompts(2),
                   tok=no_system_tokenizer()))
case("data-sft-without-eos", DataError, "EOS", "eos_token")(lambda t: sft(t, tok=no_eos_tokenizer()))
case("data-sft-given-preference-rows", DataError, "DPOTrainer")(lambda t: sft(t, data=pairs()))
case("data-dpo-given-prompt-completion", DataError, "chosen")(lambda t: dpo(t, data=plain()))
case("data-dpo-identical-sides-everywhere", DataError, "chosen == rejected", "every one")(
    lambda t: dpo(t, data=[{"prompt": "a ", "chosen": "b", "rejected": "b"}] * 4))
case("data-grpo-system-only-prompt", DataError, "row 0", "prompt", "no user turn")(
    lambda t: grpo(t, data=[{"prompt": [{"role": "system", "content": "Be brief."}]}] + prompts(3)))
case("data-grpo-prompt-ends-with-assistant", DataError, "'prompt'", "row 0", "assistant")(
    lambda t: grpo(t, data=[{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]))
case("data-grpo-column-clashes-with-reward-argument", DataError, "'completions'")(
    lambda t: grpo(t, data=[dict(r, completions="x") for r in prompts()]))
case("data-ppo-empty-prompt", DataError, "'prompt'", "row 1")(lambda t: ppo(t, data=[{"prompt": "a"}, {"prompt": ""}]))

# -- data files (the paths a run file or the API may give) -------------------------------------------------
case("file-missing", DataError, "does-not-exist.jsonl", "does not exist")(
    lambda t: sft(t, data=str(t / "does-not-exist.jsonl")))
case("file-jsonl-broken-line", DataError, "line 2")(
    lambda t: sft(t, data=jsonl(t, [json.dumps(plain()[0]), "{not json"])))
case("file-jsonl-row-is-an-array", DataError, "line 2", "list")(
    lambda t: sft(t, data=jsonl(t, [json.dumps(plain()[0]), json.dumps(["a", "b"])])))
case("file-jsonl-duplicate-key", DataError, "line 1", "'completion'", "twice")(
    lambda t: sft(t, data=jsonl(t, ['{"prompt": "a", "completion": "b", "completion": "c"}'])))
case("file-json-duplicate-key", DataError, "'prompt'", "twice")(
    lambda t: (Path(t / "d.json").write_text('[{"prompt": "a", "prompt": "b", "completion": "c"}]'),
               sft(t, data=str(t / "d.json"))))
case("file-jsonl-lone-surrogate", DataError, "'completion'", "row 1", "surrogate")(
    lambda t: sft(t, data=jsonl(t, [json.dumps(plain()[0]), '{"prompt": "a", "completion": "b \\ud800"}'])))
case("file-jsonl-not-utf8", DataError, "line 1", "UTF-8")(
    lambda t: (Path(t / "latin.jsonl").write_bytes('{"prompt": "caf\xe9", "completion": "x"}\n'.encode("latin-1")),
               sft(t, data=str(t / "latin.jsonl"))))
case("file-jsonl-empty", DataError, "no rows")(lambda t: sft(t, data=jsonl(t, [""])))

# -- the command line ---------------------------------------------------------------------------------------
case("cli-unknown-key", ConfigError, "learning_rat", "learning_rate")(
    lambda t: cli(t, "sft", "--dataset", "builtin:arithmetic", "--learning_rat", "1e-5"))
case("cli-wrong-type", ConfigError, "max_steps", "int")(
    lambda t: cli(t, "sft", "--dataset", "builtin:arithmetic", "--max_steps", "ten"))
case("cli-unknown-builtin-dataset", ConfigError, "dataset", "arithmetc")(
    lambda t: cli(t, "sft", "--dataset", "builtin:arithmetc"))
case("cli-csv-dataset", ConfigError, "dataset", "data.csv")(
    lambda t: (Path(t / "data.csv").write_text("prompt,completion\na,b\n"), cli(t, "sft", "--dataset", str(t / "data.csv"))))
case("cli-no-dataset", ConfigError, "dataset")(lambda t: cli(t, "sft", "--dataset", ""))
case("cli-invalid-format-regex", ConfigError, "reward_funcs", "format:(unclosed", "regular expression")(
    lambda t: cli(t, "grpo", "--dataset", "builtin:arithmetic", "--reward_funcs", '["format:(unclosed"]'))
case("cli-empty-model-name", ConfigError, "model")(lambda t: cli(t, "sft", "--dataset", "builtin:arithmetic", "--model", ""))
case("cli-missing-local-model", ConfigError, "model", "no-such-model")(
    lambda t: cli(t, "sft", "--dataset", "builtin:arithmetic", "--model", str(t / "no-such-model")))
case("cli-hub-id-not-cached-offline", ConfigError, "model", "someone/not-a-cached-model")(
    lambda t: cli(t, "sft", "--dataset", "builtin:arithmetic", "--model", "someone/not-a-cached-model"))
case("cli-model-folder-without-config", ConfigError, "model", "empty-folder")(
    lambda t: ((t / "empty-folder").mkdir(), cli(t, "sft", "--dataset", "builtin:arithmetic", "--model",
                                                str(t / "empty-folder"))))
# a section names the prefix of its keys ([lora] r = 8 is lora_r): one that is no key's prefix is named, with the fix
case("cli-section-of-no-key", ConfigError, "training_learning_rate", "Did you mean 'learning_rate'")(
    lambda t: cli(t, "sft", run_file="[training]\nlearning_rate = 1e-5\n"))
case("cli-run-file-bad-toml", ConfigError, "run.toml")(lambda t: cli(t, "sft", run_file="learning_rate = = 1\n"))
case("cli-config-without-path", ConfigError, "--config")(lambda t: main(["sft", "--config", "--debug"]))
case("cli-run-file-missing", ConfigError, "nothere.toml")(
    lambda t: main(["sft", "--config", str(t / "nothere.toml"), "--debug"]))
case("cli-4bit-without-lora", ConfigError, "load_in_4bit")(
    lambda t: cli(t, "sft", "--dataset", "builtin:arithmetic", "--load_in_4bit", "true"))
case("cli-negative-dataset-size", ConfigError, "dataset_size", "-3")(
    lambda t: cli(t, "grpo", "--dataset", "builtin:arithmetic", "--dataset_size", "-3"))
case("cli-resume-from-missing-folder", ConfigError, "resume_from_checkpoint", "nope")(
    lambda t: cli(t, "sft", "--dataset", "builtin:arithmetic", "--resume_from_checkpoint", str(t / "nope")))


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 60, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES)  # every case has its own name


@pytest.mark.parametrize("build,error,words", CASES)
def test_bad_input_is_refused_by_name_before_anything_is_written(tmp_path, build, error, words):
    with pytest.raises(Exception) as caught:
        build(tmp_path)
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
    message = str(caught.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
