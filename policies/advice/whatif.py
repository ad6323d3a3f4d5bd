"""One pool's what-if: the engines a layout needs at the pool's SLOs, the model checked against the pool itself.

Shared by every recommendation: the load a static size must carry (the busy-minute arrivals with the
window's request shape and prompt-length spread), the step cost of the pool's speculation, the
engine curves on another GPU type, and a calibration: the model's TTFT and TPOT p95 at the pool's
own size and mean load against what the pool measured. A what-if layout is then sized against SLOs
divided by those ratios, so a model that runs optimistic on this traffic (routing imbalance, bursts
within a minute) is held to what the fleet showed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from policies.advice.capacity import Load, Sizing, lognormal_sigma, predict, size_pool
from policies.advice.types import AdviceSettings, PoolFacts, PoolObserved
from policies.autoscale import EngineCurves

__all__ = ["Calibration", "calibrate", "on_gpu", "peak_load", "sized", "step_cost"]

MIN_FACTOR, MAX_FACTOR = 0.5, 4.0


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured over predicted p95s at the pool's own size (1.0: the model is taken as it is)."""

    ttft: float = 1.0
    tpot: float = 1.0

    def as_dict(self) -> dict[str, float]:
        return {"ttft": round(self.ttft, 3), "tpot": round(self.tpot, 3)}


def on_gpu(facts: PoolFacts, gpu_type: str, s: AdviceSettings) -> EngineCurves:
    """The pool's engine curves on another GPU type, times scaled by the types' relative speed."""
    here = s.gpu_types.get(facts.gpu_type)
    there = s.gpu_types.get(gpu_type)
    if here is None or there is None or here.speed == there.speed:
        return facts.curves
    k = here.speed / there.speed
    c = facts.curves
    return replace(c, prefill=tuple(x * k for x in c.prefill), decode=tuple(x * k for x in c.decode))  # type: ignore[arg-type]


def peak_load(obs: PoolObserved) -> Load:
    """The load a static size must carry: the busy-minute arrivals with the window's request shape."""
    return Load(max(obs.arrivals_peak, obs.arrivals), obs.prompt_tokens, obs.output_tokens, obs.hit_rate,
                lognormal_sigma(obs.prompt_p50, obs.prompt_p95))


def step_cost(facts: PoolFacts, obs: PoolObserved, s: AdviceSettings) -> tuple[float, float]:
    """(cost of a decode step in plain steps, tokens it yields) under the pool's speculation now."""
    if not facts.spec.enabled or obs.spec_length is None:
        return 1.0, 1.0
    k = facts.spec.num_speculative_tokens
    drafter = 0.0 if facts.spec.method == "ngram" else s.draft_cost
    return 1.0 + k * (drafter + s.verify_cost), max(1.0, obs.spec_length)


def sized(role: str, facts: PoolFacts, load: Load, s: AdviceSettings, curves: EngineCurves | None = None, *,
          cost: tuple[float, float] = (1.0, 1.0), transfer_s: float = 0.0,
          calibration: Calibration = Calibration()) -> Sizing:
    """`size_pool` with the pool's SLOs (over the calibration's ratios) and the advisor's settings."""
    ttft = None if facts.ttft_p95_slo is None else facts.ttft_p95_slo / calibration.ttft
    tpot = None if facts.tpot_p95_slo is None else facts.tpot_p95_slo / calibration.tpot
    return size_pool(role, load, curves or facts.curves, ttft_slo=ttft, tpot_slo=tpot, margin=s.margin,
                     step_cost=cost[0], tokens_per_step=cost[1], transfer_s=transfer_s,
                     kv_usage_max=s.kv_usage_max, max_utilization=s.max_utilization)


def calibrate(facts: PoolFacts, obs: PoolObserved, s: AdviceSettings) -> Calibration:
    """The pool's TTFT and TPOT p95 in its busy minutes over the model's at its own size and busy-minute load."""
    load = peak_load(obs)
    at = predict(max(1, facts.replicas), facts.role, load, facts.curves, step_cost=step_cost(facts, obs, s)[0],
                 tokens_per_step=step_cost(facts, obs, s)[1], kv_usage_max=s.kv_usage_max,
                 max_utilization=s.max_utilization)

    def ratio(measured: float | None, model: float | None) -> float:
        if measured is None or model is None or model <= 0 or measured <= 0:
            return 1.0
        return min(MAX_FACTOR, max(MIN_FACTOR, measured / model))

    return Calibration(ratio(obs.ttft_p95_peak or obs.ttft_p95, at.ttft_p95),
                       ratio(obs.tpot_p95_peak or obs.tpot_p95, at.tpot_p95))





