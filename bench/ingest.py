"""Signal ingest benchmark: rows per second into the store, SQLite and PostgreSQL side by side.

Rows look like a real fleet's: ~40 signal names over engine subjects, one timestamp per tick.
Each store gets a fresh database so runs do not interfere.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from typing import Any

from rich.console import Console
from sqlalchemy import create_engine, text

from collectors.types import Signal
from controlplane.errors import StoreUnavailable
from controlplane.store import migrate
from controlplane.store.db import normalize_url, redact
from controlplane.store.writer import SqlStore

__all__ = ["fleet_rows", "run_ingest_bench"]

NAMES = [f"signal_{i:02d}" for i in range(40)]


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


def run_ingest_bench(*, rows: int, batch: int, postgres_url: str | None, progress: Console) -> list[dict[str, Any]]:
    """Measure each available store; PostgreSQL failures are reported, not hidden."""
    data = fleet_rows(rows)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        url = f"sqlite:///{path}"
        migrate.upgrade(url)
        store = SqlStore.open(url)
        progress.print(f"SQLite (WAL): writing {rows:,} rows ...")
        secs = _measure(store, data, batch)
        store.close()
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        results.append({"store": "sqlite", "rows_per_s": rows / secs, "seconds": secs, "bytes_per_row": size / rows})
    if postgres_url:
        results.append(_postgres(postgres_url, data, rows, batch, progress))
    return results


def _postgres(url: str, data: list[list[Signal]], rows: int, batch: int, progress: Console) -> dict[str, Any]:
    admin_url = normalize_url(url)
    name = f"fleet_bench_{uuid.uuid4().hex[:8]}"
    try:
        admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        raise StoreUnavailable(f"PostgreSQL at {redact(url)} is unavailable for the benchmark: {exc}") from None
    db_url = admin.url.set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(db_url)
        store = SqlStore.open(db_url)
        progress.print(f"PostgreSQL: writing {rows:,} rows ...")
        secs = _measure(store, data, batch)
        with store.engine.connect() as conn:
            size = conn.execute(text("SELECT pg_total_relation_size('signals')")).scalar_one()
        store.close()
        return {"store": "postgresql", "rows_per_s": rows / secs, "seconds": secs, "bytes_per_row": size / rows}
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
