"""Leader election over a coordination.k8s.io Lease, as a pure state machine (no I/O).

One replica reconciles at a time; the others wait as standbys. `Election` decides, from the
Lease it last read and the local monotonic clock, whether to take the Lease, renew it or wait,
and whether this process may write right now. The I/O (`k8s.lease`) and the loop that runs
the operator while leading (`handlers.leadership`) live elsewhere.

Taking over. A standby never trusts the holder's `renewTime` (another machine's wall clock):
like client-go, it notes on its own monotonic clock when it first saw the Lease's current
record, and takes the Lease only once that record has stayed unchanged for a full
`leaseDurationSeconds`, or when the Lease has no holder (a leader that stopped cleanly
releases it). Writes of the Lease carry its resourceVersion, so of two racing standbys one
wins and the other gets a conflict.

The fencing rule. The leader's *local lease deadline* is
`t_sent + lease_duration - safety_margin`, where `t_sent` is the local monotonic time at
which the last successful renew (or acquire) was *sent* (the server applied it at some point
after that, so no standby can start counting the record's age before `t_sent`). Every write
the operator makes (its own requests, kopf's patches and Events, and calls to the worker
pods' admin routes) first checks `may_write(now)`: it is refused once the deadline has
passed. A standby takes over no earlier than `lease_duration` after it *observed* the renewed
record, which is after `t_sent`; so as long as the two monotonic clocks do not drift apart by
more than `safety_margin` within one lease duration, the old leader's last permitted write
happens before the new leader's first. A leader paused past its deadline (SIGSTOP, a long GC,
a frozen VM) therefore finds every write refused when it resumes; its renew then sees another
holder or the passed deadline, and it stops (fail-stop: the process exits and restarts as a
standby). CLOCK_MONOTONIC keeps counting while a process is stopped, which is what makes a
SIGSTOPped leader's deadline pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class NotLeader(Exception):
    """A write was refused: this process does not hold the Lease (or its deadline passed)."""


@dataclass(frozen=True)
class Timing:
    """The election's periods, in seconds (client-go's defaults: 15 s lease, 2 s retry).

    `retry_period`: how often a standby reads the Lease and the leader renews it.
    `safety_margin`: how much earlier than a standby could take over the leader stops writing.
    """

    lease_duration: float = 15.0
    retry_period: float = 2.0
    safety_margin: float = 2.0

    def __post_init__(self) -> None:
        if self.retry_period <= 0 or self.safety_margin <= 0:
            raise ValueError("the retry period and the safety margin must be positive")
        if self.lease_duration < self.retry_period + self.safety_margin:
            raise ValueError(
                f"--lease-duration-seconds ({self.lease_duration:g}) must be at least the retry "
                f"period plus the safety margin ({self.retry_period + self.safety_margin:g}): "
                "the leader renews once per retry period and must do so before its deadline"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says (`resource_version` None: no Lease exists yet)."""

    holder: str | None
    duration_seconds: float
    transitions: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    resource_version: str | None = None


class Action(enum.Enum):
    WAIT = "wait"
    ACQUIRE = "acquire"
    RENEW = "renew"


class Election:
    """One candidate's view of the election (see the module docstring for the rules)."""

    def __init__(self, identity: str, timing: Timing) -> None:
        if not identity:
            raise ValueError("the candidate needs an identity")
        self.identity = identity
        self.timing = timing
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._deadline: float | None = None

    def observe(self, record: LeaseRecord | None, now: float) -> None:
        """Note the Lease as just read (None: there is none). The clock of its age restarts
        only when the record changed (another holder, a renew, a release)."""
        if record is None or self._observed is None or record != self._observed:
            self._observed_at = now
        self._observed = record
        if self._held_by_another(record):
            self._deadline = None

    def _held_by_another(self, record: LeaseRecord | None) -> bool:
        return record is not None and bool(record.holder) and record.holder != self.identity

    def next_action(self, now: float) -> Action:
        """What to do with the Lease last observed."""
        record = self._observed
        if record is not None and self._held_by_another(record):
            expired = now - self._observed_at >= record.duration_seconds
            return Action.ACQUIRE if expired else Action.WAIT
        if self.may_write(now):
            return Action.RENEW
        return Action.ACQUIRE

    def desired(self, now_wall: str, action: Action) -> LeaseRecord:
        """The Lease to write for `action` (`now_wall`: the RFC 3339 micro-time of now), from the
        one last observed (its resourceVersion makes the write conditional)."""
        if action is Action.WAIT:
            raise ValueError("waiting writes nothing")
        old = self._observed
        duration = self.timing.lease_duration
        if old is None:
            return LeaseRecord(self.identity, duration, 0, now_wall, now_wall)
        if old.holder == self.identity and action is Action.RENEW:
            return replace(old, duration_seconds=duration, renew_time=now_wall)
        transitions = old.transitions + (1 if old.holder and old.holder != self.identity else 0)
        return replace(
            old,
            holder=self.identity,
            duration_seconds=duration,
            transitions=transitions,
            acquire_time=now_wall,
            renew_time=now_wall,
        )

    def released(self, now_wall: str) -> LeaseRecord | None:
        """The Lease to write when stepping down cleanly (no holder, so a standby takes it at
        its next read), or None when this process does not hold it."""
        old = self._observed
        if old is None or old.holder != self.identity:
            return None
        return replace(old, holder=None, renew_time=now_wall)

    def written(self, record: LeaseRecord, sent_at: float) -> None:
        """A write of `record`, sent at monotonic `sent_at`, succeeded."""
        self._observed = record
        self._observed_at = sent_at
        if record.holder == self.identity:
            self._deadline = sent_at + self.timing.lease_duration - self.timing.safety_margin
        else:
            self._deadline = None

    def lost(self) -> None:
        """The Lease is someone else's (or could not be renewed): stop writing at once."""
        self._deadline = None

    @property
    def deadline(self) -> float | None:
        """The local lease deadline (monotonic), or None when not leading."""
        return self._deadline

    def may_write(self, now: float) -> bool:
        """The fencing rule: leading, and the local lease deadline has not passed."""
        return self._deadline is not None and now < self._deadline

    def check(self, now: float) -> None:
        """Raise `NotLeader` unless `may_write(now)`."""
        if not self.may_write(now):
            raise NotLeader(f"{self.identity} does not hold the Lease: write refused")
