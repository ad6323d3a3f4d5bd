"""Alert delivery to a real webhook receiver on 127.0.0.1, on the loop's virtual clock.

Covers: grouping by alertname and pool with group_wait; a firing then a resolved notification
with every Alertmanager v4 field; group_interval and repeat_interval; a severity change as one
alert resolving and another firing; retries with backoff on 500 and a retry at the next interval
after giving up; send_resolved off; max_alerts; an unreachable receiver and a raising hook never
break a tick of the real loop; no token, password or URL secret in any log line; the
`alerting` section of the fleet file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from controlplane.actuators.base import StaticTargets
from controlplane.actuators.dryrun import DryRunActuator
from controlplane.alerting import ZERO_TIME, AlertNotifier, rfc3339
from controlplane.clock import VirtualClock
from controlplane.config import Alerting, parse_config
from controlplane.errors import ConfigError, StoreUnavailable
from controlplane.loop import ControlLoop, TickReport
from controlplane.observe import Observation
from controlplane.store.records import FindingRecord, NewFinding
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore
from controlplane.telemetry import Telemetry
from policies.types import FindingKey, FindingReport, PolicyInput, PolicyResult, Severity

T0 = 1_767_225_600.0
TOKEN = "tok-3f9a1c77e2"
PASSWORD = "pw-8d2e4b"
V4_KEYS = {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels", "commonLabels",
           "commonAnnotations", "externalURL", "alerts"}
ALERT_KEYS = {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}


@dataclass
class Receiver:
    """A webhook endpoint that records every POST and answers with scripted status codes."""

    url: str
    server: ThreadingHTTPServer
    statuses: list[int] = field(default_factory=list)  # answered in order, then 200
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def payloads(self) -> list[dict[str, Any]]:
        """Bodies of the requests that were answered 2xx."""
        return [r["body"] for r in self.requests if r["status"] < 300]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status = rec.statuses.pop(0) if rec.statuses else 200
            rec.requests.append({"path": self.path, "headers": dict(self.headers), "body": body, "status": status})
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec = Receiver(f"http://127.0.0.1:{server.server_address[1]}/hook", server)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield rec
    server.shutdown()
    server.server_close()
    thread.join()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alerting(url: str, **over: Any) -> Alerting:
    receiver = {"name": "oncall", "url": url, **over.pop("receiver", {})}
    return Alerting.model_validate({"receivers": [receiver], "group_wait": "30s", "group_interval": "5m",
                                    "repeat_interval": "4h", "runbook_base_url": "https://runbooks.test/fleet",
                                    "external_url": "https://fleet.test", **over})


def notifier(config: Alerting, **kw: Any) -> AlertNotifier:
    delays: list[float] = []

    async def no_wait(seconds: float) -> None:
        delays.append(seconds)

    n = AlertNotifier(config, registry=CollectorRegistry(), sleep=no_wait, backoff_s=0.5, **kw)
    n.delays = delays  # type: ignore[attr-defined]
    return n


def count(n: AlertNotifier, result: str, receiver: str = "oncall") -> float:
    value = n.registry.get_sample_value("fleet_controlplane_alert_notifications_total",
                                        {"receiver": receiver, "result": result})
    return value or 0.0


def finding(fid: int, kind: str, subject: str, severity: str = "warning", opened_at: float = T0) -> FindingRecord:
    return FindingRecord(id=fid, kind=kind, subject=subject, state="open", severity=severity,
                         summary=f"{kind} on {subject}", cause=f"because of {subject}", evidence={}, runbook=kind,
                         opened_at=opened_at, updated_at=opened_at, resolved_at=None)


async def step(n: AlertNotifier, ts: float, **lists: list[FindingRecord]) -> None:
    await n.on_report(TickReport(ts=ts, **lists))
    await n.drain()


async def test_alerts_are_grouped_by_alertname_and_pool_after_group_wait(receiver: Receiver) -> None:
    n = notifier(alerting(receiver.url))
    opened = [finding(1, "prefix_cache_hit_drop", "pool/prefill"),
              finding(2, "kv_transfer_lag", "engine/decode/d0/0"),
              finding(3, "kv_transfer_lag", "engine/decode/d0/1")]
    await step(n, T0, opened=opened)
    await step(n, T0 + 15)
    assert receiver.requests == [], "a new group waits group_wait"
    await step(n, T0 + 30)
    groups = {json.dumps(p["groupLabels"], sort_keys=True): p for p in receiver.payloads}
    assert sorted(groups) == ['{"alertname": "kv_transfer_lag", "pool": "decode"}',
                              '{"alertname": "prefix_cache_hit_drop", "pool": "prefill"}']
    kv = groups['{"alertname": "kv_transfer_lag", "pool": "decode"}']
    assert [a["labels"]["engine"] for a in kv["alerts"]] == ["0", "1"]
    assert kv["commonLabels"] == {"alertname": "kv_transfer_lag", "pod": "d0", "pool": "decode", "severity": "warning"}
    assert kv["commonAnnotations"] == {"runbook_url": "https://runbooks.test/fleet/kv_transfer_lag"}
    assert kv["groupKey"] == '{}:{alertname="kv_transfer_lag", pool="decode"}'
    await n.aclose()


async def test_firing_then_resolved_with_every_v4_field(receiver: Receiver) -> None:
    n = notifier(alerting(receiver.url))
    f = finding(7, "prefix_cache_hit_drop", "pool/prefill", opened_at=T0 - 15)
    await step(n, T0, opened=[f])
    await step(n, T0 + 30)
    [firing] = receiver.payloads
    assert set(firing) == V4_KEYS
    assert (firing["version"], firing["status"], firing["receiver"], firing["truncatedAlerts"]) == (
        "4", "firing", "oncall", 0)
    assert firing["externalURL"] == "https://fleet.test"
    assert firing["groupLabels"] == {"alertname": "prefix_cache_hit_drop", "pool": "prefill"}
    [alert] = firing["alerts"]
    assert set(alert) == ALERT_KEYS
    assert alert["labels"] == {"alertname": "prefix_cache_hit_drop", "severity": "warning", "subject": "pool/prefill",
                               "pool": "prefill"}
    assert alert["annotations"] == {"summary": "prefix_cache_hit_drop on pool/prefill",
                                    "description": "because of pool/prefill",
                                    "runbook_url": "https://runbooks.test/fleet/prefix_cache_hit_drop"}
    assert (alert["status"], alert["startsAt"], alert["endsAt"]) == ("firing", "2025-12-31T23:59:45.000Z", ZERO_TIME)
    assert alert["generatorURL"] == "https://fleet.test/incidents" and re.fullmatch(r"[0-9a-f]{16}", alert["fingerprint"])
    assert firing["commonAnnotations"] == alert["annotations"]

    await step(n, T0 + 100, resolved=[f])
    await step(n, T0 + 315)
    assert len(receiver.payloads) == 1, "changes wait for group_interval after the last notification"
    await step(n, T0 + 330)
    resolved = receiver.payloads[1]
    assert set(resolved) == V4_KEYS and resolved["status"] == "resolved"
    [done] = resolved["alerts"]
    assert (done["status"], done["startsAt"], done["endsAt"]) == ("resolved", alert["startsAt"], rfc3339(T0 + 100))
    assert done["fingerprint"] == alert["fingerprint"] and resolved["groupKey"] == firing["groupKey"]
    await step(n, T0 + 5 * 3600)
    assert len(receiver.payloads) == 2, "a resolved group is gone: nothing repeats"
    await n.aclose()


async def test_unchanged_groups_repeat_only_after_repeat_interval(receiver: Receiver) -> None:
    n = notifier(alerting(receiver.url, repeat_interval="15m", group_wait=0))
    await step(n, T0, opened=[finding(1, "saturation", "pool/decode")])
    assert len(receiver.payloads) == 1, "group_wait 0: at once"
    for minutes in (5, 10):
        await step(n, T0 + minutes * 60)
    assert len(receiver.payloads) == 1
    await step(n, T0 + 15 * 60)
    assert len(receiver.payloads) == 2 and receiver.payloads[1] == receiver.payloads[0]
    await n.aclose()


async def test_severity_change_resolves_the_old_alert_and_fires_a_new_one(receiver: Receiver) -> None:
    n = notifier(alerting(receiver.url, group_wait=0))
    f = finding(1, "slo_burn", "pool/prefill")
    await step(n, T0, opened=[f])
    await step(n, T0 + 60, updated=[replace(f, severity="critical", summary="worse")])
    await step(n, T0 + 300)
    [first, second] = receiver.payloads
    assert [a["labels"]["severity"] for a in first["alerts"]] == ["warning"]
    by_severity = {a["labels"]["severity"]: a for a in second["alerts"]}
    assert by_severity["warning"]["status"] == "resolved" and by_severity["warning"]["endsAt"] == rfc3339(T0 + 60)
    assert by_severity["critical"]["status"] == "firing" and by_severity["critical"]["startsAt"] == rfc3339(T0 + 60)
    assert second["status"] == "firing" and second["commonLabels"]["alertname"] == "slo_burn"
    await n.aclose()


async def test_retries_with_backoff_on_500(receiver: Receiver) -> None:
    receiver.statuses = [500, 503]
    n = notifier(alerting(receiver.url, group_wait=0))
    await step(n, T0, opened=[finding(1, "gpu_health", "gpu/node-a/3", severity="critical")])
    assert [r["status"] for r in receiver.requests] == [500, 503, 200]
    assert n.delays == [0.5, 1.0]  # type: ignore[attr-defined]
    assert (count(n, "sent"), count(n, "retried"), count(n, "failed")) == (1, 2, 0)
    assert receiver.requests[0]["body"] == receiver.requests[2]["body"]
    await n.aclose()


async def test_a_failed_notification_is_sent_again_at_the_next_interval(receiver: Receiver) -> None:
    receiver.statuses = [500, 500, 500]
    n = notifier(alerting(receiver.url, group_wait=0))
    await step(n, T0, opened=[finding(1, "saturation", "pool/decode")])
    assert (count(n, "failed"), receiver.payloads) == (1, [])
    await step(n, T0 + 300)
    assert len(receiver.payloads) == 1 and count(n, "sent") == 1
    await n.aclose()


async def test_client_errors_are_not_retried(receiver: Receiver) -> None:
    receiver.statuses = [400]
    n = notifier(alerting(receiver.url, group_wait=0))
    await step(n, T0, opened=[finding(1, "saturation", "pool/decode")])
    assert len(receiver.requests) == 1 and count(n, "failed") == 1 and count(n, "retried") == 0
    await n.aclose()


async def test_send_resolved_off_and_max_alerts(receiver: Receiver) -> None:
    n = notifier(alerting(receiver.url, group_wait=0, group_by=["alertname"],
                          receiver={"send_resolved": False, "max_alerts": 2}))
    fs = [finding(i, "gpu_health", f"gpu/node-a/{i}") for i in range(3)]
    await step(n, T0, opened=fs)
    [first] = receiver.payloads
    assert len(first["alerts"]) == 2 and first["truncatedAlerts"] == 1
    await step(n, T0 + 60, resolved=fs)
    await step(n, T0 + 300)
    assert len(receiver.payloads) == 1, "resolved alerts are not sent to this receiver"
    await step(n, T0 + 400, opened=[finding(9, "gpu_health", "gpu/node-b/0")])
    await step(n, T0 + 430)
    assert receiver.payloads[1]["status"] == "firing", "the group starts over"
    await n.aclose()


async def test_secrets_stay_out_of_every_log_line(receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    port = int(receiver.url.split(":")[2].split("/")[0])
    env = {"HOOK_TOKEN": TOKEN, "HOOK_URL": f"http://bob:{PASSWORD}@127.0.0.1:{port}/hook/{TOKEN}x?key={PASSWORD}y"}
    config = Alerting.model_validate({"receivers": [
        {"name": "bearer", "url": receiver.url, "bearer_token_env": "HOOK_TOKEN"},
        {"name": "in-url", "url_env": "HOOK_URL"},
        {"name": "dead", "url": f"http://127.0.0.1:{closed_port()}/hook", "bearer_token_env": "HOOK_TOKEN"},
    ], "group_wait": 0})
    receiver.statuses = [500]
    n = notifier(config, env=env)
    await step(n, T0, opened=[finding(1, "saturation", "pool/decode")])
    headers = {r["path"]: r["headers"] for r in receiver.requests}
    assert headers["/hook"]["Authorization"] == f"Bearer {TOKEN}"
    assert headers[f"/hook/{TOKEN}x?key={PASSWORD}y"]["Authorization"].startswith("Basic ")
    assert count(n, "sent", "bearer") == 1 and count(n, "sent", "in-url") == 1 and count(n, "failed", "dead") == 1
    text = "\n".join(f"{r.name} {r.getMessage()}" for r in caplog.records)
    assert "dead (http://127.0.0.1:" in text and "ConnectError" in text
    assert any(r.name == "httpx" for r in caplog.records), "httpx quotes request URLs: its lines are checked too"
    for secret in (TOKEN, PASSWORD, "bob:"):
        assert secret not in text
    await n.aclose()


def test_missing_secrets_are_configuration_errors() -> None:
    config = Alerting.model_validate({"receivers": [{"name": "a", "url": "http://x.test/", "bearer_token_env": "NOPE"}]})
    with pytest.raises(ConfigError, match="NOPE is not set"):
        AlertNotifier(config, env={})
    config = Alerting.model_validate({"receivers": [{"name": "a", "url_env": "HOOK"}]})
    with pytest.raises(ConfigError, match="HOOK does not hold an http"):
        AlertNotifier(config, env={"HOOK": "ftp://x"})


def test_the_fleet_file_alerting_section() -> None:
    base = "pools: [{name: p, role: prefill, model: m, replicas: {max: 2}}]\n"
    cfg = parse_config(base + "alerting:\n  receivers: [{name: pager, url: 'https://am.test/hook', bearer_token_env: AM_TOKEN}]\n"
                              "  group_wait: 10s\n  repeat_interval: 1h\n")
    assert cfg.alerting is not None
    assert (cfg.alerting.group_by, cfg.alerting.group_wait, cfg.alerting.group_interval, cfg.alerting.repeat_interval) == (
        ["alertname", "pool"], 10.0, 300.0, 3600.0)
    assert cfg.alerting.receivers[0].send_resolved is True
    bad = [
        ("[{name: a, url: 'https://u:pw@am.test/'}]", "carries credentials"),
        ("[{name: a, url: 'https://am.test/', token: x}]", "Extra inputs are not permitted"),
        ("[{name: a}]", "either url or url_env"),
        ("[{name: a, url: 'https://a.test/'}, {name: a, url: 'https://b.test/'}]", "used more than once"),
    ]
    for receivers, problem in bad:
        with pytest.raises(ConfigError, match=problem):
            parse_config(base + f"alerting:\n  receivers: {receivers}\n")
    for group_by, problem in (("['...', pool]", "cannot be given with other labels"),
                              ("[pool, 'team-a']", "'team-a': not a label name")):
        with pytest.raises(ConfigError, match=problem):
            parse_config(base + f"alerting:\n  receivers: [{{name: a, url: 'https://a.test/'}}]\n  group_by: {group_by}\n")


# through the real loop ----------------------------------------------------------------------

class EmptySource:
    async def observe(self, now: float) -> Observation:
        return Observation()


class Scripted:
    """A policy that reports what the test sets: subject -> severity."""

    kind = "saturation"

    def __init__(self) -> None:
        self.firing: dict[str, Severity] = {}

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        result = PolicyResult()
        for subject, severity in self.firing.items():
            result.findings.append(FindingReport(FindingKey(self.kind, subject), severity, f"{subject} saturated",
                                                 "queue grows", {"waiting": 9}, self.kind))
        result.resolved = [(k, "gone") for k in inp.open_findings if k.subject not in self.firing]
        return result


def loop_with(store: SqlStore, policy: Scripted) -> tuple[ControlLoop, VirtualClock]:
    cfg = parse_config("pools: [{name: decode, role: decode, model: m, replicas: {max: 4}}]\n")
    clock = VirtualClock(T0)
    loop = ControlLoop(config=cfg, source=EmptySource(), store=ThreadedStore(store), policies=[policy],
                       actuator=DryRunActuator(StaticTargets([]), ["decode"]), clock=clock, telemetry=Telemetry())
    return loop, clock


async def test_the_loop_delivers_its_findings_and_an_unreachable_receiver_never_breaks_a_tick(
    receiver: Receiver, sqlite_store: SqlStore, caplog: pytest.LogCaptureFixture,
) -> None:
    policy = Scripted()
    loop, clock = loop_with(sqlite_store, policy)
    config = Alerting.model_validate({"receivers": [
        {"name": "oncall", "url": receiver.url},
        {"name": "dead", "url": f"http://127.0.0.1:{closed_port()}/", "retries": 1},
    ], "group_wait": 0, "group_interval": "1m"})
    n = notifier(config)
    loop.on_report = n.on_report
    await loop.start()
    policy.firing = {"pool/decode": Severity.WARNING}
    reports = []
    for _ in range(6):
        reports.append(await loop.tick())
        await n.drain()
        clock.advance(60)  # one group_interval per tick: each change goes out on its own
        if len(reports) == 2:
            policy.firing = {"pool/decode": Severity.CRITICAL}
        if len(reports) == 4:
            policy.firing = {}
    assert [(len(r.opened), len(r.updated), len(r.resolved)) for r in reports] == [
        (1, 0, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0), (0, 0, 1), (0, 0, 0)]
    assert reports[2].updated[0].severity == "critical", "the report carries the refreshed finding"
    statuses = [(p["status"], sorted((a["labels"]["severity"], a["status"]) for a in p["alerts"])) for p in receiver.payloads]
    assert statuses == [
        ("firing", [("warning", "firing")]),
        ("firing", [("critical", "firing"), ("warning", "resolved")]),
        ("resolved", [("critical", "resolved")]),
    ]
    # The dead receiver is tried at every interval while it has never heard of a firing alert; once all
    # resolved there is nothing it needs to hear. No tick failed.
    assert count(n, "failed", "dead") == 4 and count(n, "retried", "dead") == 4
    assert loop.telemetry.registry.get_sample_value("fleet_controlplane_tick_failures_total") == 0
    assert any("dead (http://127.0.0.1:" in r.getMessage() for r in caplog.records)
    await n.aclose()


async def test_a_raising_report_hook_is_logged_and_the_tick_completes(sqlite_store: SqlStore,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    loop, _ = loop_with(sqlite_store, Scripted())

    async def broken(report: TickReport) -> None:
        raise RuntimeError("receiver code bug")

    loop.on_report = broken
    report = await loop.tick()
    assert report.ts == T0 and "tick report hook failed" in caplog.text


async def test_open_findings_at_start_are_restored_so_their_resolution_is_sent(receiver: Receiver) -> None:
    n = notifier(alerting(receiver.url, group_wait=0))
    f = finding(4, "saturation", "pool/decode", opened_at=T0 - 3600)
    n.restore([f], T0)
    [note] = n.flush(T0)
    assert note.receiver == "oncall" and note.payload["status"] == "firing"
    await n.drain()
    await step(n, T0 + 60, resolved=[f])
    await step(n, T0 + 300)
    assert [p["status"] for p in receiver.payloads] == ["firing", "resolved"]
    assert receiver.payloads[0]["alerts"][0]["startsAt"] == rfc3339(T0 - 3600)
    await n.aclose()


async def test_leading_again_resolves_what_another_replica_resolved_meanwhile(receiver: Receiver) -> None:
    n = notifier(alerting(receiver.url, group_wait=0))
    f = finding(4, "saturation", "pool/decode", opened_at=T0 - 3600)
    n.restore([f], T0)
    await step(n, T0 + 60)
    n.restore([], T0 + 600)  # this replica lost the lease; the other resolved the finding; it leads again
    await step(n, T0 + 660)
    await step(n, T0 + 960)
    assert [p["status"] for p in receiver.payloads] == ["firing", "resolved"]
    await n.aclose()


async def test_a_take_over_hands_the_open_findings_to_alert_delivery_inside_its_liveness_window(
    sqlite_store: SqlStore,
) -> None:
    # What the previous leader left firing is learnt during the take-over, whose time the liveness probe bounds: a
    # store that hung on this read once left a leader holding the Lease and doing nothing, unnoticed.
    left = await ThreadedStore(sqlite_store).open_finding(
        NewFinding("saturation", "pool/decode", "warning", "saturated", "queue", {}, "runbooks/saturation.md"), T0 - 600)
    loop, _ = loop_with(sqlite_store, Scripted())
    seen: list[tuple[list[int], tuple[str, float] | None, float]] = []
    loop.on_take_over = lambda findings, now: seen.append(([f.id for f in findings], loop.busy, now))
    await loop.start()
    assert seen == [([left.id], ("taking over", T0), T0)]
    assert loop.busy is None


async def test_group_by_dots_gives_every_label_set_its_own_group(receiver: Receiver) -> None:
    # Alertmanager's `...`: read as a label name no alert carries, it once put the whole fleet in one group.
    n = notifier(alerting(receiver.url, group_wait=0, group_by=["..."]))
    await step(n, T0, opened=[finding(1, "kv_transfer_lag", "engine/decode/d0/0"),
                              finding(2, "kv_transfer_lag", "engine/decode/d0/1")])
    assert len(receiver.payloads) == 2
    assert all(len(p["alerts"]) == 1 and p["groupLabels"] == p["alerts"][0]["labels"] for p in receiver.payloads)
    await n.aclose()


async def test_a_bearer_token_from_a_file_loses_its_newline_and_a_control_character_is_refused(
    receiver: Receiver, caplog: pytest.LogCaptureFixture,
) -> None:
    # Sent with its newline, every request failed on the header, and the error quoting it escaped the newline past
    # the scrub: the token reached the log at every retry.
    caplog.set_level(logging.DEBUG)
    config = alerting(receiver.url, group_wait=0, receiver={"bearer_token_env": "PAGER_TOKEN"})
    n = notifier(config, env={"PAGER_TOKEN": TOKEN + "\n"})
    await step(n, T0, opened=[finding(1, "saturation", "pool/decode")])
    await n.aclose()
    assert count(n, "sent") == 1 and receiver.requests[0]["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert TOKEN not in caplog.text
    with pytest.raises(ConfigError, match="PAGER_TOKEN holds control characters"):
        notifier(config, env={"PAGER_TOKEN": "tok\x00en"})


async def test_a_resolution_waiting_for_its_interval_is_sent_when_the_replica_stops_or_stands_by(
    receiver: Receiver,
) -> None:
    # The successor restores only the findings still open: a resolution left waiting in memory would never be told.
    f = finding(7, "saturation", "pool/decode")
    for stop in ("aclose", "hand_over"):
        receiver.requests.clear()
        n = notifier(alerting(receiver.url, group_wait=0))  # group_interval 5m
        await step(n, T0, opened=[f])
        await step(n, T0 + 100, resolved=[f])  # due at T0 + 300
        assert [p["status"] for p in receiver.payloads] == ["firing"]
        if stop == "hand_over":
            assert len(n.hand_over()) == 1
            assert n.hand_over() == [], "a change is handed over once"
        await n.aclose()
        assert [p["status"] for p in receiver.payloads] == ["firing", "resolved"], stop


async def test_a_resolution_behind_a_notice_in_flight_at_shutdown_is_sent_when_that_one_ends(
    receiver: Receiver,
) -> None:
    n = notifier(alerting(receiver.url, group_wait=0))
    f = finding(7, "saturation", "pool/decode")
    await n.on_report(TickReport(ts=T0, opened=[f]))  # its delivery not yet done
    await n.on_report(TickReport(ts=T0 + 15, resolved=[f]))
    await n.aclose()
    assert [p["status"] for p in receiver.payloads] == ["firing", "resolved"]


async def test_stopping_gives_a_dead_receivers_retries_a_bounded_grace() -> None:
    hole = socket.socket()  # connections complete in the kernel; nothing ever answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    config = Alerting.model_validate({"receivers": [
        {"name": "pager", "url": f"http://127.0.0.1:{hole.getsockname()[1]}/", "timeout": 0.2, "retries": 6}],
        "group_wait": 0})
    n = AlertNotifier(config, registry=CollectorRegistry(), backoff_s=0.5)  # all retries: about 33 s
    try:
        await n.on_report(TickReport(ts=T0, opened=[finding(1, "gpu_health", "gpu/node-a/0")]))
        wall = time.monotonic()
        await asyncio.wait_for(n.aclose(grace_s=0.5), 10)
        assert time.monotonic() - wall < 3
    finally:
        hole.close()


async def test_alert_timers_follow_a_clock_that_steps_back(receiver: Receiver) -> None:
    # Kept as they were, a resolution after a one-hour step back waited out the hour.
    n = notifier(alerting(receiver.url, group_wait=0))
    f = finding(1, "saturation", "pool/decode")
    await step(n, T0, opened=[f])
    await step(n, T0 - 3600, resolved=[f])
    for ts in range(60, 360, 60):
        await step(n, T0 - 3600 + ts)
    assert [p["status"] for p in receiver.payloads] == ["firing", "resolved"]
    await n.aclose()


async def test_a_tick_that_fails_after_resolving_a_finding_still_tells_the_receivers(
    receiver: Receiver, sqlite_store: SqlStore,
) -> None:
    # The finding is resolved in the store, so no later tick reports it again: the hook must hear it from this one.
    policy = Scripted()
    loop, clock = loop_with(sqlite_store, policy)
    n = notifier(alerting(receiver.url, group_wait=0, group_interval="1m"))
    loop.on_report = n.on_report
    await loop.start()
    policy.firing = {"pool/decode": Severity.WARNING}
    await loop.tick()
    await n.drain()
    clock.advance(60)
    policy.firing = {}

    async def cut_off(*args: Any, **kw: Any) -> Any:
        raise StoreUnavailable("connection reset by peer")

    loop._compact = cut_off  # type: ignore[method-assign]  # the tick's last step
    with pytest.raises(StoreUnavailable):
        await loop.tick()
    await n.drain()
    assert await loop.store.open_findings() == []
    assert [p["status"] for p in receiver.payloads] == ["firing", "resolved"]
    await n.aclose()
