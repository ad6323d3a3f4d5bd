"""The Deployment controller's proportional scaling, as the actuator predicts it: the worked example of
the Kubernetes documentation ("Proportional scaling"), scale-downs worked by hand from the same rules,
and properties over rollouts whose annotations are the controller's own."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controlplane.actuators.rollout_split import MAX_REPLICAS, max_surge, sizes_after


def deployment(replicas: int, surge: int | str = 3, unavailable: int | str = 2,
               strategy: str = "RollingUpdate") -> dict[str, Any]:
    spec: dict[str, Any] = {"replicas": replicas, "strategy": {"type": strategy}}
    if strategy == "RollingUpdate":
        spec["strategy"]["rollingUpdate"] = {"maxSurge": surge, "maxUnavailable": unavailable}
    return {"spec": spec, "status": {"replicas": 13}}


def rs(name: str, replicas: int, created: str, allowed: int | None = 13) -> dict[str, Any]:
    annotations = {} if allowed is None else {MAX_REPLICAS: str(allowed)}
    return {"metadata": {"name": name, "creationTimestamp": created, "annotations": annotations},
            "spec": {"replicas": replicas}}


OLD = "2026-12-01T09:00:00Z"
NEW = "2026-12-01T10:00:00Z"


def test_the_documented_example() -> None:
    # 10 replicas, maxSurge 3, maxUnavailable 2, a rollout stuck at 8 old and 5 new, scaled to 15:
    # "3 replicas to the old ReplicaSet and 2 to the new one".
    sets = [rs("new", 5, NEW), rs("old", 8, OLD)]
    assert sizes_after(deployment(15), sets, 15) == {"old": 11, "new": 7}


def test_a_scale_down_mid_rollout_takes_from_each() -> None:
    sets = [rs("new", 5, NEW), rs("old", 8, OLD)]
    # maxSurge 3: 11 allowed of 13; old: round(8 * 11 / 13) = 7, new: round(5 * 11 / 13) = 4.
    assert sizes_after(deployment(8), sets, 8) == {"old": 7, "new": 4}
    # maxSurge 25 % of 8 rounds up to 2: 10 allowed; old: round(8 * 10 / 13) = 6, new: round(5 * 10 / 13) = 4.
    assert sizes_after(deployment(8, surge="25%"), sets, 8) == {"old": 6, "new": 4}
    # Equal sizes, 3 allowed of 6: each round(3 * 3 / 6) = 2, and the older gives up what rounding leaves.
    even = [rs("new", 3, NEW, 6), rs("old", 3, OLD, 6)]
    assert sizes_after(deployment(2, surge=1), even, 2) == {"old": 1, "new": 2}
    assert sizes_after(deployment(0), sets, 0) == {"old": 0, "new": 0}


def test_one_replicaset_or_another_strategy_takes_the_whole_change() -> None:
    assert sizes_after(deployment(2), [rs("new", 4, NEW), rs("old", 0, OLD)], 2) is None
    assert sizes_after(deployment(2, strategy="Recreate"), [rs("new", 4, NEW), rs("old", 2, OLD)], 2) is None
    assert max_surge(deployment(2, strategy="Recreate"), 2) == 0
    assert max_surge({"spec": {}}, 10) == 3, "the API's default, 25 %, rounded up"


def test_a_lost_annotation_falls_back_to_the_pods_there_are() -> None:
    sets = [rs("new", 5, NEW, None), rs("old", 8, OLD, None)]
    assert sizes_after(deployment(8), sets, 8) == {"old": 7, "new": 4}


@given(st.lists(st.integers(1, 40), min_size=2, max_size=4), st.integers(0, 60), st.integers(0, 5),
       st.sampled_from(["0%", "10%", "25%", "50%"]))
def test_the_sizes_add_up_to_what_the_deployment_allows(sizes: list[int], replicas: int, surge: int,
                                                         percent: str) -> None:
    for value in (surge, percent):
        dep = deployment(replicas, surge=value, unavailable=1)
        before = sum(sizes)  # the controller annotates each ReplicaSet with the count it last allowed
        sets = [rs(f"rs{i}", n, f"2026-12-01T0{i}:00:00Z", before) for i, n in enumerate(sizes)]
        after = sizes_after(dep, sets, replicas)
        assert after is not None and all(n >= 0 for n in after.values())
        allowed = replicas + max_surge(dep, replicas) if replicas else 0
        assert sum(after.values()) == allowed
        growing = allowed >= before
        assert all((after[f"rs{i}"] >= n) == growing or after[f"rs{i}"] == n for i, n in enumerate(sizes))
