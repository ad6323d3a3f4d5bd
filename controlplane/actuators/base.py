"""The actuator and target-source interfaces the loop depends on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from collectors.types import Target

__all__ = ["Actuator", "PoolReplicas", "StaticTargets", "TargetSource"]


@dataclass(frozen=True, slots=True)
class PoolReplicas:
    """Replicas a pool should have and how many are ready."""

    desired: int
    ready: int


class Actuator(Protocol):
    """Reads and changes the fleet's shape. Raises ActuationError when a change fails.

    `name` is recorded on every action it carries out; a `dry_run` actuator changes nothing, and
    its actions end as `dry_run`, never `succeeded`.
    """

    name: str
    dry_run: bool

    async def observe(self) -> dict[str, PoolReplicas]:
        """Current replicas per pool."""
        ...

    async def scale(self, pool: str, replicas: int) -> None:
        """Set a pool's desired replicas."""
        ...


class TargetSource(Protocol):
    """Where the loop learns which endpoints to scrape this tick."""

    async def targets(self) -> Sequence[Target]:
        """The current scrape targets."""
        ...


class StaticTargets:
    """A fixed target list, from the fleet file."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self._targets = list(targets)

    async def targets(self) -> Sequence[Target]:
        return self._targets
