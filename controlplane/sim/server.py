"""Loopback HTTP: every ready simulated engine serves its `/metrics` on a port of its own."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from collectors.types import Target
from controlplane.actuators.base import PoolReplicas
from controlplane.sim.fleet import SimEngine, SimFleet
from controlplane.sim.metrics import render

__all__ = ["SimActuator", "SimServer", "SimTargets"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Handler(BaseHTTPRequestHandler):
    server: _EngineServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        body = self.server.body
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # scrapes every tick would flood stderr


class _EngineServer(ThreadingHTTPServer):
    daemon_threads = True
    body: bytes = b""


class SimServer:
    """Keeps one loopback server per ready engine, in step with the fleet."""

    def __init__(self, fleet: SimFleet, host: str = "127.0.0.1") -> None:
        self.fleet = fleet
        self.host = host
        self._servers: dict[int, tuple[SimEngine, _EngineServer, threading.Thread]] = {}

    def sync(self) -> None:
        """Start servers for newly ready engines, stop removed ones, publish fresh expositions."""
        live = {id(e): e for pool in self.fleet.engines for e in self.fleet.ready(pool)}
        for key in list(self._servers):
            if key not in live:
                self._stop(key)
        for key, engine in live.items():
            if key not in self._servers:
                srv = _EngineServer((self.host, 0), _Handler)
                engine.url = f"http://{self.host}:{srv.server_address[1]}/metrics"
                # A short poll interval lets shutdown() return at once instead of after 0.5 s per engine.
                thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02},
                                          name=f"sim-{engine.pod}", daemon=True)
                thread.start()
                self._servers[key] = (engine, srv, thread)
            self._servers[key][1].body = render(engine)

    def targets(self) -> list[Target]:
        """Scrape targets for every served engine."""
        return [
            Target(url=e.url or "", pool=e.pool, pod=e.pod, role=e.role)
            for e, _, _ in sorted(self._servers.values(), key=lambda v: (v[0].pool, v[0].pod))
        ]

    def _stop(self, key: int) -> None:
        engine, srv, thread = self._servers.pop(key)
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)
        engine.url = None

    def close(self) -> None:
        """Stop every server."""
        for key in list(self._servers):
            self._stop(key)


class SimTargets:
    """The simulated fleet as a target source."""

    def __init__(self, server: SimServer) -> None:
        self._server = server

    async def targets(self) -> Sequence[Target]:
        return self._server.targets()


class SimActuator:
    """Scales pools of the simulated fleet."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet

    async def observe(self) -> dict[str, PoolReplicas]:
        return {
            pool: PoolReplicas(self.fleet.desired[pool], len(self.fleet.ready(pool)))
            for pool in self.fleet.engines
        }

    async def scale(self, pool: str, replicas: int) -> None:
        self.fleet.scale(pool, replicas)
