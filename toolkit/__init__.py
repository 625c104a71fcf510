"""toolkit: post-training for language models: SFT, DPO, PPO, GRPO and async GRPO.

Everything importable from `toolkit` is the stable API of `toolkit.core`. `toolkit.experimental`
holds methods that may change in any release and warns on import. Imports are lazy: `import toolkit`
is instant, and the first name used loads the core (toolkit.core's docstring).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ._version import __version__  # noqa: F401  (in __all__, computed lazily)


class _DropKnownNoise(logging.Filter):
    """bitsandbytes (imported by transformers and peft when installed) asks the `kernels` package at import, on CPUs
    with AVX-512 BF16, for an optional kernel from the Hub, and one of the two logs a warning every time: bitsandbytes
    that it could not load it ("Failed to load CPU gemm_4bit_forward from kernels-community ... trust"), or, with
    HF_HUB_OFFLINE, `kernels` that it skips the publisher check of that repository. bitsandbytes then uses its own
    kernel, so either line is noise on every import of a trainer. Only these two messages about that one kernel
    are dropped; everything else both packages log is shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Failed to load CPU gemm_4bit_forward" in message
                    or "trust check for 'kernels-community/quantization-bitsandbytes'" in message)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropKnownNoise())
logging.getLogger("kernels._internals.hf_hub").addFilter(_DropKnownNoise())


def __getattr__(name: str) -> Any:
    if name.startswith("__") and name != "__all__":
        raise AttributeError(name)
    core = importlib.import_module("toolkit.core")  # (not `from . import core`: that would look itself up here)
    if name == "__all__":
        return [*core.__all__, "__version__"]
    if name in ("core", "experimental", "cli", "testing"):
        return importlib.import_module(f"toolkit.{name}")
    return getattr(core, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *importlib.import_module("toolkit.core").__all__})
