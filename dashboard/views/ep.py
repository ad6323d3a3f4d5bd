"""Expert-parallelism page: per-rank load and step time over time for a pool whose engines run
several data-parallel ranks, the skew between ranks, and EPLB's state and effect when recorded."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import common as c
from dashboard.pages import EP_LOAD, EP_STEP

w = c.window()
load_name = str(c.chosen("ep_load")) if c.chosen("ep_load") in EP_LOAD else EP_LOAD[0]
step_name = str(c.chosen("ep_step")) if c.chosen("ep_step") in EP_STEP else EP_STEP[0]
data = c.page_data("ep", w, pool=c.chosen("ep_pool"), load=load_name, step=step_name)
st.title("Expert parallelism")

if data["pool"] is None:
    st.info(
        "No expert-parallel data in the store for this range. This page needs a pool whose engines report "
        "data-parallel ranks above 0 (subjects `engine/<pool>/<pod>/<rank>`, from vLLM's `engine` label), "
        "as an expert-parallel deployment has. vLLM exports no per-expert load metric, so imbalance shows "
        "as skew between ranks in their load and step time."
        + (f" EPLB signals found: {', '.join(data['eplb_names'])}." if data["eplb_names"] else
           " No EPLB signal (`eplb_*`) is stored either.")
    )
    st.stop()

cols = st.columns(3)
with cols[0]:
    pool = c.select("EP pool", data["pools"], "ep_pool", data["pool"])
with cols[1]:
    c.select("Load signal", list(EP_LOAD), "ep_load", load_name)
with cols[2]:
    c.select("Step-time signal", list(EP_STEP), "ep_step", step_name)
engines: list[str] = data["engines"]
st.caption(f"{pool}: {len(engines)} ranks · {w.label} up to {c.when(w.end)} UTC")


def ranks(points: list[Any]) -> pd.DataFrame:
    df = c.points_frame(points)
    df["rank"] = df["subject"].str.removeprefix(f"engine/{pool}/")
    return df


load = ranks(data["load_series"])
step = ranks(data["step_series"])
if load.empty and step.empty:
    st.info(f"The ranks of {pool} reported neither {load_name} nor {step_name} in this range.")
    st.stop()

skew = pd.DataFrame()
if not load.empty:
    g = load.groupby("time")["mean"]
    skew = pd.DataFrame({"max/mean": g.max() / g.mean().where(g.mean() > 0)}).dropna().reset_index()
    now_skew = skew["max/mean"].iloc[-1] if not skew.empty else None
    share = load.groupby("rank")["mean"].mean()
    hot = share.idxmax() if not share.empty else "-"
    m = st.columns(3)
    m[0].metric("Load skew now (max / mean rank)", "-" if now_skew is None else f"{now_skew:.2f}")
    m[1].metric("Hottest rank over the range", hot)
    m[2].metric("Its load against the mean", f"{share.max() / share.mean():.2f}x" if share.mean() > 0 else "-")

left, right = st.columns(2)
with left:
    st.markdown(f"**Load per rank: {load_name}**")
    if load.empty:
        st.caption("no data in range")
    else:
        c.show(c.heatmap(load, y="rank", value="mean", title=load_name))
with right:
    st.markdown(f"**Step time per rank: {step_name}**")
    if step.empty:
        st.caption("no data in range")
    else:
        c.show(c.heatmap(step, y="rank", value="mean", title="seconds", scheme="inferno"))

eplb_actions = pd.DataFrame(data["eplb_actions"])
marks = None
if not eplb_actions.empty:
    marks = pd.DataFrame({"time": pd.to_datetime(eplb_actions["created_at"], unit="s", utc=True),
                          "label": eplb_actions["kind"] + " #" + eplb_actions["id"].astype(str)})
left, right = st.columns(2)
with left:
    st.markdown("**Skew between ranks over time** (max / mean of the load signal)")
    if skew.empty:
        st.caption("no load data in range")
    else:
        frame = skew.rename(columns={"max/mean": "mean"}).assign(signal="load skew")
        frame["min"] = frame["max"] = frame["mean"]
        c.show(c.band_chart(frame, y_title="max / mean", color="signal", band=False, marks=marks, w=w,
                            rules=[(1.0, "balanced")]))
with right:
    st.markdown("**Step time: slowest rank against the median**")
    if step.empty:
        st.caption("no step-time data in range")
    else:
        g = step.groupby("time")["mean"]
        frame = pd.concat([g.max().rename("slowest rank"), g.median().rename("median rank")], axis=1).reset_index()
        frame = frame.melt(id_vars="time", var_name="signal", value_name="mean")
        frame["min"] = frame["max"] = frame["mean"]
        c.show(c.band_chart(frame, y_title="seconds", color="signal", band=False, marks=marks, w=w))

st.subheader("EPLB")
eplb = c.points_frame(data["eplb_series"])
if eplb.empty and eplb_actions.empty:
    st.caption("No EPLB state is stored for this pool: vLLM exports no EPLB metric (only a `balancedness` log "
               "line), and the control plane has taken no EPLB action here. Actions that enable or tune EPLB "
               "appear on the charts above, with their effect on the skew below.")
else:
    if not eplb.empty:
        eplb["signal"] = eplb["name"] + " · " + eplb["subject"].str.replace(f"engine/{pool}/", "rank ", regex=False)
        c.show(c.band_chart(eplb, y_title="value", color="signal", marks=marks, w=w))
    if not eplb_actions.empty:
        rows = []
        for a in eplb_actions.to_dict("records"):
            at = a["created_at"]
            before = skew[(skew["time"] < pd.Timestamp(at, unit="s", tz="UTC"))
                          & (skew["time"] >= pd.Timestamp(at - 3600, unit="s", tz="UTC"))]["max/mean"]
            after = skew[(skew["time"] > pd.Timestamp(at + 300, unit="s", tz="UTC"))
                         & (skew["time"] <= pd.Timestamp(at + 3900, unit="s", tz="UTC"))]["max/mean"]
            rows.append({"action": f"#{a['id']} {a['kind']}", "at": c.when(at), "state": a["state"],
                         "skew hour before": round(before.mean(), 3) if len(before) else None,
                         "skew hour after": round(after.mean(), 3) if len(after) else None,
                         "outcome": a["outcome"] or "-"})
        st.markdown("**EPLB actions and their effect on the load skew** (outside the range: blank)")
        st.dataframe(pd.DataFrame(rows), hide_index=True)
