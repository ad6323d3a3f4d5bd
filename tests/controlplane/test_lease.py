"""Leadership through a Lease: the official client against the API emulator, Lease bodies validated.

Two candidates share one Lease; each has its own clock, as two pods would.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from kubernetes import client

from controlplane.config import LeaderElection
from controlplane.lease import LeaseLeadership
from tests.controlplane.apiserver import LEASES, ApiServer

NS = "fleet-system"
SETTINGS = LeaderElection(namespace=NS, lease_duration=15, renew_deadline=10, retry_period=2)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def candidate(api: client.ApiClient, name: str, clock: Clock) -> LeaseLeadership:
    return LeaseLeadership(api, SETTINGS, clock=clock, wall=lambda: 1_796_117_400.0, name=name, timeout=2.0)


def lease(server: ApiServer) -> dict[str, Any]:
    found = server.get(LEASES, NS, "fleet-controlplane")
    assert found is not None
    return dict(found)


async def test_one_leads_the_other_takes_over_after_the_lease_duration(server: ApiServer,
                                                                      api: client.ApiClient) -> None:
    ca, cb = Clock(), Clock(5000.0)  # clocks need not agree
    a, b = candidate(api, "a", ca), candidate(api, "b", cb)
    assert await a.contend() is True  # creates the Lease
    assert await b.contend() is False
    assert lease(server)["spec"]["holderIdentity"] == "a"
    for _ in range(5):  # a renews every retry period; b never gets it
        ca.t += 2
        cb.t += 2
        assert await a.contend() is True
        assert await b.contend() is False
    # a stops (kill -9): nothing renews. b waits the full lease duration from when it last saw a change.
    cb.t += 14
    assert await b.contend() is False
    cb.t += 2
    assert await b.contend() is True
    spec = lease(server)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    # a comes back (it was only paused): its renew deadline passed, so it no longer counts itself leader,
    # and it sees b renewing.
    ca.t += 30
    assert a.leading() is False
    assert await a.contend() is False


async def test_a_leader_that_cannot_renew_steps_down_before_the_lease_expires(server: ApiServer,
                                                                              api: client.ApiClient) -> None:
    clock = Clock()
    a = candidate(api, "a", clock)
    assert await a.contend() is True
    server.fail("GET", "/leases/fleet-controlplane", 500, "etcd timeout", times=10)
    clock.t += 2
    assert await a.contend() is True  # one failed renewal: still within renew_deadline
    clock.t += 8
    assert await a.contend() is False and a.leading() is False  # 10 s without a renewal: it stops acting
    # ... before a follower may take the lease (15 s), so two never act at once.
    assert SETTINGS.renew_deadline < SETTINGS.lease_duration


async def test_of_two_candidates_racing_for_an_expired_lease_one_wins(server: ApiServer,
                                                                      api: client.ApiClient) -> None:
    old = candidate(api, "old", Clock())
    assert await old.contend() is True
    ca, cb = Clock(), Clock()
    a, b = candidate(api, "a", ca), candidate(api, "b", cb)
    assert await a.contend() is False and await b.contend() is False  # both see old
    ca.t += 16
    cb.t += 16
    # Both read the expired lease at once (the reads are held back together), then both write with
    # the version they read: the API server takes the first and refuses the second with a 409.
    server.slow("GET", "/leases/fleet-controlplane", 0.3, times=2)
    results = await asyncio.gather(a.contend(), b.contend())
    assert sorted(results) == [False, True]
    assert lease(server)["spec"]["holderIdentity"] == ("a" if results[0] else "b")
    assert a.leading() + b.leading() == 1


async def test_release_hands_over_at_once(server: ApiServer, api: client.ApiClient) -> None:
    ca, cb = Clock(), Clock()
    a, b = candidate(api, "a", ca), candidate(api, "b", cb)
    assert await a.contend() is True
    assert await b.contend() is False
    await a.release()
    assert a.leading() is False
    assert "holderIdentity" not in lease(server)["spec"]
    assert await b.contend() is True  # no lease duration to wait out


def test_settings_that_would_let_two_replicas_act_at_once_are_refused() -> None:
    with pytest.raises(ValueError, match="renew_deadline .* < lease_duration"):
        LeaderElection(namespace=NS, lease_duration=10, renew_deadline=10, retry_period=2)


async def test_a_fractional_lease_duration_is_written_rounded_up(server: ApiServer, api: client.ApiClient) -> None:
    # The Lease holds whole seconds; truncating 10.9 s to 10 would let a follower take over while the
    # leader, renewing within 10.5 s, still counted itself leader.
    s = LeaderElection(namespace=NS, lease_duration=10.9, renew_deadline=10.5, retry_period=2)
    ca, cb = Clock(), Clock()
    a = LeaseLeadership(api, s, clock=ca, wall=lambda: 1_796_117_400.0, name="a", timeout=2.0)
    b = LeaseLeadership(api, s, clock=cb, wall=lambda: 1_796_117_400.0, name="b", timeout=2.0)
    assert await a.contend() is True
    assert lease(server)["spec"]["leaseDurationSeconds"] == 11
    assert await b.contend() is False
    ca.t += 10.2
    cb.t += 10.2
    assert a.leading() is True
    assert await b.contend() is False, "a follower took over while the leader still led"


async def test_a_renewal_seen_through_a_slow_read_is_dated_when_the_read_returned(server: ApiServer,
                                                                                  api: client.ApiClient) -> None:
    ca, cb = Clock(), Clock(5000.0)
    a, b = candidate(api, "a", ca), candidate(api, "b", cb)
    assert await a.contend() is True
    assert await b.contend() is False
    read = b._api.read_namespaced_lease

    def slow_read(*args: Any, **kwargs: Any) -> Any:
        cb.t += 10  # the read takes 10 s, and the leader renews meanwhile
        renewed = lease(server)
        renewed["spec"]["renewTime"] = "2026-12-01T10:00:12.000000Z"
        server.put(LEASES, renewed)
        return read(*args, **kwargs)

    cb.t += 4
    b._api.read_namespaced_lease = slow_read  # type: ignore[method-assign]
    assert await b.contend() is False  # sent at 5004, answered at 5014 with the renewal
    b._api.read_namespaced_lease = read  # type: ignore[method-assign]
    # The leader stops renewing. Its renewal landed up to 5014 on b's clock, so it may lead until 5024: b waits
    # the lease's duration from 5014, not from when it sent the read.
    cb.t = 5020.0
    assert await b.contend() is False
    cb.t = 5030.0
    assert await b.contend() is True


async def test_a_deleted_lease_is_not_a_free_one_while_its_holder_may_still_act(server: ApiServer,
                                                                               api: client.ApiClient) -> None:
    ca, cb = Clock(), Clock(5000.0)
    a, b = candidate(api, "a", ca), candidate(api, "b", cb)
    assert await a.contend() is True and await b.contend() is False
    server.objects[LEASES, NS, "fleet-controlplane"].delete()  # kubectl delete, a prune
    cb.t += 2
    assert await b.contend() is False, "a renewed 2 s ago and may act until it reads the lease gone"
    assert a.leading() is True
    cb.t += 14
    assert await b.contend() is True  # a's lease would have run out by now: b creates it and leads
    ca.t += 16
    assert a.leading() is False and await a.contend() is False
    assert lease(server)["spec"]["holderIdentity"] == "b"


async def test_a_leader_that_finds_its_lease_gone_steps_down_before_it_takes_it_again(server: ApiServer,
                                                                                     api: client.ApiClient) -> None:
    ca = Clock()
    a = candidate(api, "a", ca)
    assert await a.contend() is True
    server.objects[LEASES, NS, "fleet-controlplane"].delete()
    ca.t += 2
    server.fail("POST", "/leases", 409, "already exists")  # another candidate created it first
    assert await a.contend() is False and a.leading() is False


async def test_each_time_a_replica_comes_to_lead_is_a_new_term(server: ApiServer, api: client.ApiClient) -> None:
    """The loop takes over again in a new term: another replica may have led and acted in between."""
    ca, cb = Clock(), Clock()
    a, b = candidate(api, "a", ca), candidate(api, "b", cb)
    assert await a.contend() is True and a.term == 1
    ca.t += 2
    assert await a.contend() is True and a.term == 1, "a renewal is the same term"
    ca.t += 11  # its renewals failed past the renew deadline: it stopped leading, though nobody took the Lease
    assert not a.leading()
    assert await a.contend() is True and a.term == 2
    await a.release()
    assert await b.contend() is True and b.term == 1
    await b.release()
    assert await a.contend() is True and a.term == 3


async def test_a_release_held_up_in_flight_does_not_free_the_lease_of_the_next_holder(
        server: ApiServer, api: client.ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    ca, cb, cc = Clock(), Clock(), Clock()
    a, b, c = candidate(api, "a", ca), candidate(api, "b", cb), candidate(api, "c", cc)
    assert await a.contend() is True
    assert await b.contend() is False and await c.contend() is False
    sent, deliver = threading.Event(), threading.Event()
    patch = a._api.patch_namespaced_lease

    def held_up(*args: Any, **kwargs: Any) -> Any:
        if args[2]["spec"].get("holderIdentity", "") is None:  # the release
            sent.set()
            deliver.wait(10)
        return patch(*args, **kwargs)

    monkeypatch.setattr(a._api, "patch_namespaced_lease", held_up)
    releasing = asyncio.create_task(a.release())  # sent while a leads
    await asyncio.to_thread(sent.wait, 10)
    cb.t += 16  # b waits the lease out and takes it meanwhile
    assert await b.contend() is True
    deliver.set()
    await releasing
    assert lease(server)["spec"]["holderIdentity"] == "b"
    assert await c.contend() is False, "one leader at a time"


async def test_a_release_after_a_renewal_whose_answer_was_lost_hands_the_lease_over(server: ApiServer,
                                                                                   api: client.ApiClient) -> None:
    """The renewal was stored and its answer lost to the timeout: the release, on the version before it, was refused
    (409) and the Lease stayed with the stopped leader until its duration ran out."""
    ca, cb = Clock(), Clock(5000.0)
    a = LeaseLeadership(api, SETTINGS, clock=ca, wall=lambda: 1_796_117_400.0, name="a", timeout=1.0)
    b = candidate(api, "b", cb)
    assert await a.contend() is True and await b.contend() is False
    server.slow("PATCH", "/leases/fleet-controlplane", 2.0, stored=True)
    ca.t += 2
    assert await a.contend() is True  # one renewal failed: it still leads
    await a.release()
    await asyncio.sleep(1.2)  # the held-up answer goes out
    assert not lease(server)["spec"].get("holderIdentity")
    assert await b.contend() is True


def _serving_config() -> Any:
    from controlplane.config import parse_config
    from controlplane.lab.engine import free_port

    return parse_config(f"mode: act\nscrape: {{interval: 1s, timeout: 500ms, spread: 100ms}}\n"
                        f"server: {{port: {free_port()}}}\n"
                        "pools: [{name: prefill, role: prefill, model: m, replicas: {min: 1, max: 8}}]\n")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # sockets of calls left mid-flight
async def test_a_stop_during_a_take_over_leaves_the_lease_to_no_stopped_replica(server: ApiServer,
                                                                                api: client.ApiClient,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while a take-over was in flight cancelled the task, not the write in its thread: the write landed after
    the release, and the next replica waited out the lease of one that had stopped (a rolling update's)."""
    import httpx

    from controlplane.runtime import Acting, _serve
    from controlplane.store.memory import MemoryStore

    fast = LeaderElection(namespace=NS, lease_duration=15, renew_deadline=10, retry_period=0.3)
    x, b, c = (LeaseLeadership(api, fast, name=n, timeout=2.0) for n in "xbc")
    assert await x.contend() is True and await c.contend() is False
    sent, deliver = threading.Event(), threading.Event()
    patch = b._api.patch_namespaced_lease

    def held(*args: Any, **kwargs: Any) -> Any:  # b's take-over waits in flight until delivered
        if args[2]["spec"].get("holderIdentity") == "b":
            sent.set()
            deliver.wait(10)
        return patch(*args, **kwargs)

    monkeypatch.setattr(b._api, "patch_namespaced_lease", held)
    stop = asyncio.Event()
    async with httpx.AsyncClient() as http:
        serving = asyncio.create_task(_serve(_serving_config(), MemoryStore(), http, None, Acting(leadership=b), stop,
                                             False, None))
        for _ in range(100):
            if b._observed is not None:
                break
            await asyncio.sleep(0.05)
        await x.release()
        await asyncio.to_thread(sent.wait, 5)
        stop.set()
        await asyncio.wait({serving}, timeout=1.0)
        deliver.set()
        await asyncio.wait_for(serving, 10)
        await asyncio.sleep(0.5)
    assert lease(server)["spec"].get("holderIdentity") != "b"
    assert await c.contend() is True
