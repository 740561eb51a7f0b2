"""The system status server (`DYN_SYSTEM_HOST:DYN_SYSTEM_PORT`) and its admin routes.

* `server`: health, liveness, `/metrics`, `/metadata`, model-card files, `/engine/{path}`;
* `admin`: the `/engine/control|update/<name>` registry and its gating by lifecycle phase;
* `loras`: upstream's `/v1/loras` routes over the engine's LoRA updates.
"""

from dynamo.runtime.system.server import SystemServer

__all__ = ["SystemServer"]
