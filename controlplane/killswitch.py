"""The kill switch: one flag that stops all acting at once, read before every action runs.

`fleetctl pause --by NAME --reason TEXT` sets it in the store, which every control-plane replica
shares; `fleetctl resume` clears it. On Kubernetes the actuator also honours a ConfigMap flag,
so a cluster operator can stop the control plane with kubectl alone. While paused, detection,
alerts and proposals go on; approved actions wait, none starts.
"""

from __future__ import annotations

from typing import Protocol

from controlplane.store.base import Store

__all__ = ["AnySwitch", "KillSwitch", "NeverPaused", "StoreSwitch"]


class KillSwitch(Protocol):
    """Whether acting is paused, and why."""

    async def paused(self) -> str | None:
        """The reason acting is paused, or None when it is not."""
        ...


class NeverPaused:
    """A switch that is never on (tests and replays)."""

    async def paused(self) -> str | None:
        return None


class StoreSwitch:
    """The switch in the shared store (`fleetctl pause|resume`)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def paused(self) -> str | None:
        pause = await self.store.pause_state()
        return None if pause is None else f"paused by {pause.by}: {pause.reason}"


class AnySwitch:
    """Paused when any of its switches is."""

    def __init__(self, *switches: KillSwitch) -> None:
        self.switches = switches

    async def paused(self) -> str | None:
        for switch in self.switches:
            reason = await switch.paused()
            if reason is not None:
                return reason
        return None
