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
template read and patched: name it in `follows`, since the fleet file does not. Pod discovery
lists pods in its own namespace, acting or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from controlplane.actuators.kubernetes import KINDS, VERBS
from controlplane.config import FleetConfig, Workload
from controlplane.lease import LEASE_VERBS

__all__ = ["rbac_manifests"]

# Per resource, in every namespace an engine pool lives in: pods (discovery; out of routing before a drain), their
# evictions, and the HorizontalPodAutoscalers (a pool one scales is not scaled here too).
_UNNAMED = (("", "pods"), ("", "pods/eviction"), ("autoscaling", "horizontalpodautoscalers"))
_REVISIONED = ("Deployment", "Rollout")  # the kinds whose revisions are ReplicaSets
_LIST_PODS = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}  # what discovery alone needs


def _verbs(group: str, resource: str, *, named: bool) -> list[str]:
    """The control plane's calls on a resource (`VERBS`, the Lease's); create cannot be limited by name."""
    return sorted(v for g, r, v in VERBS | LEASE_VERBS if (g, r) == (group, resource) and not (named and v == "create"))


def _rule(group: str, resource: str, names: Sequence[str] = ()) -> dict[str, Any]:
    named = {"resourceNames": sorted(names)} if names else {}
    return {"apiGroups": [group], "resources": [resource], **named, "verbs": _verbs(group, resource, named=bool(names))}


def rbac_manifests(config: FleetConfig, *, namespace: str = "fleet-system", service_account: str = "fleet-controlplane",
                   follows: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Roles, a ClusterRole and their bindings for the service account `namespace/service_account`; `follows` are
    the Deployments (`namespace/name`) the pools' Rollouts follow. ValueError for a fleet file that calls no
    Kubernetes API (no pool workload with `kubernetes` set, no `discovery`)."""
    k = config.kubernetes
    pools = [p.workload for p in config.pools if p.workload is not None] if k is not None else []
    if not pools and config.discovery is None:
        raise ValueError("the fleet file names no pool workload (pools[].workload with kubernetes set) and no "
                         "discovery: the control plane calls no Kubernetes API, and needs no RBAC")
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
    # Discovery only lists pods, in its namespace (an engine namespace's pod rule covers it there).
    listing = {config.discovery.namespace} if config.discovery is not None else set()
    if k is None or not pools:
        return [doc for ns in sorted(listing) for doc in _bound("Role", service_account, [dict(_LIST_PODS)], subject, ns)]
    named: dict[str, dict[tuple[str, str], set[str]]] = {}  # namespace -> (group, resource) -> names
    events: set[str] = {"default"}  # a cordoned node's Events go to `default`
    revisions: set[str] = set()

    def grant(ns: str, group: str, resource: str, name: str) -> None:
        named.setdefault(ns, {}).setdefault((group, resource), set()).add(name)

    def workload(w: Workload, *, scaled: bool) -> None:
        """Read (replicas, revisions) and patched (engine flags, rollbacks, a Rollout's abort), scaled if a pool's;
        its Events beside it."""
        kind = KINDS[w.kind]
        grant(w.namespace, kind.group, kind.plural, w.name)
        if scaled:
            grant(w.namespace, kind.group, f"{kind.plural}/scale", w.name)
        if w.kind == "Rollout":
            grant(w.namespace, kind.group, "rollouts/status", w.name)
        events.add(w.namespace)
        if w.kind in _REVISIONED:
            revisions.add(w.namespace)

    for w in pools:
        workload(w, scaled=True)
    if k.router is not None:
        workload(k.router, scaled=False)
    for ref in follows:
        ns, _, name = ref.partition("/")
        if not ns or not name:
            raise ValueError(f"follows {ref!r}: give the Deployment a Rollout follows as NAMESPACE/NAME")
        grant(ns, "apps", "deployments", name)
        revisions.add(ns)
    if k.switch is not None:
        grant(k.switch.namespace, "", "configmaps", k.switch.name)
    if (lease := k.leader_election) is not None:
        grant(lease.namespace, "coordination.k8s.io", "leases", lease.name)

    engines = {w.namespace for w in pools}
    docs: list[dict[str, Any]] = []
    for ns in sorted(named.keys() | engines | events | listing):
        rules = [_rule(group, resource, sorted(names)) for (group, resource), names in sorted(named.get(ns, {}).items())]
        rules += [_rule(group, resource) for group, resource in _UNNAMED if ns in engines]
        if ns in listing - engines:
            rules.append(dict(_LIST_PODS))
        rules += [_rule(group, resource) for (group, resource), wanted in (
            (("apps", "replicasets"), ns in revisions), (("events.k8s.io", "events"), ns in events)) if wanted]
        if lease is not None and ns == lease.namespace:
            rules.append({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]})
        docs += _bound("Role", service_account, rules, subject, ns)
    # Cluster-scoped: named for the namespace too, so two control planes' bindings do not replace each other.
    docs += _bound("ClusterRole", f"{namespace}-{service_account}", [_rule("", "nodes")], subject, None)
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
