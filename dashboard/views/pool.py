"""Pool page: one pool's traffic, latency quantiles against its SLOs, queue, KV cache, preemptions,
prefix-cache hit rate with its per-engine spread, speculative decoding, replicas and the P:D ratio."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import common as c

w = c.window()
data = c.page_data("pool", w, pool=c.chosen("pool"))
st.title("Pool")
if data["pool"] is None:
    st.info("No pool has reported to the store yet.")
    st.stop()
pool = c.select("Pool", list(data["pools"]), "pool", data["pool"]) or data["pool"]
role = data["pools"].get(pool) or "unknown role"
ttft_slo, tpot_slo = c.slo(pool)
st.caption(f"{pool} ({role}) · {w.label} up to {c.when(w.end)} UTC · "
           + ("SLOs from the fleet file" if c.fleet_config() else "set FLEETCTL_CONFIG to the fleet file to see SLOs"))

s = c.points_frame(data["series"])


def pick(*names: str) -> pd.DataFrame:
    df = s[s["name"].isin(names)].copy()
    df["signal"] = df["name"]
    return df


def latest(name: str) -> float | None:
    value = data["now"].get(name)
    return None if value is None else float(value)


def chart(title: str, df: pd.DataFrame, y_title: str, *, color: str | None = "signal", empty: str = "no data in range",
          **kw: object) -> None:
    st.markdown(f"**{title}**")
    if df.empty:
        st.caption(empty)
    else:
        c.show(c.band_chart(df, y_title=y_title, color=color, w=w, **kw))  # type: ignore[arg-type]


cols = st.columns(6)
cols[0].metric("Engines reporting", "-" if latest("engines_reporting") is None else f"{latest('engines_reporting'):.0f}")
cols[1].metric("Requests/s", "-" if latest("request_rate") is None else f"{latest('request_rate'):.1f}")
for col, name, label, objective in ((cols[2], "ttft_p95", "TTFT p95", ttft_slo), (cols[3], "tpot_p95", "TPOT p95", tpot_slo)):
    value = latest(name)
    over = None if value is None or objective is None else f"{(value - objective) * 1000:+.0f} ms against the SLO"
    col.metric(label, c.secs(value), delta=over, delta_color="inverse",
               help=f"SLO {c.secs(objective)}" if objective else "no SLO in the fleet file")
cols[4].metric("KV cache (max engine)", c.pct(latest("kv_cache_usage_max")))
cols[5].metric("Prefix-cache hit rate", c.pct(latest("prefix_cache_hit_rate")))

if s.empty:
    st.info(f"Pool {pool} has no signals in this range.")
    st.stop()

left, right = st.columns(2)
with left:
    chart("Requests per second (and the autoscaler's planned arrivals)",
          pick("request_rate", "request_error_rate", "autoscale_forecast_rate"), "requests/s")
    chart("Queue", pick("requests_waiting", "requests_running"), "requests")
    chart("Preemptions per second", pick("preemption_rate"), "preemptions/s")
    # A p95 objective allows 5 % of requests over it; unlike the p95 read from the buckets, the share is exact when
    # the objective sits on a bucket bound.
    chart("Requests over the SLO (share; a p95 objective allows 5 %)", pick("ttft_over_slo", "tpot_over_slo"),
          "share of requests", fmt=".1%", rules=[(0.05, "5 %")],
          empty="no share yet (the pool has no objectives in the fleet file, or nothing finished)")
with right:
    chart("TTFT quantiles", pick("ttft_p50", "ttft_p95", "ttft_p99"), "seconds", band=False,
          rules=[(ttft_slo, "TTFT p95 SLO")] if ttft_slo else ())
    chart("TPOT quantiles", pick("tpot_p50", "tpot_p95", "tpot_p99"), "seconds", band=False,
          rules=[(tpot_slo, "TPOT p95 SLO")] if tpot_slo else ())
    chart("KV-cache usage", pick("kv_cache_usage", "kv_cache_usage_max"), "fraction of blocks", fmt=".0%")

st.subheader("Prefix cache")
left, right = st.columns([3, 2])
with left:
    spread = c.spread_frame(data["engine_spread"])
    pool_hits = pick("prefix_cache_hit_rate")
    st.markdown(f"**Hit rate: pool, and the spread across its {data['engines']} engines**")
    if pool_hits.empty and spread.empty:
        st.caption("no prefix-cache queries in range")
    else:
        frames = [pool_hits.assign(signal="pool")[["time", "signal", "mean", "min", "max"]]]
        if not spread.empty:
            frames.append(spread.assign(signal="engines (mean, band min–max)")[["time", "signal", "mean", "min", "max"]])
        c.show(c.band_chart(pd.concat(frames), y_title="hit rate", color="signal", fmt=".0%", w=w))
with right:
    st.markdown("**Hit rate per engine, now**")
    per_engine = pd.DataFrame(sorted(data["engine_now"].items()), columns=["engine", "hit rate"])
    if per_engine.empty:
        st.caption("no engine reported a hit rate in the last minutes")
    else:
        per_engine["engine"] = per_engine["engine"].str.removeprefix(f"engine/{pool}/")
        c.show(c.bar_chart(per_engine, x="engine", y="hit rate", y_title="hit rate", fmt=".0%"))

st.subheader("Speculative decoding")
spec = pick("spec_acceptance_rate", "spec_mean_acceptance_length", "spec_yield")
positions = c.points_frame(data["positions"])
if spec.empty and positions.empty:
    st.caption(f"Pool {pool} reports no speculative decoding in this range.")
else:
    left, mid, right = st.columns(3)
    with left:
        chart("Acceptance rate and yield", pick("spec_acceptance_rate", "spec_yield"), "fraction", fmt=".0%")
    with mid:
        chart("Mean acceptance length", pick("spec_mean_acceptance_length"), "tokens per draft")
    with right:
        st.markdown("**Acceptance per draft position (range mean)**")
        if positions.empty:
            st.caption("no per-position counters in range")
        else:
            positions["position"] = positions["name"].str.removeprefix("spec_acceptance_pos_").astype(int)
            positions["weighted"] = positions["mean"] * positions["count"]
            per = positions.groupby("position", as_index=False)[["weighted", "count"]].sum()
            per["acceptance"] = per["weighted"] / per["count"]
            per["position"] = per["position"].astype(str)
            c.show(c.bar_chart(per, x="position", y="acceptance", y_title="accepted per draft", fmt=".0%"))

st.subheader("Replicas")
left, right = st.columns(2)
with left:
    actual = pick("replicas_desired", "replicas_ready", "autoscale_target_replicas", "engines_reporting")
    # The signal is the sizer's recommendation, before its scale-down hold: `fleetctl autoscale plan`'s target is after.
    actual.loc[actual["signal"] == "autoscale_target_replicas", "signal"] = "recommended (before the hold)"
    desired_rows: list[tuple[float, Any]] = []
    if not (actual["name"] == "replicas_desired").any():
        # Stores written before replica counts were signals: desired from the audit log's scale actions.
        for a in sorted(data["scale_actions"], key=lambda a: a["created_at"]):
            if a["state"] == "succeeded" and a["finished_at"] is not None:
                if not desired_rows and a["params"].get("from_replicas") is not None:
                    desired_rows.append((w.start, a["params"]["from_replicas"]))
                desired_rows.append((a["finished_at"], a["params"].get("replicas")))
    if desired_rows:
        desired_rows.append((w.end, desired_rows[-1][1]))
        desired = pd.DataFrame(desired_rows, columns=["ts", "mean"]).dropna()
        desired = desired[desired["ts"] >= w.start - 1]
        desired["time"] = pd.to_datetime(desired["ts"], unit="s", utc=True)
        desired["signal"] = "desired (audit log)"
        desired["min"] = desired["max"] = desired["mean"]
        actual = pd.concat([actual, desired])
    cfg = c.fleet_config()
    rules = []
    if cfg is not None:
        try:
            bounds = cfg.pool(pool).replicas
            rules = [(float(bounds.min), "min replicas"), (float(bounds.max), "max replicas")]
        except KeyError:
            pass
    chart("Desired, ready and the autoscaler's recommendation", actual, "replicas / engines", band=False, rules=rules,
          empty="no replica signals in range")
    last_scale = max(data["scale_actions"], key=lambda a: a["created_at"], default=None)
    if last_scale is not None:
        st.caption(f"Last scale action #{last_scale['id']} ({last_scale['state']}): {last_scale['reason']}")
    st.caption("`fleetctl autoscale plan --pool " + pool + "` explains the target: forecast, curves and SLO margins.")
with right:
    rep = c.points_frame(data["reporting"])
    roles = data["pools"]
    st.markdown("**Prefill : decode engines (fleet)**")
    if rep.empty:
        st.caption("no engines_reporting signals in range")
    else:
        rep["role"] = rep["subject"].str.removeprefix("pool/").map(roles)
        by = rep[rep["role"].isin(["prefill", "decode"])].pivot_table(index="time", columns="role", values="mean",
                                                                      aggfunc="sum")
        if {"prefill", "decode"} <= set(by.columns):
            ratio = (by["prefill"] / by["decode"]).dropna().reset_index(name="mean")
            ratio["signal"] = "prefill per decode engine"
            ratio["min"] = ratio["max"] = ratio["mean"]
            c.show(c.band_chart(ratio, y_title="ratio", color="signal", band=False, w=w))
            st.caption(f"Now {by['prefill'].iloc[-1]:.0f} prefill : {by['decode'].iloc[-1]:.0f} decode engines.")
        else:
            st.caption("The fleet needs both a prefill and a decode pool (roles from the targets) for a ratio.")

c.advice_section(data["advice"])
