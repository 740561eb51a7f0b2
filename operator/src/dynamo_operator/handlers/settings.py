"""How the operator runs: `OperatorConfig`, from `dynamo-operator run`'s options."""

from __future__ import annotations

from dataclasses import dataclass

# The operator's own HTTP endpoints listen on every address of its pod.
METRICS_HOST = "0.0.0.0"
HEALTH_HOST = "0.0.0.0"


@dataclass(frozen=True)
class OperatorConfig:
    """How the operator runs (from `dynamo-operator run`'s options).

    `resync_seconds`: every DynamoWorker and LoRAAdapter is reconciled at least this often,
    which repairs drift no watch reports (a child deleted out of band, an edited Role, a
    worker that lost an adapter without its pod changing). `crash_after_writes`: fault
    injection for tests (exit after that many writes).
    """

    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    worker_image: str | None = None
    worker_image_pull_secrets: tuple[str, ...] = ()
    frontend_image: str | None = None
    metrics_port: int = 8080
    health_port: int = 8081
    resync_seconds: float = 30.0
    install_crds: bool = True
    crash_after_writes: int | None = None

    def __post_init__(self) -> None:
        if self.all_namespaces == bool(self.namespaces):
            raise ValueError("give --namespace (one or more) or --all-namespaces, not both")
        if self.resync_seconds <= 0:
            raise ValueError("--resync-seconds must be positive")
