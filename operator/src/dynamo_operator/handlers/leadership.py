"""High availability: a Lease elector around kopf (`--leader-election`).

Every replica campaigns for one coordination.k8s.io Lease (`k8s.election` has the rules and
the fencing rule, `k8s.lease` the requests). A standby runs no kopf at all: it only reads the
Lease every retry period and answers `/healthz` with 200 `standby`. The replica that takes
the Lease records an Event on it, starts kopf and renews the Lease every retry period.

Why a Lease elector rather than kopf's peering: kopf's peering is priority-based presence
(each operator writes a heartbeat into a KopfPeering object, and one with a lower priority
pauses while it sees a higher one). It has no expiry a paused operator can check before it
writes, no conditional takeover and no way to fence a leader that was frozen; two operators
of equal priority both pause or both run. A Lease gives all of that and is what
controller-runtime, and upstream Dynamo's operator, use.

Stepping down. When the Lease cannot be renewed before the local deadline, or someone else
holds it, the process exits at once with `LEADERSHIP_LOST_EXIT_CODE` (fail-stop, like
controller-runtime): no cleanup runs, so nothing can write after the loss; the container
restarts as a standby. On SIGTERM (a rolling update, a drain), kopf stops first, then the
Lease is released (no holder), so a standby takes over at its next read, one retry period,
rather than after a full lease duration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from aiohttp import web
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.k8s import kinds
from dynamo_operator.k8s.election import Action, Election
from dynamo_operator.k8s.lease import LeaseConflict, LeaseStore, micro_time
from dynamo_operator.metrics import OperatorMetrics
from dynamo_operator.reconcile.events import EventRecorder, Regarding

logger = logging.getLogger(__name__)

LEADERSHIP_LOST_EXIT_CODE = 3
LEADER, STANDBY = "leader", "standby"


def candidate_identity() -> str:
    """This process's name in the Lease: the pod's name (POD_NAME, which the chart sets, else
    the host name) plus a random suffix, so a restarted container never mistakes the Lease of
    its previous life for its own."""
    pod = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{pod}_{uuid.uuid4().hex[:8]}"


def _now_wall() -> str:
    return micro_time(datetime.now(UTC))


class Leadership:
    """Campaigns for, holds and releases the Lease of `store` as `election`'s candidate."""

    def __init__(
        self,
        store: LeaseStore,
        election: Election,
        metrics: OperatorMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.election = election
        self.metrics = metrics
        self._clock = clock
        self.previous_holder: str | None = None
        # When the Lease was last read, and why the last try failed: a standby that cannot
        # reach the API server is not ready (it could never take over).
        self._last_read: float | None = None
        self._last_error = "not read yet"
        metrics.leader.set(0)

    @property
    def role(self) -> str:
        return LEADER if self.election.may_write(self._clock()) else STANDBY

    def check(self) -> None:
        """The fence every write passes (`k8s.election.Election.check` on the local clock)."""
        self.election.check(self._clock())

    async def _step(self) -> bool:
        """Read the Lease and take or renew it when the rules say so; True while leading."""
        record = await self.store.read()
        self._last_read = self._clock()
        self.election.observe(record, self._clock())
        action = self.election.next_action(self._clock())
        if action is Action.WAIT:
            return False
        if action is Action.ACQUIRE and record is not None:
            self.previous_holder = record.holder
        desired = self.election.desired(_now_wall(), action)
        sent_at = self._clock()
        written = await self.store.write(desired)
        self.election.written(written, sent_at)
        return True

    async def _try_step(self) -> bool:
        try:
            return await self._step()
        except LeaseConflict as err:
            logger.debug("Lease: %s", err)
        except (ApiException, OSError, TimeoutError) as err:
            logger.warning("Lease %s/%s: %s", self.store.namespace, self.store.name, err)
            self._last_error = str(err)
        return self.election.may_write(self._clock())

    def standby_problem(self) -> str | None:
        """Why this standby is not ready: no Lease read succeeded for a Lease duration."""
        within = self.election.timing.lease_duration
        if self._last_read is not None and self._clock() - self._last_read <= within:
            return None
        return (
            f"no read of Lease {self.store.namespace}/{self.store.name} succeeded in the last"
            f" {within:.0f} s: {self._last_error}"
        )

    async def campaign(self) -> None:
        """Until this replica holds the Lease."""
        logger.info(
            "Standby %s: waiting for Lease %s/%s",
            self.election.identity,
            self.store.namespace,
            self.store.name,
        )
        while True:
            if await self._try_step():
                break
            await asyncio.sleep(self.election.timing.retry_period)
        self.metrics.leader.set(1)
        self.metrics.leader_changes.labels(change="acquired").inc()
        logger.info("Leader %s (took over from %s)", self.election.identity, self.previous_holder)

    async def hold(self) -> None:
        """Renew the Lease every retry period; return once it is lost (another holder, or no
        renew succeeded before the local deadline)."""
        while True:
            await asyncio.sleep(self.election.timing.retry_period)
            # A leader whose deadline passed (it was paused, or renews kept failing) never
            # renews: its writes were refused meanwhile, and it stops.
            if self.election.may_write(self._clock()):
                await self._try_step()
            if not self.election.may_write(self._clock()):
                self.election.lost()
                self.metrics.leader.set(0)
                self.metrics.leader_changes.labels(change="lost").inc()
                return

    async def release(self) -> None:
        """Give the Lease up (no holder) after kopf stopped, so a standby takes it at once."""
        record = self.election.released(_now_wall())
        self.election.lost()
        self.metrics.leader.set(0)
        if record is None:
            return
        try:
            await self.store.write(record)
        except (LeaseConflict, ApiException, OSError, TimeoutError) as err:
            logger.warning("Lease not released (a standby takes over when it expires): %s", err)
            return
        self.metrics.leader_changes.labels(change="released").inc()
        logger.info("Released Lease %s/%s", self.store.namespace, self.store.name)

    async def record_takeover(self, recorder: EventRecorder) -> None:
        """An Event on the Lease: who leads now, and whom it took over from."""
        regarding = Regarding(kinds.LEASE, self.store.namespace, self.store.name, self.store.uid)
        previous = f" (took over from {self.previous_holder})" if self.previous_holder else ""
        await recorder.record(
            regarding,
            reason="LeaderElected",
            note=f"{self.election.identity} became the leader{previous}",
            action="Elect",
        )


def lost_leadership(identity: str) -> None:
    """Stop at once, without cleanup: nothing may write after the Lease is lost."""
    logger.error("%s lost the Lease: exiting so that the restart runs as a standby", identity)
    logging.shutdown()
    os._exit(LEADERSHIP_LOST_EXIT_CODE)


async def serve_health(
    host: str,
    port: int,
    role: Callable[[], str],
    leader_problem: Callable[[], str | None],
    standby_problem: Callable[[], str | None],
) -> web.AppRunner:
    """`/healthz` (liveness): 200 `standby` while standing by; while leading, 200 `leader`
    unless `leader_problem()` names one (500 with it; a deaf leader is cured only by a
    restart). `/readyz` (readiness): the leader as `/healthz`; a standby 200 unless
    `standby_problem()` names one (503 with it: a restart would not reach the API server
    either, but a rollout or `helm install --wait` must not count it as up)."""

    async def healthz(_: web.Request) -> web.Response:
        if role() != LEADER:
            return web.Response(text=STANDBY)
        problem = leader_problem()
        if problem is not None:
            return web.Response(status=500, text=problem)
        return web.Response(text=LEADER)

    async def readyz(request: web.Request) -> web.Response:
        if role() == LEADER:
            return await healthz(request)
        problem = standby_problem()
        if problem is not None:
            return web.Response(status=503, text=problem)
        return web.Response(text=STANDBY)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
