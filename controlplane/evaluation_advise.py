"""`fleetctl advise eval`: the advisor on scenarios whose right answer is known, its savings measured.

Each case is a shipped scenario (`scenarios/advise/`) built so that one answer is right: a
long-context RAG trace under a tight TPOT objective and a decode-heavy chat trace with decode-class
GPUs on offer (disaggregate), a KV-bound pool (FP8 KV cache), a JSON-heavy pool (fewer or no draft
tokens), a small fleet (keep one pool). For each:

1. the scenario runs through the full loop in observe mode, so the store holds what a live fleet's
   would; the advisor reads it (after the warm-up) as `fleetctl advise` does and answers;
2. the simulator measures the truth: for the layout as it is and the layout the recommendation
   asks for (for "keep one pool", the split it advised against), per pool the fewest engines that
   meet the pool's SLOs in the busy minutes after the warm-up (the 95th percentile of the
   per-minute needs the autoscaler evaluation's oracle search finds, replaying the trace once per
   size), over the minutes of `SEEDS` seeds: one seed's answer moves by an engine where the need
   lies between two sizes, and a seed's arrivals and routing decide which;
3. the measured saving is the difference of the two layouts' GPU cost per day at the case's
   prices; the advisor's estimate must be within 20 % of it, and its answer the known one. The
   advised engine counts are also replayed, for the share of minutes they keep within the SLOs.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from catalog.fleet import Role
from controlplane.advice import advisor_input
from controlplane.evaluation import run_all
from controlplane.evaluation_autoscale import StaticReplay, oracle_needs, within_slo
from controlplane.goals import Goal, at_least, at_most, equal, goals_json
from controlplane.sim.engine import BLOCK_TOKENS, KV_BYTES_PER_TOKEN
from controlplane.sim.run import run_scenario
from controlplane.sim.scenario import PoolModel, Scenario, SpecModel, load_scenario
from controlplane.store.threaded import ThreadedStore
from policies.advice import AdviceKind, AdviceSettings, GpuType, Recommendation, advise
from policies.windows import SignalWindows

__all__ = ["CASES", "AdviceCase", "CaseResult", "apply", "evaluate_advice", "run_case", "savings_by_seed"]

SAVING_TOLERANCE = 0.20
NEED_QUANTILE = 0.95
WARMUP_S = 180.0  # caches warm and batches fill first: the advisor reads, and the truth is taken, after this
FIRST_BUSY_MINUTE = int(WARMUP_S // 60)  # the first minute the truth counts
SEEDS = 5  # the truth's seeds: the scenario's own and the next ones


@dataclass(frozen=True, slots=True)
class AdviceCase:
    """A scenario and the answer known to be right for its pool."""

    scenario: str
    pool: str
    kind: AdviceKind
    act: bool  # the right answer calls for a change (False: keep things as they are)
    change: Mapping[str, Any] = field(default_factory=dict)  # what the change must include
    fewer_draft_tokens: bool = False  # speculation: disabling or shortening the drafts are both right
    settings: AdviceSettings = field(default_factory=AdviceSettings)  # prices and GPU types of the case


CASES: dict[str, AdviceCase] = {
    "rag-prefill-heavy": AdviceCase("advise/rag-prefill-heavy", "rag", AdviceKind.DISAGGREGATION, True,
                                    {"layout": "disaggregated"}),
    "chat-decode-heavy": AdviceCase("advise/chat-decode-heavy", "chat", AdviceKind.DISAGGREGATION, True,
                                    {"layout": "disaggregated"}, settings=AdviceSettings(
                                        gpu_types={"h200": GpuType(price_per_hour=3.5),
                                                   "h20": GpuType(price_per_hour=1.5, speed=0.15, decode_speed=0.85)},
                                        decode_gpu="h20")),
    "kv-bound": AdviceCase("advise/kv-bound", "chat", AdviceKind.KV_PRECISION, True, {"kv_cache_dtype": "fp8"}),
    "json-heavy": AdviceCase("advise/json-heavy", "tools", AdviceKind.SPECULATION, True, fewer_draft_tokens=True),
    "small-fleet": AdviceCase("advise/small-fleet", "chat", AdviceKind.DISAGGREGATION, False, {"layout": "unified"}),
}


@dataclass(slots=True)
class CaseResult:
    """One case: the advice, the truth the simulator measured, and how far apart they are."""

    case: str
    kind: str
    advice: str
    right_answer: bool
    estimated_saving_per_day: float | None
    measured_saving_per_day: float
    error: float | None  # |estimated - measured| / |measured|; None: no estimate, or none measured but some promised
    engines_before: dict[str, int]  # the fewest engines per pool that meet the SLOs, as it is
    engines_after: dict[str, int]  # ... and as the recommendation has it
    advised_engines: dict[str, int]  # what the advisor said the new layout needs
    advised_attainment: float | None  # minutes within the SLOs with the advised engines, applied
    seeds: int = 1  # the truth is taken over this many seeds' minutes
    # Per pool, the need each seed alone would give (as is, and as advised): the spread the seeds pool over.
    before_by_seed: dict[str, list[int]] = field(default_factory=dict)
    after_by_seed: dict[str, list[int]] = field(default_factory=dict)
    # The saving each seed alone measures: how far the truth itself moves, against the tolerance the estimate has.
    measured_by_seed: list[float] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def within(self) -> bool:
        return self.error is not None and self.error <= SAVING_TOLERANCE


# applying a recommendation to a scenario ---------------------------------------------------------


def _with_pools(scenario: Scenario, pools: list[PoolModel]) -> Scenario:
    return scenario.model_copy(update={"fleet": scenario.fleet.model_copy(update={"pools": pools})})


def on_gpu(p: PoolModel, gpu_type: str | None, settings: AdviceSettings) -> dict[str, Any]:
    """A pool's fields moved to another GPU type: its speeds scaled by the types' relative speeds, its KV blocks by
    their memory where both give it (as the advisor moves them: `GpuType.kv_tokens_from`)."""
    if gpu_type is None or gpu_type == p.gpu_type:
        return {}
    there, here = settings.gpu_types[gpu_type], settings.gpu_types[p.gpu_type]
    kp, kd = there.relative_to(here)
    decode = p.speed if p.decode_speed is None else p.decode_speed
    out = {"gpu_type": gpu_type, "speed": p.speed * kp, "decode_speed": decode * kd}
    # The blocks are counted at the model's dtype (`engine_kv_blocks` doubles them in FP8): so are their bytes.
    kv = there.kv_tokens_from(here, p.kv_blocks * BLOCK_TOKENS, KV_BYTES_PER_TOKEN, p.gpus,
                              settings.gpu_memory_utilization)
    if kv is not None:
        out["kv_blocks"] = max(64, int(kv // BLOCK_TOKENS))
    return out


def split(scenario: Scenario, pool: str, replicas: tuple[int, int] | None = None,
          gpus: tuple[str | None, str | None] = (None, None), settings: AdviceSettings | None = None) -> Scenario:
    """The scenario with `pool` served by a prefill and a decode pool of its engines (on these GPU types): TTFT the
    prefill's SLO, TPOT the decode's."""
    settings = settings or AdviceSettings()
    out: list[PoolModel] = []
    for p in scenario.fleet.pools:
        if p.name != pool:
            out.append(p)
            continue
        n_p, n_d = replicas or (p.replicas, p.replicas)
        ceiling = p.max_replicas or p.replicas * 2
        out.append(p.model_copy(update={"name": f"{pool}-prefill", "role": Role.PREFILL, "replicas": n_p,
                                        "max_replicas": ceiling, "slo": p.slo.model_copy(update={"tpot_p95": None}),
                                        **on_gpu(p, gpus[0], settings)}))
        out.append(p.model_copy(update={"name": f"{pool}-decode", "role": Role.DECODE, "replicas": n_d,
                                        "max_replicas": ceiling, "slo": p.slo.model_copy(update={"ttft_p95": None}),
                                        **on_gpu(p, gpus[1], settings)}))
    return _with_pools(scenario, out)


def apply(scenario: Scenario, pool: str, kind: AdviceKind, change: Mapping[str, Any],
          settings: AdviceSettings | None = None) -> Scenario:
    """The scenario with the recommended layout in place of the pool's (a split for "keep one pool": the
    layout advised against, so its cost can be measured too)."""
    settings = settings or AdviceSettings()
    if kind is AdviceKind.DISAGGREGATION:
        gpus = (settings.prefill_gpu, settings.decode_gpu)
        if change.get("layout") == "disaggregated" and "prefill" in change:
            return split(scenario, pool, (int(change["prefill"]["replicas"]), int(change["decode"]["replicas"])),
                         (change["prefill"].get("gpu"), change["decode"].get("gpu")), settings)
        return split(scenario, pool, gpus=gpus, settings=settings)
    pools = []
    for p in scenario.fleet.pools:
        if p.name in pool.split("+") and kind is AdviceKind.KV_PRECISION:
            p = p.model_copy(update={"kv_cache_dtype": change.get("kv_cache_dtype", "fp8")})
        elif p.name == pool and kind is AdviceKind.SPECULATION:
            spec = change.get("speculative", {})
            method = spec.get("method", p.spec.method)
            k = 0 if method == "none" else int(spec.get("num_speculative_tokens", p.spec.num_speculative_tokens))
            p = p.model_copy(update={"spec": SpecModel(method=method, num_speculative_tokens=k)})
        pools.append(p)
    return _with_pools(scenario, pools)


# measuring ---------------------------------------------------------------------------------------


def seeded(scenario: Scenario, seeds: int) -> list[Scenario]:
    """The scenario under its own seed and the `seeds - 1` after it."""
    return [scenario.model_copy(update={"seed": scenario.seed + i}) for i in range(max(1, seeds))]


def _need(minutes: list[int]) -> int:
    return math.ceil(float(np.quantile(minutes, NEED_QUANTILE, method="higher")))


def needed(scenario: Scenario, jobs: int, progress: Callable[[str, Any], None] | None = None,
           seeds: int = 1) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Per pool, the fewest engines that meet its SLOs in the busy minutes (the 95th percentile of the minutes'
    needs, the minutes of every seed pooled: the busiest few are allowed to miss, as the advisor sizes for its
    load's 95th percentile); beside it, what each seed alone gives."""
    pooled: dict[str, list[int]] = {}
    by_seed: dict[str, list[int]] = {}
    for run in seeded(scenario, seeds):
        for pool, n in oracle_needs(run, jobs, progress).items():
            busy = n[FIRST_BUSY_MINUTE:] or n
            pooled.setdefault(pool, []).extend(busy)
            by_seed.setdefault(pool, []).append(_need(busy))
    return {pool: _need(n) for pool, n in pooled.items()}, by_seed


def cost_per_day(scenario: Scenario, engines: Mapping[str, int], settings: AdviceSettings) -> float:
    """GPU dollars per day of these engine counts."""
    return 24.0 * sum(n * p.gpus * settings.price(p.gpu_type)
                      for p in scenario.fleet.pools if (n := engines.get(p.name)) is not None)


def savings_by_seed(before: Scenario, before_seeds: Mapping[str, list[int]], after: Scenario,
                    after_seeds: Mapping[str, list[int]], settings: AdviceSettings) -> list[float]:
    """The saving per day each seed alone measures, from the engines each seed alone needs in either layout."""
    seeds = min(len(n) for n in (*before_seeds.values(), *after_seeds.values()))

    def at(by_seed: Mapping[str, list[int]], i: int) -> dict[str, int]:
        return {pool: needs[i] for pool, needs in by_seed.items()}

    return [round(cost_per_day(before, at(before_seeds, i), settings) - cost_per_day(after, at(after_seeds, i), settings),
                  2) for i in range(seeds)]


def attainment(scenario: Scenario, engines: Mapping[str, int], seeds: int = 1, jobs: int = 1) -> float:
    """Share of busy minutes within every pool's SLOs with the pools fixed at these sizes, over the seeds."""
    minutes = range(FIRST_BUSY_MINUTE, math.ceil(scenario.duration / 60.0))
    meters = run_all([(f"{scenario.name}: as advised, seed {run.seed}", StaticReplay(run, dict(engines)))
                      for run in seeded(scenario, seeds)], jobs)
    ok = sum(all(within_slo(meter, p, m) for p in scenario.fleet.pools) for meter in meters for m in minutes)
    total = len(meters) * len(minutes)
    return ok / total if total else 1.0


async def _observe(scenario: Scenario, settings: AdviceSettings) -> list[Recommendation]:
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'observe.db'}"
        config = scenario.controlplane_config(db).model_copy(update={"advisor": settings})
        run = await run_scenario(scenario, db, mode="observe", config=config, policies=[], start=0.0)
        store = ThreadedStore.open(db)
        try:
            windows = SignalWindows(scenario.duration + 120.0)
            windows.extend((s.ts, s.subject, s.name, s.value) for s in await store.load_signals(0.0))
        finally:
            store.close()
    now = run.fleet.now
    return advise(advisor_input(config, windows, now, min(now, WARMUP_S)), settings)


def run_case(name: str, jobs: int = 1, settings: AdviceSettings | None = None,
             progress: Callable[[str, Any], None] | None = None, seeds: int = SEEDS) -> CaseResult:
    """One case end to end: observe (under the scenario's seed), advise, measure both layouts over `seeds` seeds,
    compare."""
    wall = time.perf_counter()
    case = CASES[name]
    settings = settings or case.settings
    scenario = load_scenario(case.scenario)
    recs = asyncio.run(_observe(scenario, settings))
    rec = next((r for r in recs if r.kind is case.kind and r.pool == case.pool), None)
    right = rec is not None and rec.act == case.act and _answers(case, rec, scenario)
    change = rec.change if rec is not None else case.change
    after = apply(scenario, case.pool, case.kind, change, settings)
    before_n, before_seeds = needed(scenario, jobs, progress, seeds)
    after_n, after_seeds = needed(after, jobs, progress, seeds)
    measured = cost_per_day(scenario, before_n, settings) - cost_per_day(after, after_n, settings)
    by_seed = savings_by_seed(scenario, before_seeds, after, after_seeds, settings)
    estimated = None if rec is None else rec.effect.saving_per_day
    advised = _advised_engines(rec, case, after_n)
    reached = attainment(after, advised, seeds, jobs) if advised else None
    err = None
    # Relative to the measured saving; undefined (None: the goal fails) when the simulator measured none and the
    # advisor promised some.
    if estimated is not None and (measured or abs(estimated) < 1e-9):
        err = abs(estimated - measured) / abs(measured) if measured else 0.0
    return CaseResult(name, case.kind.value, rec.advice if rec else "(no recommendation)", right,
                      None if estimated is None else round(estimated, 2), round(measured, 2),
                      None if err is None else round(err, 4), before_n, after_n, advised, reached, seeds=seeds,
                      before_by_seed=before_seeds, after_by_seed=after_seeds, measured_by_seed=by_seed,
                      evidence=dict(rec.evidence) if rec else {}, wall_s=round(time.perf_counter() - wall, 1))


def _answers(case: AdviceCase, rec: Recommendation, scenario: Scenario) -> bool:
    """Whether the recommendation is the known answer."""
    if case.fewer_draft_tokens:
        spec = rec.change.get("speculative", {})
        now = next(p.spec.num_speculative_tokens for p in scenario.fleet.pools if p.name == case.pool)
        return spec.get("method") == "none" or int(spec.get("num_speculative_tokens", now)) < now
    return all(rec.change.get(k) == v for k, v in case.change.items())


def _advised_engines(rec: Recommendation | None, case: AdviceCase, truth: Mapping[str, int]) -> dict[str, int]:
    """The engine counts the advice itself names for the new layout (pool names as the applied scenario has them)."""
    if rec is None:
        return {}
    ev = rec.evidence
    if case.kind is AdviceKind.DISAGGREGATION and "prefill_pool" in ev:
        return {f"{case.pool}-prefill": int(ev["prefill_pool"]["engines"]),
                f"{case.pool}-decode": int(ev["decode_pool"]["engines"])}
    if rec.effect.metric == "engines_needed":
        return {case.pool: int(rec.effect.after)}
    return dict(truth)


def evaluate_advice(cases: list[str] | None = None, jobs: int = 1,
                    progress: Callable[[str, Any], None] | None = None, seeds: int = SEEDS) -> dict[str, Any]:
    """Every case (or the named ones): the table's rows and the goals."""
    names = cases or list(CASES)
    results = [run_case(n, jobs, progress=progress, seeds=seeds) for n in names]
    goals: list[Goal] = []
    for r in results:
        goals.append(equal(f"{r.case}: the known answer", r.right_answer, True))
        goals.append(at_most(f"{r.case}: estimated saving's error vs the simulator", r.error, SAVING_TOLERANCE))
    goals.append(at_least("cases answered right", sum(r.right_answer for r in results), len(results)))
    return {"cases": [asdict(r) for r in results], "goals": goals_json(goals)}
