"""The tiny random-weight Llama checkpoint and its LoRA adapters, made once per test session.

`hack/make-tiny-model` writes them; here the same generator (hack/tinymodel.py) runs
in-process into a session temp dir, since importing torch again in a subprocess costs
seconds. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_SEED = 0


@dataclass(frozen=True)
class TinyModel:
    """Where the tiny model lives: `base` checkpoint dir and adapter dirs by name."""

    root: Path
    base: Path
    adapters: dict[str, Path]
    served_name: str


def load_generator() -> ModuleType:
    """hack/tinymodel.py as a module (hack/ is not a package on the test path)."""
    loaded = sys.modules.get("tinymodel")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("tinymodel", REPO / "hack" / "tinymodel.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before running: its dataclasses look their module up by name.
    sys.modules["tinymodel"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny model written with seed `TINY_MODEL_SEED` (read-only for tests: copy to edit)."""
    generator = load_generator()
    root = tmp_path_factory.mktemp("tiny-model")
    generator.write_tiny_model(root, TINY_MODEL_SEED)
    adapters = {spec.name: root / "adapters" / spec.name for spec in generator.ADAPTERS}
    return TinyModel(
        root=root, base=root / "base", adapters=adapters, served_name=generator.BASE_MODEL_NAME
    )
