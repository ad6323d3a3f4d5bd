"""Loopback HTTP for the simulated fleet: every engine serves its exporters on ports of its own.

Per engine: vLLM's `/metrics`; dcgm-exporter's for its GPUs; for decode workers, NIXL's
telemetry exporter. Bodies are rendered at each `sync()` (the loop's tick), so a scrape reads
the fleet as it stood at that simulated time, whatever the wall clock says.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from collectors.types import Target
from controlplane.sim.exporters import render_dcgm, render_nixl, render_vllm
from controlplane.sim.fleet import Member, SimFleet

__all__ = ["SimServer", "SimTargets"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Handler(BaseHTTPRequestHandler):
    server: _ExporterServer

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


class _ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    body: bytes = b""


class _Endpoint:
    def __init__(self, host: str, name: str) -> None:
        self.server = _ExporterServer((host, 0), _Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/metrics"
        # A short poll interval lets shutdown() return at once instead of after 0.5 s per endpoint.
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       name=f"sim-{name}", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class SimServer:
    """Keeps each up engine's exporters served, in step with the fleet."""

    def __init__(self, fleet: SimFleet, host: str = "127.0.0.1", *, gpu: bool = True, nixl: bool = True) -> None:
        self.fleet = fleet
        self.host = host
        self.sources = ("vllm", *(("dcgm",) if gpu else ()), *(("nixl",) if nixl else ()))
        self._served: dict[int, tuple[Member, dict[str, _Endpoint]]] = {}

    def sync(self) -> None:
        """Serve newly started engines, stop removed ones, publish fresh expositions."""
        live = {id(m): m for m in self.fleet.serving()}
        for key in list(self._served):
            if key not in live:
                self._stop(key)
        model = self.fleet.spec.model
        for key, m in live.items():
            if key not in self._served:
                sources = [s for s in self.sources if s != "nixl" or m.role == "decode"]
                endpoints = {s: _Endpoint(self.host, f"{m.pod}-{s}") for s in sources}
                m.urls = {s: ep.url for s, ep in endpoints.items()}
                self._served[key] = (m, endpoints)
            endpoints = self._served[key][1]
            endpoints["vllm"].server.body = render_vllm(m, model)
            if "dcgm" in endpoints:
                endpoints["dcgm"].server.body = render_dcgm(m)
            if "nixl" in endpoints:
                endpoints["nixl"].server.body = render_nixl(m)

    def targets(self) -> list[Target]:
        """Scrape targets for every served exporter."""
        out = []
        for m, endpoints in sorted(self._served.values(), key=lambda v: (v[0].pool, v[0].pod)):
            for source, ep in endpoints.items():
                out.append(Target(url=ep.url, pool=m.pool, pod=m.pod, role=m.role, source=source))
        return out

    def _stop(self, key: int) -> None:
        m, endpoints = self._served.pop(key)
        for ep in endpoints.values():
            ep.close()
        m.urls = {}

    def close(self) -> None:
        """Stop every server."""
        for key in list(self._served):
            self._stop(key)


class SimTargets:
    """The simulated fleet as a target source."""

    stale = False

    def __init__(self, server: SimServer) -> None:
        self._server = server

    async def targets(self) -> Sequence[Target]:
        return self._server.targets()
