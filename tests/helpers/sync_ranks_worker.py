"""Run by tests/integration/test_weight_upload.py under torchrun (2 ranks, gloo): weight syncs of one LoRA model to one server,
rank 0 uploading. argv: server url, output folder (each rank writes rank<r>.json)."""

import json
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

from toolkit.core.distributed import exit_process
from toolkit.core.errors import ToolkitError
from toolkit.core.vllm_backend import VLLMServerBackend, changing_groups, engine_weights
from toolkit.testing import tiny_model


def main(url: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    client = VLLMServerBackend(url)
    client.sync_weights(model)  # all
    client.sync_weights(model)  # the blocks holding adapters
    if rank == 0:
        # another client uploads after rank 0's check (made to pass): rank 0's partial upload is refused
        client._engine_unchanged = lambda: True
        VLLMServerBackend(url).load_weights([("x", torch.zeros(1))])
    client.sync_weights(model)  # refused on rank 0: every rank gathers all weights, rank 0 uploads them
    failing = VLLMServerBackend(url)
    if rank == 0:
        failing.token = "wrong"  # its upload is refused (401)
    try:
        failing.sync_weights(model)
        error = ""
    except ToolkitError as e:
        error = str(e)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"version": client.weights_version, "error": error, "names": len(engine_weights(model)),
                   "partial_names": len(engine_weights(model, only=changing_groups(model)))}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    if dist.is_initialized():
        dist.barrier()
    exit_process(0)  # not the interpreter's teardown, where a rank can abort after finishing (see exit_process)
