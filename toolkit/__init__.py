"""toolkit: post-training for language models: SFT, DPO, PPO, GRPO and async GRPO.

Everything importable from `toolkit` is the stable API of `toolkit.core`. `toolkit.experimental`
holds methods that may change in any release and warns on import.
"""

from ._version import __version__
from .core import *  # noqa: F403
from .core import __all__ as _core_all

__all__ = [*_core_all, "__version__"]
