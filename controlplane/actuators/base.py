"""The actuator and target-source interfaces the loop depends on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from collectors.types import Target
from policies.types import ActionKind, Change

__all__ = ["ALL_KINDS", "Actuator", "FleetView", "Order", "PoolReplicas", "Releases", "StaticTargets", "TargetSource"]

ALL_KINDS = frozenset(ActionKind)


@dataclass(frozen=True, slots=True)
class PoolReplicas:
    """Replicas a pool should have and how many are ready, and how many may restart at once."""

    desired: int
    ready: int
    max_unavailable: int | None = None  # the workload's rollout budget; None where it has none
    gang: int = 1  # engines restarted together when any one is (a LeaderWorkerSet group's size)
    # A new pod template is still rolling out: old pods serve beside new ones (a maxSurge rollout keeps them ready),
    # or the controller has not caught up with the spec yet.
    rolling: bool = False
    # A digest of the pod template its engines run: an approved restart computed for another template is stale.
    # None where the actuator cannot tell.
    template: str | None = None
    # Another controller that sets the replica count (a HorizontalPodAutoscaler, KEDA's among them): scaling it too
    # would fight it. None where there is none, or the actuator cannot tell.
    scaled_by: str | None = None


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the actuator sees of the fleet: its pools, and when each workload last changed revision."""

    pools: Mapping[str, PoolReplicas]
    changed_at: Mapping[str, float] = field(default_factory=dict)  # "router" or a pool -> unix time
    # Pools whose workload could not be read now, with why: nothing acts on them until it can be.
    unreadable: Mapping[str, str] = field(default_factory=dict)
    router_template: str | None = None  # the digest of the router's pod template, where there is one to read


@dataclass(frozen=True, slots=True)
class Order:
    """One action for the actuator to carry out, as the rails allowed it, with the loop's view of the
    work in flight on each of the pool's engines (to drain the least busy, and to know when one is idle)."""

    action_id: int
    kind: ActionKind
    pool: str
    change: Change
    reason: str
    busy: Mapping[str, float] = field(default_factory=dict)  # pod -> requests running or waiting at a fresh scrape
    # The pool's engine pods whose /metrics still answer (a single failed scrape is noise); None where
    # the source cannot tell (Prometheus keeps no per-target health for us).
    answering: frozenset[str] | None = None
    created_at: float = 0.0  # when the action was created: with its id, what the fleet is stamped with
    # The pods that report requests at all (fresh or not): one missing from `busy` is late, one not here reports none
    # (a Ray worker of a gang runs no vLLM server).
    counted: frozenset[str] = frozenset()
    # What the change was approved against, as the rails checked it: the pool's engines before a scale, and the digest
    # of the pod template a rollback or an engine-flag change rests on. An actuator that reads the workload changed
    # since (someone scaled or rolled back by hand, a write of theirs won a conflict) does not make it. None: unknown.
    from_replicas: int | None = None
    from_template: str | None = None

    @property
    def stamp(self) -> str:
        """The action as the objects it changes carry it: its id and creation second, so that a store started
        afresh (ids from 1 again) never reads an earlier store's action 7 as its own."""
        return f"{self.action_id}@{self.created_at:.0f}"

    def idle(self, pod: str) -> bool:
        """Whether `pod` has nothing left to finish: a fresh count of 0, or it stopped answering (its
        target down, the pod gone). A count that is only late is not idle: that would act on stale numbers."""
        if pod in self.busy:
            return self.busy[pod] <= 0.0
        return self.answering is not None and pod not in self.answering


class Actuator(Protocol):
    """Reads and changes the fleet. Raises ActuationError when a change fails, with the reason.

    `name` is recorded on every action it carries out; `kinds` are the actions it can carry out
    (the rails hold back the others); a `dry_run` actuator changes nothing, and its actions end as
    `dry_run`, never `succeeded`.
    """

    name: str
    dry_run: bool
    kinds: frozenset[ActionKind]

    async def observe(self) -> FleetView:
        """The pools' replicas and the workloads' revisions now; a pool whose workload cannot be read is listed
        in `unreadable` and the others still come back."""
        ...

    async def carry_out(self, order: Order) -> dict[str, Any]:
        """Make the change; returns what was done (objects touched) for the audit log.

        A change that must wait (an engine finishing its requests before it goes) returns a `wait`
        entry; the loop then calls `resume` each tick with fresh numbers until no `wait` comes back.
        """
        ...

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        """Take a waiting change further; returns its detail, with `wait` while it still waits."""
        ...

    async def applied(self, order: Order) -> Mapping[str, Any] | bool | None:
        """Whether the fleet already carries this order's change: True, or what the change reported when it was
        made where the fleet kept that (the speculation it replaced, which a revert sets back); False where it does
        not; None where it cannot tell.

        A control plane that took over from one that stopped mid-action asks this before it acts
        again, so the change is made once.
        """
        ...


@runtime_checkable
class Releases(Protocol):
    """An actuator whose changes begin before they are made (engines taken out of routing to drain): what a stopped
    control plane began of one that is then not carried out can be undone."""

    async def release(self, order: Order) -> str:
        """Undo what was begun of `order` (its engines routed again); says what, or that there was nothing."""
        ...


class TargetSource(Protocol):
    """Where the loop learns which endpoints to scrape this tick."""

    @property
    def stale(self) -> bool:
        """Whether the last list served is an older one, kept because the source of truth fails to answer."""
        ...

    async def targets(self) -> Sequence[Target]:
        """The current scrape targets."""
        ...


class StaticTargets:
    """A fixed target list, from the fleet file."""

    stale = False  # the fleet file's list is always the one configured

    def __init__(self, targets: Sequence[Target]) -> None:
        self._targets = list(targets)

    async def targets(self) -> Sequence[Target]:
        return self._targets
