"""Concurrent HTTP scraping of targets with timeouts, and exponential backoff for targets whose failures are costly.

Only I/O lives here: the HTTP client is passed in (so tests can hand in a mock transport) and
the current time is an argument, so backoff works the same under a virtual clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence

import httpx

from catalog.redaction import without_credentials
from collectors.types import ScrapeResult, Target, TargetHealth

__all__ = ["Scraper", "http_client"]

ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"


class Scraper:
    """Scrapes many targets at once, bounded by `concurrency`, each within `timeout_s`, a round within `round_s`."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        concurrency: int = 64,
        timeout_s: float = 5.0,
        backoff_base_s: float = 15.0,
        backoff_max_s: float = 60.0,
        max_body_bytes: int = 32 * 1024 * 1024,
        rng: random.Random | None = None,
        spread_s: float = 0.0,
        round_s: float | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._slots = _Slots(concurrency)
        self._timeout = timeout_s
        self._backoff_base = backoff_base_s
        self._backoff_max = backoff_max_s
        self._max_body = max_body_bytes
        self._rng = rng or random.Random()
        # Each target is scraped at a fixed offset within the first `spread_s` of a round, so a
        # fleet is not hit all at once; the offset comes from the target, so its interval stays exact.
        self._spread = spread_s
        # A round ends this long after it starts, whatever its targets do: a tick's numbers come on time, and a
        # target still waiting for a slot then (behind slow or dead ones) is read next round instead.
        self._round = round_s
        self._sleep = sleep
        self._clock = clock  # the loop's: a virtual one in the simulator, where no time passes while a slot is awaited
        self.health: dict[str, TargetHealth] = {}

    async def scrape(self, targets: Sequence[Target], now: float) -> list[ScrapeResult]:
        """Scrape every target not in backoff; results come back in target order."""
        live = {t.key for t in targets}
        for key in list(self.health):
            if key not in live:
                del self.health[key]
        deadline = None if self._round is None else self._clock() + self._round
        # Those left late by earlier rounds go first, so a round too short for the fleet reads a different part of it
        # each time rather than never reaching the same targets (whose pools would never be fit to act on).
        order = sorted(range(len(targets)), key=lambda i: -self._late_rounds(targets[i]))
        done = dict(zip(order, await asyncio.gather(*(self._one(targets[i], now, deadline) for i in order)), strict=True))
        return [done[i] for i in range(len(targets))]

    def _late_rounds(self, target: Target) -> int:
        health = self.health.get(target.key)
        return health.late_rounds if health is not None else 0

    def offset(self, target: Target) -> float:
        """The target's fixed scrape offset within a round, in seconds."""
        if self._spread <= 0:
            return 0.0
        digest = zlib.crc32(target.key.encode())
        return self._spread * (digest / 0xFFFFFFFF)

    async def _one(self, target: Target, now: float, deadline: float | None) -> ScrapeResult:
        health = self.health.setdefault(target.key, TargetHealth())
        offset = self.offset(target)
        if offset:
            await self._sleep(offset)
            now += offset
        if now < health.next_attempt_at:
            return ScrapeResult(target, now, ok=False, error=health.last_error, skipped=True)
        queued = self._clock() if self._slots.busy() else None
        wait = None if deadline is None else max(0.0, deadline - self._clock())
        try:
            await asyncio.wait_for(self._slots.acquire(-health.late_rounds), wait)
        except TimeoutError:
            return self._late(health, target, now, f"every slot was taken until the round's end ({self._round:g}s)")
        try:
            if queued is not None:
                # Every slot was taken: stamped when fetched, since a target that waited behind slow ones is read that
                # much later, and its rates divide by the interval it really had.
                now += self._clock() - queued
            # Its own timeout, or what is left of the round where that is less: a read the round cut off says
            # nothing of the target.
            budget = self._timeout if deadline is None else min(self._timeout, deadline - self._clock())
            cut = budget < self._timeout - 1e-3  # the round's end comes first (a clock of epoch seconds rounds)
            if budget <= 0:
                return self._late(health, target, now, f"its slot came free at the round's end ({self._round:g}s)")
            started = time.perf_counter()
            costly = False  # the failure held a slot for the whole timeout, or read a body too large
            try:
                body, size = await asyncio.wait_for(self._fetch(target.url), budget)
                error = _looks_wrong(body)
            except (TimeoutError, httpx.TimeoutException):
                # Half its timeout is long enough to count, as a slow answer counts (below): a hung target that
                # always waits for a slot must still read as down and back off, not hold a slot every round.
                if budget < self._timeout / 2:
                    return self._late(health, target, now, f"the round ended ({self._round:g}s) {budget:.3g}s into its read")
                body, size, costly = "", 0, True
                error = f"timed out after {budget:.3g}s" + (" (the round's end)" if cut else "")
            except httpx.HTTPError as exc:
                body, size, error = "", 0, f"{type(exc).__name__}: {without_credentials(str(exc))[:200] or 'connection failed'}"
            except httpx.InvalidURL as exc:  # not an HTTPError: one target's bad URL must not fail the round
                body, size, error = "", 0, without_credentials(f"invalid URL {target.url!r}: {exc}")
            except _ScrapeRefused as exc:  # names the URL: masked here, only when it fails
                body, size, error, costly = "", 0, without_credentials(str(exc)), exc.costly
            duration = time.perf_counter() - started
        finally:
            self._slots.release()
        health.late_rounds = 0
        if error is None:
            health.consecutive_failures = health.costly_failures = 0
            health.next_attempt_at = 0.0
            health.last_error = None
            return ScrapeResult(target, now, ok=True, body=body, duration_s=duration, size_bytes=size)
        health.consecutive_failures += 1
        health.last_error = error
        # A skipped target reads as failing until it is asked again, so back off only where asking costs: a failure
        # that held its slot for half the timeout or more, or read a body too large. A refused connection or an error
        # status costs nothing, and a pod that answers again is then seen at the next round. The first costly failure
        # retries next round; the wait grows, jittered.
        if costly or duration >= self._timeout / 2:
            health.costly_failures += 1
        else:
            health.costly_failures = 0
        if health.costly_failures > 1:
            # Capped before it is raised (a target failing for days would overflow the float), and jittered after the
            # cap, so that the targets of a dead node do not all come back in the same round once they reach it.
            doublings = min(health.costly_failures - 2, 30)
            wait = min(self._backoff_max, self._backoff_base * 2.0 ** doublings)
            health.next_attempt_at = now + wait * self._rng.uniform(0.8, 1.0)
        else:
            health.next_attempt_at = 0.0
        return ScrapeResult(target, now, ok=False, duration_s=duration, size_bytes=size, error=error)

    @staticmethod
    def _late(health: TargetHealth, target: Target, now: float, why: str) -> ScrapeResult:
        """Not read this round for want of time: no failure of the target's, so its health stays as it was, but it
        goes ahead of the others next round."""
        health.late_rounds += 1
        return ScrapeResult(target, now, ok=False, error=f"not scraped this round: {why}", late=True)

    async def _fetch(self, url: str) -> tuple[str, int]:
        async with self._client.stream("GET", url, headers={"Accept": ACCEPT}) as resp:
            if resp.status_code != 200:
                raise _ScrapeRefused(f"HTTP {resp.status_code} from {url}")
            ctype = resp.headers.get("content-type", "")
            if "html" in ctype:
                raise _ScrapeRefused(f"{url} answered {ctype.split(';')[0]}, not a metrics exposition")
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > self._max_body:
                    raise _ScrapeRefused(f"body from {url} exceeds {self._max_body} bytes", costly=True)
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace"), size


class _Slots:
    """At most `n` reads at once; a freed slot goes to the waiter with the lowest priority number, then the earliest."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def busy(self) -> bool:
        """Whether a read asking now would wait (a slot is freed only when no one waits for it)."""
        return self._free <= 0

    async def acquire(self, priority: int) -> None:
        """Wait for a slot; cancelled (the round's end), it holds none."""
        if not self.busy():
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed the slot as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        """Hand the slot to the first waiter still waiting, else free it."""
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


class _ScrapeRefused(Exception):
    """The target answered, but not with something we can use."""

    def __init__(self, message: str, *, costly: bool = False) -> None:
        super().__init__(message)
        self.costly = costly


def http_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """The HTTP client a scraper uses: its pool sized to the scrape concurrency."""
    # vLLM's server drops idle connections after 5 s, httpx's default keep-alive: a scrape every
    # 5 s could reuse a connection the engine is closing. Expire ours well before.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)


def _looks_wrong(body: str) -> str | None:
    head = body.lstrip()[:64].lower()
    if head.startswith("<!doctype html") or head.startswith("<html"):
        return "answered HTML, not a metrics exposition"
    return None
