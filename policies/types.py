"""The typed inputs and outputs every policy shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from policies.windows import SignalWindows

__all__ = [
    "CHANGES",
    "ActionKind",
    "Admit",
    "Change",
    "Cordon",
    "Drain",
    "Eplb",
    "FindingKey",
    "FindingReport",
    "OpenFinding",
    "Policy",
    "PolicyInput",
    "PolicyResult",
    "PoolState",
    "Proposal",
    "RollBack",
    "ScaleBy",
    "ScaleTo",
    "Severity",
    "Speculation",
    "change_as_dict",
    "change_from_dict",
    "describe",
]


class Severity(StrEnum):
    """How urgently a person should look; alerts route on it."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class ActionKind(StrEnum):
    """Changes the control plane knows how to make to a fleet."""

    SCALE_POOL = "scale_pool"
    DRAIN_ENGINE = "drain_engine"  # take one engine out of routing, let it finish, have it replaced
    ADMISSION_CONTROL = "admission_control"  # limit new requests towards a worker
    TUNE_SPECULATION = "tune_speculation"  # change num_speculative_tokens of a pool
    DISABLE_SPECULATION = "disable_speculation"  # serve a pool without a speculative config
    ENABLE_EPLB = "enable_eplb"  # restart a pool's engines with --enable-eplb and an --eplb-config
    DISABLE_EPLB = "disable_eplb"  # restart a pool's engines without EPLB
    CORDON_NODE = "cordon_node"  # mark a node unschedulable and evict the engines running on it
    ROLLBACK = "rollback"  # return a workload (a pool's, or the router's) to its previous revision


# Typed changes: what an action does, in terms every actuator can carry out ----------------------


@dataclass(frozen=True, slots=True)
class ScaleBy:
    """Scale a pool by `delta` replicas; the rails clamp the step and the bounds into a `ScaleTo`."""

    delta: int


@dataclass(frozen=True, slots=True)
class ScaleTo:
    """Scale a pool to exactly `replicas`."""

    replicas: int


@dataclass(frozen=True, slots=True)
class Speculation:
    """Serve a pool with `num_speculative_tokens` per draft, or `step` more or fewer than now when that is
    None; its method unchanged. Zero tokens serves the pool without speculation."""

    num_speculative_tokens: int | None = None
    step: int = 0

    def __post_init__(self) -> None:
        if (self.num_speculative_tokens is None) == (self.step == 0):
            raise ValueError("give either num_speculative_tokens or a non-zero step")

    def resolve(self, current: int) -> int:
        """The number of speculative tokens this change leaves a pool that has `current` now."""
        n = self.num_speculative_tokens if self.num_speculative_tokens is not None else current + self.step
        return max(0, n)


@dataclass(frozen=True, slots=True)
class Eplb:
    """Serve an MoE pool with EPLB on (`--enable-eplb --eplb-config {...}`) or off."""

    enabled: bool
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0


@dataclass(frozen=True, slots=True)
class RollBack:
    """Return a workload to its previous revision: the pool's own, or the router in front of it (`router`)."""

    workload: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Take engine `pod` out of routing, let its work finish and have the pool replace it."""

    pod: str


@dataclass(frozen=True, slots=True)
class Cordon:
    """Stop scheduling on `node` and evict the engines on it, so the pool recreates them elsewhere."""

    node: str


@dataclass(frozen=True, slots=True)
class Admit:
    """Send only `share` of new requests towards worker `pod` (1.0 lifts the limit)."""

    pod: str
    share: float


Change = ScaleBy | ScaleTo | Speculation | Eplb | RollBack | Drain | Cordon | Admit

# Which change each kind of action takes.
CHANGES: dict[ActionKind, tuple[type, ...]] = {
    ActionKind.SCALE_POOL: (ScaleBy, ScaleTo),
    ActionKind.DRAIN_ENGINE: (Drain,),
    ActionKind.ADMISSION_CONTROL: (Admit,),
    ActionKind.TUNE_SPECULATION: (Speculation,),
    ActionKind.DISABLE_SPECULATION: (Speculation,),
    ActionKind.ENABLE_EPLB: (Eplb,),
    ActionKind.DISABLE_EPLB: (Eplb,),
    ActionKind.CORDON_NODE: (Cordon,),
    ActionKind.ROLLBACK: (RollBack,),
}
_BY_NAME: dict[str, type] = {t.__name__: t for types in CHANGES.values() for t in types}


def describe(change: Change) -> str:
    """A change in words, for the audit log and timelines."""
    match change:
        case ScaleBy(delta=d):
            return f"scale by {d:+d}"
        case ScaleTo(replicas=n):
            return f"scale to {n}"
        case Speculation(num_speculative_tokens=0):
            return "serve without speculative decoding"
        case Speculation(num_speculative_tokens=None, step=step):
            return f"{'raise' if step > 0 else 'lower'} num_speculative_tokens by {abs(step)}"
        case Speculation(num_speculative_tokens=n):
            return f"speculate {n} tokens per draft"
        case Eplb(enabled=True, window_size=w, step_interval=i, num_redundant_experts=r):
            return f"enable EPLB (window {w}, step interval {i}, {r} redundant experts)"
        case Eplb():
            return "disable EPLB"
        case RollBack(workload=w):
            return f"roll {'the router' if w == 'router' else w} back to its previous revision"
        case Drain(pod=p):
            return f"drain {p} and replace it"
        case Cordon(node=n):
            return f"cordon {n} and evict its engines"
        case Admit(pod=p, share=share):
            return f"send {share:.0%} of new requests to {p}"
    raise TypeError(f"not a change: {change!r}")


def change_as_dict(change: Change) -> dict[str, Any]:
    """A change as JSON-ready values (`type` names it), for the audit log."""
    return {"type": type(change).__name__, **{f: getattr(change, f) for f in change.__dataclass_fields__}}


def change_from_dict(data: Mapping[str, Any]) -> Change:
    """The change `change_as_dict` wrote; ValueError for anything else."""
    kind = _BY_NAME.get(str(data.get("type")))
    if kind is None:
        raise ValueError(f"unknown change type {data.get('type')!r}; known: {', '.join(sorted(_BY_NAME))}")
    fields = {k: v for k, v in data.items() if k != "type"}
    try:
        return kind(**fields)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ValueError(f"change {data.get('type')}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Proposal:
    """A change a policy asks for; the safety rails decide whether and how far it runs."""

    kind: ActionKind
    pool: str
    change: Change
    reason: str
    verify_signal: str | None = None  # pool signal expected to improve once the action took effect
    verify_lower_is_better: bool = True
    # Judged instead by whether its pool kept its SLOs while it stood: a scale made for the load improves no signal
    # that was within its objective, and judged as a remedy it would be reverted.
    verify_slo: bool = False
    inputs: tuple[str, ...] = ()  # the signals it rests on (the loop fills in the policy's `reads` when empty)

    def __post_init__(self) -> None:
        if not isinstance(self.change, CHANGES[self.kind]):
            allowed = " or ".join(t.__name__ for t in CHANGES[self.kind])
            raise TypeError(f"a {self.kind} proposal takes a {allowed} change, not {type(self.change).__name__}")


@dataclass(frozen=True, slots=True)
class FindingKey:
    """A finding's identity: one open finding per kind and subject."""

    kind: str
    subject: str


@dataclass(frozen=True, slots=True)
class FindingReport:
    """A policy's statement that a condition holds now, with its evidence."""

    key: FindingKey
    severity: Severity
    summary: str
    cause: str
    evidence: dict[str, Any]
    runbook: str
    proposals: tuple[Proposal, ...] = ()
    # A gate's verdict behind the finding (gate, baseline, canary and the judge's own fields), kept where
    # `fleetctl gate` keeps its verdicts when the finding opens.
    verdict: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class OpenFinding:
    """What a policy may know about a finding that is open: when it opened, what it saw then."""

    key: FindingKey
    opened_at: float
    evidence: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PoolState:
    """A pool as the actuator sees it, with its configured bounds."""

    name: str
    role: str
    desired: int
    ready: int
    min_replicas: int
    max_replicas: int
    ttft_p95_slo: float | None = None
    tpot_p95_slo: float | None = None
    max_unavailable: int | None = None  # engines a rollout of a new pod template may restart at once
    gang: int = 1  # engines restarted together (a LeaderWorkerSet group) when any one is
    # Inputs not fit to act on now, by signal name or producer (`vllm`, `dcgm`, ...), with why (see policies.inputs).
    stale_inputs: Mapping[str, str] = field(default_factory=dict)
    # Why the pool's workload could not be read this tick (its replicas are the last ones read); None: it was.
    unreadable: str | None = None
    rolling: bool = False  # a new pod template is still rolling out (engines restarting, with all ready or not)
    template: str | None = None  # a digest of the pod template its engines run (None: not known)
    # Seconds it has been short of ready engines, once that is `rails.settle_timeout` or more (None: not stalled).
    stalled_for: float | None = None
    scaled_by: str | None = None  # another controller that sets its replica count (an HPA), where there is one
    # Its engines spread a MoE model's experts over their ranks (--enable-expert-parallel): the only pools with experts
    # for EPLB to balance.
    expert_parallel: bool = False
    # Its workload recreates its pods under their names (a StatefulSet, a LeaderWorkerSet): a pod's new process may be
    # its rollout's, not a crash.
    keeps_names: bool = False

    @property
    def most_replicas(self) -> int:
        """The most replicas the pool can run: its maximum, in whole groups of a gang pool (a partial one serves
        none)."""
        g = max(1, self.gang)
        return self.max_replicas // g * g

    @property
    def slos(self) -> dict[str, float]:
        """The p95 objectives set on the pool, by the signal that measures each."""
        return {name: slo for name, slo in (("ttft_p95", self.ttft_p95_slo), ("tpot_p95", self.tpot_p95_slo))
                if slo is not None}


@dataclass(frozen=True, slots=True)
class PolicyInput:
    """Everything a policy may look at for one evaluation."""

    now: float
    windows: SignalWindows
    pools: Mapping[str, PoolState]
    open_findings: Mapping[FindingKey, OpenFinding]
    changed_at: Mapping[str, float] = field(default_factory=dict)  # "router" or a pool -> its last new revision


@dataclass(slots=True)
class PolicyResult:
    """Conditions that hold now, and open findings the policy declares resolved (with why).

    Open findings a policy mentions in neither list stay as they are (e.g. no data this tick).
    """

    findings: list[FindingReport] = field(default_factory=list)
    resolved: list[tuple[FindingKey, str]] = field(default_factory=list)


class Policy(Protocol):
    """A detector: one `kind` of finding, evaluated once per tick, over the signals it `reads`
    (names of `catalog.signals`; a family with a placeholder stands for all its members)."""

    kind: str
    reads: tuple[str, ...]

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """Evaluate on the given input; must not perform I/O or read the clock."""
        ...
