"""The advisor wired to a fleet: its input from the fleet file and the stored signals, `fleetctl advise`.

Owns turning `pools[]` (engine profile, flags, GPU type, SLOs) into `PoolFacts`, and a window of a
pool's stored signals into `PoolObserved` (means, the busy-minute quantile of arrivals, the fullest
KV); the recommendations themselves are `policies.advice`'s.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from controlplane.autoscaling import engine_curves
from controlplane.config import FleetConfig, Pool
from controlplane.store.base import Store
from policies.advice import AdvisorInput, PoolFacts, PoolObserved, Recommendation, SpecFacts, advise
from policies.windows import SignalWindows

__all__ = ["advise_from_store", "advisor_input", "observed", "pool_facts"]

MAX_POSITIONS = 16


def pool_facts(pool: Pool) -> PoolFacts:
    """A pool of the fleet file as the advisor sees it."""
    e = pool.engine
    return PoolFacts(
        name=pool.name, role=str(pool.role), replicas=max(pool.replicas.min, 1), curves=engine_curves(e), gpu_type=e.gpu_type,
        ttft_p95_slo=pool.slo.ttft_p95, tpot_p95_slo=pool.slo.tpot_p95,
        spec=SpecFacts(e.speculative.method, e.speculative.num_speculative_tokens, e.native_mtp),
        kv_cache_dtype=e.kv_cache_dtype, kv_bytes_per_token=e.kv_bytes_per_token, tensor_parallel=e.tensor_parallel,
        kv_heads=e.kv_heads, expert_parallel=e.gpus if e.gpus > 1 else 1, eplb=e.eplb)


def _mean(w: SignalWindows, subject: str, name: str, since: float) -> float | None:
    values = [v for _, v in w.series(subject, name, since=since) if math.isfinite(v)]
    return statistics.fmean(values) if values else None


def observed(w: SignalWindows, pool: str, since: float, quantile: float = 0.95) -> PoolObserved | None:
    """What a pool did since `since`, from its pool-level signals; None when it reported nothing."""
    subject = f"pool/{pool}"
    rates = w.series(subject, "request_rate", since=since)
    if not rates:
        return None
    per_minute: dict[int, list[float]] = defaultdict(list)
    for ts, v in rates:
        per_minute[int(ts // 60)].append(v)
    minutes = [statistics.fmean(v) for _, v in sorted(per_minute.items())]
    finished = statistics.fmean(v for _, v in rates)

    def mean(name: str) -> float | None:
        return _mean(w, subject, name, since)

    prompt, gen = mean("prompt_tokens_rate") or 0.0, mean("generation_tokens_rate") or 0.0
    engines = mean("engines_reporting") or 1.0
    kv_max = [v for _, v in w.series(subject, "kv_cache_usage_max", since=since)]
    positions = []
    for n in range(MAX_POSITIONS):
        p = mean(f"spec_acceptance_pos_{n}")
        if p is None:
            break
        positions.append(p)
    return PoolObserved(
        arrivals=finished, arrivals_peak=float(np.quantile(minutes, quantile)),
        prompt_tokens=prompt / finished if finished > 0 else 0.0,
        output_tokens=gen / finished if finished > 0 else 0.0,
        hit_rate=min(1.0, max(0.0, mean("prefix_cache_hit_rate") or 0.0)), engines=engines,
        running=(mean("requests_running") or 0.0) / max(engines, 1.0), kv_usage=mean("kv_cache_usage") or 0.0,
        kv_usage_max=float(np.quantile(kv_max, quantile)) if kv_max else 0.0,
        preemptions=mean("preemption_rate") or 0.0, ttft_p95=mean("ttft_p95"), tpot_p95=mean("tpot_p95"),
        itl_mean=mean("itl_mean"), spec_acceptance=mean("spec_acceptance_rate"),
        spec_length=mean("spec_mean_acceptance_length"), spec_yield=mean("spec_yield"),
        spec_positions=tuple(positions), minutes=(rates[-1][0] - rates[0][0]) / 60.0)


def advisor_input(config: FleetConfig, windows: SignalWindows, now: float, since: float,
                  prefix_blocks: Mapping[str, Sequence[Sequence[int]]] | None = None,
                  pools: Sequence[str] = ()) -> AdvisorInput:
    """The advisor's input for the fleet file's pools (or the named ones) over `[since, now]`."""
    chosen = [p for p in config.pools if not pools or p.name in pools]
    facts = {p.name: pool_facts(p) for p in chosen}
    seen = {name: o for name in facts if (o := observed(windows, name, since, config.advisor.load_quantile))}
    # The pool's size is what reported, not the fleet file's bounds.
    facts = {name: replace(f, replicas=max(1, round(seen[name].engines))) if name in seen else f
             for name, f in facts.items()}
    return AdvisorInput(now=now, since=since, pools=facts, observed=seen, prefix_blocks=dict(prefix_blocks or {}))


async def advise_from_store(config: FleetConfig, store: Store, now: float, since: float, *,
                            pools: Sequence[str] = (),
                            prefix_blocks: Mapping[str, Sequence[Sequence[int]]] | None = None) -> list[Recommendation]:
    """The recommendations for what the store holds over `[since, now]`."""
    windows = SignalWindows(now - since + 60.0)
    windows.extend((s.ts, s.subject, s.name, s.value) for s in await store.load_signals(since))
    return advise(advisor_input(config, windows, now, since, prefix_blocks, pools), config.advisor)
