"""Operations dashboard: fleet signals, findings with runbooks, and the audit log.

Run with `fleetctl dashboard --db URL`. Reads only, through `controlplane.store.queries`.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

import pandas as pd
import streamlit as st

from controlplane import runbooks
from controlplane.errors import StoreUnavailable
from controlplane.store.queries import ReadStore

st.set_page_config(page_title="fleet-controlplane", layout="wide")

DB = os.environ.get("FLEETCTL_STORE_URL", "sqlite:///fleet.db")
CHARTS = (
    ("prefix_cache_hit_rate", "Prefix-cache hit rate"),
    ("ttft_p95", "TTFT p95 (s)"),
    ("tpot_p95", "TPOT p95 (s)"),
    ("request_rate", "Requests/s"),
    ("kv_cache_usage_max", "KV-cache usage (max)"),
    ("requests_waiting", "Waiting requests"),
)


@st.cache_resource
def store(url: str) -> ReadStore:
    return ReadStore.open(url)


@st.cache_data(ttl=10)
def load_series(url: str, name: str, prefix: str, start: float, end: float) -> pd.DataFrame:
    points = store(url).series(name, prefix, start, end)
    df = pd.DataFrame([(p.ts, p.subject.removeprefix("pool/"), p.value) for p in points],
                      columns=["ts", "pool", "value"])
    df["time"] = pd.to_datetime(df["ts"], unit="s", utc=True)
    return df


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


try:
    reader = store(DB)
    latest = reader.latest_ts()
except StoreUnavailable as exc:
    st.error(f"The store is unreachable: {exc}")
    st.stop()

st.title("Fleet")
if latest is None:
    st.info(f"The store {DB.split('@')[-1]} holds no signals yet: start `fleetctl run` or `fleetctl demo`.")
    st.stop()

hours = st.sidebar.select_slider("Time range (hours)", options=[1, 3, 6, 24, 72, 168], value=3)
start = latest - hours * 3600

findings = reader.findings(include_resolved=True)
open_findings = [f for f in findings if f["state"] == "open"]
cols = st.columns(3)
cols[0].metric("Open findings", len(open_findings))
cols[1].metric("Targets up", sum(1 for t in reader.targets() if t["up"]))
cols[2].metric("Last signal", _when(latest))

chart_cols = st.columns(2)
for i, (name, title) in enumerate(CHARTS):
    df = load_series(DB, name, "pool/", start, latest)
    with chart_cols[i % 2]:
        st.subheader(title)
        if df.empty:
            st.caption("no data in range")
        else:
            st.line_chart(df, x="time", y="value", color="pool")

st.header("Incidents")
for f in findings[:50]:
    label = f"#{f['id']} [{f['severity']}] {f['summary']} ({f['state']}, opened {_when(f['opened_at'])})"
    with st.expander(label, expanded=f["state"] == "open"):
        st.write(f["cause"])
        st.json(f["evidence"], expanded=False)
        try:
            st.markdown(runbooks.load(f["runbook"]))
        except KeyError:
            st.caption(f"no runbook named {f['runbook']}")

st.header("Actions")
actions = reader.actions()
if actions:
    st.dataframe(pd.DataFrame([
        {"id": a["id"], "finding": a["finding_id"], "kind": a["kind"], "pool": a["pool"], "state": a["state"],
         "replicas": f"{a['params'].get('from_replicas')} -> {a['params'].get('replicas')}",
         "created": _when(a["created_at"]), "outcome": a["outcome"], "reason": a["reason"]}
        for a in actions
    ]), hide_index=True)
else:
    st.caption("no actions yet")
