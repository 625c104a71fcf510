"""Run by tests/integration/test_multiprocess.py, alone or under torchrun: TransformersBackend.generate on a model sharded by
hand with FSDP2 (every forward all-gathers), with ranks that bring different numbers of prompts to the same call
(none, fewer batches, the group path with n=2), one sequence per batch (max_batch_size=1) so batch counts differ.
Each rank's completions must equal what one process samples for that rank's prompts with that rank's seed, and
the ranks with fewer batches must have stepped placeholder batches (else the run hangs or crashes).

With one process it plays both ranks' calls in turn, unsharded."""

import json
import os
import sys

import torch
import torch.distributed as dist

from toolkit.core.distributed import exit_process
from toolkit.core.generation import SamplingParams, TransformersBackend
from toolkit.testing import tiny_model, tiny_tokenizer

# per call: (rank 0's prompts, rank 1's prompts, n)
CALLS = [
    ([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [], 1),   # rank 1 has nothing (its episodes ended)
    ([[20, 21], [22]], [[30, 31, 32]], 1),             # 2 batches against 1
    ([[40, 41]], [[50, 51], [52, 53, 54]], 2),         # the group path: n=2, one prompt per batch
]


def run(model, rank: int) -> tuple[list, list]:
    tok = tiny_tokenizer()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, max_batch_size=1)
    # every 5th id stops, so sequences end at different steps
    params = SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=tuple(range(0, 384, 5)))
    out, placeholders = [], []
    for k, (*per_rank, n) in enumerate(CALLS):
        groups = backend.generate(per_rank[rank], params, n=n, seed=1000 * k + rank)
        out.append([[(c.token_ids, c.logprobs) for c in g] for g in groups])
        placeholders.append(backend.last_stats.extra.get("placeholder_batches", 0))
    return out, placeholders


def main(out_file: str) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = tiny_model().eval()
    if world == 1:
        result = {str(rank): run(model, rank) for rank in (0, 1)}
        with open(out_file, "w") as f:
            json.dump(result, f)
        return
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    mine = run(model, dist.get_rank())
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(out_file, "w") as f:
            json.dump({"0": gathered[0], "1": gathered[1]}, f)


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():
        dist.barrier()  # rank 0 may still be writing
    exit_process(0)  # not the interpreter's teardown, where a rank can abort after finishing (see exit_process)
