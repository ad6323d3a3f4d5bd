"""The Deployment controller's proportional scaling, as the actuator predicts it: the worked example of
the Kubernetes documentation ("Proportional scaling"), scale-downs worked by hand from the same rules,
and properties over rollouts whose annotations are the controller's own."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controlplane.actuators.rollout_split import MAX_REPLICAS, max_surge, sizes_after

OLD = "2026-12-01T09:00:00Z"
NEW = "2026-12-01T10:00:00Z"


def deployment(replicas: int, surge: int | str = 3, unavailable: int | str = 2,
               strategy: str = "RollingUpdate") -> dict[str, Any]:
    spec: dict[str, Any] = {"replicas": replicas, "strategy": {"type": strategy}}
    if strategy == "RollingUpdate":
        spec["strategy"]["rollingUpdate"] = {"maxSurge": surge, "maxUnavailable": unavailable}
    return {"spec": spec, "status": {"replicas": 13}}


def rs(name: str, replicas: int, created: str, allowed: int | None = 13, revision: int | None = None
       ) -> dict[str, Any]:
    annotations = {"deployment.kubernetes.io/revision": str(revision or (2 if created == NEW else 1))}
    if allowed is not None:
        annotations[MAX_REPLICAS] = str(allowed)
    return {"metadata": {"name": name, "creationTimestamp": created, "annotations": annotations},
            "spec": {"replicas": replicas}}


def test_the_documented_example() -> None:
    # 10 replicas, maxSurge 3, maxUnavailable 2, a rollout stuck at 8 old and 5 new, scaled to 15:
    # "3 replicas to the old ReplicaSet and 2 to the new one".
    sets = [rs("new", 5, NEW), rs("old", 8, OLD)]
    assert sizes_after(deployment(15), sets, 15) == {"old": 11, "new": 7}


def test_a_scale_down_mid_rollout_takes_from_each() -> None:
    sets = [rs("new", 5, NEW), rs("old", 8, OLD)]
    # maxSurge 3: 11 allowed of 13; old: round(8 * 11 / 13) = 7, new: round(5 * 11 / 13) = 4.
    assert sizes_after(deployment(8), sets, 8) == {"old": 7, "new": 4}
    # maxSurge 25 % of 8 is 2: 10 allowed; old: round(8 * 10 / 13) = 6, new: round(5 * 10 / 13) = 4.
    assert sizes_after(deployment(8, surge="25%"), sets, 8) == {"old": 6, "new": 4}
    # Equal sizes, 3 allowed of 6: each round(3 * 3 / 6) = 2, and the older gives up what rounding leaves.
    even = [rs("new", 3, NEW, 6), rs("old", 3, OLD, 6)]
    assert sizes_after(deployment(2, surge=1), even, 2) == {"old": 1, "new": 2}
    assert sizes_after(deployment(0), sets, 0) == {"old": 0, "new": 0}


def test_a_new_replicaset_above_the_count_is_trimmed_to_it() -> None:
    # Near the end of a rollout (maxUnavailable 0): 10 new and 2 old, 13 allowed. At 9, 12 are allowed and
    # nothing moves in proportion, but the controller's next pass takes the new ReplicaSet to 9: one engine goes.
    sets = [rs("new", 10, NEW), rs("old", 2, OLD)]
    assert sizes_after(deployment(9, unavailable=0), sets, 9) == {"old": 2, "new": 9}
    assert sizes_after(deployment(9, unavailable=0), [rs("new", 10, NEW), rs("old", 1, OLD)], 9) == {
        "old": 1, "new": 9}


def test_one_replicaset_or_another_strategy_takes_the_whole_change() -> None:
    assert sizes_after(deployment(2), [rs("new", 4, NEW), rs("old", 0, OLD)], 2) is None
    assert sizes_after(deployment(2, strategy="Recreate"), [rs("new", 4, NEW), rs("old", 2, OLD)], 2) is None
    assert max_surge(deployment(2, strategy="Recreate"), 2) == 0
    assert max_surge({"spec": {}}, 10) == 3, "the API's default, 25 %, rounded up"


def test_a_lost_annotation_falls_back_to_the_pods_there_are() -> None:
    sets = [rs("new", 5, NEW, None), rs("old", 8, OLD, None)]
    dep = deployment(8)
    dep["status"]["replicas"] = 16  # 11 allowed of 16: old round(8 * 11 / 16) = 6 takes all 2 to remove
    assert sizes_after(dep, sets, 8) == {"old": 6, "new": 5}


def test_a_new_template_not_yet_scaled_up_trims_none_of_the_active_ones() -> None:
    # r3 is the new ReplicaSet, still at 0 (the surge used up): r2 is an old one, and shrinks only in proportion.
    sets = [rs("r1", 3, OLD, 9), rs("r2", 6, NEW, 9), rs("r3", 0, NEW, None, revision=3)]
    # 4 + 3 allowed of 9: r2 round(6 * 7 / 9) = 5, r1 round(3 * 7 / 9) = 2.
    assert sizes_after(deployment(4), sets, 4) == {"r1": 2, "r2": 5}


def test_equal_replicasets_grow_newest_first() -> None:
    even = [rs("old", 3, OLD, 6), rs("new", 3, NEW, 6)]
    assert sizes_after(deployment(5, surge=2), even, 5) == {"old": 3, "new": 4}


@given(st.lists(st.integers(1, 40), min_size=2, max_size=4), st.integers(0, 60), st.integers(0, 5),
       st.sampled_from(["0%", "10%", "25%", "50%"]))
def test_the_sizes_add_up_to_what_the_deployment_allows(sizes: list[int], replicas: int, surge: int,
                                                         percent: str) -> None:
    for value in (surge, percent):
        dep = deployment(replicas, surge=value, unavailable=1)
        before = sum(sizes)  # the controller annotates each ReplicaSet with the count it last allowed
        sets = [rs(f"rs{i}", n, f"2026-12-01T0{i}:00:00Z", before, revision=i + 1) for i, n in enumerate(sizes)]
        after = sizes_after(dep, sets, replicas)
        assert after is not None and all(n >= 0 for n in after.values())
        newest = f"rs{len(sizes) - 1}"
        allowed = replicas + max_surge(dep, replicas) if replicas else 0
        assert after[newest] <= replicas
        if after[newest] < replicas and min(after.values()) > 0:
            # Neither trimmed nor clamped at 0 (what rounding leaves can exceed the largest's size, as upstream):
            # the proportions add up to what the Deployment allows.
            assert sum(after.values()) == allowed
        # Each moves the way the total does; only the newest is trimmed against it.
        if allowed >= before:
            assert all(after[f"rs{i}"] >= n for i, n in enumerate(sizes) if f"rs{i}" != newest)
        else:
            assert all(after[f"rs{i}"] <= n for i, n in enumerate(sizes))
