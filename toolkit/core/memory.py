"""Tensor memory: measured (a dispatch-level tally that works on CPU as on a GPU) and estimated (a memory model).

A GPU user's question is "does this step fit my card", and the number that answers it is the peak of live tensor
bytes, which the CUDA caching allocator reports and the CPU does not (peak RSS mixes in the allocator's caching,
the Python heap and libraries). `TensorMemoryTally` counts tensor storages as they are created and freed, through
a `TorchDispatchMode`, so the same number can be measured on the CPU machines the tests run on: every op's
outputs are registered once per storage, and a finalizer on the storage takes its bytes off when the last view
dies. Tensors alive when the tally starts (weights, optimizer state) are found by a scan of live objects.

What it does not see: scratch buffers kernels allocate internally without a tensor (a CPU flash-attention
kernel's workspace, cuBLAS workspaces), and allocator fragmentation. On a GPU,
`torch.cuda.max_memory_allocated()` is the number to compare with; on CPU this tally is the closest thing.

`estimate_step_memory` (below) is the memory model: it runs one training step of the trainer's shapes on fake
tensors (no memory allocated, so a 7B model's step is estimated on a laptop) under the same tally.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import TrainerCallback

__all__ = ["MemoryEstimate", "OffloadActivations", "PeakAllocatorMemory", "PeakTensorMemoryCallback", "TensorMemoryTally",
           "estimate_step_memory"]


class TensorMemoryTally(TorchDispatchMode):
    """Live tensor bytes and their peak while the mode is active, counted per storage (views are free).

        with TensorMemoryTally() as tally:
            loss = model(**batch).loss
            loss.backward()
        print(tally.peak_bytes, tally.start_bytes)

    `count_existing=True` (default) adds the tensors alive at entry (found by a scan of live Python objects, so
    a model's weights and an optimizer's state count), which makes `peak_bytes` the whole footprint of the
    region, comparable with `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`. With False,
    only tensors created inside the region count (`peak_bytes` is then the region's own high-water mark).
    `devices` limits the count to storages on those device types (e.g. {"cpu"}); None counts every device.
    """

    def __init__(self, *, count_existing: bool = True, devices: set[str] | None = None):
        super().__init__()
        self.count_existing = count_existing
        self.devices = devices
        self.current_bytes = 0
        self.peak_bytes = 0
        self.start_bytes = 0
        self._sizes: dict[int, int] = {}  # id(storage object) -> bytes counted for it
        self.peak_op: str | None = None  # the op whose output set the peak (where to look when it is too high)
        self._op: str | None = None
        self.trace_peak = False  # debugging: keep the Python stack at the peak in .peak_stack (slow)
        self.peak_stack: list[str] | None = None

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _register(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) and not _is_fake(t):
            return  # tensor subclasses (DTensor, quantized wrappers) hold their bytes in inner tensors
        if self.devices is not None and t.device.type not in self.devices:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or otherwise storage-less tensors
            return
        nbytes = st.nbytes()
        key = id(st)
        old = self._sizes.get(key)
        if old is None:
            if nbytes == 0:
                return
            self._sizes[key] = nbytes
            # The storage's Python object lives exactly as long as the storage (torch preserves it), so its
            # finalizer runs when the last tensor viewing it is gone.
            weakref.finalize(st, self._free, key)
            self._add(nbytes)
        elif old != nbytes:  # resized in place (`out=` ops, resize_)
            self._sizes[key] = nbytes
            self._add(nbytes - old)

    def _add(self, n: int) -> None:
        self.current_bytes += n
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_op = self._op
            if self.trace_peak:
                import traceback

                self.peak_stack = traceback.format_stack(limit=25)

    def _free(self, key: int) -> None:
        n = self._sizes.pop(key, 0)
        self.current_bytes -= n

    # -- the mode ---------------------------------------------------------------------------------------------
    def __enter__(self):
        if self.count_existing:
            gc.collect()
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self._register(obj)
        self.start_bytes = self.current_bytes
        self.peak_bytes = self.current_bytes
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._register(leaf)
        # in-place ops and `out=` return their (possibly resized) arguments: seen above
        return out

    def stop_counting(self) -> None:
        """Turn the finalizers of counted storages into no-ops (after exit, so late frees cannot change results)."""
        self._sizes.clear()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class PeakAllocatorMemory:
    """The peak of allocated tensor bytes over a region of a real run, from the allocator itself.

        with PeakAllocatorMemory() as meter:
            trainer.training_step(model, batch)
        print(meter.peak_bytes)

    On CUDA it is `torch.cuda.max_memory_allocated()` after a reset. On CPU, torch's allocator keeps a running
    total only while the profiler records memory, so the region runs under `torch.profiler` with
    `profile_memory=True`: the peak of that total, plus the tensors alive at entry (weights, optimizer state;
    found by a scan of live objects). Unlike a dispatch-mode tally it changes nothing in the run (an active
    dispatch mode turns off autograd's in-place gradient accumulation, which adds a gradient-sized temporary
    where a weight is used twice, as a tied embedding is). The region is slower while profiled.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self.start_bytes = 0
        self._profiler = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            return self
        gc.collect()
        seen: set[int] = set()
        total = 0
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                try:
                    st = obj.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                if id(st) not in seen and st.nbytes():
                    seen.add(id(st))
                    total += st.nbytes()
        self.start_bytes = total
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return False
        self._profiler.__exit__(*exc)
        from torch._C._profiler import _EventType

        base, top = None, 0
        stack = list(self._profiler.profiler.kineto_results.experimental_event_tree())
        events = []
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
            stack.extend(node.children)
        events.sort()
        for _, size, total in events:
            if base is None:
                base = total - size  # the running total before the region's first allocation
            top = max(top, total - base)
        self.peak_bytes = self.start_bytes + top
        self._profiler = None
        return False


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear layer saves its weight for backward): it stays on the device anyway."""
    return isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Activation offloading: the tensors a forward saves for backward wait in host memory, not on the device.

        with OffloadActivations():
            loss = model(**batch).loss
        loss.backward()            # each saved tensor comes back to its device when backward reaches it

    What moves: plain strided tensors saved on a device in `devices` (default: any but the CPU, whose memory is
    already the host's) of at least `min_bytes`. What stays: parameters and views of them (they stay on the device
    anyway), tensor subclasses (a DTensor's shard is not its global shape), broadcast views (stride 0: copying
    would materialise them). autocast's bf16 copies of float32 weights are new tensors and do move. A tensor saved
    by several ops (the input q, k and v projections share) is copied once per forward.

    The copies run on the compute stream, without prefetch: they do not overlap with compute, so each step pays
    the transfer (device -> host in forward, host -> device in backward). Host memory: pinned buffers from
    torch's caching host allocator, which rounds each up to a power of two and keeps it for reuse; `moved_bytes`
    counts what moved (the test on CPU passes `devices={"cpu"}` to run the same path)."""

    def __init__(self, *, min_bytes: int = 1 << 20, devices: set[str] | None = None, pin_memory: bool | None = None):
        self.moved_bytes = 0
        self._copies: dict[tuple, tuple[Any, torch.Tensor]] = {}
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory

        def pack(t: torch.Tensor) -> Any:
            if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested:
                return t
            on = t.device.type in devices if devices is not None else t.device.type != "cpu"
            size = t.numel() * t.element_size()
            if not on or size < min_bytes or 0 in t.stride() or _is_weight(t):
                return t
            # the version counter: an in-place op between two saves of one tensor must not hand back the older copy
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
            seen = self._copies.get(key)
            # the same memory holds the same tensor only while the tensor first copied from it is alive (freed
            # memory is reused by later tensors of the forward)
            if seen is not None and seen[0]() is not None:
                return (t.device, seen[1])
            host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=pin and t.device.type != "cpu")
            host.copy_(t, non_blocking=pin)
            self._copies[key] = (weakref.ref(t), host)
            self.moved_bytes += size
            return (t.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True) if device.type != "cpu" else host.clone()

        super().__init__(pack, unpack)

    def __enter__(self) -> OffloadActivations:
        self._copies = {}  # one forward's copies: a storage's memory is reused once it is freed
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._copies = {}  # the packed tuples hold the copies backward needs; the index is the forward's only


class PeakTensorMemoryCallback(TrainerCallback):
    """A transformers TrainerCallback measuring the peak tensor memory of one optimizer step (`PeakAllocatorMemory`).

    The window runs from the end of step `step - 1` to the end of step `step` (after the optimizer's step and
    zero_grad), so it holds the batch's preparation (generation, for the online trainers), forward, backward and
    the optimizer step. Measure step 2 or later: the optimizer's state is created in the first step, so only
    from the second on is the step's peak the steady state. Results in `.peak_bytes` and `.start_bytes`.
    """

    def __init__(self, step: int = 2):
        if step < 2:
            raise ValueError("step: measure step 2 or later (the first creates the optimizer's state)")
        self.step = step
        self.meter: PeakAllocatorMemory | None = None
        self.peak_bytes: int | None = None
        self.start_bytes: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter is not None and state.global_step >= self.step:
            self.meter.__exit__(None, None, None)
            self.peak_bytes, self.start_bytes = self.meter.peak_bytes, self.meter.start_bytes
            self.meter = None
        elif self.meter is None and self.peak_bytes is None and state.global_step == self.step - 1:
            self.meter = PeakAllocatorMemory(args.device if args.device.type == "cuda" else "cpu")
            self.meter.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is not None:  # training ended inside the window: close it, keep no number
            self.meter.__exit__(None, None, None)
            self.meter = None


@dataclass
class MemoryEstimate:
    """The memory model's answer for one training step: bytes by kind, and the peak."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0  # peak of everything else during the step (activations, logits, temporaries)
    kv_cache: int = 0
    peak: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        """The breakdown as a few aligned lines (GiB)."""
        g = 2**30
        rows = [("weights (all models held)", self.weights), ("gradients", self.gradients),
                ("optimizer state", self.optimizer), ("activations and temporaries (training peak)", self.activations),
                ("KV cache (generation)", self.kv_cache), ("peak of the step", self.peak)]
        return "\n".join(f"{name:<46} {n / g:8.2f} GiB" for name, n in rows)


TRAINERS = ("sft", "dpo", "grpo", "ppo")


def _estimate_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention the way a memory-efficient kernel holds it (output and log-sum-exp, no [T, T] scores).

    On fake tensors torch's `scaled_dot_product_attention` picks its math path, which materializes the scores;
    the trainers run flash / memory-efficient kernels (CPU flash, FlashAttention-2, cuDNN), so the estimate calls
    the CPU flash kernel's own op, whose fake implementation allocates what the real kernel returns and saves.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # K/V expanded to the query heads, as transformers' sdpa path does on CPU (an upper bound)
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True,
                                                                     scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def _storages_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if id(st) not in seen:
            seen.add(id(st))
            total += st.nbytes()
    return total


def _attach_lora(model: torch.nn.Module, r: int, target_modules: Any, dtype: torch.dtype) -> None:
    """LoRA as PEFT computes it (base(x) + B(A(x)) * alpha / r, dropout 0), by forward hooks on the target
    Linear layers: PEFT itself cannot wrap a model of fake tensors (its `.to()` swaps tensors the fake mode holds
    weak references to). The base is frozen; the adapters are in `model._estimate_lora`."""
    names = None if target_modules == "all-linear" else set(
        [target_modules] if isinstance(target_modules, str) else target_modules)
    model.requires_grad_(False)
    adapters: list[torch.nn.Parameter] = []
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if names is not None and name.rsplit(".", 1)[-1] not in names:
            continue
        a = torch.nn.Parameter(torch.empty(r, module.in_features, dtype=dtype))
        b = torch.nn.Parameter(torch.empty(module.out_features, r, dtype=dtype))
        adapters += [a, b]

        def hook(mod, inputs, output, a=a, b=b):
            return output + torch.nn.functional.linear(torch.nn.functional.linear(inputs[0], a), b) * 2.0

        module.register_forward_hook(hook)
    model._estimate_lora = adapters


def _load_config(model: Any):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, torch.nn.Module):
        return model.config
    return AutoConfig.from_pretrained(str(model))


def estimate_step_memory(model: Any, trainer: str = "sft", *, batch_size: int = 8, seq_len: int = 1024,
                         prompt_len: int = 128, completion_len: int = 512, num_generations: int = 8,
                         dtype: str = "float32", bf16: bool = True, lora_r: int = 0,
                         lora_target_modules: Any = "all-linear", activation_checkpointing: bool = False,
                         reference_model: bool | None = None, logps_chunk_size: int | None = None,
                         fp32_lm_head: bool = True, fused_optimizer: bool = True,
                         loss_tokens: int | None = None, generation_rows: int | None = None,
                         activation_offloading: bool = False, sequence_parallel_size: int = 1) -> MemoryEstimate:
    """Peak tensor memory of one steady-state training step (optimizer state already built), without allocating.

    A model of the step, not a formula: the model's own code runs forward and backward, then AdamW steps, on fake
    tensors (`FakeTensorMode`: shapes and dtypes only, so a 7B model costs nothing to estimate), under the same
    `TensorMemoryTally` that measures real runs; the trainer's layout decides the shapes:

    - sft: `batch_size` examples of `seq_len` tokens, padding-free (one row of batch_size x seq_len tokens), the
      loss over every token through the chunked LM head, or over `loss_tokens` of them (completion-only loss).
    - dpo: `batch_size` pairs, each one prompt of `prompt_len` tokens shared by a chosen and a rejected completion
      of `completion_len` (our packed layout), a frozen reference copy (`reference_model`, default on; a LoRA run
      uses the base with adapters off instead) run without gradients first.
    - grpo: `batch_size` completions per micro-batch in groups of `num_generations` sharing their prompt (the
      shared-prompt layout: each prompt once); generation's KV cache for `generation_rows` rows (default
      `batch_size`; a round decodes all its completions together, up to generation_batch_size), in the compute
      dtype; `reference_model` (beta > 0) adds a frozen copy. PPO's rollout phase likewise (its decoding runs
      outside autocast: the cache in the weights' dtype).
    - ppo: the policy with its value head (`critic="head"`) trained on `batch_size` rows of prompt + completion,
      a frozen reference copy and a reward model of the same architecture held beside it.

    `dtype` is the weights' (and master weights'/optimizer's) dtype; `bf16=True` runs forward and backward under
    bf16 autocast (mixed precision over float32 weights). `lora_r > 0` trains LoRA adapters on
    `lora_target_modules` of frozen weights. The peak is the larger of the training pass and generation (weights,
    optimizer state, KV cache; gradients are freed by then). Kernels' internal workspaces (cuBLAS, flash) and the
    allocator's fragmentation are not in it: leave a GPU ~10% beyond the estimate.

    `activation_offloading`: the training forward's saved tensors (of 1 MiB or more, weights excepted) wait in host
    memory and come back as backward reaches them (`OffloadActivations`). `sequence_parallel_size` P: one rank of a
    Ulysses group, which holds 1/P of the micro-batch's tokens (its attention runs over every token for 1/P of the
    heads, the same bytes); the all-to-all buffers, one layer's q/k/v and output at a time, are not in it.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from .numerics import DEFAULT_CHUNK_SIZE, chunked_token_logps, chunked_token_logps_and_entropy

    if trainer not in TRAINERS:
        raise ValueError(f"trainer: '{trainer}' is not one of {TRAINERS}")
    if sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size: must be >= 1, got {sequence_parallel_size}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("prompt_len", prompt_len),
                        ("completion_len", completion_len), ("num_generations", num_generations)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if trainer == "grpo" and batch_size % num_generations and num_generations % batch_size:
        raise ValueError(f"batch_size ({batch_size}) and num_generations ({num_generations}): one must divide the "
                         "other (a micro-batch holds whole groups, or a group spans micro-batches)")
    chunk = logps_chunk_size or DEFAULT_CHUNK_SIZE
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    config = _load_config(model)
    if reference_model is None:
        reference_model = trainer in ("dpo", "ppo")
    frozen_copies = int(bool(reference_model) and not (lora_r > 0 and trainer != "ppo"))  # LoRA: base, adapters off
    frozen_copies += int(trainer == "ppo")  # the reward model

    from transformers import AttentionInterface

    AttentionInterface.register("toolkit_estimate", _estimate_attention)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16 and torch_dtype == torch.float32
                else contextlib.nullcontext())
    with FakeTensorMode(allow_non_fake_inputs=True):
        policy = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="toolkit_estimate")
        head = policy.get_output_embeddings()
        value_head = torch.nn.Linear(config.hidden_size, 1, dtype=torch_dtype) if trainer == "ppo" else None
        if lora_r > 0:
            _attach_lora(policy, lora_r, lora_target_modules, torch_dtype)
        if activation_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if lora_r > 0:  # as PEFT does under checkpointing: the embeddings' output requires grad
                policy.enable_input_require_grads()
        policy.train()
        trainable = [p for p in policy.parameters() if p.requires_grad] + getattr(policy, "_estimate_lora", [])
        if value_head is not None:
            trainable += list(value_head.parameters())
        optimizer = torch.optim.AdamW(trainable, lr=1e-6, **({"fused": True} if fused_optimizer else
                                                               {"foreach": True}))
        own = list(policy.parameters()) + list(policy.buffers()) + getattr(policy, "_estimate_lora", [])
        frozen = _storages_bytes(list(policy.parameters()) + list(policy.buffers()))  # the base, no adapters
        weights = _storages_bytes(own) + frozen_copies * frozen
        body = policy.get_decoder() if callable(getattr(policy, "get_decoder", None)) else policy.model
        head_weight = head.weight
        embedding = policy.get_input_embeddings().weight
        tied = head_weight is embedding and head_weight.requires_grad
        if tied:
            # A dispatch mode (FakeTensorMode is one) turns off autograd's in-place sum of a weight's two gradients,
            # which a real run does for a tied embedding: the head gets its own leaf on the same storage, and its
            # gradient is added into the embedding's in place after backward, as the real engine does.
            head_weight = torch.nn.Parameter(embedding.detach())

        # the token layout of one micro-batch: (tokens in the row, positions whose log-probs are taken)
        if trainer == "sft":
            tokens = batch_size * seq_len
            scored = min(loss_tokens, tokens) if loss_tokens is not None else tokens
        elif trainer == "dpo":
            tokens, scored = batch_size * (prompt_len + 2 * completion_len), batch_size * 2 * completion_len
        elif trainer == "grpo":
            prompts = max(batch_size // num_generations, 1)
            tokens, scored = prompts * prompt_len + batch_size * completion_len, batch_size * completion_len
        else:
            tokens, scored = batch_size * (prompt_len + completion_len), batch_size * completion_len
        tokens, scored = -(-tokens // sequence_parallel_size), -(-scored // sequence_parallel_size)  # this rank's
        ids = torch.zeros(1, tokens, dtype=torch.long)
        targets = torch.zeros(scored, dtype=torch.long)

        host_bytes = [0]

        def offload(t: torch.Tensor) -> Any:  # what OffloadActivations moves leaves the device until backward
            size = t.numel() * t.element_size()
            if size < (1 << 20) or 0 in t.stride() or _is_weight(t):
                return t
            host_bytes[0] += size  # (copied once per save: an upper bound on the host memory)
            return (t.shape, t.dtype)

        def reload(packed: Any) -> torch.Tensor:
            return packed if isinstance(packed, torch.Tensor) else torch.empty(packed[0], dtype=packed[1])

        offloading = (torch.autograd.graph.saved_tensors_hooks(offload, reload) if activation_offloading
                      else contextlib.nullcontext())

        def step(tally: TensorMemoryTally) -> int:
            """One micro-batch's forward, backward and optimizer step; returns the pass's peak."""
            tally.peak_bytes = tally.current_bytes
            host_bytes[0] = 0
            if trainer in ("dpo", "ppo") or (trainer == "grpo" and reference_model):
                with torch.no_grad(), autocast:  # the reference's log-probs (and PPO's reward), kept as [N] floats
                    h = body(input_ids=ids).last_hidden_state[0, :scored]
                    ref = chunked_token_logps(h, head_weight, targets, chunk_size=chunk, upcast=fp32_lm_head)
                    del h, ref
            with autocast, offloading:
                h = body(input_ids=ids).last_hidden_state[0, :scored]
                if trainer in ("grpo", "ppo"):  # their passes read the entropy from the same chunks
                    logps = chunked_token_logps_and_entropy(h, head_weight, targets, chunk_size=chunk,
                                                            upcast=fp32_lm_head, keep_for_backward=True)[0]
                else:
                    logps = chunked_token_logps(h, head_weight, targets, chunk_size=chunk, upcast=fp32_lm_head)
                loss = logps.float().mean()
                if value_head is not None:
                    loss = loss + value_head(h).float().pow(2).mean()
                del h
            loss.backward()
            if tied:
                with torch.no_grad():
                    embedding.grad.add_(head_weight.grad)
                head_weight.grad = None
            peak = tally.peak_bytes
            if fused_optimizer:
                # the fused AdamW updates in place with no temporaries: its step's peak is the state (already
                # counted) plus the gradients, reached above; it is not run (half the estimate's time)
                optimizer.zero_grad(set_to_none=True)
                return peak
            optimizer.step()  # foreach AdamW: its temporaries are part of the peak
            optimizer.zero_grad(set_to_none=True)
            return max(peak, tally.peak_bytes)

        # Adam's state: exp_avg and exp_avg_sq like each trainable parameter, and a float32 step count per parameter
        # (the fused and foreach kernels both keep it as a tensor)
        optimizer_bytes = 2 * _storages_bytes(trainable) + 4 * len(trainable)
        tally = TensorMemoryTally(count_existing=False)
        with tally:
            for p in own:
                tally._register(p)
            tally.current_bytes += weights - _storages_bytes(own)  # the frozen copies, never touched here
            if fused_optimizer:
                tally.current_bytes += optimizer_bytes  # the steady state's, without running a first step
            else:
                step(tally)  # builds the optimizer's state (and its real size)
                optimizer_bytes = sum(_storages_bytes(list(s.values())) for s in optimizer.state.values()
                                      if isinstance(s, dict))
            resident = tally.current_bytes
            peak = step(tally)
        grads = _storages_bytes(trainable)  # a gradient per trainable parameter, same dtype
        tally.stop_counting()

    kv = 0
    if trainer in ("grpo", "ppo"):
        layers = config.num_hidden_layers
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if trainer == "ppo":  # PPO decodes outside autocast: the weights' own dtype
            cache_bytes = torch.finfo(torch_dtype).bits // 8
        else:
            cache_bytes = 2 if (bf16 or torch_dtype != torch.float32) else 4
        rows = generation_rows or batch_size
        kv = 2 * layers * kv_heads * head_dim * rows * (prompt_len + completion_len) * cache_bytes
        # decoding: weights, optimizer state, the cache and one step's [rows, V] float32 logits (no gradients)
        generation_peak = resident + kv + rows * config.vocab_size * 4 * 2
        peak = max(peak, generation_peak)
    return MemoryEstimate(weights=weights, gradients=grads, optimizer=optimizer_bytes,
                          activations=max(peak - resident - grads, 0), kv_cache=kv, peak=peak,
                          details={"trainer": trainer, "tokens_per_micro_batch": tokens, "scored_tokens": scored,
                                   "dtype": dtype, "bf16": bf16, "lora_r": lora_r,
                                   "activation_checkpointing": activation_checkpointing,
                                   "activation_offloading": activation_offloading,
                                   "offloaded_bytes": host_bytes[0],
                                   "sequence_parallel_size": sequence_parallel_size,
                                   "frozen_copies": frozen_copies})
