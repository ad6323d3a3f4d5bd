"""How the Argo Rollouts controller spreads a Rollout's count over its ReplicaSets while an update is in
progress, so that a scale-down drains the pods that will be removed.

A Rollout in the middle of a canary has a stable ReplicaSet (`status.stableRS`, matched by its
`rollouts-pod-template-hash` label) and a canary one (`status.currentPodHash`), and a count scaled
then is split by the step's weight:
- without traffic routing, the canary gets the count nearest the weight and the stable the rest
  (one replica more in all where maxSurge allows a closer match, and neither at 0 for a weight
  strictly between 0 and the maximum);
- with traffic routing, the canary gets the weight's share rounded up (or a `setCanaryScale`
  step's count, and at least `minPodsPerReplicaSet`) and the stable keeps the whole count, unless
  `dynamicStableScale` sizes it by the larger of its desired and its actual traffic weight.
A blue-green update scales the active ReplicaSet to the count and the preview to
`previewReplicaCount` where one is set and not yet past its scale-up. This follows
`NewRSNewReplicas`, `CalculateReplicaCountsForBasicCanary`,
`approximateWeightedCanaryStableReplicaCounts` and `CalculateReplicaCountsForTrafficRoutedCanary`
(`utils/replicaset/` in Argo Rollouts) to the sizes they lead to, not the steps by which
availability lets them get there (an aborted canary at the weight it has stepped back to). Older
ReplicaSets go to 0 whatever the count: that is the rollout's own progress, not the scale's. A pure
function of the objects as read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from controlplane.actuators.rollout_split import int_or_percent
from controlplane.kube import dig

__all__ = ["POD_TEMPLATE_HASH", "sizes_after"]

POD_TEMPLATE_HASH = "rollouts-pod-template-hash"


def sizes_after(rollout: Mapping[str, Any], sets: Sequence[Mapping[str, Any]], replicas: int
                ) -> dict[str, int] | None:
    """The size of each ReplicaSet the scale touches once `rollout` is set to `replicas`, by name; None where one
    ReplicaSet takes the whole change (no update in progress, or its ReplicaSets not found)."""
    status: Mapping[str, Any] = rollout.get("status") or {}
    strategy: Mapping[str, Any] = dig(rollout, ("spec", "strategy"), {}) or {}
    hashed = {dig(rs, ("metadata", "labels", POD_TEMPLATE_HASH)): rs for rs in sets}
    new = hashed.get(status.get("currentPodHash"))
    if isinstance(strategy.get("blueGreen"), Mapping):
        active = hashed.get(dig(status, ("blueGreen", "activeSelector")))
        if new is None or active is None or active is new:
            return None
        return {_name(active): replicas, _name(new): _preview(rollout, replicas)}
    canary = strategy.get("canary")
    stable = hashed.get(status.get("stableRS"))
    if not isinstance(canary, Mapping) or new is None or stable is None or new is stable:
        return None
    top = int(dig(canary, ("trafficRouting", "maxTrafficWeight"), 100) or 100)
    fixed, weight = _canary_weight(rollout, canary, top, replicas, new, stable)
    if canary.get("trafficRouting") is None:
        surge = int_or_percent(canary.get("maxSurge", "25"), replicas, round_up=True)
        count, total = _nearest(replicas, weight, top, surge)
        return {_name(new): count, _name(stable): total - count}
    least = min(int(canary.get("minPodsPerReplicaSet") or 0), replicas)

    def at_least(count: int) -> int:
        return count if count == 0 else max(count, least)

    count = fixed if fixed is not None else at_least(_share(replicas, weight, top))
    if not canary.get("dynamicStableScale"):
        return {_name(new): count, _name(stable): replicas}
    kept = _share(replicas, top - weight, top)
    weights = dig(status, ("canary", "weights"))
    if isinstance(weights, Mapping):
        # The stable shrinks only once traffic has left it, and an aborted canary once traffic is back on the stable.
        kept = max(kept, _share(replicas, int(dig(weights, ("stable", "weight"), 0) or 0), top))
        if status.get("abort"):
            count = max(count, _share(replicas, int(dig(weights, ("canary", "weight"), 0) or 0), top))
    return {_name(new): at_least(count), _name(stable): at_least(kept)}


def _name(rs: Mapping[str, Any]) -> str:
    return str(rs["metadata"]["name"])


def _available(rs: Mapping[str, Any]) -> int:
    return int(dig(rs, ("status", "availableReplicas"), 0) or 0)


def _share(replicas: int, weight: int, top: int) -> int:
    """A traffic weight's share of `replicas`, rounded up."""
    return math.ceil(weight * replicas / top)


def _canary_weight(rollout: Mapping[str, Any], canary: Mapping[str, Any], top: int, replicas: int,
                   new: Mapping[str, Any], stable: Mapping[str, Any]) -> tuple[int | None, int]:
    """The canary's fixed count (a `setCanaryScale` step's replicas, with traffic routing only) or else None, and the
    weight its size follows: the last `setWeight` up to the current step, the maximum past the last step or on a
    full promotion, once aborted 0 (or, with `dynamicStableScale`, the step it has shrunk back to)."""
    status: Mapping[str, Any] = rollout.get("status") or {}
    if status.get("promoteFull"):
        return None, top
    steps: Sequence[Mapping[str, Any]] = canary.get("steps") or []
    index = int(status.get("currentStepIndex") or 0)
    upto = list(reversed(steps[:index + 1])) if index < len(steps) else []
    if canary.get("trafficRouting") is not None:
        scale = next((s["setCanaryScale"] for s in upto if isinstance(s.get("setCanaryScale"), Mapping)), None)
        if scale is not None and not scale.get("matchTrafficWeight"):
            if scale.get("replicas") is not None:
                return int(scale["replicas"]), 0
            if scale.get("weight") is not None:
                return None, int(scale["weight"])
    if status.get("abort"):
        return None, _stepped_back(canary, top, replicas, new, stable) if canary.get("dynamicStableScale") else 0
    if not upto:
        return None, top
    return None, next((int(s["setWeight"]) for s in upto if s.get("setWeight") is not None), 0)


def _stepped_back(canary: Mapping[str, Any], top: int, replicas: int, new: Mapping[str, Any],
                  stable: Mapping[str, Any]) -> int:
    """The weight an aborted canary with `dynamicStableScale` steps back to, so that the stable grows as the canary
    shrinks: the last `setWeight` whose share is below the canary engines still needed (those the stable lacks, or
    the canary's available ones if more, unless an explicit `abortScaleDownDelaySeconds` keeps the canary up)."""
    needed = replicas - _available(stable)
    if canary.get("abortScaleDownDelaySeconds") is None:
        needed = max(needed, _available(new))
    steps: Sequence[Mapping[str, Any]] = canary.get("steps") or []
    return next((int(s["setWeight"]) for s in reversed(steps)
                 if s.get("setWeight") is not None and _share(replicas, int(s["setWeight"]), top) < needed), 0)


def _nearest(replicas: int, weight: int, top: int, surge: int) -> tuple[int, int]:
    """The canary count and the total (`replicas`, or one more where maxSurge allows) whose split comes nearest the
    weight, the first on a tie; neither side at 0 for a weight strictly between 0 and `top`, unless a single replica
    cannot surge."""
    if replicas == 0:
        return 0, 0
    up, down = math.ceil(replicas * weight / top), math.floor(replicas * weight / top)
    zero_ok = weight in (0, top) or (replicas == 1 and surge == 0)

    def tied(total: int) -> bool:  # the floor and the ceiling equally far from the weight: the ceiling is taken
        return math.modf(total * (weight / top))[0] == 0.5

    options: list[tuple[int, int]] = []
    if up < replicas or zero_ok:
        options.append((up, replicas))
    if not tied(replicas) and (down != 0 or zero_ok):
        options.append((down, replicas))
    if surge > 0:
        options.append((up, replicas + 1))
        if not tied(replicas + 1) and (down != 0 or zero_ok):
            options.append((down, replicas + 1))
    if not options:
        return 0, replicas
    return min(options, key=lambda o: abs(o[0] * top / o[1] - weight))


def _preview(rollout: Mapping[str, Any], replicas: int) -> int:
    """A blue-green preview's size: `previewReplicaCount` until promoted (in full, or resumed past its scale-up
    checkpoint), the whole count without one."""
    count = dig(rollout, ("spec", "strategy", "blueGreen", "previewReplicaCount"))
    status: Mapping[str, Any] = rollout.get("status") or {}
    if count is None or status.get("promoteFull"):
        return replicas
    paused = bool(dig(rollout, ("spec", "paused"))) or bool(status.get("pauseConditions"))
    if not paused and dig(status, ("blueGreen", "scaleUpPreviewCheckPoint")):
        return replicas
    return int(count)
