"""The worker runtime's system server as the operator reaches it: its port and routes.

Upstream Dynamo's (its Rust runtime serves the same ones): the probes' paths, `/metrics`, and
the two routes the operator calls, model taints and LoRA adapters.
"""

from __future__ import annotations

SYSTEM_PORT = 9090
SYSTEM_PORT_NAME = "system"
LIVE_PATH = "/live"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MODEL_TAINTS_PATH = "/engine/update/model_taints"
LORAS_PATH = "/v1/loras"


def system_url(ip: str, path: str) -> str:
    """`path` on the system server of the pod at `ip` (IPv6 addresses bracketed)."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{SYSTEM_PORT}{path}"
