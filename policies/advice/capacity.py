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
  yields L tokens; the batch must fit `kv_usage_max` of the KV cache (a decoding sequence holds its
  prompt and half its answer on average) and `max_num_seqs`;
- prompt lengths as a lognormal through the pool's measured mean, median and 95th percentile: prefill
  cost is quadratic in the prompt (attention), so its mean is taken over the lengths, not at the mean;
- TTFT p95: the pass in flight (a prompt waits it out) plus its own pass or, for a long prompt, its
  prefill alone (passes grow with the tokens that arrive while one runs, up to the token budget),
  plus three times the M/G/1 mean wait (Pollaczek-Khinchine, from the prefill cost's second moment),
  plus the KV transfer for a prefill pool;
- TPOT p95: over drawn requests (`_tpot`), each with its answer's length, the batch at the arrival
  rate around its decode, the contexts that batch holds and, on a unified engine, the prompts that
  land during its decode and stall it; the 95th percentile of their TPOTs.

The pool needs the fewest N whose predictions fit `margin` of both SLOs; what N - 1 would give is kept
beside it, since a saving that hangs on one engine is only as good as the model's last few per cent.
A `Calibration` from the pool's own measurements (TTFT's p95, TPOT's mean) scales the queueing parts
(or the whole, where they vanish).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.stats import poisson

from policies.autoscale import EngineCurves
from policies.stats import MAX_CONTEXT, lognormal_location, lognormal_p95, quadratic_moments

__all__ = ["NO_CALIBRATION", "Calibration", "Engine", "Load", "Prefill", "Sizing", "TtftMinute", "predict",
           "prefill_cost", "size_pool", "transfer_seconds"]

TPOT_SAMPLES = 4096
TPOT_SEED = 16
MAX_OUTPUT_OVER_MEAN = 16.0  # the longest answer drawn, over the mean (the engine's max_tokens cuts the tail)
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
    max_prompt: float = MAX_CONTEXT  # the engine's context limit: no prompt is longer
    output_sigma: float = 0.0  # output lengths lognormal with this shape (0: all alike)

    @property
    def context(self) -> float:
        return self.prompt_tokens + self.output_tokens / 2.0


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
    beta, gamma = _prefill_terms(curves, load, pass_tokens)
    h = min(max(load.hit_rate, 0.0), 1.0)
    mean, second = quadratic_moments(beta, gamma, load.prompt_tokens, load.prompt_sigma, load.max_prompt)
    p95 = lognormal_p95(load.prompt_tokens, load.prompt_sigma)
    return Prefill(mean, second, curves.prefill[0] + curves.request_prefill_seconds(p95, p95 * h))


def _prefill_terms(curves: EngineCurves, load: Load, pass_tokens: float | None) -> tuple[float, float]:
    """(beta, gamma) of `prefill_cost`: one prompt of P tokens costs beta*P + gamma*P^2 seconds. The profile's terms
    (`EngineCurves.prefill_terms`) plus the pass's quadratic across prompts: a prompt of N new tokens sharing a pass
    of X pays c*N*(X - N) for the others' tokens in it, nothing once it fills its passes alone (taken at the mean N)."""
    h = min(max(load.hit_rate, 0.0), 1.0)
    x = float(curves.max_batched_tokens) if pass_tokens is None else max(1.0, pass_tokens)
    beta, gamma = curves.prefill_terms(h, x)
    shared = max(0.0, x - (1.0 - h) * load.prompt_tokens)
    return beta + (1.0 - h) * curves.prefill[2] * shared, gamma


@dataclass(frozen=True, slots=True)
class Sizing:
    """The engines a pool needs and what one of them runs at then."""

    engines: int
    batch: float  # sequences decoding per engine
    utilisation: float
    ttft_p95: float | None
    tpot_p95: float | None
    limited_by: str  # ttft | tpot | kv | load (one engine is plenty) | none (no size up to the limit fits)
    # The parts of the predictions: what the profile fixes (a pass, a step) and what queueing adds; TTFT's p95, TPOT's
    # mean (the steps, the prefill stalls).
    ttft_floor: float = 0.0
    ttft_queue: float = 0.0
    tpot_base: float = 0.0
    tpot_stall: float = 0.0
    # The sizing with one engine fewer, its `limited_by` the limit it breaks: how near the answer is to the next
    # size down, so a reader sees when a saving hangs on one engine.
    one_fewer: Sizing | None = None
    # The drawn requests' TPOTs in two parts, uncalibrated: (steps, prefill stalls); `predict`'s alone, None where
    # nothing decodes.
    tpot_draws: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)
    # The busy TTFT minute (`Calibration.ttft_minute`) needed more engines than the busy load: the engines and the
    # TTFT (with one engine fewer's) are that minute's, the batch, utilisation and TPOT the busy load's at that size.
    at_ttft_minute: bool = False

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "engines": self.engines, "batch": round(self.batch, 1), "utilisation": round(self.utilisation, 3),
            "ttft_p95_s": _r(self.ttft_p95), "tpot_p95_s": _r(self.tpot_p95), "limited_by": self.limited_by}
        if self.at_ttft_minute:
            out["sized_at"] = "the busy TTFT minute"
        if (fewer := self.one_fewer) is not None:
            out["one_fewer"] = {"engines": fewer.engines, "ttft_p95_s": _r(fewer.ttft_p95),
                                "tpot_p95_s": _r(fewer.tpot_p95), "breaks": fewer.limited_by}
        return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


@dataclass(frozen=True, slots=True)
class Calibration:
    """How the pool's own busy minutes differ from the model at its own size (TTFT's p95, TPOT's mean): the queueing
    parts (TTFT's wait, TPOT's prefill stalls) scaled where they exist, the whole where they do not; and the busy
    TTFT minute, measured at its own load."""

    ttft_queue: float = 1.0
    ttft_scale: float = 1.0
    tpot_stall: float = 1.0
    tpot_scale: float = 1.0
    ttft_minute: TtftMinute | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {k: round(getattr(self, k), 3)
                                  for k in ("ttft_queue", "ttft_scale", "tpot_stall", "tpot_scale")}
        if (m := self.ttft_minute) is not None:
            out["ttft_minute"] = {"arrivals": round(m.load.arrivals, 3), "prompt_tokens": round(m.load.prompt_tokens),
                                  "ttft_queue": round(m.calibration.ttft_queue, 3),
                                  "ttft_scale": round(m.calibration.ttft_scale, 3)}
        return out


@dataclass(frozen=True, slots=True)
class TtftMinute:
    """Where a size is checked for TTFT a second time: the busy TTFT minute's load, the calibration measured there (its
    TTFT factors), and the hit rate of the load it stands beside (a change to that load's hit rate carries over)."""

    load: Load
    calibration: Calibration
    beside_hit_rate: float


NO_CALIBRATION = Calibration()


def _pass(curves: EngineCurves, arrivals: float, new_tokens: float, extra: float) -> tuple[float, float]:
    """(new tokens, seconds) of a pass when prompts of `new_tokens` arrive at `arrivals` per second (see
    `EngineCurves.pass_tokens`). `extra`: a unified engine's decode step in every pass."""
    x = curves.pass_tokens(arrivals, new_tokens, extra)
    return x, curves.prefill_seconds(x) + extra


@dataclass(frozen=True, slots=True)
class Engine:
    """One engine of the pool as the model runs it: its role and profile, the step cost and yield of its speculation,
    the limits it is sized to, and whether its router weighs queues."""

    role: str
    curves: EngineCurves
    step_cost: float = 1.0  # a decode step's cost in plain steps (a speculative step verifies several tokens)
    tokens_per_step: float = 1.0  # tokens a decode step yields
    kv_usage_max: float = 0.95
    max_utilization: float = 0.8
    load_aware: bool = True

    def prefills(self, load: Load) -> bool:
        """Whether this engine computes the load's prompts."""
        return self.role != "decode" and load.prompt_tokens > 0

    def decodes(self, load: Load) -> bool:
        """Whether this engine generates the load's answers (past their first token)."""
        return self.role != "prefill" and load.output_tokens > 1


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
    pass_tokens: float
    cost: Prefill


def _steady(lam: float, load: Load, eng: Engine) -> _Steady:
    """The batch that Little's law and the step time agree on at `lam` arrivals per second, with the prefill passes
    riding its steps (longer iterations gather more prompts each): a fixed point."""
    curves, step_cost, max_utilization = eng.curves, eng.step_cost, eng.max_utilization
    prefill, decode = eng.prefills(load), eng.decodes(load)
    new = max(load.prompt_tokens * (1.0 - load.hit_rate), 1.0)
    x, d = _pass(curves, lam, new, 0.0) if prefill else (0.0, 0.0)
    cost = prefill_cost(curves, load, x) if prefill else Prefill(0.0, 0.0, 0.0)
    stretch = 1.0  # prefill seconds per second of prefill work: a unified engine pays a decode step each pass
    rho = lam * cost.mean
    b = step = 0.0
    if decode:
        ctx = load.context
        b_max = _batch_limit(curves, load, eng.kv_usage_max)
        b = 1.0
        for _ in range(200):
            if rho >= max_utilization:
                break
            per_token = curves.step_seconds(b, ctx) * step_cost / eng.tokens_per_step / (1.0 - rho)
            nxt = max(1.0, lam * load.output_tokens * per_token)
            if nxt > b_max:  # the batch stops at its limit; arrivals queue behind it
                return _Steady("kv" if b_max < curves.max_num_seqs else "tpot", b_max,
                               curves.step_seconds(b_max, ctx) * step_cost, rho, stretch, d, x, cost)
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
    return _Steady(broke, b, step, rho, stretch, d, x, cost)


def _batch_limit(curves: EngineCurves, load: Load, kv_usage_max: float) -> float:
    """The most sequences an engine decodes at once: `max_num_seqs`, or what fits the usable KV cache (a decoding
    sequence holds its prompt and, on average, half its answer: blocks are allocated as it grows)."""
    return min(float(curves.max_num_seqs), kv_usage_max * curves.kv_tokens / max(load.context, 1.0))


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int, cap: float) -> np.ndarray:
    """`n` draws of a lognormal with this mean and shape, none above `cap`."""
    if sigma <= 0:
        return np.full(n, min(mean, cap))
    return np.minimum(np.exp(lognormal_location(mean, sigma) + sigma * rng.standard_normal(n)), cap)


def _tpot_parts(lam: float, load: Load, eng: Engine, at: _Steady) -> tuple[np.ndarray, np.ndarray]:
    """Drawn requests' TPOT in two parts, the steps' and the prefill stalls'. Each has its answer's length,
    the arrivals around its decode (a Poisson count over a decode span either side of it: its batch-mates) and at
    that rate the batch where Little's law and the step time agree, so near the knee of the step curve a burst grows
    the batch several times faster than the arrivals; the contexts its batch holds, which the step reads; and on a
    unified engine the prompts that arrive during its decode, each stalling it for its prefill. A short answer
    that meets one long prompt, a batch that holds one very long context: the p95 is set by such draws, which a
    formula over the means does not see. Seeded, the same draws for every engine count: the p95 falls as engines
    are added."""
    curves, per_step = eng.curves, eng.step_cost / eng.tokens_per_step
    rng = np.random.default_rng(TPOT_SEED)
    n = TPOT_SAMPLES
    out = np.maximum(2.0, np.round(_lognormal(rng, load.output_tokens, load.output_sigma, n,
                                              MAX_OUTPUT_OVER_MEAN * load.output_tokens)))
    window = max(2.0 * load.output_tokens * at.step / eng.tokens_per_step / (1.0 - at.rho), 1e-6)
    counts = rng.poisson(lam * window, n)
    b_max = _batch_limit(curves, load, eng.kv_usage_max)
    batch_at = {}
    for c in np.unique(counts):
        burst = _steady(c / window, load, eng)
        batch_at[int(c)] = b_max if burst.broke else burst.batch  # past a limit the batch sits at the KV's
    batch = np.array([batch_at[int(c)] for c in counts])
    # A step reads the KV of every sequence in the batch: the batch's contexts drawn, its own and the others', since
    # with long-tailed prompts one long context in a small batch slows every step it shares.
    others = np.maximum(np.round(batch).astype(int) - 1, 0)
    drawn = _lognormal(rng, load.prompt_tokens, load.prompt_sigma, n + int(others.sum()), load.max_prompt)
    own = drawn[:n] + out / 2.0
    rest = (np.bincount(np.repeat(np.arange(n), others), weights=drawn[n:], minlength=n)
            + others * load.output_tokens / 2.0)
    d, e, f = curves.decode  # `step_seconds` over arrays: f reads every context in the batch
    per_token = (d + e * batch + f * (own + rest)) * per_step
    stall = np.zeros(n)
    if eng.prefills(load) and lam > 0:
        # A router that weighs engines' queues (llm-d's queue scorer, the least-loaded pick) sends a prompt to an
        # engine with nothing decoding while there is one: only when all of them decode does a prompt stall anyone.
        engines = load.arrivals / lam
        decoding = load.arrivals * window / 2.0  # requests decoding in the pool (Little's law; `at.batch` is >= 1)
        busy = float(poisson.sf(math.ceil(engines) - 1, decoding)) if eng.load_aware else 1.0
        arrived = rng.poisson(lam * busy * (out - 1.0) * per_token / (1.0 - at.rho))
        beta, gamma = _prefill_terms(curves, load, at.pass_tokens)
        prompts = _lognormal(rng, load.prompt_tokens, load.prompt_sigma, int(arrived.sum()), load.max_prompt)
        seconds = (beta * prompts + gamma * prompts * prompts) * at.stretch
        stall = np.bincount(np.repeat(np.arange(n), arrived), weights=seconds, minlength=n) / (out - 1.0)
    return per_token, stall


def _at(n: int, load: Load, eng: Engine, transfer_s: float, cal: Calibration,
        keep_draws: bool = False) -> tuple[str | None, Sizing]:
    """Predicted p95s with `n` engines, and the first limit they break (None: none); with the drawn TPOT parts
    where `keep_draws` (only a calibration reads them: a search would carry arrays through every step)."""
    lam = load.arrivals / n
    prefill, decode = eng.prefills(load), eng.decodes(load)
    at = _steady(lam, load, eng)
    if at.broke:
        return at.broke, Sizing(n, at.batch, at.rho, None, None, at.broke)
    tpot = ttft = draws = None
    base = stall = floor = queue = 0.0
    if decode:
        draws = _tpot_parts(lam, load, eng, at)
        steps, stalls = draws
        tpot = float(np.quantile(steps * cal.tpot_scale + stalls * cal.tpot_stall, 0.95))
        base, stall = float(steps.mean()), float(stalls.mean())
    if prefill:
        # A prompt waits out the pass in flight, then rides its own: passes grow with the tokens that arrive
        # while one runs. Behind that, an M/G/1 queue (Pollaczek-Khinchine) mean wait, its p95 about thrice that.
        d = at.pass_s + (at.step if decode else 0.0)
        floor = 0.95 * d + max(d, at.cost.p95_alone * at.stretch) + transfer_s
        queue = QUEUE_P95_WAITS * lam * at.cost.second * at.stretch ** 2 / (2.0 * (1.0 - at.rho))
        ttft = floor * cal.ttft_scale + queue * cal.ttft_queue
    return None, Sizing(n, at.batch, at.rho, ttft, tpot, "none", floor, queue, base, stall,
                        tpot_draws=draws if keep_draws else None)


def predict(n: int, load: Load, eng: Engine, *, transfer_s: float = 0.0,
            calibration: Calibration = NO_CALIBRATION) -> Sizing:
    """The model's p95s with `n` engines (uncalibrated unless given a calibration; None where a limit breaks: the load
    does not fit), with the drawn requests' TPOT parts uncalibrated."""
    return _at(n, load, eng, transfer_s, calibration, keep_draws=True)[1]


def size_pool(load: Load, eng: Engine, *, ttft_slo: float | None, tpot_slo: float | None, margin: float = 1.0,
              transfer_s: float = 0.0, limit: int = 4096, calibration: Calibration = NO_CALIBRATION) -> Sizing:
    """The fewest engines like `eng` that carry `load` within `margin` of the SLOs (`limited_by` "none" when
    even `limit` engines do not: a lone request already misses, or the numbers are nonsense)."""
    if load.arrivals <= 0:
        return Sizing(1, 0.0, 0.0, None, None, "load")

    def judge(n: int) -> Sizing:
        """The sizing at `n` engines, its `limited_by` the limit it breaks ("" when it fits)."""
        broke, sizing = _at(n, load, eng, transfer_s, calibration)
        return replace(sizing, limited_by=broke or _over(sizing, ttft_slo, tpot_slo, margin) or "")

    # Grow geometrically to a size that fits, then bisect down: needs are monotone in the engine count. `below`
    # is the largest size known not to fit; it ends one under the answer.
    below: Sizing | None = None
    fits: Sizing | None = None
    n = 1
    while n <= limit:
        sizing = judge(n)
        if not sizing.limited_by:
            fits = sizing
            break
        below = sizing
        n *= 2
    if fits is None:
        return Sizing(limit, 0.0, 0.0, None, None, "none")
    while below is not None and fits.engines - below.engines > 1:
        sizing = judge((below.engines + fits.engines) // 2)
        if sizing.limited_by:
            below = sizing
        else:
            fits = sizing
    if below is None:  # one engine is plenty
        return replace(fits, limited_by="load")
    return replace(fits, limited_by=below.limited_by, one_fewer=below)


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
