"""The hold: requests wait here, bounded and timed, for a ready pod that serves their model.

A request finds a pod at once when one serves its model (a LoRA adapter counts once a ready
pod's published cards list it: the operator loads adapters onto new pods, and each pod
publishes an adapter's card once it is loaded). Otherwise it is *held*: at most `max_held`
at once (more are refused at once), each until `timeout_s` has passed since it arrived.
Held requests are the autoscaler's demand signal (`dynamo_activator_held_requests`), which
is how the activator wakes the DynamoWorker: it never writes the DynamoWorker itself.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from dynamo.activator.metrics import ActivatorMetrics
from dynamo.activator.pods import Fleet, ReadyPod

# What a refused or expired request is told to wait before retrying.
RETRY_AFTER_S = 5


class HoldError(Exception):
    """The request cannot be forwarded; `str()` explains why, for the client."""


class HoldFull(HoldError):
    """Over the bound: refused at once."""


class HoldExpired(HoldError):
    """No suitable pod became ready before the timeout."""


class HoldClosed(HoldError):
    """The activator is shutting down."""


@dataclass(frozen=True)
class Ticket:
    """One request in the hold: when it arrived and what it waits for."""

    model: str | None
    arrived: float  # time.monotonic()
    deadline: float

    def waiting_for(self) -> str:
        return f"a ready pod serving {self.model!r}" if self.model else "a ready pod"


class Hold:
    """Hands out ready pods to requests, holding them while there is none."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: ActivatorMetrics,
        *,
        worker: str,
        max_held: int,
        timeout_s: float,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.worker = worker  # `namespace/name` of the DynamoWorker, for messages
        self.max_held = max_held
        self.timeout_s = timeout_s
        self.held = 0
        self._closed = asyncio.Event()

    def ticket(self, model: str | None) -> Ticket:
        """Start the clock for a new request (its deadline covers every retry)."""
        now = time.monotonic()
        return Ticket(model, now, now + self.timeout_s)

    async def wait(self, ticket: Ticket, exclude: frozenset[str] = frozenset()) -> ReadyPod:
        """A ready pod for `ticket` (not one in `exclude`: pods that already turned it away).

        HoldFull, HoldExpired or HoldClosed when there is none to give.
        """
        if self._closed.is_set():
            raise HoldClosed(f"the activator of DynamoWorker {self.worker} is shutting down")
        pod = self.fleet.pick(ticket.model, exclude)
        if pod is not None:
            return pod
        if self.held >= self.max_held:
            self.metrics.refused.inc()
            raise HoldFull(
                f"DynamoWorker {self.worker} is scaling up and already holds {self.held}"
                f" requests (the most it holds); retry later"
            )
        self.held += 1
        self.metrics.held.inc()
        try:
            return await self._wait_held(ticket, exclude)
        finally:
            self.held -= 1
            self.metrics.held.dec()

    def forwarded(self, ticket: Ticket) -> None:
        """Count a request a pod accepted, with its time in the hold."""
        self.metrics.forwarded.inc()
        self.metrics.wait_seconds.observe(time.monotonic() - ticket.arrived)

    def close(self) -> None:
        """Shutting down: every held request (and every new one) gets HoldClosed."""
        self._closed.set()

    async def _wait_held(self, ticket: Ticket, exclude: frozenset[str]) -> ReadyPod:
        while True:
            next_change = self.fleet.next_change()
            pod = self.fleet.pick(ticket.model, exclude)
            if pod is not None:
                return pod
            remaining = ticket.deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.expired.inc()
                raise HoldExpired(
                    f"DynamoWorker {self.worker} had no ready pod serving the request in"
                    f" {self.timeout_s:g} s: it waited for {ticket.waiting_for()}"
                )
            changed = asyncio.ensure_future(next_change.wait())
            closed = asyncio.ensure_future(self._closed.wait())
            try:
                await asyncio.wait(
                    {changed, closed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                changed.cancel()
                closed.cancel()
            if self._closed.is_set():
                raise HoldClosed(
                    f"the activator of DynamoWorker {self.worker} is shutting down; it was"
                    f" waiting for {ticket.waiting_for()}"
                )
            # The pods changed: one that turned the request away may serve it now.
            exclude = frozenset()
