"""Dashboard query benchmark: each page's query time on a store holding a week of a large fleet.

Seeds a fresh SQLite store shaped like a week of 200 engines in 4 pools (two plain pools, two
expert-parallel pools of 8 ranks per pod, one GPU per engine, KV probe paths, findings, actions
and verdicts), then times the functions the dashboard's pages load their data through
(`dashboard.pages.PAGES`) over every range the time selector offers.

What is written: raw signals for the last `raw_hours` (the pages read raw points for ranges up to
6 h), 1-minute rollups for the last `minute_hours` (by default the whole week, as a live store
keeps them 14 days) and 1-hour rollups for the whole `days`; rows go in in primary-key order
through the store's bulk load, with the rollup watermarks set where compaction
would leave them. Which level
a page reads depends on the range and on how many series it reads (`queries.plan`), so a shorter
`minute_hours` seeds faster but leaves longer few-series reads emptier than a live store.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console

from controlplane.goals import at_most, goals_json
from controlplane.store import migrate
from controlplane.store.queries import ReadStore
from controlplane.store.writer import SqlStore
from dashboard.pages import PAGES

__all__ = ["RANGES", "run_dashboard_bench", "seed_store"]

GOAL_MS = 300.0
# The dashboard's time-range choices, in seconds.
RANGES: dict[str, float] = {"15m": 900.0, "1h": 3600.0, "3h": 10800.0, "6h": 21600.0, "24h": 86400.0,
                            "3d": 3 * 86400.0, "7d": 7 * 86400.0}
T_END = 1_767_225_600.0 + 7 * 86400.0  # a fixed "now", so runs are comparable
INTERVAL = 15.0
GPUS_PER_NODE = 8
KV_PATHS_PER_PREFILL_POD = 2


@dataclass(frozen=True, slots=True)
class _Pool:
    name: str
    role: str
    ranks: int
    engines: int

    @property
    def pods(self) -> int:
        return math.ceil(self.engines / self.ranks)


@dataclass(frozen=True, slots=True)
class _Shape:
    """How one series moves: level, daily swing, noise, clipped to [0, 1] or not."""

    base: float
    swing: float = 0.2
    noise: float = 0.05
    unit: bool = False


def _pools(engines: int) -> list[_Pool]:
    """Four pools: plain prefill and decode, expert-parallel prefill and decode (8 ranks a pod)."""
    shares = (("prefill", "prefill", 1, 0.20), ("decode", "decode", 1, 0.40),
              ("moe-prefill", "prefill", 8, 0.16), ("moe-decode", "decode", 8, 0.24))
    sizes = [max(1, round(engines * share)) for *_, share in shares]
    sizes[1] += engines - sum(sizes)
    return [_Pool(name, role, ranks, n) for (name, role, ranks, _), n in zip(shares, sizes, strict=True)]


def _engine_subjects(pool: _Pool) -> list[str]:
    return [f"engine/{pool.name}/{pool.name}-{i // pool.ranks}/{i % pool.ranks}" for i in range(pool.engines)]


def _series(pools: list[_Pool]) -> Iterator[tuple[str, str, _Shape]]:
    """Every (name, subject, shape) the seeded fleet reports."""
    engine_count = 0
    for pool in pools:
        prefill = pool.role == "prefill"
        n = pool.engines
        subject = f"pool/{pool.name}"
        pool_shapes = {
            "request_rate": _Shape(2.0 * n), "request_error_rate": _Shape(0.01 * n, noise=0.5),
            "ttft_p50": _Shape(0.12 if prefill else 0.05), "ttft_p95": _Shape(0.35 if prefill else 0.12),
            "ttft_p99": _Shape(0.6 if prefill else 0.2), "tpot_p50": _Shape(0.018), "tpot_p95": _Shape(0.032),
            "tpot_p99": _Shape(0.05), "queue_time_p95": _Shape(0.05, noise=0.3), "requests_running": _Shape(8.0 * n),
            "requests_waiting": _Shape(0.5 * n, noise=0.4), "kv_cache_usage": _Shape(0.4, unit=True),
            "kv_cache_usage_max": _Shape(0.7, unit=True), "preemption_rate": _Shape(0.02, noise=1.0),
            "prefix_cache_hit_rate": _Shape(0.75, swing=0.05, unit=True),
            "external_prefix_cache_hit_rate": _Shape(0.2, unit=True),
            "engines_reporting": _Shape(float(n), swing=0.0, noise=0.0), "targets": _Shape(float(pool.pods), 0, 0),
            "targets_up": _Shape(float(pool.pods), swing=0.0, noise=0.0),
        }
        if not prefill:
            pool_shapes |= {"nixl_xfer_time_p50": _Shape(0.004), "nixl_xfer_time_p95": _Shape(0.009),
                            "nixl_xfer_time_p99": _Shape(0.013, noise=0.2),
                            "nixl_failed_transfer_rate": _Shape(0.001 * n, noise=1.0), "nixl_transfer_rate": _Shape(2.0 * n)}
            pool_shapes |= {"spec_acceptance_rate": _Shape(0.62, swing=0.05, unit=True),
                            "spec_mean_acceptance_length": _Shape(2.6, swing=0.05), "spec_yield": _Shape(0.5, unit=True),
                            "spec_acceptance_pos_0": _Shape(0.8, unit=True), "spec_acceptance_pos_1": _Shape(0.6, unit=True),
                            "spec_acceptance_pos_2": _Shape(0.4, unit=True)}
        for name, shape in pool_shapes.items():
            yield name, subject, shape
        for subject in _engine_subjects(pool):
            rank = int(subject.rsplit("/", 1)[1])
            # In the expert-parallel pools rank 3 carries the hot experts: a tail-latency anchor.
            hot = 1.6 if pool.ranks > 1 and rank == 3 else 1.0
            yield "request_rate", subject, _Shape(2.0 * hot)
            yield "ttft_p95", subject, _Shape(0.35 if prefill else 0.12)
            yield "tpot_p95", subject, _Shape(0.032 * hot)
            yield "prefix_cache_hit_rate", subject, _Shape(0.75, swing=0.05, noise=0.08, unit=True)
            yield "requests_running", subject, _Shape(8.0 * hot)
            yield "requests_waiting", subject, _Shape(0.5 * hot, noise=0.4)
            yield "kv_cache_usage", subject, _Shape(0.4 * hot, unit=True)
            yield "generation_tokens_rate", subject, _Shape(300.0 * hot)
            yield "itl_mean", subject, _Shape(0.022 * hot)
            if not prefill:
                yield "nixl_xfer_time_p50", subject, _Shape(0.004)
                yield "nixl_xfer_time_p99", subject, _Shape(0.012, noise=0.2)
                yield "nixl_failed_transfer_rate", subject, _Shape(0.001, noise=1.0)
                yield "nixl_transfer_rate", subject, _Shape(2.0)
            engine_count += 1
    for i in range(engine_count):
        subject = f"gpu/node-{i // GPUS_PER_NODE:03d}/{i % GPUS_PER_NODE}"
        for name, shape in (("gpu_utilization", _Shape(0.7, unit=True)), ("gpu_memory_used_bytes", _Shape(60e9, 0.05)),
                            ("gpu_memory_free_bytes", _Shape(20e9, 0.1)), ("gpu_tensor_active", _Shape(0.45, unit=True)),
                            ("gpu_temperature_celsius", _Shape(62.0, 0.1, 0.02)), ("gpu_power_watts", _Shape(500.0)),
                            ("gpu_xid_errors", _Shape(0.0, 0, 0)), ("gpu_ecc_sbe_rate", _Shape(0.0, 0, 0)),
                            ("gpu_ecc_dbe_rate", _Shape(0.0, 0, 0))):
            yield name, subject, shape
    by_role = {role: [p for p in pools if p.role == role] for role in ("prefill", "decode")}
    paths = sorted({f"kvpath/{pp.name}-{i}->{dp.name}-{(i * KV_PATHS_PER_PREFILL_POD + k) % dp.pods}"
                    for pp, dp in zip(by_role["prefill"], by_role["decode"], strict=False)
                    for i in range(pp.pods) for k in range(KV_PATHS_PER_PREFILL_POD)})
    for path in paths:
        yield "kv_transfer_p50", path, _Shape(0.003)
        yield "kv_transfer_p99", path, _Shape(0.009, noise=0.2)
        yield "kv_failure_rate", path, _Shape(0.0005, noise=1.0)
        yield "kv_transfer_rate", path, _Shape(1.0)


def _values(shape: _Shape, t: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    daily = np.sin(2 * np.pi * t / 86400.0 + (seed % 628) / 100.0)
    v = shape.base * (1.0 + shape.swing * daily) * (1.0 + shape.noise * rng.standard_normal(t.size))
    return np.clip(v, 0.0, 1.0) if shape.unit else np.maximum(v, 0.0)


def seed_store(url: str, *, engines: int = 200, days: float = 7.0, raw_hours: float = 6.0,
               minute_hours: float | None = None, progress: Console | None = None) -> dict[str, Any]:
    """Fill the empty SQLite store at `url` with a fleet of `engines` over `days`; returns what was written.

    1-minute rollups cover the last `minute_hours` (the whole `days` unless given).
    """
    migrate.upgrade(url)
    store = SqlStore.open(url)
    try:
        return _seed(store, engines, days, raw_hours, days * 24.0 if minute_hours is None else minute_hours, progress)
    finally:
        store.close()


_RAW = ("name", "subject", "ts", "value")
_ROLLUP = ("resolution", "name", "subject", "bucket", "count", "sum", "min", "max")


def _seed(store: SqlStore, engines: int, days: float, raw_hours: float, minute_hours: float,
          progress: Console | None) -> dict[str, Any]:
    pools = _pools(engines)
    series = sorted(_series(pools), key=lambda s: (s[0], s[1]))
    wm60 = (T_END // 60) * 60 - 120.0
    wm3600 = (wm60 // 3600) * 3600
    raw_t = np.arange(T_END - raw_hours * 3600.0, T_END + 1e-6, INTERVAL)
    minute_t = np.arange(max(T_END - minute_hours * 3600.0, T_END - days * 86400.0) // 60 * 60, wm60, 60.0)
    hour_t = np.arange((T_END - days * 86400.0) // 3600 * 3600, wm3600, 3600.0)
    counts = {"series": len(series), "raw": 0, "minute": 0, "hour": 0}
    events = _event_gpus(series)
    for level, t, per in ((0, raw_t, 1), (60, minute_t, 4), (3600, hour_t, 240)):
        if progress:
            progress.print(f"seeding {'raw signals' if level == 0 else f'{level}s rollups'}: "
                           f"{len(series):,} series x {t.size:,} points")

        def rows(level: int = level, t: np.ndarray = t, per: int = per) -> Iterator[tuple[Any, ...]]:
            ts = t.tolist()
            for seed, (name, subject, shape) in enumerate(series):
                v = _values(shape, t, seed)
                if (name, subject) in events:
                    v = _events(t, v)
                if level == 0:
                    yield from zip([name] * t.size, [subject] * t.size, ts, v.tolist(), strict=True)
                else:
                    spread = 1.0 + 2.0 * shape.noise
                    yield from zip([level] * t.size, [name] * t.size, [subject] * t.size, ts, [per] * t.size,
                                   (v * per).tolist(), (v / spread).tolist(), (v * spread).tolist(), strict=True)

        written = (store.bulk_load("signals", _RAW, rows()) if level == 0
                   else store.bulk_load("signal_rollups", _ROLLUP, rows()))
        counts["raw" if level == 0 else "minute" if level == 60 else "hour"] += written
    store.set_rollup_watermarks(wm60, wm3600)
    _seed_fleet_rows(store, pools, days)
    return {"pools": [p.name for p in pools], "engines": sum(p.engines for p in pools),
            "gpus": sum(p.engines for p in pools), "rows": counts}


def _load(store: SqlStore, table: str, rows: list[dict[str, Any]]) -> None:
    if rows:
        columns = tuple(rows[0])
        store.bulk_load(table, columns, [tuple(r[c] for c in columns) for r in rows])


def _event_gpus(series: Sequence[tuple[str, str, _Shape]]) -> set[tuple[str, str]]:
    """A couple of GPUs that log XIDs and ECC errors, so the events table has rows."""
    gpus = sorted({s for n, s, _ in series if n == "gpu_xid_errors"})
    picked = gpus[3:4] + gpus[42:43]
    return {(n, g) for g in picked for n in ("gpu_xid_errors", "gpu_ecc_dbe_rate")}


def _events(t: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = v.copy()
    out[(t // 3600) % 29 == 7] = 1.0
    return out


def _seed_fleet_rows(store: SqlStore, pools: list[_Pool], days: float) -> None:
    """Targets, a week of findings with their actions and audit events, and canary verdicts."""
    targets = []
    for pool in pools:
        for i in range(pool.pods):
            up = not (pool.name == "decode" and i == 7)
            targets.append({"key": f"{pool.name}/{pool.name}-{i}/vllm", "url": f"http://{pool.name}-{i}:8000/metrics",
                            "pool": pool.name, "pod": f"{pool.name}-{i}", "role": pool.role, "source": "vllm", "up": up,
                            "last_scrape_at": T_END, "last_error": None if up else "connection refused",
                            "consecutive_failures": 0 if up else 12, "missing_families": {"families": []}})
    _load(store, "targets", targets)
    start = T_END - days * 86400.0
    findings: list[dict[str, Any]] = []
    actions: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    kinds = (("prefix_cache_hit_drop", "pool/{p}", "prefix_cache_hit_rate"),
             ("kv_transfer_lag", "engine/{p}/{p}-0/0", "nixl_xfer_time_p99"))
    n = int(days * 40)
    for i in range(n):
        opened = start + (i + 0.5) * (T_END - start) / n
        name = pools[i % len(pools)].name
        kind, subject, signal = kinds[i % 2]
        is_open = i >= n - 3
        findings.append({"id": i + 1, "kind": kind, "subject": subject.format(p=name), "state": "open" if is_open else "resolved",
                         "severity": ("warning", "critical", "info")[i % 3], "summary": f"{kind} on {name}",
                         "cause": "seeded for the benchmark",
                         "evidence": {"signal": signal, "value": 0.45, "baseline": 0.79, "threshold": 0.16},
                         "runbook": kind, "opened_at": opened, "updated_at": opened + 600.0,
                         "resolved_at": None if is_open else opened + 1800.0,
                         "resolve_reason": None if is_open else "back to normal"})
        if i % 3 == 0:
            aid = len(actions) + 1
            state = "proposed" if is_open else "succeeded"
            actions.append({"id": aid, "finding_id": i + 1, "kind": "scale_pool", "pool": name,
                            "params": {"from_replicas": 3, "replicas": 4}, "mode": "act", "state": state,
                            "reason": "absorb the extra prefill work", "created_at": opened + 60.0,
                            "approved_at": None if is_open else opened + 60.0, "approved_by": None if is_open else "rails",
                            "started_at": None if is_open else opened + 60.0,
                            "finished_at": None if is_open else opened + 90.0, "error": None,
                            "outcome": None if is_open else "recovered", "outcome_at": None if is_open else opened + 690.0})
            for k, ev in enumerate(("proposed",) if is_open else ("proposed", "approved", "started", "succeeded",
                                                                  "outcome:recovered")):
                events.append({"action_id": aid, "ts": opened + 60.0 + k, "event": ev, "detail": {}})
    _load(store, "findings", findings)
    _load(store, "actions", actions)
    _load(store, "action_events", events)
    _load(store, "verdicts", [
        {"gate": "rollout", "pool": pools[i % len(pools)].name, "baseline": "v1", "canary": "v2",
         "started_at": start + i * 3600.0, "finished_at": start + i * 3600.0 + 900.0,
         "result": ("pass", "fail", "inconclusive")[i % 3], "score": 90.0 - i % 30,
         "details": {"metrics": [{"name": "ttft_p95", "result": "pass", "explanation": "canary within 5% of baseline"}]}}
        for i in range(int(days * 8))
    ])


def _time_pages(url: str, repeats: int, ranges: dict[str, float]) -> dict[str, Any]:
    reader = ReadStore.open(url)
    pages: dict[str, Any] = {}
    try:
        for page, load in PAGES.items():
            by_range: dict[str, float] = {}
            cold: dict[str, float] = {}
            for label, span in ranges.items():
                runs = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    end = reader.latest_ts() or T_END  # every page anchors its range on the newest signal
                    load(reader, end - span, end)
                    runs.append((time.perf_counter() - t0) * 1000.0)
                cold[label] = round(runs[0], 1)
                by_range[label] = round(statistics.median(runs[1:]), 1)
            pages[page] = {"ms": max(by_range.values()), "by_range_ms": by_range, "first_run_ms": cold}
    finally:
        reader.engine.dispose()
    return pages


def run_dashboard_bench(engines: int = 200, days: float = 7.0, *, raw_hours: float = 6.0, minute_hours: float | None = None,
                        repeats: int = 3, ranges: dict[str, float] | None = None, db_path: str | None = None,
                        progress: Console | None = None) -> dict[str, Any]:
    """Seed a store (a temporary one unless `db_path` names a new file) and time each page's queries.

    Per page: `ms` is the slowest range's median over `repeats` runs after a first one,
    `by_range_ms` every range's median and `first_run_ms` the first run of each range.
    """
    ranges = {k: v for k, v in (ranges or RANGES).items() if v <= days * 86400.0} or {"1h": 3600.0}
    with tempfile.TemporaryDirectory() as tmp:
        path = db_path or os.path.join(tmp, "dashboard-bench.db")
        url = f"sqlite:///{path}"
        t0 = time.perf_counter()
        seeded = seed_store(url, engines=engines, days=days, raw_hours=raw_hours, minute_hours=minute_hours,
                            progress=progress)
        seed_s = time.perf_counter() - t0
        size = sum(os.path.getsize(path + suffix) for suffix in ("", "-wal") if os.path.exists(path + suffix))
        if progress:
            progress.print(f"seeded {sum(seeded['rows'][k] for k in ('raw', 'minute', 'hour')):,} rows "
                           f"in {seed_s:.0f} s ({size / 2**20:,.0f} MiB); timing {len(PAGES)} pages x {len(ranges)} ranges")
        pages = _time_pages(url, repeats, ranges)
    return {
        "store": "sqlite", "engines": seeded["engines"], "gpus": seeded["gpus"], "pools": seeded["pools"], "days": days,
        "raw_hours": raw_hours, "minute_hours": days * 24.0 if minute_hours is None else minute_hours,
        "rows": seeded["rows"], "db_bytes": size,
        "seed_seconds": round(seed_s, 1), "goal_ms": GOAL_MS, "pages": pages,
        "ok": all(p["ms"] <= GOAL_MS for p in pages.values()),
        "goals": goals_json(at_most(f"{page} page, slowest range, ms", p["ms"], GOAL_MS) for page, p in pages.items()),
    }
