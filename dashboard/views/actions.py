"""Actions page: the audit log with outcomes, each action's events, and approving or rejecting
proposals in `propose` mode through the control plane's API (the dashboard never writes the store)."""

from __future__ import annotations

import os

import altair as alt
import pandas as pd
import streamlit as st

from controlplane.store.db import redact
from dashboard import common as c

w = c.window()
data = c.page_data("actions", w, action_id=c.chosen_id("action"))
st.title("Actions")

proposed = data["proposed"]
st.subheader(f"Awaiting approval ({len(proposed)})")
if "decided" in st.session_state:
    st.success(st.session_state.pop("decided"))
if not proposed:
    st.caption("No proposal is waiting. In `propose` mode the control plane writes proposals here for a person to "
               "approve; in `act` mode it acts within the rails; in `observe` mode it never acts.")
token = c.api_token()
who = c.approver()
if proposed and token is None:
    st.info("Set FLEETCTL_API_TOKEN for the dashboard (the same token the control plane has) to approve here; "
            "until then, use the command line:")
elif proposed and who.header is not None and who.user is None:
    # Configured behind a proxy, a request without its header came around it: no one to record the decision as.
    st.warning(f"Approving here takes the signed-in user in the `{who.header}` header, which the proxy in front of "
               "the dashboard sets; this request has none, so it did not come through the proxy. Use the command "
               "line:")
for a in proposed:
    with st.container(border=True):
        st.markdown(f"**#{a['id']} {a['kind']} {a['pool']}** {a['params'].get('from_replicas', '')} → "
                    f"{a['params'].get('replicas', '')} · proposed {c.when(a['created_at'])} UTC")
        st.write(a["reason"])
        if a["finding_id"] is not None:
            c.link("incidents", f"Incident #{a['finding_id']}", finding=a["finding_id"])
        if token is None or (who.header is not None and who.user is None):
            db = redact(c.store_url())  # never the store's password on a page anyone with the link reads
            st.code(f"fleetctl actions approve {a['id']} --db '{db}'\n"
                    f"fleetctl actions reject {a['id']} --db '{db}'", language="bash")
            continue
        cols = st.columns([3, 1, 1])
        if who.user is not None:
            by = who.user
            cols[0].markdown(f"Deciding as **{by}** (signed in)")
        else:
            by = cols[0].text_input("Decided by", value=os.environ.get("USER") or "operator", key=f"by_{a['id']}")
        for col, approve in ((cols[1], True), (cols[2], False)):
            if col.button("Approve" if approve else "Reject", key=f"{'ok' if approve else 'no'}_{a['id']}",
                          type="primary" if approve else "secondary"):
                ok, message = c.api_decide(a["id"], approve, by)
                if ok:
                    st.session_state["decided"] = message
                    st.cache_data.clear()
                    st.rerun()
                st.error(message)

st.subheader("Audit log")
actions = data["actions"]
if not actions:
    st.info("No actions yet: the audit log records every action the control plane proposes or takes.")
    st.stop()
log = pd.DataFrame([{
    "id": a["id"], "created": c.when(a["created_at"]), "kind": a["kind"], "pool": a["pool"],
    "change": " ".join(f"{k}={v}" for k, v in a["params"].items() if not k.startswith("verify")),
    "mode": a["mode"], "state": a["state"], "by": a["approved_by"] or "-", "outcome": a["outcome"] or "-",
    "finding": a["finding_id"], "error": a["error"] or "",
} for a in actions])
outcomes = log["outcome"].value_counts()
m = st.columns(5)
m[0].metric("Actions (newest 200)", len(log))
m[1].metric("Recovered", int(outcomes.get("recovered", 0)))
m[2].metric("Not recovered", int(outcomes.get("not_recovered", 0)))
# Scales that ran, judged: advisories and rejected proposals are judged too (would the pool have kept them?).
scaled = log[(log["kind"] == "scale_pool") & (log["state"] == "succeeded")]["outcome"].value_counts()
held, breached = int(scaled.get("held", 0)), int(scaled.get("breached", 0))
m[3].metric("Scales within SLO", f"{held} of {held + breached}",
            help="scales made whose pool kept its SLOs until they were judged")
m[4].metric("Failed or unknown", int(log["state"].isin(["failed", "unknown"]).sum()))
timeline = pd.DataFrame([{
    "created": pd.Timestamp(a["created_at"], unit="s", tz="UTC"), "pool": a["pool"], "kind": a["kind"], "id": a["id"],
    "result": a["outcome"] or a["state"],
} for a in actions])
pad = max(pd.Timedelta(minutes=30), (timeline["created"].max() - timeline["created"].min()) * 0.05)
st.markdown("**Actions over time** (color: outcome, or state while there is none)")
c.show(alt.Chart(timeline).mark_point(filled=True, size=90).encode(
    x=c.utc_x("created", timeline["created"].min() - pad, timeline["created"].max() + pad),
    y=alt.Y("pool:N", title=None), color=alt.Color("result:N", title=None),
    shape=alt.Shape("kind:N", title=None),
    tooltip=["id:Q", "kind:N", "pool:N", "result:N", c.utc_tooltip("created")],
).properties(height=max(110, 36 * timeline["pool"].nunique())))
st.dataframe(log, hide_index=True)

selected = data["selected"]
if selected is None:
    st.stop()
options = [str(a["id"]) for a in actions]
if str(selected["id"]) not in options:
    options.insert(0, str(selected["id"]))
labels = {str(a["id"]): f"#{a['id']} {a['kind']} {a['pool']} ({a['state']})" for a in [selected, *actions]}
c.select("Action", options, "action", str(selected["id"]), format_func=lambda i: labels.get(i, i))
a = selected
st.markdown(f"**#{a['id']} {a['kind']} {a['pool']}** · {a['state']} · mode {a['mode']}"
            + (f" · approved by {a['approved_by']}" if a["approved_by"] else "")
            + (f" · outcome **{a['outcome']}**" if a["outcome"] else ""))
st.write(a["reason"])
detail_cols = st.columns(3)
with detail_cols[0]:
    if a["finding_id"] is not None:
        c.link("incidents", f"Caused by incident #{a['finding_id']}", finding=a["finding_id"])
with detail_cols[1]:
    c.link("pool", f"Pool {a['pool']}", pool=a["pool"])
events = pd.DataFrame([{"time": c.when(e["ts"]), "event": e["event"],
                        "detail": ", ".join(f"{k}={v}" for k, v in (e["detail"] or {}).items())} for e in data["events"]])
st.markdown("**Events**")
if events.empty:
    st.caption("no events recorded")
else:
    st.dataframe(events, hide_index=True)
