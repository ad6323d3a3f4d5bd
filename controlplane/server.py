"""The control plane's HTTP server: /metrics, /healthz, /readyz and the small JSON API, in the loop's event loop.

Binds to 127.0.0.1 unless configured otherwise. `GET /api/status` reports the mode and the
loop's health; `POST /api/actions/<id>/approve|reject` decides a proposal in `propose` mode.
Writes need the bearer token from FLEETCTL_API_TOKEN and are refused while it is unset, so a
control plane started without one exposes nothing that changes the fleet.

The canary gate: `GET|POST /api/v1/gate?pool=&baseline=&canary=[&revision=]` answers the verdict now
as JSON (Argo Rollouts' web metric provider reads `$.result`; asked again after a silence once failed, as
a retried rollout of the same revision asks, it judges a new run); `POST /api/v1/gate/flagger/rollback`
and `.../promotion` take Flagger's webhook payload (selectors in its `metadata`) and answer 200 when
Flagger should roll back (the gate failed) or promote (it passed), 403 otherwise. They change
nothing in the fleet, so by default they need no token (Flagger's webhooks cannot send one) and the
deployment's NetworkPolicy decides who reaches them; with FLEETCTL_GATE_TOKEN set (Argo Rollouts'
web metric sends headers) they need it as their bearer token.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import tornado.httpserver
import tornado.web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from catalog.redaction import env_secret
from controlplane.errors import ActionConflict, ActionNotFound, FleetError, GateError, GateInputError
from controlplane.gate import ArmSelector, GateBook, GateKey, StoreGateSource
from controlplane.loop import ControlLoop
from controlplane.store.records import MAX_ID, MAX_NAME
from policies.canary import GateSettings, MetricRule, Outcome, Verdict

__all__ = ["GATE_TOKEN_ENV", "TOKEN_ENV", "start_server", "store_gates"]

log = logging.getLogger(__name__)

TOKEN_ENV = "FLEETCTL_API_TOKEN"
GATE_TOKEN_ENV = "FLEETCTL_GATE_TOKEN"
# Every body the API takes is a few hundred bytes; Tornado's default would hold 100 MiB of one in memory.
MAX_BODY = 64 * 1024
# The verdicts table's columns: a gate naming longer ones would never be recorded.
MAX_POOL, MAX_SELECTOR = 128, MAX_NAME


def _health(loop: ControlLoop) -> tuple[bool, dict[str, Any]]:
    """(ready, report): ready once a tick completed within three scrape intervals; a follower is ready on standby (it
    serves the API), which says nothing of whether any replica leads."""
    if not loop.leading():
        return True, {"status": "standby", "reason": "this replica does not lead: whether another does and ticks, "
                                                     "its /readyz or the store's newest signals tell"}
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


def _alive(loop: ControlLoop) -> tuple[bool, dict[str, Any]]:
    """(alive, report): alive unless this replica leads and its tick has run for ten scrape intervals (five minutes at
    least), or its take-over (three hours of signals to load) for three times that, which no healthy one takes:
    restarted, the pod gives up its Lease to a replica that acts."""
    if loop.busy is None or not loop.leading():
        return True, {"status": "ok"}
    doing, since = loop.busy
    age = loop.clock.now() - since
    limit = max(300.0, 10 * loop.config.scrape.interval) * (3 if doing == "taking over" else 1)
    if age > limit:
        return False, {"status": "stuck", "reason": f"{doing} for {age:.0f}s (the limit is {limit:g}s)"}
    return True, {"status": "ok"}


class _Healthz(tornado.web.RequestHandler):
    def initialize(self, loop: ControlLoop) -> None:
        self.loop = loop

    def get(self) -> None:
        alive, report = _alive(self.loop)
        if not alive:
            self.set_status(503)
        self.write(report)


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

    def json_body(self) -> Any:
        """The request's body as JSON (an empty one is `{}`); 400 for anything else."""
        try:
            body = json.loads(self.request.body or b"{}")
            # A `\ud800` escape is valid JSON but no text: it would fail deep in whatever encodes it, as a 500.
            json.dumps(body, ensure_ascii=False).encode()
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise tornado.web.HTTPError(400, reason="the body is not JSON") from None
        except UnicodeEncodeError:
            raise tornado.web.HTTPError(400, reason="the body holds an escape that is no character") from None
        return body

    def authorized(self, token: str) -> bool:
        """Whether the request carries `token` as its bearer token; answers 401 where it does not."""
        header = self.request.headers.get("Authorization", "")
        given = header[7:] if header[:7].lower() == "bearer " else ""
        if hmac.compare_digest(given.encode(), token.encode()):
            return True
        self.set_header("WWW-Authenticate", 'Bearer realm="fleetctl"')
        self.fail(401, "missing or wrong bearer token")
        return False


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
        if not self.authorized(self.token):
            return
        body = self.json_body()
        by = body.get("by") if isinstance(body, dict) else None
        # No line breaks or other control characters: the name goes into logs and the audit trail as one line.
        if not isinstance(by, str) or not by.strip() or len(by) > MAX_NAME or not by.isprintable():
            self.fail(400, f'the body must be {{"by": NAME}} with a name of 1 to {MAX_NAME} printable characters')
            return
        by = by.strip()
        # No store holds a larger one, and a database refuses to compare with it (int() refuses 4,300 digits).
        if len(action_id) > len(str(MAX_ID)) or int(action_id) > MAX_ID:
            self.fail(404, f"no action {action_id}")
            return
        aid = int(action_id)
        try:
            # A proposal past its time to live is expired, whether or not a tick has marked it yet: approved, a revert
            # would run under revert_ttl after all.
            action = await self.loop.store.decide(aid, approve=verb == "approve", by=by, now=self.loop.clock.now(),
                                                  via="api", ttl=self.loop.config.rails.proposal_ttl)
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


class _Gate(_Json):
    """The canary gate's verdict now, for Argo Rollouts' web metric provider and scripts."""

    def initialize(self, loop: ControlLoop, token: str | None, gates: GateBook,  # type: ignore[override]
                   gate_token: str | None) -> None:
        super().initialize(loop, token)
        self.gates = gates
        self.gate_token = gate_token

    def prepare(self) -> None:
        if self.gate_token is not None and not self.authorized(self.gate_token):
            return  # answered 401: finished, so the handler method does not run

    def _params(self) -> dict[str, str]:
        params = {k: self.get_argument(k, "") for k in ("pool", "baseline", "canary", "revision", "max_window", "step")}
        if self.request.method == "POST" and self.request.body:
            body = self.json_body()
            if not isinstance(body, dict):
                raise tornado.web.HTTPError(400, reason="the body must be a JSON object")
            params.update({k: str(v) for k, v in body.items() if k in params and v is not None})
        return params

    async def answer(self, params: dict[str, str], *, reruns: bool = True) -> tuple[GateKey, Verdict] | None:
        missing = [k for k in ("pool", "baseline", "canary") if not params.get(k)]
        if missing:
            self.fail(400, f"missing {', '.join(missing)}: give pool, baseline and canary (selectors of pods)")
            return None
        if any(len(params[k]) > 4 * MAX_NAME for k in params):
            self.fail(400, "a parameter is too long")
            return None
        if len(params["pool"]) > MAX_POOL or max(len(params["baseline"]), len(params["canary"])) > MAX_SELECTOR:
            self.fail(400, f"a pool is at most {MAX_POOL} characters, a selector at most {MAX_SELECTOR}")
            return None
        overrides = {k: params[k] for k in ("max_window", "step") if params.get(k)}
        try:
            settings = GateSettings.model_validate({**self.gates.settings.model_dump(), **overrides}) if overrides \
                else None
        except ValueError as exc:
            self.fail(400, f"bad gate settings: {exc}")
            return None
        asked = "" if settings is None else f"step={settings.step:g};max_window={settings.max_window:g}"
        key = GateKey(params["pool"], params["baseline"], params["canary"], params.get("revision", ""), asked)
        try:
            verdict = await self.gates.consult(key, self.loop.clock.now(), settings, reruns=reruns)
        except GateInputError as exc:
            self.fail(400, str(exc))
            return None
        except GateError as exc:
            self.fail(503, str(exc))
            return None
        except FleetError as exc:
            self.fail(503, f"the gate could not read its numbers: {exc}")
            return None
        return key, verdict

    async def get(self) -> None:
        await self._reply(self._params())

    async def post(self) -> None:
        await self._reply(self._params())

    async def _reply(self, params: dict[str, str]) -> None:
        got = await self.answer(params)
        if got is None:
            return
        key, verdict = got
        self.write({**verdict.as_dict(), "pool": key.pool, "baseline": key.baseline, "canary": key.canary,
                    "revision": key.revision})


class _FlaggerGate(_Gate):
    """Flagger's webhooks: `rollback` answers 200 once the gate failed, `promotion` once it passed."""

    async def post(self, hook: str) -> None:  # type: ignore[override]
        body = self.json_body()
        meta = body.get("metadata") if isinstance(body, dict) else None
        if not isinstance(meta, dict):
            self.fail(400, "Flagger's payload must carry metadata with pool, baseline and canary")
            return
        revision = f"{body.get('namespace', '')}/{body.get('name', '')}@{body.get('checksum', '')}"
        # No rerun of a decided gate: Flagger analyses a spec it has not judged (a new checksum, so a new gate), and its
        # hooks ask at its own interval, which may be many of the gate's steps.
        got = await self.answer({**{k: str(meta.get(k, "")) for k in ("pool", "baseline", "canary", "max_window",
                                                                        "step")}, "revision": revision}, reruns=False)
        if got is None:
            return
        key, verdict = got
        want = Outcome.FAIL if hook == "rollback" else Outcome.PASS
        if verdict.outcome is not want:
            self.set_status(403)
        self.write({**verdict.as_dict(), "pool": key.pool, "revision": revision})


def store_gates(loop: ControlLoop) -> GateBook:
    """The gates the API runs by default: read from the loop's store, judged by the fleet file's gate rules (those
    the loop's own canary judge applies), each verdict recorded once however many replicas serve the API."""
    roles = {p.name: str(p.role) for p in loop.config.pools}

    def source(pool: str, base: ArmSelector, can: ArmSelector, rules: Sequence[MetricRule]) -> StoreGateSource:
        # A pool the fleet file lacks (a Rollout's name given for it) has no data: refused at once, as `fleetctl gate
        # --fleet` refuses it, not read as "no data" until the window ends inconclusive and the rollout pauses.
        if pool not in roles:
            raise GateInputError(f"pool {pool!r} is not in the fleet file (it has {', '.join(sorted(roles))})")
        return StoreGateSource(loop.store, pool, base, can, rules, role=roles[pool],
                               scrape_interval=loop.config.scrape.interval)

    return GateBook(source, loop.config.policies.canary_regression.gate, record=loop.store.record_verdict,
                    claim=loop.store.claim, scrape_interval=loop.config.scrape.interval)


def start_server(loop: ControlLoop, host: str, port: int, *, token: str | None = None,
                 gates: GateBook | None = None, gate_token: str | None = None) -> tornado.httpserver.HTTPServer:
    """Start serving on the running asyncio loop; returns the server (call `.stop()` to end).

    `token` guards the write endpoints; without one it is read from FLEETCTL_API_TOKEN, and
    with neither every write is refused. `gates` runs the canary gates (by default `store_gates`); with
    `gate_token` (or FLEETCTL_GATE_TOKEN) they answer only requests that carry it.
    """
    token = env_secret(token or os.environ.get(TOKEN_ENV))
    gate_token = env_secret(gate_token or os.environ.get(GATE_TOKEN_ENV))
    gates = gates if gates is not None else store_gates(loop)
    api = {"loop": loop, "token": token}
    gate = {**api, "gates": gates, "gate_token": gate_token}
    app = tornado.web.Application(
        [
            (r"/metrics", _Metrics, {"loop": loop}),
            (r"/healthz", _Healthz, {"loop": loop}),
            (r"/readyz", _Readyz, {"loop": loop}),
            (r"/api/status", _Status, api),
            (r"/api/actions/([0-9]+)/(approve|reject)", _Decide, api),
            (r"/api/v1/gate", _Gate, gate),
            (r"/api/v1/gate/flagger/(rollback|promotion)", _FlaggerGate, gate),
        ]
    )
    # A body that trickles in holds a connection open: each read may wait this long.
    server = tornado.httpserver.HTTPServer(app, max_body_size=MAX_BODY, body_timeout=10.0,
                                           idle_connection_timeout=60.0)
    server.listen(port, address=host)
    return server
