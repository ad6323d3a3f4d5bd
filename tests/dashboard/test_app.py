"""The dashboard renders without exceptions on an empty store, an unmigrated one and a demo store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rich.console import Console
from streamlit.testing.v1 import AppTest

from controlplane.demo import run_demo
from controlplane.store import migrate

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


def render(monkeypatch: pytest.MonkeyPatch, url: str) -> AppTest:
    monkeypatch.setenv("FLEETCTL_STORE_URL", url)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_empty_store_says_so(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    migrate.upgrade(sqlite_url)
    at = render(monkeypatch, sqlite_url)
    assert any("holds no signals yet" in i.value for i in at.info)


def test_unmigrated_store_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    at = render(monkeypatch, sqlite_url)
    assert any("fleetctl db upgrade" in e.value for e in at.error)


@pytest.mark.slow
def test_demo_store_shows_incident_and_action(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    summary = asyncio.run(run_demo(0.4, sqlite_url, Console(quiet=True), pace=False))
    assert summary.ok
    at = render(monkeypatch, sqlite_url)
    assert at.metric[0].value == "0"  # the demo's incident resolved
    assert any("prefix-cache hit rate of prefill" in e.label for e in at.expander)
    assert len(at.dataframe) == 1
