"""The deploy base (`deploy/base`): every manifest valid against the official schemas, the RBAC
exactly what the control plane calls, and the pieces agreeing with each other and with the code."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from controlplane.actuators.kubernetes import VERBS
from controlplane.config import parse_config
from controlplane.lease import LEASE_VERBS
from controlplane.rules_export import build_manifest
from controlplane.telemetry import Telemetry
from tests.crd_schemas import crd_name, problems, schema

BASE = Path(__file__).resolve().parents[1] / "deploy" / "base"
K8S_VERSION = kubernetes_validate.latest_version()
CUSTOM = {"monitoring.coreos.com/v1"}  # Prometheus Operator's resources: checked below field by field


def documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((BASE / name).read_text()) if doc]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    [doc] = [d for d in documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid(doc: dict[str, Any]) -> None:
    if doc["apiVersion"] in CUSTOM:
        assert doc["kind"] in ("ServiceMonitor", "PrometheusRule") and doc["spec"]
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_rbac_grants_exactly_the_calls_it_makes() -> None:
    granted: set[tuple[str, str, str]] = set()
    where: dict[tuple[str, str, str], set[str]] = {}
    for doc in documents():
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        for rule in doc["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb))
                        where.setdefault((group, resource, verb), set()).add(doc["metadata"].get("namespace", "*"))
    assert granted == VERBS | LEASE_VERBS
    assert where[("", "nodes", "patch")] == {"*"}, "nodes are cluster-scoped: the one ClusterRole rule"
    assert all(ns != "*" for key, nss in where.items() if key[1] != "nodes" for ns in nss), "nothing else cluster-wide"
    assert not any(resource == "secrets" for _, resource, _ in granted)
    bindings = [d for d in documents() if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    roles = {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in documents()
             if d["kind"] in ("Role", "ClusterRole")}
    for b in bindings:
        assert (b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace")) in roles
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "fleet-controlplane", "namespace": "fleet-system"}]


def test_the_fleet_file_fits_the_manifests() -> None:
    config = parse_config(one("ConfigMap", "fleet-controlplane-config")["data"]["fleet.yaml"])
    k = config.kubernetes
    assert k is not None and k.leader_election is not None and k.switch is not None
    lease = one("Lease")
    assert (k.leader_election.namespace, k.leader_election.name) == (lease["metadata"]["namespace"],
                                                                     lease["metadata"]["name"])
    switch = one("ConfigMap", k.switch.name)
    assert switch["metadata"]["namespace"] == k.switch.namespace and k.switch.key in switch["data"]
    engines = {d["metadata"]["namespace"] for d in documents() if d["kind"] == "Role"
               and any("pods/eviction" in r["resources"] for r in d["rules"])}
    assert {p.workload.namespace for p in config.pools if p.workload} == engines == {config.discovery.namespace}
    deployment = one("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2 and spec["serviceAccountName"] == "fleet-controlplane"
    [container] = spec["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": config.server.port}]
    assert config.server.host == "0.0.0.0", "probes and Prometheus reach it through the pod IP"


def test_prometheus_finds_the_control_plane_and_its_rules_are_the_export() -> None:
    service, monitor = one("Service"), one("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert one("PrometheusRule", "fleet-controlplane-rules") == build_manifest(namespace="fleet-system")
    names = {m.name for m in Telemetry().registry.collect()}
    for rule in (r for g in one("PrometheusRule", "fleet-controlplane-self")["spec"]["groups"] for r in g["rules"]):
        metrics = set(re.findall(r"\bfleet_\w+", rule["expr"]))
        assert metrics and all(m.removesuffix("_total") in names for m in metrics), rule["alert"]


# examples: Argo Rollouts, Flagger and a CI Job gating on the canary gate ------------------------------

EXAMPLES = BASE.parent / "examples"


def _example(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize(("name", "crd"), [("argo-analysistemplate.yaml", "argoproj.io_v1alpha1_AnalysisTemplate"),
                                           ("flagger-canary.yaml", "flagger.app_v1beta1_Canary")])
def test_the_argo_and_flagger_examples_are_valid_against_their_crds(name: str, crd: str) -> None:
    doc = _example(name)
    assert crd_name(doc["apiVersion"], doc["kind"]) == crd
    found = schema(crd)
    assert found is not None, f"no schema for {crd}"
    assert problems(doc, found) == []


def test_the_ci_job_is_a_valid_job_that_runs_the_gate() -> None:
    doc = _example("ci-gate-job.yaml")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    [container] = doc["spec"]["template"]["spec"]["containers"]
    from controlplane.cli import gate

    assert container["args"][0] == "gate"
    ctx = gate.make_context("gate", list(container["args"][1:]))  # every option exists and parses
    assert ctx.params["pool"] == "decode" and ctx.params["report_fmt"] == "junit"
    assert doc["spec"]["backoffLimit"] == 0  # a failed gate must not be retried into a pass
    pod = doc["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True


def test_the_examples_call_the_endpoints_and_selectors_the_gate_has() -> None:
    from controlplane.gate import ArmSelector

    service = one("Service")
    port = service["spec"]["ports"][0]["port"]
    argo = _example("argo-analysistemplate.yaml")["spec"]["metrics"][0]
    web = argo["provider"]["web"]
    assert web["url"] == f"http://fleet-controlplane.fleet-system.svc:{port}/api/v1/gate"
    assert web["jsonPath"] == "{$.result}" and set(web["jsonBody"]) == {"pool", "baseline", "canary", "revision"}
    assert argo["successCondition"] == 'result == "pass"' and argo["failureCondition"] == 'result == "fail"'
    # The last measurement falls after the gate's window has ended and its last step can be read from the store (a
    # scrape interval later), when it answers in any case, and answers that stay inconclusive all along exceed the
    # limit: the run ends Inconclusive, never Successful.
    from controlplane.config import Scrape
    from policies.canary import GateSettings

    interval = float(argo["interval"].removesuffix("s"))
    last = (argo["count"] - 1) * interval
    assert GateSettings().max_window + Scrape().interval <= last < GateSettings().max_window + Scrape().interval + interval
    assert argo["count"] > argo["inconclusiveLimit"]
    for hook in _example("flagger-canary.yaml")["spec"]["analysis"]["webhooks"]:
        verb = {"rollback": "rollback", "confirm-promotion": "promotion"}[hook["type"]]
        assert hook["url"] == f"http://fleet-controlplane.fleet-system.svc:{port}/api/v1/gate/flagger/{verb}"
        assert ArmSelector.parse(hook["metadata"]["baseline"]).matches({"pod": "decode-primary-7d9f-x2"})
        canary = ArmSelector.parse(hook["metadata"]["canary"])
        assert canary.matches({"pod": "decode-6c4b-q1"}) and not canary.matches({"pod": "decode-primary-7d9f-x2"})


def test_the_network_policy_guards_the_control_planes_port_and_admits_its_callers() -> None:
    policy, pods = one("NetworkPolicy")["spec"], one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"] and policy["podSelector"]["matchLabels"].items() <= pods.items()
    [rule] = policy["ingress"]
    assert rule["ports"] == [{"port": one("Service")["spec"]["ports"][0]["targetPort"], "protocol": "TCP"}]
    [namespaces] = rule["from"][0]["namespaceSelector"]["matchExpressions"]
    callers = {"monitoring", "argo-rollouts", "flagger-system", one("Deployment")["metadata"]["namespace"]}
    assert namespaces["key"] == "kubernetes.io/metadata.name" and set(namespaces["values"]) == callers
