"""The pages' queries give the same answers on PostgreSQL as on SQLite (the production store).

The full dashboard store (the demo plus the rest of a fleet) is copied row for row into a fresh
PostgreSQL database; every page's data is then loaded from both over several ranges.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select

from controlplane.store import migrate
from controlplane.store.db import make_engine
from controlplane.store.models import Base
from controlplane.store.queries import Plan, Point, ReadStore, Spread, plan
from dashboard.pages import PAGES

RANGES = (900.0, 3600.0, 86400.0, 7 * 86400.0)


def normalized(value: Any) -> Any:
    """Page data as comparable plain values: floats rounded, lists of points sorted."""
    if isinstance(value, Point | Spread):
        return normalized({k: getattr(value, k) for k in value.__slots__})
    if isinstance(value, dict):
        return {str(k): normalized(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [normalized(v) for v in value]
        return sorted(items, key=repr) if items and isinstance(items[0], dict) and "ts" in items[0] else items
    if isinstance(value, float):
        return round(value, 9) if math.isfinite(value) else value
    return value


def test_plan_picks_the_finest_level_within_budget() -> None:
    assert plan(0, 3600, 1) == Plan(0, 15.0)
    assert plan(0, 86400, 1).resolution == 60
    assert plan(0, 7 * 86400, 1).resolution == 60 and plan(0, 7 * 86400, 10).resolution == 3600
    assert plan(0, 3600, 1000).resolution == 3600  # a thousand series: the scan budget wins
    p = plan(0, 3600, 200)
    assert 200 * 3600 / p.step <= 6000  # and the buckets returned stay bounded


@pytest.mark.postgres
def test_pages_agree_on_postgresql(full_db: Path, pg_url: str) -> None:
    migrate.upgrade(pg_url)
    src, dst = make_engine(f"sqlite:///{full_db}"), make_engine(pg_url)
    try:
        with src.connect() as read, dst.begin() as write:
            for table in Base.metadata.sorted_tables:
                if table.name == "alembic_version":
                    continue
                rows = [dict(r) for r in read.execute(select(table)).mappings()]
                if rows:
                    write.execute(insert(table), rows)
        sqlite, pg = ReadStore(src), ReadStore(dst)
        end = sqlite.latest_ts()
        assert end is not None and pg.latest_ts() == end
        for span in RANGES:
            for page, load in PAGES.items():
                a, b = load(sqlite, end - span, end), load(pg, end - span, end)
                assert normalized(a) == normalized(b), (page, span)
        assert pg.subjects("gpu_utilization", "gpu/") == sqlite.subjects("gpu_utilization", "gpu/")
        assert pg.names("spec_acceptance_pos_") == ["spec_acceptance_pos_0", "spec_acceptance_pos_1", "spec_acceptance_pos_2"]
    finally:
        src.dispose()
        dst.dispose()
