"""The control plane's HTTP server: /metrics, /healthz, /readyz and the small JSON API, in the loop's event loop.

Binds to 127.0.0.1 unless configured otherwise. `GET /api/status` reports the mode and the
loop's health; `POST /api/actions/<id>/approve|reject` decides a proposal in `propose` mode.
Writes need the bearer token from FLEETCTL_API_TOKEN and are refused while it is unset, so a
control plane started without one exposes nothing that changes the fleet. Later capabilities
(gate and alert endpoints) add handlers here.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from typing import Any

import tornado.httpserver
import tornado.web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.errors import ActionConflict, ActionNotFound, FleetError
from controlplane.loop import ControlLoop

__all__ = ["TOKEN_ENV", "start_server"]

log = logging.getLogger(__name__)

TOKEN_ENV = "FLEETCTL_API_TOKEN"
MAX_NAME = 255


def _health(loop: ControlLoop) -> tuple[bool, dict[str, Any]]:
    """(ready, report): ready once a tick completed within three scrape intervals; a follower is ready on standby."""
    if not loop.leading():
        return True, {"status": "standby", "reason": "another replica leads"}
    last = loop.last_tick_at
    interval = loop.config.scrape.interval
    if last is None:
        return False, {"status": "starting", "reason": "no tick has completed yet"}
    age = loop.clock.now() - last
    if age > 3 * interval:
        return False, {"status": "stalled", "reason": f"last tick {age:.0f}s ago (interval {interval:g}s)"}
    return True, {"status": "ready", "last_tick_age_s": round(age, 3)}


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
        ready, report = _health(self.loop)
        if not ready:
            self.set_status(503)
        self.write(report)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.write({"status": "error", "code": status_code})


class _Json(tornado.web.RequestHandler):
    """JSON answers, errors included."""

    def initialize(self, loop: ControlLoop, token: str | None) -> None:
        self.loop = loop
        self.token = token

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.finish({"error": self._reason, "code": status_code})

    def fail(self, status: int, message: str) -> None:
        self.set_status(status)
        self.finish({"error": message, "code": status})


class _Status(_Json):
    def get(self) -> None:
        ready, report = _health(self.loop)
        self.write({"mode": str(self.loop.config.mode), "ready": ready, **report, "leading": self.loop.leading(),
                    "last_tick_at": self.loop.last_tick_at, "interval_s": self.loop.config.scrape.interval,
                    "pools": [p.name for p in self.loop.config.pools], "writes_enabled": self.token is not None})


class _Decide(_Json):
    """Approve or reject a proposed action, as `fleetctl actions approve|reject ID` does."""

    async def post(self, action_id: str, verb: str) -> None:
        if self.token is None:
            self.fail(403, f"writes are disabled: set {TOKEN_ENV} where the control plane runs to enable them")
            return
        header = self.request.headers.get("Authorization", "")
        given = header[7:] if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            self.set_header("WWW-Authenticate", 'Bearer realm="fleetctl"')
            self.fail(401, "missing or wrong bearer token")
            return
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            self.fail(400, "the body is not JSON")
            return
        by = body.get("by") if isinstance(body, dict) else None
        if not isinstance(by, str) or not by.strip() or len(by) > MAX_NAME:
            self.fail(400, f'the body must be {{"by": NAME}} with a name of 1 to {MAX_NAME} characters')
            return
        by = by.strip()
        aid = int(action_id)
        try:
            action = await self.loop.store.decide(aid, approve=verb == "approve", by=by, now=self.loop.clock.now(),
                                                  via="api")
        except ActionNotFound:
            self.fail(404, f"no action {aid}")
            return
        except ActionConflict as exc:
            self.fail(409, f"action {aid} is not awaiting approval (it is {exc.current})")
            return
        except FleetError as exc:
            self.fail(503, f"the store refused: {exc}")
            return
        log.info("action %d %s by %s through the API", aid, action.state, by)
        self.write({"id": aid, "state": str(action.state), "by": by})


def start_server(loop: ControlLoop, host: str, port: int, *, token: str | None = None) -> tornado.httpserver.HTTPServer:
    """Start serving on the running asyncio loop; returns the server (call `.stop()` to end).

    `token` guards the write endpoints; without one it is read from FLEETCTL_API_TOKEN, and
    with neither every write is refused.
    """
    token = token or os.environ.get(TOKEN_ENV) or None
    api = {"loop": loop, "token": token}
    app = tornado.web.Application(
        [
            (r"/metrics", _Metrics, {"loop": loop}),
            (r"/healthz", _Healthz),
            (r"/readyz", _Readyz, {"loop": loop}),
            (r"/api/status", _Status, api),
            (r"/api/actions/([0-9]+)/(approve|reject)", _Decide, api),
        ]
    )
    server = tornado.httpserver.HTTPServer(app)
    server.listen(port, address=host)
    return server
