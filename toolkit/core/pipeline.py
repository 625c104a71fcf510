"""`toolkit pipeline`: run files in sequence, each stage starting from the model the previous one saved.

    # examples/arithmetic_pipeline.toml
    output_dir = "outputs/arithmetic"
    stages = [
      {command = "sft", config = "examples/arithmetic_warmup_sft.toml"},
      {command = "grpo", config = "examples/grpo_arithmetic.toml", overrides = {max_steps = 60}},
    ]

Stage i writes into `<output_dir>/<i>-<command>/` (its usual summary, report and `final/` model); stage i > 0
gets `model = <previous stage>/final`. Every stage's run file and overrides are checked before the first stage
starts, so a typo in the last stage does not surface after the first one trained. The pipeline writes
`<output_dir>/summary.json` (stages side by side, the commit it ran at) and `<output_dir>/report.png`
(held-out accuracy across the stages, the RL reward curve), and prints one table.
"""

from __future__ import annotations

__all__ = ["PIPELINE_COMMANDS", "load_pipeline", "run_pipeline"]

import json
import logging
import time
from pathlib import Path
from typing import Any

from .config import load_run_file, read_toml
from .distributed import env_rank
from .errors import ConfigError, ToolkitError

logger = logging.getLogger(__name__)

PIPELINE_COMMANDS = ("sft", "dpo", "grpo", "async-grpo", "ppo")


def load_pipeline(path: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """(output_dir, stages) from a pipeline file, checked: known commands, existing run files, dict overrides."""
    path = Path(path)
    data = read_toml(path, what="pipeline file")
    unknown = sorted(set(data) - {"output_dir", "stages"})
    if unknown:
        raise ConfigError(f"pipeline '{path}': unknown keys {unknown}; a pipeline file has output_dir and stages.")
    out = data.get("output_dir")
    if not isinstance(out, str) or not out:
        raise ConfigError(f"pipeline '{path}': output_dir must be a folder name, got {out!r}.")
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"pipeline '{path}': stages must be a non-empty list of {{command = ..., config = ...}}.")
    checked = []
    for i, stage in enumerate(stages):
        where = f"pipeline '{path}', stage {i + 1}"
        if not isinstance(stage, dict):
            raise ConfigError(f"{where}: expected {{command = ..., config = ...}}, got {stage!r}.")
        extra = sorted(set(stage) - {"command", "config", "overrides"})
        if extra:
            raise ConfigError(f"{where}: unknown keys {extra}; a stage has command, config and optional overrides.")
        if stage.get("command") not in PIPELINE_COMMANDS:
            raise ConfigError(f"{where}: command {stage.get('command')!r} is not one of {list(PIPELINE_COMMANDS)}.")
        given = Path(str(stage.get("config", ""))).expanduser()
        # a relative run file: next to the pipeline file, else from the working directory (the repo root for
        # the shipped examples, which name "examples/...")
        candidates = [given] if given.is_absolute() else [path.parent / given, given]
        config = next((c for c in candidates if c.is_file()), None)
        if config is None:
            raise ConfigError(f"{where}: run file '{stage.get('config')}' does not exist (looked in "
                              f"{', '.join(str(c) for c in candidates)}).")
        overrides = stage.get("overrides", {})
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where}: overrides must be a table of key = value, got {overrides!r}.")
        reserved = sorted(set(overrides) & {"output_dir", "model", "config", "help"})
        if reserved:
            raise ConfigError(f"{where}: overrides may not set {reserved}; the pipeline sets output_dir and model "
                              "for every stage.")
        load_run_file(config)  # flat and valid TOML
        checked.append({"command": stage["command"], "config": str(config), "overrides": overrides})
    return out, checked


def _toml_literal(value: Any) -> str:
    """A value as the TOML literal the CLI's override parser reads back to the same value and type."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(value, "nan" if value != value else repr(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string: "123" stays a string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"pipeline overrides: cannot pass {value!r} ({type(value).__name__}) to a stage.")


def _argv(stage: dict[str, Any], out_dir: Path, model: str | None) -> list[str]:
    argv = ["--config", stage["config"]]
    for key, value in stage["overrides"].items():
        argv.append(f"--{key}={_toml_literal(value)}")
    argv += ["--output_dir", str(out_dir)]
    if model is not None:
        argv += ["--model", model]
    return argv


def _stage_summary(out_dir: Path) -> dict[str, Any]:
    for candidate in (out_dir / "report" / "summary.json", out_dir / "summary.json"):
        if candidate.exists():
            return json.loads(candidate.read_text())
    return {}


def run_pipeline(argv: list[str], commands: dict[str, Any], parse_stage: Any) -> int:
    """Check every stage, then run them in order; `commands` maps a command to its CLI entry point and
    `parse_stage(command, argv)` checks a stage's run file + overrides the way that command will."""
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        raise ConfigError("--config: give the pipeline file, e.g. toolkit pipeline --config "
                          "examples/arithmetic_pipeline.toml.")
    extra = [a for i, a in enumerate(argv) if a != "--config" and (i == 0 or argv[i - 1] != "--config")]
    if extra:
        raise ConfigError(f"pipeline: unexpected arguments {extra}; put settings in the stages' run files or "
                          "their `overrides`.")
    out, stages = load_pipeline(argv[argv.index("--config") + 1])
    root = Path(out).expanduser()
    for i, stage in enumerate(stages):  # all stages checked before the first trains
        try:
            parse_stage(stage["command"], _argv(stage, root / f"{i}-{stage['command']}", "checked" if i else None))
        except ToolkitError as e:  # which stage (numbered from 1, as the log numbers them) and its run file
            raise type(e)(f"pipeline stage {i + 1} of {len(stages)} ({stage['command']}, {stage['config']}): "
                          f"{e}") from e
    main_process = env_rank() == 0
    started = time.perf_counter()
    results, model = [], None
    for i, stage in enumerate(stages):
        stage_dir = root / f"{i}-{stage['command']}"
        logger.info("pipeline stage %d/%d: toolkit %s --config %s -> %s", i + 1, len(stages), stage["command"],
                    stage["config"], stage_dir)
        t0 = time.perf_counter()
        rc = commands[stage["command"]](_argv(stage, stage_dir, model))
        if rc != 0:
            return rc
        _barrier()  # under torchrun the next stage loads final/, which rank 0 wrote
        summary = _stage_summary(stage_dir)
        results.append({"stage": i, "command": stage["command"], "config": stage["config"],
                        "output_dir": str(stage_dir), "minutes": round((time.perf_counter() - t0) / 60, 2),
                        **{k: v for k, v in summary.items()
                           if k.startswith(("heldout_", "eval_", "train_loss", "stability"))},
                        "accuracy_history": summary.get("accuracy_history", [])})
        model = str(stage_dir / "final")
    from .report import source_commit  # (here: report imports torch, and `toolkit pipeline --help` must not)

    total = {"stages": results, "minutes": round((time.perf_counter() - started) / 60, 2), "commit": source_commit(),
             "final_model": model,
             "heldout_accuracy_before": results[0].get("heldout_accuracy_before"),
             "heldout_accuracy_after": results[-1].get("heldout_accuracy_after")}
    if main_process:
        root.mkdir(parents=True, exist_ok=True)
        (root / "summary.json").write_text(json.dumps(total, indent=2))
        _plot(root, results, total)
        _print(total)
    return 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _print(total: dict[str, Any]) -> None:
    print("\n=== pipeline summary ===")
    print(f"{'stage':<18}{'minutes':>8}{'acc before':>12}{'acc after':>11}")
    for r in total["stages"]:
        before, after = (r.get(k) for k in ("heldout_accuracy_before", "heldout_accuracy_after"))
        shown = ["-" if v is None else f"{v:.3f}" for v in (before, after)]
        print(f"{str(r['stage']) + '-' + r['command']:<18}{r['minutes']:>8.2f}{shown[0]:>12}{shown[1]:>11}")
    print(f"{'total':<18}{total['minutes']:>8.2f}   final model: {total['final_model']}   commit: {total['commit']}")


def _stage_series(r: dict[str, Any]) -> tuple[str, list[tuple[int, float]]]:
    """(label, (step, value) points) of a stage's training signal, read from its metrics.jsonl: the training loss of
    SFT and DPO, the mean reward (PPO: score) of the RL stages."""
    key = {"grpo": "reward", "async-grpo": "reward", "ppo": "objective/scores"}.get(r["command"], "loss")
    rows = []
    for name in ("metrics.jsonl", "report/metrics.jsonl"):
        path = Path(r["output_dir"]) / name
        if path.exists():
            rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
            break
    points = [(int(row["step"]), float(row[key])) for row in rows if key in row and "step" in row]
    return ("training loss" if key == "loss" else f"mean {key.split('/')[-1]}"), points


def _headline(total: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """'held-out accuracy 21.9% -> 67.2% (sft) -> 75.0% (grpo) | 7.1 min | commit abc1234'."""
    parts = []
    first = results[0].get("heldout_accuracy_before") if results else None
    if first is not None:
        parts.append(f"{100 * first:.1f}%")
    for r in results:
        after = r.get("heldout_accuracy_after")
        if after is not None:
            parts.append(f"{100 * after:.1f}% ({r['command']})")
    accuracy = f"held-out greedy accuracy {' -> '.join(parts)}" if parts else "no held-out accuracy measured"
    return f"{accuracy}   |   {total['minutes']:.1f} min   |   commit {total.get('commit') or 'unknown'}"


def _plot(root: Path, results: list[dict[str, Any]], total: dict[str, Any]) -> None:
    """One column per stage, each with its own step axis: held-out accuracy on top (values written at the points),
    the stage's training signal below (SFT/DPO loss, RL reward with a 10-step average); a headline with accuracy
    before -> after each stage, minutes and commit."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no pipeline report.png.")
        return
    n = max(len(results), 1)
    fig, axes = plt.subplots(2, n, figsize=(4.4 * n, 6.6), squeeze=False, height_ratios=[1, 1])
    for col, r in enumerate(results):
        ax_acc, ax_sig = axes[0][col], axes[1][col]
        label, points = _stage_series(r)
        last_step = points[-1][0] if points else 1
        history = r["accuracy_history"] or [(0, r.get("heldout_accuracy_before")),
                                            (last_step, r.get("heldout_accuracy_after"))]
        acc = [(s, a) for s, a in history if a is not None]
        name = f"stage {r['stage'] + 1}: {r['command']} ({r['minutes']:.1f} min)"
        if acc:
            ax_acc.plot([s for s, _ in acc], [a for _, a in acc], "o-", color="tab:red")
            for s, a in (acc[0], acc[-1]) if len(acc) > 1 else acc:
                ax_acc.annotate(f"{100 * a:.1f}%", (s, a), textcoords="offset points", xytext=(0, 7), ha="center",
                                fontsize=9)
            ax_acc.set_title(name)
        else:
            ax_acc.set_title(f"{name}\nno held-out accuracy")
        ax_acc.set(ylim=(0, 1.08), ylabel="held-out greedy accuracy" if col == 0 else None)
        ax_acc.grid(alpha=0.3)
        if points:
            steps, values = zip(*points)
            smoothed = len(values) >= 20  # a short series is shown as it is
            ax_sig.plot(steps, values, color="tab:blue", alpha=0.35 if smoothed else 1.0,
                        marker="" if smoothed else ".", label=f"{label} (each logged step)")
            if smoothed:
                smooth = [sum(values[max(0, i - 9):i + 1]) / len(values[max(0, i - 9):i + 1])
                          for i in range(len(values))]
                ax_sig.plot(steps, smooth, color="tab:blue", label="mean of the last 10 logged values")
            ax_sig.legend(fontsize=8, loc="best")
        ax_sig.set(xlabel=f"{r['command']} step", ylabel=label)
        ax_sig.grid(alpha=0.3)
    fig.suptitle(_headline(total, results), fontsize=10)
    fig.tight_layout()
    fig.savefig(root / "report.png", dpi=110)
    plt.close(fig)
