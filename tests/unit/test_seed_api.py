"""Every name of the seed's `dynamo.common` API imports from its documented module, is a
class or function as documented, and has the documented parameter names."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from seed_api_table import SEED_API, SeedEntry

pytestmark = pytest.mark.unit


def _param_names(signature: inspect.Signature) -> tuple[str, ...]:
    """Render a signature in the table's notation: `*` marker, `*args`, `**kwargs`."""
    names: list[str] = []
    seen_star = False
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            names.append(f"*{parameter.name}")
            seen_star = True
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names.append(f"**{parameter.name}")
        else:
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY and not seen_star:
                names.append("*")
                seen_star = True
            names.append(parameter.name)
    return tuple(names)


def _method_params(cls: type, method: str) -> tuple[str, ...]:
    raw = inspect.getattr_static(cls, method)
    if isinstance(raw, staticmethod):
        return _param_names(inspect.signature(raw.__func__))
    if isinstance(raw, classmethod):
        # Bound to the class, so `cls` is already gone.
        return _param_names(inspect.signature(getattr(cls, method)))
    function: Callable[..., Any] = raw
    names = _param_names(inspect.signature(function))
    assert names[:1] == ("self",), f"{cls.__name__}.{method} is not an instance method"
    return names[1:]


def _resolve(entry: SeedEntry) -> Any:
    module = importlib.import_module(entry.module)
    assert hasattr(module, entry.name), f"{entry.module} does not export {entry.name}"
    return getattr(module, entry.name)


def test_table_matches_seed_counts() -> None:
    names = [entry.name for entry in SEED_API]
    assert len(names) == len(set(names)) == 80
    assert sum(entry.kind == "class" for entry in SEED_API) == 50
    assert sum(entry.kind == "function" for entry in SEED_API) == 30


@pytest.mark.parametrize("entry", SEED_API, ids=lambda e: f"{e.module}.{e.name}")
def test_seed_name(entry: SeedEntry) -> None:
    obj = _resolve(entry)
    if entry.kind == "class":
        assert inspect.isclass(obj), f"{entry.name} should be a class, is {type(obj)}"
        if entry.params is not None:
            assert _param_names(inspect.signature(obj)) == entry.params
        for method, params in entry.methods.items():
            assert hasattr(obj, method), f"{entry.name} lacks method {method}"
            assert _method_params(obj, method) == params, f"{entry.name}.{method}"
    else:
        assert inspect.isroutine(obj), f"{entry.name} should be a function, is {type(obj)}"
        assert entry.params is not None
        assert _param_names(inspect.signature(obj)) == entry.params
