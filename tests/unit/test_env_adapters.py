"""Adapters for environments users already have, run unmodified: Gymnasium text environments, TextArena games."""

import re
import string

import pytest

gymnasium = pytest.importorskip("gymnasium")
textarena = pytest.importorskip("textarena")

from toolkit import ConfigError  # noqa: E402
from toolkit.core.environments import (  # noqa: E402
    GymnasiumEnvironment,
    TemplateDelta,
    TextArenaEnvironment,
    run_episode,
)
from toolkit.core.generation import Completion  # noqa: E402
from toolkit.core.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from toolkit.testing import tiny_model, tiny_tokenizer  # noqa: E402


class Echo(gymnasium.Env):
    """A Gymnasium text environment: repeat the secret word within 3 tries; reward 1 on success."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gymnasium.spaces.Text(max_length=200, charset=string.printable)
        self.action_space = gymnasium.spaces.Text(max_length=200, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.word = ["apple", "pear", "plum"][int(self.np_random.integers(3))]
        self.tries = 0
        return f"Say the word '{self.word}'.", {}

    def step(self, action):
        self.tries += 1
        won = self.word in action
        return ("Right." if won else "No, try again."), float(won), won, self.tries >= 3, {}


gymnasium.register(id="toolkit-test/Echo-v0", entry_point=Echo, max_episode_steps=5)


def scripted(tok, turns):
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    said = iter(turns)

    def sample(context):
        ids = tok(next(said), add_special_tokens=False)["input_ids"] + [stop]
        return Completion(ids, [-0.1] * len(ids), "stop")

    return sample


def test_a_gymnasium_environment_made_by_id_runs_token_exact():
    tok = tiny_tokenizer()
    env = GymnasiumEnvironment("toolkit-test/Echo-v0")  # through gymnasium.make and its wrappers
    messages = env.reset({"seed": 1})
    word = re.search(r"'(\w+)'", messages[0]["content"]).group(1)
    env2 = GymnasiumEnvironment("toolkit-test/Echo-v0")
    ep = run_episode(env2, {"seed": 1}, scripted(tok, ["banana", f"it is {word}"]), TemplateDelta(tok), max_turns=5)
    assert ep.finish == "done" and ep.reward == 1.0 and len(ep.turns) == 2
    assert "No, try again." in tok.decode(ep.prompt_ids + ep.ids)
    # truncation (3 wrong tries) ends the episode with no reward
    ep = run_episode(GymnasiumEnvironment("toolkit-test/Echo-v0"), {"seed": 1}, scripted(tok, ["x", "y", "z", "w"]),
                     TemplateDelta(tok), max_turns=5)
    assert ep.finish == "done" and len(ep.turns) == 3 and ep.reward == 0.0
    with pytest.raises(ConfigError, match="gymnasium cannot make"):
        GymnasiumEnvironment("toolkit-test/Missing-v0")


def test_a_textarena_game_runs_unmodified():
    tok = tiny_tokenizer()
    env = TextArenaEnvironment("GuessTheNumber-v0-raw")
    opening = env.reset({"seed": 3})[0]["content"]
    assert "Guess The Number" in opening
    # binary search by the game's own hints, as a scripted policy
    lo, hi, guesses = 1, 20, []

    def sample(context):
        nonlocal lo, hi
        text = tok.decode(context)
        if text.rstrip().endswith("lower.<|im_end|>\n<|im_start|>assistant"):
            hi = guesses[-1] - 1
        elif guesses:
            lo = guesses[-1] + 1
        guesses.append((lo + hi) // 2)
        ids = tok(f"[{guesses[-1]}]", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        return Completion(ids, [-0.1] * len(ids), "stop")

    ep = run_episode(TextArenaEnvironment("GuessTheNumber-v0-raw"), {"seed": 3}, sample, TemplateDelta(tok),
                     max_turns=10)
    assert ep.finish == "done" and ep.reward == 1.0 and 1 < len(ep.turns) <= 5
    context = tok.decode(ep.prompt_ids + ep.ids)
    assert "The target number is" in context and context.count("You are Player 0") == 1  # no history re-sent
    with pytest.raises(ConfigError, match="textarena cannot make"):
        TextArenaEnvironment("NoSuchGame-v0")


def test_grpo_trains_on_a_textarena_game_by_name(tmp_path):
    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=6, learning_rate=1e-2, save_strategy="no", seed=0,
                      disable_tqdm=True, report_to="none", environment="textarena",
                      environment_kwargs={"env_id": "GuessTheNumber-v0-raw"}, max_turns=3, max_episode_tokens=400,
                      stop_token_ids=[end] + list(range(200, 384)))
    rows = [{"prompt": "Guess the number", "seed": i} for i in range(4)]
    t = GRPOTrainer(tiny_model(), [], args, train_dataset=rows, processing_class=tok)
    t.train()
    logs = {k: v for h in t.state.log_history for k, v in h.items()}
    assert logs["episodes/turns_mean"] > 1 and "reward" in logs
    assert "Guess The Number" in tok.decode(t._rollout.prompt_ids[0])
