"""Canary-gates page: the verdict history from the verdicts table, with each metric's explanation."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from dashboard import common as c

RESULTS = alt.Scale(domain=["pass", "marginal", "fail", "inconclusive"], range=["#2ca02c", "#ff7f0e", "#d62728", "#7f7f7f"])


def metric_rows(details: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-metric rows from a verdict's details: a list of metric dicts, or a mapping of name to dict."""
    metrics = details.get("metrics", details)
    if isinstance(metrics, dict):
        metrics = [{"name": k, **(v if isinstance(v, dict) else {"value": v})} for k, v in metrics.items()]
    if not isinstance(metrics, list):
        return []
    rows = []
    for m in metrics:
        if isinstance(m, dict):
            rows.append({k: v if isinstance(v, str | int | float | bool) or v is None else str(v) for k, v in m.items()})
    return rows


w = c.window()
data = c.page_data("canary", w)
st.title("Canary gates")
verdicts = data["verdicts"]
if not verdicts:
    st.info("No canary gate has run yet. Verdicts (pass, fail or inconclusive, with per-metric statistics) "
            "appear here once a gate judges a rollout.")
    st.stop()

df = pd.DataFrame([{
    "id": v["id"], "gate": v["gate"], "pool": v["pool"], "baseline": v["baseline"], "canary": v["canary"],
    "result": v["result"], "score": v["score"], "finished": pd.Timestamp(v["finished_at"], unit="s", tz="UTC"),
    "duration": c.secs(v["finished_at"] - v["started_at"]),
} for v in verdicts])
counts = df["result"].value_counts()
m = st.columns(5)
m[0].metric("Verdicts (newest 200)", len(df))
for col, result in zip(m[1:], ("pass", "marginal", "fail", "inconclusive"), strict=True):
    col.metric(result, int(counts.get(result, 0)))

df["lane"] = df["gate"] + " · " + df["pool"]
st.markdown("**History**")
c.show(alt.Chart(df).mark_point(filled=True, size=90).encode(
    x=c.utc_x("finished"), y=alt.Y("lane:N", title=None),
    color=alt.Color("result:N", scale=RESULTS), shape="result:N",
    tooltip=["id:Q", "gate:N", "pool:N", "baseline:N", "canary:N", "result:N", "score:Q",
             c.utc_tooltip("finished", seconds=False)],
).properties(height=max(120, 40 * df["lane"].nunique())))
if df["score"].notna().any():
    st.markdown("**Score**")
    c.show(alt.Chart(df.dropna(subset=["score"])).mark_line(point=True).encode(
        x=c.utc_x("finished"), y=alt.Y("score:Q", title="score"), color=alt.Color("lane:N", title=None),
        tooltip=["id:Q", "result:N", "score:Q"]).properties(height=c.CHART_HEIGHT))

st.dataframe(df.drop(columns=["lane"]).assign(finished=[c.when(v["finished_at"]) for v in verdicts]), hide_index=True)
by_id = {str(v["id"]): v for v in verdicts}
choice = c.select("Verdict", list(by_id), "verdict", c.chosen("verdict"),
                  format_func=lambda i: f"#{i} {by_id[i]['gate']} {by_id[i]['pool']}: {by_id[i]['result']}")
v = by_id.get(choice or "", verdicts[0])
st.markdown(f"**#{v['id']}** {c.literal(v['gate'])} on {c.literal(v['pool'])}: {c.literal(v['baseline'])} → "
            f"{c.literal(v['canary'])} · **{v['result']}**" + ("" if v["score"] is None else f" · score {v['score']:.1f}"))
details = v["details"] or {}
if details.get("reason"):
    st.markdown(f"**Why:** {details['reason']}")
rows = metric_rows(details)
if rows:
    st.dataframe(pd.DataFrame(rows), hide_index=True)
else:
    st.json(v["details"] or {}, expanded=False)
