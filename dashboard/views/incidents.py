"""Incidents page: the timeline of findings in the range, and one incident with its evidence
plotted (signal, baseline, threshold), its runbook, and links to its pool and the actions it caused."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from controlplane import runbooks
from dashboard import common as c

COLORS = alt.Scale(domain=["critical", "warning", "info"], range=["#d62728", "#ff7f0e", "#1f77b4"])


def demote(markdown: str) -> str:
    """The runbook's headings two levels down, so they sit under this page's own."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append(f"##{line}" if line.startswith("#") and not fenced else line)
    return "\n".join(out)


w = c.window()
data = c.page_data("incidents", w, finding_id=c.chosen_id("finding"))
st.title("Incidents")
st.caption(f"{w.label} up to {c.when(w.end)} UTC")
counts = data["open_counts"]
m = st.columns(4)
m[0].metric("Open", sum(counts.values()))
for col, sev in zip(m[1:], ("critical", "warning", "info"), strict=True):
    col.metric(f"open {sev}", counts.get(sev, 0))

findings = data["findings"]
if findings:
    tl = pd.DataFrame([{
        "incident": f"#{f['id']} {f['kind']} {f['subject']}", "severity": f["severity"], "state": f["state"],
        "opened": pd.Timestamp(max(f["opened_at"], w.start), unit="s", tz="UTC"),
        "until": pd.Timestamp(min(f["resolved_at"] or w.end, w.end), unit="s", tz="UTC"), "summary": f["summary"],
    } for f in findings])
    st.markdown(f"**Timeline** ({len(findings)} incidents in range)")
    c.show(alt.Chart(tl).mark_bar(minBandSize=4).encode(
        x=c.utc_x("opened", w.start, w.end),
        x2="until:T", y=alt.Y("incident:N", title=None, sort="-x", axis=alt.Axis(labelLimit=320)),
        color=alt.Color("severity:N", scale=COLORS), tooltip=["incident:N", "severity:N", "state:N", "summary:N",
                                                              c.utc_tooltip("opened")],
    ).properties(height=min(600, max(120, 22 * len(tl)))))
else:
    st.caption("No incident was open in this range.")

selected = data["selected"]
if selected is None:
    st.info("No incidents yet: findings appear here when a policy detects a problem.")
    st.stop()

options = [str(f["id"]) for f in findings]
if str(selected["id"]) not in options:
    options.insert(0, str(selected["id"]))
labels = {str(f["id"]): f"#{f['id']} [{f['severity']}] {f['summary']}" for f in [selected, *findings]}
c.select("Incident", options, "finding", str(selected["id"]), format_func=lambda i: labels.get(i, i))

f = selected
st.header(f"#{f['id']} {f['summary']}")
st.markdown(f"**{f['severity']}** · {f['kind']} on `{f['subject']}` · {f['state']} · opened {c.when(f['opened_at'])} UTC"
            + (f" · resolved {c.when(f['resolved_at'])} UTC ({f['resolve_reason']})" if f["resolved_at"] else ""))
st.write(f["cause"])
pool = c.pool_of(f["subject"])
links = st.columns(2)
lo, hi = data.get("window", (w.start, w.end))
span = next((label for label, secs in c.RANGES.items() if secs >= hi - lo), "7 d")
with links[0]:
    if pool:
        c.link("pool", f"Pool {pool} at the time", pool=pool, end=round(hi), range=span)
for a in data["actions"][:5]:
    with links[1]:
        c.link("actions", f"Action #{a['id']} {a['kind']} ({a['state']}, {a['outcome'] or 'no outcome yet'})",
               action=a["id"])
if not data["actions"]:
    links[1].caption("No action was taken for this incident.")

evidence = f["evidence"] or {}
signal = evidence.get("signal")
series = c.points_frame(data["evidence"])
st.markdown(f"**Evidence: `{signal or '?'}` on `{f['subject']}`**")
if isinstance(signal, str):
    st.caption(c.signal_help(signal))
if series.empty:
    st.caption("The evidence signal has no stored points around this incident (retention may have removed them).")
else:
    marks = pd.DataFrame({"time": pd.to_datetime([f["opened_at"]] + ([f["resolved_at"]] if f["resolved_at"] else []),
                                                 unit="s", utc=True),
                          "label": ["opened"] + (["resolved"] if f["resolved_at"] else [])})
    series["signal"] = signal
    frame = c.Window(lo, hi, "", False, None)
    c.show(c.band_chart(series, y_title=c.signal_title(str(signal)), color="signal", rules=c.evidence_lines(f["kind"], evidence),
                        marks=marks, w=frame, height=280))
with st.expander("Evidence as recorded", expanded=False):
    st.json(evidence, expanded=True)

st.subheader("Runbook")
try:
    with st.container(border=True):
        st.markdown(demote(runbooks.load(f["runbook"])))
except KeyError:
    st.caption(f"No runbook named {f['runbook']} ships with this version.")
