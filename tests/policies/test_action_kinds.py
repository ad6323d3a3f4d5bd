"""Action kinds and their typed changes: stable spellings, a change fit for its kind, and the audit log's form."""

from __future__ import annotations

import pytest

from policies.types import (
    CHANGES,
    ActionKind,
    Admit,
    Cordon,
    Drain,
    Eplb,
    Proposal,
    RollBack,
    ScaleBy,
    ScaleTo,
    Speculation,
    change_as_dict,
    change_from_dict,
)


def test_spellings_are_stable() -> None:
    # They are stored in the audit log and used as metric labels.
    assert [k.value for k in ActionKind] == [
        "scale_pool", "drain_engine", "admission_control", "tune_speculation", "disable_speculation", "enable_eplb",
        "disable_eplb", "cordon_node", "rollback",
    ]
    assert set(CHANGES) == set(ActionKind)


@pytest.mark.parametrize("change", [ScaleBy(-1), ScaleTo(5), Speculation(2), Speculation(step=-1), Speculation(0),
                                    Eplb(True, 500, 2000, 8), Eplb(False), RollBack("router"), Drain("decode-3"),
                                    Cordon("gpu-node-7"), Admit("decode-1", 0.25)])
def test_changes_survive_the_audit_log(change: object) -> None:
    stored = change_as_dict(change)  # type: ignore[arg-type]
    assert stored["type"] == type(change).__name__
    assert change_from_dict(stored) == change


def test_a_proposal_takes_the_change_its_kind_needs() -> None:
    Proposal(ActionKind.DISABLE_SPECULATION, "decode", Speculation(0), "x")
    with pytest.raises(TypeError, match="a scale_pool proposal takes a ScaleBy or ScaleTo change, not Drain"):
        Proposal(ActionKind.SCALE_POOL, "decode", Drain("decode-1"), "x")
    with pytest.raises(ValueError, match="unknown change type 'Teleport'"):
        change_from_dict({"type": "Teleport"})
    with pytest.raises(ValueError, match="either num_speculative_tokens or a non-zero step"):
        Speculation()


def test_a_relative_speculation_change_resolves_against_the_pool() -> None:
    assert Speculation(step=-1).resolve(3) == 2
    assert Speculation(step=-5).resolve(3) == 0  # never below off
    assert Speculation(4).resolve(1) == 4
