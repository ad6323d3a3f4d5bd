"""The lifecycle of an action, shared by the rails, the loop and the store."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ACTIVE_STATES", "ActionState"]


class ActionState(StrEnum):
    """proposed -> approved -> started -> succeeded | failed | unknown; or rejected / expired."""

    PROPOSED = "proposed"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"  # its finding resolved before anyone approved it
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"  # the process stopped while it ran; never retried blindly


# Not finished yet: the rails treat these as in flight.
ACTIVE_STATES = frozenset({ActionState.PROPOSED, ActionState.APPROVED, ActionState.STARTED})
