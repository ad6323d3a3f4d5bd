"""The lab's router and phase probe against stand-in engines (no vLLM): an unreachable engine is passed over,
one engine's slowness stays its own, an answer the client never got is no success, and a dead engine or a
slow model build ends the lab with a message naming it."""

from __future__ import annotations

import asyncio
import functools
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import tornado.netutil
import tornado.web
from tornado.httpserver import HTTPServer

import controlplane.lab.lab as lab_mod
from collectors.types import Target
from controlplane.lab.engine import ensure_model
from controlplane.lab.lab import Lab, LabError, LabSettings, _PhaseProbe
from controlplane.lab.router import RoutePolicy, Router, Upstream


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve(handler: type[tornado.web.RequestHandler]) -> tuple[HTTPServer, str]:
    sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
    server = HTTPServer(tornado.web.Application([(r"/v1/completions", handler)]))
    server.add_sockets(sockets)
    return server, f"http://127.0.0.1:{sockets[0].getsockname()[1]}"


def answering(delay_s: float = 0.0, events: int = 0) -> type[tornado.web.RequestHandler]:
    class Engine(tornado.web.RequestHandler):
        async def post(self) -> None:
            await asyncio.sleep(delay_s)
            for i in range(events):  # a streamed answer, one event at a time
                self.write(f"data: {i}\n\n")
                await self.flush()
                await asyncio.sleep(0.1)
            self.write({"choices": [{"text": "x"}]})

    return Engine


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., object]]:
    servers: list[HTTPServer] = []

    async def start(**kw: float) -> str:
        server, url = await serve(answering(**kw))  # type: ignore[arg-type]
        servers.append(server)
        return url

    yield start
    for s in servers:
        s.stop()
        await s.close_all_connections()


@pytest.mark.parametrize("policy", list(RoutePolicy))
async def test_an_unreachable_engine_is_passed_over(engines: Callable[..., object], policy: RoutePolicy) -> None:
    # Kept in the ranking, a refused engine won its keys (or every other turn) back at once: half the traffic 502.
    live = await engines()  # type: ignore[misc]
    router = await Router([Upstream("vllm-0", live), Upstream("vllm-1", f"http://127.0.0.1:{closed_port()}")],
                          policy).start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            codes = [(await client.post(f"{router.url}/v1/completions", json={"prompt": f"prompt {i} " * 50})).status_code
                     for i in range(40)]
    finally:
        await router.close()
    assert sum(c != 200 for c in codes) <= 1 and router.stats["vllm-1"].errors <= 1


async def test_a_slow_engine_does_not_hold_up_requests_for_another(engines: Callable[..., object]) -> None:
    # One pool for all: the slow engine's requests held every connection, the fast engine's queued behind them.
    fast, slow = await engines(), await engines(delay_s=2.0)  # type: ignore[misc]
    router = await Router([Upstream("fast", fast), Upstream("slow", slow)], RoutePolicy.ROUND_ROBIN).start()

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, float]:
        t0 = time.monotonic()
        r = await client.post(f"{router.url}/v1/completions", json={"prompt": f"p{i}"})
        return r.headers["x-routed-to"], time.monotonic() - t0

    try:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
            results = await asyncio.gather(*(one(client, i) for i in range(40)))
    finally:
        await router.close()
    assert max(t for name, t in results if name == "fast") < 1.0


async def test_a_stream_the_client_left_is_an_error_not_a_success(engines: Callable[..., object]) -> None:
    url = await engines(events=10)  # type: ignore[misc]
    router = await Router([Upstream("vllm-0", url)], RoutePolicy.ROUND_ROBIN).start()
    try:
        async with httpx.AsyncClient(timeout=10) as client, \
                client.stream("POST", f"{router.url}/v1/completions", json={"prompt": "x", "stream": True}) as resp:
            async for _ in resp.aiter_raw():
                break  # the client goes away after the first event
        for _ in range(40):
            await asyncio.sleep(0.05)
            if router.stats["vllm-0"].in_flight == 0:
                break
    finally:
        await router.close()
    st = router.stats["vllm-0"]
    assert (st.in_flight, st.ok, st.errors) == (0, 0, 1)


async def test_an_engine_that_stops_answering_is_named() -> None:
    # Once a raw httpx error: exit 70, a traceback, and the phases measured so far lost.
    dead = Target(url=f"http://127.0.0.1:{closed_port()}/metrics", pool="lab", pod="vllm-1")
    async with httpx.AsyncClient(timeout=2.0) as client:
        with pytest.raises(LabError, match="engine vllm-1 .* stopped answering"):
            await _PhaseProbe(client, [dead], "lab").settle(answered=1, timeout_s=0.5)


async def test_a_model_build_past_its_time_is_a_lab_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".fleet-vllm-lab").write_text("")
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexec sleep 30\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(lab_mod, "ensure_model", functools.partial(ensure_model, timeout_s=0.5))
    lab = Lab(LabSettings(venv=venv, model_dir=tmp_path / "model", log_dir=tmp_path / "logs"))
    try:
        with pytest.raises(LabError, match="did not finish within 0.5s"):
            await lab.start()
    finally:
        await lab.close()
