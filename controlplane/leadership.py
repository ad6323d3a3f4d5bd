"""Which control-plane replica may act: the interface the loop and the runtime ask, and the lone
replica's answer. The Lease that elects one of several is in `lease`."""

from __future__ import annotations

from typing import Protocol

__all__ = ["AlwaysLeader", "Leadership"]


class Leadership(Protocol):
    """Whether this replica may act, and the rounds that keep it so."""

    identity: str
    retry_period: float
    term: int  # how many times this replica has come to lead: one lost and won back may find others' work done

    def leading(self) -> bool:
        """True while this replica holds leadership; no API call."""
        ...

    async def contend(self) -> bool:
        """One round: take or renew leadership if it may; returns `leading()`."""
        ...

    async def release(self) -> None:
        """Give leadership up at a clean stop, so a follower need not wait for it to expire."""
        ...


class AlwaysLeader:
    """A single control plane: it always leads."""

    identity = "single"
    retry_period = 3600.0
    term = 0

    def leading(self) -> bool:
        return True

    async def contend(self) -> bool:
        return True

    async def release(self) -> None:
        return None
