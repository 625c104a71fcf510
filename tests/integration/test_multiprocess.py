"""Real two-process (gloo) runs: 2 ranks x batch 4 equal 1 process x batch 8, losses per step and final weights.

SFT (a list and a stream), DPO, PPO (advantage whitening, loss token counts, gradients, clipping and rollout
statistics over all ranks; one case with gradient accumulation) and GRPO (loss types dapo, grpo, dr_grpo and prompt; group and batch reward scaling; one case with
gradient accumulation 2 per rank and num_iterations 2): GRPO's loss counts (tokens,
completions, prompts of the step) and batch-level advantage statistics are global across ranks, so the
2-process run is the same optimisation as the 1-process run with twice the batch. The same equality
holds under FSDP2 (accelerate's preparation, sharded weights) for SFT, DPO and GRPO.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import HELPERS

WORKER = str((HELPERS / "ddp_worker.py"))
FSDP2_CASES = ["sft", "sft-stream", "dpo", "grpo-dapo-group", "grpo-grpo-batch", "grpo-prompt-batch-accum", "episodes"]
CASES = ["sft", "sft-stream", "dpo", "ppo", "ppo-accum", "ppo-minibatches", "grpo-dapo-group", "grpo-grpo-batch", "grpo-dr_grpo-batch", "grpo-prompt-batch-accum", "episodes"]


def _run(cmd, env):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _two_ranks_against_one(tmp_path, cases, port, **extra_env):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch"
    # ACCELERATE_USE_CPU: what `accelerate launch --cpu` sets; without it Trainer stays single-process on CPU.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true",
           "PYTHONPATH": str(HELPERS) + os.pathsep + str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, WORKER, str(one), "1", ",".join(cases)], env)
    _run([torchrun, "--nproc_per_node", "2", "--master_port", str(port), WORKER, str(two), "2", ",".join(cases)],
         {**env, **extra_env})
    r1, r2 = json.loads((one / "result.json").read_text()), json.loads((two / "result.json").read_text())
    for case in cases:
        assert r1[case]["world_size"] == 1 and r2[case]["world_size"] == 2, case
        assert len(r1[case]["losses"]) == len(r2[case]["losses"]) >= 1, case
        # logged losses are rounded to 6 decimals: values 1e-9 apart can round 1e-6 apart, hence abs=2e-6 (the
        # parameters below are compared unrounded)
        assert r2[case]["losses"] == pytest.approx(r1[case]["losses"], rel=1e-5, abs=2e-6), case
        if r2[case]["saved"] is not None:  # save_model on every rank: staged, moved in, nothing left half-way
            assert {"config.json", "README.md"} <= set(r2[case]["saved"]), (case, r2[case]["saved"])
            assert ".toolkit-saving" not in r2[case]["saved"] and r2[case]["saved"] == r1[case]["saved"], case
            # the weights written (gathered whole under FSDP2, tied ones once) are the one-process run's
            from safetensors.torch import load_file
            w1, w2 = (load_file(str(d / case / "saved" / "model.safetensors")) for d in (one, two))
            assert w1.keys() == w2.keys(), case
            for k in w1:
                torch.testing.assert_close(w1[k], w2[k], rtol=1e-5, atol=1e-5, msg=f"{case} saved: {k}")
        p1, p2 = torch.load(one / case / "params.pt"), torch.load(two / case / "params.pt")
        for k in p1:
            torch.testing.assert_close(p1[k], p2[k], rtol=1e-5, atol=1e-5, msg=f"{case}: {k}")
    return r2


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    r2 = _two_ranks_against_one(tmp_path, CASES, 29533)
    assert not any(r["sharded"] for r in r2.values())  # plain DDP


@pytest.mark.slow
def test_async_grpo_with_two_trainer_ranks(tmp_path):
    """Two trainer processes, each with its own rollout worker process (4 processes in all). At max_staleness 0
    the run equals synchronous GRPO on the same 2 ranks (losses, final weights, and every rank's rows of every
    round); with max_staleness 1 the ranks still train the same rounds, each its share, in the synchronous
    order. (Synchronous GRPO on 2 ranks equals 1 process with twice the batch: the test above.)"""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true",
           "PYTHONPATH": str(HELPERS) + os.pathsep + str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # async-0-warm: warm start on (the trainer ranks generate the first rounds themselves, deciding together when
    # every rank's worker is ready; a tiny model's 3 steps may all be generated there)
    cases = ["grpo-tfm", "async-0", "async-1", "async-0-warm", "grpo-tfm-episodes", "async-0-episodes"]
    _run([torchrun, "--nproc_per_node", "2", "--master_port", "29537", WORKER, str(tmp_path), "2", ",".join(cases)],
         env)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["async-0"]["world_size"] == 2 and len(r["async-0"]["losses"]) == 3
    assert r["async-0"]["losses"] == pytest.approx(r["grpo-tfm"]["losses"], rel=1e-5, abs=2e-6)  # rounded to 6 decimals when logged
    assert r["async-0-warm"]["losses"] == pytest.approx(r["grpo-tfm"]["losses"], rel=1e-5, abs=2e-6)
    assert r["async-0-warm"]["rounds_in_trainer"] == 1 and r["async-0"]["rounds_in_trainer"] == 0
    sync = torch.load(tmp_path / "grpo-tfm" / "params.pt")
    for case in ("async-0", "async-0-warm"):
        stale0 = torch.load(tmp_path / case / "params.pt")
        for k in sync:
            torch.testing.assert_close(stale0[k], sync[k], rtol=1e-5, atol=1e-5, msg=f"{case}: {k}")
    # multi-turn episodes: each rank's worker runs its rank's episodes (the factory sent to it, pickled)
    assert r["async-0-episodes"]["losses"] == pytest.approx(r["grpo-tfm-episodes"]["losses"], rel=1e-5, abs=2e-6)
    assert max(r["grpo-tfm-episodes"]["turns"]) > 1
    sync_ep, async_ep = (torch.load(tmp_path / c / "params.pt") for c in ("grpo-tfm-episodes", "async-0-episodes"))
    for k in sync_ep:
        torch.testing.assert_close(async_ep[k], sync_ep[k], rtol=1e-5, atol=1e-5, msg=f"episodes: {k}")
    for rank in (0, 1):
        expected = json.loads((tmp_path / "grpo-tfm" / f"rounds_rank{rank}.json").read_text())
        assert len(expected) == 3
        for case in ("async-0", "async-1", "async-0-warm"):
            assert json.loads((tmp_path / case / f"rounds_rank{rank}.json").read_text()) == expected, (case, rank)
    rank0, rank1 = (json.loads((tmp_path / "grpo-tfm" / f"rounds_rank{k}.json").read_text()) for k in (0, 1))
    assert all(not set(a) & set(b) for a, b in zip(rank0, rank1))  # each rank its own share of the round


@pytest.mark.slow
def test_fsdp2_two_ranks_match_one_process(tmp_path):
    """accelerate's own FSDP2 preparation (each decoder layer, the embedding/norm/head unit and the root sharded,
    reshard_after_forward=True) over 2 gloo processes: the chunked LM head reads the weight outside the forward
    (models.output_head) and GRPO's decoding runs in lockstep across ranks (each forward all-gathers; a rank
    that stopped early crashed the collective before). The worker lifts accelerate's GPU-only gate for FSDP."""
    r2 = _two_ranks_against_one(tmp_path, FSDP2_CASES, 29535, TOOLKIT_TEST_FSDP2="1")
    assert all(r["sharded"] for r in r2.values())
    # multi-turn episodes: some episodes were cut before their third turn, and a rank with fewer contexts than the
    # other made up the difference with calls that only step placeholder batches (else the run would hang)
    assert 1 < max(r2["episodes"]["turns"]) and min(r2["episodes"]["turns"]) < 3
    assert r2["episodes"]["padded_calls"] > 0


@pytest.mark.slow
def test_fsdp2_ranks_with_different_numbers_of_prompts_generate_in_lockstep(tmp_path):
    """TransformersBackend on an FSDP2 model (2 gloo processes): ranks bring different numbers of prompts to a call
    (none; 2 batches against 1; the group path), one sequence per batch. The batch count is agreed before any
    forward, and the rank with fewer batches steps placeholders: each rank samples exactly what one process samples
    for its prompts and seed, and the run neither hangs nor crashes."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    worker = str((HELPERS / "lockstep_worker.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _run([sys.executable, worker, str(tmp_path / "one.json")], env)
    _run([torchrun, "--nproc_per_node", "2", "--master_port", "29538", worker, str(tmp_path / "two.json")], env)
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    for rank in ("0", "1"):
        for call_two, call_one in zip(two[rank][0], one[rank][0], strict=True):
            assert [[ids for ids, _ in g] for g in call_two] == [[ids for ids, _ in g] for g in call_one], rank
            flat = lambda call: [x for g in call for _, lp in g for x in lp]  # noqa: E731
            assert flat(call_two) == pytest.approx(flat(call_one), abs=1e-5), rank
    # In call 1 or 2, the first batch of the rank with two ended before the other rank's batch: that rank stepped on
    # drawing nothing (it drew before, and its second batch then sampled differently from one process)
    def first_batch_steps(rank, call):  # the batch (one prompt, n samples) decodes until its longest sample ends
        return max(len(ids) for ids, _ in two[rank][0][call][0])

    assert first_batch_steps("0", 1) < first_batch_steps("1", 1) or first_batch_steps("1", 2) < first_batch_steps("0", 2)
    assert one["0"][1] == one["1"][1] == [0, 0, 0]  # one process never pads
    assert two["0"][1] == [0, 0, 1] and two["1"][1] == [3, 1, 0]  # batches short of the other rank's, per call
    assert sum(len(g) for call in two["1"][0] for g in call) == 0 + 1 + 2 * 2


@pytest.mark.slow
def test_the_cli_under_torchrun_prints_and_writes_from_rank_zero_only(tmp_path):
    from toolkit.testing import tiny_model, tiny_tokenizer

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i}+1? ", "completion": str(i + 1)}) for i in range(16)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(
        [torchrun, "--nproc_per_node", "2", "--master_port", "29534", "-m", "toolkit.core.cli", "sft", "--model",
         str(tmp_path / "m"), "--dataset", str(data), "--max_steps", "2", "--output_dir", str(tmp_path / "out"),
         "--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no", "--disable_tqdm", "true"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("=== SFT summary ===") == 1, proc.stdout
    assert "[rank 1] INFO" not in proc.stderr
    assert proc.stderr.count("SFT train data:") <= 1  # an INFO line of the data layer, once
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["saved_to"].endswith("final") and (tmp_path / "out" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_lm_head_read_outside_forward_is_whole_when_fsdp2_resharded_it(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    worker = str((HELPERS / "fsdp_head_worker.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _run([sys.executable, worker, str(tmp_path / "one.pt")], env)
    _run([torchrun, "--nproc_per_node", "2", "--master_port", "29536", worker, str(tmp_path / "two.pt")], env)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert two["head_type_after_forward"] == "DTensor"  # a direct read would get a shard (and a matmul error)
    for k in one["params"]:
        torch.testing.assert_close(one["params"][k], two["params"][k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(two["engine_weights"][k], two["params"][k], rtol=0, atol=0, msg=k)
    assert set(two["engine_weights"]) == set(one["params"])
    assert two["partial_names"] == one["partial_names"] == sorted(k for k in one["params"] if ".layers.1." in k)
