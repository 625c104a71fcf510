"""GRPO on multi-turn episodes (GRPOConfig.environment): token-exact rows, environment ids out of the loss, errors."""

import logging
import random
import time

import pytest
import torch

from toolkit import ConfigError, ToolkitError
from toolkit.core.environments import EnvResponse
from toolkit.core.generation import TransformersBackend
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer


def rows(n=8):
    return [{"prompt": [{"role": "user", "content": f"Task {i}"}], "answer": str(i)} for i in range(n)]


class Chatty:
    """Answers every turn with a tool message of random text (whitespace and unicode included) for 3 turns; the
    episode's reward is the number of characters the model wrote, mod 7 (varied within a group)."""

    def __init__(self, fail_on: str | None = None):
        self.rng, self.turn, self.written, self.fail_on = random.Random(0), 0, 0, fail_on

    def reset(self, row):
        self.turn, self.written, self.row = 0, 0, row
        return list(row["prompt"])

    def step(self, text):
        if self.fail_on is not None and self.row["answer"] == self.fail_on:
            raise RuntimeError("the environment broke")
        self.turn += 1
        self.written += len(text)
        if self.turn == 3:
            return EnvResponse(reward=float(self.written % 7), done=True)
        noise = "".join(self.rng.choice(["a", " ", "\n", "é", "🙂", "  x"]) for _ in range(self.rng.randint(1, 6)))
        return EnvResponse(messages=[{"role": "tool", "content": noise}], info={"tool_calls": 1, "tool_errors": 0})


class Recording(TransformersBackend):
    """Remembers every (context, sampled ids) it produced."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[list[int], list[int]]] = []

    def generate(self, prompts, params, *, n=1, seed=None):
        groups = super().generate(prompts, params, n=n, seed=seed)
        for p, g in zip(prompts, groups):
            self.seen += [(list(p), list(c.token_ids)) for c in g]
        return groups


def config(tmp_path, **kw):
    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # a random tiny model rarely samples <|im_end|>: every id >= 200 also ends a turn, so episodes have several
    base = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=6, learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=0,
                disable_tqdm=True, report_to="none", max_turns=4, max_episode_tokens=200,
                stop_token_ids=[end] + list(range(200, 384)))
    base.update(kw)
    return GRPOConfig(**base)


def trainer(tmp_path, environment=Chatty, backend=True, **kw):
    tok = tiny_tokenizer()
    model = tiny_model()
    gen = Recording(model, pad_token_id=tok.pad_token_id) if backend else None
    return GRPOTrainer(model, [], config(tmp_path, **kw), train_dataset=rows(), processing_class=tok,
                       environment=environment, generation_backend=gen)


def test_episode_rows_are_the_sampled_ids_and_only_they_are_trained(tmp_path):
    t = trainer(tmp_path)
    t.train()
    r = t._rollout
    assert r.token_masks is not None and len(r.token_masks) == 8
    full = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
    # every turn the backend sampled sits in a row right after the context it was sampled from
    assert len(t.generation_backend.seen) > 8  # several turns
    for context, ids in t.generation_backend.seen:
        hits = [k for k, f in enumerate(full) if f[:len(context) + len(ids)] == context + ids]
        assert hits, "a sampled turn is not in any trained row"
        k = hits[0]
        start = len(context) - len(r.prompt_ids[k])
        assert r.token_masks[k][start:start + len(ids)] == [1] * len(ids)
    # mask 1 exactly on sampled ids: the sampled ids counted by the mask equal the ids the backend returned
    sampled_total = sum(len(ids) for _, ids in t.generation_backend.seen)
    assert sum(sum(m) for m in r.token_masks) == sampled_total
    assert any(0 in m for m in r.token_masks)  # tool messages are in the rows, masked
    logs = {k: v for h in t.state.log_history for k, v in h.items()}
    assert logs["episodes/turns_mean"] > 1 and "episodes/tool_calls_mean" in logs and "entropy" in logs


@pytest.mark.parametrize("settings", [
    {}, {"importance_sampling_level": "sequence"}, {"importance_sampling_mode": "mask", "importance_sampling_min": 0.5},
    {"off_policy_mask_threshold": 0.0}, {"loss_type": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4},
    {"beta": 0.1}, {"num_iterations": 2}, {"loss_type": "dr_grpo"}])
def test_environment_ids_do_not_reach_the_loss(tmp_path, settings):
    t = trainer(tmp_path, max_steps=1, **settings)
    t.train()
    rollout = t._rollout
    rollout.included[:] = True  # every row in the loss, whatever its group's rewards
    rollout.advantages = torch.linspace(-1, 1, len(rollout.advantages))
    batch = t._split(rollout)[0]
    env = batch["completion_mask"] & ~batch["sampled_mask"]
    assert bool(env.any()) and not bool((batch["loss_mask"] & env).any())

    def loss_and_grads(b):
        t.model.zero_grad()
        loss = t.compute_loss(t.model, b)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in t.model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(batch)
    # every per-token input a loss may read at the environment positions (the sampler's placeholder log-probs,
    # pi_old's, the reference's): changing them must change neither the loss nor any gradient
    poked = dict(batch)
    for key in ("sampler_logps", "old_logps", "ref_logps"):
        if key in poked:
            poked[key] = poked[key].masked_fill(env, -7.0)
    loss2, grads2 = loss_and_grads(poked)
    assert torch.equal(loss, loss2)
    assert len(grads) == len(grads2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    # the control: the same change at sampled positions does change the loss, so the check above can fail
    sampled = batch["loss_mask"]
    moved = {k: (v.masked_fill(sampled, -7.0) if k in ("sampler_logps", "old_logps", "ref_logps") else v)
             for k, v in batch.items()}
    assert not torch.equal(loss_and_grads(moved)[0], loss)
    # the step's token count is the sampled tokens only
    count = sum(sum(m) for m, inc in zip(rollout.token_masks, rollout.included) if inc)
    assert float(batch["step_tokens"]) == pytest.approx(count)


def test_dr_grpo_normalises_by_the_episode_budget(tmp_path):
    t = trainer(tmp_path, loss_type="dr_grpo", max_turns=3, max_completion_length=6)
    assert t._aggregation_constant(t.args) == 18 and t.resolved_objective().objective_settings.aggregation_constant == 18


class Salted(Chatty):
    """A different start for every episode (a counter in the opening message): a group's prompts differ."""

    count = 0

    def reset(self, row):
        Salted.count += 1
        messages = super().reset(row)
        return [{"role": "user", "content": messages[0]["content"] + f" #{Salted.count}"}]


def test_episodes_whose_starts_differ_keep_their_own_prompts(tmp_path):
    t = trainer(tmp_path, environment=Salted)
    t.train()
    r = t._rollout
    assert len({tuple(p) for p in r.prompt_ids}) == len(r.prompt_ids)  # every row its own start
    full = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
    for context, ids in t.generation_backend.seen:
        assert any(f[:len(context) + len(ids)] == context + ids for f in full)


def test_unfinished_episodes_count_as_failed_or_are_left_out(tmp_path):
    class Endless(Chatty):
        def step(self, text):
            return EnvResponse(messages=[{"role": "tool", "content": "go on"}])  # never a reward, never done

    t = trainer(tmp_path, environment=Endless, max_turns=2)
    t.train()
    assert t._rollout.rewards.tolist() == [0.0] * 8 and not bool(t._rollout.included.any())  # tied at 0
    t = trainer(tmp_path / "b", environment=Endless, max_turns=2, unfinished_episode_reward=None)
    t.train()
    assert torch.isnan(t._rollout.rewards).all()


def test_a_broken_environment_costs_its_episodes_not_the_run(tmp_path, caplog):
    class Broken(Chatty):
        made = 0

        def __init__(self):
            super().__init__()
            Broken.made += 1
            self.breaks = Broken.made % 2 == 0  # every second episode

        def step(self, text):
            if self.turn == 0:  # a first turn rewarded 0.0, so the episode has a reward before it breaks
                self.turn += 1
                return EnvResponse(messages=[{"role": "tool", "content": "ok"}], reward=0.0)
            if self.breaks:
                raise RuntimeError("the environment broke")
            return super().step(text)

    with caplog.at_level(logging.WARNING):
        t = trainer(tmp_path, environment=Broken, max_steps=2)
        t.train()
    errors = [h["episodes/env_errors"] for h in t.state.log_history if "episodes/env_errors" in h]
    assert len(errors) == 2 and sum(errors) > 0
    assert "the environment broke" in caplog.text
    r = t._rollout
    broken = torch.isnan(r.rewards)
    # the broken episodes (which had given no reward yet) are out of the loss, whatever their earlier turns
    assert bool(broken.any()) and not bool(r.included[broken].any())


def test_bad_environment_settings_fail_before_training(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ConfigError, match="reward_funcs: with an environment"):
        GRPOTrainer(tiny_model(), ["numeric_match"], config(tmp_path), train_dataset=rows(), processing_class=tok,
                    environment=Chatty)
    with pytest.raises(ConfigError, match="environment: 'nope' is not a registered environment"):
        config(tmp_path, environment="nope")
    with pytest.raises(ConfigError, match="environment_kwargs: set without environment"):
        config(tmp_path, environment_kwargs={"max_tool_turns": 1})
    with pytest.raises(ConfigError, match="environment_kwargs: .*unexpected keyword"):
        GRPOTrainer(tiny_model(), [], config(tmp_path, environment="calculator", environment_kwargs={"colour": 1}),
                    train_dataset=rows(), processing_class=tok)
    with pytest.raises(ConfigError, match="max_turns"):
        config(tmp_path, environment="calculator", max_turns=0)
    with pytest.raises(ConfigError, match="max_episode_tokens"):  # an environment= factory is checked the same
        GRPOTrainer(tiny_model(), [], config(tmp_path, max_episode_tokens=0), train_dataset=rows(),
                    processing_class=tok, environment=Chatty)
    with pytest.raises(ConfigError, match="no reset"):
        GRPOTrainer(tiny_model(), [], config(tmp_path), train_dataset=rows(), processing_class=tok,
                    environment=lambda: object())
    from toolkit.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    with pytest.raises(ConfigError, match="does not run multi-turn episodes yet"):
        OnlineDPOTrainer(tiny_model(), [], OnlineDPOConfig(output_dir=str(tmp_path / "a"), environment="calculator",
                                                           per_device_train_batch_size=8, num_generations=4),
                         train_dataset=rows(), processing_class=tok)


def test_the_calculator_environment_by_name_with_held_out_episodes(tmp_path):
    from toolkit.core.report import heldout_episodes
    from toolkit.core.tasks import task_rows

    tok = tiny_tokenizer()
    data = task_rows("calculator", 8, max_value=99, kind="prompt_only")
    t = GRPOTrainer(tiny_model(), [], config(tmp_path, environment="calculator",
                                             environment_kwargs={"max_tool_turns": 1}),
                    train_dataset=data, processing_class=tok)
    t.train()
    success, mean = heldout_episodes(t, task_rows("calculator", 4, seed=9, max_value=99, kind="prompt_only"))
    assert success == 0.0 and mean == 0.0  # a random model does not do arithmetic
    assert t.heldout_episode_stats["turns_mean"] >= 1
    prompt = tok.decode(t._rollout.prompt_ids[0])
    assert "calculator" in prompt and "<tool_call>" in prompt  # the environment's system prompt


def test_slow_failing_and_cut_environments_at_the_episode_level():
    from toolkit.core.environments import TemplateDelta, run_episodes
    from toolkit.core.generation import Completion

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")

    class Script:
        def __init__(self, mode):
            self.mode = mode

        def reset(self, row):
            if self.mode == "reset":
                raise ValueError("no such game")
            return [{"role": "user", "content": "go"}]

        def step(self, text):
            if self.mode == "slow":
                time.sleep(3)
            if self.mode == "role":
                return EnvResponse(messages=[{"content": "a message without a role"}])
            return EnvResponse(reward=1.0, done=True)

    stopped = lambda contexts: [Completion([65, end], [-0.1, -0.1], "stop") for _ in contexts]  # noqa: E731
    started = time.monotonic()
    eps = run_episodes([Script(m) for m in ("slow", "reset", "role", "ok")], [{}] * 4, stopped, TemplateDelta(tok),
                       max_turns=3, step_timeout=0.5)
    assert time.monotonic() - started < 2.5  # the slow step was given up on, not waited for
    assert [ep.finish for ep in eps] == ["env_error", "env_error", "env_error", "done"]
    assert "environment_step_timeout" in eps[0].infos[-1]["env_error"]
    assert "no such game" in eps[1].infos[-1]["env_error"] and eps[1].ids == []
    assert "Script.step: a message is" in eps[2].infos[-1]["env_error"]  # checked before the template sees it
    assert eps[3].reward == 1.0 and not eps[3].truncated

    class Judge(Script):
        def step(self, text):
            return EnvResponse(reward=0.5, done=True)

    cut = lambda contexts: [Completion([65, 66], [-0.1, -0.1], "length") for _ in contexts]  # noqa: E731
    eps = run_episodes([Judge("ok")], [{}], cut, TemplateDelta(tok), max_turns=3)
    # scored by the environment although cut: done, and marked truncated (mask_truncated_completions sees it)
    assert eps[0].finish == "done" and eps[0].truncated and eps[0].reward == 0.5


def test_a_rank_whose_episodes_ended_keeps_turning_while_another_rank_is_active():
    """Under a sharded model every rank must make the same generate calls: with `any_rank` saying another rank is
    still active, a rank whose episodes all ended samples an empty batch each remaining turn (its episodes are
    untouched), and stops with the others. (The real collective: tests/integration/test_multiprocess.py, case episodes.)"""
    from toolkit.core.environments import TemplateDelta, run_episodes
    from toolkit.core.generation import Completion

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")

    class OneTurn:
        def reset(self, row):
            return [{"role": "user", "content": "go"}]

        def step(self, text):
            return EnvResponse(reward=1.0, done=True)

    calls, asked = [], []

    def sample(contexts):
        calls.append(len(contexts))
        return [Completion([65, end], [-0.1, -0.1], "stop") for _ in contexts]

    def other_rank_active_for_two_more_turns(flag):  # the other rank's episodes last 3 turns
        asked.append(flag)
        return flag or len(asked) <= 3

    alone = run_episodes([OneTurn(), OneTurn()], [{}] * 2, sample, TemplateDelta(tok), max_turns=5)
    assert calls == [2]
    calls.clear()
    eps = run_episodes([OneTurn(), OneTurn()], [{}] * 2, sample, TemplateDelta(tok), max_turns=5,
                       any_rank=other_rank_active_for_two_more_turns)
    assert calls == [2, 0, 0] and asked == [True, False, False, False]
    assert [(ep.ids, ep.mask, ep.finish) for ep in eps] == [(ep.ids, ep.mask, ep.finish) for ep in alone]


class Waiting(Chatty):
    """Chatty whose steps wait 0.5 s first, as a tool on a remote machine does."""

    def step(self, text):
        time.sleep(0.5)
        return super().step(text)


def test_run_episodes_times_its_waits_apart_from_its_sampling():
    from toolkit.core.environments import TemplateDelta, environment_wait_metrics, run_episodes
    from toolkit.core.generation import Completion

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")

    class TwoSlowTurns:
        def reset(self, row):
            time.sleep(0.1)
            self.turn = 0
            return [{"role": "user", "content": "go"}]

        def step(self, text):
            time.sleep(0.2)
            self.turn += 1
            return EnvResponse(messages=[{"role": "tool", "content": "ok"}], done=self.turn == 2)

    def sample(contexts):
        time.sleep(0.05)
        return [Completion([65, end], [-0.1, -0.1], "stop") for _ in contexts]

    timings = {"environment_s": 10.0}  # added to, not replaced: a caller may sum over calls
    eps = run_episodes([TwoSlowTurns() for _ in range(4)], [{}] * 4, sample, TemplateDelta(tok), max_turns=3,
                       timings=timings)
    assert [len(ep.turns) for ep in eps] == [2] * 4
    # 4 environments answer concurrently: one reset (0.1 s) and two steps (0.2 s) of waiting, not 4 times that
    # (2.0 s); the slack is for a loaded machine
    assert 10.0 + 0.5 <= timings["environment_s"] < 10.0 + 1.8
    assert 0.1 <= timings["generate_s"] < 1.0  # two sampling calls of 0.05 s
    assert environment_wait_metrics(1.5, 2.0) == {"episodes/environment_s": 1.5, "episodes/environment_share": 0.75}
    assert environment_wait_metrics(0.0, 0.0)["episodes/environment_share"] == 0.0


@pytest.mark.slow
def test_grpo_logs_how_much_of_a_round_its_environments_kept_waiting(tmp_path):
    fast = trainer(tmp_path / "fast")
    fast.train()
    slow = trainer(tmp_path / "slow", environment=Waiting)
    slow.train()
    share = {name: [h["episodes/environment_share"] for h in t.state.log_history if "episodes/environment_share" in h]
             for name, t in (("fast", fast), ("slow", slow))}
    waited = [h["episodes/environment_s"] for h in slow.state.log_history if "episodes/environment_s" in h]
    assert len(share["fast"]) == len(share["slow"]) == 1
    # the tiny model decodes in milliseconds: 3 turns of 0.5 s waits are most of the slow round, little of the fast
    fast_waited = [h["episodes/environment_s"] for h in fast.state.log_history if "episodes/environment_s" in h]
    assert waited[0] >= 1.5 and fast_waited[0] < 0.5 and share["fast"][0] < share["slow"][0]
    assert 0.3 < share["slow"][0] <= 1

    calls = []

    class OldOverride(GRPOTrainer):  # written before run_episodes took `timings`: still called, logs no waits
        def run_episodes(self, rows, sampling, *, seed, group_size=1, backend=None):
            calls.append(len(rows))
            return super().run_episodes(rows, sampling, seed=seed, group_size=group_size, backend=backend)

    tok = tiny_tokenizer()
    old = OldOverride(tiny_model(), [], config(tmp_path / "old"), train_dataset=rows(), processing_class=tok,
                      environment=Chatty)
    old.train()
    assert calls == [8]
    assert any("episodes/turns_mean" in h for h in old.state.log_history)
    assert not any("episodes/environment_s" in h for h in old.state.log_history)


def test_an_environment_factory_that_raises_costs_its_episode_not_the_run():
    from toolkit.core.environments import TemplateDelta, fresh_environments, run_episodes
    from toolkit.core.generation import Completion

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    made = []

    class Flaky:
        def __init__(self):
            made.append(self)
            if len(made) % 2 == 0:
                raise OSError("no sandbox slot left")

        def reset(self, row):
            return [{"role": "user", "content": "go"}]

        def step(self, text):
            return EnvResponse(reward=1.0, done=True)

    envs = fresh_environments(Flaky, 4)
    eps = run_episodes(envs, [{}] * 4, lambda cs: [Completion([65, end], [-0.1, -0.1], "stop") for _ in cs],
                       TemplateDelta(tok), max_turns=2)
    assert [ep.finish for ep in eps] == ["done", "env_error", "done", "env_error"]
    assert "the environment factory raised OSError: no sandbox slot left" in eps[1].infos[-1]["env_error"]
    assert eps[0].reward == 1.0 and eps[1].reward is None

    def gone():
        raise OSError("sandbox pool shut down")

    with pytest.raises(ToolkitError, match="the factory raised for every one of the 3 episodes.*sandbox pool"):
        fresh_environments(gone, 3)  # every one: not transient, and nothing to train on


def test_failed_resets_train_as_placeholders_and_async_evaluates_in_process(tmp_path):
    class BadStart(Chatty):
        made = 0

        def reset(self, row):
            BadStart.made += 1
            if BadStart.made % 3 == 0:
                raise ValueError("no start today")
            return super().reset(row)

    t = trainer(tmp_path, environment=BadStart, max_steps=2)
    t.train()  # the failed episodes' placeholder rows pack and go through forward like any other row
    assert sum(h["episodes/env_errors"] for h in t.state.log_history if "episodes/env_errors" in h) > 0

    from toolkit.core.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from toolkit.core.report import heldout_episodes
    from toolkit.core.tasks import task_rows

    tok = tiny_tokenizer()
    a = AsyncGRPOTrainer(tiny_model(), [], AsyncGRPOConfig(output_dir=str(tmp_path / "a"), environment="calculator",
                                                           per_device_train_batch_size=8, num_generations=4,
                                                           max_completion_length=6, report_to="none"),
                         train_dataset=task_rows("calculator", 8, max_value=99, kind="prompt_only"),
                         processing_class=tok)
    # no worker is started for it: the trainer process evaluates with its own model
    assert heldout_episodes(a, task_rows("calculator", 4, seed=5, max_value=99, kind="prompt_only")) == (0.0, 0.0)
    assert a.worker.process is None


@pytest.mark.parametrize("gpu", [False, True])
def test_checkpointing_default_counts_episode_tokens(tmp_path, monkeypatch, gpu):
    # Single completions of 6 tokens keep a micro-batch far under the bound; episodes of up to 600 ids (tool output
    # included) do not: 8 x 600 = 4800 > 4096. Named or given as a factory, the default follows the episodes, with
    # or without a GPU (only the config and the trainer's constructor run here: nothing is placed on a device).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # transformers' own setup needs a real one
    monkeypatch.setattr("toolkit.core.models._has_gpu", lambda: gpu)
    assert not config(tmp_path, max_episode_tokens=600).activation_checkpointing
    assert config(tmp_path, max_episode_tokens=600, environment="calculator").activation_checkpointing
    t = trainer(tmp_path, max_episode_tokens=600)
    assert t.args.activation_checkpointing and t.args.gradient_checkpointing
    assert not trainer(tmp_path, max_episode_tokens=500).args.activation_checkpointing  # 4000: under the bound
    # a value the user gave is theirs, episodes or not
    assert not trainer(tmp_path, max_episode_tokens=600, activation_checkpointing=False).args.activation_checkpointing


# ------------------------------------------------------------------------------ environments that fail (issue 63)


class _Returns:
    """An environment whose step returns what it is given (a wrong type, a dict content, a long tool result)."""

    def __init__(self, answer):
        self.answer = answer

    def reset(self, row):
        return list(row["prompt"]) if "prompt" in row else [{"role": "user", "content": "go"}]

    def step(self, text):
        return self.answer() if callable(self.answer) else self.answer


def _run(env, **kw):
    from toolkit.core.environments import TemplateDelta, run_episodes
    from toolkit.core.generation import Completion

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stopped = lambda contexts: [Completion([65, 66, end], [-0.1] * 3, "stop") for _ in contexts]  # noqa: E731
    return run_episodes([env], [{}], stopped, TemplateDelta(tok), **kw)[0]


def test_a_wrong_answer_type_costs_its_episode_and_names_the_environment_method_and_expectation():
    ep = _run(_Returns("plain text"), max_turns=3)  # used to end the whole run with AttributeError
    assert ep.finish == "env_error"
    assert ep.infos[-1]["env_error"] == ("TypeError: _Returns.step returned str 'plain text'; expected "
                                         "toolkit.core.environments.EnvResponse(messages=[...], reward=..., done=...)")
    ep = _run(_Returns(EnvResponse(messages=[{"role": "tool", "content": {"temperature": 21}}])), max_turns=3)
    assert ep.finish == "env_error"  # rendered as a repr by one template, refused by another: refused here, named
    assert "_Returns.step: a 'tool' message's content is a dict ({'temperature': 21}); chat templates render " \
           "text: give a string (json.dumps it" in ep.infos[-1]["env_error"]

    class BadReset(_Returns):
        def reset(self, row):
            return "What is 2 + 2?"

    ep = _run(BadReset(None), max_turns=3)
    assert ep.finish == "env_error" and "BadReset.reset returned str 'What is 2 + 2?' as its messages" \
        in ep.infos[-1]["env_error"]


def test_a_tool_result_longer_than_the_episode_budget_is_cut_in_tokens_so_an_answer_still_fits():
    """The ToolBox cuts a result at 4,000 characters, which alone is longer than a 512-token episode budget: no
    episode could ever answer after it, and nothing said why. Now the environment's answer is cut in tokens to
    leave the next turn its room, with a note in the text and a count in the turn's info."""
    from toolkit.core.environments import ToolBox, ToolCall

    result, _ = ToolBox({"dump": lambda: "log line 42: ok\n" * 400}).run(ToolCall("dump", {}))
    assert len(result) > 4000  # cut at 4,000 characters, still ~1,500 tokens

    answers = iter([EnvResponse(messages=[{"role": "tool", "content": result}]), EnvResponse(reward=1.0, done=True)])
    ep = _run(_Returns(lambda: next(answers)), max_turns=3, max_tokens=200, answer_reserve=20)
    assert ep.finish == "done" and ep.reward == 1.0 and len(ep.turns) == 2  # it answered after the tool
    assert ep.count("env_tokens_cut") > 1000 and len(ep.ids) <= 200
    text = tiny_tokenizer().decode(ep.ids)
    assert "tokens cut: the episode's budget (max_episode_tokens) keeps room for the answer" in text
    # without a reserve (a direct caller of run_episodes) nothing is cut: the episode ends at its budget as before
    answers = iter([EnvResponse(messages=[{"role": "tool", "content": result}]), EnvResponse(reward=1.0, done=True)])
    ep = _run(_Returns(lambda: next(answers)), max_turns=3, max_tokens=200)
    assert ep.finish == "max_tokens" and ep.count("env_tokens_cut") == 0


def test_limits_that_cannot_fit_a_turn_an_answer_and_a_second_turn_are_refused_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match=r"max_episode_tokens: 40 cannot hold a turn \(max_completion_length=16\), "
                                          r"one short environment answer \(\d+ tokens with this chat template\) and "
                                          r"a second turn \(16\).*Raise max_episode_tokens to at least \d+"):
        trainer(tmp_path, max_episode_tokens=40, max_completion_length=16)


def test_an_environment_that_fails_every_episode_stops_the_run_naming_it_and_its_last_error(tmp_path, caplog):
    """A failing reward stopped the run after 3 failed batches; an environment failing every episode went on for
    ever with loss 0 and one warning. Now it stops the same way."""
    from toolkit import TrainingHealthError

    class Broken(Chatty):
        def step(self, text):
            raise ConnectionError("the game server refused the connection")

    t = trainer(tmp_path, environment=Broken, max_steps=10, environment_max_consecutive_failures=2)
    with pytest.raises(TrainingHealthError, match=r"environment 'Broken': every episode failed \(this rank's 8, and "
                                                  r"every other rank's\) in each of the last 2 steps \(environment_max_consecutive_failures=2\).*"
                                                  r"last error: ConnectionError: the game server refused"):
        t.train()
    assert t.state.global_step == 1  # the second failed step stopped it
    # a run whose environment fails only some episodes goes on
    ok = trainer(tmp_path / "some", environment=lambda: Chatty(fail_on="3"), max_steps=3,
                 environment_max_consecutive_failures=1)
    ok.train()
    assert ok.state.global_step == 3
