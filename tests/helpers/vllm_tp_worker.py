"""Run under torchrun (2 ranks, gloo) by tests/integration/test_vllm_tensor_parallel.py: a colocated VLLMBackend with
tensor_parallel_size 2 over a `vllm` module whose LLM records what it is given (no GPU here: the real external
launcher is not run). Each rank asks for its own prompts; the file it writes says what the engine saw and what the
rank got back."""

import json
import sys
import types

import torch.distributed as dist

from toolkit.core import vllm_backend
from toolkit.core.generation import SamplingParams


class RecordingLLM:
    """vllm.LLM as far as VLLMBackend's generate uses it; a completion's ids are its prompt's first two ids, so
    the share a rank gets back shows whose prompts they were."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.seen: list = []

    def generate(self, prompts, sampling, use_tqdm=False, lora_request=None):
        self.seen.append({"prompts": [list(p) for p in prompts], "n": [s.n for s in sampling],
                          "temperature": [s.temperature for s in sampling], "seed": [s.seed for s in sampling]})
        out = []
        for p, s in zip(prompts, sampling):
            c = types.SimpleNamespace(token_ids=list(p)[:2], finish_reason="length",
                                      logprobs=[{t: types.SimpleNamespace(logprob=-0.5)} for t in list(p)[:2]])
            out.append(types.SimpleNamespace(outputs=[c] * s.n))
        return out


def install_fake_vllm():
    module = types.ModuleType("vllm")
    module.LLM = RecordingLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    sys.modules["vllm"], sys.modules["vllm.inputs"] = module, inputs
    vllm_backend.vllm_build = lambda: None
    vllm_backend._engine_on_gpu = lambda: True  # the GPU path: external_launcher and the tensor-parallel group


def main(model_path: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    install_fake_vllm()
    # each rank computed its own memory share (from its own free memory); the engine gets the group's smallest
    backend = vllm_backend.VLLMBackend(model_path, tensor_parallel_size=2, sleep_mode=False,
                                       gpu_memory_utilization=0.3 if rank == 0 else 0.5)
    record = {"kwargs": {k: backend.llm.kwargs.get(k) for k in ("distributed_executor_backend",
                                                                 "tensor_parallel_size", "gpu_memory_utilization")},
              "lockstep": backend.decodes_in_lockstep}
    # rank 0 asks for two prompts at temperature 0.5, n=2; rank 1 for one at 0.9, n=2; then rank 1 for none
    mine = [[10, 11, 12], [20, 21, 22]] if rank == 0 else [[30, 31, 32]]
    params = SamplingParams(max_tokens=2, temperature=0.5 if rank == 0 else 0.9)
    got = backend.generate(mine, params, n=2, seed=100 * (rank + 1))
    record["first"] = [[c.token_ids for c in g] for g in got]
    got = backend.submit([[40, 41]] if rank == 0 else [], params, n=2).result()  # runs now, on this thread
    record["second"] = [[c.token_ids for c in g] for g in got]
    record["seen"] = backend.llm.seen
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
