"""The typed inputs and outputs every policy shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from policies.windows import SignalWindows

__all__ = [
    "ActionKind",
    "FindingKey",
    "FindingReport",
    "OpenFinding",
    "Policy",
    "PolicyInput",
    "PolicyResult",
    "PoolState",
    "Proposal",
    "Severity",
]


class Severity(StrEnum):
    """How urgently a person should look; alerts route on it."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class ActionKind(StrEnum):
    """Changes the control plane knows how to make to a fleet."""

    SCALE_POOL = "scale_pool"
    DRAIN_ENGINE = "drain_engine"  # stop routing to one engine and let it finish its requests
    ADMISSION_CONTROL = "admission_control"  # limit new requests towards a pool or worker
    TUNE_SPECULATION = "tune_speculation"  # change num_speculative_tokens of a pool by `delta`
    DISABLE_SPECULATION = "disable_speculation"  # serve a pool without a speculative config
    ENABLE_EPLB = "enable_eplb"  # restart a pool's engines with --enable-eplb and an --eplb-config
    DISABLE_EPLB = "disable_eplb"  # restart a pool's engines without EPLB
    CORDON_NODE = "cordon_node"  # mark a node unschedulable and drain the engines running on it


@dataclass(frozen=True, slots=True)
class Proposal:
    """A change a policy asks for; the safety rails decide whether and how far it runs."""

    kind: ActionKind
    pool: str
    delta: int
    reason: str
    verify_signal: str | None = None  # pool signal expected to improve once the action took effect
    verify_lower_is_better: bool = True


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


@dataclass(frozen=True, slots=True)
class PolicyInput:
    """Everything a policy may look at for one evaluation."""

    now: float
    windows: SignalWindows
    pools: Mapping[str, PoolState]
    open_findings: Mapping[FindingKey, OpenFinding]


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
