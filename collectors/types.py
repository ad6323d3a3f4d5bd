"""Values that flow out of the collectors: targets, samples, signals and scrape results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from catalog.fleet import Role


@dataclass(frozen=True, slots=True)
class Target:
    """One scrape endpoint and the pod, pool and role it belongs to."""

    url: str
    pool: str
    pod: str
    role: Role = Role.UNIFIED
    source: str = "vllm"

    @property
    def key(self) -> str:
        """Stable identity for per-target state (backoff, previous readings, health rows): a pod
        may expose several endpoints (vLLM and LMCache), told apart by their source."""
        return f"{self.pool}/{self.pod}/{self.source}"


class Sample(NamedTuple):
    """One parsed series value (a tuple: millions are made per second on the hot path)."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None


@dataclass(frozen=True, slots=True)
class Objectives:
    """A pool's latency objectives (p95, seconds): the share of its requests over each is a signal of its own."""

    ttft: float | None = None
    tpot: float | None = None

    @staticmethod
    def signal(objective: str) -> str:
        """The signal holding the share of a pool's requests over this objective (a field's name)."""
        return f"{objective}_over_slo"

    def given(self) -> list[tuple[str, float]]:
        """(field, seconds) of the objectives that are set."""
        return [(name, v) for name in ("ttft", "tpot") if (v := getattr(self, name)) is not None]


class Signal(NamedTuple):
    """A derived number for one subject at one time; stored narrow."""

    ts: float
    subject: str
    name: str
    value: float


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """What one scrape of one target produced, successful or not."""

    target: Target
    ts: float
    ok: bool
    body: str = ""
    duration_s: float = 0.0
    size_bytes: int = 0
    error: str | None = None
    skipped: bool = False  # in backoff: not attempted this round
    late: bool = False  # not read within the round's time (`Scraper` round_s): says nothing of the target


@dataclass(slots=True)
class TargetHealth:
    """Per-target scrape bookkeeping for backoff and reporting."""

    consecutive_failures: int = 0
    costly_failures: int = 0  # the last of them in a row that timed out, took half the timeout or read too much
    next_attempt_at: float = 0.0
    last_error: str | None = None
    missing_families: list[str] = field(default_factory=list)
    late_rounds: int = 0  # rounds in a row that ended before it was read


def engine_subject(pool: str, pod: str, engine: str) -> str:
    """Subject naming: engines are `engine/<pool>/<pod>/<rank>`."""
    return f"engine/{pool}/{pod}/{engine}"


def target_subject(target: Target) -> str:
    """Subject naming: a scrape endpoint's own health is `target/<pool>/<pod>/<source>`."""
    return f"target/{target.key}"


def pod_subject(pool: str, pod: str) -> str:
    """Subject naming: pods are `pod/<pool>/<pod>`."""
    return f"pod/{pool}/{pod}"


def pool_subject(pool: str) -> str:
    """Subject naming: pools are `pool/<pool>`."""
    return f"pool/{pool}"
