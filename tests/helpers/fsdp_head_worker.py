"""Run by tests/integration/test_multiprocess.py, alone or under torchrun: two SGD steps of the chunked-head loss on a model
sharded by hand with FSDP2 so that every unit, the root (which holds the tied embedding/LM head) included,
reshards after its forward. The LM head weight is then a DTensor shard when the loss reads it;
`models.output_head` must hand back the whole weight, with gradients that match one process."""

import os
import sys

import torch
import torch.distributed as dist

from toolkit.core.distributed import exit_process
from toolkit.core.models import output_head
from toolkit.core.numerics import chunked_token_logps
from toolkit.testing import tiny_model


def main(out: str) -> None:
    torch.set_num_threads(1)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    model = tiny_model()
    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    head_type = "Parameter"
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
    mine = ids[rank * 4 // world:(rank + 1) * 4 // world]
    for _ in range(2):
        hidden = model(input_ids=mine, output_hidden_states=True, logits_to_keep=1, use_cache=False).hidden_states[-1]
        head_type = type(model.get_output_embeddings().weight).__name__  # what a direct read would get
        weight, bias = output_head(model)
        logps = chunked_token_logps(hidden[:, :-1].reshape(-1, hidden.shape[-1]), weight, mine[:, 1:].reshape(-1),
                                    bias=bias)
        # the mean over the whole batch's tokens; FSDP averages gradients over ranks, hence x world
        (-logps.sum() / ids[:, 1:].numel() * world).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    # what a vLLM backend is sent: whole tensors on every rank (a collective), never this rank's shards
    from toolkit.core.vllm_backend import changing_groups, engine_weights

    sent = {k: v.clone() for k, v in engine_weights(model)}
    # a later sync sends what can change: with the embedding (and its tied head), block 0 and the final norm
    # frozen, block 1 only; every rank selects the same names (each gathers what it sends: a collective)
    for module in (model.model.embed_tokens, model.model.layers[0], model.model.norm):
        module.requires_grad_(False)
    partial = sorted(k for k, _ in engine_weights(model, only=changing_groups(model)))
    if rank == 0:
        torch.save({"params": params, "head_type_after_forward": head_type, "engine_weights": sent,
                    "partial_names": partial}, out)


if __name__ == "__main__":
    main(sys.argv[1])
    if dist.is_initialized():
        dist.barrier()  # rank 0 may still be saving
    exit_process(0)  # not the interpreter's teardown, where a rank can abort after finishing (see exit_process)
