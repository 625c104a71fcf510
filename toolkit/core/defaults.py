"""Names any layer may need without importing torch or transformers (the command line's start-up reads them).

`toolkit.core.models` re-exports both; this module exists so that `toolkit --help` and `toolkit <command> --help`
stay fast (docs/architecture.md, "Start-up").
"""

from __future__ import annotations

__all__ = ["DEFAULT_MODEL", "EMBEDDED_HUB_ID"]

#: The embedded model's short name, accepted wherever a model is accepted (toolkit.core.models).
DEFAULT_MODEL = "smollm2-135m-instruct"
#: The Hub model the embedded copy comes from (its model cards name it as base_model).
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
