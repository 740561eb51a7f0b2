"""Environment parsing with upstream's Rust runtime rules.

Upstream reads its runtime settings through figment (an empty variable counts as unset) and
parses flags with `env_is_truthy` (trimmed, case-insensitive `1|true|on|yes`). Those rules
differ from `dynamo.common.utils.env.env_bool` (no trim, no `on`) and from
`dynamo.common.rl.admin.env_bool` (`on` counts, empty is false), which stay as they are for
the Python code that uses them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

logger = logging.getLogger(__name__)

RUST_TRUE_VALUES = frozenset({"1", "true", "on", "yes"})


def is_truthy(value: str) -> bool:
    """The Rust runtime's truthiness: trimmed, case-insensitive `1|true|on|yes`."""
    return value.strip().lower() in RUST_TRUE_VALUES


def env_text(environ: Mapping[str, str], name: str) -> str | None:
    """The variable's value, or None when unset or empty (figment ignores empty values)."""
    value = environ.get(name)
    return value if value else None


def env_flag(environ: Mapping[str, str], name: str, default: bool = False) -> bool:
    """A flag with the Rust truthiness rule; unset or empty gives `default`."""
    value = env_text(environ, name)
    return default if value is None else is_truthy(value)


def env_seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """Seconds as a float: unset, empty, unparsable or non-finite give `default` (with a
    warning for the bad ones); negative values become 0."""
    value = env_text(environ, name)
    if value is None:
        return default
    try:
        seconds = float(value.strip())
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        logger.warning("%s=%r is not a finite number of seconds; using %s", name, value, default)
        return default
    return max(seconds, 0.0)


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer; unset or empty gives `default`, anything else unparsable raises
    ValueError naming the variable."""
    value = env_text(environ, name)
    if value is None:
        return default
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
