"""A reward whose module never finishes importing in the async GRPO rollout worker process (as a plugin import that
hangs would): tests/trainers/test_async_grpo.py's warm-start test. In any other process it imports normally."""

import multiprocessing
import time

if multiprocessing.current_process().name == "toolkit-rollout-worker":
    time.sleep(3600)


def short(prompts, completions, completion_ids, **kw):
    return [-len(ids) / 8.0 for ids in completion_ids]
