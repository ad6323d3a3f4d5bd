"""The lifecycle of an action, shared by the rails, the loop and the store.

An action moves only along `TRANSITIONS`, and the store makes every move a conditional update
(`transition(id, expected, to)`): when two deciders race (a person rejects while the loop starts
the action), exactly one wins and the other learns the state it lost to.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

__all__ = ["ACTIVE_STATES", "FINISHED_STATES", "SCORED_STATES", "SIGNAL_OUTCOMES", "SLO_OUTCOMES", "TRANSITIONS",
           "ActionState", "IllegalTransition", "check_transition"]


class ActionState(StrEnum):
    """proposed -> approved -> started -> succeeded | failed | unknown | dry_run; or rejected, expired,
    cancelled; or advisory (observe mode)."""

    PROPOSED = "proposed"  # awaiting a person's approval (propose mode), or the rails' own (act mode)
    APPROVED = "approved"  # may run; the rails check it again when it does
    REJECTED = "rejected"  # a person said no
    EXPIRED = "expired"  # its finding resolved, or nobody decided within the rails' proposal_ttl
    CANCELLED = "cancelled"  # when it was due to run, the fleet no longer matched what was approved
    STARTED = "started"  # the actuator was called
    SUCCEEDED = "succeeded"  # the actuator changed the fleet
    FAILED = "failed"  # the actuator refused or raised; its message is kept
    UNKNOWN = "unknown"  # the process stopped while it ran; never retried blindly
    DRY_RUN = "dry_run"  # a dry-run actuator carried it out: nothing on the fleet changed
    ADVISORY = "advisory"  # observe mode: what `act` would have done now; never run, scored all the same


# Not finished yet: the rails treat these as in flight, and the database allows one per pool and kind.
ACTIVE_STATES = frozenset({ActionState.PROPOSED, ActionState.APPROVED, ActionState.STARTED})
FINISHED_STATES = frozenset(ActionState) - ACTIVE_STATES
# Finished actions whose outcome is judged after `rails.verify_after`: what was done, and what would
# have been (advisories, rejected and expired proposals: did the signal recover without it?), so a
# team sees how good the decisions are before it lets the control plane act.
SCORED_STATES = frozenset({ActionState.SUCCEEDED, ActionState.ADVISORY, ActionState.REJECTED, ActionState.EXPIRED})
# What a judging says: a remedy by its signal, a scale or cordon by its pool's SLOs; unmeasured where the numbers
# could not say.
SIGNAL_OUTCOMES = ("recovered", "not_recovered", "unmeasured")
SLO_OUTCOMES = ("held", "breached", "unmeasured")

TRANSITIONS: dict[ActionState, frozenset[ActionState]] = {
    ActionState.PROPOSED: frozenset({ActionState.APPROVED, ActionState.REJECTED, ActionState.EXPIRED,
                                     ActionState.ADVISORY}),
    ActionState.APPROVED: frozenset({ActionState.STARTED, ActionState.EXPIRED, ActionState.CANCELLED}),
    # Cancelled from started only by a take-over that finds it never applied and the rails not letting it run now.
    ActionState.STARTED: frozenset({ActionState.SUCCEEDED, ActionState.FAILED, ActionState.UNKNOWN,
                                    ActionState.DRY_RUN, ActionState.CANCELLED}),
    **{s: frozenset() for s in FINISHED_STATES},
}


class IllegalTransition(ValueError):
    """A move the lifecycle does not allow (a programming error, not a race)."""


def check_transition(expected: Iterable[ActionState], to: ActionState) -> None:
    """Raise IllegalTransition unless `to` is a legal next state from every state in `expected`."""
    froms = list(expected)
    if not froms:
        raise IllegalTransition(f"a transition to {to} needs at least one expected state")
    bad = [str(s) for s in froms if to not in TRANSITIONS[s]]
    if bad:
        raise IllegalTransition(f"an action cannot move from {', '.join(bad)} to {to}")
