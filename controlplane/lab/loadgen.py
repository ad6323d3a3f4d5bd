"""Turns a workload trace into real completion requests, with traffic modes that inject faults.

Prompts follow the trace's prefix-block structure. A Mooncake request lists the hashes of its
512-token prefix blocks; each hash becomes one lab block of `block_tokens` words (128: the CPU
build's KV block, so one trace block is one KV block), the same words for the same hash, so
requests that share hashes share a real prefix. Every word is a single token of the served
model's tokenizer, which makes the block sizes exact. Traces without hashes (Azure) get one
shared system block per traffic category followed by blocks unique to the request. Prompts are
capped at `max_prompt_blocks` blocks and outputs at `max_output_tokens`: CPU engines are slow.

Arrivals keep the trace's gaps, rescaled to a mean of `rate` requests per second, and the trace
wraps around when it runs out. The traffic mode can be switched at any time:

- `normal`: shared prefixes as the trace has them, greedy decoding.
- `unique`: every prompt starts with a random block of its own (a system prompt stamped per
  request), so no prefix is ever shared and the prefix-cache hit rate collapses.
- `random`: sampling at a high temperature: the ngram drafter finds nothing to propose.
- `json`: constrained decoding with a JSON schema (vLLM structured outputs).
- `burst`: normal traffic at `burst_factor` times the rate.

Requests in flight are bounded (arrivals wait for a slot); failures are counted, never raised.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from controlplane.sim.traces import Request, load_azure, load_mooncake, trace_path

__all__ = [
    "LAB_TRACES",
    "TRIAGE_SCHEMA",
    "LoadGen",
    "LoadSettings",
    "PromptBuilder",
    "Traffic",
    "TrafficStats",
    "lab_trace",
    "single_token_words",
]

# `--trace` names and the trace files they stand for.
LAB_TRACES: dict[str, str] = {
    "mooncake": "mooncake/conversation",
    "mooncake-synthetic": "mooncake/synthetic",
    "azure-conv": "azure/conv",
    "azure-code": "azure/code",
}
# Mooncake timestamps come in ~3 s steps; spreading each step's requests over it smooths arrivals.
MOONCAKE_SPREAD_S = 3.0
AZURE_TOKENS_PER_BLOCK = 512  # Azure lengths are scaled down as if hashed in Mooncake's block size

TRIAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["ok", "degraded", "down"]},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["status", "count", "tags"],
    "additionalProperties": False,
}
"""The schema of `json` traffic: a small triage record, as an extraction or tool-call API would ask for."""


class Traffic(StrEnum):
    """What the load generator sends."""

    NORMAL = "normal"
    UNIQUE = "unique"
    RANDOM = "random"
    JSON = "json"
    BURST = "burst"


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """How trace requests become lab requests."""

    rate: float = 3.0  # requests per second of normal traffic (two CPU engines take ~4-5)
    burst_factor: float = 4.0  # rate multiplier of `burst` traffic
    max_in_flight: int = 32
    block_tokens: int = 128  # tokens per lab block: the CPU build's KV block
    max_prompt_blocks: int = 6
    max_output_tokens: int = 24
    json_max_tokens: int = 64  # room for the whole record: JSON output is longer in this tiny vocabulary
    random_temperature: float = 1.0  # the tiny model is near uniform here: output is noise
    timeout_s: float = 60.0
    seed: int = 0
    model: str = "tiny-llama"

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a finite number > 0, got {self.rate}")
        if self.burst_factor < 1:
            raise ValueError(f"burst_factor must be >= 1, got {self.burst_factor}")
        for name in ("max_in_flight", "block_tokens", "max_prompt_blocks", "max_output_tokens", "json_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)
class TrafficStats:
    """Counts of one traffic mode (or of all), since the generator started."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0  # sum over answered requests
    json_valid: int = 0  # finished JSON outputs that parsed and had the required keys
    json_invalid: int = 0

    @property
    def mean_latency_s(self) -> float | None:
        """Mean end-to-end latency of the answered requests."""
        return self.latency_s / self.ok if self.ok else None

    def minus(self, before: TrafficStats) -> TrafficStats:
        """The counts since `before` was copied."""
        kinds = {k: v - before.error_kinds.get(k, 0) for k, v in self.error_kinds.items()}
        return TrafficStats(
            self.sent - before.sent, self.ok - before.ok, self.errors - before.errors,
            {k: v for k, v in kinds.items() if v}, self.prompt_tokens - before.prompt_tokens,
            self.completion_tokens - before.completion_tokens, self.latency_s - before.latency_s,
            self.json_valid - before.json_valid, self.json_invalid - before.json_invalid,
        )

    def copy(self) -> TrafficStats:
        """An independent copy."""
        return self.minus(TrafficStats())


def single_token_words(model_dir: Path) -> list[str]:
    """Whole words (letters only, 3+) that the model's byte-level BPE tokenizer keeps as one token
    after a space, read from its `tokenizer.json`; sorted, so a block's words are reproducible."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the vocabulary of {path}: {exc}") from None
    # "Ġ" marks a leading space in byte-level BPE vocabularies.
    words = sorted(tok[1:] for tok in vocab if tok.startswith("Ġ") and tok[1:].isascii() and tok[1:].isalpha()
                   and len(tok) > 3)
    if len(words) < 16:
        raise ValueError(f"{path} has only {len(words)} single-token words; prompts need at least 16")
    return words


class PromptBuilder:
    """Deterministic prompt text for prefix blocks: the same block id gives the same words."""

    def __init__(self, words: Sequence[str], block_tokens: int = 128, seed: int = 0) -> None:
        self.words = list(words)
        self.block_tokens = block_tokens
        self.seed = seed
        self._cache: dict[str, list[str]] = {}

    def block(self, block_id: str) -> list[str]:
        """The words of one block (cached: trace blocks repeat)."""
        words = self._cache.get(block_id)
        if words is None:
            rng = random.Random(f"{self.seed}:{block_id}")
            words = [rng.choice(self.words) for _ in range(self.block_tokens)]
            if len(self._cache) < 4096:  # the hot blocks (shared system prompts, templates) come early
                self._cache[block_id] = words
        return words

    def random_block(self, rng: random.Random) -> list[str]:
        """A block nobody else will send."""
        return [rng.choice(self.words) for _ in range(self.block_tokens)]

    def text(self, blocks: Sequence[list[str]]) -> str:
        """The prompt of these blocks: one token per word, with the leading space the tokenizer expects."""
        return "".join(" " + w for b in blocks for w in b)


def lab_blocks(req: Request, settings: LoadSettings) -> list[tuple[str, int]]:
    """(block id, tokens) of a trace request's prompt in lab blocks, capped at `max_prompt_blocks`."""
    bt = settings.block_tokens
    if req.hash_ids:
        scale = bt / req.block_tokens
        n = len(req.hash_ids)
        last = req.input_tokens - (n - 1) * req.block_tokens
        sizes = [bt] * (n - 1) + [max(1, min(bt, math.ceil(last * scale)))]
        return [(f"h{h}", k) for h, k in zip(req.hash_ids, sizes, strict=True)][: settings.max_prompt_blocks]
    # No hashes: a system block shared by the category, the rest unique to this request.
    tokens = min(settings.max_prompt_blocks * bt, max(1, math.ceil(req.input_tokens * bt / AZURE_TOKENS_PER_BLOCK)))
    out: list[tuple[str, int]] = []
    for i in range(math.ceil(tokens / bt)):
        block_id = f"sys:{req.category}" if i == 0 else f"r{req.index}:{i}"
        out.append((block_id, min(bt, tokens - i * bt)))
    return out


def lab_trace(name: str, count: int) -> list[Request]:
    """The first `count` requests of a lab trace (a key of `LAB_TRACES`, or a `traces.TRACES` name)."""
    key = LAB_TRACES.get(name, name)
    path = trace_path(key)
    if key.startswith("mooncake/"):
        rows: Iterator[Request] = load_mooncake(path, spread_s=MOONCAKE_SPREAD_S)
    else:
        rows = load_azure(path)
    out = []
    for req in rows:
        out.append(req)
        if len(out) >= count:
            break
    if len(out) < 2:
        raise ValueError(f"trace {name!r} ({path}) has fewer than 2 requests")
    return out


class LoadGen:
    """Sends a trace's requests to an OpenAI-compatible `base_url` (the router) at the trace's pace."""

    def __init__(self, base_url: str, requests: Sequence[Request], prompts: PromptBuilder,
                 settings: LoadSettings | None = None, *, traffic: Traffic = Traffic.NORMAL) -> None:
        if len(requests) < 2:
            raise ValueError("the load generator needs at least 2 trace requests")
        self.base_url = base_url.rstrip("/")
        self.requests = list(requests)
        self.prompts = prompts
        self.settings = settings or LoadSettings()
        self.traffic = Traffic(traffic)
        self.total = TrafficStats()
        self.by_traffic: dict[Traffic, TrafficStats] = {t: TrafficStats() for t in Traffic}
        self.in_flight = 0
        self._gaps = self._scaled_gaps()
        self._rng = random.Random(self.settings.seed)
        self._slots = asyncio.Semaphore(self.settings.max_in_flight)
        self._running = asyncio.Event()
        self._running.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[None]] = set()

    def _scaled_gaps(self) -> list[float]:
        """Seconds before each request at the base rate: the trace's gaps, rescaled to a mean of 1/rate."""
        times = [r.arrival_s for r in self.requests]
        span = times[-1] - times[0]
        mean = span / (len(times) - 1) if span > 0 else 1.0
        scale = (1.0 / self.settings.rate) / mean
        gaps = [(b - a) * scale for a, b in pairwise(times)]
        return [1.0 / self.settings.rate, *gaps]  # the first request (and each wrap) after one mean gap

    def set_traffic(self, traffic: Traffic | str) -> None:
        """Switch the traffic mode; requests sent from now on follow it."""
        self.traffic = Traffic(traffic)

    def pause(self) -> None:
        """Stop sending new requests (those in flight finish)."""
        self._running.clear()

    def resume(self) -> None:
        """Send again after `pause()`."""
        self._running.set()

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Pause and wait until no request is in flight; False when some still were after `timeout_s`."""
        self.pause()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def body(self, req: Request, traffic: Traffic) -> dict[str, Any]:
        """The `/v1/completions` request body for one trace request in one traffic mode."""
        s = self.settings
        blocks = [self.prompts.block(block_id)[:tokens] for block_id, tokens in lab_blocks(req, s)]
        if traffic is Traffic.UNIQUE:
            blocks[0] = self.prompts.random_block(self._rng)[: len(blocks[0])]
        body: dict[str, Any] = {
            "model": s.model,
            "prompt": self.prompts.text(blocks),
            "max_tokens": max(1, min(req.output_tokens, s.max_output_tokens)),
            "temperature": 0.0,
            "ignore_eos": True,  # the lengths the trace asks for, not wherever the random model stops
        }
        if traffic is Traffic.RANDOM:
            body["temperature"] = s.random_temperature
        elif traffic is Traffic.JSON:
            del body["ignore_eos"]  # the grammar ends the record
            body["max_tokens"] = s.json_max_tokens
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "triage", "schema": TRIAGE_SCHEMA, "strict": True}}
        return body

    def _arrivals(self) -> Iterator[tuple[Request, float]]:
        while True:
            yield from zip(self.requests, self._gaps, strict=True)

    async def run(self, stop: asyncio.Event) -> None:
        """Send requests until `stop` is set, then wait for those in flight."""
        timeout = httpx.Timeout(self.settings.timeout_s, connect=5.0)
        n = self.settings.max_in_flight
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=n,
                                                                         max_keepalive_connections=n)) as client:
            try:
                await self._send_loop(client, stop)
            finally:
                if self._tasks:
                    await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send_loop(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        due = time.monotonic()
        for req, gap in self._arrivals():
            factor = self.settings.burst_factor if self.traffic is Traffic.BURST else 1.0
            due += gap / factor
            if await _wait_until(stop, due):
                return
            while True:
                if not self._running.is_set():
                    if await _wait_event(stop, self._running):
                        return
                    due = time.monotonic()  # a pause is not a backlog to catch up on
                await self._slots.acquire()
                if stop.is_set():
                    self._slots.release()
                    return
                if self._running.is_set():
                    break
                self._slots.release()  # paused while waiting for a slot: a drain must not see it sent
            traffic = self.traffic
            self.in_flight += 1
            self._idle.clear()
            task = asyncio.create_task(self._send(client, req, traffic))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, client: httpx.AsyncClient, req: Request, traffic: Traffic) -> None:
        stats = (self.total, self.by_traffic[traffic])
        for s in stats:
            s.sent += 1
        started = time.monotonic()
        error: str | None = None
        usage: dict[str, Any] = {}
        try:
            body = self.body(req, traffic)
            resp = await client.post(f"{self.base_url}/v1/completions", json=body)
            if resp.status_code != 200:
                error = f"http_{resp.status_code}"
            else:
                answer = resp.json()
                usage = answer.get("usage") or {}
                if traffic is Traffic.JSON:
                    verdict = _json_verdict(answer)
                    for s in stats:
                        s.json_valid += verdict is True
                        s.json_invalid += verdict is False
        except httpx.TimeoutException:
            error = "timeout"
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        except ValueError:
            error = "bad_response"
        finally:
            self.in_flight -= 1
            self._slots.release()
            if self.in_flight == 0:
                self._idle.set()
        elapsed = time.monotonic() - started
        for s in stats:
            if error is None:
                s.ok += 1
                s.latency_s += elapsed
                s.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                s.completion_tokens += int(usage.get("completion_tokens") or 0)
            else:
                s.errors += 1
                s.error_kinds[error] = s.error_kinds.get(error, 0) + 1


def _json_verdict(answer: dict[str, Any]) -> bool | None:
    """True: a finished record that parses with the required keys; False: finished but not; None: cut at max_tokens."""
    choice = (answer.get("choices") or [{}])[0]
    if choice.get("finish_reason") != "stop":
        return None
    try:
        record = json.loads(choice.get("text", ""))
    except ValueError:
        return False
    return isinstance(record, dict) and all(k in record for k in TRIAGE_SCHEMA["required"])


async def _wait_until(stop: asyncio.Event, due: float) -> bool:
    """Sleep until monotonic time `due`; True when `stop` was set first."""
    delay = due - time.monotonic()
    if delay > 0:
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            pass
    return stop.is_set()


async def _wait_event(stop: asyncio.Event, event: asyncio.Event) -> bool:
    """Wait for `event` or `stop`; True when `stop` was set."""
    waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(event.wait())}
    _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in pending:
        w.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return stop.is_set()
