"""KV-transfer page: NIXL transfer-time distribution and tail over time, failures, and each
prefill->decode pair, from the KV path probe, vLLM's NIXL connector metrics and NIXL agents."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard import common as c

TITLES = {"kvpath/": "KV path probe (prefill → decode pairs)", "engine/": "vLLM NIXL connector (per engine)",
          "nixl/": "NIXL agents"}

MS = 1000.0  # transfer times are stored in seconds and shown in milliseconds


def ms(df: pd.DataFrame, cols: tuple[str, ...] = ("mean", "min", "max")) -> pd.DataFrame:
    out = df.copy()
    for col in cols:
        if col in out:
            out[col] = out[col] * MS
    return out


w = c.window()
data = c.page_data("kv", w)
st.title("KV transfer")
st.caption(f"{w.label} up to {c.when(w.end)} UTC")
if not data["sources"]:
    st.info("No KV-transfer data in the store for this range. It comes from the KV path probe "
            "(`kvpath/<prefill>-><decode>`: kv_transfer_p99, kv_failure_rate), from vLLM engines running the "
            "NIXL connector (nixl_xfer_time_*, nixl_failed_transfer_rate) and from NIXL's own exporter "
            "(`nixl/<host>/<agent>`).")
    st.stop()

for src in data["sources"]:
    prefix = src["prefix"]
    st.header(TITLES.get(prefix, prefix))
    totals = pd.DataFrame([(p.name, p.subject, p.mean, p.max) for p in src["totals"]],
                          columns=["name", "subject", "mean", "max"])
    wide = totals.pivot_table(index="subject", columns="name", values="mean") if not totals.empty else pd.DataFrame()
    peak = totals[totals["name"] == src["p99"]].set_index("subject")["max"] if not totals.empty else pd.Series()
    st.caption(f"{src['subjects']} subjects · p99 is `{src['p99']}`, failures `{src['failures']}`")

    left, right = st.columns(2)
    with left:
        if prefix == "engine/":
            pools = c.points_frame(src["pools"])
            lat = pools[pools["name"].str.startswith(src["p99"][:-3])].copy()
            lat["signal"] = lat["subject"].str.removeprefix("pool/") + " " + lat["name"].str.rsplit("_", n=1).str[-1]
            st.markdown("**Transfer time per pool (p50, p95, p99)**")
            if lat.empty:
                st.caption("no pool-level transfer times in range")
            else:
                c.show(c.band_chart(ms(lat), y_title="ms", color="signal", band=False, w=w))
        else:
            spread = c.spread_frame(src["spread"])
            lat = spread[spread["name"] == src["p99"]].assign(signal=f"p99 across {src['subjects']} (mean, band min–max)")
            st.markdown("**Transfer-time p99 over time across subjects**")
            if lat.empty:
                st.caption("no transfer times in range")
            else:
                c.show(c.band_chart(ms(lat), y_title="ms", color="signal", w=w))
    with right:
        st.markdown("**Distribution of p99 across subjects (range mean)**")
        if src["p99"] not in wide:
            st.caption("no transfer times in range")
        else:
            hist = (wide[[src["p99"]]] * MS).rename(columns={src["p99"]: "p99"}).reset_index()
            chart = alt.Chart(hist).mark_bar().encode(
                x=alt.X("p99:Q", bin=alt.Bin(maxbins=30), title="p99 (ms)"),
                y=alt.Y("count():Q", title="subjects", axis=alt.Axis(tickMinStep=1)), tooltip=["count():Q"],
            ).properties(height=c.CHART_HEIGHT)
            c.show(chart)

    left, right = st.columns(2)
    with left:
        tail = c.points_frame(src["tail"])
        st.markdown("**Tail over time: the slowest subjects' p99**")
        if tail.empty:
            st.caption("no transfer times in range")
        else:
            tail["subject"] = tail["subject"].str.removeprefix(prefix)
            c.show(c.band_chart(ms(tail), y_title="ms", color="subject", band=False, w=w))
    with right:
        st.markdown("**Failed transfers per second**")
        if prefix == "engine/":
            pools = c.points_frame(src["pools"])
            fails = pools[pools["name"] == src["failures"]].copy()
            fails["signal"] = fails["subject"].str.removeprefix("pool/")
            fails = fails.rename(columns={"mean": "total"})
        else:
            spread = c.spread_frame(src["spread"])
            fails = spread[spread["name"] == src["failures"]].assign(signal="all subjects")
        if fails.empty:
            st.caption("no failure counters in range")
        else:
            fails["min"] = fails["max"] = fails["total"]
            c.show(c.band_chart(fails, y_title="failures/s", color="signal", band=False, y="total", w=w))

    if prefix == "kvpath/" and src["p99"] in wide:
        pairs = wide.reset_index()
        pairs["p99 ms"] = pairs[src["p99"]] * MS
        split = pairs["subject"].str.removeprefix(prefix).str.split("->", n=1, expand=True)
        if split.shape[1] == 2:
            pairs["prefill"], pairs["decode"] = split[0], split[1]
            st.markdown("**Per prefill → decode pair: p99 over the range**")
            chart = alt.Chart(pairs).mark_rect().encode(
                x=alt.X("decode:N", title="decode", axis=alt.Axis(labelAngle=0)), y=alt.Y("prefill:N", title="prefill"),
                color=alt.Color("p99 ms:Q", title="p99 (ms)", scale=alt.Scale(scheme="orangered")),
                tooltip=["prefill:N", "decode:N", alt.Tooltip("p99 ms:Q", format=".1f")],
            ).properties(height=min(600, max(160, 18 * pairs["prefill"].nunique())))
            c.show(chart)

    table = wide.copy()
    if not table.empty:
        table["p99 peak (ms)"] = peak * MS
        if src["p99"] in table:
            table[src["p99"]] = table[src["p99"]] * MS
            table = table.rename(columns={src["p99"]: "p99 (ms)"})
        if src["rate"] and src["rate"] in table and src["failures"] in table:
            table["failed share"] = table[src["failures"]] / table[src["rate"]].where(table[src["rate"]] > 0)
        table = table.sort_values("p99 (ms)", ascending=False) if "p99 (ms)" in table else table
        with st.expander(f"All {len(table)} subjects (range means)", expanded=False):
            st.dataframe(table.reset_index(), hide_index=True)
