"""A Gymnasium text environment importable by name from any process (async GRPO's worker makes it with
`gymnasium.make("episode_envs:Turns-v0")`, which imports this module and so registers it)."""

import string

import gymnasium


class Turns(gymnasium.Env):
    """Three turns; each answer is followed by an observation with whitespace and unicode; the reward, given at the
    end, is the number of characters written, mod 7 (varied within a group)."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gymnasium.spaces.Text(max_length=400, charset=string.printable + "é🙂")
        self.action_space = gymnasium.spaces.Text(max_length=400, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn, self.written = 0, 0
        return f"Start {int(self.np_random.integers(100))}", {}

    def step(self, action):
        self.turn += 1
        self.written += len(action)
        done = self.turn == 3
        reward = float(self.written % 7) if done else 0.0
        return f"  turn {self.turn} é\n🙂 ", reward, done, False, {}


gymnasium.register(id="Turns-v0", entry_point=Turns)


class NeedsCode(Exception):
    """Pickles (as the class and its args) but does not unpickle: the class cannot be called without `code`."""

    def __init__(self, *, code):
        super().__init__()
        self.code = code


class LockInInfo:
    """An `Environment` (reset/step) whose step info holds a lock, which does not pickle, and an exception that
    does not unpickle: async GRPO's worker must still deliver the round (those values replaced by strings), not lose
    it in its queue's feeder thread or crash the trainer."""

    def reset(self, row):
        return [{"role": "user", "content": f"go {row['seed']}"}]

    def step(self, text):
        import threading

        from toolkit.core.environments import EnvResponse

        info = {"lock": threading.Lock(), "error": NeedsCode(code=3), "chars": len(text)}
        return EnvResponse(reward=float(len(text) % 3), done=True, info=info)
