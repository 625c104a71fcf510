"""toolkit: post-training for language models (SFT now; DPO, PPO, GRPO and async GRPO to come).

Everything importable from `toolkit` is the stable API of `toolkit.core`. `toolkit.experimental`
holds methods that may change in any release and warns on import.
"""

from .core import *  # noqa: F403
from .core import __all__ as _core_all

__version__ = "0.1.0"
__all__ = list(_core_all) + ["__version__"]
