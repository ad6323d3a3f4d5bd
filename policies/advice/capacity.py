"""How many engines a pool of a given role needs for a load at its SLOs: the advisor's what-if model.

From the engine's profile curves (`EngineCurves`, the autoscaler's prior) and a steady load, per
engine count N with arrivals λ = Λ/N to each engine:

- prefill work: each request's new prompt tokens, `request_prefill_seconds` s_p; its share of engine
  time ρ_p = λ · s_p, stretched on a unified engine by the decode step every iteration also pays
  (a full chunk's prefill takes P, so each prefill second costs 1 + step/P);
- decode: the batch B that Little's law and the step time agree on, B = λ · output · TPOT(B), with
  TPOT(B) = step(B, C) · cost / L / (1 - ρ_p): a speculative step costs `cost` plain steps and
  yields L tokens; the batch must fit `kv_usage_max` of the KV cache and `max_num_seqs`;
- TTFT p95: twice a lone prompt's prefill, plus queueing as an M/D/1 queue's p95 wait (1.5 services
  per ρ/(1-ρ)), plus the KV transfer for a prefill pool;
- TPOT p95: a fifth over the mean step, plus, on a unified engine, the prefills that land during a
  request's decode: the 95th percentile of a Poisson count of arrivals over its decode, each
  stalling it for s_p, spread over its output tokens.

The pool needs the fewest N whose predictions fit `margin` of both SLOs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.autoscale import EngineCurves

__all__ = ["Load", "Sizing", "size_pool", "transfer_seconds"]

P95_OVER_MEAN_TPOT = 1.2
IDLE_TTFT_FACTOR = 2.0
QUEUE_P95_SERVICES = 1.5


@dataclass(frozen=True, slots=True)
class Load:
    """A steady load on a pool: arrivals per second and what each request asks."""

    arrivals: float
    prompt_tokens: float
    output_tokens: float
    hit_rate: float = 0.0

    @property
    def context(self) -> float:
        return self.prompt_tokens + self.output_tokens / 2.0


@dataclass(frozen=True, slots=True)
class Sizing:
    """The engines a pool needs and what one of them runs at then."""

    engines: int
    batch: float  # sequences decoding per engine
    utilisation: float
    ttft_p95: float | None
    tpot_p95: float | None
    limited_by: str  # ttft | tpot | kv | load (one engine is plenty) | none (no size up to the limit fits)

    def as_dict(self) -> dict[str, object]:
        return {"engines": self.engines, "batch": round(self.batch, 1), "utilisation": round(self.utilisation, 3),
                "ttft_p95_s": _r(self.ttft_p95), "tpot_p95_s": _r(self.tpot_p95), "limited_by": self.limited_by}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _at(n: int, role: str, load: Load, curves: EngineCurves, step_cost: float, tokens_per_step: float,
        transfer_s: float, kv_usage_max: float, max_utilization: float) -> tuple[str | None, Sizing]:
    """Predicted p95s with `n` engines, and the first limit they break (None: none)."""
    lam = load.arrivals / n
    prefill = role != "decode" and load.prompt_tokens > 0
    decode = role != "prefill" and load.output_tokens > 1
    s_p = curves.request_prefill_seconds(load.prompt_tokens, load.prompt_tokens * load.hit_rate) if prefill else 0.0
    batch, tpot, step = 0.0, None, 0.0
    rho_p = lam * s_p
    if decode:
        ctx = load.context
        b_max = min(float(curves.max_num_seqs),
                    kv_usage_max * curves.kv_tokens / max(load.prompt_tokens + load.output_tokens, 1.0))
        b = 1.0
        for _ in range(200):
            if rho_p >= max_utilization:
                break
            per_token = curves.step_seconds(b, ctx) * step_cost / tokens_per_step / (1.0 - rho_p)
            nxt = max(1.0, lam * load.output_tokens * per_token)
            if nxt > b_max:
                return ("kv" if b_max < curves.max_num_seqs else "tpot"), Sizing(n, nxt, rho_p, None, None, "kv")
            done = abs(nxt - b) < 1e-3
            b = nxt
            if done:
                break
            # Every iteration pays the decode step once: prefill shares the engine with it.
            rho_p = lam * s_p * (1.0 + curves.step_seconds(b, ctx) * step_cost / curves.prefill_seconds(
                curves.max_batched_tokens))
        batch = b
        step = curves.step_seconds(b, ctx) * step_cost
    if rho_p >= max_utilization:
        return "ttft" if prefill else "tpot", Sizing(n, batch, rho_p, None, None, "ttft")
    if decode:
        # A request's decode lasts T; the prompts that arrive meanwhile each stall it for their prefill.
        # Its TPOT p95 counts the 95th percentile of those stalls (Poisson, normal approximation).
        per_token = step / tokens_per_step
        span = load.output_tokens * per_token / (1.0 - rho_p)
        m = lam * span if prefill else 0.0
        stalls = m + 1.645 * math.sqrt(m) if m > 0 else 0.0
        tpot = P95_OVER_MEAN_TPOT * per_token + stalls * s_p / max(load.output_tokens - 1.0, 1.0)
    ttft = None
    if prefill:
        alone = curves.prefill_seconds(max(1.0, load.prompt_tokens * (1.0 - load.hit_rate)))
        service = s_p * (rho_p / (lam * s_p)) if lam * s_p > 0 else s_p
        ttft = IDLE_TTFT_FACTOR * alone + QUEUE_P95_SERVICES * service * rho_p / (1.0 - rho_p) + transfer_s
    return None, Sizing(n, batch, rho_p, ttft, tpot, "none")


def size_pool(role: str, load: Load, curves: EngineCurves, *, ttft_slo: float | None, tpot_slo: float | None,
              margin: float = 1.0, step_cost: float = 1.0, tokens_per_step: float = 1.0, transfer_s: float = 0.0,
              kv_usage_max: float = 0.85, max_utilization: float = 0.9, limit: int = 4096) -> Sizing:
    """The fewest engines of `role` that carry `load` within `margin` of the SLOs (`limited_by` "none" when
    even `limit` engines do not: a lone request already misses, or the numbers are nonsense)."""
    if load.arrivals <= 0:
        return Sizing(1, 0.0, 0.0, None, None, "load")
    last_limit = "load"
    n = 1
    hi_checked = 0
    # Grow geometrically to a size that fits, then bisect down: needs are monotone in the engine count.
    fits: Sizing | None = None
    while n <= limit:
        broke, sizing = _at(n, role, load, curves, step_cost, tokens_per_step, transfer_s, kv_usage_max,
                            max_utilization)
        broke = broke or _over(sizing, ttft_slo, tpot_slo, margin)
        if broke is None:
            fits = sizing
            break
        last_limit, hi_checked = broke, n
        n *= 2
    if fits is None:
        return Sizing(limit, 0.0, 0.0, None, None, "none")
    lo, hi = hi_checked, fits.engines
    while hi - lo > 1:
        mid = (lo + hi) // 2
        broke, sizing = _at(mid, role, load, curves, step_cost, tokens_per_step, transfer_s, kv_usage_max,
                            max_utilization)
        broke = broke or _over(sizing, ttft_slo, tpot_slo, margin)
        if broke is None:
            hi, fits = mid, sizing
        else:
            lo, last_limit = mid, broke
    return Sizing(fits.engines, fits.batch, fits.utilisation, fits.ttft_p95, fits.tpot_p95,
                  last_limit if fits.engines > 1 else "load")


def _over(s: Sizing, ttft_slo: float | None, tpot_slo: float | None, margin: float) -> str | None:
    if ttft_slo is not None and s.ttft_p95 is not None and s.ttft_p95 > margin * ttft_slo:
        return "ttft"
    if tpot_slo is not None and s.tpot_p95 is not None and s.tpot_p95 > margin * tpot_slo:
        return "tpot"
    return None


def transfer_seconds(prompt_tokens: float, kv_bytes_per_token: float, link_gbps: float) -> float:
    """Time to move one prompt's KV cache from a prefill to a decode engine over the link."""
    if link_gbps <= 0:
        return math.inf
    return prompt_tokens * kv_bytes_per_token * 8.0 / (link_gbps * 1e9)
