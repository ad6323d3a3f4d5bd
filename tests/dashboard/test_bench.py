"""The dashboard benchmark seeds a store and times every page's queries (a small fleet here)."""

from __future__ import annotations

from pathlib import Path

from bench.dashboard import run_dashboard_bench
from controlplane.store.queries import ReadStore
from dashboard.pages import PAGES


def test_bench_times_every_page_on_a_seeded_store(tmp_path: Path) -> None:
    db = tmp_path / "bench.db"
    result = run_dashboard_bench(engines=16, days=1, raw_hours=1, minute_hours=3, repeats=1,
                                 ranges={"1h": 3600.0, "24h": 86400.0}, db_path=str(db))
    assert set(result["pages"]) == set(PAGES)
    assert result["engines"] == result["gpus"] == 16
    assert all(r > 0 for r in result["rows"].values())
    for page in result["pages"].values():
        assert set(page["by_range_ms"]) == {"1h", "24h"} and page["ms"] == max(page["by_range_ms"].values())
    # Each page's slowest range is judged against the 300 ms goal. Whether it holds is the benchmark's finding
    # (`fleetctl bench dashboard`), not this test's: one page read stalled 417 ms on two busy cores.
    goals = {g["name"]: g for g in result["goals"]}
    assert set(goals) == {f"{page} page, slowest range, ms" for page in PAGES}
    for page, r in result["pages"].items():
        g = goals[f"{page} page, slowest range, ms"]
        assert (g["value"], g["goal"], g["holds"]) == (r["ms"], "<= 300", r["ms"] <= 300.0), page
    assert result["ok"] is all(g["holds"] for g in goals.values())
    # The seeded store is what the pages read: every page finds its data.
    store = ReadStore.open(f"sqlite:///{db}")
    try:
        end = store.latest_ts()
        assert end is not None
        assert PAGES["ep"](store, end - 3600, end)["pool"] == "moe-decode"
        assert len(PAGES["gpus"](store, end - 3600, end)["gpus"]) == 16
        assert [s["prefix"] for s in PAGES["kv"](store, end - 3600, end)["sources"]] == ["kvpath/", "engine/"]
        assert PAGES["incidents"](store, end - 86400, end)["findings"]
    finally:
        store.engine.dispose()
