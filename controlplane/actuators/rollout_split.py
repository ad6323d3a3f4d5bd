"""How the Deployment controller spreads a new replica count over the ReplicaSets of a rollout in
progress (its proportional scaling), so that a scale-down drains the pods that will be removed.

A Deployment scaled while its old and new ReplicaSets both have replicas does not take the change
from one of them: each gets a share in proportion to its size, against the largest count the
Deployment allowed before (`deployment.kubernetes.io/max-replicas` on each ReplicaSet) and the
count it allows now (replicas plus maxSurge), and what rounding leaves goes to the largest; its next
pass trims the new ReplicaSet to the Deployment's count where it is above it. This follows `scale`,
`GetProportion` and `reconcileNewReplicaSet` in the controller (`pkg/controller/deployment/`); a pure
function of the objects as read. What the rollout then removes of the old ReplicaSets as new pods
become available is the rollout's own progress, not the scale's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from controlplane.kube import dig, int_or_percent

__all__ = ["MAX_REPLICAS", "REVISION", "max_surge", "sizes_after"]

MAX_REPLICAS = "deployment.kubernetes.io/max-replicas"
REVISION = "deployment.kubernetes.io/revision"


def max_surge(deployment: Mapping[str, Any], replicas: int) -> int:
    """The pods a rolling update may run above `replicas` (a percentage rounds up); 0 for any other strategy."""
    strategy = dig(deployment, ("spec", "strategy"), {}) or {}
    if strategy.get("type", "RollingUpdate") != "RollingUpdate":
        return 0
    return int_or_percent(dig(strategy, ("rollingUpdate", "maxSurge"), "25%"), replicas, round_up=True)


def _replicas(rs: Mapping[str, Any]) -> int:
    return int(dig(rs, ("spec", "replicas"), 0) or 0)


def _fraction(rs: Mapping[str, Any], deployment: Mapping[str, Any], replicas: int) -> int:
    """What the ReplicaSet's size moves by, in proportion, when the Deployment goes to `replicas`."""
    if replicas == 0:
        return -_replicas(rs)
    allowed_now = replicas + max_surge(deployment, replicas)
    try:
        allowed_before = int(dig(rs, ("metadata", "annotations", MAX_REPLICAS)))
    except (TypeError, ValueError):
        allowed_before = 0
    if allowed_before == 0:  # the annotation lost (edited by hand): the controller falls back to the pods there are
        allowed_before = int(dig(deployment, ("status", "replicas"), 0) or 0)
        if allowed_before == 0:
            return 0
    # Go's math.Round: halves away from zero.
    return math.floor(_replicas(rs) * allowed_now / allowed_before + 0.5) - _replicas(rs)


def sizes_after(deployment: Mapping[str, Any], sets: Sequence[Mapping[str, Any]], replicas: int
                ) -> dict[str, int] | None:
    """Each active ReplicaSet's size once `deployment` is set to `replicas`, by name; None where one ReplicaSet takes
    the whole change (no rollout in progress, or not a rolling update)."""
    active = [rs for rs in sets if _replicas(rs) > 0]
    strategy = dig(deployment, ("spec", "strategy", "type"), "RollingUpdate")
    if len(active) < 2 or strategy != "RollingUpdate":
        return None
    # (A new ReplicaSet already at the new count, ready, and annotated with it empties the old ones instead; its
    # desired-replicas annotation still holds the count before this change, so that does not arise here.)
    allowed = replicas + max_surge(deployment, replicas) if replicas > 0 else 0
    to_add = allowed - sum(_replicas(rs) for rs in active)
    sizes = {str(rs["metadata"]["name"]): _replicas(rs) for rs in active}
    if to_add != 0:
        _spread(sizes, active, deployment, replicas, to_add)
    # Its next pass trims a new ReplicaSet left above the Deployment's count to it (the newest of all: a new template's
    # ReplicaSet not yet scaled up is the new one, and then none of the active ones is trimmed).
    newest = str(max(sets, key=_revision)["metadata"]["name"])
    if newest in sizes:
        sizes[newest] = min(sizes[newest], replicas)
    return sizes


def _spread(sizes: dict[str, int], active: Sequence[Mapping[str, Any]], deployment: Mapping[str, Any], replicas: int,
            to_add: int) -> None:
    """Add `to_add` replicas (fewer where negative) to `sizes`, in proportion, as `scale` does."""

    def age(rs: Mapping[str, Any]) -> tuple[str, str]:
        return str(dig(rs, ("metadata", "creationTimestamp"), "")), str(rs["metadata"]["name"])

    # Largest first; among equals the older first when shrinking, the newer first when growing.
    ordered = sorted(active, key=age, reverse=to_add > 0)
    ordered.sort(key=_replicas, reverse=True)
    added = 0
    for rs in ordered:
        if added == to_add:
            break
        fraction = _fraction(rs, deployment, replicas)
        share = min(fraction, to_add - added) if to_add > 0 else max(fraction, to_add - added)
        sizes[str(rs["metadata"]["name"])] += share
        added += share
    first = str(ordered[0]["metadata"]["name"])
    sizes[first] = max(0, sizes[first] + to_add - added)


def _revision(rs: Mapping[str, Any]) -> int:
    try:
        return int(dig(rs, ("metadata", "annotations", REVISION), 0) or 0)
    except (TypeError, ValueError):
        return 0
