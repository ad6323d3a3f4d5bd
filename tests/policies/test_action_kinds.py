"""Action kinds the policies propose: stable spellings, and the rails hold back those no actuator runs."""

from __future__ import annotations

import pytest

from controlplane.config import Mode, Rails
from controlplane.rails import RailsReason, check
from policies.types import ActionKind, PoolState, Proposal

POOL = PoolState("decode", "decode", 3, 3, 1, 6)


def test_spellings_are_stable() -> None:
    # They are stored in the audit log and used as metric labels.
    assert [k.value for k in ActionKind] == [
        "scale_pool", "drain_engine", "admission_control", "tune_speculation", "disable_speculation", "enable_eplb",
        "disable_eplb", "cordon_node",
    ]


@pytest.mark.parametrize("kind", [k for k in ActionKind if k is not ActionKind.SCALE_POOL])
@pytest.mark.parametrize("mode", [Mode.PROPOSE, Mode.ACT])
def test_kinds_without_an_actuator_are_held_back_not_recorded(kind: ActionKind, mode: Mode) -> None:
    for pool in (POOL, None):  # a cordon may name no pool at all
        decision = check(Proposal(kind, "" if pool is None else "decode", -1, "x"), pool, mode=mode, rails=Rails(),
                         history=[], now=0.0)
        assert decision.reason is RailsReason.NOT_SUPPORTED and not decision.may_record
        assert decision.target_replicas is None


def test_scaling_still_passes() -> None:
    decision = check(Proposal(ActionKind.SCALE_POOL, "decode", 1, "x"), POOL, mode=Mode.ACT, rails=Rails(), history=[],
                     now=0.0)
    assert decision.reason is RailsReason.ALLOWED and decision.target_replicas == 4
