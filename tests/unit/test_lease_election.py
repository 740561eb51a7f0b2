"""Leader election: the Lease state machine (`k8s.election`) and the write fence.

The state machine is driven with explicit monotonic times. The safety property (a paused
old leader's last permitted write comes before the new leader's first) is checked over
random schedules of renew latencies and pauses. The fence is checked against a real
loopback HTTP server, which records what reached it: a refused write is never sent.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import kopf
import pytest
from aiohttp import web
from kubernetes_asyncio import client

from dynamo_operator import cli
from dynamo_operator.handlers.fence import FencedRequest, WriteFence, kopf_session
from dynamo_operator.handlers.settings import OperatorConfig
from dynamo_operator.k8s.client import ApiError, Cluster
from dynamo_operator.k8s.election import Action, Election, LeaseRecord, NotLeader, Timing
from dynamo_operator.k8s.kinds import SERVICE
from support.loopback_http import serve

pytestmark = pytest.mark.unit

TIMING = Timing(lease_duration=15.0, retry_period=2.0, safety_margin=2.0)
WALL = "2026-01-01T00:00:00.000000Z"


def lease(holder: str | None, version: str, *, transitions: int = 0) -> LeaseRecord:
    return LeaseRecord(
        holder, 15.0, transitions, acquire_time=WALL, renew_time=WALL, resource_version=version
    )


def leading(identity: str = "a", at: float = 0.0) -> Election:
    election = Election(identity, TIMING)
    election.observe(None, at)
    assert election.next_action(at) is Action.ACQUIRE
    election.written(lease(identity, "1"), sent_at=at)
    return election


def test_timing_refuses_a_lease_too_short_to_renew() -> None:
    with pytest.raises(ValueError, match="--lease-duration-seconds"):
        Timing(lease_duration=3.0, retry_period=2.0, safety_margin=2.0)
    with pytest.raises(ValueError, match="positive"):
        Timing(lease_duration=15.0, retry_period=0.0, safety_margin=2.0)


def test_no_lease_is_created_with_this_candidate_as_holder() -> None:
    election = Election("a", TIMING)
    election.observe(None, 0.0)
    assert election.next_action(0.0) is Action.ACQUIRE
    desired = election.desired(WALL, Action.ACQUIRE)
    assert desired == LeaseRecord("a", 15.0, 0, WALL, WALL, None)
    assert not election.may_write(0.0)  # not before the write succeeded


def test_the_local_deadline_counts_from_when_the_renew_was_sent() -> None:
    election = leading(at=100.0)
    # sent at 100: the deadline is 100 + 15 - 2, however late the answer came.
    assert election.deadline == 113.0
    assert election.may_write(112.999)
    assert not election.may_write(113.0)
    with pytest.raises(NotLeader):
        election.check(113.0)
    assert election.next_action(112.0) is Action.RENEW


def test_renew_keeps_the_acquire_time_and_transitions() -> None:
    election = leading()
    held = LeaseRecord("a", 15.0, 3, "t-acquired", "t-renewed", "7")
    election.observe(held, 1.0)
    renewed = election.desired("t-now", Action.RENEW)
    assert renewed == LeaseRecord("a", 15.0, 3, "t-acquired", "t-now", "7")


def test_a_standby_waits_while_the_holder_renews_however_long() -> None:
    standby = Election("b", TIMING)
    for i in range(50):  # 100 s of renews every 2 s
        standby.observe(lease("a", str(i)), now=2.0 * i)
        assert standby.next_action(2.0 * i) is Action.WAIT


def test_a_standby_takes_over_after_a_full_duration_unchanged_on_its_own_clock() -> None:
    standby = Election("b", TIMING)
    # The holder's renewTime says nothing to the standby (another machine's clock): only how
    # long the record has stayed the same, from when this standby first saw it.
    standby.observe(lease("a", "9"), now=50.0)
    standby.observe(lease("a", "9"), now=64.9)
    assert standby.next_action(64.9) is Action.WAIT
    standby.observe(lease("a", "9"), now=65.0)
    assert standby.next_action(65.0) is Action.ACQUIRE
    taken = standby.desired("t-now", Action.ACQUIRE)
    assert (taken.holder, taken.transitions, taken.acquire_time) == ("b", 1, "t-now")
    assert taken.resource_version == "9"  # conditional on the version it judged


def test_a_released_lease_is_taken_at_once() -> None:
    leader = leading("a")
    leader.observe(lease("a", "2"), 1.0)
    released = leader.released("t-now")
    assert released is not None
    assert released.holder is None
    assert Election("b", TIMING).released("t") is None  # nothing to release

    standby = Election("b", TIMING)
    standby.observe(released, 1.0)
    assert standby.next_action(1.0) is Action.ACQUIRE
    assert standby.desired("t", Action.ACQUIRE).transitions == 0  # no holder was displaced


def test_a_leader_that_sees_another_holder_stops_writing_at_once() -> None:
    leader = leading("a")
    assert leader.may_write(1.0)
    leader.observe(lease("b", "5", transitions=1), 1.0)
    assert not leader.may_write(1.0)
    assert leader.next_action(1.0) is Action.WAIT  # and never overwrites the new holder


def test_lost_stops_writing() -> None:
    leader = leading("a")
    leader.lost()
    assert leader.deadline is None
    assert not leader.may_write(0.5)


@pytest.mark.parametrize("seed", range(200))
def test_a_paused_leaders_last_write_precedes_the_new_leaders_first(seed: int) -> None:
    """Random renew latencies, a pause at a random time, standby reads at random phases: the
    old leader's fence closes before the standby can take over."""
    rng = random.Random(seed)
    server = lease("a", "0")
    leader = leading("a", at=0.0)
    standby = Election("b", TIMING)
    t, version, paused_at = 0.0, 0, rng.uniform(0, 60)
    # The leader renews every retry period until it pauses; each renew is sent at t and
    # applied by the server somewhere within the request's latency.
    while t + TIMING.retry_period < paused_at:
        t += TIMING.retry_period
        version += 1
        applied = t + rng.uniform(0, 1.5)
        server = lease("a", str(version))
        leader.written(server, sent_at=t)
        # The standby reads between renews, after the server applied this one.
        standby.observe(server, rng.uniform(applied, applied + TIMING.retry_period))
    # Paused: the last moment the fence lets the leader write.
    assert leader.deadline is not None
    last_leader_write = leader.deadline
    standby_read = t
    while True:
        standby_read += rng.uniform(0.1, TIMING.retry_period)
        standby.observe(server, standby_read)
        if standby.next_action(standby_read) is Action.ACQUIRE:
            break
    assert last_leader_write < standby_read, (last_leader_write, standby_read)
    # Resumed after the takeover: every write is refused.
    assert not leader.may_write(standby_read)


class ClockedFence:
    """The fence of a leader elected at 0 (deadline 13), on a clock the test sets."""

    def __init__(self) -> None:
        self.election = leading("a", at=0.0)
        self.now = 1.0

    def check(self) -> None:
        self.election.check(self.now)


def _recording_app(seen: list[str]) -> web.Application:
    async def record(request: web.Request) -> web.Response:
        seen.append(request.method)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    return app


async def test_the_fence_refuses_writes_before_they_are_sent_and_lets_reads_through() -> None:
    seen: list[str] = []
    fence = ClockedFence()
    check = fence.check

    async with (
        serve(_recording_app(seen)) as server,
        aiohttp.ClientSession(middlewares=(WriteFence(check),)) as session,
    ):
        async with session.post(server.url("/v1/loras")) as response:
            assert response.status == 200
        fence.now = 20.0  # past the deadline (13)
        async with session.get(server.url("/v1/loras")) as response:
            assert response.status == 200
        for method in ("POST", "PATCH", "DELETE", "PUT"):
            with pytest.raises(FencedRequest, match="does not hold the Lease"):
                async with session.request(method, server.url("/x")):
                    pass
    assert seen == ["POST", "GET"]


async def test_kopfs_session_holds_at_most_its_bound_of_connections_open() -> None:
    """kopf's session (`kopf_session`, no fence without leader election) opens no more than
    its bound of connections however many requests are in flight; the rest wait their turn."""
    in_flight, most = 0, 0
    release, three = asyncio.Event(), asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        if most == 3:
            three.set()
        await release.wait()
        in_flight -= 1
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", held)
    async with serve(app) as server:
        session = kopf_session(kopf.ConnectionInfo(server=server.url("")), 3, None)
        http = session.aiohttp_session
        try:

            async def patch(i: int) -> int:
                async with http.patch(server.url(f"/x/{i}")) as response:
                    return response.status

            requests = [asyncio.create_task(patch(i)) for i in range(10)]
            await three.wait()  # the server sees the first three
            await asyncio.sleep(0.2)  # and no fourth while they are held
            assert most == 3
            release.set()
            assert await asyncio.gather(*requests) == [200] * 10
        finally:
            await http.close()
    assert most == 3


async def test_the_api_client_refuses_writes_past_the_deadline() -> None:
    seen: list[str] = []
    fence = ClockedFence()
    check = fence.check

    async with serve(_recording_app(seen)) as server:
        api = client.ApiClient(client.Configuration(host=server.url("").rstrip("/")))
        try:
            cluster = Cluster(api, fence=check)
            manifest = {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "s", "namespace": "ns"},
            }
            await cluster.apply(manifest)
            fence.now = 13.0
            with pytest.raises(ApiError, match="NotLeader") as refused:
                await cluster.apply(manifest)
            assert refused.value.retryable
            await cluster.get(SERVICE, "ns", "s")  # reads still go out
        finally:
            await api.close()
    assert seen == ["PATCH", "GET"]


def test_leader_election_needs_a_namespace_for_its_lease() -> None:
    with pytest.raises(ValueError, match="POD_NAMESPACE"):
        OperatorConfig(all_namespaces=True, leader_election=True)
    assert OperatorConfig(namespaces=("a", "b"), leader_election=True).lease_namespace == "a"
    config = OperatorConfig(all_namespaces=True, leader_election=True, operator_namespace="ops")
    assert config.lease_namespace == "ops"
    assert config.election_timing() == Timing(15.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="--lease-duration-seconds"):
        OperatorConfig(namespaces=("a",), leader_election=True, lease_duration_seconds=3)


def test_the_command_line_reaches_the_election() -> None:
    args = cli._parser().parse_args(
        ["run", "-n", "a", "--leader-election", "--lease-name", "x", "--lease-retry-seconds", "1"]
    )
    assert (args.leader_election, args.lease_name, args.lease_retry_seconds) == (True, "x", 1.0)
    assert cli._parser().parse_args(["run", "-n", "a"]).lease_name is None


class _UnreachableStore:
    """A Lease store whose API server answers only when told to (a standby's view of it)."""

    namespace, name = "ops", "dynamo-operator-leader"

    def __init__(self) -> None:
        self.reachable = False

    async def read(self) -> LeaseRecord | None:
        if not self.reachable:
            raise OSError("Cannot connect to host 198.19.0.1:443")
        return lease("a", "1")

    async def write(self, record: LeaseRecord) -> LeaseRecord:
        raise AssertionError("a standby of a held Lease writes nothing")


async def test_a_standby_that_cannot_read_the_lease_is_not_ready() -> None:
    from dynamo_operator.handlers.leadership import Leadership
    from dynamo_operator.metrics import OperatorMetrics

    now = [100.0]
    store = _UnreachableStore()
    standby = Leadership(
        store,  # type: ignore[arg-type]
        Election("b", TIMING),
        OperatorMetrics(),
        clock=lambda: now[0],
    )
    assert standby.standby_problem() is not None  # nothing read yet
    assert not await standby._try_step()
    problem = standby.standby_problem()
    assert problem is not None
    assert "ops/dynamo-operator-leader" in problem
    assert "Cannot connect to host 198.19.0.1:443" in problem
    store.reachable = True
    assert not await standby._try_step()  # held by "a": a standby waits
    assert standby.standby_problem() is None
    # Unreachable again: ready for one Lease duration after the last read, then not.
    store.reachable = False
    now[0] += TIMING.lease_duration
    await standby._try_step()
    assert standby.standby_problem() is None
    now[0] += 1
    assert standby.standby_problem() is not None
