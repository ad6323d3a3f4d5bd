"""The control plane's JSON API over real HTTP: status, and approving or rejecting proposals.

The loop runs in `propose` mode against the simulated fleet in virtual time until the prefix-cache
policy proposes scaling prefill; the proposal is then decided through the API, and the next tick
acts on an approval. Writes need the bearer token and are refused without one configured.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from controlplane.actions import ActionState
from controlplane.clock import VirtualClock
from controlplane.config import Mode
from controlplane.demo import demo_config
from controlplane.lab.engine import free_port
from controlplane.loop import ControlLoop
from controlplane.runtime import build_loop
from controlplane.server import start_server
from controlplane.sim.actuator import SimActuator
from controlplane.sim.fleet import SimFleet
from controlplane.sim.routing import RouterKind as Router
from controlplane.sim.server import SimServer, SimTargets
from controlplane.store.queries import ReadStore
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore

TOKEN = "s3cret-token-for-tests"




class Api:
    """A propose-mode loop with its HTTP server on a free port."""

    def __init__(self, loop: ControlLoop, store: SqlStore, fleet: SimFleet, server: SimServer, clock: VirtualClock,
                 base: str) -> None:
        self.loop, self.store, self.fleet, self.server, self.clock, self.base = loop, store, fleet, server, clock, base

    async def ticks(self, n: int) -> None:
        for _ in range(n):
            self.clock.advance(self.loop.config.scrape.interval)
            self.fleet.advance_to(self.clock.now())
            self.server.sync()
            await self.loop.tick()

    async def proposal(self) -> int:
        """Break the router until the policy proposes; the proposal's id."""
        await self.ticks(20)
        self.fleet.set_router(Router.ROUND_ROBIN)
        await self.ticks(4)
        [proposal] = self.store.actions(states=[ActionState.PROPOSED])
        return proposal.id


async def _api(sim: tuple, store: SqlStore, token: str | None) -> AsyncIterator[Api]:
    fleet, sim_server, clock = sim
    cfg = demo_config(str(store.engine.url)).model_copy(update={"mode": Mode.PROPOSE})
    async with httpx.AsyncClient(timeout=2.0) as scrape:
        loop = build_loop(cfg, ThreadedStore(store), scrape, targets=SimTargets(sim_server), actuator=SimActuator(fleet),
                          clock=clock)
        await loop.start()
        port = free_port()
        http = start_server(loop, "127.0.0.1", port, token=token)
        try:
            yield Api(loop, store, fleet, sim_server, clock, f"http://127.0.0.1:{port}")
        finally:
            http.stop()


@pytest.fixture
async def api(sim: tuple, sqlite_store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Api]:
    monkeypatch.delenv("FLEETCTL_API_TOKEN", raising=False)
    async for a in _api(sim, sqlite_store, TOKEN):
        yield a


@pytest.fixture
async def readonly_api(sim: tuple, sqlite_store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Api]:
    monkeypatch.delenv("FLEETCTL_API_TOKEN", raising=False)
    async for a in _api(sim, sqlite_store, None):
        yield a


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_status_reports_mode_health_and_whether_writes_are_enabled(api: Api) -> None:
    async with httpx.AsyncClient(base_url=api.base) as c:
        before = (await c.get("/api/status")).json()
        await api.ticks(1)
        after = (await c.get("/api/status")).json()
    assert before["mode"] == "propose" and before["ready"] is False and before["status"] == "starting"
    assert after["ready"] is True and after["status"] == "ready" and after["writes_enabled"] is True
    assert after["pools"] == ["prefill", "decode"]


async def test_approve_through_the_api_and_the_loop_acts(api: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    aid = await api.proposal()
    assert api.fleet.router_kind is Router.ROUND_ROBIN
    async with httpx.AsyncClient(base_url=api.base) as c:
        r = await c.post(f"/api/actions/{aid}/approve", json={"by": "alice"}, headers=auth())
        assert r.status_code == 200, r.text
        assert r.json() == {"id": aid, "state": "approved", "by": "alice"}
        again = await c.post(f"/api/actions/{aid}/approve", json={"by": "alice"}, headers=auth())
        assert again.status_code == 409 and "not awaiting approval (it is approved)" in again.json()["error"]
        huge = await c.post(f"/api/actions/{2**64}/approve", json={"by": "alice"}, headers=auth())
        assert huge.status_code == 404 and f"no action {2**64}" in huge.json()["error"], "no 500 past what a store holds"
        endless = await c.post(f"/api/actions/{'9' * 5000}/approve", json={"by": "alice"}, headers=auth())
        assert endless.status_code == 404
    [action] = api.store.actions()
    assert action.state == "approved"
    await api.ticks(1)
    assert api.fleet.router_kind is Router.CACHE_AWARE, "the router was rolled back"
    assert api.store.actions()[0].state == "succeeded"
    # The audit log names who approved, and that it came through the API.
    approved = [e for e in ReadStore(api.store.engine).action_events(aid) if e["event"] == "approved"]
    assert approved[0]["detail"] == {"by": "alice", "via": "api"}
    assert TOKEN not in caplog.text


async def test_a_proposal_past_its_time_to_live_is_refused_as_expired_before_a_tick_marks_it(api: Api) -> None:
    """Approved between its time to live and the next tick, the API answered 200 and the tick expired it; a revert so
    approved would have run under revert_ttl after all."""
    aid = await api.proposal()
    api.clock.advance(api.loop.config.rails.proposal_ttl)  # no tick since
    async with httpx.AsyncClient(base_url=api.base) as c:
        r = await c.post(f"/api/actions/{aid}/approve", json={"by": "alice"}, headers=auth())
    assert r.status_code == 409 and "(it is expired)" in r.json()["error"]
    assert api.store.actions()[0].state == "proposed"


async def test_reject_through_the_api(api: Api) -> None:
    aid = await api.proposal()
    async with httpx.AsyncClient(base_url=api.base) as c:
        r = await c.post(f"/api/actions/{aid}/reject", json={"by": "bob"}, headers=auth())
    assert r.status_code == 200 and r.json()["state"] == "rejected"
    await api.ticks(1)
    assert api.fleet.router_kind is Router.ROUND_ROBIN
    [action] = api.store.actions()
    assert action.state == "rejected"


async def test_writes_need_the_right_token_and_a_name(api: Api) -> None:
    aid = await api.proposal()
    async with httpx.AsyncClient(base_url=api.base) as c:
        missing = await c.post(f"/api/actions/{aid}/approve", json={"by": "eve"})
        wrong = await c.post(f"/api/actions/{aid}/approve", json={"by": "eve"}, headers=auth("guess"))
        basic = await c.post(f"/api/actions/{aid}/approve", json={"by": "eve"}, headers={"Authorization": f"Basic {TOKEN}"})
        no_name = await c.post(f"/api/actions/{aid}/approve", json={}, headers=auth())
        not_json = await c.post(f"/api/actions/{aid}/approve", content=b"by=eve", headers=auth())
        unknown = await c.post("/api/actions/999/approve", json={"by": "eve"}, headers=auth())
        bad_verb = await c.post(f"/api/actions/{aid}/delete", json={"by": "eve"}, headers=auth())
        forged = await c.post(f"/api/actions/{aid}/approve", json={"by": "eve\nINFO action 1 approved by bob"},
                              headers=auth())
        deep = await c.post(f"/api/actions/{aid}/approve", content=b"[" * 20_000, headers=auth())
        # Valid JSON, no text: once a 500 with a traceback wherever it was encoded (a gate's selector, its pool).
        surrogate = await c.post(f"/api/actions/{aid}/approve", content=b'{"by": "\\ud800"}', headers=auth())
        gate = await c.post("/api/v1/gate", content=b'{"pool": "\\ud800", "baseline": "pod=a", "canary": "pod=b"}')
    assert missing.status_code == wrong.status_code == basic.status_code == 401
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert no_name.status_code == not_json.status_code == forged.status_code == deep.status_code == 400
    assert surrogate.status_code == gate.status_code == 400
    assert unknown.status_code == 404
    assert bad_verb.status_code == 404
    assert TOKEN not in missing.text + wrong.text + no_name.text
    [action] = api.store.actions()
    assert action.state == "proposed"


async def test_without_a_configured_token_every_write_is_refused(readonly_api: Api) -> None:
    aid = await readonly_api.proposal()
    async with httpx.AsyncClient(base_url=readonly_api.base) as c:
        status = (await c.get("/api/status")).json()
        r = await c.post(f"/api/actions/{aid}/approve", json={"by": "alice"}, headers=auth())
    assert status["writes_enabled"] is False
    assert r.status_code == 403 and "FLEETCTL_API_TOKEN" in r.json()["error"]
    [action] = readonly_api.store.actions()
    assert action.state == "proposed"


async def test_the_token_comes_from_the_environment(sim: tuple, sqlite_store: SqlStore,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # As a Secret made from a file holds it: with its newline, which no client can send, every write got 401.
    monkeypatch.setenv("FLEETCTL_API_TOKEN", TOKEN + "\n")
    async for a in _api(sim, sqlite_store, None):
        aid = await a.proposal()
        async with httpx.AsyncClient(base_url=a.base) as c:
            r = await c.post(f"/api/actions/{aid}/approve", json={"by": "carol"}, headers=auth())
        assert r.status_code == 200


async def test_a_leader_whose_tick_hangs_fails_its_liveness_probe(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick stuck on a hung store query holds the Lease while nothing acts: restarted, the pod lets another lead."""
    import asyncio

    hung = asyncio.Event()

    async def observe_hanging(*_: object) -> None:
        await hung.wait()

    monkeypatch.setattr(api.loop, "_observe", observe_hanging)
    tick = asyncio.ensure_future(api.loop.tick())
    async with httpx.AsyncClient(base_url=api.base) as c:
        await asyncio.sleep(0.05)
        assert (await c.get("/healthz")).status_code == 200  # a tick in progress is no fault
        api.clock.advance(301.0)
        stuck = await c.get("/healthz")
        assert stuck.status_code == 503 and stuck.json()["status"] == "stuck"
        hung.set()
        with contextlib.suppress(Exception):
            await tick
        assert (await c.get("/healthz")).json() == {"status": "ok"}
