"""The RBAC derived from a fleet file (`controlplane/rbac.py`): valid against the official schemas, every call
the actuator makes granted, object by object, and nothing the fleet file does not name."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate
from click.testing import CliRunner
from kubernetes import client

from controlplane.actuators.kubernetes import VERBS
from controlplane.cli import cli
from controlplane.config import Workload, parse_config
from controlplane.lease import LEASE_VERBS
from controlplane.rbac import rbac_manifests
from policies.types import ActionKind, Cordon, RollBack, ScaleTo, Speculation
from tests.controlplane.apiserver import DEPLOYMENTS, NODES, PODS, REPLICASETS, ApiServer, rbac_of
from tests.controlplane.test_kubernetes_actuator import (
    LWS,
    NS,
    ROLLOUTS,
    Clock,
    actuator,
    deployment,
    lws,
    order,
    pod,
    replica_set,
)

FLEET = """
mode: act
kubernetes:
  router: {kind: Deployment, namespace: gateway, name: epp, container: epp}
  switch: {namespace: fleet-system, name: fleet-controlplane, key: paused}
  leader_election: {namespace: fleet-system}
pools:
  - {name: decode, role: decode, model: m, replicas: {min: 1, max: 8},
     workload: {kind: Deployment, namespace: llm, name: vllm-decode}}
  - {name: prefill, role: prefill, model: m, replicas: {min: 1, max: 8},
     workload: {kind: LeaderWorkerSet, namespace: llm, name: vllm-prefill}}
  - {name: canary, role: decode, model: m, replicas: {min: 1, max: 8},
     workload: {kind: Rollout, namespace: llm, name: vllm-canary}}
  - {name: batch, role: unified, model: m, replicas: {min: 1, max: 4},
     workload: {kind: StatefulSet, namespace: batch, name: vllm-batch}}
targets:
  - {url: "http://10.0.0.1:8000/metrics", pool: decode, pod: vllm-decode-a}
"""
K8S_VERSION = kubernetes_validate.latest_version()


def manifests() -> list[dict[str, Any]]:
    return rbac_manifests(parse_config(FLEET), follows=["llm/vllm-canary-template"])


def allows(docs: list[dict[str, Any]], group: str, resource: str, verb: str, namespace: str | None,
           name: str | None) -> bool:
    """Kubernetes' RBAC check for one request of the service account the manifests bind."""
    for doc in docs:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        if doc["kind"] == "Role" and doc["metadata"]["namespace"] != namespace:
            continue
        for rule in doc["rules"]:
            names = rule.get("resourceNames")
            if (group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                    and (not names or name in names)):
                return True
    return False


def test_every_manifest_is_valid_and_bound_to_the_control_planes_service_account() -> None:
    docs = manifests()
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    roles = {(d["kind"], d["metadata"].get("namespace")) for d in docs if d["kind"].endswith("Role")}
    assert roles == {("Role", "llm"), ("Role", "batch"), ("Role", "gateway"), ("Role", "fleet-system"),
                     ("Role", "default"), ("ClusterRole", None)}
    for binding in (d for d in docs if d["kind"].endswith("Binding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleet-controlplane",
                                        "namespace": "fleet-system"}]


def test_it_grants_the_calls_the_control_plane_makes_and_names_every_object_it_can() -> None:
    docs = manifests()
    granted = {(g, r, v) for d in docs if d["kind"].endswith("Role") for rule in d["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == VERBS | LEASE_VERBS
    for d in docs:
        for rule in d.get("rules", []):
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
            # Unnamed: what has no stable name (pods, Events), what is listed, and creating the Lease.
            if "resourceNames" not in rule:
                assert rule["resources"][0] in ("pods", "pods/eviction", "replicasets", "horizontalpodautoscalers",
                                                "events", "nodes", "leases"), rule
                assert rule["resources"] != ["leases"] or rule["verbs"] == ["create"]
    assert allows(docs, "apps", "deployments", "patch", "llm", "vllm-canary-template"), "a Rollout's Deployment"
    assert allows(docs, "apps", "statefulsets/scale", "patch", "batch", "vllm-batch")
    assert not allows(docs, "apps", "deployments", "patch", "llm", "postgres"), "another workload of the namespace"
    assert not allows(docs, "apps", "deployments/scale", "patch", "llm", "epp"), "the router is never scaled"
    assert not allows(docs, "", "pods", "patch", "fleet-system", "x"), "no pods outside the engines' namespaces"
    assert not allows(docs, "apps", "statefulsets/scale", "patch", "llm", "vllm-batch"), "names are per namespace"
    assert not allows(docs, "apps", "replicasets", "list", "batch", None), "a StatefulSet has no ReplicaSets"
    assert not allows(docs, "", "pods", "list", "gateway", None), "the router's pods are not the control plane's"


async def test_every_call_of_the_actuators_work_is_allowed(server: ApiServer, api: client.ApiClient) -> None:
    router = deployment("epp", replicas=1)
    router["metadata"]["namespace"] = "gateway"  # the router in a namespace of its own
    epp = server.put(DEPLOYMENTS, router)
    for revision, image, created in ((4, "epp:v1", "2026-11-20T10:00:00Z"), (5, "epp:v2", "2026-12-01T09:55:00Z")):
        rs = replica_set(epp, revision, image, created)
        rs["metadata"]["namespace"] = "gateway"
        server.put(REPLICASETS, rs)
    server.put(DEPLOYMENTS, deployment(replicas=3))
    server.put(LWS, lws(replicas=2))
    server.put(DEPLOYMENTS, deployment("vllm-canary-template", replicas=0))  # the template the Rollout follows
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS},
                          "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "vllm-canary-template"}},
                                   "workloadRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                                   "name": "vllm-canary-template"}}})
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    for name in ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c"):
        server.put(PODS, pod(name))
    clock = Clock()
    act = actuator(api, clock)
    act.settings = act.settings.model_copy(update={"router": Workload(kind="Deployment", namespace="gateway",
                                                                      name="epp", container="epp")})
    view = await act.observe()
    assert view.changed_at["router"] > 0
    await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), pool="prefill", action_id=1))
    await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), action_id=2))
    await act.carry_out(order(ActionKind.ROLLBACK, RollBack("router"), action_id=3))
    # Approved against the template observe digested (the followed Deployment's): the same one the change checks.
    canary = view.pools["canary"].template
    flags = replace(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), pool="canary", action_id=7),
                    from_template=canary)
    assert (await act.carry_out(flags))["patched"] == "Deployment llm/vllm-canary-template"
    abort = replace(order(ActionKind.ROLLBACK, RollBack("canary"), pool="canary", action_id=4),
                    from_template=(await act.observe()).pools["canary"].template)
    assert (await act.carry_out(abort)) == {"aborted": "Rollout llm/vllm-canary"}
    down = order(ActionKind.SCALE_POOL, ScaleTo(2), action_id=5, busy={"vllm-decode-a": 0.0, "vllm-decode-b": 1.0,
                                                                       "vllm-decode-c": 1.0})
    wait = (await act.carry_out(down))["wait"]
    await act.resume(down, wait, clock.t + 5)
    cordon = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), action_id=6,
                   busy={"vllm-decode-b": 0.0, "vllm-decode-c": 0.0})
    wait = (await act.carry_out(cordon))["wait"]
    await act.resume(cordon, wait, clock.t + 5)
    docs = manifests()
    seen = [(rbac, request.namespace, request.name) for request in server if (rbac := rbac_of(request)) is not None]
    assert {rbac[2] for rbac, _, _ in seen} >= {"get", "list", "patch", "create"}
    refused = [(rbac, ns, name) for rbac, ns, name in seen
               if not allows(docs, *rbac, ns, name if rbac[2] not in ("list", "create") else None)]
    assert refused == []


def test_the_command_writes_the_manifests_and_names_a_fleet_file_without_workloads(tmp_path: Any) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    out = CliRunner().invoke(cli, ["rbac", "export", "--config", str(fleet), "--follows", "llm/vllm-canary-template"])
    assert out.exit_code == 0, out.output
    assert out.output.count("\nkind: Role\n") == 5 and "vllm-canary-template" in out.output
    bare = tmp_path / "bare.yaml"
    bare.write_text("mode: observe\npools:\n  - {name: decode, role: decode, model: m, replicas: {min: 1, max: 8}}\n"
                    "targets:\n  - {url: 'http://10.0.0.1:8000/metrics', pool: decode, pod: a}\n")
    out = CliRunner().invoke(cli, ["rbac", "export", "--config", str(bare)])
    assert out.exit_code != 0 and "names no pool workload" in out.output
    out = CliRunner().invoke(cli, ["rbac", "export", "--config", str(fleet), "--follows", "vllm-canary-template"])
    assert out.exit_code != 0 and "NAMESPACE/NAME" in out.output


def test_pod_discovery_may_list_pods_in_its_namespace_acting_or_not() -> None:
    """It lists pods every tick; a 403 there fails every tick."""
    acting = parse_config(FLEET.replace("targets:\n  - {url: \"http://10.0.0.1:8000/metrics\", pool: decode, pod: "
                                        "vllm-decode-a}\n", "discovery: {namespace: engines, selector: app=vllm}\n"))
    docs = rbac_manifests(acting, follows=["llm/vllm-canary-template"])
    assert allows(docs, "", "pods", "list", "engines", None)
    assert not allows(docs, "", "pods", "patch", "engines", None), "only listed there: no engine of a pool lives there"
    observing = parse_config("mode: observe\ndiscovery: {namespace: engines, selector: app=vllm}\n"
                             "pools:\n  - {name: decode, role: decode, model: m, replicas: {min: 1, max: 8}}\n")
    docs = rbac_manifests(observing)
    assert [d["kind"] for d in docs] == ["Role", "RoleBinding"] and docs[0]["metadata"]["namespace"] == "engines"
    assert allows(docs, "", "pods", "list", "engines", None) and not allows(docs, "", "pods", "list", "llm", None)
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
