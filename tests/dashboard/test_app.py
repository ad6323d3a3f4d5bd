"""The dashboard renders every page without exceptions on an empty store, an unmigrated one, the
demo's store and the demo's store with the rest of a fleet; links select what they name; SLOs
come from the fleet file; approvals go to the control plane's API, never to the store.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from streamlit.testing.v1 import AppTest

from controlplane.demo import run_demo
from controlplane.store import migrate
from controlplane.store.records import NewAction
from controlplane.store.writer import SqlStore
from tests.dashboard.conftest import copy_store

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
PAGES = ("fleet", "pool", "ep", "kv", "gpus", "incidents", "actions", "canary")
# What each page says on a store without its data.
EMPTY = {
    "fleet": "No pool has reported yet",
    "pool": "No pool has reported to the store yet",
    "ep": "No expert-parallel data in the store",
    "kv": "No KV-transfer data in the store",
    "gpus": "No GPU signals in the store",
    "incidents": "No incidents yet",
    "actions": "No actions yet",
    "canary": "No canary gate has run yet",
}
# The fewest charts each page draws on a store that has its data.
CHARTS = {"fleet": 3, "pool": 10, "ep": 4, "kv": 8, "gpus": 5, "incidents": 2, "actions": 1, "canary": 2}
# On the demo's own store: its decode workers' NIXL transfers and every engine's GPU, but no
# speculative decoding, EP or canary gates.
DEMO_CHARTS = {"fleet": 3, "pool": 7, "kv": 3, "gpus": 3, "incidents": 2, "actions": 1}
NOBODY = "http://127.0.0.1:9"  # no control plane answers here


def render(monkeypatch: pytest.MonkeyPatch, url: str, page: str = "fleet", *, query: dict[str, str] | None = None,
           env: dict[str, str] | None = None) -> AppTest:
    monkeypatch.setenv("FLEETCTL_STORE_URL", url)
    monkeypatch.setenv("FLEETCTL_API_URL", NOBODY)
    for name in ("FLEETCTL_API_TOKEN", "FLEETCTL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    if page != "fleet" or query:
        for k, v in (query or {}).items():
            at.query_params[k] = v
        if page != "fleet":
            at.switch_page(f"views/{page}.py")
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def charts(at: AppTest) -> int:
    return len(at.get("vega_lite_chart"))


def texts(at: AppTest) -> str:
    parts = [e.value for kind in ("info", "caption", "markdown", "warning", "success", "error") for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


def test_empty_store_says_so(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    migrate.upgrade(sqlite_url)
    at = render(monkeypatch, sqlite_url)
    assert any("holds no signals yet" in i.value for i in at.info)


def test_unmigrated_store_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    at = render(monkeypatch, sqlite_url)
    assert any("fleetctl db upgrade" in e.value for e in at.error)


def test_unreachable_store_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    at = render(monkeypatch, "postgresql://nobody@127.0.0.1:1/none", "pool")
    assert any("unreachable" in e.value for e in at.error)


@pytest.mark.slow
def test_demo_store_shows_incident_and_action(monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    summary = asyncio.run(run_demo(0.4, sqlite_url, Console(quiet=True), pace=False))
    assert summary.ok
    at = render(monkeypatch, sqlite_url)
    # The router incident resolved; an SLO-burn finding may stay open while its slow window drains.
    assert any(f["kind"] == "prefix_cache_hit_drop" and f["state"] == "resolved" for f in summary.findings)
    assert at.metric[0].value == str(sum(f["state"] == "open" for f in summary.findings))
    assert any("prefix-cache hit rate of prefill" in e.label for e in at.expander)
    assert len(at.dataframe) == 1


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_an_empty_store(monkeypatch: pytest.MonkeyPatch, sqlite_url: str, page: str) -> None:
    migrate.upgrade(sqlite_url)
    at = render(monkeypatch, sqlite_url, page)
    assert EMPTY[page] in texts(at)
    assert not at.error


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_the_demo_store(monkeypatch: pytest.MonkeyPatch, demo_db: Path, page: str) -> None:
    at = render(monkeypatch, f"sqlite:///{demo_db}", page)
    assert not at.error
    if page in ("ep", "canary"):  # the demo simulates neither
        assert EMPTY[page] in texts(at)
    else:
        assert charts(at) >= DEMO_CHARTS[page]


@pytest.mark.parametrize("page", PAGES)
def test_every_page_draws_its_charts_on_a_full_store(monkeypatch: pytest.MonkeyPatch, full_db: Path, page: str) -> None:
    at = render(monkeypatch, f"sqlite:///{full_db}", page)
    assert not at.error
    assert charts(at) >= CHARTS[page], texts(at)


def test_pages_read_what_the_store_holds(monkeypatch: pytest.MonkeyPatch, full_db: Path) -> None:
    url = f"sqlite:///{full_db}"
    ep = render(monkeypatch, url, "ep")
    assert [m.value for m in ep.metric if m.label.startswith("Hottest")] == ["moe-decode-0/2"]
    gpus = render(monkeypatch, url, "gpus")
    assert any("gpu-node-b/3" in str(v) for v in gpus.dataframe[1].value["GPU"])
    kv = render(monkeypatch, url, "kv")
    assert "KV path probe (prefill → decode pairs)" in [h.value for h in kv.header]
    canary = render(monkeypatch, url, "canary")
    metrics = canary.dataframe[-1].value
    assert list(metrics["name"]) == ["ttft", "tpot", "e2e", "error_rate"]
    assert any("anytime-valid" in r and "allowed +5.0%" in r for r in metrics["reason"])
    assert {m.label: str(m.value) for m in canary.metric}["fail"] == "1", [(m.label, m.value) for m in canary.metric]
    fleet = render(monkeypatch, url, "fleet")
    assert any("kv_precision · decode (+168 $/day)" in e.label for e in fleet.expander)
    assert list(fleet.dataframe[-1].value["error"]) == ["+10%"]


def test_links_select_the_pool_the_incident_and_the_action(monkeypatch: pytest.MonkeyPatch, demo_db: Path) -> None:
    url = f"sqlite:///{demo_db}"
    pool = render(monkeypatch, url, "pool", query={"pool": "prefill"})
    assert pool.selectbox(key="pool").value == "prefill"
    assert any(c.value.startswith("prefill (prefill)") for c in pool.caption)
    incident = render(monkeypatch, url, "incidents", query={"finding": "1"})
    assert incident.header[0].value.startswith("#1 ")
    assert "Pool prefill at the time" in [link.label for link in incident.get("page_link")]
    store = SqlStore.open(url)
    try:
        [rollback] = [a.id for a in store.actions() if a.kind == "rollback"]  # the autoscaler's scales come first
    finally:
        store.close()
    assert any(link.label.startswith(f"Action #{rollback} rollback") for link in incident.get("page_link"))
    action = render(monkeypatch, url, "actions", query={"action": str(rollback)})
    assert any(m.value.startswith(f"**#{rollback} rollback prefill**") for m in action.markdown)
    assert "Caused by incident #1" in [link.label for link in action.get("page_link")]


def test_choosing_a_pool_reloads_the_page_for_it(monkeypatch: pytest.MonkeyPatch, demo_db: Path) -> None:
    at = render(monkeypatch, f"sqlite:///{demo_db}", "pool")
    assert at.selectbox(key="pool").value == "decode"
    at.selectbox(key="pool").select("prefill").run()
    assert not at.exception
    assert any(c.value.startswith("prefill (prefill)") for c in at.caption)
    [engines] = [m.value for m in at.metric if m.label == "Engines reporting"]
    assert int(engines) > 3  # the demo scaled prefill up from 3
    # Prefill's TTFT objective is in the demo's fleet file: the share of its requests over it is drawn.
    assert "Requests over the SLO" in texts(at) and "no share yet" not in texts(at)


def test_a_link_can_pin_the_time_range(monkeypatch: pytest.MonkeyPatch, demo_db: Path) -> None:
    from controlplane.store.queries import ReadStore

    end = ReadStore.open(f"sqlite:///{demo_db}").latest_ts() - 600
    at = render(monkeypatch, f"sqlite:///{demo_db}", "pool", query={"end": str(end), "range": "3 h"})
    assert at.selectbox(key="range").value == "3 h"
    assert any(c.value.startswith("Pinned to") for c in at.sidebar.caption)
    for odd in ("inf", "nan", "1e20"):  # no time a store holds: the page is live, not a traceback
        at = render(monkeypatch, f"sqlite:///{demo_db}", "pool", query={"end": odd})
        assert not at.exception and any(c.value.startswith("Live") for c in at.sidebar.caption)


def test_slos_come_from_the_fleet_file(monkeypatch: pytest.MonkeyPatch, demo_db: Path, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("""
mode: propose
pools:
  - {name: prefill, role: prefill, model: m, replicas: {min: 2, max: 6}, slo: {ttft_p95: 500ms}}
  - {name: decode, role: decode, model: m, replicas: {min: 2, max: 6}, slo: {tpot_p95: 50ms}}
""")
    at = render(monkeypatch, f"sqlite:///{demo_db}", env={"FLEETCTL_CONFIG": str(fleet)})
    table = at.dataframe[0].value.set_index("pool")
    assert table.loc["prefill", "TTFT SLO"] == "500 ms" and table.loc["decode", "TPOT SLO"] == "50 ms"
    assert "TTFT" in table.loc["prefill", "SLO status"]
    assert [m.value for m in at.metric if m.label == "Mode"] == ["propose"]  # the API is down: the file says


def test_an_unreadable_fleet_file_is_a_warning(monkeypatch: pytest.MonkeyPatch, demo_db: Path, tmp_path: Path) -> None:
    at = render(monkeypatch, f"sqlite:///{demo_db}", "pool", env={"FLEETCTL_CONFIG": str(tmp_path / "missing.yaml")})
    assert any("cannot be used" in w.value for w in at.warning)


class FakeApi:
    """The control plane's API as the dashboard sees it: records requests, answers as told."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answer: tuple[int, dict[str, Any]] = (200, {})
        self.status: dict[str, Any] = {"mode": "propose", "ready": True, "status": "ready", "last_tick_age_s": 3.0}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._reply(200, api.status)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                self._reply(*api.answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def fake_api() -> Iterator[FakeApi]:
    api = FakeApi()
    yield api
    api.close()


@pytest.fixture
def proposal_db(demo_db: Path, tmp_path: Path) -> tuple[str, int]:
    """The demo store with one proposal awaiting approval."""
    path = tmp_path / "proposal.db"
    copy_store(demo_db, path)
    store = SqlStore.open(f"sqlite:///{path}")
    try:
        a = store.create_action(NewAction(1, "scale_pool", "prefill", {"from_replicas": 4, "replicas": 5}, "propose",
                                          "absorb the extra prefill work"), 1.0)
    finally:
        store.close()
    return f"sqlite:///{path}", a.id


def test_mode_and_health_come_from_the_api(monkeypatch: pytest.MonkeyPatch, demo_db: Path, fake_api: FakeApi) -> None:
    at = render(monkeypatch, f"sqlite:///{demo_db}", env={"FLEETCTL_API_URL": fake_api.url})
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Mode"] == "propose" and metrics["Control plane"] == "ready"


def test_a_replica_on_standby_is_not_shown_as_a_ready_control_plane(monkeypatch: pytest.MonkeyPatch, demo_db: Path,
                                                                    fake_api: FakeApi) -> None:
    """A follower is ready on standby, and a Service reaches one exactly when the leader stalls."""
    fake_api.status = {"mode": "propose", "ready": True, "leading": False, "status": "standby",
                       "reason": "this replica does not lead"}
    at = render(monkeypatch, f"sqlite:///{demo_db}", env={"FLEETCTL_API_URL": fake_api.url})
    [shown] = [m for m in at.metric if m.label == "Control plane"]
    assert shown.value == "standby" and "newest signal in the store" in shown.help


def test_without_a_token_the_actions_page_shows_the_command(monkeypatch: pytest.MonkeyPatch,
                                                            proposal_db: tuple[str, int]) -> None:
    url, aid = proposal_db
    at = render(monkeypatch, url, "actions")
    assert any(f"fleetctl actions approve {aid}" in c.value for c in at.code)
    assert not at.button


def test_approving_calls_the_control_plane_with_the_token(monkeypatch: pytest.MonkeyPatch, proposal_db: tuple[str, int],
                                                          fake_api: FakeApi) -> None:
    url, aid = proposal_db
    fake_api.answer = (200, {"id": aid, "state": "approved", "by": "alice"})
    at = render(monkeypatch, url, "actions", env={"FLEETCTL_API_URL": fake_api.url, "FLEETCTL_API_TOKEN": "t0ken"})
    at.text_input(key=f"by_{aid}").input("alice")
    at.button(key=f"ok_{aid}").click().run()
    assert not at.exception
    assert fake_api.requests == [{"path": f"/api/actions/{aid}/approve", "auth": "Bearer t0ken", "body": {"by": "alice"}}]
    assert any(f"action {aid} approved by alice" in s.value for s in at.success)
    # The dashboard asked; the store is unchanged until the control plane writes it.
    store = SqlStore.open(url)
    try:
        assert [a.id for a in store.actions(states=["proposed"])] == [aid]
    finally:
        store.close()


def test_behind_a_proxy_a_request_without_its_user_cannot_approve(monkeypatch: pytest.MonkeyPatch,
                                                                 proposal_db: tuple[str, int], fake_api: FakeApi) -> None:
    # A dashboard configured behind an authenticating proxy, reached around it: no one to record the decision as, and
    # no name typed in its place.
    url, aid = proposal_db
    at = render(monkeypatch, url, "actions", env={"FLEETCTL_API_URL": fake_api.url, "FLEETCTL_API_TOKEN": "t0ken",
                                                  "FLEETCTL_DASHBOARD_USER_HEADER": "X-Forwarded-Email"})
    assert not at.button and not at.text_input
    assert any("X-Forwarded-Email" in w.value for w in at.warning)
    assert any(f"fleetctl actions approve {aid}" in code.value for code in at.code)


def test_behind_a_proxy_the_signed_in_user_decides(monkeypatch: pytest.MonkeyPatch, proposal_db: tuple[str, int],
                                                  fake_api: FakeApi) -> None:
    from dashboard import common

    url, aid = proposal_db
    fake_api.answer = (200, {"id": aid, "state": "approved", "by": "alice@example.com"})
    monkeypatch.setattr(common, "approver", lambda: common.Approver("X-Forwarded-Email", "alice@example.com"))
    at = render(monkeypatch, url, "actions", env={"FLEETCTL_API_URL": fake_api.url, "FLEETCTL_API_TOKEN": "t0ken"})
    assert not at.text_input  # the name is the proxy's, not one typed
    at.button(key=f"ok_{aid}").click().run()
    assert fake_api.requests[0]["body"] == {"by": "alice@example.com"}


def test_a_refused_decision_is_shown(monkeypatch: pytest.MonkeyPatch, proposal_db: tuple[str, int],
                                     fake_api: FakeApi) -> None:
    url, aid = proposal_db
    fake_api.answer = (409, {"error": f"action {aid} is not awaiting approval (it is approved)", "code": 409})
    at = render(monkeypatch, url, "actions", env={"FLEETCTL_API_URL": fake_api.url, "FLEETCTL_API_TOKEN": "t0ken"})
    at.button(key=f"no_{aid}").click().run()
    assert fake_api.requests[0]["path"] == f"/api/actions/{aid}/reject"
    assert any("HTTP 409" in e.value and "not awaiting approval" in e.value for e in at.error)


def test_a_store_that_stops_answering_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, demo_db: Path) -> None:
    from controlplane.errors import StoreUnavailable
    from dashboard import pages

    def down(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise StoreUnavailable("findings_between: connection refused")

    monkeypatch.setitem(pages.PAGES, "incidents", down)
    at = render(monkeypatch, f"sqlite:///{demo_db}", "incidents")
    assert any("stopped answering" in e.value and "connection refused" in e.value for e in at.error)


def test_read_errors_become_store_unavailable(sqlite_url: str) -> None:
    from controlplane.errors import StoreUnavailable
    from controlplane.store.queries import ReadStore

    migrate.upgrade(sqlite_url)
    store = ReadStore.open(sqlite_url)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE signals")
    with pytest.raises(StoreUnavailable, match="latest_ts: no such table"):
        store.latest_ts()
    store.engine.dispose()


def test_what_the_gate_api_was_sent_shows_as_typed_never_as_a_link() -> None:
    from dashboard.common import literal

    assert literal("pod=~[login](https://evil.example)`x") == "`pod=~[login](https://evil.example)'x`"


@pytest.mark.postgres
@pytest.mark.parametrize(("page", "key"), [("actions", "action"), ("incidents", "finding")])
def test_a_link_to_an_id_no_store_holds_shows_the_page(monkeypatch: pytest.MonkeyPatch, pg_url: str, page: str,
                                                      key: str) -> None:
    # A superscript digit is a digit to str.isdigit(), and PostgreSQL's INTEGER ends at 2^31-1.
    migrate.upgrade(pg_url)
    for wanted in ("\u00b2", "99999999999"):
        at = render(monkeypatch, pg_url, page, query={key: wanted})
        assert EMPTY[page] in texts(at) and not at.error


def test_the_pool_pages_cards_show_the_newest_point_not_the_last_buckets_mean(monkeypatch: pytest.MonkeyPatch,
                                                                             sqlite_url: str) -> None:
    # A day's range is read in hour-wide buckets: the card once showed the hour's mean (589 ms) where the fleet page
    # showed the TTFT of now (3.00 s).
    from collectors.types import Signal

    end = 1_700_000_000 // 3600 * 3600 + 3300.0
    migrate.upgrade(sqlite_url)
    store = SqlStore.open(sqlite_url)
    ts, points = end - 86_400, []
    while ts <= end:
        points += [Signal(ts, "pool/chat", "ttft_p95", 3.0 if ts >= end - 300 else 0.3),
                   Signal(ts, "pool/chat", "engines_reporting", 4.0)]
        ts += 60.0
    store.write_signals(points)
    store.close()
    at = render(monkeypatch, sqlite_url, "pool", query={"range": "24 h", "pool": "chat"})
    assert {m.label: m.value for m in at.metric}["TTFT p95"] == "3.00 s"
