"""A pure-Python reimplementation of NVIDIA Dynamo's `dynamo.common` library.

The submodules named in `__all__` are imported lazily on first attribute access, so
`import dynamo.common` stays cheap (several submodules pull in heavy dependencies).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType


def _resolve_version() -> str:
    """Return the package version: `_version` module, else the installed distribution."""
    try:
        from ._version import __version__ as generated

        return str(generated)
    except ImportError:
        pass
    # Upstream ships as `ai-dynamo`; this project ships as `dynamo-operator`.
    for distribution in ("ai-dynamo", "dynamo-operator"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "0.0.0+unknown"


__version__ = _resolve_version()

# Upstream also lists `snapshot`; it is not part of this reimplementation, so it is not
# advertised here (a lazy name that cannot be imported would only fail later).
_LAZY_SUBMODULES = ("config_dump", "constants", "utils")

__all__ = ["__version__", "config_dump", "constants", "utils"]


def __getattr__(name: str) -> ModuleType:
    """Import the listed submodules on first access and cache them in the module globals."""
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
