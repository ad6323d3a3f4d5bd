"""Scenarios: a trace, a fleet and a timeline of faults, each fault with its ground truth.

A scenario file is YAML validated like the fleet file (errors name the file, field path and
line). Faults change the simulated fleet at `at` and undo the change at `end`; their `truth`
says which finding kind on which pool (and pod) a detector should raise meanwhile. Scenarios
without faults are fault-free replays: every finding they produce is a false alarm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from catalog.fleet import Role
from catalog.settings import Seconds, Settings
from controlplane.config import (
    Engine,
    FleetConfig,
    Mode,
    Policies,
    Pool,
    Rails,
    Replicas,
    Scrape,
    Slo,
    Speculative,
    Store,
    parse_yaml,
)
from controlplane.errors import ConfigError
from controlplane.sim.engine import KV_BYTES_PER_TOKEN, EngineConfig
from controlplane.sim.fleet import FleetSpec, PoolSpec, SimFleet, SystemPrompts
from controlplane.sim.moe import EplbConfig, MoeSpec
from controlplane.sim.perf import DYNAMO_PROFILE, load_model
from controlplane.sim.routing import RouterKind
from controlplane.sim.speculation import SpecConfig
from controlplane.sim.traces import Request, TraceFormat, read_trace, shipped_trace, trace_format
from policies.ep_imbalance import EpImbalanceSettings
from policies.gpu_health import GpuHealthSettings
from policies.types import ActionKind

__all__ = ["FAULT_KINDS", "SCALE_STEP", "Fault", "FaultTimeline", "Scenario", "TraceSpec", "Truth", "apply_fault",
           "builtin_scenarios", "load_scenario"]

# The most replicas one scale action may add or remove in a replay, every strategy alike: as fast as a Kubernetes
# HPA's default allows (4 pods or 100 % per 15 s).
SCALE_STEP = 8

# ServeGen's language models publish no lengths: requests get these (prompt, output) tokens.
SERVEGEN_LENGTHS = (1500, 250)


class TraceSpec(Settings):
    """Which trace (a shipped one by `name`, or a file or ServeGen folder by `path`), which window, how fast."""

    name: str | None = None  # azure/conv, azure/code, mooncake/conversation, mooncake/synthetic, servegen/<kind>/<model>
    path: str | None = None  # relative to the scenario file; format from the name unless `format` says
    format: TraceFormat | None = None
    start: float = Field(0.0, ge=0)
    duration: Seconds | None = None
    speedup: float = Field(1.0, gt=0)
    clients: list[str] | None = None  # ServeGen: the clients to replay (all by default)
    sample: float = Field(1.0, gt=0, le=1)  # ServeGen: share of arrivals kept

    @model_validator(mode="after")
    def _one_source(self) -> TraceSpec:
        if (self.name is None) == (self.path is None):
            raise ValueError("give the trace either a name (a shipped trace) or a path (your own file or folder)")
        if self.name is not None:
            try:
                shipped_trace(self.name)
            except KeyError as exc:
                raise ValueError(str(exc.args[0])) from None
            if self.format is not None:
                raise ValueError("format applies to a trace given by path; a shipped trace's format is known")
        return self

    @property
    def label(self) -> str:
        """The trace as the scenario names it."""
        return self.name or str(self.path)

    def source(self) -> tuple[Path, TraceFormat]:
        """(file or folder, format) to read."""
        if self.name is not None:
            return shipped_trace(self.name)
        path = Path(str(self.path))
        return path, self.format or trace_format(path)

    def requests(self, duration_s: float, seed: int) -> Iterator[Request]:
        """The trace's arrivals in its window, `duration_s` of trace time long unless `duration` says."""
        path, fmt = self.source()
        return read_trace(path, fmt, start_s=self.start, duration_s=self.duration or duration_s, speedup=self.speedup,
                          seed=seed, clients=self.clients, sample=self.sample, default_lengths=SERVEGEN_LENGTHS)


class SpecModel(Settings):
    method: Literal["none", "ngram", "eagle", "eagle3", "mtp"] = "none"
    num_speculative_tokens: int = Field(0, ge=0, le=16)


class MoeModel(Settings):
    experts: int = Field(64, ge=2)
    ranks: int = Field(4, ge=1, le=64)
    zipf_s: float = Field(0.4, ge=0)
    moe_share: float = Field(0.55, ge=0, le=1)


class EplbModel(Settings):
    window_size: int = Field(1000, gt=0)
    step_interval: int = Field(3000, gt=0)
    num_redundant_experts: int = Field(0, ge=0)


class PoolModel(Settings):
    """One simulated pool and the bounds the control plane keeps it in."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    role: Role
    replicas: int = Field(ge=1)
    max_replicas: int | None = Field(None, ge=1)
    speed: float = Field(1.0, gt=0)
    decode_speed: float | None = Field(None, gt=0)  # decode steps' own factor (a memory-bound GPU's), default `speed`
    gpu_type: str = "h200"  # what the advisor prices the pool's GPUs as
    kv_blocks: int = Field(30_000, ge=64)
    max_num_seqs: int = Field(256, ge=1)
    max_batched_tokens: int = Field(8192, ge=64)
    startup: Seconds = 120.0
    profile: str = DYNAMO_PROFILE  # a shipped profile's name, or a Dynamo profile folder or Splitwise CSV by path
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # fp8: half the bytes per token, so twice the blocks
    spec: SpecModel = SpecModel()
    moe: MoeModel | None = None
    eplb: EplbModel | None = None
    slo: Slo = Slo()

    @property
    def gpus(self) -> int:
        """GPUs one engine of the pool holds: its expert-parallel ranks, else one."""
        return self.moe.ranks if self.moe else 1

    @property
    def engine_kv_blocks(self) -> int:
        """KV blocks an engine holds: `kv_blocks` at the model's dtype, twice as many in FP8."""
        return self.kv_blocks * (2 if self.kv_cache_dtype == "fp8" else 1)

    @model_validator(mode="after")
    def _checks(self) -> PoolModel:
        if self.eplb is not None and self.moe is None:
            raise ValueError("eplb needs an moe section: EPLB balances experts")
        if self.spec.method != "none" and self.spec.num_speculative_tokens < 1:
            raise ValueError("spec.num_speculative_tokens must be >= 1 when a method is set")
        return self


class SystemPromptModel(Settings):
    count: int = Field(24, ge=1)
    blocks: int = Field(4, ge=1)
    block_tokens: int = Field(256, ge=16)
    zipf_s: float = Field(1.1, ge=0)


class FleetModel(Settings):
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    router: RouterKind = RouterKind.CACHE_AWARE
    decode_router: RouterKind = RouterKind.LEAST_LOADED
    link_gbps: float = Field(400.0, gt=0)
    system_prompts: SystemPromptModel | None = None
    load: float = Field(1.0, gt=0)  # every arrival of the trace counted this many times (on average)
    # Seconds over which an arrival's copies come in (uniformly after it); 0: all at the same instant.
    load_spread: Seconds = Field(0.0, ge=0)
    pools: list[PoolModel] = Field(min_length=1)

    @model_validator(mode="after")
    def _roles(self) -> FleetModel:
        roles = [p.role for p in self.pools]
        if (Role.PREFILL in roles) != (Role.DECODE in roles):
            raise ValueError("a disaggregated fleet needs both a prefill and a decode pool")
        if len({p.name for p in self.pools}) != len(self.pools):
            raise ValueError("pool names must be unique")
        return self


FaultKind = Literal["router_flip", "system_prompt", "prompt_scale", "hot_expert", "class_mix", "canary", "kv_lag",
                    "gpu_xid", "gpu_thermal", "burst", "slow_engine"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class Truth(Settings):
    """What a detector should report while the fault lasts."""

    kind: str
    pool: str | None = None
    pod: str | None = None  # a pod name, or a node/agent name containing it
    required: bool = True  # False: a finding of this kind is no false alarm, its absence no miss


class Fault(Settings):
    """One change to the fleet from `at` until `end` (or the end of the run)."""

    kind: FaultKind
    at: Seconds
    end: Seconds | None = None
    pool: str | None = None
    pod: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    truth: list[Truth] = Field(default_factory=list)

    @model_validator(mode="after")
    def _ordered(self) -> Fault:
        if self.end is not None and self.end <= self.at:
            raise ValueError(f"end ({self.end}) must come after at ({self.at})")
        return self


class Scenario(Settings):
    """A whole scenario file."""

    name: str
    description: str = ""
    trace: TraceSpec
    duration: Seconds
    seed: int = 7
    scrape_interval: Seconds = 15.0
    fleet: FleetModel
    faults: list[Fault] = Field(default_factory=list)
    source: str = ""

    @model_validator(mode="after")
    def _faults_fit(self) -> Scenario:
        pools = {p.name for p in self.fleet.pools}
        for i, f in enumerate(self.faults):
            if f.at >= self.duration:
                raise ValueError(f"faults[{i}] starts at {f.at}s, after the scenario's {self.duration}s")
            if f.pool is not None and f.pool not in pools:
                raise ValueError(f"faults[{i}].pool {f.pool!r} is not a pool of the fleet ({', '.join(sorted(pools))})")
        return self

    # what the run needs ------------------------------------------------------------------------

    def requests(self) -> Iterator[Request]:
        """The trace window as arrivals from 0, replayed again from its start if the run outlasts it."""
        t = self.trace
        window = list(t.requests(self.duration * t.speedup, self.seed))
        if not window:
            raise ConfigError(self.source or self.name, [f"trace {t.label!r} has no requests in the chosen window"])
        span = max(window[-1].arrival_s, 1.0)
        offset = 0.0
        while offset < self.duration:
            for r in window:
                if offset + r.arrival_s >= self.duration:
                    return
                yield replace(r, arrival_s=offset + r.arrival_s) if offset else r
            offset += span

    def check(self) -> None:
        """Read what the run will need (the trace window, every pool's profile), so a bad file fails before it starts."""
        next(self.requests())
        for p in self.fleet.pools:
            load_model(p.profile, p.speed, p.decode_speed)

    def fleet_spec(self) -> FleetSpec:
        """The simulator's fleet."""
        f = self.fleet
        pools = tuple(
            PoolSpec(
                p.name, p.role, p.replicas, speed=p.speed, decode_speed=p.decode_speed,
                engine=EngineConfig(kv_blocks=p.engine_kv_blocks, max_num_seqs=p.max_num_seqs,
                                    max_batched_tokens=p.max_batched_tokens,
                                    kv_bytes_per_token=KV_BYTES_PER_TOKEN // (2 if p.kv_cache_dtype == "fp8" else 1)),
                spec=SpecConfig(p.spec.method, p.spec.num_speculative_tokens),
                moe=MoeSpec(p.moe.experts, p.moe.ranks, p.moe.zipf_s, p.moe.moe_share, seed=self.seed) if p.moe else None,
                eplb=EplbConfig(p.eplb.window_size, p.eplb.step_interval, p.eplb.num_redundant_experts) if p.eplb else None,
                startup_s=p.startup, profile=p.profile,
            )
            for p in f.pools
        )
        sp = f.system_prompts
        prompts = SystemPrompts(sp.count, sp.blocks, sp.block_tokens, sp.zipf_s) if sp else None
        return FleetSpec(f.model, pools, f.router, f.decode_router, f.link_gbps, system_prompts=prompts, seed=self.seed,
                         load=f.load, load_spread_s=f.load_spread)

    def controlplane_config(self, db_url: str, mode: str = "observe") -> FleetConfig:
        """The fleet file the control plane runs with against this scenario's fleet."""
        pools = [Pool(name=p.name, role=p.role, model=self.fleet.model, slo=p.slo,
                      replicas=Replicas(min=1, max=p.max_replicas or p.replicas * 2),
                      engine=Engine(profile=p.profile, speed=p.speed, decode_speed=p.decode_speed,
                                    gpu_type=p.gpu_type, kv_blocks=p.engine_kv_blocks,
                                    max_num_seqs=p.max_num_seqs, max_batched_tokens=p.max_batched_tokens, gpus=p.gpus,
                                    kv_cache_dtype=p.kv_cache_dtype, expert_parallel=p.moe is not None,
                                    eplb=p.eplb is not None,
                                    speculative=Speculative(method=p.spec.method,
                                                            num_speculative_tokens=p.spec.num_speculative_tokens)))
                 for p in self.fleet.pools]
        # Each simulated engine has a node of its own, named after it (see exporters.node_of).
        policies = Policies(ep_imbalance=EpImbalanceSettings(pod_host="node-{pod}"),
                            gpu_health=GpuHealthSettings(pod_host="node-{pod}"))
        # Scaling is as fast as in the autoscaling evaluation; the remedies keep a cooldown of their own.
        return FleetConfig(mode=Mode(mode), store=Store(url=db_url), pools=pools, policies=policies,
                           scrape=Scrape(interval=self.scrape_interval, timeout=2.0, spread=0.0),
                           rails=Rails(cooldown=600.0, cooldowns={ActionKind.SCALE_POOL: 60.0}, max_step=SCALE_STEP,
                                       max_actions_per_hour=20, verify_after=600.0))

    def truth_windows(self) -> list[tuple[float, float, Truth]]:
        """(onset, end, truth) for every fault's every truth, times from the start of the run."""
        return [(f.at, f.end or self.duration, t) for f in self.faults for t in f.truth]


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a scenario file by path."""
    path = Path(name_or_path)
    here: Path | None = None  # the folder a user's scenario file lies in
    if path.suffix in (".yaml", ".yml") and path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(str(path), [f"cannot read the scenario file ({exc})"]) from None
        source, here = str(path), path.resolve().parent
    else:
        shipped = resources.files("controlplane.sim").joinpath("scenarios", f"{name_or_path}.yaml")
        if not shipped.is_file():
            known = ", ".join(sorted(builtin_scenarios()))
            raise ConfigError(name_or_path, [f"no such scenario file or shipped scenario; shipped: {known}"])
        text, source = shipped.read_text(encoding="utf-8"), f"scenarios/{name_or_path}.yaml"
    scenario = parse_yaml(text, Scenario, source)
    if here is not None:
        scenario = _resolve_paths(scenario, here)
    return scenario.model_copy(update={"source": source})


def _beside(value: str | None, here: Path) -> str | None:
    if value is None or Path(value).is_absolute() or not (here / value).exists():
        return value
    return str(here / value)


def _resolve_paths(scenario: Scenario, here: Path) -> Scenario:
    """A user's trace and profiles lie beside the scenario that names them, wherever the command runs."""
    trace = scenario.trace
    if trace.path is not None and not Path(trace.path).is_absolute():
        trace = trace.model_copy(update={"path": str(here / trace.path)})
    pools = [p.model_copy(update={"profile": _beside(p.profile, here)}) for p in scenario.fleet.pools]
    fleet = scenario.fleet.model_copy(update={"pools": pools})
    return scenario.model_copy(update={"trace": trace, "fleet": fleet})


def builtin_scenarios() -> list[str]:
    """Names of the scenarios shipped with the package."""
    folder = resources.files("controlplane.sim").joinpath("scenarios")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


class FaultTimeline:
    """A scenario's faults on a fleet as time passes: each made at its `at`, undone at its `end`, in time order."""

    def __init__(self, faults: list[Fault], t0: float) -> None:
        self.t0 = t0
        self._pending = sorted(faults, key=lambda f: f.at)
        self._undo: list[tuple[float, Fault, Callable[[], Any]]] = []

    def advance(self, fleet: SimFleet, now: float) -> list[tuple[float, Fault, bool]]:
        """Start and end what is due by `now` (the fleet simulated up to each moment first); returns what happened
        as (seconds since t0, fault, started)."""
        events: list[tuple[float, Fault, bool]] = []
        while self._pending and self.t0 + self._pending[0].at <= now:
            fault = self._pending.pop(0)
            fleet.advance_to(self.t0 + fault.at)
            end = self.t0 + (fault.end if fault.end is not None else math.inf)
            self._undo.append((end, fault, apply_fault(fleet, fault)))
            events.append((fault.at, fault, True))
        for item in sorted(self._undo, key=lambda u: u[0]):
            if item[0] <= now:
                fleet.advance_to(item[0])
                item[2]()
                self._undo.remove(item)
                events.append((item[0] - self.t0, item[1], False))
        return events


def apply_fault(fleet: SimFleet, fault: Fault) -> Any:
    """Make the fault's change; returns a callable that undoes it."""
    p, kind = fault.params, fault.kind
    if kind == "router_flip":
        before = fleet.router_kind
        fleet.set_router(p.get("router", "round_robin"))
        return lambda: fleet.set_router(before)
    if kind == "system_prompt":
        if p.get("unique", False):
            # A per-request value (a timestamp, a request id) at the top of the system prompt:
            # no two prompts share a first block, so nothing after it can hit either.
            fleet.unique_prefix = True
            return lambda: setattr(fleet, "unique_prefix", False)
        fleet.prompt_generation += 1
        return lambda: None  # new shared prompts: the caches warm up to them
    if kind == "prompt_scale":
        fleet.prompt_scale = float(p.get("factor", 3.0))
        return lambda: setattr(fleet, "prompt_scale", 1.0)
    if kind == "class_mix":
        before_mix = dict(fleet.class_mix)
        fleet.class_mix = {str(k): float(v) for k, v in p.get("mix", {"json": 0.6}).items()}
        return lambda: setattr(fleet, "class_mix", before_mix)
    if kind == "burst":
        base = fleet.rate_scale
        fleet.rate_scale = base * float(p.get("factor", 2.0))
        return lambda: setattr(fleet, "rate_scale", base)
    if kind == "canary":
        assert fault.pool is not None, "a canary names its pool"
        fleet.rollout(fault.pool, str(p.get("version", "canary")), float(p.get("share", 0.25)),
                      float(p.get("slowdown", 1.15)))
        return lambda: fleet.rollback(fault.pool or "")
    members = _targets(fleet, fault)
    if kind == "hot_expert":
        for m in members:
            assert m.engine.moe is not None, f"{m.pod} serves no MoE model"
            m.engine.moe.make_hot(float(p.get("share", 0.3)))

        def cool() -> None:
            for m in members:
                assert m.engine.moe is not None
                m.engine.moe.reset_popularity()
        return cool
    if kind == "kv_lag":
        for m in members:
            m.transfer.slowdown = float(p.get("slowdown", 20.0))
            m.transfer.fail_share = float(p.get("fail_share", 0.0))

        def heal() -> None:
            for m in members:
                m.transfer.slowdown, m.transfer.fail_share = 1.0, 0.0
        return heal
    if kind == "slow_engine":
        for m in members:
            m.engine.slowdown = float(p.get("slowdown", 2.0))

        def recover() -> None:
            for m in members:
                m.engine.slowdown = 1.0
        return recover
    if kind == "gpu_xid":
        for m in members:
            m.gpu.xid = int(p.get("xid", 79))
            m.gpu.xid_count += 1
            m.gpu.ecc_dbe += float(p.get("ecc_dbe", 0))
            m.engine.slowdown = float(p.get("slowdown", 3.0))
            m.engine.error_share = float(p.get("error_share", 0.2))

        def replace_gpu() -> None:
            for m in members:
                m.gpu.xid, m.engine.slowdown, m.engine.error_share = 0, 1.0, 0.0
        return replace_gpu
    if kind == "gpu_thermal":
        for m in members:
            m.gpu.throttled = True
            m.engine.slowdown = float(p.get("slowdown", 1.4))

        def cool_down() -> None:
            for m in members:
                m.gpu.throttled, m.engine.slowdown = False, 1.0
        return cool_down
    raise ValueError(f"unknown fault kind {kind!r}")


def _targets(fleet: SimFleet, fault: Fault) -> list[Any]:
    if fault.pod is not None:
        return [fleet.member(fault.pod)]
    if fault.pool is not None:
        return list(fleet.members[fault.pool])
    raise ValueError(f"fault {fault.kind} needs a pool or a pod")
