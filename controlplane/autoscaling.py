"""The autoscaler wired to a fleet file: each pool's prior curves from its engine profile, and the plan now.

Owns turning `pools[].engine` (a measured profile, a speed, the vLLM flags) into the prior the sizer
starts from, and `fleetctl autoscale plan`: the sizer run once over what the store holds, as the
loop would run it on its next tick.
"""

from __future__ import annotations

import numpy as np

from controlplane.config import Engine, FleetConfig
from controlplane.sim.engine import BLOCK_TOKENS
from controlplane.sim.perf import load_model
from controlplane.store.base import Store
from policies.autoscale import DESIRED, GANG, READY, Autoscaler, EngineCurves, SizerRun, plan_each
from policies.inputs import KIND as STALE_INPUTS
from policies.inputs import stopped_or_frozen
from policies.types import FindingKey, OpenFinding, PolicyInput, PoolState
from policies.windows import HISTORY_S, SignalWindows

__all__ = ["build_sizer", "engine_curves", "plan_from_store"]

_PREFILL_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
_DECODE_GRID = [(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (512, 2048, 8192)]


def engine_curves(engine: Engine) -> EngineCurves:
    """The profile's prefill and decode-step times at the pool's speed, as the sizer's quadratic and plane."""
    model = load_model(engine.profile, engine.speed, engine.decode_speed)
    t = np.array(_PREFILL_TOKENS, dtype=float)
    prefill = np.array([model.prefill_batch_seconds([(int(x), 0)]) for x in t])
    a, b, c = np.linalg.lstsq(np.column_stack([np.ones_like(t), t, t * t]), prefill, rcond=None)[0]
    rows = np.array([[1.0, bb, bb * cc] for bb, cc in _DECODE_GRID])
    steps = np.array([model.decode_step_seconds(bb, cc) for bb, cc in _DECODE_GRID])
    d, e, f = np.linalg.lstsq(rows, steps, rcond=None)[0]
    return EngineCurves(prefill=(float(max(0.0, a)), float(max(0.0, b)), float(max(0.0, c))),
                        decode=(float(max(0.0, d)), float(max(0.0, e)), float(max(0.0, f))),
                        kv_tokens=engine.kv_blocks * BLOCK_TOKENS, max_num_seqs=engine.max_num_seqs,
                        max_batched_tokens=engine.max_batched_tokens, gpus=engine.gpus)


def build_sizer(config: FleetConfig) -> Autoscaler | None:
    """The autoscaler for the fleet file's pools, or None when `autoscaling.enabled` is off."""
    return _autoscaler(config) if config.autoscaling.enabled else None


def _autoscaler(config: FleetConfig) -> Autoscaler:
    return Autoscaler(config.autoscaling, {p.name: engine_curves(p.engine) for p in config.pools})


async def plan_from_store(config: FleetConfig, store: Store, now: float) -> SizerRun:
    """What the sizer would set each pool to at `now`, from the signals and findings in the store."""
    sizer = _autoscaler(config)  # enabled or not: the plan is what it would do
    windows = SignalWindows(HISTORY_S)
    windows.extend((s.ts, s.subject, s.name, s.value) for s in await store.load_signals(now - HISTORY_S))
    open_findings = await store.open_findings()
    # What the loop would hold back as stale: series that stopped (the scrapes ended long ago, read as a lull), frozen
    # gauges, and what its last tick found unfit (`stale_inputs` findings).
    stale = stopped_or_frozen(windows, [p.name for p in config.pools], now, config.scrape.interval,
                              config.rails.frozen_after)
    unfit = {f.subject.removeprefix("pool/"): dict(f.evidence.get("inputs") or {})
             for f in open_findings if f.kind == STALE_INPUTS}
    pools = {}
    for p in config.pools:
        subject = f"pool/{p.name}"
        desired = windows.latest(subject, DESIRED)
        ready = windows.latest(subject, READY)
        pools[p.name] = PoolState(p.name, str(p.role), round(desired or 0), round(ready or 0), p.replicas.min,
                                  p.replicas.max, p.slo.ttft_p95, p.slo.tpot_p95,
                                  gang=round(windows.latest(subject, GANG) or 1),
                                  stale_inputs={**unfit.get(p.name, {}), **stale.get(p.name, {})})
    findings = {FindingKey(f.kind, f.subject): OpenFinding(FindingKey(f.kind, f.subject), f.opened_at, f.evidence)
                for f in open_findings}
    return plan_each(sizer, PolicyInput(now=now, windows=windows, pools=pools, open_findings=findings))
