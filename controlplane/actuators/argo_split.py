"""How the Argo Rollouts controller spreads a Rollout's count over its ReplicaSets while an update is in
progress, so that a scale-down drains the pods that will be removed.

A Rollout in the middle of an update has a stable ReplicaSet (`status.stableRS`) and a new one
(`status.currentPodHash`), each found by its `rollouts-pod-template-hash` label. Scaled to R:
- a canary without traffic routing ends with the new set at the count nearest the step's weight and
  the stable at the rest (one replica more in all where maxSurge allows a closer match, and neither
  at 0 for a weight strictly between 0 and the maximum);
- with traffic routing the canary gets the weight's share rounded up (or a `setCanaryScale` step's
  count, and at least `minPodsPerReplicaSet`) and the stable keeps R, or with `dynamicStableScale`
  the rest of the weight;
- an aborted canary ends at 0 and its stable at R (unless `abortScaleDownDelaySeconds: 0` leaves a
  `setCanaryScale` count up);
- a blue-green update keeps its stable at R and its preview at `previewReplicaCount` (where one is
  set, until promoted or resumed past its scale-up), or at 0 once aborted;
- a new set with no distinct stable one takes R.
These are the sizes `NewRSNewReplicas`, `CalculateReplicaCountsForBasicCanary`,
`approximateWeightedCanaryStableReplicaCounts`, `CalculateReplicaCountsForTrafficRoutedCanary` and
`reconcileBlueGreenStableReplicaSet` (in `utils/replicaset/` and `rollout/` of Argo Rollouts) lead
to, not the passes by which availability and traffic weights get there: the drain is for every pod
the scale will remove. Older ReplicaSets are left out: the update removes them (after a scale-down
delay of seconds, in which a blue-green one follows the count). A pure function of the objects as
read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from controlplane.kube import dig, int_or_percent

__all__ = ["POD_TEMPLATE_HASH", "sizes_after"]

POD_TEMPLATE_HASH = "rollouts-pod-template-hash"


def sizes_after(rollout: Mapping[str, Any], sets: Sequence[Mapping[str, Any]], replicas: int
                ) -> dict[str, int] | None:
    """The size each ReplicaSet the update keeps ends at once `rollout` is set to `replicas`, by name; None where
    its new ReplicaSet is not found (the whole change is then one ReplicaSet's)."""
    status: Mapping[str, Any] = rollout.get("status") or {}
    strategy: Mapping[str, Any] = dig(rollout, ("spec", "strategy"), {}) or {}
    hashed = {label: rs for rs in sets if (label := dig(rs, ("metadata", "labels", POD_TEMPLATE_HASH)))}
    new, stable = hashed.get(status.get("currentPodHash")), hashed.get(status.get("stableRS"))
    if new is None:
        return None
    if stable is None or stable is new:
        return {_name(new): replicas}
    blue_green, canary = strategy.get("blueGreen"), strategy.get("canary")
    if isinstance(blue_green, Mapping):
        return {_name(stable): replicas, _name(new): _preview(rollout, blue_green, hashed, replicas)}
    if not isinstance(canary, Mapping):
        return None
    top = int(dig(canary, ("trafficRouting", "maxTrafficWeight"), 100) or 100)
    fixed, weight = _canary_weight(rollout, canary, top)
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
    return {_name(new): at_least(count), _name(stable): at_least(_share(replicas, top - weight, top))}


def _name(rs: Mapping[str, Any]) -> str:
    return str(rs["metadata"]["name"])


def _share(replicas: int, weight: int, top: int) -> int:
    """A traffic weight's share of `replicas`, rounded up."""
    return math.ceil(weight * replicas / top)


def _kept_up_on_abort(strategy: Mapping[str, Any]) -> bool:
    """Whether an abort leaves the new ReplicaSet up: `abortScaleDownDelaySeconds` set to 0 (any other value only
    delays its scale-down)."""
    return strategy.get("abortScaleDownDelaySeconds") == 0


def _canary_weight(rollout: Mapping[str, Any], canary: Mapping[str, Any], top: int) -> tuple[int | None, int]:
    """The canary's fixed count (a `setCanaryScale` step's replicas, with traffic routing only) or else None, and the
    weight its size follows: the last `setWeight` up to the current step, the maximum past the last step or on a
    full promotion, 0 once aborted."""
    status: Mapping[str, Any] = rollout.get("status") or {}
    if status.get("promoteFull"):
        return None, top
    steps: Sequence[Mapping[str, Any]] = canary.get("steps") or []
    index = int(status.get("currentStepIndex") or 0)
    upto = list(reversed(steps[:index + 1])) if index < len(steps) else []
    aborted = bool(status.get("abort"))
    if canary.get("trafficRouting") is not None and (not aborted or _kept_up_on_abort(canary)):
        scale = next((s["setCanaryScale"] for s in upto if isinstance(s.get("setCanaryScale"), Mapping)), None)
        if scale is not None and not scale.get("matchTrafficWeight"):
            if scale.get("replicas") is not None:
                return int(scale["replicas"]), 0
            if scale.get("weight") is not None:
                return None, int(scale["weight"])
    if aborted:
        return None, 0
    if not upto:
        return None, top
    return None, next((int(s["setWeight"]) for s in upto if s.get("setWeight") is not None), 0)


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


def _preview(rollout: Mapping[str, Any], blue_green: Mapping[str, Any], hashed: Mapping[str, Mapping[str, Any]],
             replicas: int) -> int:
    """A blue-green update's new ReplicaSet: `previewReplicaCount` until it is active, promoted in full or resumed
    past its scale-up checkpoint, the whole count without one, 0 once aborted (unless kept up)."""
    status: Mapping[str, Any] = rollout.get("status") or {}
    if status.get("abort") and not _kept_up_on_abort(blue_green):
        return 0
    count = blue_green.get("previewReplicaCount")
    active = dig(status, ("blueGreen", "activeSelector"))
    if count is None or active not in hashed or active == status.get("currentPodHash") or status.get("promoteFull"):
        return replicas
    paused = bool(dig(rollout, ("spec", "paused"))) or bool(status.get("pauseConditions"))
    if not paused and dig(status, ("blueGreen", "scaleUpPreviewCheckPoint")):
        return replicas
    return int(count)
