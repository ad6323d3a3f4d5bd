"""The RBAC a fleet file's control plane needs, object by object.

`deploy/base/rbac.yaml` grants the actuator's calls (`VERBS`) per resource in one namespace. This
derives the same calls from a fleet file with every object it may read or change named
(`resourceNames`), in each namespace its pools, router, Lease and kill switch live in: a control
plane that scales the pools' Deployments cannot touch the namespace's other workloads. What cannot
be named stays per resource, and only where it is needed: the pods (their names are their
controllers'), their evictions and the HorizontalPodAutoscalers in the engines' namespaces, the
ReplicaSets listed where a Deployment or Rollout lives, the Events recorded beside what they are
about, and creating the Lease (create cannot be limited by name). Cordoning patches nodes, which
are cluster-scoped. A Rollout that follows a Deployment (`spec.workloadRef`) has that Deployment's
template read and patched: name it in `follows`, since the fleet file does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from controlplane.actuators.kubernetes import KINDS
from controlplane.config import FleetConfig

__all__ = ["rbac_manifests"]

# Per resource, in every namespace an engine pool lives in (`VERBS` less what is named).
_UNNAMED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("", "pods", ("list", "patch")),  # discovery and drains; out of routing before a drain
    ("", "pods/eviction", ("create",)),  # evictions honour PodDisruptionBudgets
    ("autoscaling", "horizontalpodautoscalers", ("list",)),  # a pool an HPA scales is not scaled here too
)
REPLICA_SETS = {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]}  # a Deployment's revisions
EVENTS = {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]}
_REVISIONED = ("Deployment", "Rollout")  # the kinds whose revisions are ReplicaSets


def rbac_manifests(config: FleetConfig, *, namespace: str = "fleet-system", service_account: str = "fleet-controlplane",
                   follows: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Roles, a ClusterRole and their bindings for the service account `namespace/service_account`; `follows` are
    the Deployments (`namespace/name`) the pools' Rollouts follow. ValueError for a fleet file with nothing to act on."""
    k = config.kubernetes
    scaled = [(p.workload.kind, p.workload.namespace, p.workload.name) for p in config.pools if p.workload is not None]
    if k is None or not scaled:
        raise ValueError("the fleet file names no pool workload (pools[].workload with kubernetes set): the control "
                         "plane changes nothing, and needs no RBAC")
    named: dict[str, dict[tuple[str, str], set[str]]] = {}  # namespace -> (group, resource) -> names
    verbs: dict[tuple[str, str], tuple[str, ...]] = {}

    def grant(ns: str, group: str, resource: str, name: str, how: tuple[str, ...]) -> None:
        named.setdefault(ns, {}).setdefault((group, resource), set()).add(name)
        verbs[group, resource] = how

    events: set[str] = {"default"}  # a cordoned node's Events go to `default`
    revisions: set[str] = set()
    for kind_name, ns, name in scaled:
        kind = KINDS[kind_name]
        grant(ns, kind.group, kind.plural, name, ("get", "patch"))  # replicas, revisions; engine flags, rollbacks
        grant(ns, kind.group, f"{kind.plural}/scale", name, ("patch",))
        if kind_name == "Rollout":
            grant(ns, kind.group, "rollouts/status", name, ("patch",))  # abort
        events.add(ns)
        if kind_name in _REVISIONED:
            revisions.add(ns)
    if (router := k.router) is not None:  # read and rolled back, never scaled; its Events beside it
        kind = KINDS[router.kind]
        grant(router.namespace, kind.group, kind.plural, router.name, ("get", "patch"))
        if router.kind == "Rollout":
            grant(router.namespace, kind.group, "rollouts/status", router.name, ("patch",))
        events.add(router.namespace)
        if router.kind in _REVISIONED:
            revisions.add(router.namespace)
    for ref in follows:
        ns, _, name = ref.partition("/")
        if not ns or not name:
            raise ValueError(f"follows {ref!r}: give the Deployment a Rollout follows as NAMESPACE/NAME")
        grant(ns, "apps", "deployments", name, ("get", "patch"))
        revisions.add(ns)
    if k.switch is not None:
        grant(k.switch.namespace, "", "configmaps", k.switch.name, ("get",))
    if (lease := k.leader_election) is not None:
        grant(lease.namespace, "coordination.k8s.io", "leases", lease.name, ("get", "patch"))

    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
    engines = {ns for _, ns, _ in scaled}
    docs: list[dict[str, Any]] = []
    for ns in sorted(named.keys() | engines | events):
        rules = [{"apiGroups": [group], "resources": [resource], "resourceNames": sorted(names),
                  "verbs": list(verbs[group, resource])}
                 for (group, resource), names in sorted(named.get(ns, {}).items())]
        if ns in engines:
            rules += [{"apiGroups": [group], "resources": [resource], "verbs": list(how)}
                      for group, resource, how in _UNNAMED]
        rules += [rule for rule, wanted in ((REPLICA_SETS, ns in revisions), (EVENTS, ns in events)) if wanted]
        if lease is not None and ns == lease.namespace:
            rules.append({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]})
        docs += _bound("Role", service_account, rules, subject, ns)
    # Cluster-scoped: named for the namespace too, so two control planes' bindings do not replace each other.
    docs += _bound("ClusterRole", f"{namespace}-{service_account}",
                   [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}], subject, None)
    return docs


def _bound(kind: str, name: str, rules: list[dict[str, Any]], subject: dict[str, str],
           namespace: str | None) -> list[dict[str, Any]]:
    """A Role (or ClusterRole) and the binding that gives it to `subject`."""
    meta: dict[str, Any] = {"name": name, **({"namespace": namespace} if namespace is not None else {})}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta, "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{kind}Binding", "metadata": dict(meta),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
               "subjects": [subject]}
    return [role, binding]
