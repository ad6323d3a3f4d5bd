"""The control plane's HTTP server: /metrics, /healthz and /readyz, in the loop's event loop.

Binds to 127.0.0.1 unless configured otherwise. Later capabilities (gate and alert endpoints)
add handlers here.
"""

from __future__ import annotations

from typing import Any

import tornado.httpserver
import tornado.web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.loop import ControlLoop

__all__ = ["start_server"]


class _Metrics(tornado.web.RequestHandler):
    def initialize(self, loop: ControlLoop) -> None:
        self.loop = loop

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.write(generate_latest(self.loop.telemetry.registry))


class _Healthz(tornado.web.RequestHandler):
    def get(self) -> None:
        self.write({"status": "ok"})


class _Readyz(tornado.web.RequestHandler):
    def initialize(self, loop: ControlLoop) -> None:
        self.loop = loop

    def get(self) -> None:
        last = self.loop.last_tick_at
        interval = self.loop.config.scrape.interval
        if last is None:
            self.set_status(503)
            self.write({"status": "starting", "reason": "no tick has completed yet"})
            return
        age = self.loop.clock.now() - last
        if age > 3 * interval:
            self.set_status(503)
            self.write({"status": "stalled", "reason": f"last tick {age:.0f}s ago (interval {interval:g}s)"})
            return
        self.write({"status": "ready", "last_tick_age_s": round(age, 3)})

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.write({"status": "error", "code": status_code})


def start_server(loop: ControlLoop, host: str, port: int) -> tornado.httpserver.HTTPServer:
    """Start serving on the running asyncio loop; returns the server (call `.stop()` to end)."""
    app = tornado.web.Application(
        [
            (r"/metrics", _Metrics, {"loop": loop}),
            (r"/healthz", _Healthz),
            (r"/readyz", _Readyz, {"loop": loop}),
        ]
    )
    server = tornado.httpserver.HTTPServer(app)
    server.listen(port, address=host)
    return server
