"""Acting on a fleet through the Kubernetes API, with the official client: every kind of action but
admission control, which belongs to the router.

Owns writes to the pools' workloads (Deployment, StatefulSet, LeaderWorkerSet, Argo Rollout) and to
the router's, to the engine pods and their nodes, and Events about what it did; it reads them to
know the pools' replicas and the workloads' revisions. It must not scrape, detect or decide: the
loop chose the change and its target, the rails allowed it; this only carries it out.

What it needs, and nothing more (`VERBS`; `deploy/base/rbac.yaml` grants exactly that, and the
emulator tests fail on any call outside it): get and patch on the workloads, patch on their `scale`
subresource, list on ReplicaSets, patch on a Rollout's status (to abort it), list and patch on pods,
create on `pods/eviction`, patch on nodes, create on Events, get on its ConfigMap (the
kill switch), list on HorizontalPodAutoscalers (a pool one scales is not scaled here too).

How: scaling goes through the scale subresource, a LeaderWorkerSet's in whole groups. Scaling down
drains first: the engines that will go are taken out of routing (their `routing_label` removed), and
the scale-down follows once they are idle or `drain_grace` has passed (the loop resumes it each
tick); the count is written onto the workload's version as read, so a scale by someone else
meanwhile is seen, not overwritten. A Deployment or Rollout gives up the least busy, given the lowest
`controller.kubernetes.io/pod-deletion-cost` so its ReplicaSet removes those; in the middle of an
update the change is spread over the ReplicaSets as their controller spreads it (a Deployment's
in proportion, `rollout_split`; an Argo Rollout's by the canary's weight or the blue-green
preview's count, `argo_split`), so each gives up its own least busy. A StatefulSet gives up its
highest ordinals and a LeaderWorkerSet its highest groups, which are the ones drained. The engines
that go are worked out again before the count is written: where the ReplicaSets moved meanwhile (a
rollout went on, an engine went down), those the scale now removes drain too, and a drained engine
it no longer removes is routed again. The action ends once the controller has removed the drained
engines; one still there when the grace ends (the controller chose another: a rollout's own
progress, a split not foreseen) is routed again, and the outcome says so (`not_removed`). A
StatefulSet's or LeaderWorkerSet's pod still above the count is going, one at a time: it gets
`REMOVAL_GRACES` more graces first.
New engine arguments (EPLB, speculative decoding) patch the engine container of the pod template
once, with the object's resourceVersion (for an Argo Rollout with a `workloadRef`, the template of
the Deployment it names, which the Rollout follows; that template's digest is the one reported); the
rails have checked that the rollout restarts no more engines at once than the workload allows.
Neither a new template nor a rollback is written where the controller would not roll it onto every
pod (a paused Deployment or Rollout, an `OnDelete` or partitioned StatefulSet, a partitioned
LeaderWorkerSet): it would read as made while engines run the old one. A Deployment rolls back as
`kubectl rollout undo` does, to its previous ReplicaSet's template; an Argo Rollout is aborted. A
drained engine is evicted once idle and its workload replaces it; a cordon marks the node
unschedulable and evicts the engines of every configured pool on it, in any namespace (a gang's
whole group), keeping one of a pool that serves nowhere else routed until another serves elsewhere
(or `cordon_hold` ends). Both go through the Eviction API, which honours PodDisruptionBudgets: a refusal (or a
conflict with the pod changing under it) is retried until one more grace after the engines were due
(idle, or the drain's or cordon's grace ended), and the engines still there then are routed again. A
workload's pods are those its selector matches (matchExpressions included; a Rollout without one has
its Deployment's) that no other controller owns. A scale whose stamp fails after its count is
written is made, and says so (`unstamped`).

Every write carries the action's id in an annotation of the object it changes, so a restarted
leader sees a change it already made (`applied`) and never makes it twice, and is followed by an
Event on that object. With `dry_run` every write is sent as a server-side dry run. Blocking calls
run in worker threads. A 409 conflict is retried on a fresh read (three times); 403, 404 and 422
end the action with the API's message; timeouts and server errors are retried once, and a write
still unanswered then is looked for on the object (its stamp, its count) before the action fails.
Every read a write is computed from is checked against what the action was approved from (the
pool's count, the pod template's digest): a workload someone else scaled or rolled since, a fresh
read after a conflict included, is not changed.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import re
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from controlplane.actuators import argo_split, rollout_split
from controlplane.actuators.base import FleetView, Order, PoolReplicas
from controlplane.config import ConfigMapFlag, Kubernetes, Workload
from controlplane.errors import ActuationError
from controlplane.kube import api_message, dig, int_or_percent, pod_ready
from controlplane.selectors import LabelSelector
from policies.types import ActionKind, Cordon, Drain, Eplb, RollBack, ScaleTo, Speculation, describe

__all__ = ["ACTION_ANNOTATION", "VERBS", "ConfigMapSwitch", "KubernetesActuator", "WorkloadKind"]

log = logging.getLogger(__name__)

ACTION_ANNOTATION = "fleet-controlplane.io/action"  # the last action that changed the object (`Order.stamp`)
SPEC_ANNOTATION = "fleet-controlplane.io/speculative-config"  # the config speculation was switched off with
# What an engine-flag change reported, beside its stamp: a leader that finds the change made reports it again (the
# speculation it replaced is what its revert sets back).
RESULT_ANNOTATION = "fleet-controlplane.io/action-result"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAINED_COST = -1000  # a drained engine's deletion cost: its ReplicaSet removes it before any ready one
REVISION = rollout_split.REVISION
ARGO_REVISION = "rollout.argoproj.io/revision"  # what Argo Rollouts numbers its ReplicaSets by
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER = "leaderworkerset.sigs.k8s.io/worker-index"  # 0: the group's leader
POD_INDEX = "apps.kubernetes.io/pod-index"
CONTROLLER = "fleet-controlplane"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkloadKind:
    """Where a kind of workload lives in the API and where its pod template and rollout budget are."""

    group: str
    version: str
    plural: str
    template: tuple[str, ...]  # path to the pod template in the object
    max_unavailable: tuple[str, ...]  # path to the rollout's maxUnavailable
    gang: tuple[str, ...] = ()  # path to the number of pods restarted together
    revision: tuple[str, ...] = ("spec", "template")  # what a new revision changes (a LeaderWorkerSet: both templates)
    others: tuple[tuple[str, ...], ...] = ()  # further pod templates that may run the engine (a LWS's leader's)

    @property
    def templates(self) -> tuple[tuple[str, ...], ...]:
        """Every pod template of the kind that may run the engine (a leader's first)."""
        return (*self.others, self.template)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS: dict[str, WorkloadKind] = {
    "Deployment": WorkloadKind("apps", "v1", "deployments", ("spec", "template"),
                               ("spec", "strategy", "rollingUpdate", "maxUnavailable")),
    "StatefulSet": WorkloadKind("apps", "v1", "statefulsets", ("spec", "template"),
                                ("spec", "updateStrategy", "rollingUpdate", "maxUnavailable")),
    "LeaderWorkerSet": WorkloadKind("leaderworkerset.x-k8s.io", "v1", "leaderworkersets",
                                    ("spec", "leaderWorkerTemplate", "workerTemplate"),
                                    ("spec", "rolloutStrategy", "rollingUpdateConfiguration", "maxUnavailable"),
                                    ("spec", "leaderWorkerTemplate", "size"), ("spec", "leaderWorkerTemplate"),
                                    (("spec", "leaderWorkerTemplate", "leaderTemplate"),)),
    "Rollout": WorkloadKind("argoproj.io", "v1alpha1", "rollouts", ("spec", "template"),
                            ("spec", "strategy", "canary", "maxUnavailable")),
}

# The kinds whose maxUnavailable defaults to 25 % (a StatefulSet's and a LeaderWorkerSet's to 1).
_QUARTER = ("Deployment", "Rollout")

# Every API call this actuator makes, as (API group, resource, verb): the RBAC it needs, no more.
VERBS: frozenset[tuple[str, str, str]] = frozenset({
    *((k.group, k.plural, verb) for k in KINDS.values() for verb in ("get", "patch")),
    *((k.group, f"{k.plural}/scale", "patch") for k in KINDS.values()),
    ("apps", "replicasets", "list"), ("argoproj.io", "rollouts/status", "patch"),
    ("", "pods", "list"), ("", "pods", "patch"), ("", "pods/eviction", "create"),
    ("", "nodes", "patch"), ("events.k8s.io", "events", "create"), ("", "configmaps", "get"),
    ("autoscaling", "horizontalpodautoscalers", "list"),
})


# How a scale is spread over the ReplicaSets of an update in progress, by the controller that owns them.
_SPLITS: dict[str, Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]], int], dict[str, int] | None]] = {
    "Deployment": rollout_split.sizes_after, "Rollout": argo_split.sizes_after}


def _load(order: Order, pod: str) -> float:
    """Requests on `pod` for choosing whom to drain: a dead engine leaves first, one not heard from lately last."""
    if pod in order.busy:
        return order.busy[pod]
    return -1.0 if order.idle(pod) else math.inf



def _leaving(w: Workload, pods: Mapping[str, Mapping[str, Any]], keep: int, leaving: int, order: Order,
             first: int = 0, sizes: Mapping[str, int] | None = None) -> tuple[list[str], set[str]]:
    """The pods a scale-down to `keep` replicas (`leaving` engines fewer) removes that are to drain first, and the pods
    it keeps. A StatefulSet removes the ordinals from `first + keep` up (`first`: its `spec.ordinals.start`) and a
    LeaderWorkerSet the groups from `keep` up, whatever their load (a terminating pod among them is not drained again).
    A ReplicaSet removes its pods in its own order (`_removed`), which the drain's deletion cost steers to the least
    busy of the ready ones. A Deployment or Argo Rollout in the middle of an update spreads the change over its
    ReplicaSets (`sizes`, the size after the scale of each it touches): each gives up its own share, and the pods of
    the others go with the update."""
    if w.by_ordinal:
        going = _above(w, pods, first, keep)[::-1]
        return going, set(pods) - set(going)
    groups = [(pods, leaving)] if sizes is None else [
        (own, len(own) - size) for rs, size in sorted(sizes.items())
        for own in [{p: meta for p, meta in pods.items() if _owner(meta) == rs}]]
    drain: list[str] = []
    kept: set[str] = set()
    for own, count in groups:
        removed = _removed(own, count, order)
        drain += [p for p in removed if own[p].get("ready", True)]
        kept |= set(own) - set(removed)
    return drain, kept


# Graces after the first that a StatefulSet's or LeaderWorkerSet's drained pod still above its count may take to go.
REMOVAL_GRACES = 4


def _above(w: Workload, pods: Mapping[str, Mapping[str, Any]], first: int, keep: int) -> list[str]:
    """Those of `pods` a StatefulSet (ordinals from `first`) or LeaderWorkerSet of `keep` replicas does not keep: its
    ordinals, or groups, from `first + keep` up."""
    label, least = (POD_INDEX, first + keep) if w.kind == "StatefulSet" else (LWS_GROUP, keep)
    return sorted(p for p in pods if _ordinal(p, pods[p], label) >= least)


def _due_to_go(w: Workload, obj: Mapping[str, Any], pods: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Those of `pods` that a StatefulSet or LeaderWorkerSet (as read) still has to remove: at or above its count."""
    if not w.by_ordinal:
        return []
    return _above(w, pods, int(dig(obj, ("spec", "ordinals", "start"), 0) or 0), int(dig(obj, ("spec", "replicas"), 1)))


_PHASE_RANK = {"Pending": 0, "Unknown": 1, "Running": 2}


@dataclass(frozen=True, slots=True)
class _OnNode:
    """The engines on a cordoned node, as `KubernetesActuator._engines_on` found them."""

    owners: dict[str, str]  # engine -> its pool
    unmoved: dict[str, str]  # pool whose engines stay there -> why
    leaders: dict[str, str]  # gang engine -> its group's leader
    serving: set[str]  # pools with an engine ready and routed off the node
    routed: set[str]  # engines on the node still routed


def _kept(on: _OnNode, order: Order) -> dict[str, list[str]]:
    """Per pool with no engine serving off a cordoned node, one of its engines there (a gang: one group) left routed
    until the others' replacements serve elsewhere: out all at once, the pool would serve nothing meanwhile, for what
    may be one faulty GPU among eight. One still routed (a cordon made again after a take-over finds the others out)
    whose engines all answer their scrapes (the faulty GPU's may not), else none; and none where the pool has a
    single engine or group there, whose replacement comes only once it goes."""
    units: dict[str, dict[str, list[str]]] = {}
    for pod, pool in sorted(on.owners.items()):
        units.setdefault(pool, {}).setdefault(on.leaders.get(pod, pod), []).append(pod)
    kept: dict[str, list[str]] = {}
    for pool, groups in sorted(units.items()):
        if pool in on.serving or len(groups) < 2:
            continue
        # Judged by what answers a scrape: the leader, and the members that report requests (a Ray worker of a gang
        # runs no vLLM server, and required to answer, no group of such a pool was ever kept).
        answering = [members for leader, members in groups.items() if all(m in on.routed for m in members)
                     and (order.answering is None
                          or all(m in order.answering for m in members if m == leader or m in order.counted))]
        if answering:
            kept[pool] = min(answering, key=lambda members: (sum(order.busy.get(m, 0.0) for m in members), members))
    return kept


def _removed(pods: Mapping[str, Mapping[str, Any]], leaving: int, order: Order) -> list[str]:
    """The `leaving` pods a ReplicaSet removes, in its order: unscheduled, pending, not ready, then the lowest deletion
    cost, which the drain gives to the least busy ready ones (first those this action drained already: a leader taking
    over redoes it)."""
    mine = {p for p, meta in pods.items() if _drained(meta, order)}

    def rank(p: str) -> tuple[bool, int, bool, bool, float, str]:
        meta = pods[p]
        ready = bool(meta.get("ready", True))
        return (bool(meta.get("node", True)), _PHASE_RANK.get(str(meta.get("phase", "Running")), 2), ready,
                p not in mine, _load(order, p) if ready else 0.0, p)

    return sorted(pods, key=rank)[:max(0, leaving)]


def _controller(meta: Mapping[str, Any]) -> tuple[str, str] | None:
    """The kind and name of the object that controls a pod (None for an orphan)."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("kind")), str(ref.get("name"))
    return None


def _owner(meta: Mapping[str, Any]) -> str | None:
    """The name of the ReplicaSet that controls a pod."""
    ref = _controller(meta)
    return ref[1] if ref is not None and ref[0] == "ReplicaSet" else None


def _ordinal(pod: str, meta: Mapping[str, Any], label: str) -> int:
    """A pod's ordinal (StatefulSet) or group index (LeaderWorkerSet): its label, else (a StatefulSet's pod on a
    cluster older than the label) the number its name ends with."""
    value = dig(meta, ("labels", label))
    if value is None and label == POD_INDEX:
        value = pod.rsplit("-", 1)[-1]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ActuationError(f"pod {pod}: no {label} to tell which engines the scale-down removes") from None


def _merge_to(current: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns `current` into `target`: keys only `current` has set to null, maps merged
    key by key, anything else (lists included, which a merge patch replaces whole) as `target` has it."""
    patch: dict[str, Any] = {k: None for k in current if k not in target}
    for k, v in target.items():
        here = current.get(k)
        patch[k] = _merge_to(here, v) if isinstance(here, Mapping) and isinstance(v, Mapping) else v
    return patch


def _body(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn`'s answer with its JSON body read and parsed in the calling thread (a worker's, never the event loop's)."""
    return json.loads(fn(*args, _preload_content=False, **kwargs).data)


def _gang(w: Workload, obj: Mapping[str, Any]) -> int:
    """Engines per replica of the workload as read: a LeaderWorkerSet group's size, else 1."""
    path = KINDS[w.kind].gang
    return int(dig(obj, path, 1)) if path else 1


def _selector(w: Workload, obj: Mapping[str, Any]) -> LabelSelector:
    """The selector of the workload's pods, as read; ActuationError where it has none or one that cannot be read."""
    # A LeaderWorkerSet has no selector in its spec: its controller labels every pod with the set's name.
    try:
        selector = (LabelSelector.parse(f"{LWS_NAME}={w.name}") if w.kind == "LeaderWorkerSet" else
                    LabelSelector.from_api(dig(obj, ("spec", "selector"), {}) or {}))
    except ValueError as exc:
        raise ActuationError(f"{w.kind} {w.namespace}/{w.name}: its pod selector cannot be read: {exc}") from None
    if not selector.requirements:
        raise ActuationError(f"{w.kind} {w.namespace}/{w.name} has no pod selector: its engines cannot be told "
                             "from others in the namespace")
    return selector


def _engines(w: Workload, obj: Mapping[str, Any]) -> tuple[int, int]:
    """Engines per replica (`_gang`) and the engines the workload as read asks for."""
    size = _gang(w, obj)
    return size, int(dig(obj, ("spec", "replicas"), 1)) * size


def _stamped(obj: Mapping[str, Any], order: Order) -> bool:
    """Whether an object carries this action's annotation: the change was made."""
    return bool(dig(obj, ("metadata", "annotations", ACTION_ANNOTATION)) == order.stamp)


def _applied(obj: Mapping[str, Any], order: Order, where: str) -> dict[str, Any]:
    """The outcome of a change found made (`_stamped`): what it reported then, where the object kept it."""
    try:
        kept = json.loads(dig(obj, ("metadata", "annotations", RESULT_ANNOTATION)) or "{}")
    except ValueError:
        kept = {}
    result = kept.get("result") if isinstance(kept, dict) and kept.get("stamp") == order.stamp else None
    return {**(result if isinstance(result, dict) else {}), "already_applied": where}


def _namespace_of(workloads: Mapping[str, Workload], order: Order, wait: Mapping[str, Any], pod: str) -> str:
    """The namespace of an engine a wait names: as a cordon's wait recorded it, else its pool's, else the wait's."""
    if (recorded := (wait.get("namespaces") or {}).get(pod)) is not None:
        return str(recorded)
    pool = (wait.get("pools") or {}).get(pod, order.pool)
    return workloads[pool].namespace if pool in workloads else str(wait["namespace"])


def _count_as_approved(order: Order, w: Workload, desired: int, change: ScaleTo) -> None:
    """Refuse a scale whose workload someone else scaled since it was approved (a count already at the one asked for
    is this scale's own write, its answer lost, or the same wish)."""
    if order.from_replicas is not None and desired not in (order.from_replicas, change.replicas):
        raise ActuationError(f"{w.kind} {w.namespace}/{w.name} went from {order.from_replicas} to {desired} engines "
                             f"since the scale to {change.replicas} was approved: not scaled")


def _template_as_approved(order: Order, holder: Workload, held: Mapping[str, Any]) -> None:
    """Refuse a change to a pod template other than the one it was approved against (`Order.from_template`)."""
    now_running = _digest(dig(held, KINDS[holder.kind].revision))
    if order.from_template is not None and now_running != order.from_template:
        raise ActuationError(f"the pod template of {holder.kind} {holder.namespace}/{holder.name} changed since "
                             f"{describe(order.change)} was approved: not made (what it was computed from is not what "
                             "runs now)")


def _drained(meta: Mapping[str, Any] | None, order: Order) -> bool:
    """Whether a pod (its metadata) is out of routing by this action's drain: its stamp and the drain's deletion cost (a
    pod routed again loses the cost)."""
    return bool(dig(meta, ("annotations", ACTION_ANNOTATION)) == order.stamp
                and dig(meta, ("annotations", DELETION_COST)) == str(DRAINED_COST))


def _revision_number(rs: Mapping[str, Any]) -> int:
    """A ReplicaSet's revision, as its Deployment or Argo Rollout numbers it (0 where it says none)."""
    annotations = dig(rs, ("metadata", "annotations"), {}) or {}
    try:
        return int(annotations.get(REVISION) or annotations.get(ARGO_REVISION) or 0)
    except (TypeError, ValueError):
        return 0


def _digest(template: Any) -> str | None:
    """A pod template's digest, the same for the same template however its keys are ordered."""
    if template is None:
        return None
    return hashlib.sha256(json.dumps(template, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rolling(kind: str, obj: Mapping[str, Any]) -> bool:
    """Whether a new pod template is still rolling out: fewer pods on it than exist (a maxSurge rollout keeps the old
    pods ready meanwhile, so the ready count does not show it), or a spec its controller has not caught up with yet.
    Pods that were never created (a quota, an admission webhook) are no rollout: the pool is short, not rolling. Nor
    is what a controller leaves on the old template on purpose, which would otherwise hold every pool's disruptive
    changes until a person steps in: an aborted Argo Rollout (its stable pods serve, the new ones are gone), a
    StatefulSet's ordinals (a LeaderWorkerSet's groups) below its partition, or a StatefulSet that updates a pod only
    when it is deleted."""
    if kind == "Rollout" and dig(obj, ("status", "abort")) is True:
        return False
    if kind == "StatefulSet" and dig(obj, ("spec", "updateStrategy", "type")) == "OnDelete":
        return False
    generation, observed = dig(obj, ("metadata", "generation")), dig(obj, ("status", "observedGeneration"))
    if isinstance(generation, int) and isinstance(observed, int) and observed < generation:
        return True
    updated = dig(obj, ("status", "updatedReplicas"))
    reported = dig(obj, ("status", "replicas"))
    existing = int(reported if reported is not None else dig(obj, ("spec", "replicas"), 1))
    if kind == "StatefulSet":
        existing -= int(dig(obj, ("spec", "updateStrategy", "rollingUpdate", "partition"), 0) or 0)
    elif kind == "LeaderWorkerSet":  # groups, counted as its status counts them
        existing -= int(dig(obj, ("spec", "rolloutStrategy", "rollingUpdateConfiguration", "partition"), 0) or 0)
    return updated is not None and int(updated) < existing


def _rolled_out(what: str, kind: str, obj: Mapping[str, Any]) -> None:
    """ActuationError naming `what` where the workload's controller would put a new pod template on none or only
    some of its pods. A template written there reads as made and settled (`_rolling` counts such pods as left behind
    on purpose) while no engine, or only some, runs it, so an engine-flag change or a rollback is refused there, as
    `kubectl rollout undo` refuses a paused Deployment."""
    if (reason := _held_back(kind, obj)) is not None:
        raise ActuationError(f"{what} not made: {reason}")


def _held_back(kind: str, obj: Mapping[str, Any]) -> str | None:
    """Why the workload's controller would roll a new pod template onto none or only some of its pods, or None."""
    if kind in ("Deployment", "Rollout") and dig(obj, ("spec", "paused")) is True:
        return "it is paused: its controller rolls out no new template until someone resumes it"
    partition: Any = 0
    if kind == "StatefulSet":
        if dig(obj, ("spec", "updateStrategy", "type")) == "OnDelete":
            return "its update strategy is OnDelete: a pod takes a new template only when someone deletes it"
        partition = dig(obj, ("spec", "updateStrategy", "rollingUpdate", "partition"), 0)
    elif kind == "LeaderWorkerSet":
        partition = dig(obj, ("spec", "rolloutStrategy", "rollingUpdateConfiguration", "partition"), 0)
    if int(partition or 0) > 0:
        return f"its partition {partition} keeps the ordinals below it on the template they run"
    return None


def _budget(value: Any, replicas: int) -> int | None:
    """maxUnavailable as a number of pods (percentages round down, as the controllers do; at least 1)."""
    if value is None:
        return None
    return max(1, int_or_percent(value, replicas, round_up=False))


class _Conflict(Exception):
    """A write lost to a concurrent one (409): read again and retry."""


class _Missing(ActuationError):
    """The object is not there (404): an error to most callers, done to an eviction."""


class _Refused(ActuationError):
    """Refused for now (429): an eviction a PodDisruptionBudget does not allow yet."""


class _Unanswered(ActuationError):
    """No answer twice (a timeout, a server error): a write may have been made all the same, and is looked for."""


class KubernetesActuator:
    """Carries out actions on the pools' workloads, pods and nodes."""

    name = "kubernetes"
    kinds = frozenset(set(ActionKind) - {ActionKind.ADMISSION_CONTROL})

    def __init__(self, api: k8s.ApiClient, settings: Kubernetes, workloads: Mapping[str, Workload], *,
                 clock: Callable[[], float], instance: str | None = None) -> None:
        self.settings = settings
        self.dry_run = settings.dry_run
        self.workloads = dict(workloads)
        self.clock = clock
        self.instance = instance or socket.gethostname()
        self._core = k8s.CoreV1Api(api)
        self._apps = k8s.AppsV1Api(api)
        self._custom = k8s.CustomObjectsApi(api)
        self._events = k8s.EventsV1Api(api)
        self._autoscaling = k8s.AutoscalingV2Api(api)
        self._scalers: dict[str, dict[tuple[str, str, str], str]] = {}  # per namespace, its HPAs as last listed
        self._scalers_unlisted: set[str] = set()  # namespaces whose last list failed (warned of once)
        self._timeout = (settings.timeout, settings.timeout)

    # calling the API ----------------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One API call in a worker thread, errors translated; timeouts and server errors retried once."""
        for attempt in (1, 2):
            try:
                return await asyncio.to_thread(fn, *args, _request_timeout=self._timeout, **kwargs)
            except ApiException as exc:
                if exc.status == 409:
                    raise _Conflict(api_message(exc)) from None
                if exc.status == 404:
                    raise _Missing(f"{what}: {api_message(exc)}") from None
                if exc.status == 429:
                    raise _Refused(f"{what}: {api_message(exc)}") from None
                if exc.status in (403, 422) or (exc.status or 0) < 500:
                    raise ActuationError(f"{what}: {api_message(exc)}") from None
                if attempt == 2:  # a server error can come after the write was stored (etcd slow to confirm it)
                    raise _Unanswered(f"{what}: {api_message(exc)}") from None
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                if attempt == 2:
                    raise _Unanswered(f"{what}: {type(exc).__name__}: {exc}") from None
            log.warning("%s failed; retrying once", what)
        raise AssertionError("unreachable")

    async def _json(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A call whose body is read and parsed in the worker thread: read on the event loop, a slow body would stall
        scrapes and the Lease's renewal."""
        return await self._call(what, _body, fn, *args, **kwargs)

    def _writes(self) -> dict[str, Any]:
        return {"dry_run": "All"} if self.dry_run else {}

    async def _read(self, w: Workload) -> dict[str, Any]:
        kind = KINDS[w.kind]
        raw = await self._call(f"reading {w.kind} {w.namespace}/{w.name}", self._custom.get_namespaced_custom_object,
                               kind.group, kind.version, w.namespace, kind.plural, w.name)
        return dict(raw)

    async def _patch(self, w: Workload, body: dict[str, Any], what: str) -> dict[str, Any]:
        kind = KINDS[w.kind]
        raw = await self._call(what, self._custom.patch_namespaced_custom_object, kind.group, kind.version,
                               w.namespace, kind.plural, w.name, body, **self._writes())
        return dict(raw)

    async def _retrying(self, what: str, order: Order, w: Workload, obj: dict[str, Any],
                        write: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """A write computed from `obj` (as read), again from a fresh read when it loses to a concurrent one, unless
        the fresh read carries this action's stamp: a write whose answer was lost (a timeout, then its resend's
        conflict) is made, and computing it again would apply a relative change twice or roll back past it."""
        for attempt in range(3):
            current = obj if attempt == 0 else await self._read(w)
            if attempt and _stamped(current, order):
                return _applied(current, order, f"{w.kind} {w.namespace}/{w.name}")
            try:
                return await write(current)
            except _Conflict as exc:
                log.info("%s: conflict (%s); reading again", what, exc)
        raise ActuationError(f"{what}: the object kept changing under three attempts (409 conflict)")

    # observing ----------------------------------------------------------------------------------

    async def observe(self) -> FleetView:
        # The reads are independent: one tick waits for the slowest, not for their sum.
        # One pool's workload that cannot be read (renamed, its CRD gone, a denied get) leaves the others known.
        seen, (router_changed, router_template), scalers = await asyncio.gather(
            asyncio.gather(*(self._observe_pool(w) for w in self.workloads.values()), return_exceptions=True),
            self._router(), self._autoscalers())
        pools, changed, unreadable = {}, {}, {}
        for (pool, w), got in zip(self.workloads.items(), seen, strict=True):
            if isinstance(got, ActuationError):
                unreadable[pool] = str(got)
            elif isinstance(got, BaseException):
                raise got
            else:
                pools[pool] = dataclasses.replace(got[0], scaled_by=scalers.get((w.namespace, w.kind, w.name)))
                if got[1] is not None:
                    changed[pool] = got[1]
        if router_changed is not None:
            changed["router"] = router_changed
        return FleetView(pools, changed, unreadable, router_template)

    async def _autoscalers(self) -> dict[tuple[str, str, str], str]:
        """The HorizontalPodAutoscalers (KEDA's ScaledObjects make one each) that scale the pools' workloads, by the
        workload's namespace, kind and name. A namespace whose list fails keeps its last one read; one never read (a
        Role without the grant, say) is warned of once and counts as having none."""
        for namespace in sorted({w.namespace for w in self.workloads.values()}):
            try:
                listed = await self._json(f"listing the HorizontalPodAutoscalers in {namespace}",
                                          self._autoscaling.list_namespaced_horizontal_pod_autoscaler, namespace)
            except ActuationError as exc:
                if namespace not in self._scalers_unlisted:
                    self._scalers_unlisted.add(namespace)
                    log.warning("%s; pools there are scaled as if by the last list (%s)", exc,
                                "none yet" if namespace not in self._scalers else "kept")
                continue
            self._scalers_unlisted.discard(namespace)
            found: dict[tuple[str, str, str], str] = {}
            for hpa in listed["items"]:
                ref = dig(hpa, ("spec", "scaleTargetRef"), {}) or {}
                kind, group = str(ref.get("kind")), str(ref.get("apiVersion", "")).rpartition("/")[0]
                if kind in KINDS and group == KINDS[kind].group:
                    found[(namespace, kind, str(ref.get("name")))] = \
                        f"HorizontalPodAutoscaler {namespace}/{dig(hpa, ('metadata', 'name'))}"
            self._scalers[namespace] = found
        return {key: hpa for found in self._scalers.values() for key, hpa in found.items()}

    async def _router(self) -> tuple[float | None, str | None]:
        """When the router's current revision replaced another, and its pod template's digest (None for either: no
        router, no change, or it cannot be read; the pools stay known, only the router's revision is not)."""
        router = self.settings.router
        if router is None:
            return None, None
        try:
            obj = await self._read(router)
        except ActuationError as exc:
            log.warning("the router cannot be read: %s", exc)
            return None, None
        digest = await self._template_digest(router, obj)
        try:
            return await self._revision_time(router, obj), digest
        except ActuationError as exc:  # its ReplicaSets cannot be listed: when it last changed is not known
            log.warning("the router's revision cannot be read: %s", exc)
            return None, digest

    async def _observe_pool(self, w: Workload) -> tuple[PoolReplicas, float | None]:
        """One pool's replicas as its workload reports them, and when its current revision replaced another."""
        obj = await self._read(w)
        kind = KINDS[w.kind]
        desired = int(dig(obj, ("spec", "replicas"), 1))
        size = _gang(w, obj)
        template = await self._template_digest(w, obj)
        # The budget counts replicas, a LeaderWorkerSet's whole groups: the engines a rollout restarts at once are as
        # many groups' engines.
        budget = _budget(dig(obj, kind.max_unavailable, "25%" if w.kind in _QUARTER else 1), desired) \
            if kind.max_unavailable else None
        replicas = PoolReplicas(
            desired * size, int(dig(obj, ("status", "readyReplicas"), 0) or 0) * size,
            max_unavailable=budget * size if budget is not None else None,
            gang=size, rolling=_rolling(w.kind, obj), template=template)
        return replicas, await self._revision_time(w, obj)

    async def _template_digest(self, w: Workload, obj: Mapping[str, Any]) -> str | None:
        """The digest of the pod template `w`'s engines run (None where the Deployment a Rollout follows cannot be read:
        its count is still known, its template not)."""
        try:
            holder, held = await self._template_holder(w, obj)
        except ActuationError as exc:
            log.warning("the pod template of %s %s/%s cannot be read: %s", w.kind, w.namespace, w.name, exc)
            return None
        return _digest(dig(held, KINDS[holder.kind].revision))

    async def _template_holder(self, w: Workload, obj: Mapping[str, Any]) -> tuple[Workload, Mapping[str, Any]]:
        """The workload whose pod template `w`'s engines run, as read: `w` itself, or the Deployment an Argo Rollout
        names in `spec.workloadRef` (its controller follows that Deployment's template, which is where changes go)."""
        ref = dig(obj, ("spec", "workloadRef"))
        # With a workloadRef its controller follows the Deployment's template whatever its own holds (one left empty,
        # as conversions write it).
        if w.kind != "Rollout" or not isinstance(ref, Mapping):
            return w, obj
        if ref.get("kind") != "Deployment" or not ref.get("name"):
            raise ActuationError(f"Rollout {w.namespace}/{w.name} refers to {ref.get('kind')} {ref.get('name')}: only a "
                                 "Deployment's pod template can be read and changed")
        holder = Workload(kind="Deployment", namespace=w.namespace, name=str(ref["name"]), container=w.container)
        return holder, await self._read(holder)

    async def _pod_selector(self, w: Workload, obj: Mapping[str, Any]) -> LabelSelector:
        """`_selector`, or for an Argo Rollout without one of its own, the selector of the Deployment it follows: its
        controller takes that one."""
        if w.kind == "Rollout" and not dig(obj, ("spec", "selector")) and dig(obj, ("spec", "workloadRef")):
            holder, held = await self._template_holder(w, obj)
            return _selector(holder, held)
        return _selector(w, obj)

    async def _replica_sets(self, w: Workload, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The ReplicaSets the workload (a Deployment or an Argo Rollout) owns, newest revision first."""
        selector = await self._pod_selector(w, obj)
        items = (await self._json(f"listing the ReplicaSets of {w.namespace}/{w.name}",
                                  self._apps.list_namespaced_replica_set, w.namespace,
                                  label_selector=str(selector)))["items"]
        uid = dig(obj, ("metadata", "uid"))
        mine = [rs for rs in items
                if uid is None or any(o.get("uid") == uid for o in dig(rs, ("metadata", "ownerReferences"), []) or [])]
        return sorted(mine, key=_revision_number, reverse=True)

    async def _revision_time(self, w: Workload, obj: Mapping[str, Any]) -> float | None:
        """When the workload's current revision replaced another (a Deployment's or an Argo Rollout's newest
        ReplicaSet, when there is an older one; a first revision is no change)."""
        if w.kind not in _SPLITS:
            return None
        try:
            sets = await self._replica_sets(w, obj)
        except ActuationError as exc:  # its count stays known; only when it changed is not
            log.warning("when %s %s/%s last changed cannot be read: %s", w.kind, w.namespace, w.name, exc)
            return None
        stamp = dig(sets[0], ("metadata", "creationTimestamp")) if len(sets) >= 2 else None
        if not stamp:
            return None
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()

    # carrying out -------------------------------------------------------------------------------

    async def applied(self, order: Order) -> Mapping[str, Any] | bool | None:
        """What the change reported, where the workload carries this action's annotation; False where it does not,
        None where it cannot tell."""
        if isinstance(order.change, Drain | Cordon):
            return False  # its start is made again at no cost (each step is idempotent), or released (`release`)
        w = self._workload(order)
        if w is None:
            return None
        obj = await self._read(w)
        if _stamped(obj, order):
            return _applied(obj, order, f"{w.kind} {w.namespace}/{w.name}")
        if isinstance(order.change, ScaleTo) and order.from_replicas is not None:
            # The count is written, then stamped: a leader stopped between the two left the count this scale asked
            # for, away from the one it was approved at, and no stamp. Read as not made, it was recorded as never
            # applied while the pool ran at it, with no cooldown after it (as `_count_as_approved`, the same count
            # is this scale's own write, or the same wish).
            _, desired = _engines(w, obj)
            if desired == order.change.replicas != order.from_replicas:
                return {"scaled": f"{w.kind} {w.namespace}/{w.name}", "replicas": desired,
                        "unstamped": "found by its count: the stamp after it was not written"}
        if isinstance(order.change, Speculation | Eplb):  # a Rollout's change lands on the Deployment it follows first
            holder, held = await self._template_holder(w, obj)
            if holder is not w and _stamped(held, order):
                return _applied(held, order, f"{holder.kind} {holder.namespace}/{holder.name}")
        return False

    async def release(self, order: Order) -> str:
        """Route again the engines `order` took out of routing (they carry its stamp and no routing label): a stopped
        leader began its drain, and it will not be carried out. For a cordon, every configured pool's (the node stays
        cordoned: that much is its point)."""
        w = self.workloads.get(order.pool)
        if w is None:
            return "nothing to release: no workload is configured for the pool"
        pools = sorted(self.workloads) if isinstance(order.change, Cordon) else [order.pool]
        said = []
        for name in pools:  # each pool on its own: one that cannot be read leaves the others' engines to route
            other = self.workloads[name]
            try:
                obj = await self._read(other)
                out = [p for p, meta in (await self._pods_of(other, obj)).items()
                       if dig(meta, ("annotations", ACTION_ANNOTATION)) == order.stamp
                       and not self._routed(meta)]
            except _Missing:
                continue  # no such workload: no engines of it anywhere
            except ActuationError as exc:
                said.append(f"{name}'s engines not looked at ({exc}): route any it drained by hand")
                continue
            if out:
                said.append(await self._back_in(order, other, obj, sorted(out)))
        return "; ".join(said) or "nothing was taken out of routing"

    def _workload(self, order: Order) -> Workload | None:
        change = order.change
        if isinstance(change, RollBack) and change.workload == "router":
            return self.settings.router
        if isinstance(change, ScaleTo | Speculation | Eplb | RollBack):
            return self.workloads.get(order.pool)
        return None

    async def carry_out(self, order: Order) -> dict[str, Any]:
        change = order.change
        if isinstance(change, Drain | Cordon):
            return await self._begin_drain(order)
        w = self._workload(order)
        if w is None:
            raise ActuationError(f"{order.kind} on {order.pool}: no workload is configured for it")
        obj = await self._read(w)
        if _stamped(obj, order):
            # A leader that died after the write: the change is made; never make it twice.
            return _applied(obj, order, f"{w.kind} {w.namespace}/{w.name}")
        if isinstance(change, ScaleTo):
            return await self._scale(order, w, obj, change)
        what = f"{describe(change)} on {w.kind} {w.namespace}/{w.name}"
        try:
            if isinstance(change, Speculation | Eplb):
                return await self._retrying(what, order, w, obj,
                                            lambda current: self._set_args(order, w, change, current))
            if isinstance(change, RollBack):
                return await self._retrying(what, order, w, obj, lambda current: self._rollback(order, w, current))
        except _Unanswered as exc:
            return await self._landed(order, exc)
        raise ActuationError(f"the Kubernetes actuator cannot carry out {type(change).__name__}")

    async def _landed(self, order: Order, unanswered: _Unanswered) -> dict[str, Any]:
        """A change whose write went unanswered, found made after all (the workload carries its stamp); the error
        otherwise: an action is failed only once the fleet shows it was not made."""
        try:
            found = await self.applied(order)
        except ActuationError as exc:
            raise ActuationError(f"{unanswered}; whether it was made cannot be read ({exc})") from None
        if not found:
            raise unanswered
        log.warning("action %d: %s, but the change is made", order.action_id, unanswered)
        return {**(found if isinstance(found, Mapping) else {}), "unanswered": str(unanswered)}

    def _stamp(self, order: Order) -> dict[str, Any]:
        return {"metadata": {"annotations": {ACTION_ANNOTATION: order.stamp}}}

    async def _scale(self, order: Order, w: Workload, obj: Mapping[str, Any], change: ScaleTo) -> dict[str, Any]:
        size, desired = _engines(w, obj)
        if change.replicas >= desired:  # every read it writes from is checked against the approval there
            try:
                return await self._retrying(f"scaling {w.kind} {w.namespace}/{w.name}", order, w, dict(obj),
                                            lambda current: self._scale_up(order, w, current, change))
            except _Unanswered as exc:
                # The fresh read after a conflict went unanswered, and the conflict may be with its own first write
                # (stored, its answer lost): the count read back tells. (A write left unanswered raises here too,
                # once its own read-back found the count unwritten or unreadable: read once more.)
                if not await self._counts(w, change.replicas // size):
                    raise
                log.warning("action %d: %s, but the count reads as written", order.action_id, exc)
                return await self._scaled(order, w, {"scaled": f"{w.kind} {w.namespace}/{w.name}",
                                                     "replicas": change.replicas // size, "unanswered": str(exc)})
        _count_as_approved(order, w, desired, change)
        # Scale down by draining: the engines that will go leave routing first.
        victims, _ = await self._victims(order, w, obj, change.replicas)
        await self._take_out(order, w, obj, victims, change.replicas)
        return {"wait": {"phase": "draining", "pods": victims, "namespace": w.namespace, "replicas": change.replicas,
                         "from": desired, "deadline": self.clock() + self.settings.drain_grace, "then": "scale"}}

    async def _scale_up(self, order: Order, w: Workload, obj: Mapping[str, Any], change: ScaleTo) -> dict[str, Any]:
        """Write a count no lower than the workload's, as read, onto the version read."""
        size, desired = _engines(w, obj)
        _count_as_approved(order, w, desired, change)
        if change.replicas < desired:  # raised by someone else since: a lower count now needs a drain
            raise ActuationError(f"{w.kind} {w.namespace}/{w.name} went to {desired} engines, more than the "
                                 f"{change.replicas} asked for: not scaled")
        return await self._set_replicas(order, w, change.replicas // size,
                                        version=dig(obj, ("metadata", "resourceVersion")))

    async def _victims(self, order: Order, w: Workload, obj: Mapping[str, Any], replicas: int
                       ) -> tuple[list[str], set[str]]:
        """The live engines that scaling `w` (as read) down to `replicas` engines removes and are to drain, and those
        it keeps."""
        split = _SPLITS.get(w.kind)
        sets = await self._replica_sets(w, obj) if split is not None else None
        pods = await self._pods_of(w, obj, sets)
        size, desired = _engines(w, obj)
        sizes = split(obj, sets, replicas) if split is not None and sets is not None else None
        return _leaving(w, pods, replicas // size, desired - replicas, order,
                        first=int(dig(obj, ("spec", "ordinals", "start"), 0) or 0), sizes=sizes)

    async def _take_out(self, order: Order, w: Workload, obj: Mapping[str, Any], pods: Sequence[str],
                        replicas: int) -> None:
        """Take the engines a scale-down removes out of routing, at the lowest deletion cost; all back in if one
        fails (the one that failed too: a write left unanswered may be stored all the same)."""
        done: list[str] = []
        try:
            for pod in pods:
                done.append(pod)
                await self._unroute(order, w.namespace, pod, cost=DRAINED_COST)
                await self._pod_event(order, w.namespace, pod, f"taken out of routing to scale to {replicas}")
        except ActuationError as exc:
            raise ActuationError(f"{exc}; {await self._back_in(order, w, obj, done)}") from None

    async def _set_replicas(self, order: Order, w: Workload, replicas: int, *, drained: Mapping[str, Any] | None = None,
                            pods: Sequence[str] = (), version: str | None = None) -> dict[str, Any]:
        """Scale through the subresource, then stamp the workload. With `drained` (the workload as read) a scale that
        is refused puts the drained `pods` back in routing; once the count is written they stay out, whatever follows.
        With `version` (the workload's resourceVersion as read) the count is written only onto that version: a scale
        by someone else since is not overwritten (`_Conflict`)."""
        kind = KINDS[w.kind]
        body: dict[str, Any] = {"spec": {"replicas": replicas}}
        if version is not None:
            body["metadata"] = {"resourceVersion": version}
        done: dict[str, Any] = {"scaled": f"{w.kind} {w.namespace}/{w.name}", "replicas": replicas}
        try:
            await self._call(f"scaling {w.kind} {w.namespace}/{w.name}",
                             self._custom.patch_namespaced_custom_object_scale, kind.group, kind.version, w.namespace,
                             kind.plural, w.name, body, **self._writes())
        except ActuationError as exc:
            written = await self._counts(w, replicas) if isinstance(exc, _Unanswered) else False
            if written:
                log.warning("action %d: %s, but the count reads as written", order.action_id, exc)
                done["unanswered"] = str(exc)
            elif drained is None:
                raise
            elif written is None:
                # Routed again, they might be the engines the controller then removes while they serve.
                raise ActuationError(f"{exc}; whether the count was written cannot be read: {', '.join(pods)} stay out "
                                     "of routing (route them again by hand if the count is unchanged)") from None
            else:
                raise ActuationError(f"{exc}; {await self._back_in(order, w, drained, pods)}") from None
        return await self._scaled(order, w, done)

    async def _scaled(self, order: Order, w: Workload, done: dict[str, Any]) -> dict[str, Any]:
        """Stamp a workload whose count is written, and say so in an Event."""
        try:
            await self._patch(w, self._stamp(order), f"annotating {w.kind} {w.namespace}/{w.name}")
        except (ActuationError, _Conflict) as exc:
            # The count is written: the change is made, and what follows it (the check that drained engines went)
            # must run. Unstamped, a new leader reads the pool's count instead, which a redo's rails compare.
            log.warning("%s %s/%s is scaled to %d, but not stamped with action %d: %s", w.kind, w.namespace, w.name,
                        done["replicas"], order.action_id, exc)
            done["unstamped"] = str(exc)
        await self._event(order, w, f"scaled to {done['replicas']}")
        return done

    async def _counts(self, w: Workload, replicas: int) -> bool | None:
        """Whether `w` asks for `replicas` now (None where it cannot be read): an unanswered scale made after all."""
        if self.dry_run:
            return False  # a dry run's write changes nothing to read back
        try:
            return int(dig(await self._read(w), ("spec", "replicas"), 1)) == replicas
        except ActuationError as exc:
            log.warning("%s %s/%s: its count cannot be read back: %s", w.kind, w.namespace, w.name, exc)
            return None

    async def _set_args(self, order: Order, w: Workload, change: Speculation | Eplb,
                        obj: Mapping[str, Any]) -> dict[str, Any]:
        holder, held = await self._template_holder(w, obj)
        if holder is not w and _stamped(held, order):
            # The referenced template carries the change already (the Rollout's stamp was lost): not made twice.
            done = _applied(held, order, f"{holder.kind} {holder.namespace}/{holder.name}")
            await self._stamp_follower(order, w, dig(held, ("metadata", "annotations", RESULT_ANNOTATION)))
            return done
        _rolled_out(f"{describe(change)} on {w.kind} {w.namespace}/{w.name}", w.kind, obj)
        _template_as_approved(order, holder, held)
        where = f"{holder.kind} {holder.namespace}/{holder.name}"
        annotations = dict(dig(held, ("metadata", "annotations"), {}) or {})
        body: dict[str, Any] = {}
        detail: dict[str, Any] = {}
        for path, template, engine in _engine_templates(held, KINDS[holder.kind], w.container, where):
            detail = _changed_flags(engine, change, annotations, f"{where} ({'.'.join(path[1:])})")
            _set_in(body, path, template)
        annotations[ACTION_ANNOTATION] = order.stamp
        annotations[RESULT_ANNOTATION] = json.dumps({"stamp": order.stamp, "result": detail}, separators=(",", ":"))
        body["metadata"] = {"resourceVersion": dig(held, ("metadata", "resourceVersion")), "annotations": annotations}
        await self._patch(holder, body, f"patching the pod template of {where}")
        if holder is not w:
            await self._stamp_follower(order, w, annotations[RESULT_ANNOTATION])
        await self._event(order, w, describe(change))
        return {"patched": where, "container": w.container, **detail}

    async def _stamp_follower(self, order: Order, w: Workload, result: str | None) -> None:
        """Stamp a Rollout whose Deployment's template carries the change, with the change's `result`: for the audit
        only, as the Deployment's stamp already says the change is made (`applied`), so a failure is logged, not the
        action's."""
        stamp = self._stamp(order)
        if result is not None:
            stamp["metadata"]["annotations"][RESULT_ANNOTATION] = result
        try:
            await self._patch(w, stamp, f"annotating Rollout {w.namespace}/{w.name}")
        except ActuationError as exc:
            log.warning("action %d: %s", order.action_id, exc)

    async def _rollback(self, order: Order, w: Workload, obj: Mapping[str, Any]) -> dict[str, Any]:
        # Rolled back (or forward) by someone else since it was approved: undoing once more would bring back the
        # revision that was rolled away from, or abort a new rollout.
        if order.from_template is not None:
            _template_as_approved(order, *await self._template_holder(w, obj))
        if w.kind == "Rollout":
            kind = KINDS[w.kind]
            try:
                await self._call(f"aborting Rollout {w.namespace}/{w.name}",
                                 self._custom.patch_namespaced_custom_object_status, kind.group, kind.version,
                                 w.namespace, kind.plural, w.name, {"status": {"abort": True}}, **self._writes())
            except _Unanswered:
                # The abort may have been stored all the same (its stamp follows it, in a write of its own).
                if self.dry_run or dig(await self._read(w), ("status", "abort")) is not True:
                    raise
            try:
                await self._patch(w, self._stamp(order), f"annotating Rollout {w.namespace}/{w.name}")
            except ActuationError as exc:
                # The abort is made: failing the action would say the rollout runs on. Unstamped, a take-over aborts
                # once more, which is the same abort.
                log.warning("action %d: aborted, but %s", order.action_id, exc)
            await self._event(order, w, "aborted the rollout: back to the stable revision")
            return {"aborted": f"Rollout {w.namespace}/{w.name}"}
        if w.kind != "Deployment":
            raise ActuationError(f"rolling back a {w.kind} is not supported: only Deployments and Argo Rollouts")
        _rolled_out(f"rolling back Deployment {w.namespace}/{w.name}", w.kind, obj)
        sets = await self._replica_sets(w, obj)
        if len(sets) < 2:
            raise ActuationError(f"Deployment {w.namespace}/{w.name} has no previous revision to roll back to")
        previous = sets[1]
        template = copy.deepcopy(dig(previous, ("spec", "template"), {}))
        labels = dict(dig(template, ("metadata", "labels"), {}) or {})
        labels.pop("pod-template-hash", None)  # the controller's own label, as `kubectl rollout undo` drops it
        template.setdefault("metadata", {})["labels"] = labels
        revision = dig(previous, ("metadata", "annotations", REVISION))
        # A merge patch keeps every map key it does not name: the bad revision's own keys are named, as null.
        body = {"metadata": {"resourceVersion": dig(obj, ("metadata", "resourceVersion")),
                             "annotations": {ACTION_ANNOTATION: order.stamp}},
                "spec": {"template": _merge_to(dig(obj, ("spec", "template"), {}) or {}, template)}}
        await self._patch(w, body, f"rolling back Deployment {w.namespace}/{w.name}")
        await self._event(order, w, f"rolled back to revision {revision}")
        return {"rolled_back": f"Deployment {w.namespace}/{w.name}", "to_revision": revision}

    # draining -------------------------------------------------------------------------------------

    async def _pods_of(self, w: Workload, obj: Mapping[str, Any], sets: Sequence[Mapping[str, Any]] | None = None
                       ) -> dict[str, dict[str, Any]]:
        """The workload's live pods and their metadata: those its selector matches that no other object controls
        (`sets`: a Deployment's or Rollout's ReplicaSets, where the caller has listed them)."""
        selector = await self._pod_selector(w, obj)
        listed = await self._json(f"listing the pods of {w.kind} {w.namespace}/{w.name}", self._core.list_namespaced_pod,
                                  w.namespace, label_selector=str(selector))
        # Another workload's pods can carry the same labels (a second Deployment, the Deployment an Argo Rollout
        # replaced): a pod controlled by anything but this workload's own is never drained, evicted or counted. An
        # orphan stays in: its labels are the workload's, and its controller may adopt it.
        if w.kind in _SPLITS:
            owners: set[tuple[str, str]] | None = {
                ("ReplicaSet", str(dig(rs, ("metadata", "name")))) for rs in
                (sets if sets is not None else await self._replica_sets(w, obj))}
        else:  # a LeaderWorkerSet's pods belong to StatefulSets and pods it owns; its name label is its controller's
            owners = {(w.kind, w.name)} if w.kind == "StatefulSet" else None
        # As the controllers count them: a pod being deleted, or one that ended (evicted, completed), is no replica.
        return {p["metadata"]["name"]: {**p["metadata"], "ready": pod_ready(p), "phase": dig(p, ("status", "phase")),
                                        "node": dig(p, ("spec", "nodeName"))}
                for p in listed["items"] if not dig(p, ("metadata", "deletionTimestamp"))
                and dig(p, ("status", "phase")) not in ("Failed", "Succeeded")
                and selector.matches(dig(p, ("metadata", "labels")))
                and (owners is None or (ref := _controller(p["metadata"])) is None or ref in owners)}

    async def _unroute(self, order: Order, namespace: str, pod: str, cost: int | None = None) -> None:
        """Take a pod out of the router's pool (its routing label removed) and mark it with the action."""
        annotations: dict[str, Any] = {ACTION_ANNOTATION: order.stamp}
        if cost is not None:
            annotations[DELETION_COST] = str(cost)
        body = {"metadata": {"labels": {self.settings.routing_label: None}, "annotations": annotations}}
        await self._patch_pod(f"taking pod {namespace}/{pod} out of routing", namespace, pod, body)

    async def _reroute(self, order: Order, namespace: str, pod: str, value: str) -> None:
        """Put a pod this action took out of routing back in, at the normal deletion cost."""
        body = {"metadata": {"labels": {self.settings.routing_label: value},
                             "annotations": {DELETION_COST: None, ACTION_ANNOTATION: order.stamp}}}
        await self._patch_pod(f"putting pod {namespace}/{pod} back into routing", namespace, pod, body)

    async def _patch_pod(self, what: str, namespace: str, pod: str, body: Mapping[str, Any]) -> None:
        """A pod's routing label and annotations patched, again once on a conflict (the patch holds no version to lose
        to; a webhook or the server's own retries may answer 409 all the same), then an ActuationError: the callers
        route back what they took out on one, and a conflict that escaped them left engines out of routing for good."""
        for attempt in (1, 2):
            try:
                await self._call(what, self._core.patch_namespaced_pod, pod, namespace, body, **self._writes())
                return
            except _Conflict as exc:
                if attempt == 2:
                    raise ActuationError(f"{what}: 409 conflict twice: {exc}") from None
                log.info("%s: conflict (%s); once more", what, exc)

    async def _begin_drain(self, order: Order) -> dict[str, Any]:
        change = order.change
        w = self.workloads.get(order.pool)
        if w is None:
            raise ActuationError(f"{order.kind} on {order.pool}: no workload is configured for it")
        if isinstance(change, Drain):
            try:
                await self._unroute(order, w.namespace, change.pod)
            except _Missing:  # gone already (a drain taken over after its eviction): what it was for
                return {"drained": [change.pod], "already_gone": True}
            except _Unanswered as exc:
                # Stored, perhaps, with its answer lost: routed again, or it would run on and serve nothing.
                raise ActuationError(f"{exc}; {await self._back_in(order, w, {}, [change.pod])}") from None
            await self._pod_event(order, w.namespace, change.pod, "taken out of routing to drain")
            return {"wait": {"phase": "draining", "pods": [change.pod], "namespace": w.namespace, "then": "delete",
                             "deadline": self.clock() + self.settings.drain_grace}}
        assert isinstance(change, Cordon)
        node = change.node
        await self._call(f"cordoning node {node}", self._core.patch_node, node,
                         {"spec": {"unschedulable": True},
                          "metadata": {"annotations": {ACTION_ANNOTATION: order.stamp}}}, **self._writes())
        await self._node_event(order, node)
        on = await self._engines_on(node, order.pool)
        kept = {} if self.dry_run else _kept(on, order)
        moving = sorted(p for p in on.owners if not any(p in members for members in kept.values()))
        wait: dict[str, Any] = {"phase": "evicting", "pods": moving, "namespace": w.namespace, "then": "evict",
                                "node": node, "pools": on.owners, "deadline": self.clock() + self.settings.drain_grace,
                                # Each engine's namespace as it is now: a fleet file changed before a take-over
                                # resumes the wait must not move an engine to another namespace's pod of its name.
                                "namespaces": {p: self.workloads[owner].namespace for p, owner in on.owners.items()}}
        if on.unmoved:
            wait["unmoved"] = on.unmoved
        if on.leaders:
            wait["groups"] = on.leaders
        if kept:
            wait |= {"kept": kept, "kept_until": self.clock() + self.settings.cordon_hold}
        done: list[str] = []
        try:
            for pod in wait["pods"]:
                done.append(pod)  # before the write, as a scale-down's: one left unanswered may be stored
                await self._unroute(order, _namespace_of(self.workloads, order, wait, pod), pod)
        except ActuationError as exc:
            raise ActuationError(f"{exc}; {await self._back_in_each(order, wait, done)}") from None
        return {"wait": wait}

    async def _engines_on(self, node: str, pool: str) -> _OnNode:
        """The engines a cordon of `node` asked for by `pool` moves, each with its pool: every configured pool's, in any
        namespace (the faulty GPU may serve any of them; the loop's view of their load comes with the order), and a
        gang's whole group where one of its engines is there (its workload recreates the group). Also the pools whose
        engines stay there, with why: their workload cannot be read (`pool`'s own must be), or an engine of theirs
        shares a name with another pool's in another namespace (a wait names engines as the loop's numbers do);
        each gang engine's group leader, the one pod evicted for the group; the pools with an engine elsewhere that
        is ready and routed; and the engines there still routed."""
        owners: dict[str, str] = {}
        unmoved: dict[str, str] = {}
        leaders: dict[str, str] = {}
        serving: set[str] = set()
        routed: set[str] = set()
        for name, other in sorted(self.workloads.items(), key=lambda item: item[0] != pool):  # the asking pool first
            try:
                pods = await self._pods_of(other, await self._read(other))
            except ActuationError as exc:
                if name == pool:
                    raise
                if isinstance(exc, _Missing):
                    continue  # no such workload: no engines of it anywhere
                log.warning("cordoning %s: the engines of pool %s are left there: %s", node, name, exc)
                unmoved[name] = str(exc)
                continue
            there = {p for p, meta in pods.items() if meta["node"] == node}
            if other.kind == "LeaderWorkerSet":
                groups = {dig(pods[p], ("labels", LWS_GROUP)) for p in there}
                members: dict[Any, list[str]] = {}
                for p, meta in sorted(pods.items()):
                    if (group := dig(meta, ("labels", LWS_GROUP))) in groups:
                        members.setdefault(group, []).append(p)
                for group_pods in members.values():
                    head = next((p for p in group_pods if dig(pods[p], ("labels", LWS_WORKER)) == "0"), group_pods[0])
                    leaders.update(dict.fromkeys(group_pods, head))
                    there |= set(group_pods)
            if clash := sorted(p for p in there if p in owners):
                log.warning("cordoning %s: pool %s's %s share a name with pool %s's engines: left there", node, name,
                            ", ".join(clash), owners[clash[0]])
                unmoved[name] = f"{', '.join(clash)} share a name with pool {owners[clash[0]]}'s engines"
                continue
            owners.update(dict.fromkeys(there, name))
            if any(self._serves(meta) for p, meta in pods.items() if p not in there):
                serving.add(name)
            routed |= {p for p in there if self._routed(pods[p])}
        return _OnNode(owners, unmoved, leaders, serving, routed)

    def _routed(self, meta: Mapping[str, Any]) -> bool:
        """Whether a pod (as `_pods_of` lists it) carries the routing label."""
        return self.settings.routing_label in (meta.get("labels") or {})

    def _serves(self, meta: Mapping[str, Any]) -> bool:
        """Whether a pod (as `_pods_of` lists it) is ready and routed."""
        return bool(meta["ready"]) and self._routed(meta)

    async def _back_in_each(self, order: Order, wait: Mapping[str, Any], pods: Sequence[str]) -> str:
        """`_back_in` for each pool's pods, at that pool's routing value (a cordon's wait names each pod's pool), and
        the pools a cordon left on the node."""
        owners: Mapping[str, str] = wait.get("pools") or {}
        by_pool: dict[str, list[str]] = {}
        for pod in pods:
            pool = owners.get(pod, order.pool)
            by_pool.setdefault(pool if pool in self.workloads else order.pool, []).append(pod)
        said = [await self._back_in(order, self.workloads[pool], {}, names)
                for pool, names in sorted((by_pool or {order.pool: []}).items())]
        if wait.get("unmoved"):
            said.append(f"the engines of {', '.join(sorted(wait['unmoved']))} are still on the node (not read)")
        return "; ".join(said)

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        if wait["then"] == "verify":
            return await self._verify_removed(order, wait, now)
        if wait.get("kept"):
            wait = await self._release_kept(order, wait, now)
        pods: list[str] = list(wait["pods"])
        idle = [p for p in pods if order.idle(p)]
        late = now >= float(wait["deadline"])
        if wait["then"] == "evict":
            # Gone already, or a new pod under its name (a StatefulSet's; a gang's group recreated): not evicted again.
            if (stamped := await self._stamped_pods(order, wait)) is not None:
                pods = [p for p in pods if p in stamped]
            # Evict once idle (or at the grace's end): the Eviction API honours PodDisruptionBudgets. A gang goes as
            # one once all of it is idle: its leader is evicted, and its LeaderWorkerSet recreates the whole group
            # elsewhere (evicting each engine would recreate the group once per engine, busy ones included).
            groups: dict[str, list[str]] = {}
            for p in pods:
                groups.setdefault((wait.get("groups") or {}).get(p, p), []).append(p)
            # Judged by the members that report requests (a late count waits), the leader always: a Ray worker of a
            # gang runs no vLLM server and reports none.
            due = [key for key, members in sorted(groups.items())
                   if late or all(m in idle for m in members if m == key or m in order.counted or len(members) == 1)]
            heads = [key if key in groups[key] else groups[key][0] for key in due]
            busy = [p for key, members in sorted(groups.items()) if key not in due for p in members]
            riding = [p for key, head in zip(due, heads, strict=True) for p in groups[key] if p != head]
            refused = set(await self._evict_all(order, wait, heads, [*busy, *riding]))
            left = [p for key, head in zip(due, heads, strict=True) if head in refused for p in groups[key]] + busy
            # As for a drain, one more grace for the budget: engines busy until the grace's end are all evicted at
            # once, and a budget of one lets the first go and refuses the next until its replacement is ready.
            gone = [*wait.get("evicted", []), *(p for p in pods if p not in left)]
            if (left and now < float(wait["deadline"]) + (self.settings.drain_grace if late else 0.0)) or (
                    wait.get("kept") and not left):
                return {"wait": {**wait, "pods": left, **({"evicted": gone} if gone else {})}}
            if left:
                raise ActuationError(f"node {wait['node']}: {', '.join(left)} could not be evicted within "
                                     f"{self.settings.drain_grace:g}s of the grace's end (a PodDisruptionBudget "
                                     f"refused); {await self._back_in_each(order, wait, left)}")
            done = {"cordoned": wait["node"], "evicted": gone, "waited_for_idle": not late}
            if wait.get("kept_back"):
                done["kept_back"] = wait["kept_back"]
            return {**done, "unmoved": wait["unmoved"]} if wait.get("unmoved") else done
        if len(idle) < len(pods) and not late:
            return {"wait": wait}
        detail = {"drained": pods, "idle": len(idle) == len(pods), "waited_s": round(now - float(wait["deadline"])
                                                                                   + self.settings.drain_grace, 1)}
        if wait["then"] == "scale":
            return await self._scale_drained(order, wait, pods, detail, now)
        live = await self._live_pods(order)
        # A new pod under the drained one's name (a StatefulSet's) means the drained one is gone.
        going = [p for p in pods if p not in live or dig(live[p], ("annotations", ACTION_ANNOTATION)) == order.stamp]
        # Evicted, not deleted: a PodDisruptionBudget that allows no disruption now keeps the engine until it does.
        if left := await self._evict_all(order, wait, going):
            if now < float(wait["deadline"]) + self.settings.drain_grace:  # one more grace for the budget
                return {"wait": {**wait, "pods": left}}
            raise ActuationError(f"{', '.join(left)} drained but not evicted within {self.settings.drain_grace:g}s (a "
                                 "PodDisruptionBudget refused); "
                                 f"{await self._back_in(order, self.workloads[order.pool], {}, left)}")
        return detail

    async def _release_kept(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        """Take out of routing, to be evicted, the engines a cordon kept serving for a pool, once another engine of
        the pool is ready and routed off the node (or `cordon_hold` has passed: the node is faulty, and its
        replacements may never come); those it evicted already are remembered, as the wait names only what is left."""
        kept: dict[str, list[str]] = dict(wait["kept"])
        due = now >= float(wait["kept_until"])
        released: dict[str, str] = {}
        moved: list[str] = []  # every pool's, before each write: one left unanswered may be stored
        try:
            for pool, members in sorted(kept.items()):
                pods = await self._pods_now(order, pool)
                # Another engine serving off the node: not one of the kept group's own (a group spans nodes), which
                # released it the tick after it was kept.
                if not due and (pods is None or not any(self._serves(meta) for p, meta in pods.items()
                                                        if meta["node"] != wait["node"] and p not in members)):
                    continue
                # Only what is still there as kept: a pod gone, or made again elsewhere under its name (a StatefulSet's,
                # a group recreated), is no longer the cordon's to move. A group goes whole while any of it is on the
                # node: its leader is evicted for it, and routed alone it would serve as its worker went.
                alive = [p for p in members if pods is None or p in pods]
                on_node = [p for p in alive if pods is None or pods[p]["node"] == wait["node"]]
                here = alive if on_node and len(members) > 1 else on_node
                for pod in here:
                    moved.append(pod)
                    try:
                        await self._unroute(order, _namespace_of(self.workloads, order, wait, pod), pod)
                    except _Missing:
                        moved.remove(pod)
                del kept[pool]
                released |= {p: ("gone" if p not in moved else "hold ended" if due else "replaced") for p in members}
        except ActuationError as exc:
            raise ActuationError(f"{exc}; {await self._back_in_each(order, wait, [*wait['pods'], *moved])}") from None
        if not released:
            return wait
        out = {**wait, "pods": sorted({*wait["pods"], *moved}), "kept": kept,
               "kept_back": {**wait.get("kept_back", {}), **released},
               # Their own grace to finish what they serve, from now.
               "deadline": max(float(wait["deadline"]), now + self.settings.drain_grace)}
        if not kept:
            del out["kept"], out["kept_until"]
        return out

    async def _evict_all(self, order: Order, wait: Mapping[str, Any], pods: Sequence[str],
                         waiting: Sequence[str] = ()) -> list[str]:
        """Evict `pods`; those a PodDisruptionBudget refuses for now. On any other failure the ones not evicted, and
        those `waiting` to be, are routed again (they would run and serve nothing) and the error says so."""
        left: list[str] = []
        for i, pod in enumerate(pods):
            try:
                if not await self._evict(_namespace_of(self.workloads, order, wait, pod), pod):
                    left.append(pod)
            except ActuationError as exc:
                rest = left + list(pods[i:]) + list(waiting)
                raise ActuationError(f"{exc}; {await self._back_in_each(order, wait, rest)}") from None
        return left

    async def _scale_drained(self, order: Order, wait: dict[str, Any], pods: list[str], detail: dict[str, Any],
                             now: float) -> dict[str, Any]:
        """Write the count a drain waited for, unless the workload moved meanwhile: scaled already (taken over from a
        leader that stopped), scaled by someone else, or its controller now removing engines not drained yet."""
        w = self.workloads[order.pool]
        for _ in range(3):
            try:
                obj = await self._read(w)
            except ActuationError as exc:  # not scaled: the drained engines would serve nothing
                raise ActuationError(f"{exc}; not scaled; {await self._back_in(order, w, {}, pods)}") from None
            try:
                return await self._scale_drained_as_read(order, wait, pods, detail, now, w, obj)
            except _Conflict as exc:  # the workload changed since it was read: checked again from a fresh read
                log.info("action %d: scaling %s: conflict (%s); reading again", order.action_id, order.pool, exc)
        raise ActuationError(f"{w.kind} {w.namespace}/{w.name} kept changing under three attempts (409 conflict): not "
                             f"scaled; {await self._back_in(order, w, {}, pods)}")

    async def _scale_drained_as_read(self, order: Order, wait: dict[str, Any], pods: list[str], detail: dict[str, Any],
                                     now: float, w: Workload, obj: dict[str, Any]) -> dict[str, Any]:
        """`_scale_drained` on the workload as read; the count is written only if the workload is still as read
        (`_Conflict` otherwise)."""
        size, now_at = _engines(w, obj)
        hpa = self._scalers.get(w.namespace, {}).get((w.namespace, w.kind, w.name))
        if hpa is not None and not _stamped(obj, order):
            # It came while the engines drained: the count is its to set now.
            raise ActuationError(f"{hpa} scales {w.kind} {w.namespace}/{w.name} now: not scaled; "
                                 f"{await self._back_in(order, w, obj, pods)}")
        if _stamped(obj, order) or now_at == int(wait["replicas"]):
            # Scaled already: by a leader that stopped before it could record it, taken over from its wait.
            return self._verifying(w, pods, now, {"already_applied": f"{w.kind} {w.namespace}/{w.name}",
                                                 "replicas": now_at, **detail})
        if "from" in wait and now_at != int(wait["from"]):
            # Someone scaled the workload while its engines drained: setting the count decided before would
            # undo that. The drained engines go back into routing, and the pool is sized again from here.
            raise ActuationError(f"{w.kind} {w.namespace}/{w.name} went from {wait['from']} to {now_at} engines "
                                 f"while {', '.join(pods)} drained: not scaled to {wait['replicas']}; "
                                 f"{await self._back_in(order, w, obj, pods)}")
        victims, kept = await self._victims_now(order, w, obj, int(wait["replicas"])) or ([], set())
        missing = [p for p in victims if p not in pods]
        if missing:
            # The ReplicaSets moved while the engines drained (a rollout went on, an engine went down): the scale
            # now removes engines not drained yet. They drain too, and the scale waits for them.
            try:
                await self._take_out(order, w, obj, missing, int(wait["replicas"]))
            except ActuationError as exc:
                raise ActuationError(f"{exc}; {await self._back_in(order, w, obj, pods)}") from None
            return {"wait": {**wait, "pods": pods + missing,
                             "deadline": max(float(wait["deadline"]), now + self.settings.drain_grace)}}
        # Drained, but the scale keeps it (another engine goes in its place): routed again, at the normal deletion
        # cost, before the count is written, so that the ReplicaSet removes the engines that go and not this one.
        spared = [p for p in pods if p in kept]
        value = await self._routing_value(w, obj) if spared else ""
        if failed := await self._reroute_all(order, w, spared, value):
            raise ActuationError(f"{failed[0][1]}; not scaled; {await self._back_in(order, w, obj, pods, value)}")
        if spared:
            detail["spared"] = spared
        going = [p for p in pods if p not in spared]
        done = {**await self._set_replicas(order, w, int(wait["replicas"]) // size, drained=obj, pods=going,
                                           version=dig(obj, ("metadata", "resourceVersion"))),
                **detail}
        return self._verifying(w, going, now, done)

    async def _victims_now(self, order: Order, w: Workload, obj: Mapping[str, Any], replicas: int
                           ) -> tuple[list[str], set[str]] | None:
        """The engines the scale a drain waited for removes now, and those it keeps; None where that cannot
        be told (a dry run, whose drain marked no pod; a failed read): the drained ones go, as they would have
        without the check."""
        if self.dry_run:
            return None
        try:
            return await self._victims(order, w, obj, replicas)
        except ActuationError as exc:
            log.warning("action %d: which engines scaling %s removes cannot be read again (%s); scaling as drained",
                        order.action_id, order.pool, exc)
            return None

    def _verifying(self, w: Workload, pods: Sequence[str], now: float, done: dict[str, Any]) -> dict[str, Any]:
        """Verified, not assumed: a scale-down ends once its controller has removed the drained engines (`done` is its
        outcome then); a dry run, or one that drained none, ends now."""
        if self.dry_run or not pods:
            return done
        return {"wait": {"phase": "removing", "pods": list(pods), "namespace": w.namespace, "then": "verify",
                         "deadline": now + self.settings.drain_grace, "done": done}}

    async def _verify_removed(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        """After a drained scale-down, wait for the workload's controller to remove the drained engines. One still
        there when the grace ends was not the one removed (the controller chose another, or has not acted): it is
        routed again rather than left serving nothing, and the outcome says so."""
        w = self.workloads[order.pool]
        late = now >= float(wait["deadline"])
        try:
            obj = await self._read(w)
            live = await self._pods_of(w, obj)
        except ActuationError as exc:
            if not late:
                return {"wait": wait}  # read again next tick
            # Not known: routed again (a pod already gone answers 404), rather than maybe left serving nothing.
            return {**wait["done"], "unverified": f"whether the drained engines were removed: {exc}",
                    "routing": await self._back_in(order, w, {}, wait["pods"])}
        left = [p for p in wait["pods"] if _drained(live.get(p), order)]  # not one routed again or new under its name
        if left and not late:
            return {"wait": wait}
        # Gone, or a new pod under its name; not one routed again (spared by a leader that stopped before recording it).
        removed = [p for p in wait["pods"] if dig(live.get(p), ("annotations", ACTION_ANNOTATION)) != order.stamp]
        spared = list(wait.get("spared", []))  # routed again while the others were waited for
        removed = [p for p in removed if p not in spared]
        if not left:
            return {**wait["done"], "removed": removed, **({"not_removed": spared} if spared else {})}
        # A StatefulSet or LeaderWorkerSet removes its highest ordinals one at a time, and (OrderedReady) only once the
        # lower pods are healthy: one still above its count is going, slowly, and routed again now it would be killed
        # later while serving. Those get a few more graces; one the count was raised over meanwhile serves at once.
        going = _due_to_go(w, obj, {p: live[p] for p in left})
        if going and now < float(wait["deadline"]) + REMOVAL_GRACES * self.settings.drain_grace:
            if back := [p for p in left if p not in going]:
                await self._back_in(order, w, obj, back)
                wait = {**wait, "spared": [*spared, *(p for p in back if p not in spared)]}
            return {"wait": wait}
        return {**wait["done"], "removed": removed, "not_removed": [*spared, *left],
                "routing": await self._back_in(order, w, obj, left)}

    async def _stamped_pods(self, order: Order, wait: Mapping[str, Any]) -> set[str] | None:
        """The pods of every pool a cordon's wait moves that still carry its stamp; None where one pool's cannot be
        listed (the pods are then evicted as named, as without the check)."""
        out: set[str] = set()
        for pool in sorted({*(wait.get("pools") or {}).values()} or {order.pool}):
            if (pods := await self._pods_now(order, pool)) is None:
                return None
            out |= {p for p, meta in pods.items() if dig(meta, ("annotations", ACTION_ANNOTATION)) == order.stamp}
        return out

    async def _live_pods(self, order: Order) -> dict[str, dict[str, Any]]:
        """The pool's pods now, to tell a drained pod from a new one under its name; empty where that cannot be told:
        the drained pods are evicted as named, as they would have been without the check."""
        return await self._pods_now(order, order.pool) or {}

    async def _pods_now(self, order: Order, pool: str) -> dict[str, dict[str, Any]] | None:
        """A pool's pods as listed now; None where that cannot be told (no workload configured, a failed read, a dry
        run whose changes stamped nothing)."""
        w = self.workloads.get(pool)
        if w is None or self.dry_run:
            return None
        try:
            return await self._pods_of(w, await self._read(w))
        except ActuationError as exc:
            log.warning("action %d: the pods of %s cannot be listed (%s); evicting the ones it took out as named",
                        order.action_id, pool, exc)
            return None

    async def _back_in(self, order: Order, w: Workload, obj: Mapping[str, Any], pods: Sequence[str],
                       value: str | None = None) -> str:
        """Put the pods a failed scale-down took out of routing back in (they would stay running and serve nothing),
        and say how that went (`value`: the routing label's, where the caller has read it)."""
        value = value or await self._routing_value(w, obj)
        failed = await self._reroute_all(order, w, pods, value)
        if failed:
            return (f"not routed again, set {self.settings.routing_label}={value} by hand: "
                    f"{', '.join(f'{pod} ({exc})' for pod, exc in failed)}")
        return f"the drained engines are routed again ({', '.join(pods) or 'none'})"

    async def _reroute_all(self, order: Order, w: Workload, pods: Sequence[str], value: str
                           ) -> list[tuple[str, ActuationError]]:
        """Route `pods` again, each tried; the pods that failed, with why (a pod gone meanwhile is no failure)."""
        failed: list[tuple[str, ActuationError]] = []
        for pod in pods:
            try:
                await self._reroute(order, w.namespace, pod, value)
            except _Missing:
                pass
            except ActuationError as exc:
                failed.append((pod, exc))
        return failed

    async def _routing_value(self, w: Workload, obj: Mapping[str, Any]) -> str:
        """The routing label's value on the workload's pods (`true` where its template, or the template of the
        Deployment a Rollout follows, does not say or cannot be read)."""
        try:
            holder, held = await self._template_holder(w, obj)
        except ActuationError:
            holder, held = w, obj
        if not held:  # the caller could not read it: one more try, for a label whose value is not `true`
            try:
                holder, held = await self._template_holder(w, await self._read(w))
            except ActuationError:
                pass
        labels = dig(held, (*KINDS[holder.kind].template, "metadata", "labels"), {}) or {}
        return str(labels.get(self.settings.routing_label, "true"))

    async def _evict(self, namespace: str, pod: str) -> bool:
        """Evict one pod; False when a PodDisruptionBudget refuses it for now (HTTP 429), or the pod changed under the
        eviction (409)."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
        if self.dry_run:
            body["deleteOptions"] = {"dryRun": ["All"]}
        try:
            await self._call(f"evicting pod {namespace}/{pod}", self._core.create_namespaced_pod_eviction, pod,
                             namespace, body)
        except _Refused as exc:
            log.info("%s; retried", exc)
            return False
        except _Conflict as exc:  # the pod changed while the eviction deleted it (a Pending pod's status): next tick
            log.info("evicting pod %s/%s: %s; retried", namespace, pod, exc)
            return False
        except _Missing:
            pass  # gone already: what the eviction was for
        return True

    # events -----------------------------------------------------------------------------------------

    async def _event(self, order: Order, w: Workload, note: str) -> None:
        kind = KINDS[w.kind]
        await self._record(order, w.namespace, {"apiVersion": kind.api_version, "kind": w.kind,
                                                "namespace": w.namespace, "name": w.name}, note)

    async def _pod_event(self, order: Order, namespace: str, pod: str, note: str) -> None:
        await self._record(order, namespace, {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod},
                           note)

    async def _node_event(self, order: Order, node: str) -> None:
        await self._record(order, "default", {"apiVersion": "v1", "kind": "Node", "name": node},
                           "cordoned: its engines are evicted")

    async def _record(self, order: Order, namespace: str, regarding: dict[str, Any], note: str) -> None:
        """An Event on the object; a failure to record one never fails the action."""
        now = datetime.datetime.fromtimestamp(self.clock(), tz=datetime.UTC)
        body = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"generateName": f"{CONTROLLER}-", "namespace": namespace},
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "type": "Normal",
            "reason": "".join(part.capitalize() for part in str(order.kind).split("_")),
            "action": str(order.kind), "note": f"action {order.action_id}: {note}. {order.reason}"[:1024],
            "regarding": regarding, "reportingController": f"{CONTROLLER}.io/controller",
            "reportingInstance": self.instance[:128],
        }
        try:
            await asyncio.to_thread(self._events.create_namespaced_event, namespace, body,
                                    _request_timeout=self._timeout, **self._writes())
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("could not record an Event for action %d: %s", order.action_id, exc)


def _engine_templates(held: Mapping[str, Any], kind: WorkloadKind, container: str,
                      where: str) -> list[tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]]:
    """(path, copy of the template, its engine container) for each pod template of `held` that runs vLLM's server.

    Where every pod runs one template, its engine container is the engine, as the fleet file says. A LeaderWorkerSet
    with a leader template runs the server where a container's command says so: in a Ray group only the leader does
    (its workers run `ray start`, which an engine flag would break); with data parallelism over nodes every pod does,
    and all change together.
    """
    found, names = [], []
    for path in kind.templates:
        template = copy.deepcopy(dig(held, path))
        if template is None:
            continue
        containers = dig(template, ("spec", "containers"), []) or []
        names += [str(c.get("name", "?")) for c in containers]
        engine = next((c for c in containers if c.get("name") == container), None)
        if engine is not None:
            found.append((path, template, engine))
    if not found:
        raise ActuationError(f"{where} has no container {container!r} in its pod template at "
                             f"{' or '.join('.'.join(p) for p in kind.templates)} (has {', '.join(names) or 'none'})")
    launches = [_launch(engine) for _, _, engine in found]
    if len(found) == 1 and all(dig(held, p) is None for p in kind.others):
        chosen = [0]  # every pod runs this template: its engine container is the engine, whatever starts it
    else:
        chosen = [i for i, (serves, _) in enumerate(launches) if serves]
        if not chosen:
            raise ActuationError(f"{where}: none of its pod templates runs vLLM's server recognisably in container "
                                 f"{container!r} (`vllm serve`, `python -m vllm.entrypoints...`, or the image's own "
                                 "entrypoint)")
    for i in chosen:
        if (why := launches[i][1]) is not None:
            raise ActuationError(f"{where} ({'.'.join(found[i][0][1:])}): container {container!r} {why}")
    return [found[i] for i in chosen]


# A shell's `-c` string: its flags are inside the string, where no argument edit reaches them.
_SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})
# Programs that start another (`env VAR=value sh -c ...`, an init process), with their options that take a value:
# the program is what follows them.
_WRAPPERS: dict[str, frozenset[str]] = {
    "env": frozenset({"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}),
    "tini": frozenset({"-p", "-e"}),
    "dumb-init": frozenset({"-r", "--rewrite"}),
    "catatonit": frozenset(),
}
_SERVER = re.compile(r"\bvllm\s+serve\b|vllm\.entrypoints")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _program(argv: Sequence[str]) -> int:
    """Where the program a container runs stands in its argv, past wrappers, their options and `VAR=value`s."""
    i = 0
    while i < len(argv) and (valued := _WRAPPERS.get(argv[i].rsplit("/", 1)[-1])) is not None:
        i += 1
        while i < len(argv) and (argv[i].startswith("-") or _ASSIGNMENT.match(argv[i])):
            if argv[i] == "--":
                i += 1
                break
            i += 2 if argv[i] in valued else 1
    return i


def _launch(engine: Mapping[str, Any]) -> tuple[bool, str | None]:
    """How the container starts: whether it runs vLLM's server recognisably, and why its flags cannot be changed by
    an argument edit (None where they can): they sit inside a shell's `-c` string, where flags appended after it are
    the shell's positional parameters, which it ignores (a change that would silently do nothing)."""
    command = [str(x) for x in engine.get("command") or []]
    argv = command + [str(x) for x in engine.get("args") or []]
    i = _program(argv)
    if i < len(argv) and argv[i].rsplit("/", 1)[-1] in _SHELLS:
        j, string = i + 1, False
        while j < len(argv) and argv[j].startswith(("-", "+")) and argv[j] != "--":
            option = argv[j]
            short = not option.startswith("--")
            string |= short and "c" in option[1:]  # -c, -ec, -lc
            j += 2 if short and ("o" in option[1:] or "O" in option[1:]) else 1  # -o pipefail, -euo pipefail
        if string and j < len(argv):
            script, shown = argv[j], " ".join(argv[i:j])
            serves = bool(_SERVER.search(script))
            if "$@" not in script and "${@}" not in script:
                return serves, (f"runs a shell string ({shown} '...'), where flags appended after it would be "
                                "ignored: give the engine its flags as args the string hands on with \"$@\"")
            if j + 1 == len(argv):  # the first word after the string is $0, not one of "$@"
                return serves, (f"runs a shell string ({shown} '...') that hands on \"$@\" with nothing after it to "
                                "stand for $0: an appended flag would become $0; add `--` after the string")
            return serves, None  # what follows the string is handed on to what it runs
    if not command:
        return True, None  # the image's entrypoint (vLLM's images: `vllm serve`) takes the args as its flags
    return bool(_SERVER.search(" ".join(argv))), None


def _changed_flags(engine: dict[str, Any], change: Speculation | Eplb, annotations: dict[str, Any],
                   where: str) -> dict[str, Any]:
    """Make `change` in the engine container's flags, wherever in its command or args they are, and say what changed;
    `annotations` keep a speculative config switched off, for the revert that switches it back on."""
    command = [str(x) for x in engine.get("command") or []]
    args = [str(x) for x in engine.get("args") or []]
    names = ("--enable-eplb", "--eplb-config") if isinstance(change, Eplb) else ("--speculative-config",)
    for word in command + args:
        if _flag(word) not in names and any(n in word.replace("_", "-") for n in names):
            raise ActuationError(f"{where}: {' or '.join(names)} is set inside {word[:80]!r}, where an edit of the "
                                 "engine's flags cannot reach it")
    added: list[str] = []
    if isinstance(change, Eplb):
        if change.enabled and not any("enable-expert-parallel" in w.replace("_", "-") or w == "-ep"
                                      for w in command + args):
            raise ActuationError(f"{where} runs without --enable-expert-parallel: vLLM refuses --enable-eplb without it "
                                 "(a dense model has no experts to balance); not made")
        command, args = (_without(_without(a, "--enable-eplb", bare=True), "--eplb-config") for a in (command, args))
        if change.enabled:
            config = {"window_size": change.window_size, "step_interval": change.step_interval,
                      "num_redundant_experts": change.num_redundant_experts}
            added = ["--enable-eplb", "--eplb-config", json.dumps(config, separators=(",", ":"))]
        detail: dict[str, Any] = {"eplb": change.enabled}
    else:
        current = _value(args, "--speculative-config") or _value(command, "--speculative-config")
        spec = json.loads(current) if current else json.loads(annotations.get(SPEC_ANNOTATION, "null") or "null")
        if spec is None:
            raise ActuationError(f"{where} has no --speculative-config to change")
        before = int(spec.get("num_speculative_tokens", 0)) if current else 0
        n = change.resolve(before)
        command, args = (_without(a, "--speculative-config") for a in (command, args))
        if n > 0:
            spec["num_speculative_tokens"] = n
            added = ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        else:
            annotations[SPEC_ANNOTATION] = json.dumps(spec, separators=(",", ":"))
        detail = {"num_speculative_tokens": n, "from": before}
    # New flags go where the engine's flags are: its args, or its command where it has none.
    if args or not command:
        args += added
    else:
        command += added
    if command:
        engine["command"] = command
    if args or "args" in engine:
        engine["args"] = args
    return detail


def _set_in(body: dict[str, Any], path: Sequence[str], value: Any) -> None:
    """Put `value` at `path` in a patch body, keeping what other paths put there."""
    for key in path[:-1]:
        body = body.setdefault(key, {})
    body[path[-1]] = value


def _flag(arg: str) -> str:
    """A long option's name as vLLM's parser reads it: `--enable_eplb` is `--enable-eplb`."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else arg


def _value(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE` in an argument list (either spelling of the name)."""
    for i, arg in enumerate(args):
        if _flag(arg) != flag:
            continue
        if "=" in arg:
            return arg.split("=", 1)[1]
        if i + 1 < len(args):
            return args[i + 1]
    return None


def _without(args: Sequence[str], flag: str, *, bare: bool = False) -> list[str]:
    """`args` without `--flag VALUE` and `--flag=VALUE` (or without a bare `--flag` when `bare`), either spelling."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if _flag(arg) == flag:
            skip = not bare and "=" not in arg
            continue
        out.append(arg)
    return out


class ConfigMapSwitch:
    """The kill switch as a ConfigMap key, for operators with kubectl: `paused: "true"` stops acting."""

    def __init__(self, api: k8s.ApiClient, flag: ConfigMapFlag, timeout: float = 10.0) -> None:
        self._core = k8s.CoreV1Api(api)
        self.flag = flag
        self._timeout = (timeout, timeout)

    async def paused(self) -> str | None:
        f = self.flag
        try:
            data = await asyncio.to_thread(_body, self._core.read_namespaced_config_map, f.name, f.namespace,
                                           _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 404:  # deleting the switch must not be a way to turn acting back on
                return (f"the kill switch ConfigMap {f.namespace}/{f.name} does not exist: not acting until it does "
                        f"(with {f.key}: \"false\")")
            return f"the kill switch ConfigMap {f.namespace}/{f.name} cannot be read ({api_message(exc)}): not acting"
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            return f"the kill switch ConfigMap {f.namespace}/{f.name} cannot be read ({exc}): not acting"
        value = str((data.get("data") or {}).get(f.key, "")).strip().lower()
        return f"ConfigMap {f.namespace}/{f.name} has {f.key}: {value}" if value == "true" else None
