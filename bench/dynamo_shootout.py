"""NVIDIA Dynamo's SLA planner in the loop of the simulated fleet, beside `fleetctl autoscale eval`'s strategies.

Dynamo's planner runs unchanged in its own virtual environment (`make bench-dynamo-venv`; its pins never
meet the product's), behind `bench/dynamo/planner_worker.py`, which drives it through Dynamo's own offline
replay adapter. This side replays the trace through the same simulated fleet the other strategies get
(same seed, start-up time, drain and starting size) and, at every tick the planner asks for, hands it the
fleet in its own terms:

- worker counts: engines serving per pool, with the ones still starting or draining apart;
- one forward-pass-metrics snapshot per serving engine, its current iteration as vLLM's instrumented
  scheduler would report it: prefill and decode requests scheduled with their tokens and KV tokens, what
  waits in the queue, and the iteration's wall time from the engine's own performance model;
- the traffic window since the last tick, as Dynamo's frontend reports it: requests that arrived, mean
  prompt and output length, prefix-cache hit rate, mean TTFT and ITL.

Its `target_prefill`/`target_decode` are applied to the pools at once (new engines serve after the pool's
start-up time; removed ones drain). Its performance regressions are seeded as Dynamo's replay seeds them,
with benchmark forward-pass metrics on the same grid, here measured from the simulated engine itself (the
calibrated profile at the pool's speed) instead of NVIDIA's simulator, which its replay uses and this
environment cannot install.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from catalog.fleet import Role
from collectors.derive import counter_increase
from controlplane.evaluation_autoscale import MinuteMeter, StrategyRun, pool_ceiling, resized, start_sizes, summarise
from controlplane.sim.engine import BLOCK_TOKENS, SimEngine
from controlplane.sim.fleet import SimFleet
from controlplane.sim.perf import PerfModel, load_model
from controlplane.sim.scenario import FaultTimeline, PoolModel, Scenario
from policies.stats import MAX_CONTEXT

__all__ = ["CONFIGURATIONS", "DynamoError", "DynamoPeer", "DynamoRun", "FleetObserver", "PlannerProcess", "benchmark_fpms",
           "capabilities", "check_environment", "default_python", "fpm_snapshot", "planner_config"]

WORKER = Path(__file__).resolve().parent / "dynamo" / "planner_worker.py"
DEFAULT_VENV = Path(os.environ.get("FLEET_DYNAMO_VENV", Path.home() / ".cache" / "fleet-controlplane" / "dynamo-venv"))
# --max-model-len: the longest prompt an engine takes (Mooncake's reach 126k tokens); Dynamo's threshold modes scale
# with it.
CONTEXT_LENGTH = int(MAX_CONTEXT)

# The planner's configurations tried on every trace; the report keeps each one's row and names the best.
# sla-*: throughput-based scaling on a load forecast and the performance model, every minute (Dynamo's
# default interval is 3 minutes; one fits these one-hour traces better), with each load predictor;
# +load adds the fast loop on forward-pass metrics; throughput and load are Dynamo's threshold modes on
# queue and KV usage (throughput's are built in; load's, which a user must give, are KV usage 80 %/40 % and
# two batch budgets/a quarter of one of queued prefill tokens). The SLA mode sizes for the mean request,
# so a user who needs a p95 gives it tighter targets: the `-tight` ones get half our objectives
# (`slo_scale`, ours to apply; not one of Dynamo's fields).
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "sla-constant": {"optimization_target": "sla", "load_predictor": "constant"},
    "sla-arima": {"optimization_target": "sla", "load_predictor": "arima"},
    "sla-kalman": {"optimization_target": "sla", "load_predictor": "kalman"},
    "sla-prophet": {"optimization_target": "sla", "load_predictor": "prophet"},
    "sla-kalman-tight": {"optimization_target": "sla", "load_predictor": "kalman", "slo_scale": 0.5},
    "sla-prophet-tight": {"optimization_target": "sla", "load_predictor": "prophet", "slo_scale": 0.5},
    "sla-arima+load": {"optimization_target": "sla", "load_predictor": "arima", "enable_load_scaling": True},
    "throughput": {"optimization_target": "throughput"},
    "load": {"optimization_target": "load", "decode_scale_up_kv_rate": 80, "decode_scale_down_kv_rate": 40,
             "prefill_scale_up_queue_tokens": 16_384, "prefill_scale_down_queue_tokens": 2_048},
}
SLA_INTERVAL_S = 60


class DynamoError(RuntimeError):
    """Dynamo's planner could not be started or failed a tick."""


def default_python() -> Path:
    """The Dynamo environment's interpreter: $FLEET_DYNAMO_PYTHON, else the benchmark venv's."""
    return Path(os.environ.get("FLEET_DYNAMO_PYTHON", DEFAULT_VENV / "bin" / "python"))


# what the planner is seeded with --------------------------------------------------------------------


def _fpm(wall_time: float, **scheduled: int) -> dict[str, Any]:
    return {"wall_time": wall_time, **scheduled}


def benchmark_fpms(model: PerfModel, pool: PoolModel, granularity: int = 8) -> dict[str, list[dict[str, Any]]]:
    """Forward-pass metrics on the grid Dynamo's replay benchmarks (one prefill of 100 tokens up to the
    batch budget; batches up to `max_num_seqs` at 500 to 8,000 tokens of context), and mixed iterations
    for an aggregated engine, timed by the engine's model."""
    top = pool.max_batched_tokens
    prefill = [_fpm(model.prefill_batch_seconds([(isl, 0)]), num_prefill_requests=1, sum_prefill_tokens=isl)
               for isl in range(100, top + 1, max(1, (top - 100) // granularity))]
    max_kv = pool.engine_kv_blocks * BLOCK_TOKENS
    decode = []
    for ctx in (500, 2000, 4000, 8000):
        for bs in range(1, pool.max_num_seqs + 1, max(1, pool.max_num_seqs // granularity)):
            if bs * ctx > max_kv:
                break
            decode.append(_fpm(model.decode_step_seconds(bs, ctx), num_decode_requests=bs,
                               sum_decode_kv_tokens=bs * ctx))
    # An aggregated engine runs prefill chunks beside its decode batch; the AIC regression cannot time such
    # an iteration from pure ones, and Dynamo's replay leaves it to the live stream, so the grid's mixed
    # points are timed here as the engine times them.
    mixed = [_fpm(model.prefill_batch_seconds([(chunk, 0)]) + model.decode_step_seconds(bs, ctx),
                  num_prefill_requests=1, sum_prefill_tokens=chunk, num_decode_requests=bs,
                  sum_decode_kv_tokens=bs * ctx)
             for chunk in (512, 2048, top) for ctx in (500, 2000, 8000)
             for bs in range(1, pool.max_num_seqs + 1, max(1, pool.max_num_seqs // 4)) if bs * ctx <= max_kv]
    return {"prefill": prefill, "decode": decode, "mixed": mixed}


def capabilities(pool: PoolModel) -> dict[str, Any]:
    """What Dynamo reads from an engine's card: batch limits, KV capacity, GPUs."""
    return {"num_gpu": pool.gpus, "max_num_batched_tokens": pool.max_batched_tokens,
            "max_num_seqs": pool.max_num_seqs, "context_length": CONTEXT_LENGTH,
            "max_kv_tokens": pool.engine_kv_blocks * BLOCK_TOKENS, "kv_cache_block_size": BLOCK_TOKENS}


# the fleet in the planner's terms ---------------------------------------------------------------------


def _moments(values: Sequence[float]) -> tuple[int, float]:
    return (int(sum(values)), float(np.var(values)) if values else 0.0)


def fpm_snapshot(engine: SimEngine, worker_id: int) -> dict[str, Any]:
    """The engine's current iteration as vLLM's instrumented scheduler reports it (Dynamo's replay field names)."""
    decoders, prefills, chunks = engine.next_iteration()
    step = engine.step_seconds(chunks, decoders)
    decode_kv, decode_var = _moments([r.context for r in decoders])
    queued = list(engine.waiting)
    queued_prompt, queued_var = _moments([r.input_tokens for r in queued if r.generated < 1])
    requeued_kv, requeued_var = _moments([r.context for r in queued if r.generated >= 1])
    return {
        "worker_id": str(worker_id), "dp_rank": 0, "wall_time": step,
        "num_prefill_requests": len(prefills), "sum_prefill_tokens": int(sum(c for c, _ in chunks)),
        "var_prefill_length": float(np.var([r.input_tokens for r in prefills])) if prefills else 0.0,
        "sum_prefill_kv_tokens": int(sum(done for _, done in chunks)),
        "num_decode_requests": len(decoders), "sum_decode_kv_tokens": decode_kv, "var_decode_kv_tokens": decode_var,
        "num_queued_prefill": sum(1 for r in queued if r.generated < 1), "sum_queued_prefill_tokens": queued_prompt,
        "var_queued_prefill_length": queued_var, "num_queued_decode": sum(1 for r in queued if r.generated >= 1),
        "sum_queued_decode_kv_tokens": requeued_kv, "var_queued_decode_kv_tokens": requeued_var,
    }


_COUNTS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
_HISTS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
          "vllm:request_time_per_output_token_seconds")


@dataclass
class FleetObserver:
    """Turns the simulated fleet into the snapshots `ReplayPlannerAdapter.on_tick` reads, a tick at a time."""

    prefill_pool: str | None  # None: one aggregated pool, reported as Dynamo's decode workers
    decode_pool: str
    _ids: dict[str, int] = field(default_factory=dict)
    _last: dict[tuple[str, str], float] = field(default_factory=dict)
    _arrived: int = 0
    _t: float = 0.0
    _ticks: int = 0

    def _id(self, pod: str) -> int:
        return self._ids.setdefault(pod, len(self._ids) + 1)

    def _delta(self, engines: Iterable[SimEngine], key: str, read: Any) -> float:
        total = 0.0
        for e in engines:
            value = float(sum(read(r) for r in e.ranks))
            total += counter_increase(self._last.get((e.pod, key), 0.0), value) or 0.0
            self._last[(e.pod, key)] = value
        return total

    def _engines(self, fleet: SimFleet, pool: str) -> list[SimEngine]:
        return [m.engine for m in fleet.members[pool] if m.ready_at <= fleet.now]

    def traffic(self, fleet: SimFleet) -> dict[str, Any]:
        """The window since the last tick, as Dynamo's frontend metrics give it."""
        entry = self._engines(fleet, self.prefill_pool or self.decode_pool)
        out = self._engines(fleet, self.decode_pool)

        def count(engines: list[SimEngine], name: str) -> float:
            return self._delta(engines, name, lambda r: r.counters.get(name, 0.0))

        def hist(engines: list[SimEngine], name: str) -> tuple[float, float]:
            return (self._delta(engines, name + ":sum", lambda r: r.hists[name].sum),
                    self._delta(engines, name + ":count", lambda r: float(np.sum(r.hists[name].counts))))

        ttft_sum, ttft_n = hist(entry, _HISTS[0])
        itl_sum, itl_n = hist(out, _HISTS[1])
        _, finished = hist(out, _HISTS[2])
        prompt = count(entry, _COUNTS[0])
        generated = count(out, _COUNTS[1])
        queries, hits = count(entry, _COUNTS[2]), count(entry, _COUNTS[3])
        if self.prefill_pool is not None:
            generated += count(entry, _COUNTS[1])  # the prefill worker samples the first token
        arrived = fleet.arrived - self._arrived
        self._arrived = fleet.arrived
        duration, self._t = fleet.now - self._t, fleet.now
        return {"duration_s": duration, "num_req": float(arrived),
                "avg_isl": prompt / ttft_n if ttft_n else 0.0, "avg_osl": generated / finished if finished else 0.0,
                "avg_kv_hit_rate": hits / queries if queries else 0.0,
                "avg_ttft_ms": 1000.0 * ttft_sum / ttft_n if ttft_n else 0.0,
                "avg_itl_ms": 1000.0 * itl_sum / itl_n if itl_n else 0.0,
                "ttft_count": ttft_n, "itl_count": itl_n, "shape_count": finished, "hit_rate_count": queries}

    def result(self, fleet: SimFleet) -> dict[str, Any]:
        """One tick's snapshot: worker counts and ids, per-worker forward-pass metrics, the traffic window."""
        out: dict[str, Any] = {"tick_ordinal": self._ticks}
        self._ticks += 1
        roles = (("prefill", self.prefill_pool), ("decode", self.decode_pool))
        for role, pool in roles:
            members = fleet.members[pool] if pool else []
            ready = [m for m in members if m.ready_at <= fleet.now]
            serving = [m for m in ready if not m.draining]
            # A draining engine has left Dynamo's inventory (a Dynamo scale-down deletes the pod; here it drains).
            out[f"active_{role}_count"] = out[f"non_draining_{role}_count"] = len(serving)
            out[f"active_{role}_ids"] = [self._id(m.pod) for m in serving]
            out[f"starting_{role}_ids"] = [self._id(m.pod) for m in members if m.ready_at > fleet.now]
            out[f"draining_{role}_ids"] = [self._id(m.pod) for m in ready if m.draining]
            out[f"{role}_fpm_snapshots"] = [fpm_snapshot(m.engine, self._id(m.pod)) for m in serving]
        out["traffic"] = self.traffic(fleet)
        return out


# the planner process ----------------------------------------------------------------------------------


class PlannerProcess:
    """Dynamo's planner behind `planner_worker.py`, in the Dynamo environment's interpreter."""

    def __init__(self, python: Path) -> None:
        if not Path(python).exists():
            raise DynamoError(f"{python}: no Dynamo environment there; create it with `make bench-dynamo-venv` "
                              "or point FLEET_DYNAMO_PYTHON at one")
        # The planner logs every tick; DYNAMO_PLANNER_LOG=INFO passes its log through.
        log = None if os.environ.get("DYNAMO_PLANNER_LOG") else subprocess.DEVNULL
        self._proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=log, text=True, bufsize=1, env={**os.environ, "PYTHONPATH": ""})

    def ask(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its answer."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise DynamoError(f"Dynamo's planner exited (status {self._proc.poll()}); rerun with DYNAMO_PLANNER_LOG=INFO")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise DynamoError(f"Dynamo's planner failed on {msg.get('op')}: {reply['error']}")
        return reply

    def close(self) -> None:
        """Stop the worker."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if not pipe.closed:
                pipe.close()


# one configuration on one trace ---------------------------------------------------------------------------


def planner_config(scenario: Scenario, configuration: Mapping[str, Any]) -> dict[str, Any]:
    """Dynamo's `PlannerConfig` for the scenario's fleet: the same SLOs, GPU budget and minimum engines ours get."""
    pools = {p.role: p for p in scenario.fleet.pools}
    disagg = Role.PREFILL in pools
    first = pools.get(Role.PREFILL) or pools[Role.UNIFIED]
    last = pools.get(Role.DECODE) or pools[Role.UNIFIED]
    ttft, tpot = first.slo.ttft_p95, last.slo.tpot_p95
    own = dict(configuration)
    scale = float(own.pop("slo_scale", 1.0))
    config: dict[str, Any] = {
        "namespace": "fleet-bench", "environment": "virtual", "backend": "vllm", "mode": "disagg" if disagg else "agg",
        "ttft_ms": 1000.0 * scale * (ttft or 2.0), "itl_ms": 1000.0 * scale * (tpot or 0.1), "min_endpoint": 1,
        "max_gpu_budget": sum(pool_ceiling(p) * p.gpus for p in scenario.fleet.pools),
        "decode_engine_num_gpu": last.gpus,
        "throughput_adjustment_interval_seconds": SLA_INTERVAL_S,
    }
    if disagg:
        config["prefill_engine_num_gpu"] = first.gpus
    return {**config, **own}


@dataclass(frozen=True)
class DynamoRun:
    """One configuration of Dynamo's planner on one trace, picklable for a worker process."""

    trace: str
    scenario: Scenario
    name: str
    configuration: dict[str, Any]
    start: dict[str, int]
    python: Path

    def __call__(self) -> StrategyRun:
        wall = time.perf_counter()
        s = self.scenario
        pools = {p.role: p for p in s.fleet.pools}
        prefill, decode = pools.get(Role.PREFILL), pools.get(Role.DECODE) or pools[Role.UNIFIED]
        sized = resized(s, self.start)
        fleet = SimFleet(sized.fleet_spec(), sized.requests(), now=0.0)
        meter = MinuteMeter(fleet, 0.0, {p.name: p.gpus for p in s.fleet.pools})
        faults = FaultTimeline(s.faults, 0.0)  # as every strategy's replay meets them
        observer = FleetObserver(prefill.name if prefill else None, decode.name)
        events = 0
        planner = PlannerProcess(self.python)
        try:
            seeds = {role: benchmark_fpms(load_model(p.profile, p.speed, p.decode_speed), p)
                     for role, p in (("prefill", prefill or decode), ("decode", decode))}
            caps = {"prefill": capabilities(prefill) if prefill else None, "decode": capabilities(decode)}
            next_tick: float | None = planner.ask({
                "op": "start", "config": planner_config(s, self.configuration), "capabilities": caps,
                "benchmark": {"prefill": seeds["prefill"]["prefill"], "decode": seeds["decode"]["decode"],
                              "mixed": [] if prefill else seeds["decode"]["mixed"]},
            })["first_tick_s"]
            interval = s.scrape_interval
            sample_at = interval
            while sample_at <= s.duration + 1e-9:
                t = sample_at if next_tick is None else min(sample_at, next_tick)
                faults.advance(fleet, t)
                fleet.advance_to(t)
                if next_tick is not None and t >= next_tick - 1e-9:
                    answer = planner.ask({"op": "tick", "result": observer.result(fleet)})
                    targets = {"decode": (decode, answer["target_decode"])}
                    if prefill is not None:
                        targets["prefill"] = (prefill, answer["target_prefill"])
                    capped: dict[str, int] = {}
                    for role, (pool, asked) in targets.items():
                        if asked is None:
                            continue
                        n = max(1, min(pool_ceiling(pool), int(asked)))
                        if n != int(asked):
                            capped[role] = n
                        if n != fleet.desired[pool.name]:
                            fleet.scale(pool.name, n)
                            events += 1
                    if capped:
                        planner.ask({"op": "capped", **capped})
                    next_tick = answer["next_tick_s"]
                if t >= sample_at - 1e-9:
                    meter.sample(fleet)
                    sample_at += interval
        finally:
            planner.close()
        return summarise(self.trace, f"dynamo:{self.name}", s, meter, events, time.perf_counter() - wall)


@dataclass(frozen=True)
class DynamoPeer:
    """Dynamo's planner as a peer of `fleetctl autoscale eval`: one run per configuration, the best one reported."""

    python: Path
    configurations: tuple[str, ...] = tuple(CONFIGURATIONS)
    name: str = "dynamo"

    def runs(self, trace: str, scenario: Scenario, needs: Mapping[str, list[int]]) -> list[DynamoRun]:
        """One picklable run per configuration, each starting where every dynamic strategy does (`start_sizes`)."""
        start = start_sizes(scenario, needs)
        return [DynamoRun(trace, scenario, c, CONFIGURATIONS[c], start, Path(self.python)) for c in self.configurations]


def check_environment(python: Path) -> str:
    """Dynamo's version in the environment at `python`; DynamoError when it cannot run the planner."""
    probe = ("import dynamo.planner.offline.replay_adapter; from importlib.metadata import version; "
             "print(version('ai-dynamo'))")
    if not Path(python).exists():
        raise DynamoError(f"{python}: no Dynamo environment there; create it with `make bench-dynamo-venv`")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    if done.returncode != 0:
        raise DynamoError(f"{python} cannot import Dynamo's planner: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()

