"""How many engines a pool of a given role needs for a load at its SLOs: the advisor's what-if model.

From the engine's profile curves (`EngineCurves`, the autoscaler's prior) and a steady load, per
engine count N with arrivals λ = Λ/N to each engine:

- prefill work: each request's new prompt tokens (`prefill_cost`, mean S over the prompt lengths) with
  its share of the passes it rides (a pass takes the prompts that arrived during the last one: at
  light load one or two, each paying much of the pass's fixed cost); its share of engine time
  ρ_p = λ · S, stretched on a unified engine by the decode step every pass also pays (a full
  chunk's prefill takes P, so each prefill second costs 1 + step/P);
- decode: the batch B that Little's law and the step time agree on, B = λ · output · TPOT(B), with
  TPOT(B) = step(B, C) · cost / L / (1 - ρ_p): a speculative step costs `cost` plain steps and
  yields L tokens; the batch must fit `kv_usage_max` of the KV cache and `max_num_seqs`;
- prompt lengths as a lognormal through the pool's measured mean, median and 95th percentile: prefill
  cost is quadratic in the prompt (attention), so its mean is taken over the lengths, not at the mean;
- TTFT p95: the pass in flight (a prompt waits it out) plus its own pass or, for a long prompt, its
  prefill alone (passes grow with the tokens that arrive while one runs, up to the token budget),
  plus three times the M/G/1 mean wait (Pollaczek-Khinchine, from the prefill cost's second moment),
  plus the KV transfer for a prefill pool;
- TPOT p95: a fifth over the step of a busy decode span's batch (its arrivals a 95th-percentile
  Poisson count above the mean), plus, on a unified engine, the prefills that land during a
  request's decode: the 95th percentile of their total (a compound Poisson sum over its decode),
  spread over its output tokens.

The pool needs the fewest N whose predictions fit `margin` of both SLOs. A `Calibration` from the pool's
own measured p95s scales the queueing parts (or the whole, where they vanish).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from policies.autoscale import EngineCurves

__all__ = ["NO_CALIBRATION", "Calibration", "Load", "Prefill", "Sizing", "lognormal_sigma", "predict", "prefill_cost",
           "size_pool", "transfer_seconds"]

P95_OVER_MEAN_TPOT = 1.2
QUEUE_P95_WAITS = 3.0  # a queue's 95th-percentile wait over its mean (an exponential tail: ln 20)


@dataclass(frozen=True, slots=True)
class Load:
    """A steady load on a pool: arrivals per second and what each request asks (prompt lengths lognormal with
    shape `prompt_sigma`: 0 for all alike)."""

    arrivals: float
    prompt_tokens: float
    output_tokens: float
    hit_rate: float = 0.0
    prompt_sigma: float = 0.0
    max_prompt: float = 131072.0  # the engine's context limit: no prompt is longer

    @property
    def context(self) -> float:
        return self.prompt_tokens + self.output_tokens / 2.0

    def prompt_moment(self, k: int) -> float:
        """E[prompt^k] of a lognormal with this mean and shape, over the prompts up to the context limit (the
        lognormal's far tail would otherwise rule the higher moments)."""
        s = self.prompt_sigma
        mu = math.log(max(self.prompt_tokens, 1.0)) - s * s / 2.0
        full = math.exp(k * mu + k * k * s * s / 2.0)
        if s <= 0:
            return full
        z = (math.log(self.max_prompt) - mu - k * s * s) / s
        return full * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def lognormal_sigma(median: float | None, p95: float | None, cap: float = 1.5) -> float:
    """The shape of a lognormal through a median and a 95th percentile (0 when either is unknown)."""
    if not median or not p95 or p95 <= median:
        return 0.0
    return min(cap, math.log(p95 / median) / 1.645)


@dataclass(frozen=True, slots=True)
class Prefill:
    """What prefilling one request costs an engine: mean and second moment over the prompt lengths, and the
    time a 95th-percentile prompt takes alone."""

    mean: float
    second: float
    p95_alone: float


def prefill_cost(curves: EngineCurves, load: Load, pass_tokens: float | None = None) -> Prefill:
    """Prefill seconds per request. A prompt of P tokens, a share h cached, rides passes of X new tokens (default: full
    passes of the token budget T): it pays its tokens' share of each pass's fixed cost and of its quadratic term
    (which every token of a shared pass pays), plus attention over the tokens before it: beta*P + gamma*P^2 with
    beta = (1-h)(a/X + b + cX) and gamma = c(1-h)(1+h). The quadratic makes long prompts dominate: the mean is taken
    over the lengths."""
    a, b, c = curves.prefill
    h = min(max(load.hit_rate, 0.0), 1.0)
    x = float(curves.max_batched_tokens) if pass_tokens is None else max(1.0, pass_tokens)
    beta = (1.0 - h) * (a / x + b + c * x)
    gamma = c * (1.0 - h) * (1.0 + h)
    m1, m2, m3, m4 = (load.prompt_moment(k) for k in (1, 2, 3, 4))
    mean = beta * m1 + gamma * m2
    second = beta * beta * m2 + 2 * beta * gamma * m3 + gamma * gamma * m4
    p95 = load.prompt_tokens * math.exp(1.645 * load.prompt_sigma - load.prompt_sigma ** 2 / 2.0)
    return Prefill(mean, second, a + curves.request_prefill_seconds(p95, p95 * h))


@dataclass(frozen=True, slots=True)
class Sizing:
    """The engines a pool needs and what one of them runs at then."""

    engines: int
    batch: float  # sequences decoding per engine
    utilisation: float
    ttft_p95: float | None
    tpot_p95: float | None
    limited_by: str  # ttft | tpot | kv | load (one engine is plenty) | none (no size up to the limit fits)
    # The parts of the p95s: what the profile fixes (a pass, a step) and what the queueing approximations add.
    ttft_floor: float = 0.0
    ttft_queue: float = 0.0
    tpot_base: float = 0.0
    tpot_stall: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {"engines": self.engines, "batch": round(self.batch, 1), "utilisation": round(self.utilisation, 3),
                "ttft_p95_s": _r(self.ttft_p95), "tpot_p95_s": _r(self.tpot_p95), "limited_by": self.limited_by}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


@dataclass(frozen=True, slots=True)
class Calibration:
    """How the pool's own busy-minute p95s differ from the model at its own size: the queueing parts (TTFT's wait,
    TPOT's prefill stalls) scaled where they exist, the whole p95 where they do not."""

    ttft_queue: float = 1.0
    ttft_scale: float = 1.0
    tpot_stall: float = 1.0
    tpot_scale: float = 1.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(getattr(self, k), 3) for k in ("ttft_queue", "ttft_scale", "tpot_stall", "tpot_scale")}


NO_CALIBRATION = Calibration()


def _pass(curves: EngineCurves, arrivals: float, new_tokens: float, extra: float) -> tuple[float, float]:
    """(new tokens, seconds) of a pass when prompts of `new_tokens` arrive at `arrivals` per second: the prompts that
    arrived during the last pass, at least one (a zero-truncated Poisson count, m / (1 - e^-m) for m arrivals expected
    in a pass), up to the token budget; a fixed point. `extra`: a unified engine's decode step in every pass. Light
    load means small passes, each paying the profile's fixed cost for few prompts."""
    x = max(1.0, new_tokens)
    for _ in range(50):
        m = arrivals * (curves.prefill_seconds(x) + extra)
        per_pass = m / -math.expm1(-m) if m > 1e-9 else 1.0
        nxt = min(float(curves.max_batched_tokens), max(1.0, new_tokens * per_pass))
        if abs(nxt - x) < 0.5:
            x = nxt
            break
        x = nxt
    return x, curves.prefill_seconds(x) + extra


@dataclass(frozen=True, slots=True)
class _Steady:
    """One engine at a steady arrival rate: its decode batch and step, the passes its prompts ride, their cost, and
    the share of its time prefill takes (None in `broke`: it fits; else the limit it breaks)."""

    broke: str | None
    batch: float
    step: float
    rho: float
    stretch: float
    pass_s: float
    cost: Prefill


def _steady(lam: float, role: str, load: Load, curves: EngineCurves, step_cost: float, tokens_per_step: float,
            kv_usage_max: float, max_utilization: float) -> _Steady:
    """The batch that Little's law and the step time agree on at `lam` arrivals per second, with the prefill passes
    riding its steps (longer iterations gather more prompts each): a fixed point."""
    prefill = role != "decode" and load.prompt_tokens > 0
    decode = role != "prefill" and load.output_tokens > 1
    new = max(load.prompt_tokens * (1.0 - load.hit_rate), 1.0)
    x, d = _pass(curves, lam, new, 0.0) if prefill else (0.0, 0.0)
    cost = prefill_cost(curves, load, x) if prefill else Prefill(0.0, 0.0, 0.0)
    stretch = 1.0  # prefill seconds per second of prefill work: a unified engine pays a decode step each pass
    rho = lam * cost.mean
    b = step = 0.0
    if decode:
        ctx = load.context
        b_max = min(float(curves.max_num_seqs),
                    kv_usage_max * curves.kv_tokens / max(load.prompt_tokens + load.output_tokens, 1.0))
        b = 1.0
        for _ in range(200):
            if rho >= max_utilization:
                break
            per_token = curves.step_seconds(b, ctx) * step_cost / tokens_per_step / (1.0 - rho)
            nxt = max(1.0, lam * load.output_tokens * per_token)
            if nxt > b_max:  # the batch stops at its limit; arrivals queue behind it
                return _Steady("kv" if b_max < curves.max_num_seqs else "tpot", b_max,
                               curves.step_seconds(b_max, ctx) * step_cost, rho, stretch, d, cost)
            done = abs(nxt - b) < 1e-3
            b = nxt
            if done:
                break
            if prefill:
                step_b = curves.step_seconds(b, ctx) * step_cost
                x, _ = _pass(curves, lam, new, step_b)
                d = curves.prefill_seconds(x)
                cost = prefill_cost(curves, load, x)
                stretch = 1.0 + step_b / curves.prefill_seconds(curves.max_batched_tokens)
                rho = lam * cost.mean * stretch
        step = curves.step_seconds(b, ctx) * step_cost
    broke = ("ttft" if prefill else "tpot") if rho >= max_utilization else None
    return _Steady(broke, b, step, rho, stretch, d, cost)


def _at(n: int, role: str, load: Load, curves: EngineCurves, step_cost: float, tokens_per_step: float,
        transfer_s: float, kv_usage_max: float, max_utilization: float,
        cal: Calibration = NO_CALIBRATION) -> tuple[str | None, Sizing]:
    """Predicted p95s with `n` engines, and the first limit they break (None: none)."""
    lam = load.arrivals / n
    prefill = role != "decode" and load.prompt_tokens > 0
    decode = role != "prefill" and load.output_tokens > 1
    at = _steady(lam, role, load, curves, step_cost, tokens_per_step, kv_usage_max, max_utilization)
    if at.broke:
        return at.broke, Sizing(n, at.batch, at.rho, None, None, at.broke)
    tpot = ttft = None
    base = stall = floor = queue = 0.0
    if decode:
        # A request's TPOT is set by the batch during its own decode (`span` long). Over a minute of many spans the
        # p95 request sees a busy one: arrivals a 95th-percentile Poisson count above the mean, and near the knee
        # of the step curve the batch grows several times faster than they do.
        span = load.output_tokens * at.step / tokens_per_step / (1.0 - at.rho)
        # A busy span past a limit still has a step: the batch capped at it (see `_steady`).
        busy = _steady(lam + 1.645 * math.sqrt(lam / span), role, load, curves, step_cost, tokens_per_step,
                       kv_usage_max, max_utilization)
        # The prompts that arrive during a decode each stall it for their prefill: the 95th percentile of those
        # stalls (a compound Poisson sum, normal approximation).
        per_token = busy.step / tokens_per_step
        m = lam * span if prefill else 0.0
        stalls = (m * at.cost.mean + 1.645 * math.sqrt(m * at.cost.second)) * at.stretch if m > 0 else 0.0
        base, stall = P95_OVER_MEAN_TPOT * per_token, stalls / max(load.output_tokens - 1.0, 1.0)
        tpot = base * cal.tpot_scale + stall * cal.tpot_stall
    if prefill:
        # A prompt waits out the pass in flight, then rides its own: passes grow with the tokens that arrive
        # while one runs. Behind that, an M/G/1 queue (Pollaczek-Khinchine) mean wait, its p95 about thrice that.
        d = at.pass_s + (at.step if decode else 0.0)
        floor = 0.95 * d + max(d, at.cost.p95_alone * at.stretch) + transfer_s
        queue = QUEUE_P95_WAITS * lam * at.cost.second * at.stretch ** 2 / (2.0 * (1.0 - at.rho))
        ttft = floor * cal.ttft_scale + queue * cal.ttft_queue
    return None, Sizing(n, at.batch, at.rho, ttft, tpot, "none", floor, queue, base, stall)


def predict(n: int, role: str, load: Load, curves: EngineCurves, *, step_cost: float = 1.0,
            tokens_per_step: float = 1.0, transfer_s: float = 0.0, kv_usage_max: float = 0.85,
            max_utilization: float = 0.9) -> Sizing:
    """The model's p95s with `n` engines, uncalibrated (None where a limit breaks: the load does not fit)."""
    return _at(n, role, load, curves, step_cost, tokens_per_step, transfer_s, kv_usage_max, max_utilization)[1]


def size_pool(role: str, load: Load, curves: EngineCurves, *, ttft_slo: float | None, tpot_slo: float | None,
              margin: float = 1.0, step_cost: float = 1.0, tokens_per_step: float = 1.0, transfer_s: float = 0.0,
              kv_usage_max: float = 0.85, max_utilization: float = 0.9, limit: int = 4096,
              calibration: Calibration = NO_CALIBRATION) -> Sizing:
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
                            max_utilization, calibration)
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
                            max_utilization, calibration)
        broke = broke or _over(sizing, ttft_slo, tpot_slo, margin)
        if broke is None:
            hi, fits = mid, sizing
        else:
            lo, last_limit = mid, broke
    return replace(fits, limited_by=last_limit if fits.engines > 1 else "load")


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
