"""A small HTTP router in front of several engines' OpenAI-compatible endpoints.

It forwards `/v1/completions` and `/v1/chat/completions` (streamed or not) to one engine per
request, picked by the routing policy:

- `prefix`: consistent hashing with bounded loads. The key is the prompt's first few blocks
  (characters of text, or token ids when the prompt is a token list), so requests that share
  a prefix land on the engine that already holds it in its prefix cache. Engines are ranked by
  rendezvous hashing, which moves only the keys of an engine that joins or leaves; an engine
  already carrying much more than its share of the requests in flight is passed over for the
  next in rank.
- `round_robin`: every engine in turn, blind to prompts. Switching to it at runtime is the
  classic routing fault: shared prefixes get spread over every engine's cache.

An engine that cannot be reached is passed over for `eject_s` (as a proxy's outlier detection
does), unless every engine is; each engine has its own connection pool, so one slow engine's
requests never queue those bound for another. `GET /router` reports the policy and per-engine
counts; `PUT /router/policy` with `{"policy": "round_robin"}` switches the policy, so the fault can
be injected from outside too. Runs on the caller's asyncio loop (tornado on asyncio) and forwards
with httpx.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import httpx
import tornado.iostream
import tornado.netutil
import tornado.web
from tornado.httpserver import HTTPServer

__all__ = ["RoutePolicy", "Router", "RouterSettings", "Upstream", "UpstreamStats", "prefix_key"]

log = logging.getLogger(__name__)

FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Headers that describe one hop's connection, not the message; never copied across.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"})


class RoutePolicy(StrEnum):
    """How the router picks an engine."""

    PREFIX = "prefix"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Upstream:
    """One engine behind the router: a stable name (the pod) and its base URL (`http://host:port`)."""

    name: str
    url: str


@dataclass(slots=True)
class UpstreamStats:
    """Per-engine counters since the router started."""

    requests: int = 0  # forwarded
    ok: int = 0  # answered 200
    errors: int = 0  # answered otherwise, unreachable, or the client gone before the whole answer
    in_flight: int = 0
    ejected_until: float = 0.0  # monotonic time until which an unreachable engine is passed over


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """What the prefix policy hashes and how much imbalance it tolerates."""

    prefix_blocks: int = 2  # blocks of the prompt that make the key
    block_chars: int = 512  # characters per block of a text prompt
    block_tokens: int = 128  # token ids per block of a token prompt (the CPU build's KV block)
    load_factor: float = 1.5  # an engine may carry this multiple of the mean requests in flight
    timeout_s: float = 120.0  # per forwarded request
    eject_s: float = 10.0  # an engine that could not be reached is passed over this long
    connections: int = 16  # per engine


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prefix_key(body: Mapping[str, Any], settings: RouterSettings) -> bytes:
    """The bytes the prefix policy hashes: the first blocks of the prompt or of the chat messages."""
    chars = settings.prefix_blocks * settings.block_chars
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        prompt = "".join(_text_of(m.get("content")) for m in body["messages"] if isinstance(m, dict))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt[:chars].encode()
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = prompt[: settings.prefix_blocks * settings.block_tokens]
        return b"ids:" + ",".join(map(str, ids)).encode()
    return b""


def _rank(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\0" + name.encode(), digest_size=8).digest(), "big")


class Router:
    """Routes OpenAI-compatible requests over `upstreams`; `start()` serves it on 127.0.0.1."""

    def __init__(
        self,
        upstreams: Sequence[Upstream],
        policy: RoutePolicy = RoutePolicy.PREFIX,
        settings: RouterSettings | None = None,
    ) -> None:
        if not upstreams:
            raise ValueError("the router needs at least one upstream engine")
        names = [u.name for u in upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstream names must be unique, got {names}")
        self.upstreams = list(upstreams)
        self.settings = settings or RouterSettings()
        self.stats = {u.name: UpstreamStats() for u in self.upstreams}
        self.policy_changes: list[tuple[RoutePolicy, RoutePolicy]] = []
        self._policy = RoutePolicy(policy)
        self._turn = itertools.count()
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._server: HTTPServer | None = None
        self.port: int | None = None

    # policy ---------------------------------------------------------------------------------

    @property
    def policy(self) -> RoutePolicy:
        """The policy in force."""
        return self._policy

    def set_policy(self, policy: RoutePolicy | str) -> RoutePolicy:
        """Switch the routing policy now (for requests that arrive from here on); return the old one."""
        new, old = RoutePolicy(policy), self._policy
        if new is not old:
            self.policy_changes.append((old, new))
            log.info("router policy %s -> %s", old, new)
        self._policy = new
        return old

    def pick(self, body: Mapping[str, Any]) -> Upstream:
        """The engine that should serve a request with this JSON body, among those not passed over."""
        now = time.monotonic()
        # A dead engine answers at once: kept in the ranking, it won its keys (or every other turn) back as fast.
        live = [u for u in self.upstreams if self.stats[u.name].ejected_until <= now] or self.upstreams
        key = prefix_key(body, self.settings) if self._policy is RoutePolicy.PREFIX else b""
        if not key:
            return live[next(self._turn) % len(live)]
        ranked = sorted(live, key=lambda u: _rank(key, u.name), reverse=True)
        total = sum(self.stats[u.name].in_flight for u in live)
        cap = max(1, math.ceil(self.settings.load_factor * (total + 1) / len(live)))
        for upstream in ranked:
            if self.stats[upstream.name].in_flight < cap:
                return upstream
        return min(ranked, key=lambda u: self.stats[u.name].in_flight)

    def snapshot(self) -> dict[str, Any]:
        """Policy and per-engine counters, as plain data."""
        return {"policy": str(self._policy), "upstreams": {n: asdict(s) for n, s in self.stats.items()}}

    # serving --------------------------------------------------------------------------------

    def client(self, upstream: Upstream) -> httpx.AsyncClient:
        """The connection pool of one engine; RuntimeError before `start()`."""
        if upstream.name not in self._clients:
            raise RuntimeError("the router is not started")
        return self._clients[upstream.name]

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT` once started."""
        if self.port is None:
            raise RuntimeError("the router is not started")
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> Router:
        """Listen on `host:port` (0: a free port) on the running asyncio loop."""
        if self._server is not None:
            raise RuntimeError(f"the router already listens on port {self.port}")
        n = self.settings.connections
        # One pool per engine: in a shared one, a slow engine's requests held every connection and those for an idle
        # engine queued behind them.
        self._clients = {u.name: httpx.AsyncClient(
            timeout=httpx.Timeout(self.settings.timeout_s, connect=5.0),
            # Below vLLM's 5 s keep-alive timeout, so a reused connection is never closed under a request.
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0),
        ) for u in self.upstreams}
        app = tornado.web.Application(
            [
                (r"/v1/(?:chat/)?completions", _ForwardHandler, {"router": self}),
                (r"/v1/models", _ModelsHandler, {"router": self}),
                (r"/router", _StatsHandler, {"router": self}),
                (r"/router/policy", _PolicyHandler, {"router": self}),
                (r"/health", _HealthHandler),
            ]
        )
        sockets = tornado.netutil.bind_sockets(port, host)
        self.port = int(sockets[0].getsockname()[1])
        self._server = HTTPServer(app, idle_connection_timeout=60)
        self._server.add_sockets(sockets)
        return self

    async def close(self) -> None:
        """Stop listening, drop open connections and close the upstream client."""
        if self._server is not None:
            self._server.stop()
            await self._server.close_all_connections()
            self._server = None
        for client in self._clients.values():
            await client.aclose()
        self._clients = {}

    async def forward(self, path: str, raw: bytes, headers: Mapping[str, str],
                      handler: tornado.web.RequestHandler) -> None:
        """Forward one request to the engine the policy picks and relay its answer into `handler`."""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            _error(handler, 400, "the request body is not JSON")
            return
        if not isinstance(body, dict):
            _error(handler, 400, "the request body must be a JSON object")
            return
        upstream = self.pick(body)
        client = self.client(upstream)
        stats = self.stats[upstream.name]
        stats.requests += 1
        stats.in_flight += 1
        sent = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        request = client.build_request("POST", upstream.url + path, content=raw, headers=sent)
        status = 502
        relayed = False
        try:
            response = await client.send(request, stream=True)
            try:
                status = response.status_code
                relayed = True
                handler.set_status(status)
                for k, v in response.headers.items():
                    if k.lower() not in _HOP_HEADERS:
                        handler.set_header(k, v)
                handler.set_header("X-Routed-To", upstream.name)
                async for chunk in response.aiter_raw():
                    handler.write(chunk)
                    if body.get("stream"):
                        await handler.flush()
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            status = 502
            if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                stats.ejected_until = time.monotonic() + self.settings.eject_s
                log.warning("engine %s (%s) unreachable: passed over for %gs", upstream.name, upstream.url,
                            self.settings.eject_s)
            if not relayed:
                _error(handler, 502, f"engine {upstream.name} ({upstream.url}) failed: {type(exc).__name__}: {exc}")
        except tornado.iostream.StreamClosedError:
            status = 499  # the client went away: its answer was not delivered, whatever the engine said
        finally:
            stats.in_flight -= 1
            if status == 200:
                stats.ok += 1
            else:
                stats.errors += 1


def _error(handler: tornado.web.RequestHandler, status: int, message: str) -> None:
    handler.clear()
    handler.set_status(status)
    handler.set_header("Content-Type", "application/json")
    handler.write(json.dumps({"error": {"message": message, "code": status}}))


class _ForwardHandler(tornado.web.RequestHandler):
    def initialize(self, router: Router) -> None:
        self.router = router

    async def post(self) -> None:
        await self.router.forward(self.request.path, self.request.body, dict(self.request.headers), self)


class _ModelsHandler(tornado.web.RequestHandler):
    def initialize(self, router: Router) -> None:
        self.router = router

    async def get(self) -> None:
        # Every engine serves the same model: any one that is not passed over answers for all.
        upstream = self.router.pick({})
        try:
            resp = await self.router.client(upstream).get(upstream.url + "/v1/models")
        except httpx.HTTPError as exc:
            _error(self, 502, f"engine {upstream.name} ({upstream.url}) failed: {exc}")
            return
        self.set_status(resp.status_code)
        self.set_header("Content-Type", resp.headers.get("content-type", "application/json"))
        self.write(resp.content)


class _StatsHandler(tornado.web.RequestHandler):
    def initialize(self, router: Router) -> None:
        self.router = router

    def get(self) -> None:
        self.write(self.router.snapshot())


class _PolicyHandler(tornado.web.RequestHandler):
    def initialize(self, router: Router) -> None:
        self.router = router

    def put(self) -> None:
        try:
            wanted = json.loads(self.request.body or b"{}").get("policy")
            old = self.router.set_policy(wanted)
        except (ValueError, AttributeError):
            choices = ", ".join(p.value for p in RoutePolicy)
            _error(self, 400, f'expected {{"policy": one of {choices}}}, got {self.request.body[:100]!r}')
            return
        self.write({"policy": str(self.router.policy), "previous": str(old)})


class _HealthHandler(tornado.web.RequestHandler):
    def get(self) -> None:
        self.write({"status": "ok"})
