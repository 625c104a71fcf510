"""TrainerLifecycle: what every trainer on transformers.Trainer shares, written once (toolkit.core.lifecycle)."""

import os

import torch
from builders import plain_pc

from toolkit import SFTConfig, SFTTrainer
from toolkit.core.lifecycle import TrainerLifecycle
from toolkit.core.plugins import registry
from toolkit.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")


def sft(tmp_path):
    return SFTTrainer(tiny_model(), SFTConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1,
                                              report_to="none", disable_tqdm=True, save_strategy="no"),
                      train_dataset=plain_pc(8), processing_class=tiny_tokenizer())


def test_recorded_metrics_are_averaged_at_the_next_logged_step(tmp_path):
    t = sft(tmp_path)
    t.record_metric("a", 1.0)
    t.record_metric("a", torch.tensor(3.0))            # a tensor is read only at the log
    t.record_metric("b_max", 2.0)
    t.record_metric("b_max", torch.tensor(5.0))        # *_max: the largest
    t.record_metric("c", float("nan"))                 # NaN is skipped
    t.record_metric("c", 4.0)
    t.record_metric("d", torch.tensor([1.0, 0.0, 0.0, 1.0]))  # each element counts as one value
    t.record_metric("a", 10.0, mode="eval")
    assert t.recorded_metrics()["d"] == [1.0, 0.0, 0.0, 1.0]
    logs = {"loss": 0.5}
    t.log(logs)
    assert (logs["a"], logs["b_max"], logs["c"], logs["d"]) == (2.0, 5.0, 4.0, 0.5)
    assert "eval_a" not in logs and t.recorded_metrics() == {}
    eval_logs = {"eval_loss": 1.0}
    t.log(eval_logs)
    assert eval_logs["eval_a"] == 10.0 and t.recorded_metrics("eval") == {}
    closing = {"train_runtime": 1.0}  # the run's closing summary is not a logged step: nothing is merged into it
    t.record_metric("a", 7.0)
    t.log(closing)
    assert "a" not in closing and t.recorded_metrics() == {"a": [7.0]}


def test_plugins_hear_the_trainers_own_name(tmp_path):
    heard = []

    class Listener:
        from toolkit import hookimpl

        @hookimpl
        def toolkit_on_step_metrics(self, trainer, step, metrics):
            heard.append((trainer, "loss" in metrics))

    reg = registry()
    plugin = Listener()
    reg.pm.register(plugin)
    try:
        t = sft(tmp_path)
        t.train()
    finally:
        reg.pm.unregister(plugin)
    assert ("sft", True) in heard


def test_every_trainer_shares_the_lifecycle():
    from toolkit import AsyncGRPOTrainer, DPOTrainer, GRPOTrainer, PPOTrainer
    from toolkit.experimental.cpo import CPOTrainer
    from toolkit.experimental.gkd import GKDTrainer
    from toolkit.experimental.kto import KTOTrainer
    from toolkit.experimental.online_dpo import OnlineDPOTrainer
    from toolkit.experimental.orpo import ORPOTrainer
    from toolkit.experimental.reward import RewardTrainer

    for cls in (SFTTrainer, DPOTrainer, GRPOTrainer, AsyncGRPOTrainer, PPOTrainer, KTOTrainer, CPOTrainer, ORPOTrainer,
                OnlineDPOTrainer, GKDTrainer, RewardTrainer):
        assert issubclass(cls, TrainerLifecycle), cls
        # none writes its own resume preamble, atomic save or metric averaging again
        for name in ("_save_checkpoint", "log", "save_model", "create_model_card"):
            assert name not in vars(cls) or cls is PPOTrainer and name == "save_model", (cls.__name__, name)
