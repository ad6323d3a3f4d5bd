"""The dashboard's page models: each page loads everything it shows through one function of `PAGES`.

Each function reads the store through `ReadStore`'s bounded queries only, so a page's cost stays
bounded however long the store has run; the dashboard benchmark times the same functions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from controlplane.store.queries import ReadStore
from policies.kv_transfer import PATHS

__all__ = [
    "EP_LOAD",
    "EP_STEP",
    "PAGES",
    "actions_page",
    "canary_page",
    "ep_page",
    "fleet_page",
    "gpu_page",
    "incidents_page",
    "kv_page",
    "pool_page",
]

# The dashboard's pages: each loads everything it shows through one of these --------------------

FLEET_NOW = ("targets", "targets_up", "engines_reporting", "request_rate", "request_error_rate", "ttft_p95", "tpot_p95",
             "kv_cache_usage_max", "requests_waiting", "prefix_cache_hit_rate", "preemption_rate")
FLEET_SERIES = ("request_rate", "ttft_p95", "tpot_p95")
POOL_NOW = ("engines_reporting", "request_rate", "ttft_p95", "tpot_p95", "kv_cache_usage_max", "prefix_cache_hit_rate")
POOL_SERIES = ("request_rate", "request_error_rate", "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95", "tpot_p99",
               "ttft_over_slo", "tpot_over_slo",
               "queue_time_p95", "requests_running", "requests_waiting", "kv_cache_usage", "kv_cache_usage_max",
               "preemption_rate", "prefix_cache_hit_rate", "external_prefix_cache_hit_rate", "spec_acceptance_rate",
               "spec_mean_acceptance_length", "spec_yield", "engines_reporting", "targets", "targets_up", "replicas_desired",
               "replicas_ready", "autoscale_target_replicas", "autoscale_forecast_rate")
SPEC_POSITION = "spec_acceptance_pos_"
EP_LOAD = ("requests_running", "generation_tokens_rate", "prompt_tokens_rate", "requests_waiting", "kv_cache_usage")
EP_STEP = ("itl_mean", "itl_p50", "tpot_mean", "itl_p95")
EPLB_PREFIX = "eplb_"
GPU_NOW = ("gpu_utilization", "gpu_memory_used_bytes", "gpu_memory_free_bytes", "gpu_tensor_active",
           "gpu_temperature_celsius", "gpu_power_watts")
GPU_DETAIL = ("gpu_utilization", "gpu_memory_used_bytes", "gpu_tensor_active", "gpu_temperature_celsius")
# XID counts and codes (the code is only stored when an XID was seen) and uncorrectable ECC errors.
GPU_EVENTS = ("gpu_xid_errors", "gpu_xid_last", "gpu_ecc_dbe_rate")
TOP_PATHS = 8


def fleet_page(store: ReadStore, start: float, end: float) -> dict[str, Any]:
    """Pools with their latest values, pool series, targets up/down, incidents and recent actions."""
    pools = store.pools()
    subjects = [f"pool/{p}" for p in pools]
    now: dict[str, dict[str, float]] = defaultdict(dict)
    for (name, subject), (_ts, value) in store.latest(FLEET_NOW, subjects, at=end).items():
        now[subject.removeprefix("pool/")][name] = value
    return {
        "pools": pools,
        "now": dict(now),
        "series": store.buckets(FLEET_SERIES, subjects, start, end),
        "targets": store.target_counts(),
        "open_counts": store.open_counts(),
        "open_findings": store.findings(limit=20),
        "recent_findings": store.findings_between(start, end, limit=10),
        "actions": store.actions(limit=10),
        "advice": store.advice(limit=10),
    }


def pool_page(store: ReadStore, start: float, end: float, pool: str | None = None) -> dict[str, Any]:
    """One pool: its series with bands, per-engine hit-rate spread, speculative decoding, replicas and the P:D ratio."""
    pools = store.pools()
    if pool not in pools:
        pool = next(iter(pools), None)
    if pool is None:
        return {"pools": pools, "pool": None}
    subject = f"pool/{pool}"
    positions = store.names(SPEC_POSITION)
    engines = store.subjects_for("prefix_cache_hit_rate", f"engine/{pool}/", start, end)
    return {
        "pools": pools,
        "pool": pool,
        "series": store.buckets(POOL_SERIES, [subject], start, end),
        # The cards: the newest point, as the fleet page shows it, not the mean of the last chart bucket (an hour wide
        # on a day's range).
        "now": {name: value for (name, _s), (_t, value) in store.latest(POOL_NOW, [subject], at=end).items()},
        "positions": store.buckets(positions, [subject], start, end),
        "engine_spread": store.spread(["prefix_cache_hit_rate"], engines, start, end),
        "engine_now": {s: v for (_n, s), (_t, v) in store.latest(["prefix_cache_hit_rate"], engines, at=end).items()},
        "engines": len(engines),
        "scale_actions": [a for a in store.actions_where(pool=pool) if a["kind"] == "scale_pool"],
        "reporting": store.buckets(["engines_reporting"], [f"pool/{p}" for p in pools], start, end),
        "advice": store.advice(pool),
    }


def _ep_groups(store: ReadStore, start: float, end: float) -> dict[str, list[str]]:
    """Engine subjects per pool, for pools whose engines carry data-parallel ranks above 0."""
    by_pool: dict[str, list[str]] = defaultdict(list)
    for subject in store.subjects_for("requests_running", "engine/", start, end):
        parts = subject.split("/")
        if len(parts) == 4:
            by_pool[parts[1]].append(subject)
    return {p: subs for p, subs in sorted(by_pool.items()) if any(s.rsplit("/", 1)[1] != "0" for s in subs)}


def ep_page(store: ReadStore, start: float, end: float, pool: str | None = None, load: str = EP_LOAD[0],
            step: str = EP_STEP[0]) -> dict[str, Any]:
    """Expert parallelism: per-rank load and step time for one EP pool, EPLB signals and actions."""
    groups = _ep_groups(store, start, end)
    eplb_names = store.names(EPLB_PREFIX)
    if pool not in groups:
        pool = next(iter(groups), None)
    out: dict[str, Any] = {"pools": list(groups), "pool": pool, "eplb_names": eplb_names, "load": load, "step": step}
    if pool is None:
        return out
    engines = groups[pool]
    out["engines"] = engines
    out["load_series"] = store.buckets([load], engines, start, end)
    out["step_series"] = store.buckets([step], engines, start, end)
    out["eplb_series"] = store.buckets(eplb_names, [f"pool/{pool}", *engines], start, end) if eplb_names else []
    out["eplb_actions"] = [a for a in store.actions_where(pool=pool) if "eplb" in a["kind"]]
    return out


def kv_page(store: ReadStore, start: float, end: float) -> dict[str, Any]:
    """KV transfer per source (probe paths, vLLM's NIXL connector, NIXL agents): distribution, tail, failures.

    vLLM pools aggregate their engines' transfer histograms, so for that source the distribution
    over time is the pools' own quantiles; the probe paths and NIXL agents have no aggregate, so
    theirs is the spread across subjects.
    """
    sources = []
    for path in PATHS:  # the same subjects and signals the detector reads
        subjects = store.subjects_for(path.p99, path.prefix, start, end)
        if not subjects:
            continue
        p50 = path.p99.replace("p99", "p50")
        rate = [path.rate] if path.rate else []
        totals = store.totals([path.p99, path.failures, *rate], subjects, start, end)
        ranked = sorted(subjects, key=lambda s: -(totals[(path.p99, s)].mean if (path.p99, s) in totals else 0.0))
        source: dict[str, Any] = {
            "prefix": path.prefix, "p50": p50, "p99": path.p99, "failures": path.failures, "rate": path.rate,
            "subjects": len(subjects), "totals": list(totals.values()),
            "tail": store.buckets([path.p99], ranked[:TOP_PATHS], start, end),
            "pools": [], "spread": [],
        }
        if path.prefix == "engine/":
            pools = sorted({f"pool/{s.split('/')[1]}" for s in subjects})
            source["pools"] = store.buckets([p50, path.p99.replace("p99", "p95"), path.p99, path.failures, *rate],
                                            pools, start, end)
        else:
            source["spread"] = store.spread([path.p99, path.failures], subjects, start, end)
        sources.append(source)
    return {"sources": sources}


def gpu_page(store: ReadStore, start: float, end: float, host: str | None = None) -> dict[str, Any]:
    """GPUs by node: latest values, utilization over time per GPU, XID/ECC events, one node's detail."""
    gpus = store.subjects_for("gpu_utilization", "gpu/", start, end)
    hosts = sorted({g.split("/")[1] for g in gpus})
    if host not in hosts:
        host = next(iter(hosts), None)
    detail = [g for g in gpus if g.split("/")[1] == host]
    now: dict[str, dict[str, float]] = defaultdict(dict)
    for (name, subject), (_ts, value) in store.latest(GPU_NOW, gpus, at=end).items():
        now[subject][name] = value
    return {
        "gpus": gpus,
        "hosts": hosts,
        "host": host,
        "now": dict(now),
        "utilization": store.buckets(["gpu_utilization"], gpus, start, end),
        "events": store.buckets(GPU_EVENTS, gpus, start, end, positive=True),
        "detail": store.buckets(GPU_DETAIL, detail, start, end),
    }


def incidents_page(store: ReadStore, start: float, end: float, finding_id: int | None = None) -> dict[str, Any]:
    """Findings in the range for the timeline; one finding with its evidence series and the actions it caused."""
    findings = store.findings_between(start, end)
    selected = store.finding(finding_id) if finding_id is not None else None
    if selected is None and findings:
        selected = findings[0]
    out: dict[str, Any] = {"findings": findings, "open_counts": store.open_counts(), "selected": selected,
                           "evidence": [], "actions": []}
    if selected is None:
        return out
    signal = (selected["evidence"] or {}).get("signal")
    # The baseline window before the incident and a little after it resolved.
    lo = selected["opened_at"] - 2400.0
    hi = min(max(selected["resolved_at"] or end, selected["updated_at"]) + 900.0, max(end, selected["updated_at"]))
    out["window"] = (lo, hi)
    if isinstance(signal, str):
        out["evidence"] = store.buckets([signal], [selected["subject"]], lo, hi)
    out["actions"] = store.actions_where(finding_id=selected["id"])
    return out


def actions_page(store: ReadStore, start: float, end: float, action_id: int | None = None) -> dict[str, Any]:
    """The audit log (newest 200), proposals awaiting approval, and one action's events."""
    actions = store.actions(limit=200)
    proposed = store.actions_where(states=["proposed"])
    selected = store.action(action_id) if action_id is not None else None
    if selected is None and actions:
        selected = proposed[0] if proposed else actions[0]
    return {"actions": actions, "proposed": proposed, "selected": selected,
            "events": store.action_events(selected["id"]) if selected else []}


def canary_page(store: ReadStore, start: float, end: float) -> dict[str, Any]:
    """Canary gate verdicts, newest first."""
    return {"verdicts": store.verdicts()}


PAGES: dict[str, Callable[..., dict[str, Any]]] = {
    "fleet": fleet_page,
    "pool": pool_page,
    "ep": ep_page,
    "kv": kv_page,
    "gpus": gpu_page,
    "incidents": incidents_page,
    "actions": actions_page,
    "canary": canary_page,
}
"""Page key to the function that loads that page's data: (store, start, end, **selection) -> data."""
