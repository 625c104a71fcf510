"""Sequence parallelism's single-process parts: batch sharing, row sharding, the loss scaling, refusals.
The split forwards themselves run in tests/integration/test_sequence_parallel.py (real torchrun ranks)."""

import pytest
import torch

from toolkit import ConfigError, DPOConfig, SFTConfig, SFTTrainer
from toolkit.core.packing import completion_hidden, pack_completions
from toolkit.core.sequence_parallel import RepeatBatches, SequenceParallel, enable, sequence_parallel_loss, shard_row
from toolkit.testing import tiny_model, tiny_tokenizer


def _sp(rank=0, size=2):
    return SequenceParallel(group=None, size=size, rank=rank, dp_rank=0, dp_size=1)


def _batches(sampler, batch_size, world):
    stream = list(sampler)
    batches = [stream[i:i + batch_size] for i in range(0, len(stream), batch_size)]
    return [batches[r::world] for r in range(world)]  # accelerate: batch i to rank i mod world


def test_ranks_of_a_group_get_the_same_batches_and_groups_get_one_process_order():
    # 2 replicas x 2 sequence-parallel ranks, batches of 3 from 12 indices
    per_rank = _batches(RepeatBatches(list(range(12)), 3, 2), 3, world=4)
    assert per_rank[0] == per_rank[1] == [[0, 1, 2], [6, 7, 8]]
    assert per_rank[2] == per_rank[3] == [[3, 4, 5], [9, 10, 11]]
    assert len(RepeatBatches(list(range(12)), 3, 2)) == 24


def test_a_short_last_batch_is_completed_from_the_epoch_start_or_dropped():
    stream = list(RepeatBatches(list(range(7)), 3, 2))
    assert stream[-6:] == [6, 0, 1, 6, 0, 1]  # never straddles two ranks' turns
    assert len(stream) == len(RepeatBatches(list(range(7)), 3, 2)) == 18
    dropped = RepeatBatches(list(range(7)), 3, 2, drop_last=True)
    assert list(dropped) == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5] and len(dropped) == 12


def test_the_row_is_padded_to_a_multiple_of_the_group_and_split_in_order():
    batch = pack_completions([[5, 6]], [[7, 8, 9]], pad_token_id=2)  # 5 tokens
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    first, a0, b0 = shard_row(kwargs, _sp(0))
    second, a1, b1 = shard_row(kwargs, _sp(1))
    assert (a0, b0, a1, b1) == (0, 3, 3, 6)
    assert first["input_ids"].tolist() == [[5, 6, 7]] and second["input_ids"].tolist() == [[8, 9, 0]]
    assert second["position_ids"].tolist() == [[3, 4, 0]]
    assert first["toolkit_sp"].length == 5 and first["toolkit_sp"].position_ids.shape == (1, 6)
    with pytest.raises(ValueError, match="padded batch cannot be split"):
        shard_row({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}, _sp())


def test_the_loss_keeps_its_value_and_scales_its_gradient_by_the_group_size():
    x = torch.tensor(3.0, requires_grad=True)
    loss = sequence_parallel_loss(x * 2, _sp(size=4))
    loss.backward()
    assert loss.item() == 6.0 and x.grad.item() == 8.0
    assert sequence_parallel_loss(x * 2, None).item() == 6.0


def test_enable_refuses_attention_it_cannot_split_and_heads_it_cannot_share():
    model = tiny_model()  # sdpa: not switched to toolkit_varlen
    with pytest.raises(ValueError, match="toolkit_varlen"):
        enable(model, _sp())
    model.set_attn_implementation("toolkit_varlen")
    with pytest.raises(ValueError, match="divide the model's 4 attention heads"):
        enable(model, _sp(size=3))
    enable(model, _sp())
    batch = pack_completions([[5, 6]], [[7, 8]], pad_token_id=2)
    with pytest.raises(ValueError, match="sequence-parallel group"):
        completion_hidden(model, batch)  # each rank holds a share of the hidden states: no whole [N, H] here


def test_settings_are_checked_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="sequence_parallel_size: must be >= 1"):
        SFTConfig(output_dir=str(tmp_path), sequence_parallel_size=0)
    with pytest.raises(ConfigError, match="sequence_parallel_size: must be >= 1"):
        DPOConfig(output_dir=str(tmp_path), sequence_parallel_size=0)


def test_one_process_cannot_hold_a_group_of_two(tmp_path):
    rows = [{"prompt": "a b", "completion": " c d"}] * 4
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=2: must divide the number of processes \(1\)"):
        SFTTrainer(tiny_model(), SFTConfig(output_dir=str(tmp_path / "o"), sequence_parallel_size=2, report_to="none"),
                   train_dataset=rows, processing_class=tiny_tokenizer())
    assert not (tmp_path / "o").exists()


def test_padded_batches_are_refused_by_name(tmp_path):
    rows = [{"prompt": "a b", "completion": " c d"}] * 4
    with pytest.raises(ConfigError, match="splits packed rows, and this model's batches are padded"):
        SFTTrainer(tiny_model(), SFTConfig(output_dir=str(tmp_path / "o"), sequence_parallel_size=2,
                                           padding_free=False, report_to="none"),
                   train_dataset=rows, processing_class=tiny_tokenizer())


def test_streams_overriding_subclasses_and_unshared_sampling_are_refused_by_name(tmp_path):
    from datasets import IterableDataset

    rows = [{"prompt": "a b", "completion": " c d"}] * 4
    cfg = dict(output_dir=str(tmp_path / "o"), sequence_parallel_size=2, report_to="none")
    stream = IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ConfigError, match="train_dataset is streamed"):
        SFTTrainer(tiny_model(), SFTConfig(**cfg, max_steps=2), train_dataset=stream, processing_class=tiny_tokenizer())

    class OwnForward(SFTTrainer):
        def compute_token_logps(self, model, inputs):
            return super().compute_token_logps(model, inputs)

    with pytest.raises(ConfigError, match="OwnForward overrides compute_token_logps"):
        OwnForward(tiny_model(), SFTConfig(**cfg), train_dataset=rows, processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="must draw the same batches"):
        SFTTrainer(tiny_model(), SFTConfig(**cfg, train_sampling_strategy="group_by_length"), train_dataset=rows,
                   processing_class=tiny_tokenizer())
    from toolkit.experimental.kto import KTOConfig, KTOTrainer

    pairs = [{"prompt": "a b", "completion": " c", "label": True}, {"prompt": "a b", "completion": " d", "label": False}]
    with pytest.raises(ConfigError, match="KTOTrainer overrides compute_loss"):  # its own loss: unscaled gradients
        KTOTrainer(tiny_model(), args=KTOConfig(**cfg), train_dataset=pairs * 2, processing_class=tiny_tokenizer())
    assert not (tmp_path / "o").exists()


def test_evaluation_batches_are_repeated_whole_and_a_short_last_one_stays_short():
    from toolkit.core.sequence_parallel import RepeatedBatchSampler

    batches = RepeatedBatchSampler(list(range(7)), 3, 2)
    assert list(batches) == [[0, 1, 2]] * 2 + [[3, 4, 5]] * 2 + [[6]] * 2 and len(batches) == 6
    assert not hasattr(batches, "batch_size")  # accelerate would hold a short batch back from some ranks


def test_held_out_batches_come_in_a_multiple_of_the_replicas_without_repeating_a_row():
    from toolkit.core.sequence_parallel import RepeatedBatchSampler

    uneven = RepeatedBatchSampler(list(range(5)), 2, 2, replicas=2)  # 3 batches of 2 would leave one replica short
    assert list(uneven) == [[0, 1]] * 2 + [[2]] * 2 + [[3]] * 2 + [[4]] * 2
    per_rank = _batches(uneven, 1, world=4)  # (each yielded item is a batch: accelerate's turn per rank)
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    seen = [i for turns in (per_rank[0], per_rank[2]) for batch in turns for i in batch[0]]
    assert sorted(seen) == list(range(5))  # every row once over the replicas
    assert RepeatedBatchSampler(list(range(8)), 2, 1, replicas=2).sizes == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="3 held-out rows"):
        RepeatedBatchSampler(list(range(3)), 2, 2, replicas=4)
