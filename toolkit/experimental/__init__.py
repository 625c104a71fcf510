"""toolkit.experimental: methods incubating before promotion to toolkit.core. No stability promise.

Importing this package emits `ToolkitExperimentalWarning`; set `TOOLKIT_EXPERIMENTAL_SILENCE=1`
to silence it. A method is promoted to `toolkit.core` by the rule in docs/experimental.md
(tests incl. parity where a reference exists, docs, a real run recorded in a closing note, and
one release of use), with a shim left here for one minor release.
"""

import os
import warnings


class ToolkitExperimentalWarning(UserWarning):
    """Warns that an API under toolkit.experimental may change or disappear in any release."""


if os.environ.get("TOOLKIT_EXPERIMENTAL_SILENCE", "").lower() not in ("1", "true", "yes"):
    warnings.warn(
        "toolkit.experimental has no stability promise: its APIs may change in any release. "
        "Set TOOLKIT_EXPERIMENTAL_SILENCE=1 to silence this warning.",
        ToolkitExperimentalWarning,
        stacklevel=2,
    )
