"""The `toolkit` command.

    toolkit sft --config examples/sft_smollm2.toml [--field value ...]
    toolkit grpo --config examples/grpo_arithmetic.toml [--field value ...]
    toolkit async-grpo --config examples/grpo_arithmetic.toml [--field value ...]
    toolkit dpo --config examples/dpo_arithmetic.toml [--field value ...]
    toolkit ppo --config examples/ppo_arithmetic.toml [--field value ...]
    toolkit pipeline --config examples/arithmetic_pipeline.toml   # stages in sequence (e.g. SFT, then GRPO)
    toolkit sft --help                      # every key, with its help text (likewise grpo)
    toolkit model-path                      # where the embedded SmolLM2 checkpoint is cached
    toolkit estimate --model <path or id> --trainer grpo --seq_len 4096 --gpu_gib 24   # peak GPU memory of a step
    toolkit vllm-serve --model <folder>     # a vLLM engine over HTTP for generation_backend = "vllm-server"
    toolkit plugins                         # losses, estimators, rewards, backends by name, and their packages
    toolkit <command> ... --debug           # show the traceback of an error (otherwise one line, exit 1 or 2)

Experimental commands (toolkit.experimental, no stability promise; the `toolkit` script adds them):

    toolkit reward --config examples/reward_arithmetic.toml   # a Bradley-Terry reward model from preference pairs
    toolkit cpo --config examples/simpo_arithmetic.toml       # CPO / SimPO: preference optimisation, no reference
    toolkit kto --config examples/kto_arithmetic.toml         # KTO: unpaired desirable/undesirable feedback
    toolkit orpo --config examples/orpo_arithmetic.toml       # ORPO: SFT and odds-ratio preference, no reference
    toolkit online-dpo --config examples/online_dpo_arithmetic.toml  # DPO on pairs the policy samples, judged by rewards
    toolkit gkd --config examples/gkd_arithmetic.toml         # GKD / on-policy distillation from a teacher model
"""

from __future__ import annotations

__all__ = [
    "load_dataset_spec",
    "main",
    "run_offline",
    "run_online",
]

import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .config import RunArgs, build_configs, describe_fields, load_run_file, merge_overrides, parse_overrides
from .distributed import (
    exit_process,
    is_main_process,
    leave_process_group,
    quiet_other_ranks,
    warn_if_fewer_processes_than_asked,
)
from .errors import ConfigError, ToolkitError
from .runs import build_trainer, load_dataset_spec, load_datasets

logger = logging.getLogger("toolkit")


def _parse(argv: list[str], config_cls: type) -> tuple[RunArgs, Any] | None:
    """Run file + overrides -> (RunArgs, config), or None after printing --help."""
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(describe_fields(RunArgs, config_cls))
        return None
    values: dict[str, Any] = {}
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config: give the path of a run file, e.g. --config examples/sft_smollm2.toml.")
        values.update(load_run_file(argv[i + 1]))
        argv = argv[:i] + argv[i + 2:]
    return build_configs(merge_overrides(values, parse_overrides(argv)), config_cls)


def _print_summary(title: str, summary: dict[str, Any]) -> None:
    print(f"\n=== {title} summary ===")
    for k, v in summary.items():
        if k == "accuracy_history":  # one line per evaluation is in the log already
            continue
        print(f"{k:>28}: {v:.4f}" if isinstance(v, float) else f"{k:>28}: {v}")


def run_offline(argv: list[str], config_cls: type, make_trainer: Any, *, kind: str, title: str,
                eval_keys: tuple[str, ...] = (), generates: bool = True) -> int:
    """A command for a trainer on fixed data (SFT, DPO, and the experimental ones built like them): parse the run
    file and overrides into `RunArgs` and `config_cls`, load the datasets (`kind`: "prompt_completion",
    "preference"), `make_trainer(run, config, train_dataset, eval_dataset)`, evaluate before and after training,
    save to output_dir/final with the model card, print a summary. `eval_keys`: eval metrics reported before
    and after. `generates=False`: the trained model does not generate (a reward model), so no greedy accuracy.
    Returns the exit code."""
    parsed = _parse(argv, config_cls)
    if parsed is None:
        return 0
    run, cfg = parsed
    train, held_out = load_datasets(run, kind)
    started = time.perf_counter()
    trainer = make_trainer(run, cfg, train, held_out)
    summary: dict[str, Any] = {"model": run.model, "dataset": run.dataset}
    accuracy = _offline_accuracy(run, held_out) if generates and run.report_accuracy else None
    history: list[tuple[int, float]] = []
    if accuracy is not None:
        summary["heldout_accuracy_before"] = accuracy(trainer)
        history.append((0, summary["heldout_accuracy_before"]))
        logger.info("held-out greedy accuracy before training: %.3f", summary["heldout_accuracy_before"])
        if run.eval_every > 0:
            trainer.add_callback(_accuracy_every(run.eval_every, trainer, accuracy, history))
    elif run.eval_every > 0:
        logger.info("eval_every = %d: no held-out accuracy is measured in this run (see above), so none every %d "
                    "steps either.", run.eval_every, run.eval_every)
        if hasattr(trainer, "heldout_episode_stats"):
            summary["heldout_episodes_before"] = dict(trainer.heldout_episode_stats)
    if held_out is not None:
        before = trainer.evaluate()
        summary["eval_loss_before"] = before["eval_loss"]
        for key in eval_keys:
            summary[key.replace("eval_rewards/", "eval_reward_") + "_before"] = before.get(key)
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if losses:
        k = max(1, len(losses) // 4)
        summary["train_loss_first_quarter"] = sum(losses[:k]) / k
        summary["train_loss_last_quarter"] = sum(losses[-k:]) / k
    if held_out is not None:
        after = trainer.evaluate()
        summary["eval_loss_after"] = after["eval_loss"]
        for key in eval_keys:
            summary[key.replace("eval_rewards/", "eval_reward_") + "_after"] = after.get(key)
    if accuracy is not None:
        # measured after train(), never taken from the last step's callback: load_best_model_at_end may have
        # swapped the model since, and this is the model saved to final/
        summary["heldout_accuracy_after"] = accuracy(trainer)
        history.append((trainer.state.global_step, summary["heldout_accuracy_after"]))
        summary["accuracy_history"] = history  # the pipeline's report draws it
    final_dir = Path(cfg.output_dir) / "final"
    # Trainer saves on rank 0 only (should_save); _internal_call: no push from here (_publish pushes once)
    trainer.save_model(str(final_dir), _internal_call=True)
    summary["saved_to"] = str(final_dir)
    summary["minutes"] = round((time.perf_counter() - started) / 60, 2)
    if is_main_process():
        (Path(cfg.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        _publish(trainer, cfg, run, final_dir, summary, title)
        _print_summary(title, summary)
    return 0


def _accuracy_every(every: int, trainer: Any, measure: Any, history: list[tuple[int, float]]) -> Any:
    """SFT/DPO with `eval_every`: a callback measuring held-out greedy accuracy every `every` optimizer steps,
    appended to `history` (the model goes back to train mode after)."""
    from transformers import TrainerCallback

    class AccuracyEveryNSteps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % every or state.global_step >= state.max_steps:
                return  # the last step is measured after train(), on the model it saves
            was_training = trainer.model.training
            value = measure(trainer)
            trainer.model.train(was_training)
            history.append((state.global_step, value))
            logger.info("held-out greedy accuracy at step %d: %.3f", state.global_step, value)

    return AccuracyEveryNSteps()


def _offline_accuracy(run: RunArgs, held_out: Any) -> Any:
    """How an SFT/DPO run measures held-out greedy accuracy (a function of the trainer), or None.

    builtin:arithmetic by its number (as it always was); any other eval data with a verifiable answer (a builtin
    task, or rows with an `answer` column) by the run's reward functions, as GRPO's held-out evaluation does."""
    if held_out is None:
        return None
    if run.eval_dataset == "builtin:arithmetic":
        from .tasks import greedy_accuracy

        from .report import evaluation_precision

        def measure(trainer: Any) -> float:
            with evaluation_precision(trainer.args, trainer.model):
                return greedy_accuracy(trainer.model, trainer.processing_class, held_out)

        return measure
    from .data import as_rows

    rows = as_rows(held_out)
    if not run.eval_dataset.startswith("builtin:") and not (rows and "answer" in rows[0] and "prompt" in rows[0]):
        logger.info("held-out accuracy: skipped (eval_dataset needs a 'prompt' and an 'answer' column for the reward "
                    "functions %s to check a greedy completion); eval loss is reported.", list(run.reward_funcs))
        return None
    logger.info("held-out accuracy: greedy completions to %d eval prompts, scored by %s, before and after training "
                "(report_accuracy = false turns it off).", len(rows), list(run.reward_funcs))
    from .plugins import resolve_reward
    from .report import evaluation_precision, heldout_accuracy

    funcs = [resolve_reward(f) for f in run.reward_funcs]
    # Generation prompts only: the training columns (completion / chosen / rejected) are not shown to the model
    prompts = [{k: v for k, v in r.items() if k not in ("completion", "chosen", "rejected")} for r in rows]

    def by_rewards(trainer: Any) -> float:
        with evaluation_precision(trainer.args, trainer.model):
            return heldout_accuracy(trainer.model, trainer.processing_class, prompts, funcs, max_new_tokens=32)[0]

    return by_rewards


def _publish(trainer: Any, cfg: Any, run: RunArgs, final_dir: Path, summary: dict[str, Any], title: str) -> None:
    """The card (with the run's results) into final/, then, with push_to_hub, final/ to the repo root, once.

    Trainer's own push_to_hub would upload output_dir, which holds final/ as well: the weights twice."""
    from .model_card import write_model_card

    plot = None
    if summary.get("plot") and Path(summary["plot"]).exists():  # the GRPO/PPO report travels with the model
        shutil.copyfile(summary["plot"], final_dir / "report.png")
        plot = "report.png"
    write_model_card(trainer, final_dir, dataset_name=run.dataset, results=summary, plot=plot)
    if not cfg.push_to_hub:
        return
    from huggingface_hub import HfApi

    from .model_card import hub_base_model

    repo = trainer.hub_model_id  # created by Trainer at start (init_hf_repo)
    with hub_base_model(final_dir, trainer.model):  # the pushed adapter names its base by Hub id
        HfApi().upload_folder(repo_id=repo, folder_path=str(final_dir), commit_message=f"toolkit {title}: final model",
                              token=cfg.hub_token, revision=cfg.hub_revision)
    summary["pushed_to"] = f"https://huggingface.co/{repo}"


def run_sft(argv: list[str]) -> int:
    from .sft import SFTConfig

    def make(run, cfg, train, held_out):
        return build_trainer("sft", run, cfg, train, held_out)

    return run_offline(argv, SFTConfig, make, kind="prompt_completion", title="SFT")


def run_dpo(argv: list[str]) -> int:
    from .dpo import DPOConfig

    def make(run, cfg, train, held_out):
        return build_trainer("dpo", run, cfg, train, held_out)

    return run_offline(argv, DPOConfig, make, kind="preference", title="DPO",
                        eval_keys=("eval_rewards/accuracies", "eval_rewards/margins"))


def run_grpo(argv: list[str]) -> int:
    from .grpo import GRPOConfig

    def make(run, cfg, train, callbacks):  # held-out accuracy is measured by the callbacks, not evaluate()
        return build_trainer("grpo", run, cfg, train, callbacks=callbacks)

    return run_online(argv, GRPOConfig, make, title="GRPO", reward_key="reward", step_name="optimizer step")


def run_async_grpo(argv: list[str]) -> int:
    from .async_grpo import AsyncGRPOConfig

    def make(run, cfg, train, callbacks):
        return build_trainer("async-grpo", run, cfg, train, callbacks=callbacks)

    return run_online(argv, AsyncGRPOConfig, make, title="Async GRPO", reward_key="reward",
                       step_name="optimizer step")


def run_ppo(argv: list[str]) -> int:
    from .ppo import PPOConfig

    def make(run, cfg, train, callbacks):
        return build_trainer("ppo", run, cfg, train, callbacks=callbacks)

    return run_online(argv, PPOConfig, make, title="PPO", reward_key="objective/scores", step_name="PPO update")


def run_online(argv: list[str], config_cls: type, make_trainer: Any, *, title: str, reward_key: str,
               step_name: str, kind: str = "prompt_only") -> int:
    """A command for a trainer that samples from its policy (GRPO, PPO, and the experimental ones built like
    them): parse, load the prompts, `make_trainer(run, config, train_dataset, callbacks)` (pass `callbacks` on:
    they measure held-out accuracy), train, save to output_dir/final, write the report (`reward_key`: the logged
    reward to plot; `step_name`: what a step is called) and print a summary. Returns the exit code."""
    from .report import AccuracyCallback, write_report

    parsed = _parse(argv, config_cls)
    if parsed is None:
        return 0
    run, cfg = parsed
    train, held_out = load_datasets(run, kind)
    started = time.perf_counter()
    callbacks = []
    accuracy = None
    # builtin:arithmetic is checked by its number; any other eval_dataset by the run's own reward functions
    # (GRPO and async GRPO; PPO's rewards include a reward model and are not replayed here)
    by_rewards = run.eval_dataset != "builtin:arithmetic"
    with_env = getattr(cfg, "environment", None) is not None  # episodes are scored by their environment
    if held_out is not None and run.report_accuracy and by_rewards and not run.reward_funcs and title != "PPO" \
            and not with_env:
        logger.info("%s: no held-out evaluation of a custom eval_dataset without reward functions to score it.", title)
        held_out = None
    if held_out is not None and run.report_accuracy and by_rewards and title == "PPO":
        logger.info("PPO: no held-out evaluation of an eval_dataset other than builtin:arithmetic (its rewards include "
                    "a reward model and are not replayed).")
    if held_out is not None and run.report_accuracy and not (by_rewards and title == "PPO"):
        accuracy = AccuracyCallback(held_out, every=run.eval_every, max_new_tokens=cfg.max_completion_length,
                                    by_rewards=by_rewards)
        callbacks.append(accuracy)
    trainer = make_trainer(run, cfg, train, callbacks)
    summary: dict[str, Any] = {"model": run.model, "dataset": run.dataset, "reward_funcs": list(run.reward_funcs)}
    if accuracy is not None:
        accuracy.trainer = trainer
        summary["heldout_accuracy_before"] = accuracy.measure(trainer, step=0)
        logger.info("held-out greedy accuracy before training: %.3f", summary["heldout_accuracy_before"])
        if hasattr(trainer, "heldout_episode_stats"):
            summary["heldout_episodes_before"] = dict(trainer.heldout_episode_stats)
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    if accuracy is not None:
        summary["heldout_accuracy_after"] = accuracy.measure(trainer, step=trainer.state.global_step)
        summary["accuracy_train_minutes"] = accuracy.train_minutes
        if hasattr(trainer, "heldout_episode_stats"):
            summary["heldout_episodes_after"] = dict(trainer.heldout_episode_stats)
        if accuracy.mean_rewards:
            summary["heldout_mean_reward_before"] = accuracy.mean_rewards[0][1]
            summary["heldout_mean_reward_after"] = accuracy.mean_rewards[-1][1]
    final_dir = Path(cfg.output_dir) / "final"
    trainer.save_model(str(final_dir), _internal_call=True)  # no push from here (_publish pushes once)
    summary["saved_to"] = str(final_dir)
    summary["minutes"] = round((time.perf_counter() - started) / 60, 2)
    if is_main_process():
        summary.update(write_report(trainer, Path(cfg.output_dir), accuracy.history if accuracy else [], summary,
                                    reward_key=reward_key, title=title, step_name=step_name))
        _publish(trainer, cfg, run, final_dir, summary, title)
        _print_summary(title, summary)
    return 0


def main(argv: list[str] | None = None, extra_commands: dict[str, Any] | None = None) -> int:
    """Run one command. `extra_commands` ({name: fn(argv) -> exit code}) adds commands from outside the stable
    core: the `toolkit` script (toolkit.cli) adds the experimental tier's, which the core never imports."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    commands = {"sft": run_sft, "grpo": run_grpo, "async-grpo": run_async_grpo, "dpo": run_dpo, "ppo": run_ppo,
                "pipeline": _pipeline,
                "model-path": _model_path, "estimate": _estimate, "plugins": _plugins, "vllm-serve": _vllm_serve, **(extra_commands or {})}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command '{argv[0]}'; commands: {', '.join(commands)}")
            return 2
        return 0
    if argv[0] != "pipeline" and ("--help" in argv[1:] or "-h" in argv[1:]):
        text = _shipped_help(argv[0])
        if text is not None:  # the run file's keys without importing the trainer (toolkit._dev.cli_help)
            print(__doc__)
            print(text)
            return 0
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    quiet_other_ranks()
    if argv[0] in ("sft", "grpo", "async-grpo", "dpo", "ppo", "pipeline", *(extra_commands or {})):
        warn_if_fewer_processes_than_asked()
    try:
        return commands[argv[0]](argv[1:])
    except ToolkitError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a person gets one line; --debug gives the traceback
        if debug:
            raise
        print(f"error: {type(e).__name__}: {e}\n(run again with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        leave_process_group()


def _shipped_help(command: str) -> str | None:
    """`toolkit <command> --help`'s listing of run-file keys as shipped in toolkit/cli_help.json (generated from the
    config classes by toolkit._dev.cli_help and checked against them by the tests), or None for a command without
    one (it then prints its help the slow way, from the classes)."""
    path = Path(__file__).resolve().parents[1] / "cli_help.json"
    try:
        return json.loads(path.read_text()).get(command)
    except (OSError, ValueError):
        return None


def _pipeline(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        from . import pipeline

        print(pipeline.__doc__)
        return 0
    from .pipeline import run_pipeline

    stage_commands = {"sft": run_sft, "grpo": run_grpo, "async-grpo": run_async_grpo, "dpo": run_dpo, "ppo": run_ppo}
    chain = {"vision": False}

    def parse_stage(command: str, stage_argv: list[str]) -> None:
        from .async_grpo import AsyncGRPOConfig
        from .dpo import DPOConfig
        from .grpo import GRPOConfig
        from .ppo import PPOConfig
        from .sft import SFTConfig

        config_cls = {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig, "async-grpo": AsyncGRPOConfig,
                      "ppo": PPOConfig}[command]
        run, _ = _parse(stage_argv, config_cls)  # the config: every field and the environment and its kwargs
        # what else can fail only after earlier stages trained: a missing data file, an unknown reward name, data of
        # the wrong format, a column a reward function needs
        from .plugins import resolve_reward

        funcs = [resolve_reward(spec) for spec in run.reward_funcs]  # RL trains on them; held-out accuracy reads them
        kind = {"sft": "prompt_completion", "dpo": "preference"}.get(command, "prompt_only")
        # image rows are read as the stage's processor will read them; a later stage trains the one before's model
        # (its model is the placeholder "checked" here), so it is of the same kind
        vision = chain["vision"] if run.model == "checked" else _is_vision_model(run.model)
        chain["vision"] = vision
        for spec, split in ((run.dataset, "train"), (run.eval_dataset, "test")):
            if spec and Path(spec).suffix in (".json", ".jsonl") and not Path(spec).expanduser().exists():
                raise ConfigError(f"dataset: '{spec}' (a {command} stage) does not exist.")
            if spec.startswith(("builtin:", "reasoning_gym:")) or Path(spec).suffix in (".json", ".jsonl"):
                # read now (milliseconds): an impossible size or a wrong format fails before stage 1
                _check_stage_data(command, load_dataset_spec(spec, run, split=split, kind=kind), funcs,
                                  run.reward_funcs, train=split == "train", vision=vision)

    return run_pipeline(argv, stage_commands, parse_stage)


def _is_vision_model(model: Any) -> bool:
    """Whether a stage's model (a name or path) is a vision-language model; False where it cannot be told without
    loading it (a Hub id not cached here: its stage says so when it starts)."""
    from .models import is_vision_language, resolve_model_path

    try:
        return is_vision_language(resolve_model_path(str(model)))
    except (OSError, ValueError, ConfigError):
        return False


def _check_stage_data(command: str, data: Any, funcs: list[Any], names: list[Any], *, train: bool,
                      vision: bool = False) -> None:
    """A pipeline stage's dataset, read and checked as its trainer will (format, rows, reward columns), before any
    stage trains. `vision`: the stage trains a vision-language model (turns may hold image parts)."""
    from .data import as_rows, detect_format, normalize_rows, validate
    from .rewards import check_reward_columns

    rows = normalize_rows(as_rows(data))
    fmt = detect_format(rows, tokenized=command == "sft")
    validate(rows, fmt, vision=vision)
    wanted = {"sft": ("language_modeling", "prompt_completion", "tokenized"),
              "dpo": ("preference", "tokenized_preference")}.get(command)
    if wanted is not None and fmt.kind not in wanted and train:
        raise ConfigError(f"dataset: a {command} stage needs {' or '.join(wanted)} data; this dataset is "
                          f"{fmt.describe()}.")
    if wanted is None and "prompt" not in fmt.columns:
        raise ConfigError(f"dataset: a {command} stage needs a 'prompt' column; this dataset is {fmt.describe()}.")
    if wanted is None or not train:  # RL trains on the rewards; every stage's held-out accuracy reads them
        check_reward_columns(funcs, [str(n) for n in names], list(rows[0]), where="dataset")


def _plugins(argv: list[str]) -> int:
    """Print every plugin and every registered name with the plugin and package it comes from."""
    from .hookspecs import HOOKS_VERSION
    from .plugins import AUTOLOAD_ENV, KIND_TITLES, _autoload_disabled, registry

    reg = registry()
    print(f"toolkit plugin hooks {HOOKS_VERSION}; entry-point group 'toolkit'"
          + (f" (autoload OFF: {AUTOLOAD_ENV} is set)" if _autoload_disabled() else ""))
    print("\nplugins:")
    for name, package in reg.plugins():
        print(f"  {name:<24} {package}")
    for kind, title in KIND_TITLES.items():
        print(f"\n{title}:")
        for entry in sorted(reg.tables()[kind].values(), key=lambda e: e.name):
            print(f"  {entry.name:<24} {entry.plugin:<20} {entry.package}")
    return 0


def _vllm_serve(argv: list[str]) -> int:
    from .vllm_backend import require_vllm
    from .vllm_server import serve

    require_vllm()
    return serve(argv)


def _estimate(argv: list[str]) -> int:
    """`toolkit estimate`: the memory model's peak for one training step (toolkit.core.memory), nothing allocated."""
    import argparse

    from .memory import TRAINERS, estimate_step_memory
    from .models import embedded_model_path

    ap = argparse.ArgumentParser(prog="toolkit estimate", description=(
        "Peak tensor memory of one steady-state training step (weights, gradients, optimizer state, activations, KV "
        "cache), computed by running the step on fake tensors: nothing is allocated, so any model size can be "
        "asked. Within a few percent of the measured peak on the embedded model (tests/trainers/"
        "test_memory_model.py); a GPU needs ~10%% more for kernel workspaces and fragmentation."))
    ap.add_argument("--model", default=None, help="a model folder or Hub id (its config.json only); default the "
                                                  "embedded SmolLM2-135M")
    ap.add_argument("--trainer", choices=TRAINERS, default="sft")
    ap.add_argument("--batch_size", type=int, default=8, help="rows per micro-batch (DPO: pairs; GRPO: completions)")
    ap.add_argument("--seq_len", type=int, default=1024, help="SFT: tokens per example")
    ap.add_argument("--prompt_len", type=int, default=128, help="DPO/GRPO/PPO: prompt tokens")
    ap.add_argument("--completion_len", type=int, default=512, help="DPO/GRPO/PPO: completion tokens")
    ap.add_argument("--num_generations", type=int, default=8, help="GRPO: completions per prompt")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="weights and optimizer state (float32 under bf16 autocast is mixed precision; --no_bf16 "
                         "turns the autocast off)")
    ap.add_argument("--no_bf16", action="store_true", help="no bf16 autocast (float32 compute)")
    ap.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 trains the full model")
    ap.add_argument("--activation_checkpointing", action="store_true")
    ap.add_argument("--activation_offloading", action="store_true",
                    help="saved activations wait in host memory until backward (the trainers' activation_offloading)")
    ap.add_argument("--sequence_parallel_size", type=int, default=1,
                    help="one rank of a Ulysses group of this many ranks, holding 1/N of each row's tokens")
    ap.add_argument("--reference_model", choices=("auto", "yes", "no"), default="auto",
                    help="a frozen reference copy (auto: DPO and PPO yes, GRPO no, i.e. beta = 0)")
    ap.add_argument("--gpu_gib", type=float, default=None, help="say whether the step fits a card of this size; if "
                                                                "not, find the first setting that does (checkpointing, "
                                                                "then offloading, then sequence parallelism 2/4/8)")
    a = ap.parse_args(argv)
    if a.trainer == "ppo" and (a.activation_offloading or a.sequence_parallel_size > 1):
        ap.error("--activation_offloading and --sequence_parallel_size: PPO has neither setting")
    model = a.model or str(embedded_model_path())
    ref = None if a.reference_model == "auto" else a.reference_model == "yes"

    def estimate(checkpointing: bool, offloading: bool, sp: int):
        return estimate_step_memory(model, a.trainer, batch_size=a.batch_size, seq_len=a.seq_len,
                                    prompt_len=a.prompt_len, completion_len=a.completion_len,
                                    num_generations=a.num_generations, dtype=a.dtype, bf16=not a.no_bf16,
                                    lora_r=a.lora_r, activation_checkpointing=checkpointing,
                                    activation_offloading=offloading, reference_model=ref, sequence_parallel_size=sp)

    est = estimate(a.activation_checkpointing, a.activation_offloading, a.sequence_parallel_size)
    d = est.details
    print(f"{a.trainer} on {model}: {d['tokens_per_micro_batch']} tokens per micro-batch, {d['dtype']} weights"
          f"{' + bf16 autocast' if d['bf16'] and d['dtype'] == 'float32' else ''}, "
          f"{'LoRA r=' + str(d['lora_r']) if d['lora_r'] else 'full fine-tuning'}, activation checkpointing "
          f"{'on' if d['activation_checkpointing'] else 'off'}, {d['frozen_copies']} frozen model(s) beside")
    if a.sequence_parallel_size > 1 or a.activation_offloading:
        print(f"per rank of a sequence-parallel group of {a.sequence_parallel_size}; activation offloading "
              f"{'on' if a.activation_offloading else 'off'}")
    print(est.table())
    if a.activation_offloading:
        print(f"pinned host memory for the offloaded activations: {d['offloaded_bytes'] / 2**30:.2f} GiB per rank "
              "(each save counted; the host allocator rounds each buffer up to a power of two)")
    if a.gpu_gib is not None:
        need = est.peak * 1.1 / 2**30
        print(f"{'fits' if need <= a.gpu_gib else 'does not fit'} a {a.gpu_gib:g} GiB card (the peak + 10% for "
              f"kernel workspaces and fragmentation: {need:.1f} GiB)")
        if need > a.gpu_gib:
            # the ladder, cheapest first: recompute (a third more compute), then host copies (PCIe time), then
            # more GPUs per row
            from .memory import _load_config

            heads = _load_config(model).num_attention_heads
            ladder = [(True, a.activation_offloading, a.sequence_parallel_size)]
            if a.trainer != "ppo":  # PPO has neither setting
                ladder += [(True, True, a.sequence_parallel_size)]
                # Ulysses gives each rank of a group a share of the heads: sizes that divide them
                ladder += [(True, True, sp) for sp in (2, 4, 8) if sp > a.sequence_parallel_size and heads % sp == 0]
            asked = (a.activation_checkpointing, a.activation_offloading, a.sequence_parallel_size)
            ladder = [rung for rung in dict.fromkeys(ladder) if rung != asked]
            for checkpointing, offloading, sp in ladder:
                est_rung = estimate(checkpointing, offloading, sp)
                peak = est_rung.peak * 1.1 / 2**30
                setting = (f"activation_checkpointing=True, activation_offloading={offloading}, "
                           f"sequence_parallel_size={sp}")
                host = est_rung.details["offloaded_bytes"] / 2**30
                print(f"  {setting}: {peak:.1f} GiB" + (f" (and {host:.1f} GiB of pinned host memory per rank)"
                                                        if offloading else ""))
                if peak <= a.gpu_gib:
                    print(f"fits with {setting}")
                    return 0
            print("no setting tried fits; shorten the rows, use LoRA (--lora_r) or shard the weights (FSDP2)")
    return 0


def _model_path(argv: list[str]) -> int:
    from .models import embedded_model_path

    print(embedded_model_path())
    return 0


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process (a rank can abort in interpreter teardown)
