"""In-flight weight updates (PipelineRL): new weights between decode steps, partial rollouts continued under
them, each token's version recorded, and the behaviour log-prob of each token being its own version's."""

import pytest
import torch
from test_async_grpo import async_cfg, low_ids, prompts

from toolkit import ConfigError
from toolkit.core.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from toolkit.core.generation import SamplingParams, TransformersBackend
from toolkit.testing import tiny_model, tiny_tokenizer


def _token_logps(model, prompt, completion):
    """log pi(completion_t | prompt, completion_<t) by one plain forward of the whole sequence (temperature 1)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("shared_start", [False, True])
def test_a_completion_continues_under_new_weights_and_each_token_carries_its_versions_logprob(shared_start):
    """Also with prompts that start alike (the backend prefills that start once, then the rest of each prompt
    after it: the rebuilt cache must hold the same layout)."""
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    model = tiny_model(seed=0).eval()
    calls = []

    def refresh():
        calls.append(1)
        if len(calls) == 3:  # after the third sampled token: publish version 7
            model.load_state_dict(new.state_dict())
            return 7
        return None

    forwards = []
    backend = TransformersBackend(model, pad_token_id=2, refresh_weights=refresh, version=6,
                                  on_decode_step=lambda: forwards.append(1))
    head = list(range(30, 50)) if shared_start else []
    prompts_ = [head + [5, 9, 11, 4], head + [7, 8]]
    groups = backend.generate(prompts_, SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=()), n=2,
                              seed=0)
    assert len(forwards) == 9 + (2 if shared_start else 1)  # the shared start is one more prefill forward
    for prompt, group in zip(prompts_, groups):
        for c in group:
            assert c.versions == [6, 6, 6] + [7] * 7  # one rollout, two policy versions, nothing restarted
            want = torch.cat([_token_logps(old, prompt, c.token_ids)[:3], _token_logps(new, prompt, c.token_ids)[3:]])
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=2e-4, rtol=1e-4)
    assert backend.version == 7


@pytest.mark.parametrize("drop_finished", [False, True])
def test_rows_that_finished_before_the_update_and_several_chunks_keep_exact_logprobs(drop_finished):
    """Stop tokens end some rows before the refresh, and a small max_batch_size splits the prompts into chunks:
    the update lands in the first chunk, the second runs on it. Keeping finished rows, the rebuilt cache has
    masked gaps; dropping them (a quarter of a 4-row chunk is one row), it holds the rows left only."""
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    model = tiny_model(seed=0).eval()
    calls, rows_per_forward = [], []
    model.register_forward_pre_hook(lambda m, a, kw: rows_per_forward.append(kw["input_ids"].shape), with_kwargs=True)

    def refresh():
        calls.append(1)
        if len(calls) == 3:
            model.load_state_dict(new.state_dict())
            return 1
        return None

    backend = TransformersBackend(model, pad_token_id=2, refresh_weights=refresh, version=0, max_batch_size=4)
    backend._compact_finished_rows = drop_finished
    prompts_ = [[5, 9, 11, 4], [7, 8], [20, 21, 22], [6]]
    stop = tuple(range(100, 260))  # ~40% of the vocabulary: rows stop at different steps
    groups = backend.generate(prompts_, SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=stop), n=4,
                              seed=3)
    kinds = set()
    for prompt, group in zip(prompts_, groups):
        for c in group:
            assert c.versions == sorted(c.versions) and set(c.versions) <= {0, 1}  # one switch, never back
            kinds.add((0 in c.versions, 1 in c.versions))
            v = torch.tensor(c.versions)
            want = torch.where(v == 0, _token_logps(old, prompt, c.token_ids), _token_logps(new, prompt, c.token_ids))
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=2e-4, rtol=1e-4)
    # rows that ended under the old weights, rows that switched mid-way, rows (later chunks) all on the new ones
    assert kinds == {(True, False), (True, True), (False, True)}
    refill = next(shape for shape in rows_per_forward[1:] if shape[1] > 1)  # the first chunk's rebuilt cache
    assert (refill[0] < 4) == drop_finished


def test_without_refresh_no_versions_are_reported():
    backend = TransformersBackend(tiny_model(), pad_token_id=2)
    (group,) = backend.generate([[5, 6]], SamplingParams(max_tokens=4, temperature=1.0), n=1, seed=0)
    assert group[0].versions is None


class _Recording(AsyncGRPOTrainer):
    """Keeps each rollout and the weights of every version, to check the trained batch afterwards."""

    def generate_rollout(self, row_indices):
        rollout = super().generate_rollout(row_indices)
        self.rollouts.append((self.state.global_step, rollout))
        return rollout


@pytest.mark.slow
def test_async_rounds_mix_versions_and_the_loss_gets_each_tokens_behaviour_logprob(tmp_path):
    from transformers import TrainerCallback

    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            snapshots[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # Long completions, cheap training: a round is still decoding when the next weights are published.
    t = _Recording(tiny_model(), [low_ids],
                   async_cfg(tmp_path, max_steps=4, max_staleness=1, max_completion_length=160, temperature=1.0,
                             inflight_weight_updates=True, loss_type="decoupled_ppo"),
                   train_dataset=prompts(), processing_class=tiny_tokenizer(), callbacks=[Snapshot()])
    snapshots[0] = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    t.rollouts = []
    t.train()
    mixed = [(step, r, i) for step, r in t.rollouts for i, v in enumerate(r.sampler_versions) if len(set(v)) > 1]
    assert mixed, "no round was updated in flight"
    assert max(h.get("async/round_versions", 0) for h in t.state.log_history) >= 2
    step, rollout, row = mixed[0]
    versions = rollout.sampler_versions[row]
    ids, prompt = rollout.completion_ids[row], rollout.prompt_ids[row]
    want = torch.zeros(len(ids))
    for v in set(versions):
        ref = tiny_model()
        ref.load_state_dict(snapshots[v])
        at = torch.tensor([x == v for x in versions])
        want[at] = _token_logps(ref.eval(), prompt, ids)[at]
    torch.testing.assert_close(torch.tensor(rollout.sampler_logps[row]), want, atol=2e-4, rtol=1e-4)
    # what the loss reads as the behaviour log-prob and version of each token is this rollout's, row by row
    batch = t._micro_batch(rollout, [row], {"step_tokens": 1.0, "step_sequences": 1.0, "step_prompts": 1.0})
    torch.testing.assert_close(batch["sampler_logps"][0, :len(ids)], torch.tensor(rollout.sampler_logps[row]))
    assert batch["sampler_versions"][0, :len(ids)].tolist() == versions


def test_inflight_updates_need_the_transformers_backend_and_single_turn_rounds(tmp_path):
    with pytest.raises(ConfigError, match="inflight_weight_updates"):
        AsyncGRPOConfig(output_dir=str(tmp_path), inflight_weight_updates=True, generation_backend="vllm")
    with pytest.raises(ConfigError, match="episodes"):
        AsyncGRPOConfig(output_dir=str(tmp_path), inflight_weight_updates=True, environment="calculator")
    with pytest.raises(ConfigError, match="scoring_concurrency"):
        AsyncGRPOConfig(output_dir=str(tmp_path), scoring_concurrency=0)
