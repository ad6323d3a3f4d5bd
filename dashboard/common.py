"""What every dashboard page shares: the store connection, the time range, cached page data,
charts, number formatting, links between pages, the fleet file's SLOs and the control plane's API.

The dashboard reads the store only through `controlplane.store.queries` (the page models are in
`pages.py`); it changes the fleet only by asking the control plane's HTTP API, never by writing
the store.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from catalog.redaction import env_secret
from catalog.signals import lookup
from controlplane.config import FleetConfig, load_config
from controlplane.errors import FleetError, StoreUnavailable
from controlplane.store.db import redact
from controlplane.store.queries import Point, ReadStore, Spread
from dashboard.pages import PAGES

__all__ = [
    "PAGE_FILES",
    "RANGES",
    "Approver",
    "Window",
    "ago",
    "api_decide",
    "api_status",
    "api_token",
    "api_url",
    "approver",
    "band_chart",
    "bar_chart",
    "chosen",
    "fleet_config",
    "heatmap",
    "latest_ts",
    "link",
    "page_data",
    "pct",
    "points_frame",
    "pool_of",
    "reader",
    "secs",
    "select",
    "show",
    "signed_in_user",
    "slo",
    "spread_frame",
    "store_url",
    "when",
    "window",
]

STORE_ENV = "FLEETCTL_STORE_URL"
CONFIG_ENV = "FLEETCTL_CONFIG"
API_ENV = "FLEETCTL_API_URL"
TOKEN_ENV = "FLEETCTL_API_TOKEN"
# The request header an authenticating proxy in front of the dashboard (oauth2-proxy, an ingress's external auth)
# sets to the user it signed in: approvals are then recorded as that user, not as a name anyone may type.
USER_HEADER_ENV = "FLEETCTL_DASHBOARD_USER_HEADER"
DEFAULT_API = "http://127.0.0.1:9464"
API_TIMEOUT_S = 2.0
RANGES: dict[str, float] = {"15 min": 900.0, "1 h": 3600.0, "3 h": 10800.0, "6 h": 21600.0, "24 h": 86400.0,
                            "3 d": 259200.0, "7 d": 604800.0}
DEFAULT_RANGE = "1 h"
PAGE_FILES: dict[str, str] = {
    "fleet": "views/fleet.py",
    "pool": "views/pool.py",
    "ep": "views/ep.py",
    "kv": "views/kv.py",
    "gpus": "views/gpus.py",
    "incidents": "views/incidents.py",
    "actions": "views/actions.py",
    "canary": "views/canary.py",
}
CHART_HEIGHT = 220


# the store and the time range ----------------------------------------------------------------

def store_url() -> str:
    """The store the dashboard reads (FLEETCTL_STORE_URL, as `fleetctl dashboard --db` sets it)."""
    return os.environ.get(STORE_ENV, "sqlite:///fleet.db")


@st.cache_resource(show_spinner=False)
def _open(url: str) -> ReadStore:
    return ReadStore.open(url)


def reader() -> ReadStore:
    """The read-only store; shows what is wrong and stops the page when it cannot be opened."""
    url = store_url()
    try:
        return _open(url)
    except StoreUnavailable as exc:
        st.error(f"The store {redact(url)} cannot be read: {exc}")
        st.stop()
        raise  # st.stop() raises; this keeps type checkers honest


def latest_ts() -> float | None:
    """Time of the store's newest signal; shows what is wrong and stops the page when the store fails."""
    try:
        return reader().latest_ts()
    except StoreUnavailable as exc:
        st.error(f"The store {redact(store_url())} stopped answering: {exc}")
        st.stop()
        raise


@dataclass(frozen=True, slots=True)
class Window:
    """The time range every page shows: [start, end], anchored on the store's newest signal."""

    start: float
    end: float
    label: str
    live: bool
    latest: float | None

    @property
    def span(self) -> float:
        """Length in seconds."""
        return self.end - self.start


def window() -> Window:
    """The window the entry script chose for this run."""
    w = st.session_state.get("window")
    if isinstance(w, Window):
        return w
    now = time.time()
    return Window(now - RANGES[DEFAULT_RANGE], now, DEFAULT_RANGE, True, None)


# Live windows move with every new signal, so entries age out quickly; the bound caps memory.
@st.cache_data(ttl=60, max_entries=64, show_spinner=False)
def _page_data(url: str, page: str, start: float, end: float, params: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return PAGES[page](_open(url), start, end, **dict(params))


def page_data(page: str, w: Window, **params: Any) -> dict[str, Any]:
    """The page's data for window `w` (cached per store, page, window and selection)."""
    reader()
    try:
        return _page_data(store_url(), page, w.start, w.end, tuple(sorted(params.items())))
    except StoreUnavailable as exc:
        st.error(f"The store {redact(store_url())} stopped answering: {exc}")
        st.stop()
        raise


def select(label: str, options: Sequence[str], key: str, current: str | None, **kwargs: Any) -> str | None:
    """A selectbox kept in the URL (so links can set it) showing `current`, the choice this run's data is for.

    Read the choice with `chosen(key)` before loading the data; the user's next choice arrives in
    the next run the same way.
    """
    if not options:
        return None
    value = current if current in options else options[0]
    if st.session_state.get(key) != value:
        st.session_state[key] = value
    chosen = st.selectbox(label, list(options), key=key, bind="query-params", **kwargs)
    return None if chosen is None else str(chosen)


def chosen(key: str) -> str | None:
    """The value a bound selectbox holds, before it is drawn in this run.

    The URL wins: a link that names a pool or an incident must show it even when the user chose
    another one earlier in the same browser tab.
    """
    value = st.query_params.get(key) or st.session_state.get(key)
    return str(value) if value else None


def chosen_id(key: str) -> int | None:
    """The id a link names (an action's, a finding's), or None where it names none a store could hold."""
    from controlplane.store.records import MAX_ID

    value = chosen(key)
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > len(str(MAX_ID)):
        return None
    return int(value) if int(value) <= MAX_ID else None


# fleet file and control-plane API --------------------------------------------------------------

@st.cache_resource(show_spinner=False)
def _config(path: str, mtime: float) -> FleetConfig:
    return load_config(path)


def fleet_config() -> FleetConfig | None:
    """The fleet file named by FLEETCTL_CONFIG, if any; a warning when it cannot be read."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return None
    try:
        return _config(path, Path(path).stat().st_mtime)
    except (OSError, FleetError) as exc:
        st.warning(f"{CONFIG_ENV}={path} cannot be used, so SLOs are not shown: {exc}")
        return None


def slo(pool: str) -> tuple[float | None, float | None]:
    """(TTFT p95, TPOT p95) objectives of a pool from the fleet file, in seconds."""
    cfg = fleet_config()
    if cfg is None:
        return None, None
    try:
        p = cfg.pool(pool)
    except KeyError:
        return None, None
    return p.slo.ttft_p95, p.slo.tpot_p95


def api_url() -> str:
    """Where the control plane's HTTP API answers (FLEETCTL_API_URL)."""
    return os.environ.get(API_ENV, DEFAULT_API).rstrip("/")


def api_token() -> str | None:
    """The bearer token for the API's write endpoints (FLEETCTL_API_TOKEN), if set; as the server reads it, without the
    newline a Secret made from a file ends in."""
    return env_secret(os.environ.get(TOKEN_ENV))


def signed_in_user(headers: Mapping[str, str], header: str) -> str | None:
    """The user an authenticating proxy signed in, from its `header` (any case); None where it is absent, blank or
    holds a control character (no proxy's value: the request did not come through it)."""
    wanted = header.strip().lower()
    value = next((v for k, v in headers.items() if k.lower() == wanted), "").strip()
    return value if value and value.isprintable() else None


@dataclass(frozen=True, slots=True)
class Approver:
    """Who decides on this page: the proxy's signed-in user (`header` set), or a name typed (no proxy configured);
    `user` None where a proxy is configured and this request did not come through it."""

    header: str | None
    user: str | None


def approver() -> Approver:
    """Who this request may approve as: with FLEETCTL_DASHBOARD_USER_HEADER set, only the user in that header."""
    header = (os.environ.get(USER_HEADER_ENV) or "").strip() or None
    if header is None:
        return Approver(None, None)
    return Approver(header, signed_in_user(st.context.headers, header))


@st.cache_data(ttl=10, show_spinner=False)
def _status(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/api/status", timeout=API_TIMEOUT_S) as r:
            return {"ok": True, **json.loads(r.read())}
    except urllib.error.HTTPError as exc:
        return {"ok": False, "error": f"HTTP {exc.code}"}
    except (OSError, ValueError) as exc:
        return {"ok": False, "error": str(getattr(exc, "reason", exc))}


def api_status() -> dict[str, Any]:
    """The control plane's `/api/status`, or {"ok": False, "error": ...} when it does not answer."""
    return _status(api_url())


def api_decide(action_id: int, approve: bool, by: str) -> tuple[bool, str]:
    """Ask the control plane to approve or reject a proposal; (succeeded, message)."""
    token = api_token()
    if token is None:
        return False, f"{TOKEN_ENV} is not set for the dashboard"
    verb = "approve" if approve else "reject"
    req = urllib.request.Request(
        f"{api_url()}/api/actions/{action_id}/{verb}", data=json.dumps({"by": by}).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=API_TIMEOUT_S) as r:
            body = json.loads(r.read())
        return True, f"action {body['id']} {body['state']} by {body['by']}"
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        return False, f"the control plane refused (HTTP {exc.code}): {message}"
    except (OSError, ValueError) as exc:
        # The reason may quote the request's headers, the token among them.
        reason = str(getattr(exc, "reason", exc)).replace(token, "***")
        return False, f"the control plane at {api_url()} did not answer: {reason}"


# frames and charts ---------------------------------------------------------------------------

def evidence_lines(kind: str, evidence: dict[str, Any]) -> list[tuple[float, str]]:
    """The levels to draw over a finding's evidence signal, each in the signal's own unit.

    Policies record `threshold` in the unit they decide in: the prefix-cache policy the allowed drop
    below its baseline, the expert-parallel ones a ratio to it, the KV-transfer policy seconds
    (`threshold_s`), SLO burn a burn rate and speculative decoding a CUSUM height in sigmas; drawn as
    they are, a burn rate of 14.4 stood on a TTFT chart as 14.4 s.
    """
    def num(key: str) -> float | None:
        v = evidence.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    if kind == "slo_burn":  # its baseline and threshold are the error budget and the burn rate
        return [] if num("slo") is None else [(num("slo"), "SLO")]  # type: ignore[list-item]
    baseline = num("baseline") if num("baseline") is not None else num("baseline_p99")
    threshold = num("threshold")
    lines = [] if baseline is None else [(baseline, "baseline")]
    if kind == "prefix_cache_hit_drop" and baseline is not None and threshold is not None:
        lines.append((baseline - threshold, "threshold (baseline − allowed drop)"))
    elif kind == "spec_decode_collapse" and baseline is not None and num("min_drop") is not None:
        lines.append((baseline - num("min_drop"), "threshold (baseline − allowed drop)"))  # type: ignore[operator]
    elif kind == "ep_imbalance" and baseline is not None and threshold is not None:
        lines.append((baseline * threshold, "threshold (baseline × allowed ratio)"))
    elif num("threshold_s") is not None:
        lines.append((num("threshold_s"), "threshold"))  # type: ignore[arg-type]
    if num("peers_median_p99") is not None:
        lines.append((num("peers_median_p99"), "peers' median"))  # type: ignore[arg-type]
    if kind == "pool_at_max" and num("max") is not None:
        lines.append((num("max"), "replicas.max"))  # type: ignore[arg-type]
    return lines


def signal_title(name: str) -> str:
    """An axis title for a signal: its name and unit from the catalogue."""
    spec = lookup(name)
    return f"{name} ({spec.unit})" if spec is not None else name


def signal_help(name: str) -> str:
    """What a signal measures and what produces it, from the catalogue."""
    spec = lookup(name)
    if spec is None:
        return f"{name}: not in the signal catalogue"
    return f"{name} ({spec.unit}): {spec.help}; from {', '.join(sorted(spec.producers))}"


def points_frame(points: Iterable[Point]) -> pd.DataFrame:
    """Bucketed points as a frame: time, name, subject, mean, min, max, count."""
    df = pd.DataFrame([(p.ts, p.name, p.subject, p.mean, p.min, p.max, p.count) for p in points],
                      columns=["ts", "name", "subject", "mean", "min", "max", "count"])
    df["time"] = pd.to_datetime(df["ts"], unit="s", utc=True)
    return df


def spread_frame(spreads: Iterable[Spread]) -> pd.DataFrame:
    """Cross-subject spreads as a frame: time, name, mean, min, max, total, subjects."""
    df = pd.DataFrame([(s.ts, s.name, s.mean, s.min, s.max, s.total, s.subjects) for s in spreads],
                      columns=["ts", "name", "mean", "min", "max", "total", "subjects"])
    df["time"] = pd.to_datetime(df["ts"], unit="s", utc=True)
    return df


def utc_x(field: str = "time", start: float | pd.Timestamp | None = None,
          end: float | pd.Timestamp | None = None) -> alt.X:
    """A time axis labelled in UTC, as every caption on the pages is (a plain temporal axis shows the browser's own
    zone), spanning `start`..`end` when given (epoch seconds or timestamps)."""
    def iso(t: float | pd.Timestamp) -> str:
        return str((t if isinstance(t, pd.Timestamp) else pd.Timestamp(t, unit="s", tz="UTC")).isoformat())

    domain = [iso(start), iso(end)] if start is not None and end is not None else alt.Undefined
    return alt.X(f"{field}:T", title=None, scale=alt.Scale(type="utc", domain=domain))


def utc_tooltip(field: str = "time", *, seconds: bool = True) -> alt.Tooltip:
    """A time in a tooltip, in UTC."""
    if seconds:
        return alt.Tooltip(f"{field}:T", timeUnit="utcyearmonthdatehoursminutesseconds", format="%Y-%m-%d %H:%M:%S",
                           title=f"{field} (UTC)")
    return alt.Tooltip(f"{field}:T", timeUnit="utcyearmonthdatehoursminutes", format="%Y-%m-%d %H:%M",
                       title=f"{field} (UTC)")


def _time_axis(w: Window | None) -> alt.X:
    return utc_x("time", w.start, w.end) if w else utc_x("time")


def band_chart(df: pd.DataFrame, *, y_title: str, color: str | None = None, band: bool = True, fmt: str = ".3~g",
               rules: Sequence[tuple[float, str]] = (), marks: pd.DataFrame | None = None, w: Window | None = None,
               height: int = CHART_HEIGHT, y: str = "mean", lo: str = "min", hi: str = "max") -> alt.LayerChart:
    """Lines of `y` over time (one per `color`), a shaded lo..hi band, horizontal rules and event marks."""
    # Both layers carry the same legend: one layer without it would hide the merged legend.
    colors = alt.Color(f"{color}:N", title=None, legend=_legend(df[color].astype(str))) if color else alt.Undefined
    base = alt.Chart(df).encode(x=_time_axis(w))
    tooltip = [utc_tooltip()] + ([alt.Tooltip(f"{color}:N")] if color else [])
    line = base.mark_line(interpolate="monotone", strokeWidth=1.6).encode(
        y=alt.Y(f"{y}:Q", title=y_title, axis=alt.Axis(format=fmt)),
        color=colors,
        tooltip=[*tooltip, *(alt.Tooltip(f"{col}:Q", format=fmt) for col in (y, lo, hi))],
    )
    layers: list[alt.Chart] = []
    if band:
        layers.append(base.mark_area(opacity=0.15, interpolate="monotone").encode(
            y=f"{lo}:Q", y2=f"{hi}:Q", color=colors))
    layers.append(line)
    if rules:
        rdf = pd.DataFrame(rules, columns=["value", "label"])
        rule = alt.Chart(rdf).mark_rule(strokeDash=[6, 4], color="#d62728").encode(
            y="value:Q", tooltip=["label:N", alt.Tooltip("value:Q", format=fmt)])
        text = alt.Chart(rdf).mark_text(align="left", dx=4, dy=-6, color="#d62728", fontSize=11).encode(
            y="value:Q", x=alt.value(2), text="label:N")
        layers += [rule, text]
    if marks is not None and not marks.empty:
        layers.append(alt.Chart(marks).mark_rule(color="#7f7f7f", strokeDash=[2, 2]).encode(
            x=utc_x(), tooltip=[utc_tooltip(), "label:N"]))
    return alt.layer(*layers).properties(height=height)  # type: ignore[return-value]  # a LayerChart


def _legend(labels: pd.Series) -> alt.Legend:
    """A legend under the chart, in as many columns as its longest label leaves room for."""
    per_row = 2 if labels.str.len().max() > 14 else 3
    return alt.Legend(orient="bottom", columns=min(max(labels.nunique(), 1), per_row), labelLimit=300,
                      symbolType="stroke", symbolOpacity=1, symbolStrokeWidth=2)


def heatmap(df: pd.DataFrame, *, y: str, value: str, title: str, fmt: str = ".3~g", scheme: Any = "viridis",
            height: int | None = None) -> alt.Chart:
    """Rows `y` over time, colored by `value`."""
    rows = max(1, df[y].nunique()) if not df.empty else 1
    chart: alt.Chart = alt.Chart(df).mark_rect().encode(
        x=utc_x(),
        y=alt.Y(f"{y}:N", title=None, sort=None, axis=alt.Axis(labelLimit=220, labelOverlap=rows > 40)),
        color=alt.Color(f"{value}:Q", title=title, scale=alt.Scale(scheme=scheme), legend=alt.Legend(format=fmt)),
        tooltip=[utc_tooltip(seconds=False), f"{y}:N", alt.Tooltip(f"{value}:Q", format=fmt)],
    ).properties(height=height or min(720, max(160, 18 * rows)))
    return chart


def bar_chart(df: pd.DataFrame, *, x: str, y: str, y_title: str, fmt: str = ".3~g", color: str | None = None,
              height: int = CHART_HEIGHT, sort: str | None = None) -> alt.Chart:
    """Bars of `y` per `x` category."""
    chart: alt.Chart = alt.Chart(df).mark_bar().encode(
        x=alt.X(f"{x}:N", title=None, sort=sort,
                axis=alt.Axis(labelAngle=0 if df[x].astype(str).str.len().max() <= 4 else -40, labelLimit=160)),
        y=alt.Y(f"{y}:Q", title=y_title, axis=alt.Axis(format=fmt)),
        color=alt.Color(f"{color}:N", title=None) if color else alt.Undefined,
        tooltip=[f"{x}:N", alt.Tooltip(f"{y}:Q", format=fmt)],
    ).properties(height=height)
    return chart


def show(chart: Any) -> None:
    """Draw a chart across the column."""
    st.altair_chart(chart, width="stretch")


# formatting and links ------------------------------------------------------------------------

def when(ts: float | None) -> str:
    """UTC time of day with date, or '-'."""
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def secs(v: float | None) -> str:
    """Seconds as ms below one second."""
    if v is None or pd.isna(v):
        return "-"
    if abs(v) < 1:
        return f"{v * 1000:.0f} ms"
    if abs(v) < 120:
        return f"{v:.2f} s"
    return f"{v / 60:.0f} min" if abs(v) < 7200 else f"{v / 3600:.1f} h"


def ago(seconds: float) -> str:
    """A duration in the largest unit that keeps it short."""
    s = abs(seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.0f} d"


def pct(v: float | None) -> str:
    """A fraction as a percentage."""
    return "-" if v is None or pd.isna(v) else f"{v:.0%}"


def pool_of(subject: str) -> str | None:
    """The pool a subject belongs to (`pool/`, `engine/`, `pod/`, `target/` subjects), else None."""
    kind, _, rest = subject.partition("/")
    if kind in ("pool", "engine", "pod", "target") and rest:
        return rest.split("/", 1)[0]
    return None


def link(page: str, label: str, **query: Any) -> None:
    """A link to another page, with its selection in the URL."""
    st.page_link(PAGE_FILES[page], label=label, query_params={k: str(v) for k, v in query.items() if v is not None})


def advice_section(rows: list[dict[str, Any]]) -> None:
    """The advisor's open recommendations with their evidence, and how its followed advice turned out."""
    st.subheader("Advice")
    open_rows = [r for r in rows if r["state"] == "open"]
    if not open_rows:
        st.caption("No advice recorded yet: `fleetctl advise --config FLEET.yaml` computes and keeps it.")
    for r in open_rows:
        saving = r["saving_per_day"]
        money = "" if saving is None else f" ({saving:+,.0f} $/day)"
        with st.expander(f"{r['kind']} · {r['pool']}{money}: {r['advice']}", expanded=False):
            st.caption(f"confidence {r['confidence']:.2f}; predicted {r['metric']} {r['before']:.4g} -> "
                       f"{r['predicted']:.4g}; runbook: `fleetctl runbook advice`, section {r['kind']}")
            st.json(r["evidence"], expanded=False)
    measuring = [r for r in rows if r["state"] == "followed"]
    if measuring:
        st.caption("Followed, being measured on what the fleet shows since: " + "; ".join(
            f"{r['kind']} · {r['pool']}" for r in measuring))
    scored = [r for r in rows if r["state"] == "applied" and r["error"] is not None]
    if scored:
        st.markdown("**Followed advice, predicted against measured**")
        st.dataframe(pd.DataFrame([{"advice": r["advice"], "metric": r["metric"], "predicted": r["predicted"],
                                    "measured": r["measured"], "error": f"{r['error']:+.0%}"} for r in scored]),
                     hide_index=True)


def literal(text: object) -> str:
    """`text` as a markdown code span: what the gate API was sent (selectors, names) shows as typed, never as a
    link or formatting."""
    return "`" + str(text).replace("`", "'").replace("\n", " ") + "`"
