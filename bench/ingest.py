"""Signal ingest benchmark: rows per second into the store, SQLite and PostgreSQL side by side.

Rows look like a real fleet's: ~40 signal names over engine subjects, one timestamp per tick.
Each store gets a fresh database so runs do not interfere.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from rich.console import Console

from collectors.types import Signal
from controlplane.goals import at_least, goals_json
from controlplane.store import migrate
from controlplane.store.db import scratch_database
from controlplane.store.writer import SqlStore

__all__ = ["fleet_rows", "run_ingest_bench"]

NAMES = [f"signal_{i:02d}" for i in range(40)]
# 5,000 pods write about 175,000 signals per 15 s interval (bench scrape), 11,700 rows/s; the store
# should take four times that, leaving room for rollups, retention and the dashboard's reads.
ROWS_PER_S_GOAL = 4 * 175_000 / 15


def fleet_rows(n: int, engines: int = 500, t0: float = 1_767_225_600.0) -> list[list[Signal]]:
    """n signals grouped by tick, as the loop would write them."""
    per_tick = engines * len(NAMES)
    ticks: list[list[Signal]] = []
    made = 0
    tick = 0
    while made < n:
        ts = t0 + 15.0 * tick
        batch = []
        for e in range(engines):
            subject = f"engine/pool-{e % 4}/pod-{e}/0"
            for name in NAMES:
                batch.append(Signal(ts, subject, name, float((e * 7 + tick) % 101) / 100.0))
                made += 1
                if made >= n or len(batch) >= per_tick:
                    break
            if made >= n:
                break
        ticks.append(batch)
        tick += 1
    return ticks


def _measure(store: SqlStore, rows: list[list[Signal]], batch: int) -> float:
    started = time.perf_counter()
    for tick_rows in rows:
        for i in range(0, len(tick_rows), batch):
            store.write_signals(tick_rows[i : i + batch])
    return time.perf_counter() - started


def run_ingest_bench(*, rows: int, batch: int, postgres_url: str | None, progress: Console) -> dict[str, Any]:
    """Measure each available store; PostgreSQL failures are reported, not hidden."""
    data = fleet_rows(rows)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        progress.print(f"SQLite (WAL): writing {rows:,} rows ...")
        results.append(_store("sqlite", f"sqlite:///{os.path.join(tmp, 'bench.db')}", data, rows, batch))
    if postgres_url:
        with scratch_database(postgres_url, "fleet_bench") as url:
            progress.print(f"PostgreSQL: writing {rows:,} rows ...")
            results.append(_store("postgresql", url, data, rows, batch))
    return {"rows": rows, "batch": batch, "results": results,
            "goals": goals_json(at_least(f"{r['store']} rows per second", r["rows_per_s"], ROWS_PER_S_GOAL) for r in results)}


def _store(kind: str, url: str, data: list[list[Signal]], rows: int, batch: int) -> dict[str, Any]:
    migrate.upgrade(url)
    store = SqlStore.open(url)
    try:
        secs = _measure(store, data, batch)
        size = store.signal_bytes()
    finally:
        store.close()
    return {"store": kind, "rows_per_s": rows / secs, "seconds": secs, "bytes_per_row": size / rows}
