"""How the operator runs: `OperatorConfig`, from `dynamo-operator run`'s options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dynamo_operator.k8s.election import Timing
from dynamo_operator.pods.credentials import DEFAULT_TOKEN_FILE

# The operator's own HTTP endpoints listen on every address of its pod.
METRICS_HOST = "0.0.0.0"
HEALTH_HOST = "0.0.0.0"
DEFAULT_LEASE_NAME = "dynamo-operator-leader"


@dataclass(frozen=True)
class OperatorConfig:
    """How the operator runs (from `dynamo-operator run`'s options).

    `resync_seconds`: every DynamoWorker and LoRAAdapter is reconciled at least this often,
    which repairs drift no watch reports (a child deleted out of band, an edited Role, a
    worker that lost an adapter without its pod changing). `worker_token_file`: the projected
    token sent to worker pods (`pods.credentials`). `operator_namespace`: where the operator's
    pod runs (POD_NAMESPACE), which the worker pods' NetworkPolicy admits. `leader_election`:
    replicas elect one leader through the Lease `lease_name` in `lease_namespace`
    (`handlers.leadership`), held for `lease_duration_seconds` and read or renewed every
    `lease_retry_seconds`.
    """

    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    worker_image: str | None = None
    vllm_worker_image: str | None = None
    worker_image_pull_secrets: tuple[str, ...] = ()
    frontend_image: str | None = None
    metrics_port: int = 8080
    health_port: int = 8081
    resync_seconds: float = 30.0
    install_crds: bool = True
    worker_token_file: Path = DEFAULT_TOKEN_FILE
    operator_namespace: str | None = None
    leader_election: bool = False
    lease_name: str = DEFAULT_LEASE_NAME
    lease_duration_seconds: float = 15.0
    lease_retry_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.all_namespaces == bool(self.namespaces):
            raise ValueError("give --namespace (one or more) or --all-namespaces, not both")
        if self.resync_seconds <= 0:
            raise ValueError("--resync-seconds must be positive")
        if self.leader_election:
            if self.lease_namespace is None:
                raise ValueError(
                    "--leader-election with --all-namespaces needs POD_NAMESPACE (the namespace "
                    "of the Lease; the chart sets it)"
                )
            self.election_timing()  # refuses periods that cannot work

    @property
    def lease_namespace(self) -> str | None:
        """Where the leader-election Lease lives: the operator's own namespace, else the
        first watched one."""
        return self.operator_namespace or (self.namespaces[0] if self.namespaces else None)

    def election_timing(self) -> Timing:
        """The election's periods; the safety margin is one retry period."""
        return Timing(
            lease_duration=self.lease_duration_seconds,
            retry_period=self.lease_retry_seconds,
            safety_margin=self.lease_retry_seconds,
        )
