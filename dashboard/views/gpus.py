"""GPU page: utilization, memory, tensor activity and temperature by node, utilization per GPU over
time, and XID/ECC events; one node's GPUs in detail."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import common as c

w = c.window()
data = c.page_data("gpus", w, host=c.chosen("gpu_host"))
st.title("GPUs")
if not data["gpus"]:
    st.info("No GPU signals in the store for this range: add dcgm-exporter targets (or run the NVML collector) "
            "so that `gpu/<host>/<gpu>` subjects report gpu_utilization, memory, tensor activity and temperature.")
    st.stop()
st.caption(f"{len(data['gpus'])} GPUs on {len(data['hosts'])} nodes · {w.label} up to {c.when(w.end)} UTC")

now = pd.DataFrame.from_dict(data["now"], orient="index")
for col in ("gpu_utilization", "gpu_memory_used_bytes", "gpu_memory_free_bytes", "gpu_tensor_active",
            "gpu_temperature_celsius", "gpu_power_watts"):
    if col not in now:
        now[col] = float("nan")
now["host"] = [s.split("/")[1] for s in now.index]
now["memory"] = now["gpu_memory_used_bytes"] / (now["gpu_memory_used_bytes"] + now["gpu_memory_free_bytes"])
events = c.points_frame(data["events"])
events["host"] = events["subject"].str.split("/").str[1]
xids = events[events["name"] == "gpu_xid_errors"].groupby("host")["mean"].count()
ecc = events[events["name"] == "gpu_ecc_dbe_rate"].groupby("host")["mean"].count()

nodes = now.groupby("host").agg(gpus=("host", "size"), utilization=("gpu_utilization", "mean"), memory=("memory", "mean"),
                                tensor=("gpu_tensor_active", "mean"), temp_max=("gpu_temperature_celsius", "max"),
                                power=("gpu_power_watts", "sum"))
nodes["XID events"] = xids.reindex(nodes.index).fillna(0).astype(int)
nodes["ECC DBE events"] = ecc.reindex(nodes.index).fillna(0).astype(int)
m = st.columns(4)
m[0].metric("Mean utilization now", c.pct(now["gpu_utilization"].mean()))
m[1].metric("Mean memory used", c.pct(now["memory"].mean()))
hottest = now["gpu_temperature_celsius"].max()
m[2].metric("Hottest GPU", "-" if pd.isna(hottest) else f"{hottest:.0f} °C")
m[3].metric("GPUs with XID/ECC events", events["subject"].nunique())

st.subheader("Nodes now")
st.dataframe(nodes.reset_index(), hide_index=True, column_config={
    "utilization": st.column_config.ProgressColumn(format="percent", min_value=0, max_value=1),
    "memory": st.column_config.ProgressColumn(format="percent", min_value=0, max_value=1),
    "tensor": st.column_config.ProgressColumn(format="percent", min_value=0, max_value=1),
    "temp_max": st.column_config.NumberColumn("temp max (°C)", format="%.0f"),
    "power": st.column_config.NumberColumn("power (W)", format="%.0f"),
})

util = c.points_frame(data["utilization"])
st.subheader("Utilization per GPU")
if util.empty:
    st.caption("no utilization in range")
else:
    util["gpu"] = util["subject"].str.removeprefix("gpu/")
    c.show(c.heatmap(util, y="gpu", value="mean", title="utilization", fmt=".0%"))

st.subheader("XID and ECC events")
if events.empty:
    st.caption("No XID or uncorrectable ECC error in this range.")
else:
    shown = events.sort_values("ts", ascending=False).head(200)
    st.dataframe(pd.DataFrame({
        "from": [c.when(t) for t in shown["ts"]], "GPU": shown["subject"].str.removeprefix("gpu/"),
        "event": shown["name"].map({"gpu_xid_errors": "XID errors", "gpu_xid_last": "last XID code",
                                    "gpu_ecc_dbe_rate": "uncorrectable ECC errors/s"}),
        "max": shown["max"],
    }), hide_index=True)
    st.caption("Each row is a time bucket in which the GPU reported the event; `max` is the largest value in it "
               "(XID count or code, or ECC errors per second).")

st.subheader("Node detail")
host = c.select("Node", data["hosts"], "gpu_host", data["host"])
detail = c.points_frame(data["detail"])
if detail.empty:
    st.caption(f"{host} reported nothing in this range.")
else:
    detail["gpu"] = detail["subject"].str.removeprefix(f"gpu/{host}/")
    left, right = st.columns(2)
    specs = (("gpu_utilization", "Utilization", "fraction", ".0%"), ("gpu_memory_used_bytes", "Memory used", "bytes", ".3~s"),
             ("gpu_tensor_active", "Tensor-core activity", "fraction", ".0%"),
             ("gpu_temperature_celsius", "Temperature", "°C", ".0f"))
    for i, (name, title, unit, fmt) in enumerate(specs):
        with (left if i % 2 == 0 else right):
            st.markdown(f"**{title}**")
            df = detail[detail["name"] == name]
            if df.empty:
                st.caption("no data in range")
            else:
                c.show(c.band_chart(df, y_title=unit, color="gpu", band=False, fmt=fmt, w=w))
