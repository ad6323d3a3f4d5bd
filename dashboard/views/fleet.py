"""Fleet page: every pool's health against its SLOs, targets up and down, open incidents, recent actions,
and the control plane's mode and health."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboard import common as c

SEVERITIES = ("critical", "warning", "info")

w = c.window()
data = c.page_data("fleet", w)
st.title("Fleet")
st.caption(f"{w.label} up to {c.when(w.end)} UTC")

# control plane ------------------------------------------------------------------------------
counts: dict[str, int] = data["open_counts"]
status = c.api_status()
cfg = c.fleet_config()
pools: dict[str, str] = data["pools"]
now: dict[str, dict[str, float]] = data["now"]
targets = pd.DataFrame(data["targets"], columns=["pool", "role", "source", "up", "count"])
up = int(targets.loc[targets["up"].astype(bool), "count"].sum()) if not targets.empty else 0
total = int(targets["count"].sum()) if not targets.empty else 0
engines = sum(int(v.get("engines_reporting", 0)) for v in now.values())

cols = st.columns([1, 0.8, 1.5, 0.7, 1, 1])
cols[0].metric("Open incidents", sum(counts.values()),
               help=", ".join(f"{counts.get(s, 0)} {s}" for s in SEVERITIES))
if status.get("ok"):
    cols[1].metric("Mode", status["mode"], help=f"Reported by the control plane at {c.api_url()}")
    # A follower is ready on standby; the Service may lead here to one exactly when the leader stalls, so its word
    # is shown, with the newest signal the leader stored, not "ready".
    newest = "none" if w.latest is None else f"{c.ago(max(0.0, time.time() - w.latest))} ago"
    cols[2].metric("Control plane", str(status.get("status", "?")),
                   help=(f"{status.get('reason')}; newest signal in the store: {newest}" if status.get("reason")
                         else f"last tick {status.get('last_tick_age_s', '-')} s ago"))
else:
    mode = str(cfg.mode) if cfg else next((a["mode"] for a in data["actions"]), "unknown")
    cols[1].metric("Mode", mode, help="From the fleet file (FLEETCTL_CONFIG)" if cfg else
                   "The mode of the newest action in the audit log; the control plane's API did not answer")
    cols[2].metric("Control plane", "unreachable", help=f"{c.api_url()}: {status.get('error')}")
    age = None if w.latest is None else max(0.0, time.time() - w.latest)
    st.caption(f"The control plane's API at {c.api_url()} did not answer ({status.get('error')}); "
               f"newest signal in the store: {c.when(w.latest)} UTC"
               + ("" if age is None else f" ({c.ago(age)} before this page's clock)."))
cols[3].metric("Pools", len(pools))
cols[4].metric("Targets up", f"{up} / {total}", help="Scrape targets (vLLM engines' pods and other exporters)")
cols[5].metric("Engines reporting", engines)

# pools and SLOs -----------------------------------------------------------------------------
st.subheader("Pools")
if not pools:
    st.info("No pool has reported yet.")
else:
    series = c.points_frame(data["series"])
    rows = []
    for pool, role in pools.items():
        v = now.get(pool, {})
        t_slo, p_slo = c.slo(pool)
        mine = series[series["subject"] == f"pool/{pool}"]
        status_parts = []
        for name, objective in (("ttft_p95", t_slo), ("tpot_p95", p_slo)):
            if objective is None:
                continue
            s = mine[mine["name"] == name]["mean"]
            over = float((s > objective).mean()) if len(s) else 0.0
            current = v.get(name)
            label = name.split("_")[0].upper()
            if current is not None and current > objective:
                status_parts.append(f"🔴 {label} over SLO now")
            elif over > 0:
                status_parts.append(f"🟠 {label} over SLO {over:.0%} of the range")
            else:
                status_parts.append(f"🟢 {label} within SLO")
        pool_targets = targets[targets["pool"] == pool]
        rows.append({
            "pool": pool, "role": role or "-",
            "targets up": f"{int(pool_targets.loc[pool_targets['up'].astype(bool), 'count'].sum())} / "
                          f"{int(pool_targets['count'].sum())}" if not pool_targets.empty else "-",
            "engines": int(v["engines_reporting"]) if "engines_reporting" in v else None,
            "req/s": v.get("request_rate"),
            "TTFT p95": c.secs(v.get("ttft_p95")), "TTFT SLO": c.secs(t_slo),
            "TPOT p95": c.secs(v.get("tpot_p95")), "TPOT SLO": c.secs(p_slo),
            "SLO status": "; ".join(status_parts) or ("no SLO in the fleet file" if cfg else "set FLEETCTL_CONFIG for SLOs"),
            "KV max": c.pct(v.get("kv_cache_usage_max")), "waiting": v.get("requests_waiting"),
            "prefix hit": c.pct(v.get("prefix_cache_hit_rate")),
        })
    st.dataframe(pd.DataFrame(rows), hide_index=True,
                 column_config={"req/s": st.column_config.NumberColumn(format="%.1f"),
                                "waiting": st.column_config.NumberColumn(format="%.0f")})
    link_cols = st.columns(min(len(pools), 6))
    for i, pool in enumerate(pools):
        with link_cols[i % len(link_cols)]:
            c.link("pool", f"Pool {pool}", pool=pool)

    if series.empty:
        st.caption("No pool series in this range.")
    else:
        series["pool"] = series["subject"].str.removeprefix("pool/")
        left, right = st.columns(2)
        for col, name, title in ((left, "ttft_p95", "TTFT p95"), (right, "tpot_p95", "TPOT p95")):
            df = series[series["name"] == name]
            rules = [(objective, f"{pool} SLO") for pool in pools
                     if (objective := c.slo(pool)[0 if name == "ttft_p95" else 1]) is not None]
            with col:
                st.markdown(f"**{title} per pool**")
                if df.empty:
                    st.caption("no data in range")
                else:
                    c.show(c.band_chart(df, y_title="seconds", color="pool", rules=rules, w=w))
        df = series[series["name"] == "request_rate"]
        st.markdown("**Requests per second per pool**")
        if df.empty:
            st.caption("no data in range")
        else:
            c.show(c.band_chart(df, y_title="requests/s", color="pool", band=False, w=w))

# incidents and actions ----------------------------------------------------------------------
left, right = st.columns(2)
with left:
    st.subheader("Incidents in range")
    sev_cols = st.columns(3)
    for col, sev in zip(sev_cols, SEVERITIES, strict=True):
        col.metric(f"open {sev}", counts.get(sev, 0))
    shown = {f["id"]: f for f in [*data["open_findings"], *data["recent_findings"]]}
    if not shown:
        st.caption("No incident was open in this range.")
    for f in sorted(shown.values(), key=lambda f: (f["state"] != "open", -f["opened_at"])):
        with st.expander(f"#{f['id']} [{f['severity']}] {f['summary']} ({f['state']}, opened {c.when(f['opened_at'])})",
                         expanded=f["state"] == "open"):
            st.write(f["cause"])
            c.link("incidents", "Evidence and runbook", finding=f["id"])
            if (of := c.pool_of(f["subject"])) is not None:
                c.link("pool", f"Pool {of}", pool=of)
with right:
    st.subheader("Recent actions")
    if not data["actions"]:
        st.caption("No actions yet.")
    for a in data["actions"]:
        c.link("actions", f"#{a['id']} {a['kind']} {a['pool']}: {a['state']}"
               + (f", {a['outcome']}" if a["outcome"] else "") + f" ({c.when(a['created_at'])})", action=a["id"])
    c.link("actions", "All actions and approvals")

c.advice_section(data["advice"])
