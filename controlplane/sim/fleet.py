"""The simulated fleet: pools of engines, routers, the prefill->decode KV handoff, faults and actions.

Requests from a trace enter the prefill (or unified) pool through a router; a prefill worker
computes the prompt and hands its KV to a decode worker over a link of fixed bandwidth, queueing
behind that worker's other transfers. `advance_to(t)` moves every engine forward; between two
calls the fleet takes actions (scale, EPLB, speculation, canary rollout, rollback) and faults
(router flips, new prompts, hot experts, lagging links, GPU errors). Deterministic for a seed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import count

import numpy as np

from catalog.fleet import Role
from controlplane.sim.engine import EngineConfig, Hist, SimEngine, SimRequest
from controlplane.sim.moe import EplbConfig, ExpertParallel, MoeSpec
from controlplane.sim.perf import DYNAMO_PROFILE, PerfModel, load_model
from controlplane.sim.routing import ROUTERS, Router, RouterKind
from controlplane.sim.speculation import SpecConfig
from controlplane.sim.traces import Request

__all__ = ["FleetSpec", "GpuState", "Member", "PoolSpec", "SimFleet", "SystemPrompts", "Transfer"]

SYSTEM_PROMPT_BASE = 1 << 40  # synthetic block hashes live far above any trace's


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool of identical engines."""

    name: str
    role: Role
    replicas: int
    profile: str = DYNAMO_PROFILE
    speed: float = 1.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    decode_speed: float | None = None  # decode steps' speed factor when it differs from `speed`
    spec: SpecConfig = field(default_factory=SpecConfig)
    moe: MoeSpec | None = None
    eplb: EplbConfig | None = None
    startup_s: float = 120.0  # from scale-up to serving: pull the image, load weights, warm up


@dataclass(frozen=True, slots=True)
class SystemPrompts:
    """Shared prompt prefixes for traces that carry no block hashes (Azure, ServeGen)."""

    count: int = 24
    blocks: int = 4
    block_tokens: int = 256
    zipf_s: float = 1.1


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The whole simulated fleet."""

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    pools: tuple[PoolSpec, ...] = ()
    router: RouterKind = RouterKind.CACHE_AWARE
    decode_router: RouterKind = RouterKind.LEAST_LOADED
    link_gbps: float = 400.0  # per decode worker: one 400 Gb/s NIC per GPU, as H100/H200 nodes have
    link_latency_s: float = 0.002
    system_prompts: SystemPrompts | None = None
    seed: int = 7
    load: float = 1.0  # every trace arrival counted this many times on average: a trace at a multiple of its load
    # The copies of one arrival come in uniformly over this many seconds after it. At 0 they come at the same
    # instant: a trace at 20x its load arrives in bursts of 20 prompts, which a prefill-only engine queues as
    # one long prompt, unlike 20x as many users would.
    load_spread_s: float = 0.0


# vLLM's NIXL connector histograms (seconds) and NIXL's telemetry exporter (microseconds).
NIXL_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BOUNDS = tuple(float(2**k) for k in range(20, 36, 2))  # 1 MiB .. 32 GiB per transfer
NIXL_US_BOUNDS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
                  1000000)


@dataclass(slots=True)
class Transfer:
    """NIXL statistics of one decode worker's incoming KV transfers."""

    count: float = 0.0
    failed: float = 0.0
    bytes: float = 0.0
    xfer: Hist = field(default_factory=lambda: Hist(NIXL_SECONDS_BOUNDS))
    post: Hist = field(default_factory=lambda: Hist(NIXL_SECONDS_BOUNDS))
    xfer_us: Hist = field(default_factory=lambda: Hist(NIXL_US_BOUNDS))
    post_us: Hist = field(default_factory=lambda: Hist(NIXL_US_BOUNDS))
    sizes: Hist = field(default_factory=lambda: Hist(NIXL_BYTES_BOUNDS))
    link_free_at: float = 0.0
    slowdown: float = 1.0  # a lagging worker's NIC or a congested link
    fail_share: float = 0.0


@dataclass(slots=True)
class GpuState:
    """What dcgm-exporter reports beyond activity for the GPUs of one engine."""

    xid: int = 0
    xid_count: float = 0.0
    ecc_dbe: float = 0.0
    ecc_sbe: float = 0.0
    thermal_violation_s: float = 0.0
    throttled: bool = False
    energy_j: float = 0.0
    last_busy_s: float = 0.0
    last_t: float = 0.0
    utilization: float = 0.0

    def power_w(self, activity: float) -> float:
        """Power draw of one GPU whose share of the engine's work is `activity` (1.0: an even share)."""
        return 120.0 + 530.0 * self.utilization * activity


@dataclass(eq=False)
class Member:
    """An engine's place in the fleet: serving state, version and side channels."""

    engine: SimEngine
    role: Role
    ready_at: float
    version: str = "stable"
    draining: bool = False
    transfer: Transfer = field(default_factory=Transfer)
    gpu: GpuState = field(default_factory=GpuState)
    urls: dict[str, str] = field(default_factory=dict)
    inflight: int = 0  # KV transfers on their way to this decode worker
    asked_at: float = 0.0  # when the fleet asked for it: its GPU is held from then
    gone_at: float | None = None  # when it left the fleet, drained

    @property
    def load(self) -> int:
        """Requests in the engine or on their way to it, as a router that tracks its own sends counts."""
        return self.engine.load + self.inflight

    def rank_activity(self) -> list[float]:
        """Each GPU's share of the work relative to an even split: the hot experts' rank works more."""
        e = self.engine
        return e.moe.rank_activity() if e.moe is not None else [1.0] * len(e.ranks)

    @property
    def pod(self) -> str:
        """The engine's pod name."""
        return self.engine.pod

    @property
    def pool(self) -> str:
        """The engine's pool."""
        return self.engine.pool


class SimFleet:
    """Engines grouped in pools; `advance_to(t)` moves the whole fleet forward to time `t`."""

    def __init__(self, spec: FleetSpec, requests: Iterable[Request], *, now: float = 0.0,
                 refresh_s: float = 1.0) -> None:
        if not spec.pools:
            raise ValueError("a fleet needs at least one pool")
        self.spec = spec
        self.now = self.t0 = now
        self.refresh_s = refresh_s
        self.rng = np.random.default_rng(spec.seed)
        self._requests: Iterator[Request] = iter(requests)
        self._next: Request | None = next(self._requests, None)
        self._spread: list[tuple[float, int, SimRequest]] = []  # copies of arrivals not yet due
        self._events: list[tuple[float, int, SimRequest, Member]] = []  # KV landing on a decode worker
        self._handoffs: list[tuple[float, int, SimEngine, SimRequest]] = []
        self._seq = count()
        self._rid = count()
        self._serial: dict[str, int] = {}
        self._models: dict[str, PerfModel] = {}
        self.members: dict[str, list[Member]] = {p.name: [] for p in spec.pools}
        # Engines drained and gone, in order, until a meter takes them (`take_departed`); None: no meter reads them.
        self._departed: list[tuple[str, Member]] | None = None
        self.pool_specs = {p.name: p for p in spec.pools}
        self.desired = {p.name: p.replicas for p in spec.pools}
        self.routers: dict[str, Router] = {}
        self.router_kind = RouterKind(spec.router)
        # The router is a workload with revisions: a config push is a new one, a rollback restores the last.
        self.router_revisions: list[tuple[float, RouterKind]] = [(now, self.router_kind)]
        # When a workload last got a new revision; the first one is not a change, so nothing is listed yet.
        self.changed_at: dict[str, float] = {}
        # Traffic knobs the scenarios turn.
        self.prompt_generation = 0  # bump for a new set of system prompts
        self.prompt_scale = 1.0  # longer prompts: KV pressure
        self.class_mix: dict[str, float] = {}  # traffic class -> share of requests forced into it
        self.rate_scale = spec.load
        self.unique_prefix = False
        self.arrived = self.completed = 0
        self._sp_cum = self._system_prompt_cdf()
        for pool in spec.pools:
            self._set_router(pool.name)
            for _ in range(pool.replicas):
                self._add(pool, ready_at=now)

    # shape -----------------------------------------------------------------------------------

    def _model(self, pool: PoolSpec) -> PerfModel:
        key = f"{pool.profile}@{pool.speed}/{pool.decode_speed}"
        if key not in self._models:
            self._models[key] = load_model(pool.profile, pool.speed, pool.decode_speed)
        return self._models[key]

    def _add(self, pool: PoolSpec, ready_at: float, version: str = "stable",
             slowdown: float = 1.0) -> Member:
        n = self._serial.get(f"{pool.name}/{version}", 0)
        self._serial[f"{pool.name}/{version}"] = n + 1
        pod = f"{pool.name}-{n}" if version == "stable" else f"{pool.name}-{version}-{n}"
        config = replace(pool.engine, prefill_only=pool.role is Role.PREFILL,
                         ranks=pool.moe.ranks if pool.moe else pool.engine.ranks)
        moe = ExpertParallel(pool.moe, pool.eplb) if pool.moe else None
        engine = SimEngine(pool.name, pod, self._model(pool), config, now=self.now, spec=pool.spec, moe=moe,
                           on_prefilled=self._handoff)
        engine.slowdown = slowdown
        member = Member(engine, pool.role, ready_at, version, asked_at=self.now)
        member.transfer.link_free_at = self.now
        member.gpu.last_t = self.now
        self.members[pool.name].append(member)
        return member

    def ready(self, pool: str) -> list[Member]:
        """Engines of a pool that take new requests now."""
        return [m for m in self.members[pool] if m.ready_at <= self.now and not m.draining]

    def serving(self) -> list[Member]:
        """Every engine that is up (ready, draining included): what exporters serve."""
        return [m for ms in self.members.values() for m in ms if m.ready_at <= self.now]

    def engines(self) -> list[SimEngine]:
        """Every engine that is up."""
        return [m.engine for m in self.serving()]

    def member(self, pod: str) -> Member:
        """The engine named `pod`."""
        for ms in self.members.values():
            for m in ms:
                if m.pod == pod:
                    return m
        raise KeyError(f"no engine named {pod!r}")

    def _entry_pools(self) -> list[str]:
        """Where requests enter: the prefill pool if there is one, else the unified pools."""
        prefill = [p.name for p in self.spec.pools if p.role is Role.PREFILL]
        return prefill or [p.name for p in self.spec.pools if p.role is Role.UNIFIED]

    def _decode_pools(self) -> list[str]:
        return [p.name for p in self.spec.pools if p.role is Role.DECODE]

    def _set_router(self, pool: str) -> None:
        spec = self.pool_specs[pool]
        kind = self.spec.decode_router if spec.role is Role.DECODE else self.router_kind
        self.routers[pool] = ROUTERS[kind]()

    # actions --------------------------------------------------------------------------------

    def scale(self, pool: str, replicas: int) -> None:
        """Set a pool's replicas, a canary's engines included (as a Deployment counts its old and new pods):
        new engines run the stable version and serve after the startup time; removed ones drain, stable first."""
        spec = self.pool_specs[pool]
        self.desired[pool] = replicas
        live = [m for m in self.members[pool] if not m.draining]
        for _ in range(replicas - len(live)):
            self._add(spec, ready_at=self.now + spec.startup_s)
        surplus = sorted(live, key=lambda m: (m.version == "stable", m.ready_at), reverse=True)
        for m in surplus[: max(0, len(live) - replicas)]:
            m.draining = True

    def set_router(self, kind: RouterKind | str) -> None:
        """Push a new router configuration (a fault when it leaves cache-aware): a new router revision."""
        try:
            new = RouterKind(kind)
        except ValueError:
            raise ValueError(f"unknown router {kind!r}; known: {', '.join(RouterKind)}") from None
        self.router_revisions.append((self.now, new))
        self._use_router(new)

    def rollback_router(self) -> RouterKind:
        """Return the router to its previous revision; ValueError when it has none."""
        if len(self.router_revisions) < 2:
            raise ValueError("the router has no previous revision to roll back to")
        self.router_revisions.pop()
        previous = self.router_revisions[-1][1]
        self._use_router(previous)
        return previous

    def _use_router(self, kind: RouterKind) -> None:
        self.router_kind = kind
        self.changed_at["router"] = self.now
        for pool in self._entry_pools():
            self._set_router(pool)

    def replace(self, pod: str) -> str:
        """Drain engine `pod` (no new requests; it leaves once idle) and start a fresh one in its place."""
        m = self.member(pod)
        if m.draining:
            raise ValueError(f"{pod} is draining already")
        m.draining = True
        spec = self.pool_specs[m.pool]
        return self._add(spec, ready_at=self.now + spec.startup_s, version=m.version).pod

    def set_eplb(self, pool: str, eplb: EplbConfig | None) -> None:
        """Enable, retune or disable EPLB on every engine of an MoE pool."""
        if self.pool_specs[pool].moe is None:
            raise ValueError(f"pool {pool!r} serves no MoE model: EPLB does not apply")
        self.pool_specs[pool] = replace(self.pool_specs[pool], eplb=eplb)
        self.changed_at[pool] = self.now
        for m in self.members[pool]:
            assert m.engine.moe is not None
            m.engine.moe.set_eplb(eplb)

    def set_speculation(self, pool: str, spec: SpecConfig) -> None:
        """Change a pool's speculative config (engines restart with it in vLLM; here at once)."""
        self.pool_specs[pool] = replace(self.pool_specs[pool], spec=spec)
        self.changed_at[pool] = self.now
        for m in self.members[pool]:
            m.engine.spec = spec
            for stats in m.engine.ranks:
                if len(stats.per_pos) < spec.num_speculative_tokens:
                    stats.per_pos += [0.0] * (spec.num_speculative_tokens - len(stats.per_pos))

    def rollout(self, pool: str, version: str, share: float, slowdown: float = 1.0) -> list[str]:
        """Replace `share` of a pool's engines with `version` (its step times times `slowdown`)."""
        spec = self.pool_specs[pool]
        stable = [m for m in self.members[pool] if not m.draining and m.version == "stable"]
        n = max(1, round(share * len(stable)))
        self.changed_at[pool] = self.now
        pods = []
        for m in stable[-n:]:
            m.draining = True
            pods.append(self._add(spec, ready_at=self.now + spec.startup_s, version=version, slowdown=slowdown).pod)
        return pods

    def rollback(self, pool: str) -> None:
        """Drain every non-stable engine of a pool and restore the stable replica count."""
        spec = self.pool_specs[pool]
        canaries = [m for m in self.members[pool] if m.version != "stable" and not m.draining]
        self.changed_at[pool] = self.now
        for m in canaries:
            m.draining = True
        live = [m for m in self.members[pool] if not m.draining and m.version == "stable"]
        for _ in range(self.desired[pool] - len(live)):
            self._add(spec, ready_at=self.now + spec.startup_s)

    # time -----------------------------------------------------------------------------------

    def advance_to(self, t: float) -> None:
        """Simulate every arrival, handoff and engine iteration up to time `t`.

        In windows of `refresh_s`: arrivals are routed and the entry pools run to the window's
        end; the prompts they finished hand off in time order, so each decode worker's link
        queues its transfers as they happened; then the decode pools run, taking each KV at
        the time it lands.
        """
        while self.now < t:
            stop = min(t, self.now + self.refresh_s)
            self._arrivals_until(stop)
            decode = set(self._decode_pools())
            for pool, ms in self.members.items():
                if pool not in decode:
                    for m in ms:
                        if m.ready_at <= stop:
                            m.engine.run_until(stop)
            # An engine's last iteration may end past `stop`; its handoffs wait for their window,
            # or they would hold a link busy ahead of earlier transfers.
            self._handoffs.sort(key=lambda h: (h[0], h[1]))
            due = [h for h in self._handoffs if h[0] <= stop]
            del self._handoffs[: len(due)]
            for t_done, _, engine, req in due:
                self._transfer(engine, req, t_done)
            while self._events and self._events[0][0] <= stop:
                te, _, req, member = heapq.heappop(self._events)
                self._deliver(req, member, te)
            for pool in decode:
                for m in self.members[pool]:
                    if m.ready_at <= stop:
                        m.engine.run_until(stop)
            self.now = stop
            self._sample_gpus()
            self._reap()

    def _sample_gpus(self) -> None:
        """Activity, energy and throttled time of every GPU over the window just simulated.

        Kept here, not in the exporter, so what dcgm-exporter shows does not depend on how often
        (or by how many scrapers) it is read; the default one-second window is DCGM's own sample period.
        """
        for ms in self.members.values():
            for m in ms:
                g, e = m.gpu, m.engine
                dt = self.now - g.last_t
                if dt <= 0:
                    continue
                g.utilization = min(1.0, (e.busy_s - g.last_busy_s) / dt)
                # An iteration that ends past the window puts its excess in this window's busy time: carried to the
                # next window, not clamped away (a saturated GPU read 0 % in the window after).
                g.last_busy_s, g.last_t = g.last_busy_s + g.utilization * dt, self.now
                g.energy_j += sum(g.power_w(a) for a in m.rank_activity()) * dt
                if g.throttled:  # clocks held down for most of the window
                    g.thermal_violation_s += 0.6 * dt

    def take_departed(self) -> list[tuple[str, Member]]:
        """The engines drained and gone since the last call, with their pools, in order: what they served and held
        since a meter's last look is still counted. Kept from the first call on, and only until taken (a day's churn
        of engines, each with its histograms, is memory)."""
        out, self._departed = self._departed or [], []
        return out

    def _reap(self) -> None:
        for pool, ms in self.members.items():
            gone = [m for m in ms if m.draining and m.engine.idle() and m.transfer.link_free_at <= self.now]
            if gone:
                self.members[pool] = [m for m in ms if m not in gone]
                for m in gone:
                    m.gone_at = self.now
                    m.engine.drop_cache()  # a day's churn of engines, each with its prefix cache, is memory
                    if self._departed is not None:
                        self._departed.append((pool, m))

    def _arrivals_until(self, stop: float) -> None:
        while self._next is not None and self.t0 + self._next.arrival_s <= stop:
            te = self.t0 + self._next.arrival_s
            trace_req = self._next
            self._next = next(self._requests, None)
            for req in self._admit(trace_req, te):
                heapq.heappush(self._spread, (req.arrival, req.rid, req))
        while self._spread and self._spread[0][0] <= stop:
            t, _, req = heapq.heappop(self._spread)
            self._route(req, t)

    def _admit(self, r: Request, t: float) -> list[SimRequest]:
        """Trace request -> engine requests, with the scenario's traffic knobs applied."""
        copies = int(self.rate_scale) + (1 if self.rng.random() < self.rate_scale % 1 else 0)
        out: list[SimRequest] = []
        for _ in range(copies):
            rid = next(self._rid)
            hash_ids, block_tokens, tokens = r.hash_ids, r.block_tokens, r.input_tokens
            if not hash_ids and self.spec.system_prompts is not None:
                sp = self.spec.system_prompts
                k = int(np.searchsorted(self._sp_cum, self.rng.random()))
                base = SYSTEM_PROMPT_BASE + (self.prompt_generation * sp.count + k) * sp.blocks
                hash_ids, block_tokens = tuple(range(base, base + sp.blocks)), sp.block_tokens
                tokens = max(tokens, sp.blocks * sp.block_tokens + 16)
            if self.unique_prefix and hash_ids:
                hash_ids = (-1 - rid, *hash_ids)
            if self.prompt_scale != 1.0:
                tokens = int(tokens * self.prompt_scale)
            cls = "code" if r.category == "code" else "text"
            u = (rid * 0.6180339887) % 1.0  # a low-discrepancy draw keeps class shares steady
            for name, share in self.class_mix.items():
                if u < share:
                    cls = name
                    break
                u -= share
            at = t + (self.rng.random() * self.spec.load_spread_s if out and self.spec.load_spread_s else 0.0)
            out.append(SimRequest(rid, at, max(1, tokens), max(1, r.output_tokens), hash_ids, block_tokens, cls))
            self.arrived += 1
        return out

    def _system_prompt_cdf(self) -> np.ndarray:
        sp = self.spec.system_prompts
        if sp is None:
            return np.ones(1)
        w = 1.0 / np.arange(1, sp.count + 1) ** sp.zipf_s
        return np.cumsum(w / w.sum())

    def _route(self, req: SimRequest, t: float) -> None:
        pools = self._entry_pools()
        candidates = [m for p in pools for m in self.ready(p)]
        if not candidates:
            return  # nothing serves: the request fails at the gateway
        member = self.routers[pools[0]].pick(req, candidates)
        member.engine.run_until(t)
        member.engine.submit(req)

    def _handoff(self, engine: SimEngine, req: SimRequest, t: float) -> None:
        """A prefill finished; its transfer is queued in time order once the window's prefills are known."""
        self._handoffs.append((t, next(self._seq), engine, req))

    def _transfer(self, engine: SimEngine, req: SimRequest, t: float) -> None:
        """Pick a decode worker and queue the KV transfer on its link."""
        decode = [m for p in self._decode_pools() for m in self.ready(p)]
        if not decode:
            return
        target = self.routers[self._decode_pools()[0]].pick(req, decode)
        tr = target.transfer
        size = req.input_tokens * engine.config.kv_bytes_per_token
        start = max(t, tr.link_free_at)
        wire = size * 8 / (self.spec.link_gbps * 1e9) * tr.slowdown
        done = start + self.spec.link_latency_s * tr.slowdown + wire
        tr.link_free_at = done
        tr.count += 1
        tr.bytes += size
        # NIXL's transfer time runs from the request's post, so it includes the queue behind earlier ones.
        post = 0.0002 * tr.slowdown
        for hist, scale in ((tr.xfer, 1.0), (tr.xfer_us, 1e6)):
            hist.observe((done - t) * scale)
        for hist, scale in ((tr.post, 1.0), (tr.post_us, 1e6)):
            hist.observe(post * scale)
        tr.sizes.observe(size)
        if tr.fail_share and self.rng.random() < tr.fail_share:
            tr.failed += 1
            return  # the request is lost with its KV: vLLM aborts it
        dreq = SimRequest(req.rid, req.arrival, req.input_tokens, req.output_tokens, req.hash_ids, req.block_tokens,
                          req.cls, remote_kv=True, handoff_at=done)
        target.inflight += 1
        heapq.heappush(self._events, (done, next(self._seq), dreq, target))

    def _deliver(self, req: SimRequest, member: Member, t: float) -> None:
        member.inflight -= 1
        # A draining worker serves the KV already sent to it (it is kept until it lands): dropped, the request
        # vanished with no error counted anywhere.
        member.engine.run_until(t)
        member.engine.submit(req)
