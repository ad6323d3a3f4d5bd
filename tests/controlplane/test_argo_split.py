"""The Argo Rollouts controller's split of a Rollout's count during an update, as the actuator predicts it:
the cases of Argo Rollouts' own test of the weighted split (their inputs and expected counts), the canary's
weight through its steps, traffic routing, aborts, blue-green previews, and properties of the weighted
split. Every Rollout here is valid against the Rollout CRD's schema."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.actuators import argo_split
from controlplane.actuators.argo_split import POD_TEMPLATE_HASH, sizes_after
from tests.crd_schemas import crd_name, problems, schema


def rs(name: str, replicas: int, available: int | None = None) -> dict[str, Any]:
    return {"metadata": {"name": f"vllm-{name}", "labels": {POD_TEMPLATE_HASH: name}},
            "spec": {"replicas": replicas}, "status": {"availableReplicas": replicas if available is None else available}}


SETS = [rs("stable", 8), rs("canary", 2), rs("older", 0)]


def rollout(replicas: int, canary: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
            blue_green: dict[str, Any] | None = None) -> dict[str, Any]:
    strategy = {"blueGreen": {"activeService": "vllm-active", **blue_green}} if blue_green is not None else \
        {"canary": {"steps": [{"setWeight": 20}, {"pause": {}}], **(canary or {})}}
    obj = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "metadata": {"name": "vllm-decode"},
           "spec": {"replicas": replicas, "strategy": strategy, "selector": {"matchLabels": {"app": "vllm-decode"}}},
           "status": {"currentPodHash": "canary", "stableRS": "stable", "currentStepIndex": 1, **(status or {})}}
    found = schema(crd_name("argoproj.io/v1alpha1", "Rollout"))
    assert found is not None and problems(obj, found) == []
    return obj


# Argo Rollouts' TestApproximateWeightedNewStableReplicaCounts: (replicas, weight, maxSurge) -> (canary, stable).
UPSTREAM = {
    (0, 0, 0): (0, 0), (0, 50, 0): (0, 0), (0, 100, 0): (0, 0), (0, 0, 1): (0, 0), (0, 50, 1): (0, 0),
    (0, 100, 1): (0, 0),
    (1, 0, 0): (0, 1), (1, 1, 0): (0, 1), (1, 49, 0): (0, 1), (1, 50, 0): (1, 0), (1, 99, 0): (1, 0),
    (1, 100, 0): (1, 0),
    (1, 0, 1): (0, 1), (1, 1, 1): (1, 1), (1, 49, 1): (1, 1), (1, 50, 1): (1, 1), (1, 99, 1): (1, 1),
    (1, 100, 1): (1, 0),
    (2, 0, 0): (0, 2), (2, 1, 0): (1, 1), (2, 50, 0): (1, 1), (2, 99, 0): (1, 1), (2, 100, 0): (2, 0),
    (2, 0, 1): (0, 2), (2, 1, 1): (1, 2), (2, 50, 1): (1, 1), (2, 99, 1): (2, 1), (2, 100, 1): (2, 0),
    (3, 10, 0): (1, 2), (3, 25, 0): (1, 2), (3, 33, 0): (1, 2), (3, 34, 0): (1, 2), (3, 49, 0): (1, 2),
    (3, 50, 0): (2, 1),
    (3, 10, 1): (1, 3), (3, 25, 1): (1, 3), (3, 33, 1): (1, 2), (3, 34, 1): (1, 2), (3, 49, 1): (2, 2),
    (3, 50, 1): (2, 2),
    (10, 1, 0): (1, 9), (10, 14, 0): (1, 9), (10, 15, 0): (2, 8), (10, 16, 0): (2, 8), (10, 99, 0): (9, 1),
    (10, 100, 1): (10, 0),
    (10, 0, 1): (0, 10), (10, 1, 1): (1, 10), (10, 18, 1): (2, 9), (10, 19, 1): (2, 9), (10, 20, 1): (2, 8),
    (10, 23, 1): (2, 8), (10, 24, 1): (3, 8), (10, 25, 1): (3, 8), (10, 99, 1): (10, 1),
}


@pytest.mark.parametrize(("replicas", "weight", "surge"), sorted(UPSTREAM))
def test_the_weighted_split_matches_argo_rollouts_own_cases(replicas: int, weight: int, surge: int) -> None:
    canary = {"steps": [{"setWeight": weight}], "maxSurge": surge, "maxUnavailable": 0 if surge else 1}
    assert sizes_after(rollout(replicas, canary, {"currentStepIndex": 0}), SETS, replicas) == {
        "vllm-canary": UPSTREAM[replicas, weight, surge][0], "vllm-stable": UPSTREAM[replicas, weight, surge][1]}


def test_a_scale_down_mid_canary_takes_from_each_by_the_weight() -> None:
    # 10 at 20 %, the default maxSurge (25 %, 2 of 8): 2 canary and 7 stable (9 in all) come nearest 20 %, so 8
    # -> 9 removes one stable engine and no canary; at 5, exactly 1 and 4.
    assert sizes_after(rollout(10), SETS, 8) == {"vllm-canary": 2, "vllm-stable": 7}
    assert sizes_after(rollout(10), SETS, 5) == {"vllm-canary": 1, "vllm-stable": 4}
    # Past the pause, with no step left: the canary takes everything (the stable goes as the rollout completes).
    assert sizes_after(rollout(10, status={"currentStepIndex": 2}), SETS, 5) == {"vllm-canary": 5, "vllm-stable": 0}
    assert sizes_after(rollout(10, status={"promoteFull": True}), SETS, 5) == {"vllm-canary": 5, "vllm-stable": 0}
    # Aborted: back to the stable.
    assert sizes_after(rollout(10, status={"abort": True}), SETS, 5) == {"vllm-canary": 0, "vllm-stable": 5}


def test_the_weight_is_the_last_set_up_to_the_current_step() -> None:
    steps = {"steps": [{"setWeight": 10}, {"pause": {"duration": "10m"}}, {"setWeight": 50}, {"pause": {}}]}
    weights = {i: sizes_after(rollout(10, steps, {"currentStepIndex": i}), SETS, 10) for i in range(4)}
    assert [w["vllm-canary"] for w in weights.values()] == [1, 1, 5, 5]  # type: ignore[index]
    no_weight = {"steps": [{"pause": {}}, {"setWeight": 40}]}
    assert sizes_after(rollout(10, no_weight, {"currentStepIndex": 0}), SETS, 10) == {
        "vllm-canary": 0, "vllm-stable": 10}


def test_a_new_replicaset_with_no_distinct_stable_one_takes_the_count() -> None:
    # Promoted, or a first rollout: the new set grows or shrinks to the count, and the older ones go with the update.
    assert sizes_after(rollout(10, status={"stableRS": "canary"}), SETS, 5) == {"vllm-canary": 5}
    assert sizes_after(rollout(10, status={"stableRS": "gone"}), SETS, 5) == {"vllm-canary": 5}
    assert sizes_after(rollout(10, status={"currentPodHash": "gone"}), SETS, 5) is None, "the new set not listed"
    unlabelled = [{"metadata": {"name": "vllm-x", "labels": {}}, "spec": {"replicas": 3}}]
    assert sizes_after(rollout(10, status={"currentPodHash": ""}), unlabelled, 5) is None
    plain = {"spec": {"replicas": 10}, "status": {"currentPodHash": "canary", "stableRS": "stable"}}
    assert sizes_after(plain, SETS, 5) is None, "no strategy read"


def test_traffic_routing_keeps_the_stable_whole_and_sizes_the_canary_by_weight() -> None:
    routed = {"trafficRouting": {"nginx": {"stableIngress": "vllm"}}}
    assert sizes_after(rollout(10, routed), SETS, 6) == {"vllm-canary": 2, "vllm-stable": 6}  # ceil(20 % of 6)
    least = {**routed, "minPodsPerReplicaSet": 2}
    assert sizes_after(rollout(10, least), SETS, 4) == {"vllm-canary": 2, "vllm-stable": 4}  # 1, raised to 2
    fixed = {**routed, "steps": [{"setCanaryScale": {"replicas": 3}}, {"setWeight": 20}, {"pause": {}}]}
    assert sizes_after(rollout(10, fixed, {"currentStepIndex": 2}), SETS, 6) == {"vllm-canary": 3, "vllm-stable": 6}
    matched = {**routed, "steps": [{"setCanaryScale": {"replicas": 3}}, {"setCanaryScale": {"matchTrafficWeight": True}},
                                   {"setWeight": 50}, {"pause": {}}]}
    assert sizes_after(rollout(10, matched, {"currentStepIndex": 3}), SETS, 8) == {"vllm-canary": 4, "vllm-stable": 8}
    scaled = {**routed, "steps": [{"setCanaryScale": {"weight": 50}}, {"setWeight": 10}, {"pause": {}}]}
    assert sizes_after(rollout(10, scaled, {"currentStepIndex": 2}), SETS, 6) == {"vllm-canary": 3, "vllm-stable": 6}
    top = {"trafficRouting": {**routed["trafficRouting"], "maxTrafficWeight": 1000}, "steps": [{"setWeight": 150}]}
    assert sizes_after(rollout(10, top, {"currentStepIndex": 0}), SETS, 10) == {"vllm-canary": 2, "vllm-stable": 10}


def test_a_dynamic_stable_ends_at_the_rest_of_the_weight() -> None:
    # Argo's pass keeps the stable above its share until the traffic has left it (its own tests check that pass);
    # the split is where it ends, which is what the scale removes.
    dynamic = {"trafficRouting": {"smi": {}}, "dynamicStableScale": True}
    weights = {"canary": {"weights": {"canary": {"weight": 0}, "stable": {"weight": 100}}}}
    assert sizes_after(rollout(10, dynamic, weights), SETS, 10) == {"vllm-canary": 2, "vllm-stable": 8}
    assert sizes_after(rollout(10, {**dynamic, "minPodsPerReplicaSet": 3}), SETS, 10) == {"vllm-canary": 3,
                                                                                         "vllm-stable": 8}


@pytest.mark.parametrize(("delay", "expected"), [
    (None, {"vllm-canary": 0, "vllm-stable": 10}),  # the default delay only postpones the canary's scale-down
    (30, {"vllm-canary": 0, "vllm-stable": 10}),
    (0, {"vllm-canary": 3, "vllm-stable": 10}),  # kept up: its setCanaryScale still counts
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_an_aborted_canary_ends_at_zero_unless_kept_up(delay: int | None, expected: dict[str, int],
                                                       dynamic: bool) -> None:
    canary: dict[str, Any] = {"trafficRouting": {"smi": {}}, "dynamicStableScale": dynamic,
                              "steps": [{"setCanaryScale": {"replicas": 3}}, {"setWeight": 60}, {"pause": {}}]}
    if delay is not None:
        canary["abortScaleDownDelaySeconds"] = delay
    assert sizes_after(rollout(10, canary, {"abort": True, "currentStepIndex": 2}), SETS, 10) == expected


def test_a_blue_green_preview_keeps_its_own_count_until_promoted() -> None:
    status = {"blueGreen": {"activeSelector": "stable", "previewSelector": "canary"}}
    assert sizes_after(rollout(10, blue_green={}, status=status), SETS, 6) == {"vllm-stable": 6, "vllm-canary": 6}
    preview = {"previewReplicaCount": 2}
    assert sizes_after(rollout(10, blue_green=preview, status=status), SETS, 6) == {"vllm-stable": 6,
                                                                                    "vllm-canary": 2}
    resumed = {"blueGreen": {**status["blueGreen"], "scaleUpPreviewCheckPoint": True}}
    assert sizes_after(rollout(10, blue_green=preview, status=resumed), SETS, 6) == {"vllm-stable": 6,
                                                                                     "vllm-canary": 6}
    paused = rollout(10, blue_green=preview, status={**resumed, "pauseConditions": [
        {"reason": "BlueGreenPause", "startTime": "2026-12-01T10:00:00Z"}]})
    assert sizes_after(paused, SETS, 6) == {"vllm-stable": 6, "vllm-canary": 2}
    # Switched, its post-promotion analysis running: the old stable is kept at the count until the new one is stable.
    switched = {"blueGreen": {"activeSelector": "canary"}}
    assert sizes_after(rollout(10, blue_green=preview, status=switched), SETS, 6) == {"vllm-stable": 6,
                                                                                      "vllm-canary": 6}
    assert sizes_after(rollout(10, blue_green=preview, status={**switched, "stableRS": "canary"}), SETS, 6) == {
        "vllm-canary": 6}
    aborted = {**status, "abort": True}
    assert sizes_after(rollout(10, blue_green=preview, status=aborted), SETS, 6) == {"vllm-stable": 6,
                                                                                     "vllm-canary": 0}
    kept = {**preview, "abortScaleDownDelaySeconds": 0}
    assert sizes_after(rollout(10, blue_green=kept, status=aborted), SETS, 6) == {"vllm-stable": 6, "vllm-canary": 2}


@given(st.integers(0, 40), st.integers(0, 100), st.integers(0, 5))
def test_the_weighted_split_is_whole_and_near_the_weight(replicas: int, weight: int, surge: int) -> None:
    canary, total = argo_split._nearest(replicas, weight, 100, surge)
    assert 0 <= canary <= total and total in ((replicas, replicas + 1) if surge and replicas else (replicas,))
    # Argo's own fallback where no option qualifies ("should not get here"): the share is exactly half way between two
    # counts, its ceiling is every replica, and there is no surge to round into. Then the canary gets none, as upstream.
    if replicas > 1 and surge == 0 and replicas * weight % 100 == 50 and -(-replicas * weight // 100) == replicas:
        assert (canary, total) == (0, replicas)
        return
    if replicas:
        # Within one engine of the weight's share, and no side emptied by a weight strictly between the ends.
        assert abs(canary - total * weight / 100) <= 1
        if 0 < weight < 100 and (replicas > 1 or surge):
            assert 0 < canary < total
