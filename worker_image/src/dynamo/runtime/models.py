"""`ServedModels`: the model names this worker answers to, and which one a request picks.

The base model answers to its served name, the engine's model path and its aliases; each
loaded LoRA adapter answers to its own name. The runtime refreshes `adapters` after every
adapter load or unload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynamo.runtime.errors import RequestError


@dataclass
class ServedModels:
    """Names of the base model and of the loaded adapters (name -> lora id)."""

    base: str
    aliases: frozenset[str] = frozenset()
    adapters: dict[str, int] = field(default_factory=dict)
    created: int = 0

    def resolve(self, requested: object) -> str | None:
        """The adapter a request's `model` names, None for the base model; raise a 404
        `RequestError` for any other name."""
        if requested is None or requested == self.base or requested in self.aliases:
            return None
        if not isinstance(requested, str):
            raise RequestError("'model' must be a string", param="model")
        if requested in self.adapters:
            return requested
        raise RequestError(
            f"The model `{requested}` does not exist on this worker; it serves "
            f"{sorted({self.base, *self.adapters})}",
            status=404,
            param="model",
        )

    def listing(self) -> dict[str, Any]:
        """The `/v1/models` body: the base model, then each adapter (with its parent)."""
        data: list[dict[str, Any]] = [
            {"id": self.base, "object": "model", "created": self.created, "owned_by": "dynamo"}
        ]
        for name in sorted(self.adapters):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "dynamo",
                    "parent": self.base,
                }
            )
        return {"object": "list", "data": data}
