"""Run by tests/integration/test_sequence_parallel.py under torchrun (gloo, one thread per process).

Each rank builds the same tiny model twice: a reference that runs the whole batch in this process, and one whose
packed rows are split over a sequence-parallel group (`sequence_parallel_size` consecutive ranks). Both compute
the trainers' losses on the same batches (SFT: packed rows; DPO: chosen and rejected sharing the prompt; GRPO:
the shared-prompt layout, several completions per prompt), backpropagate, and average gradients over the world as
DDP/FSDP do; the script writes, from rank 0, the largest differences in loss and gradients. With FSDP2 the
sequence-parallel model is sharded over the whole world.

Usage: sequence_parallel_worker.py OUT.json SP_SIZE CASES [fsdp2]
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from toolkit.core.attention import use_varlen_attention
from toolkit.core.numerics import aggregate, clipped_surrogate, preference_loss, tokens_to_rows
from toolkit.core.packing import completion_logps, pack_completions, pack_shared_prompts, sequence_sums
from toolkit.core.sequence_parallel import enable, sequence_parallel_group, sequence_parallel_loss
from toolkit.testing import tiny_model


def batches(case: str, dp_size: int):
    """One packed batch per data-parallel replica: odd total lengths, so the row is padded to a multiple of P."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(dp_size):
        def seq(n):
            return torch.randint(3, 380, (n,), generator=g).tolist()
        if case == "sft":
            prompts = [seq(int(n)) for n in torch.randint(3, 9, (3,), generator=g)]
            completions = [seq(int(n)) for n in torch.randint(5, 30, (3,), generator=g)]
            if sum(map(len, prompts + completions)) % 2 == 0:  # an odd row: P=2 pads it
                completions[-1].append(5)
            out.append(pack_completions(prompts, completions, pad_token_id=2))
        elif case == "dpo":
            prompts = [seq(int(n)) for n in torch.randint(4, 12, (2,), generator=g)]
            rows = [p for p in prompts for _ in range(2)]  # chosen, rejected per prompt
            completions = [seq(int(n)) for n in torch.randint(3, 20, (4,), generator=g)]
            out.append(pack_shared_prompts(rows, completions, [[0, 1], [2, 3]]))
        else:  # grpo: 2 prompts x 4 completions, a common start laid out once
            head = seq(6)
            prompts = [head + seq(int(n)) for n in torch.randint(2, 8, (2,), generator=g)]
            rows = [p for p in prompts for _ in range(4)]
            completions = [seq(int(n)) for n in torch.randint(1, 25, (8,), generator=g)]
            if (len(head) + sum(len(p) - len(head) for p in prompts) + sum(map(len, completions))) % 2 == 0:
                completions[-1].append(5)  # an odd row: P=2 pads it
            b = pack_shared_prompts(rows, completions, [[0, 1, 2, 3], [4, 5, 6, 7]], common_prefix=True)
            b["advantages"] = torch.randn(8, generator=g)
            b["old_logps"] = -torch.rand(int(b["completion_lengths"].sum()), generator=g) * 5
            out.append(b)
    return out


def loss_of(case: str, model, batch) -> torch.Tensor:
    logps = completion_logps(model, batch)
    if case == "sft":  # the mean over the batch's completion tokens
        return -logps.sum() / logps.numel()
    if case == "dpo":
        seqs = sequence_sums(logps, batch["completion_lengths"])
        ref = torch.linspace(-40, -10, 4)
        return preference_loss("sigmoid", seqs[0::2] - ref[0::2], seqs[1::2] - ref[1::2], beta=0.1).mean()
    lengths = batch["completion_lengths"]
    mask = torch.arange(int(lengths.max()))[None] < lengths[:, None]
    rows = tokens_to_rows(logps, mask)
    per_token, _ = clipped_surrogate(rows, tokens_to_rows(batch["old_logps"], mask),
                                     batch["advantages"][:, None].expand_as(rows), epsilon_low=0.2, epsilon_high=0.28)
    return aggregate(per_token, mask, "token")


def grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[name] = g.detach().clone()
    return out


def peak_memory(model, batch) -> int:
    """Peak bytes of the tensors created by one SFT forward + backward of `batch` (the CPU tensor tally)."""
    from toolkit.core.memory import TensorMemoryTally

    with TensorMemoryTally(count_existing=False) as tally:
        loss = loss_of("sft", model, batch)
        loss.backward()
        del loss
    return tally.peak_bytes


def memory(sp, length: int) -> dict:
    """One SFT row of `length` tokens: the peak tensor memory of a forward + backward on one rank with the whole row
    against a rank of the sequence-parallel group. Width 256, 4 layers, 8 heads: activations dominate."""
    g = torch.Generator().manual_seed(1)
    batch = pack_completions([torch.randint(3, 380, (16,), generator=g).tolist()],
                             [torch.randint(3, 380, (length - 16,), generator=g).tolist()], pad_token_id=2)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=length,
                         attn_implementation="sdpa")
    whole, split = LlamaForCausalLM(config), LlamaForCausalLM(config)
    for m in (whole, split):
        use_varlen_attention(m)
    enable(split, sp)
    peaks = torch.tensor([peak_memory(whole, batch), peak_memory(split, batch)], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the rank that needed the most
    return {"whole": int(peaks[0]), "split": int(peaks[1]), "tokens": length}


def main(path: str, sp_size: int, cases: list[str], fsdp2: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    sp = sequence_parallel_group(sp_size)
    result = {"world": world, "sp_size": sp.size, "dp_size": sp.dp_size}
    if cases and cases[0].startswith("memory"):  # memory-<tokens>
        result["memory"] = memory(sp, int(cases.pop(0).split("-")[1]))
    for case in cases:
        reference, split = tiny_model(seed=3), tiny_model(seed=3)
        use_varlen_attention(reference)
        use_varlen_attention(split)
        enable(split, sp)
        if fsdp2:
            from torch.distributed.fsdp import fully_shard

            for layer in split.model.layers:
                fully_shard(layer)
            fully_shard(split)
        data = batches(case, sp.dp_size)
        # the reference: every replica's batch in this process, the mean of their losses (what DDP optimises)
        ref_losses = [loss_of(case, reference, b) for b in data]
        (sum(ref_losses) / len(data)).backward()
        # sequence parallel: this group's batch, split over its ranks; gradients averaged over the world
        loss = loss_of(case, split, data[sp.dp_rank])
        sequence_parallel_loss(loss, sp).backward()
        if not fsdp2:  # what DDP does (FSDP2 reduce-scatters the average itself)
            for p in split.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        g_ref, g_sp = grads(reference), grads(split)
        result[case] = {
            "loss_diff": abs(loss.item() - ref_losses[sp.dp_rank].item()),
            "loss": loss.item(),
            "grad_diff": max((g_ref[k] - g_sp[k]).abs().max().item() for k in g_ref),
            "grad_scale": max(g.abs().max().item() for g in g_ref.values()),
            "row_tokens": int(data[sp.dp_rank]["input_ids"].shape[1]),
        }
        diffs = [torch.tensor(result[case]["loss_diff"])]
        dist.all_reduce(diffs[0], op=dist.ReduceOp.MAX)  # the worst rank's loss difference
        result[case]["loss_diff"] = diffs[0].item()
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), len(sys.argv) > 4 and sys.argv[4] == "fsdp2")
    os._exit(0)
