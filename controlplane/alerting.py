"""Alert delivery: findings as Alertmanager-compatible webhook notifications (payload version 4).

Every finding that opens becomes a firing alert and every one that resolves a resolved alert;
a changed severity resolves the old alert and fires one with the new label, as two Prometheus
rules would. Each receiver groups alerts by `group_by` and times its notifications as an
Alertmanager route does: a new group waits `group_wait`, a changed group is sent at most every
`group_interval`, an unchanged firing group again after `repeat_interval`, and a failed
notification is retried at the next interval. Time is the loop's clock (each report's
timestamp), so a notification goes out at the first tick at or after it is due, and tests run on
virtual time. Deliveries run as tasks beside the loop: a slow or dead receiver costs its own
retries, never a tick. Secrets (bearer tokens, credentials or tokens inside a URL) come from the
environment and never reach a log line: receivers are logged by name and scheme://host:port.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
from prometheus_client import CollectorRegistry, Counter

from catalog.redaction import env_secret
from controlplane.config import GROUP_BY_ALL, Alerting, AlertReceiver
from controlplane.errors import ConfigError
from controlplane.loop import TickReport
from controlplane.rules_export import runbook_url
from controlplane.store.records import FindingRecord

__all__ = ["Alert", "AlertNotifier", "Notification", "alert_for", "fingerprint", "rfc3339", "subject_labels"]

log = logging.getLogger(__name__)

# Alertmanager's webhook sends Go's zero time as the end of an alert that still fires.
ZERO_TIME = "0001-01-01T00:00:00Z"
USER_AGENT = "fleet-controlplane"
CLOSE_GRACE_S = 15.0  # deliveries still retrying at shutdown: inside the pod's 60 s termination grace period


class _Redact(logging.Filter):
    """Hides the receivers' secrets in httpx's own log lines, which quote every request URL."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            text = record.getMessage()
            for secret in sorted(self.secrets, key=len, reverse=True):
                text = text.replace(secret, "***")
            record.msg, record.args = text, None
        return True


_REDACT = _Redact()


def rfc3339(ts: float) -> str:
    """Epoch seconds as an RFC 3339 UTC timestamp with milliseconds."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fingerprint(labels: Mapping[str, str]) -> str:
    """A stable 16-hex-digit identity of a label set (Alertmanager uses a 64-bit hash of the labels)."""
    text = "\xff".join(f"{k}\xfe{labels[k]}" for k in sorted(labels))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def subject_labels(subject: str) -> dict[str, str]:
    """Labels that a finding's subject names: pool, pod and engine, or a GPU's host and index."""
    kind, _, rest = subject.partition("/")
    parts = rest.split("/") if rest else []
    names: tuple[str, ...] = ()
    if kind in ("pool", "engine", "pod", "target"):
        names = ("pool", "pod", "engine") if kind == "engine" else ("pool", "pod")
    elif kind == "gpu":
        names = ("hostname", "gpu", "gpu_instance")
    elif kind == "nixl":
        names = ("hostname", "agent_name")
    return {name: value for name, value in zip(names, parts, strict=False) if value}


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert as Alertmanager holds it: labels identify it, `ends_at` is set once it resolved."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: float
    ends_at: float | None = None
    generator_url: str = ""

    @property
    def fingerprint(self) -> str:
        """Identity from the labels."""
        return fingerprint(self.labels)

    @property
    def status(self) -> str:
        """`firing` or `resolved`."""
        return "firing" if self.ends_at is None else "resolved"

    def to_json(self) -> dict[str, Any]:
        """The alert as one element of a webhook payload's `alerts`."""
        return {
            "status": self.status,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "startsAt": rfc3339(self.starts_at),
            "endsAt": ZERO_TIME if self.ends_at is None else rfc3339(self.ends_at),
            "generatorURL": self.generator_url,
            "fingerprint": self.fingerprint,
        }


def alert_for(finding: FindingRecord, config: Alerting, *, starts_at: float | None = None,
              ends_at: float | None = None) -> Alert:
    """The alert of a finding: alertname is its kind; description is its likely cause."""
    labels = {"alertname": finding.kind, "severity": finding.severity, "subject": finding.subject,
              **subject_labels(finding.subject)}
    annotations = {
        "summary": finding.summary,
        "description": finding.cause,
        "runbook_url": runbook_url(finding.runbook or finding.kind, config.runbook_base_url),
    }
    generator = f"{config.external_url.rstrip('/')}/incidents" if config.external_url else ""
    return Alert(labels, annotations, finding.opened_at if starts_at is None else starts_at, ends_at, generator)


@dataclass(frozen=True, slots=True)
class Notification:
    """One webhook call: the receiver, the group and the version-4 JSON body."""

    receiver: str
    group_key: str
    payload: dict[str, Any]
    at: float


@dataclass(frozen=True, slots=True)
class _Sent:
    """What a receiver was last told about a group (Alertmanager's notification log entry)."""

    firing: frozenset[str]
    resolved: frozenset[str]
    at: float


@dataclass(slots=True)
class _Group:
    key: str
    labels: dict[str, str]
    next_flush: float
    alerts: dict[str, Alert] = field(default_factory=dict)
    sent: _Sent | None = None
    in_flight: bool = False


@dataclass(slots=True)
class _Route:
    """A receiver with its resolved endpoint, credentials and aggregation groups."""

    receiver: AlertReceiver
    url: str  # without credentials
    shown: str  # scheme://host:port, the only form that is logged
    headers: dict[str, str]
    auth: httpx.BasicAuth | None
    secrets: tuple[str, ...]
    groups: dict[str, _Group] = field(default_factory=dict)

    def scrub(self, text: str) -> str:
        """`text` with every secret of this receiver replaced."""
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text


def _route(index: int, receiver: AlertReceiver, env: Mapping[str, str]) -> _Route:
    where = f"alerting.receivers[{index}] ({receiver.name})"
    if receiver.url_env is None:
        raw = receiver.url or ""  # the fleet file's validation guarantees one of the two
    else:
        raw = env.get(receiver.url_env, "")
        if not raw:
            raise ConfigError("alerting", [f"{where}: environment variable {receiver.url_env} is not set"])
        if not raw.startswith(("http://", "https://")):
            raise ConfigError("alerting", [f"{where}: {receiver.url_env} does not hold an http(s) URL"])
    headers = {"User-Agent": USER_AGENT}
    secrets: list[str] = [raw]
    if receiver.bearer_token_env is not None:
        # Sent with a Secret file's newline, every request failed on the header, and the error quoting it escaped the
        # newline past the scrub.
        token = env_secret(env.get(receiver.bearer_token_env))
        if token is None:
            raise ConfigError("alerting", [f"{where}: environment variable {receiver.bearer_token_env} is not set"])
        if any(not c.isprintable() for c in token):
            raise ConfigError("alerting", [f"{where}: {receiver.bearer_token_env} holds control characters no HTTP "
                                           "header may carry"])
        headers["Authorization"] = f"Bearer {token}"
        secrets.append(token)
    parts = urlsplit(raw)
    hostport = parts.netloc.rpartition("@")[2]
    auth = None
    if parts.username is not None:
        auth = httpx.BasicAuth(unquote(parts.username), unquote(parts.password or ""))
        if parts.password:
            secrets += [parts.password, unquote(parts.password)]
    url = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    # Webhook URLs often carry a token in the path or query: neither is ever logged.
    secrets += [url, parts.query, parts.path if len(parts.path) > 1 else ""]
    return _Route(receiver, url, f"{parts.scheme}://{hostport}", headers, auth, tuple(s for s in secrets if s))


def _group_key(labels: Mapping[str, str]) -> str:
    inner = ", ".join(f"{k}={json.dumps(labels[k])}" for k in sorted(labels))
    return f"{{}}:{{{inner}}}"


def _common(maps: Iterable[Mapping[str, str]]) -> dict[str, str]:
    maps = list(maps)
    if not maps:
        return {}
    first = maps[0]
    return {k: v for k, v in sorted(first.items()) if all(m.get(k) == v for m in maps[1:])}


class AlertNotifier:
    """Turns tick reports into grouped webhook notifications and delivers them to every receiver."""

    def __init__(
        self,
        config: Alerting,
        *,
        client: httpx.AsyncClient | None = None,
        env: Mapping[str, str] | None = None,
        registry: CollectorRegistry | None = None,
        backoff_s: float = 1.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Secrets are read from `env` (the process environment by default); ConfigError if one is missing."""
        env = os.environ if env is None else env
        self.config = config
        self._routes = [_route(i, r, env) for i, r in enumerate(config.receivers)]
        httpx_log = logging.getLogger("httpx")
        if _REDACT not in httpx_log.filters:
            httpx_log.addFilter(_REDACT)
        for route in self._routes:
            _REDACT.secrets.update(route.secrets)
        self._client = client or httpx.AsyncClient(follow_redirects=False)
        self._own_client = client is None
        self._backoff_s = backoff_s
        self._sleep = sleep
        self.registry = registry if registry is not None else CollectorRegistry()
        self.notifications = Counter(
            "fleet_controlplane_alert_notifications", "Webhook notifications by receiver and result (sent, failed, retried).",
            ["receiver", "result"], registry=self.registry,
        )
        self._current: dict[int, Alert] = {}  # finding id -> its alert while it fires
        self._seen: float | None = None  # the latest time flushed at
        self._tasks: set[asyncio.Task[None]] = set()

    # alerts -----------------------------------------------------------------------------------

    def observe(self, report: TickReport) -> None:
        """Take in what a tick opened, updated and resolved."""
        now = report.ts
        for f in report.opened:
            self._fire(f, now, f.opened_at)
        for f in report.updated:
            old = self._current.get(f.id)
            if old is None:
                self._fire(f, now, f.opened_at)
            elif old.labels.get("severity") != f.severity:
                # Severity is a label: the old alert ends and one with the new severity starts now.
                self._put(replace(old, ends_at=now), now)
                self._fire(f, now, now)
            else:
                self._fire(f, now, old.starts_at)
        for f in report.resolved:
            old = self._current.pop(f.id, None) or alert_for(f, self.config)
            self._put(replace(old, ends_at=now), now)

    def restore(self, findings: Iterable[FindingRecord], now: float) -> None:
        """Take in the findings open now (at start-up, or on leading again), so their resolution reaches the
        receivers; one this replica still fires that another resolved meanwhile is resolved now."""
        still = {f.id: f for f in findings}
        for fid in [fid for fid in self._current if fid not in still]:
            self._put(replace(self._current.pop(fid), ends_at=now), now)
        for f in still.values():
            if f.id not in self._current:
                self._fire(f, now, f.opened_at)

    def _fire(self, finding: FindingRecord, now: float, starts_at: float) -> None:
        alert = alert_for(finding, self.config, starts_at=starts_at)
        self._current[finding.id] = alert
        self._put(alert, now)

    def _put(self, alert: Alert, now: float) -> None:
        by_all = self.config.group_by == [GROUP_BY_ALL]
        labels = {k: v for k, v in alert.labels.items() if by_all or k in self.config.group_by}
        key = _group_key(labels)
        for route in self._routes:
            group = route.groups.get(key)
            if group is None:
                group = route.groups[key] = _Group(key, labels, now + self.config.group_wait)
            group.alerts[alert.fingerprint] = alert

    # notifications ----------------------------------------------------------------------------

    async def on_report(self, report: TickReport) -> None:
        """The loop's hook: take in a tick's report and start the notifications now due."""
        self.observe(report)
        self.flush(report.ts)

    def flush(self, now: float, *, pending: bool = False) -> list[Notification]:
        """Start delivering every notification due at `now` (as tasks of the running event loop), or with `pending`
        every one whose group changed since its last notice, due or not; returns them."""
        self._follow_clock(now)
        started = []
        for route in self._routes:
            for group in list(route.groups.values()):
                if group.in_flight or (now < group.next_flush and not pending):
                    continue
                group.next_flush = now + self.config.group_interval
                note = self._prepare(route, group, now)
                if note is not None:
                    started.append(note)
        return started

    def _follow_clock(self, now: float) -> None:
        """Move the groups' timers back with a clock that stepped back (as the loop drops its later points): kept as
        they were, every pending notice would wait out the step, a resolution for as long as the clock was ahead."""
        back = (self._seen - now) if self._seen is not None else 0.0
        self._seen = now
        if back <= 0:
            return
        log.warning("alert timers moved back %.0fs with the clock", back)
        for route in self._routes:
            for group in route.groups.values():
                group.next_flush -= back
                if group.sent is not None:
                    group.sent = replace(group.sent, at=group.sent.at - back)

    def _prepare(self, route: _Route, group: _Group, now: float) -> Notification | None:
        firing = frozenset(fp for fp, a in group.alerts.items() if a.ends_at is None)
        resolved = frozenset(group.alerts) - firing
        snapshot = dict(group.alerts)
        if not self._needs_update(route, group.sent, firing, resolved, now):
            self._settle(route, group, group.sent, snapshot)
            return None
        alerts = [a for a in snapshot.values() if a.ends_at is None or route.receiver.send_resolved]
        sent = _Sent(firing, resolved, now)
        if not alerts:
            self._settle(route, group, sent, snapshot)  # all resolved and the receiver does not want to hear it
            return None
        note = self._notification(route, group, alerts, now)
        group.in_flight = True
        task = asyncio.get_running_loop().create_task(self._deliver(route, group, note, sent, snapshot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return note

    def _needs_update(self, route: _Route, sent: _Sent | None, firing: frozenset[str], resolved: frozenset[str],
                      now: float) -> bool:
        """Alertmanager's deduplication: new firing alerts, all resolved, newly resolved, or the repeat is due."""
        if sent is None:
            return bool(firing)
        if not firing <= sent.firing:
            return True
        if not firing:
            return bool(sent.firing)
        if route.receiver.send_resolved and not resolved <= sent.resolved:
            return True
        return now - sent.at >= self.config.repeat_interval

    def _settle(self, route: _Route, group: _Group, sent: _Sent | None, snapshot: Mapping[str, Alert]) -> None:
        """After a successful notification: remember it, drop the resolved alerts it covered, and an empty group."""
        group.sent = sent
        for fp, alert in snapshot.items():
            if alert.ends_at is not None and group.alerts.get(fp) is alert:
                del group.alerts[fp]
        if not group.alerts and route.groups.get(group.key) is group:
            del route.groups[group.key]

    def _notification(self, route: _Route, group: _Group, alerts: list[Alert], now: float) -> Notification:
        alerts = sorted(alerts, key=lambda a: (sorted(a.labels.items()), a.starts_at))
        limit = route.receiver.max_alerts
        truncated = max(0, len(alerts) - limit) if limit else 0
        if truncated:
            alerts = alerts[:limit]
        payload = {
            "version": "4",
            "groupKey": group.key,
            "truncatedAlerts": truncated,
            "status": "firing" if any(a.ends_at is None for a in alerts) else "resolved",
            "receiver": route.receiver.name,
            "groupLabels": dict(group.labels),
            "commonLabels": _common(a.labels for a in alerts),
            "commonAnnotations": _common(a.annotations for a in alerts),
            "externalURL": self.config.external_url or "",
            "alerts": [a.to_json() for a in alerts],
        }
        return Notification(route.receiver.name, group.key, payload, now)

    async def _deliver(self, route: _Route, group: _Group, note: Notification, sent: _Sent,
                       snapshot: Mapping[str, Alert]) -> None:
        try:
            ok = await self._post(route, note)
        except Exception as exc:  # a delivery task must never die unobserved; the next interval retries
            log.error("alert receiver %s (%s): notification failed unexpectedly: %s", route.receiver.name, route.shown,
                      route.scrub(repr(exc)))
            self.notifications.labels(route.receiver.name, "failed").inc()
            ok = False
        finally:
            group.in_flight = False
        if ok:
            self._settle(route, group, sent, snapshot)

    async def _post(self, route: _Route, note: Notification) -> bool:
        """POST with retries on connection errors, timeouts, 429 and 5xx; True once the receiver took it."""
        r = route.receiver
        attempts = r.retries + 1
        reason = ""
        for attempt in range(1, attempts + 1):
            retryable = True
            try:
                response = await self._client.post(route.url, json=note.payload, headers=route.headers,
                                                   auth=route.auth or httpx.USE_CLIENT_DEFAULT, timeout=r.timeout)
            except httpx.HTTPError as exc:
                reason = route.scrub(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            else:
                if response.is_success:
                    self.notifications.labels(r.name, "sent").inc()
                    log.info("alert receiver %s (%s): sent %s %s, %d alert(s)", r.name, route.shown,
                             note.payload["status"], note.group_key, len(note.payload["alerts"]))
                    return True
                reason = f"HTTP {response.status_code}"
                retryable = response.status_code == 429 or response.status_code >= 500
            if not retryable or attempt == attempts:
                break
            self.notifications.labels(r.name, "retried").inc()
            delay = self._backoff_s * 2 ** (attempt - 1)
            log.info("alert receiver %s (%s): attempt %d of %d failed (%s); retrying in %gs", r.name, route.shown,
                     attempt, attempts, reason, delay)
            await self._sleep(delay)
        self.notifications.labels(r.name, "failed").inc()
        log.warning("alert receiver %s (%s): notification for %s failed (%s); retried at the next group interval",
                    r.name, route.shown, note.group_key, reason)
        return False

    async def drain(self) -> None:
        """Wait for the deliveries in flight."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def hand_over(self) -> list[Notification]:
        """Send every change not yet told, due or not: a replica that stops acting (shutdown, the Lease lost) holds
        the only record of them, and its successor restores only the findings still open, so a resolution waiting
        for its group's interval would never reach the receivers."""
        return self.flush(self._seen, pending=True) if self._seen is not None else []

    async def aclose(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Hand the pending changes over, give the deliveries in flight `grace_s` (a dead receiver's retries would
        outlast the pod's termination grace period), and close the HTTP client if it is ours."""
        deadline = time.monotonic() + grace_s
        for _ in range(2):  # again once those in flight end: a change behind one of them goes then
            self.hand_over()
            if self._tasks and (left := deadline - time.monotonic()) > 0:
                await asyncio.wait(list(self._tasks), timeout=left)
        late = list(self._tasks)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        if late:
            log.warning("stopped with %d alert notification(s) undelivered after %gs", len(late), grace_s)
        if self._own_client:
            await self._client.aclose()
