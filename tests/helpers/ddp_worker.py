"""Run by tests/integration/test_multiprocess.py, alone or under torchrun: one trainer per case, parameters saved by rank 0.

Every case takes 8 examples per optimizer step: 1 process x 8 or 2 processes x 4 (same data order), SGD at
learning rate 1 without clipping, so any difference in how the loss is normalised shows in the weights.
"""

import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch

from toolkit import (AsyncGRPOConfig, AsyncGRPOTrainer, DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PPOConfig,
                     PPOTrainer, SFTConfig, SFTTrainer)
from toolkit.core.distributed import exit_process, leave_process_group
from toolkit.core.generation import TransformersBackend
from toolkit.core.hookspecs import hookimpl
from toolkit.core.plugins import registry
from transformers import TrainerCallback
from toolkit.testing import tiny_model, tiny_tokenizer

SGD = dict(optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant", weight_decay=0.0,
           logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")


class PerPromptSeeded:
    """GRPO's sampler, seeded per prompt (from its ids and the round), so the completions of a prompt do not
    depend on which rank or which position it lands on: both runs then train on the very same samples."""

    def __init__(self, model, tokenizer, config):
        self.inner = TransformersBackend(model, pad_token_id=tokenizer.pad_token_id)
        self.calls = 0
        self.padded = 0  # PerContextSeeded: calls without prompts made to keep a sharded model's ranks in step

    def sync_weights(self, model):
        self.inner.sync_weights(model)

    def generate(self, prompts, params, *, n=1, seed=None):
        self.calls += 1
        return [self.inner.generate([p], params, n=n, seed=zlib.crc32(f"{p}/{self.calls}".encode()))[0]
                for p in prompts]


class PerContextSeeded(PerPromptSeeded):
    """Seeded by the context's ids alone, for multi-turn episodes: a turn's context holds the episode so far, so
    the samples do not depend on the rank, the batch or how many calls came before. Under FSDP2 every rank makes as
    many calls to the real backend as the rank with the most contexts (a call without prompts steps placeholder
    batches alongside the other ranks' forwards: TransformersBackend's lockstep padding)."""

    def generate(self, prompts, params, *, n=1, seed=None):
        from toolkit.core.generation import _decodes_in_lockstep, _max_over_ranks

        # the call count is agreed before any forward (as TransformersBackend agrees its batch count)
        calls = _max_over_ranks(len(prompts), torch.device("cpu")) if _decodes_in_lockstep(self.inner.model) else 0
        out = [self.inner.generate([p], params, n=n, seed=zlib.crc32(str(list(p)).encode()))[0] for p in prompts]
        for _ in range(calls - len(prompts)):
            assert self.inner.generate([], params, n=1) == []
            self.padded += self.inner.last_stats.extra["placeholder_batches"]  # the real backend's own count
        return out


class _Plugin:
    @staticmethod
    @hookimpl
    def toolkit_register_generation_backends():
        return {"per_prompt_seeded": PerPromptSeeded, "per_context_seeded": PerContextSeeded}


# multi-turn episodes (tests/helpers/episode_envs.py): three turns unless a turn is cut at max_completion_length, so
# episodes (and ranks) end at different turns; the reward is the characters written, mod 7
EPISODES = dict(environment="gymnasium", environment_kwargs={"env": "episode_envs:Turns-v0"}, max_turns=3,
                max_episode_tokens=200)


def episode_rows():
    return [{"prompt": "play", "seed": i} for i in range(16)]


def sft_rows():
    short = [{"prompt": f"What is {i} + {i + 1}? ", "completion": str(2 * i + 1)} for i in range(4)]
    long = [{"prompt": "Say a long thing: ", "completion": "The quick brown fox jumps " * (i + 1)} for i in range(4)]
    return short + long


def pairs():
    return [{"prompt": f"What is {i} + {i + 1}? ", "chosen": str(2 * i + 1), "rejected": "I do not know " * (i % 3 + 1)}
            for i in range(8)]


def prompts():
    return [{"prompt": f"Count to {i}: " + "one " * (i % 3)} for i in range(8)]


def uneven_reward(completions, completion_ids, **kw):
    """Deterministic and varied (so groups have non-zero spread), from the sampled ids alone."""
    return [float(sum(ids) % 7) / 7 + 0.1 * len(ids) for ids in completion_ids]


class _RecordsRounds:
    """Records the rows of every round this rank trains on (GRPO and async GRPO both build rollouts here)."""

    rounds_seen: list

    def build_rollout(self, row_indices, *args, **kwargs):
        self.__dict__.setdefault("rounds_seen", []).append([int(i) for i in row_indices])
        return super().build_rollout(row_indices, *args, **kwargs)


class RecordingGRPO(_RecordsRounds, GRPOTrainer):
    pass


class RecordingAsyncGRPO(_RecordsRounds, AsyncGRPOTrainer):
    pass


class _WaitForWorker(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            deadline = time.time() + 120
            while not self.trainer.worker.ready() and time.time() < deadline:
                time.sleep(0.05)


def enable_fsdp2_on_cpu() -> dict:
    """accelerate (1.15) turns its FSDP plugin on only for GPU-like launches; on CPU it silently runs DDP. This
    lifts that gate in the test process only, so accelerate's own FSDP2 preparation (fully_shard of each decoder
    layer, the embedding/norm/head unit, the root) runs for real with gloo. Returns the TrainingArguments."""
    import accelerate.state as acc_state
    from accelerate.utils import DistributedType

    original = acc_state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    acc_state.AcceleratorState.__init__ = init
    return dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                        "reshard_after_forward": True})


FSDP: dict = {}


def run(case: str, out: Path, world: int) -> dict:
    per_device = 8 // world
    tok = tiny_tokenizer()
    sharded = FSDP if world > 1 else {}
    if case.endswith("-sp"):
        # sequence parallelism: groups of 2 ranks share each batch, each rank holding half of every packed row;
        # 8 examples per step over the world // 2 replicas, 2 steps
        sp = 2 if world > 1 else 1
        per_device = 8 // (world // sp)
        # held-out batches of 3 rows: 6 rows make 2, the same batches for one process and for 2 replicas
        common = dict(output_dir=str(out), max_steps=2, per_device_train_batch_size=per_device,
                      per_device_eval_batch_size=3, sequence_parallel_size=sp, **{**SGD, "learning_rate": 0.1}, **sharded)
        if case == "sft-sp":  # with held-out rows: evaluation shares its batches over the group too
            trainer = SFTTrainer(tiny_model(), SFTConfig(**common), train_dataset=sft_rows(),
                                 eval_dataset=sft_rows()[::-1][:6], processing_class=tok)
        elif case == "grpo-sp":
            # 8 prompts x 2 completions per step; batch-scaled rewards (statistics over each replica's rows once),
            # a reference (KL), completions cut by every 4th id so row lengths differ
            common.update(per_device_train_batch_size=2 * per_device, learning_rate=0.5)
            cfg = GRPOConfig(**common, num_generations=2, max_completion_length=6, stop_token_ids=list(range(0, 384, 4)),
                             loss_type="dapo", scale_rewards="batch", beta=0.04, generation_backend="per_prompt_seeded")
            trainer = GRPOTrainer(tiny_model(), [uneven_reward], cfg, train_dataset=prompts(), processing_class=tok)
        else:
            trainer = DPOTrainer(tiny_model(), args=DPOConfig(beta=0.5, **common), train_dataset=pairs(),
                                 eval_dataset=pairs()[:6], processing_class=tok)
    elif case == "sft":
        trainer = SFTTrainer(tiny_model(), SFTConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=per_device,
                                                      **SGD, **sharded), train_dataset=sft_rows(), processing_class=tok)
    elif case == "sft-stream":
        # a stream (never materialised): every rank reads it and keeps its share of each global batch of 8
        from datasets import IterableDataset

        stream = IterableDataset.from_generator(lambda: iter(sft_rows()))
        trainer = SFTTrainer(tiny_model(), SFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=per_device,
                                                      **SGD, **sharded), train_dataset=stream, processing_class=tok)
    elif case == "dpo":
        trainer = DPOTrainer(tiny_model(), args=DPOConfig(output_dir=str(out), max_steps=1, beta=0.5,
                                                          per_device_train_batch_size=per_device, **SGD, **sharded),
                             train_dataset=pairs(), processing_class=tok)
    elif case.startswith("ppo"):  # ppo[-accum|-minibatches]
        # 8 completions per update in all; -accum: 2 processes x (micro-batch 2 x gradient accumulation 2), with
        # whitened rewards and gradient clipping (the norm must be taken after the ranks' gradients are summed);
        # -minibatches: 2 mini-batches per epoch, drawn from one permutation of every rank's completions
        accum = case.endswith("accum")
        ga = 2 if accum and world > 1 else 1
        minibatches = 2 if case.endswith("minibatches") else 1
        cfg = PPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=per_device // ga // minibatches,
                        gradient_accumulation_steps=ga, num_mini_batches=minibatches, num_ppo_epochs=2,
                        max_completion_length=6, critic="separate",  # the critic with its own gradients to reduce
                        stop_token_ids=list(range(0, 384, 4)), generation_backend="per_prompt_seeded",
                        whiten_rewards=accum, **{**SGD, "learning_rate": 0.1, "max_grad_norm": 1.0 if accum else 0.0})
        trainer = PPOTrainer(tiny_model(), [uneven_reward], cfg, train_dataset=prompts(), processing_class=tok)
    elif case == "episodes":
        # GRPO on multi-turn episodes: 8 prompts x 2 episodes per step over the ranks; under FSDP2 the ranks whose
        # episodes ended keep decoding placeholders while another rank's episodes continue
        # 1 id in 7 stops a turn: about 40% of turns reach max_completion_length uncut, which ends their episode
        cfg = GRPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=2 * per_device, num_generations=2,
                         max_completion_length=6, stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")] +
                         list(range(330, 384)), loss_type="dapo", scale_rewards="batch", beta=0.0,
                         generation_backend="per_context_seeded", **EPISODES, **{**SGD, "learning_rate": 0.5},
                         **sharded)
        trainer = GRPOTrainer(tiny_model(), [], cfg, train_dataset=episode_rows(), processing_class=tok)
    elif case.startswith("grpo-tfm") or case.startswith("async"):
        # async-<k>: AsyncGRPOTrainer, one rollout worker per rank, max_staleness k. grpo-tfm: synchronous GRPO with
        # the same settings and the plain transformers backend; at staleness 0 async must equal it on every rank
        # (each worker draws its rank's rows with its rank's seeds). The reward is imported by module name, as
        # the worker process needs it.
        import ddp_worker

        # -episodes: multi-turn episodes (a registered environment; its factory is sent to each worker process)
        episodes = case.endswith("episodes")
        common = dict(output_dir=str(out), max_steps=3, per_device_train_batch_size=2 * per_device, num_generations=2,
                      max_completion_length=6, stop_token_ids=list(range(0, 384, 4)), loss_type="dapo", beta=0.0,
                      scale_rewards="batch", **{**SGD, "learning_rate": 0.5}, **(EPISODES if episodes else {}))
        if episodes:  # a turn ends with the template's end-of-turn token (TemplateDelta checks it comes first)
            common["stop_token_ids"] = [tok.convert_tokens_to_ids("<|im_end|>")] + list(range(200, 384))
        rewards, data = ([], episode_rows()) if episodes else ([ddp_worker.uneven_reward], prompts())
        if case.startswith("grpo-tfm"):
            trainer = RecordingGRPO(tiny_model(), rewards, GRPOConfig(**common), train_dataset=data,
                                    processing_class=tok)
        else:
            cfg = AsyncGRPOConfig(**common, max_staleness=int(case.split("-")[1]), worker_threads=1,
                                  heartbeat_timeout=120, worker_start_timeout=300, warm_start=case.endswith("warm"))
            trainer = RecordingAsyncGRPO(tiny_model(), rewards, cfg, train_dataset=data, processing_class=tok)
            if case.endswith("warm"):  # round 0 from the trainers; each rank waits for its worker after step 1, so
                trainer.add_callback(_WaitForWorker(trainer))  # the ranks hand rounds 1 and 2 over together
    else:  # grpo-<loss_type>-<scale_rewards>[-accum]
        _, loss_type, scale, *accum = case.split("-")
        # -accum: 2 processes x (2 prompts x gradient accumulation 2) with num_iterations 2, against 1 process x
        # 8 prompts with num_iterations 2: the step counts must hold across micro-batches and reuse of a round
        ga = 2 if accum and world > 1 else 1
        iterations = 2 if accum else 1
        # 8 prompts per step in all: per process 8/world prompts x 2 completions. Every 4th token id stops a
        # completion, so lengths vary and per-rank token counts differ (local normalisation would show).
        cfg = GRPOConfig(output_dir=str(out), max_steps=2 * iterations, per_device_train_batch_size=2 * per_device // ga,
                         gradient_accumulation_steps=ga, num_iterations=iterations, num_generations=2,
                         max_completion_length=6, stop_token_ids=list(range(0, 384, 4)), loss_type=loss_type, scale_rewards=scale, beta=0.0,
                         generation_backend="per_prompt_seeded", **{**SGD, "learning_rate": 0.5}, **sharded)
        trainer = GRPOTrainer(tiny_model(), [uneven_reward], cfg, train_dataset=prompts(), processing_class=tok)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if case in ("sft-sp", "dpo-sp"):
        losses.append(trainer.evaluate()["eval_loss"])
    if case.startswith("ppo"):  # the rollout statistics are global too: scores, KL, advantages' inputs
        losses += [h[k] for h in trainer.state.log_history if "objective/scores" in h
                   for k in ("objective/scores", "objective/kl", "val/explained_variance", "policy/clipfrac_avg")]
    # under FSDP2 each rank holds shards (DTensors): gather them whole (a collective, so on every rank)
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in trainer.model.named_parameters()}
    if case.startswith("ppo"):  # PPO's separate critic trains too
        params.update({f"critic.{k}": v.detach().clone() for k, v in trainer.critic.named_parameters()})
    if trainer.is_world_process_zero():
        torch.save(params, out / "params.pt")
    saved = None
    if case in ("sft", "dpo", "ppo", "sft-sp", "dpo-sp"):  # every rank calls save_model (FSDP gathers), rank 0 writes, all wait
        trainer.save_model(str(out / "saved"))
        if trainer.is_world_process_zero():
            saved = sorted(p.name for p in (out / "saved").iterdir())
    if hasattr(trainer, "rounds_seen"):
        (out / f"rounds_rank{trainer.accelerator.process_index}.json").write_text(json.dumps(trainer.rounds_seen))
    here = [h["async/rounds_in_trainer"] for h in trainer.state.log_history if "async/rounds_in_trainer" in h]
    padded = getattr(trainer.generation_backend, "padded", 0) if hasattr(trainer, "generation_backend") else 0
    if torch.distributed.is_initialized():  # summed over the ranks (a collective: every rank runs every case)
        t = torch.tensor([padded])
        torch.distributed.all_reduce(t)
        padded = int(t.item())
    return {"losses": losses, "world_size": trainer.args.world_size, "rounds_in_trainer": here[-1] if here else None,
            "turns": [h["episodes/turns_mean"] for h in trainer.state.log_history if "episodes/turns_mean" in h],
            "padded_calls": padded, "saved": saved,
            "sequence_parallel": trainer.sequence_parallel.size if getattr(trainer, "sequence_parallel", None) else 1,
            "sharded": type(trainer.model).__name__.startswith("FSDP")}


def main(out_dir: str, world: int, cases: list[str]) -> None:
    torch.set_num_threads(1)
    if os.environ.get("TOOLKIT_TEST_FSDP2") == "1":
        FSDP.update(enable_fsdp2_on_cpu())
    registry().register(_Plugin(), name="ddp-test-backend")
    results = {}
    for case in cases:
        out = Path(out_dir) / case
        out.mkdir(parents=True, exist_ok=True)
        results[case] = run(case, out, world)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        if torch.distributed.get_rank() != 0:
            return
    (Path(out_dir) / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
    except BaseException:
        leave_process_group()  # a failing rank still leaves before teardown; its traceback is what matters
        raise
    exit_process(0)  # not the interpreter's teardown, where a rank can abort after finishing (see exit_process)
