"""The Kubernetes actuator: the official client, unchanged, over HTTP against the API emulator.

Every object it creates or patches, and every subresource body, is validated against the official
OpenAPI schemas by the emulator (`apiserver.py`); each test ends by asserting none was invalid.
Covers: scaling through the scale subresource (Deployment, LeaderWorkerSet with its gang), a
drained scale-down of the least busy engines (each ReplicaSet's share in the middle of a rollout
or an Argo canary, worked out again before the count is written), engine arguments for EPLB and speculative decoding
(other containers untouched, a stale resourceVersion retried, 422 and 403 surfaced), rollbacks
(Deployment from its ReplicaSets, Argo Rollout abort), drain and replace, cordon with evictions a
PodDisruptionBudget holds back, Events, the action annotation that stops a repeat, server-side
dry run, slow and failing API calls, the ConfigMap kill switch, and the RBAC it needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import kmock
import pytest
from kubernetes import client

from controlplane.actuators import kubernetes as kubernetes_actuator
from controlplane.actuators.base import Order
from controlplane.actuators.kubernetes import ACTION_ANNOTATION, DELETION_COST, VERBS, ConfigMapSwitch, KubernetesActuator
from controlplane.config import ConfigMapFlag, Kubernetes, Workload
from controlplane.errors import ActuationError
from controlplane.rails import revert_of
from policies.types import ActionKind, Change, Cordon, Drain, Eplb, RollBack, ScaleTo, Speculation
from tests.controlplane.apiserver import (
    CONFIGMAPS,
    DEPLOYMENTS,
    EVENTS,
    HPAS,
    NODES,
    PODS,
    REPLICASETS,
    ApiServer,
)

NS = "llm"
LWS = kmock.resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
ROLLOUTS = kmock.resource("argoproj.io", "v1alpha1", "rollouts")
STATEFULSETS = kmock.resource("apps", "v1", "statefulsets")
ARGS = ["--model", "/models/llama", "--port", "8000", "--enable-expert-parallel",
        "--speculative-config", '{"method":"eagle","model":"/models/eagle","num_speculative_tokens":3}']


class Clock:
    def __init__(self) -> None:
        self.t = 1_767_225_600.0

    def __call__(self) -> float:
        return self.t


def deployment(name: str = "vllm-decode", replicas: int = 3, args: list[str] | None = None) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "annotations": {"deployment.kubernetes.io/revision": "2"}},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
            "template": {"metadata": {"labels": {**labels, "llm-d.ai/routed": "true"}},
                         "spec": {"containers": [
                             {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": list(args or ARGS)},
                             {"name": "sidecar", "image": "envoyproxy/envoy:v1.31", "args": ["--log-level", "info"]},
                         ]}},
        },
        "status": {"replicas": replicas, "readyReplicas": replicas},
    }


def replica_set(dep: dict[str, Any], revision: int, image: str, created: str) -> dict[str, Any]:
    name = dep["metadata"]["name"]
    template = json.loads(json.dumps(dep["spec"]["template"]))
    template["metadata"]["labels"]["pod-template-hash"] = f"h{revision}"
    template["spec"]["containers"][0]["image"] = image
    return {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": f"{name}-h{revision}", "namespace": NS, "creationTimestamp": created,
                     "labels": template["metadata"]["labels"],
                     "annotations": {"deployment.kubernetes.io/revision": str(revision)},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                          "uid": dep["metadata"]["uid"], "controller": True}]},
        "spec": {"replicas": 0, "selector": {"matchLabels": template["metadata"]["labels"]}, "template": template},
    }


def pod(name: str, app: str = "vllm-decode", node: str = "gpu-node-1") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": app, "llm-d.ai/routed": "true"}},
            "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def actuator(api: client.ApiClient, clock: Clock | None = None, **settings: Any) -> KubernetesActuator:
    workloads = {"decode": Workload(kind="Deployment", namespace=NS, name="vllm-decode"),
                 "prefill": Workload(kind="LeaderWorkerSet", namespace=NS, name="vllm-prefill"),
                 "canary": Workload(kind="Rollout", namespace=NS, name="vllm-canary")}
    router = Workload(kind="Deployment", namespace=NS, name="epp", container="epp")
    config = Kubernetes(router=router, drain_grace=60.0, timeout=2.0, **settings)
    return KubernetesActuator(api, config, workloads, clock=clock or Clock(), instance="fleet-controlplane-0")


def order(kind: ActionKind, change: Change, pool: str = "decode", action_id: int = 7,
          busy: dict[str, float] | None = None, answering: set[str] | None = None) -> Order:
    return Order(action_id, kind, pool, change, "a test", busy=busy or {},
                 answering=None if answering is None else frozenset(answering))


def events(server: ApiServer) -> list[dict[str, Any]]:
    return [dict(o.raw) for (r, _, _), o in server.objects.items() if r == EVENTS and not o.deleted]


async def test_scale_up_through_the_scale_subresource_with_an_event(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    done = await actuator(api).carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4)))
    assert done == {"scaled": "Deployment llm/vllm-decode", "replicas": 4}
    dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert dep is not None and dep["spec"]["replicas"] == 4
    assert dep["metadata"]["annotations"][ACTION_ANNOTATION] == "7@0"
    [event] = events(server)
    assert event["regarding"]["name"] == "vllm-decode" and event["action"] == "scale_pool"
    assert event["reason"] == "ScalePool" and "action 7: scaled to 4" in event["note"]


async def test_observe_reads_replicas_budgets_gangs_and_revisions(server: ApiServer, api: client.ApiClient) -> None:
    dep = server.put(DEPLOYMENTS, deployment(replicas=3))
    server.put(REPLICASETS, replica_set(dep, 1, "vllm/vllm-openai:v0.10.0", "2026-11-20T10:00:00Z"))
    server.put(REPLICASETS, replica_set(dep, 2, "vllm/vllm-openai:v0.11.0", "2026-12-01T09:30:00Z"))
    group = lws(replicas=2, size=4, ready=1)
    group["spec"]["rolloutStrategy"] = {"rollingUpdateConfiguration": {"maxUnavailable": 1}}
    server.put(LWS, group)
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS},
                          "spec": {"replicas": 2, "strategy": {"canary": {"maxUnavailable": 1}}},
                          "status": {"readyReplicas": 2}})
    epp = server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    server.put(REPLICASETS, replica_set(epp, 5, "epp:v2", "2026-12-01T09:55:00Z"))
    assert "router" not in (await actuator(api).observe()).changed_at, "a first revision is no change"
    server.put(REPLICASETS, replica_set(epp, 4, "epp:v1", "2026-11-30T09:00:00Z"))
    view = await actuator(api).observe()
    assert view.pools["decode"].desired == view.pools["decode"].ready == 3
    assert view.pools["decode"].max_unavailable == 1 and view.pools["decode"].gang == 1
    assert (view.pools["prefill"].desired, view.pools["prefill"].ready, view.pools["prefill"].gang) == (8, 4, 4)
    # One group at a time: its four engines restart together, as the LeaderWorkerSet's budget allows.
    assert view.pools["prefill"].max_unavailable == 4
    assert view.changed_at["decode"] == 1_796_117_400.0  # 2026-12-01T09:30:00Z, the newest ReplicaSet
    assert view.changed_at["router"] == 1_796_118_900.0


@pytest.mark.parametrize(("status", "rolling"), [
    ({"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3, "observedGeneration": 5}, False),
    ({"readyReplicas": 3, "updatedReplicas": 1, "observedGeneration": 5}, True),  # maxSurge 1: old pods still ready
    ({"replicas": 4, "readyReplicas": 3, "updatedReplicas": 3, "observedGeneration": 5}, True),  # one old pod left
    ({"readyReplicas": 3, "updatedReplicas": 3, "observedGeneration": 4}, True),  # a spec not yet reconciled
    # Pods a quota or an admission webhook keeps from being created: no rollout, a pool short of engines (which
    # may never come: the stall path's to handle, which a pool read as rolling never reaches).
    ({"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 5}, False),
])
async def test_a_rollout_in_progress_reads_as_rolling(server: ApiServer, api: client.ApiClient,
                                                      status: dict[str, int], rolling: bool) -> None:
    dep = deployment(replicas=3)
    dep["metadata"]["generation"] = 5
    dep["status"] = status
    server.put(DEPLOYMENTS, dep)
    server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    view = await actuator(api).observe()
    decode = view.pools["decode"]
    assert (decode.desired, decode.ready, decode.rolling) == (3, status["readyReplicas"], rolling), \
        "ready counts every ready pod"


@pytest.mark.parametrize(("kind", "spec", "status", "rolling"), [
    # Aborted (by the control plane's own rollback, say): Argo scales the new pods away and serves the stable ones.
    ("Rollout", {}, {"abort": True, "phase": "Degraded", "replicas": 4, "readyReplicas": 4, "updatedReplicas": 0}, False),
    ("Rollout", {}, {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 1}, True),  # a canary step
    # A partition keeps the ordinals below it on the old template: only those from it up roll.
    ("StatefulSet", {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 2}}},
     {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 1}, False),
    ("StatefulSet", {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}},
     {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 1}, True),
    # OnDelete: a pod takes the new template when someone deletes it; nothing rolls meanwhile.
    ("StatefulSet", {"updateStrategy": {"type": "OnDelete"}}, {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 0},
     False),
    # A LeaderWorkerSet's partition counts groups: those below it keep the old template.
    ("LeaderWorkerSet", {"rolloutStrategy": {"rollingUpdateConfiguration": {"partition": 2, "maxUnavailable": 1}}},
     {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 2}, False),
    ("LeaderWorkerSet", {"rolloutStrategy": {"rollingUpdateConfiguration": {"partition": 1, "maxUnavailable": 1}}},
     {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 2}, True),
])
async def test_what_a_controller_leaves_on_the_old_template_on_purpose_is_no_rollout(
        server: ApiServer, api: client.ApiClient, kind: str, spec: dict[str, Any], status: dict[str, Any],
        rolling: bool) -> None:
    """A pool read as rolling holds every pool's disruptive changes (`rollout_in_flight`) until it is not."""
    server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    act = actuator(api)
    if kind == "Rollout":
        server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                              "metadata": {"name": "vllm-canary", "namespace": NS},
                              "spec": {"replicas": 4, **spec}, "status": status})
        pool = "canary"
    elif kind == "LeaderWorkerSet":
        group = lws(replicas=4, size=2)
        group["spec"].update(spec)
        group["status"] = status
        server.put(LWS, group)
        pool = "prefill"
    else:
        statefulset(server)
        sts = server.get(STATEFULSETS, NS, "vllm-kv")
        assert sts is not None
        sts["spec"].update(spec)
        sts["status"] = status
        server.put(STATEFULSETS, sts)
        act.workloads["kv"] = Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")
        pool = "kv"
    assert (await act.observe()).pools[pool].rolling is rolling


@pytest.mark.parametrize(("strategy", "budget"), [
    ({}, 2),  # Argo Rollouts' default, 25 % of 8
    ({"canary": {"maxUnavailable": "50%"}}, 4),
    ({"canary": {"maxUnavailable": 3}}, 3),
    # 0.8 rounds down; the actuator's budget is at least one engine (Argo's is 0 here, with maxSurge to roll on).
    ({"canary": {"maxUnavailable": "10%"}}, 1),
])
async def test_a_rollouts_budget_defaults_to_argo_rollouts_quarter(server: ApiServer, api: client.ApiClient,
                                                                  strategy: dict[str, Any], budget: int) -> None:
    server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS},
                          "spec": {"replicas": 8, "strategy": strategy}, "status": {"readyReplicas": 8}})
    assert (await actuator(api).observe()).pools["canary"].max_unavailable == budget


async def test_a_workload_that_cannot_be_read_leaves_the_other_pools_known(server: ApiServer,
                                                                         api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS}, "spec": {"replicas": 2},
                          "status": {"readyReplicas": 2}})
    view = await actuator(api).observe()  # no LeaderWorkerSet vllm-prefill (a typo in the fleet file, say)
    assert (view.pools["decode"].desired, view.pools["canary"].desired) == (3, 2)
    assert "prefill" not in view.pools and "LeaderWorkerSet llm/vllm-prefill" in view.unreadable["prefill"]


async def test_scale_down_drains_the_least_busy_engines_first(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    for name in ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c"):
        server.put(PODS, pod(name))
    clock = Clock()
    act = actuator(api, clock)
    busy = {"vllm-decode-a": 5.0, "vllm-decode-b": 1.0, "vllm-decode-c": 9.0}
    o = order(ActionKind.SCALE_POOL, ScaleTo(2), busy=busy)
    first = await act.carry_out(o)
    assert first["wait"]["pods"] == ["vllm-decode-b"] and first["wait"]["then"] == "scale"
    victim = server.get(PODS, NS, "vllm-decode-b")
    assert victim is not None and "llm-d.ai/routed" not in victim["metadata"]["labels"], "out of routing"
    assert victim["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "-1000"
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 3  # type: ignore[index]
    clock.t += 10
    still = await act.resume(o, first["wait"], clock.t)  # it still has a request in flight
    assert "wait" in still
    idle = Order(o.action_id, o.kind, o.pool, o.change, o.reason, busy={**busy, "vllm-decode-b": 0.0})
    removing = await act.resume(idle, first["wait"], clock.t + 5)
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 2  # type: ignore[index]
    # The action ends once the ReplicaSet has removed the drained engine, not when the count is written.
    assert "wait" in await act.resume(idle, removing["wait"], clock.t + 20)
    remove(server, "vllm-decode-b")
    done = await act.resume(idle, removing["wait"], clock.t + 35)
    assert done["replicas"] == 2 and done["idle"] is True and done["drained"] == ["vllm-decode-b"]
    assert done["removed"] == ["vllm-decode-b"]


def remove(server: ApiServer, *names: str) -> None:
    """What a ReplicaSet does to the pods it scales away: they terminate."""
    for name in names:
        server.terminate(NS, name)


def unready(server: ApiServer, name: str) -> None:
    """An engine that crashed or restarts: running, not ready (its ReplicaSet removes such a pod first)."""
    crashed = server.get(PODS, NS, name)
    assert crashed is not None
    crashed["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    server.put(PODS, crashed)


def scaled(result: dict[str, Any]) -> dict[str, Any]:
    """The outcome of a scale-down whose count is written, recorded once its drained engines are gone."""
    assert result["wait"]["then"] == "verify", result
    return dict(result["wait"]["done"])


async def test_a_drained_engine_the_controller_did_not_remove_is_routed_again(server: ApiServer,
                                                                             api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    removing = await act.resume(o, wait, Clock().t + 5)
    remove(server, "vllm-decode-c")  # it chose another (a rollout's proportions, a canary's weight)
    assert "wait" in await act.resume(o, removing["wait"], Clock().t + 30)
    done = await act.resume(o, removing["wait"], Clock().t + 66)
    assert done["replicas"] == 2 and done["not_removed"] == ["vllm-decode-a"] and routed(server, "vllm-decode-a")


def lws(replicas: int = 2, size: int = 4, ready: int | None = None) -> dict[str, Any]:
    workers = {"spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]}}
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "vllm-prefill", "namespace": NS},
            "spec": {"replicas": replicas, "leaderWorkerTemplate": {"size": size, "workerTemplate": workers}},
            "status": {"readyReplicas": replicas if ready is None else ready}}


def group_pod(group: int, worker: int) -> dict[str, Any]:
    p = pod(f"vllm-prefill-{group}" + (f"-{worker}" if worker else ""), app="vllm-prefill")
    p["metadata"]["labels"] |= {"leaderworkerset.sigs.k8s.io/name": "vllm-prefill",
                                "leaderworkerset.sigs.k8s.io/group-index": str(group),
                                "leaderworkerset.sigs.k8s.io/worker-index": str(worker)}
    return p


async def test_a_gang_scales_by_whole_groups_and_drains_the_group_that_goes(server: ApiServer,
                                                                            api: client.ApiClient) -> None:
    server.put(LWS, lws(replicas=2))
    server.put(PODS, pod("vllm-decode-a"))  # another pool's engine in the namespace: never touched
    for g in range(2):
        for i in range(4):
            server.put(PODS, group_pod(g, i))
    act = actuator(api)
    assert (await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(12), pool="prefill")))["replicas"] == 3
    server.put(LWS, lws(replicas=2))
    # The LeaderWorkerSet removes its highest group, however busy: that group is drained, not the idlest engines.
    busy = {f"vllm-prefill-1{'-' + str(i) if i else ''}": 9.0 for i in range(4)} | {"vllm-prefill-0": 0.0}
    first = await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), pool="prefill", busy=busy))
    assert sorted(first["wait"]["pods"]) == ["vllm-prefill-1", "vllm-prefill-1-1", "vllm-prefill-1-2",
                                             "vllm-prefill-1-3"]
    other = server.get(PODS, NS, "vllm-decode-a")
    assert other is not None and other["metadata"]["labels"]["llm-d.ai/routed"] == "true"
    assert server.get(PODS, NS, "vllm-prefill-0")["metadata"]["labels"]["llm-d.ai/routed"] == "true"  # type: ignore[index]


def statefulset(server: ApiServer) -> None:
    """A StatefulSet `vllm-kv` of three engines, `vllm-kv-0` to `-2`."""
    sts = deployment("vllm-kv", replicas=3)
    sts["kind"] = "StatefulSet"
    sts["spec"] = {"replicas": 3, "selector": sts["spec"]["selector"], "serviceName": "vllm-kv",
                   "template": sts["spec"]["template"]}
    server.put(STATEFULSETS, sts)
    for i in range(3):
        server.put(PODS, pod(f"vllm-kv-{i}", app="vllm-kv"))


async def test_a_statefulset_drains_its_highest_ordinals(server: ApiServer, api: client.ApiClient) -> None:
    statefulset(server)
    act = actuator(api)
    act.workloads["kv"] = Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")
    busy = {"vllm-kv-0": 0.0, "vllm-kv-1": 0.0, "vllm-kv-2": 7.0}
    first = await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(2), pool="kv", busy=busy))
    assert first["wait"]["pods"] == ["vllm-kv-2"], "the ordinal the StatefulSet removes, not the idlest"


async def kv_scaled_to(server: ApiServer, api: client.ApiClient, replicas: int, act: KubernetesActuator | None = None
                       ) -> tuple[KubernetesActuator, Order, dict[str, Any]]:
    """The StatefulSet `vllm-kv` (afresh) scaled from 3 to `replicas`, all idle: the actuator, the order and the wait
    for its drained ordinals to go, the count written."""
    statefulset(server)
    if act is None:
        act = actuator(api)
        act.workloads["kv"] = Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")
    o = order(ActionKind.SCALE_POOL, ScaleTo(replicas), pool="kv", busy={f"vllm-kv-{i}": 0.0 for i in range(3)})
    first = await act.carry_out(o)
    removing = await act.resume(o, first["wait"], Clock().t + 5)
    assert server.get(STATEFULSETS, NS, "vllm-kv")["spec"]["replicas"] == replicas  # type: ignore[index]
    return act, o, removing["wait"]


def kv_raised_to(server: ApiServer, replicas: int) -> None:
    """`vllm-kv`'s count raised by a person (or the next plan) while its drained ordinals wait to go."""
    sts = server.get(STATEFULSETS, NS, "vllm-kv")
    assert sts is not None
    sts["spec"]["replicas"] = replicas
    server.put(STATEFULSETS, sts)


async def test_a_statefulsets_drained_ordinal_still_above_its_count_is_waited_for_longer(
        server: ApiServer, api: client.ApiClient) -> None:
    # The StatefulSet removes one pod at a time, and with OrderedReady not while a lower one is unhealthy: its top
    # ordinal may outlast the grace. It is going all the same; routed again, it would be killed later while serving.
    act, o, wait = await kv_scaled_to(server, api, 2)
    assert "wait" in await act.resume(o, wait, Clock().t + 66) and not routed(server, "vllm-kv-2")
    remove(server, "vllm-kv-2")
    done = await act.resume(o, wait, Clock().t + 120)
    assert done["removed"] == ["vllm-kv-2"] and "not_removed" not in done
    # Never removed: routed again at the last grace's end, as a Deployment's spared pod is at the first.
    act, o, wait = await kv_scaled_to(server, api, 2, act)
    assert "wait" in await act.resume(o, wait, Clock().t + 200)
    done = await act.resume(o, wait, Clock().t + 5 + 60 * 5 + 1)
    assert done["not_removed"] == ["vllm-kv-2"] and routed(server, "vllm-kv-2")
    # The count raised again meanwhile (by a person, or the next plan): the ordinal stays, and serves again at once.
    act, o, wait = await kv_scaled_to(server, api, 2, act)
    kv_raised_to(server, 3)
    done = await act.resume(o, wait, Clock().t + 70)
    assert done["not_removed"] == ["vllm-kv-2"] and routed(server, "vllm-kv-2")


async def test_a_statefulsets_drained_ordinal_the_count_was_raised_over_serves_while_the_higher_one_goes(
        server: ApiServer, api: client.ApiClient) -> None:
    act, o, wait = await kv_scaled_to(server, api, 1)
    assert sorted(wait["pods"]) == ["vllm-kv-1", "vllm-kv-2"]
    kv_raised_to(server, 2)  # ordinal 1 stays, ordinal 2 still goes
    waiting = await act.resume(o, wait, Clock().t + 70)
    assert waiting["wait"]["spared"] == ["vllm-kv-1"] and routed(server, "vllm-kv-1") and not routed(server, "vllm-kv-2")
    remove(server, "vllm-kv-2")
    done = await act.resume(o, waiting["wait"], Clock().t + 100)
    assert done["removed"] == ["vllm-kv-2"] and done["not_removed"] == ["vllm-kv-1"]


async def scaling_down(server: ApiServer, api: client.ApiClient) -> tuple[KubernetesActuator, Order, dict[str, Any]]:
    """Three decode engines scaled to two: the idle one, `vllm-decode-a`, drains; the actuator, order and wait."""
    server.put(DEPLOYMENTS, deployment(replicas=3))
    for name in ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c"):
        server.put(PODS, pod(name))
    act = actuator(api)
    o = order(ActionKind.SCALE_POOL, ScaleTo(2), busy={"vllm-decode-a": 0.0, "vllm-decode-b": 3.0, "vllm-decode-c": 3.0})
    return act, o, (await act.carry_out(o))["wait"]


async def test_a_scale_made_by_hand_during_a_drain_is_not_undone(server: ApiServer, api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    assert wait["pods"] == ["vllm-decode-a"]
    server.put(DEPLOYMENTS, deployment(replicas=5))  # an operator scales up for an incoming launch meanwhile
    with pytest.raises(ActuationError, match="went from 3 to 5 engines while vllm-decode-a drained"):
        await act.resume(o, wait, Clock().t + 5)
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 5  # type: ignore[index]
    back = server.get(PODS, NS, "vllm-decode-a")
    assert back is not None and back["metadata"]["labels"]["llm-d.ai/routed"] == "true"
    assert "controller.kubernetes.io/pod-deletion-cost" not in back["metadata"].get("annotations", {})


async def test_an_eviction_that_loses_to_a_change_of_its_pod_is_asked_again(server: ApiServer,
                                                                            api: client.ApiClient) -> None:
    act, clock, o, wait = await draining(server, api, busy=0.0)
    server.fail("POST", "/eviction", 409, "Operation cannot be fulfilled on pods: the object has been modified")
    held = await act.resume(o, wait, clock.t + 1)
    assert held["wait"]["pods"] == ["vllm-decode-a"], "asked again next tick, not a failed action"
    done = await act.resume(o, held["wait"], clock.t + 20)
    assert done["drained"] == ["vllm-decode-a"] and server.get(PODS, NS, "vllm-decode-a") is None


async def test_a_scale_down_begun_by_a_leader_that_stopped_is_released_when_it_is_not_carried_further(
        server: ApiServer, api: client.ApiClient) -> None:
    act, o, _ = await scaling_down(server, api)
    assert await act.applied(o) is False, "its count is not written: not applied"
    assert "llm-d.ai/routed" not in server.get(PODS, NS, "vllm-decode-a")["metadata"]["labels"]  # type: ignore[index]
    said = await actuator(api).release(o)  # the new leader's actuator: nothing but the fleet to go by
    assert said == "the drained engines are routed again (vllm-decode-a)"
    back = server.get(PODS, NS, "vllm-decode-a")
    assert back is not None and back["metadata"]["labels"]["llm-d.ai/routed"] == "true"
    assert "controller.kubernetes.io/pod-deletion-cost" not in back["metadata"].get("annotations", {})
    assert await actuator(api).release(o) == "nothing was taken out of routing"
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 3  # type: ignore[index]


async def test_a_drain_taken_over_is_begun_again_and_one_whose_pod_is_gone_is_done(server: ApiServer,
                                                                                 api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=2))
    server.put(PODS, pod("vllm-decode-a"))
    o = order(ActionKind.DRAIN_ENGINE, Drain("vllm-decode-a"), busy={"vllm-decode-a": 2.0})
    act = actuator(api)
    await act.carry_out(o)
    for begun in (o, order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"))):  # a cordon's was `unknown` before
        assert await act.applied(begun) is False, "begun again at no cost, or released"
    again = await act.carry_out(o)
    assert again["wait"]["pods"] == ["vllm-decode-a"]
    server.objects[PODS, NS, "vllm-decode-a"].delete()  # evicted before the stopped leader recorded it
    assert await act.carry_out(o) == {"drained": ["vllm-decode-a"], "already_gone": True}


async def draining(server: ApiServer, api: client.ApiClient, busy: float
                   ) -> tuple[KubernetesActuator, Clock, Order, dict[str, Any]]:
    """Two decode engines; `vllm-decode-a`, with `busy` requests, taken out of routing to drain: the actuator, its
    clock, the order and the wait."""
    server.put(DEPLOYMENTS, deployment(replicas=2))
    server.put(PODS, pod("vllm-decode-a"))
    clock = Clock()
    act = actuator(api, clock)
    o = order(ActionKind.DRAIN_ENGINE, Drain("vllm-decode-a"), busy={"vllm-decode-a": busy})
    return act, clock, o, (await act.carry_out(o))["wait"]


async def test_a_drain_that_does_not_go_idle_ends_at_the_grace(server: ApiServer, api: client.ApiClient) -> None:
    act, clock, o, wait = await draining(server, api, busy=3.0)
    clock.t += 61
    done = await act.resume(o, wait, clock.t)
    assert done == {"drained": ["vllm-decode-a"], "idle": False, "waited_s": 61.0}
    assert server.get(PODS, NS, "vllm-decode-a") is None, "evicted; its Deployment replaces it"


async def test_a_late_count_is_waited_for_and_a_silent_engine_is_not(server: ApiServer,
                                                                      api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    for name in ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c"):
        server.put(PODS, pod(name))
    clock = Clock()
    act = actuator(api, clock)
    everyone = {"vllm-decode-a", "vllm-decode-b", "vllm-decode-c"}
    # b's scrape is late and c stopped answering: c goes first, then a (1 request), never b (unknown).
    o = order(ActionKind.SCALE_POOL, ScaleTo(1), busy={"vllm-decode-a": 1.0},
              answering=everyone - {"vllm-decode-c"})
    first = await act.carry_out(o)
    assert first["wait"]["pods"] == ["vllm-decode-c", "vllm-decode-a"]
    late = order(ActionKind.SCALE_POOL, ScaleTo(1), answering=everyone)  # a's count is late this tick
    assert "wait" in await act.resume(late, first["wait"], clock.t + 5), "a late count is not a count of 0"
    unknown = order(ActionKind.SCALE_POOL, ScaleTo(1))  # the source keeps no per-target health
    assert "wait" in await act.resume(unknown, first["wait"], clock.t + 5)
    gone = order(ActionKind.SCALE_POOL, ScaleTo(1), busy={"vllm-decode-a": 0.0}, answering={"vllm-decode-a"})
    done = scaled(await act.resume(gone, first["wait"], clock.t + 6))  # c is no longer discovered; a is idle
    assert done["idle"] is True and done["replicas"] == 1


async def test_engine_arguments_for_eplb_and_speculation(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    act = actuator(api)
    done = await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True, 1000, 3000, 8), action_id=1))
    assert done["eplb"] is True
    dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert dep is not None
    vllm, sidecar = dep["spec"]["template"]["spec"]["containers"]
    assert vllm["args"][-3:] == ["--enable-eplb", "--eplb-config",
                                 '{"window_size":1000,"step_interval":3000,"num_redundant_experts":8}']
    assert sidecar["args"] == ["--log-level", "info"], "other containers are untouched"
    await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), action_id=2))
    args = server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "eagle", "model": "/models/eagle", "num_speculative_tokens": 2}
    await act.carry_out(order(ActionKind.DISABLE_SPECULATION, Speculation(0), action_id=3))
    dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert "--speculative-config" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    # Off, and back on with the configuration it was switched off with (a revert).
    await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(2), action_id=4))
    args = server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    assert json.loads(args[args.index("--speculative-config") + 1])["method"] == "eagle"
    await act.carry_out(order(ActionKind.DISABLE_EPLB, Eplb(False), action_id=5))
    args = server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    assert "--enable-eplb" not in args and "--eplb-config" not in args and args[:4] == ARGS[:4]


def lws_templates(leader: dict[str, Any] | None, worker: dict[str, Any]) -> dict[str, Any]:
    """A LeaderWorkerSet whose leader and workers run the given `vllm` containers (no leader template: None)."""
    group = lws()
    spec = group["spec"]["leaderWorkerTemplate"]
    spec["workerTemplate"] = {"spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", **worker}]}}
    if leader is not None:
        spec["leaderTemplate"] = {"spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                                           **leader}]}}
    return group


def containers_of(server: ApiServer) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    spec = server.get(LWS, NS, "vllm-prefill")["spec"]["leaderWorkerTemplate"]  # type: ignore[index]
    leader = spec.get("leaderTemplate")
    return (leader["spec"]["containers"][0] if leader else None), spec["workerTemplate"]["spec"]["containers"][0]


async def test_eplb_is_not_enabled_on_an_engine_without_expert_parallelism(server: ApiServer,
                                                                           api: client.ApiClient) -> None:
    dense = deployment()
    args = dense["spec"]["template"]["spec"]["containers"][0]["args"]
    args.remove("--enable-expert-parallel")
    server.put(DEPLOYMENTS, dense)
    before = server.get(DEPLOYMENTS, NS, "vllm-decode")
    with pytest.raises(ActuationError, match="runs without --enable-expert-parallel"):
        await actuator(api).carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), action_id=1))
    assert server.get(DEPLOYMENTS, NS, "vllm-decode") == before, "vLLM would refuse to start: nothing is rolled out"


@pytest.mark.parametrize(("kind", "spec", "why"), [
    ("Deployment", {"paused": True}, "it is paused"),
    ("Rollout", {"paused": True}, "it is paused"),
    ("StatefulSet", {"updateStrategy": {"type": "OnDelete"}}, "OnDelete"),
    ("StatefulSet", {"updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}}, "partition 1"),
    ("LeaderWorkerSet", {"rolloutStrategy": {"rollingUpdateConfiguration": {"partition": 2}}}, "partition 2"),
])
async def test_no_engine_flags_are_written_where_the_controller_would_not_roll_them_out(
        server: ApiServer, api: client.ApiClient, kind: str, spec: dict[str, Any], why: str) -> None:
    """Written there, the change reads as made and settled (such pods are no rollout) while engines run without it."""
    act = actuator(api)
    if kind == "Deployment":
        obj, resource, pool = deployment(), DEPLOYMENTS, "decode"
    elif kind == "Rollout":
        obj = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "metadata": {"name": "vllm-canary", "namespace": NS},
               "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "vllm-canary"}},
                        "template": deployment("vllm-canary")["spec"]["template"]}}
        resource, pool = ROLLOUTS, "canary"
    elif kind == "StatefulSet":
        statefulset(server)
        obj, resource, pool = server.get(STATEFULSETS, NS, "vllm-kv"), STATEFULSETS, "kv"
        assert obj is not None
        obj["spec"]["template"]["spec"]["containers"][0]["args"] = list(ARGS)
        act.workloads["kv"] = Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")
    else:
        obj = lws_templates({"args": list(ARGS)}, {"args": ["--foo"]})
        resource, pool = LWS, "prefill"
    obj["spec"].update(spec)
    server.put(resource, obj)
    before = json.loads(json.dumps(server.get(resource, NS, obj["metadata"]["name"])))
    with pytest.raises(ActuationError, match=f"not made: .*{why}"):
        await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), pool=pool, action_id=1))
    assert server.get(resource, NS, obj["metadata"]["name"]) == before
    assert not server.invalid


async def test_a_paused_deployment_is_not_rolled_back(server: ApiServer, api: client.ApiClient) -> None:
    """As `kubectl rollout undo` refuses it: the old template would wait unrolled while the bad one serves."""
    dep = server.put(DEPLOYMENTS, deployment())
    server.put(REPLICASETS, replica_set(dep, 1, "vllm/vllm-openai:v0.10.0", "2026-11-20T10:00:00Z"))
    server.put(REPLICASETS, replica_set(dep, 2, "vllm/vllm-openai:v0.11.0", "2026-12-01T09:55:00Z"))
    paused = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert paused is not None
    paused["spec"]["paused"] = True
    before = json.loads(json.dumps(server.put(DEPLOYMENTS, paused)))
    with pytest.raises(ActuationError, match="not made: it is paused"):
        await actuator(api).carry_out(order(ActionKind.ROLLBACK, RollBack("decode")))
    assert server.get(DEPLOYMENTS, NS, "vllm-decode") == before


async def test_a_gangs_engine_arguments_change_where_vllm_serves(server: ApiServer, api: client.ApiClient) -> None:
    act = actuator(api)
    # A Ray group: the leader serves, the workers join its cluster. Only the leader's flags change; a flag given to
    # `ray start` would break the workers.
    ray = ["ray", "start", "--address=$(LWS_LEADER_ADDRESS):6379", "--block"]
    server.put(LWS, lws_templates({"command": ["vllm", "serve"], "args": list(ARGS)}, {"command": list(ray)}))
    done = await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), pool="prefill", action_id=1))
    leader, worker = containers_of(server)
    assert done["eplb"] is True and leader is not None and "--enable-eplb" in leader["args"]
    assert worker["command"] == ray and "args" not in worker
    done = await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), pool="prefill", action_id=2))
    assert done["from"] == 3 and done["num_speculative_tokens"] == 2
    # Data parallelism over nodes: every pod serves, so every template changes, in one write.
    server.put(LWS, lws_templates({"args": [*ARGS, "--data-parallel-rank", "0"]},
                                  {"args": [*ARGS, "--headless"]}))
    await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), pool="prefill", action_id=3))
    leader, worker = containers_of(server)
    assert leader is not None and "--enable-eplb" in leader["args"] and "--enable-eplb" in worker["args"]
    assert leader["args"][:len(ARGS) + 1] == [*ARGS, "--data-parallel-rank"] and "--headless" in worker["args"]
    # No leader template: every pod runs the workers' one.
    server.put(LWS, lws_templates(None, {"command": ["/entry.sh"], "args": list(ARGS)}))
    await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), pool="prefill", action_id=4))
    assert "--enable-eplb" in containers_of(server)[1]["args"]
    # A path that names vLLM is not its server: the Ray workers' script takes no engine flags.
    script = ["bash", "/vllm-workspace/examples/online_serving/multi-node-serving.sh", "worker",
              "--ray_address=$(LWS_LEADER_ADDRESS)"]
    server.put(LWS, lws_templates({"args": list(ARGS)}, {"command": list(script)}))
    await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), pool="prefill", action_id=6))
    leader, worker = containers_of(server)
    assert leader is not None and "--enable-eplb" in leader["args"] and worker["command"] == script
    # Neither template recognisably serves: which to change is not guessed.
    server.put(LWS, lws_templates({"command": ["/leader.sh"]}, {"command": ["/worker.sh"]}))
    with pytest.raises(ActuationError, match="none of its pod templates runs vLLM's server recognisably"):
        await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), pool="prefill", action_id=5))


async def test_flags_inside_a_shell_string_are_refused_not_silently_dropped(server: ApiServer,
                                                                             api: client.ApiClient) -> None:
    act = actuator(api)
    # vLLM's own multi-node example starts the leader from `sh -c`: flags appended after the string would be the
    # shell's positional parameters, which it ignores, and the change would do nothing.
    script = "bash /vllm-workspace/multi-node-serving.sh leader; python3 -m vllm.entrypoints.openai.api_server --tp 8"
    ray = ["sh", "-c", "bash /vllm-workspace/multi-node-serving.sh worker --ray_address=$(LWS_LEADER_ADDRESS)"]
    server.put(LWS, lws_templates({"command": ["sh", "-c", script]}, {"command": ray}))
    with pytest.raises(ActuationError, match=r"leaderTemplate\): container .vllm. runs a shell string \(sh -c"):
        await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), pool="prefill", action_id=1))
    leader, worker = containers_of(server)
    assert leader is not None and leader["command"] == ["sh", "-c", script] and worker["command"] == ray
    # A script that hands its args on to the server: the args are the flags.
    dep = deployment()
    dep["spec"]["template"]["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", 'exec vllm serve "$@"', "--"]
    server.put(DEPLOYMENTS, dep)
    await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), action_id=2))
    vllm = server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert "--enable-eplb" in vllm["args"] and vllm["command"][-1] == "--"
    # However the string is given: options run together, the shell named in command and the string in args, a
    # shell behind `env`, or a shell string that starts no vLLM (a wrapper): appended flags would be ignored.
    for n, launch in enumerate([
            {"command": ["bash", "-c", "vllm serve /m --port 8000"], "args": []},
            {"command": ["/bin/sh", "-ec", "exec vllm serve /m"]},
            {"command": ["/bin/sh"], "args": ["-c", "exec vllm serve /m"]},
            {"command": ["/usr/bin/env", "HF_HOME=/cache", "bash", "-o", "pipefail", "-c", "vllm serve /m | tee log"]},
            {"command": ["sh", "-c", "/start.sh"], "args": ["--port", "8000"]},
            {"command": ["bash", "-euo", "pipefail", "-c", "vllm serve /m"]},
            {"command": ["tini", "--", "sh", "-c", "vllm serve /m"]},
            {"command": ["tini", "-p", "SIGTERM", "--", "sh", "-c", "vllm serve /m"]},
            {"command": ["/usr/bin/dumb-init", "--", "bash", "-c", "vllm serve /m"]},
            {"command": ["env", "-i", "sh", "-c", "vllm serve /m"]},
            # Hands on "$@", with nothing after the string for $0: the first flag appended would become $0.
            {"command": ["sh", "-c", 'exec vllm serve /m "$@"']}]):
        dep["spec"]["template"]["spec"]["containers"][0] = {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                                            **launch}
        server.put(DEPLOYMENTS, dep)
        with pytest.raises(ActuationError, match="runs a shell string"):
            await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), action_id=3 + n))
    # A wrapper's option whose value is missing ends the command: nothing to read past it.
    assert kubernetes_actuator._launch({"command": ["tini", "-p"]}) == (False, None)
    # A flag set inside a string that hands on "$@": no edit of the args takes it away.
    dep["spec"]["template"]["spec"]["containers"][0] = {
        "name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
        "command": ["sh", "-c", 'exec vllm serve /m --enable-eplb "$@"', "--"], "args": ["--port", "8000"]}
    server.put(DEPLOYMENTS, dep)
    with pytest.raises(ActuationError, match="--enable-eplb or --eplb-config is set inside"):
        await act.carry_out(order(ActionKind.DISABLE_EPLB, Eplb(False), action_id=20))


async def test_engine_flags_are_found_wherever_and_however_spelled(server: ApiServer, api: client.ApiClient) -> None:
    act = actuator(api)
    dep = deployment()
    # Flags in the command, more in args; vLLM's parser takes `_` for `-` in a name.
    dep["spec"]["template"]["spec"]["containers"][0] |= {
        "command": ["vllm", "serve", "/models/llama", "--enable_eplb", "--speculative_config",
                    '{"method":"eagle","model":"/models/eagle","num_speculative_tokens":3}'],
        "args": ["--port=8000"]}
    server.put(DEPLOYMENTS, dep)
    done = await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), action_id=1))
    assert (done["from"], done["num_speculative_tokens"]) == (3, 2)
    await act.carry_out(order(ActionKind.DISABLE_EPLB, Eplb(False), action_id=2))
    vllm = server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert vllm["command"] == ["vllm", "serve", "/models/llama"]
    assert vllm["args"][0] == "--port=8000" and vllm["args"][1] == "--speculative-config"
    assert json.loads(vllm["args"][2])["num_speculative_tokens"] == 2


async def test_the_template_digest_moves_with_the_template_not_the_count(server: ApiServer,
                                                                         api: client.ApiClient) -> None:
    # What an approved restart is checked against when it is due (a template changed since: stale).
    server.put(DEPLOYMENTS, deployment(replicas=3))
    act = actuator(api)
    first = (await act.observe()).pools["decode"].template
    await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=1))
    assert first is not None and (await act.observe()).pools["decode"].template == first
    await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), action_id=2))
    assert (await act.observe()).pools["decode"].template not in (first, None)
    # The router's too, for a rollback of it approved after a hand rollback.
    epp = server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    router = (await act.observe()).router_template
    epp["spec"]["template"]["spec"]["containers"][0]["image"] = "epp:v3"
    server.put(DEPLOYMENTS, epp)
    assert router is not None and (await act.observe()).router_template not in (router, None)
    # A LeaderWorkerSet's revision is both templates and the group's size: the leader runs `vllm serve`.
    group = lws()
    group["spec"]["leaderWorkerTemplate"] |= {"leaderTemplate": {"spec": {"containers": [{"name": "vllm",
                                                                                             "args": ["--tp", "8"]}]}},
                                              "workerTemplate": {"spec": {"containers": [{"name": "vllm"}]}}}
    server.put(LWS, group)
    before = (await act.observe()).pools["prefill"].template
    group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["args"] = ["--tp", "4"]
    server.put(LWS, group)
    assert (await act.observe()).pools["prefill"].template not in (before, None)


async def test_a_stale_read_is_retried_and_refusals_fail_with_the_apis_message(server: ApiServer,
                                                                                api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    act = actuator(api)
    server.fail("PATCH", "/deployments/vllm-decode", 409, "the object has been modified", times=2)
    done = await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True), action_id=1))
    assert done["eplb"] is True  # third attempt, on a fresh read
    server.fail("PATCH", "/deployments/vllm-decode", 422,
                'Deployment.apps "vllm-decode" is invalid: spec.template.spec.containers[0].args: Too long')
    with pytest.raises(ActuationError, match="HTTP 422.*is invalid: spec.template.spec.containers"):
        await act.carry_out(order(ActionKind.DISABLE_EPLB, Eplb(False), action_id=2))
    server.fail("PATCH", "/deployments/vllm-decode/scale", 403,
                'deployments.apps "vllm-decode" is forbidden: User "system:serviceaccount:llm:fleet" cannot patch')
    with pytest.raises(ActuationError, match="HTTP 403.*cannot patch"):
        await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=3))
    server.fail("PATCH", "/deployments/vllm-decode", 409, "modified", times=3)
    with pytest.raises(ActuationError, match="kept changing under three attempts"):
        await act.carry_out(order(ActionKind.DISABLE_EPLB, Eplb(False), action_id=4))


async def test_server_errors_and_timeouts_are_retried_once(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    act = actuator(api)
    server.fail("PATCH", "/deployments/vllm-decode/scale", 500, "etcdserver: request timed out")
    assert (await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=1)))["replicas"] == 4
    # Beyond the 2 s timeout, twice: the writes are stored all the same, and the count read back says so.
    server.slow("PATCH", "/deployments/vllm-decode/scale", 2.5, times=2, stored=True)
    done = await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(5), action_id=2))
    assert done["replicas"] == 5 and "Timeout" in done["unanswered"]
    dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert dep is not None and dep["metadata"]["annotations"][ACTION_ANNOTATION] == "2@0"
    # Two server errors that stored nothing: the action fails, and says why.
    server.fail("PATCH", "/deployments/vllm-decode/scale", 504, "Timeout: request did not complete", times=2)
    with pytest.raises(ActuationError, match="HTTP 504"):
        await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(6), action_id=3))
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 5  # type: ignore[index]


async def test_an_unanswered_template_change_is_found_made_or_failed(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    act = actuator(api)
    patch = act._patch

    async def stored_unanswered(w: Workload, body: dict[str, Any], what: str) -> dict[str, Any]:
        await patch(w, body, what)
        raise kubernetes_actuator._Unanswered(f"{what}: ReadTimeoutError")

    act._patch = stored_unanswered  # type: ignore[method-assign]
    before = tokens(server)
    done = await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), action_id=1))
    assert "ReadTimeoutError" in done["unanswered"] and "already_applied" in done
    assert (done["from"], done["num_speculative_tokens"], tokens(server)) == (before, before - 1, before - 1)
    act._patch = patch  # type: ignore[method-assign]
    server.fail("PATCH", "/deployments/vllm-decode", 503, "etcd leader changed", times=2)
    with pytest.raises(ActuationError, match="HTTP 503"):
        await act.carry_out(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), action_id=2))
    assert tokens(server) == before - 1


async def test_a_scale_is_not_made_on_a_count_someone_changed_since_its_approval(server: ApiServer,
                                                                                 api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    act = actuator(api)
    write = act._set_replicas

    async def operator_scales_first(*args: Any, **kwargs: Any) -> dict[str, Any]:
        server.put(DEPLOYMENTS, deployment(replicas=2))  # their write wins: ours gets a 409
        raise kubernetes_actuator._Conflict("the object has been modified")

    act._set_replicas = operator_scales_first  # type: ignore[method-assign]
    approved = replace(order(ActionKind.SCALE_POOL, ScaleTo(5), action_id=1), from_replicas=3)
    with pytest.raises(ActuationError, match="went from 3 to 2 engines since the scale to 5 was approved"):
        await act.carry_out(approved)
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 2  # type: ignore[index]
    act._set_replicas = write  # type: ignore[method-assign]
    # Read already moved: a scale-down takes no engine out of routing.
    server.put(PODS, pod("vllm-decode-a"))
    with pytest.raises(ActuationError, match="went from 3 to 2 engines"):
        await act.carry_out(replace(approved, change=ScaleTo(1), action_id=2))
    assert routed(server, "vllm-decode-a")
    # At the count asked for already (a write of its own whose answer was lost): made, and stamped.
    server.put(DEPLOYMENTS, deployment(replicas=5))
    assert (await act.carry_out(replace(approved, action_id=3)))["replicas"] == 5
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["metadata"]["annotations"][ACTION_ANNOTATION] == "3@0"  # type: ignore[index]


async def test_a_rollback_is_not_made_after_someone_rolled_back_by_hand(server: ApiServer,
                                                                        api: client.ApiClient) -> None:
    # `kubectl rollout undo` wins the race: the bad revision's ReplicaSet is now the previous one, and undoing once
    # more from the fresh read would bring it back.
    epp = server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    good = replica_set(epp, 4, "epp:v1-cache-aware", "2026-11-20T10:00:00Z")
    server.put(REPLICASETS, good)
    server.put(REPLICASETS, replica_set(epp, 5, "epp:v2-round-robin", "2026-12-01T09:55:00Z"))
    bad = server.get(DEPLOYMENTS, NS, "epp")
    assert bad is not None
    bad["spec"]["template"]["spec"]["containers"][0]["image"] = "epp:v2-round-robin"
    server.put(DEPLOYMENTS, bad)
    act = actuator(api)
    approved = replace(order(ActionKind.ROLLBACK, RollBack("router")),
                       from_template=(await act.observe()).router_template)
    patch = act._patch

    async def undone_by_hand_first(w: Workload, body: dict[str, Any], what: str) -> dict[str, Any]:
        undone = json.loads(json.dumps(bad))
        undone["spec"]["template"]["spec"]["containers"][0]["image"] = "epp:v1-cache-aware"
        server.put(DEPLOYMENTS, undone)
        good["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "6"
        server.put(REPLICASETS, good)
        act._patch = patch  # type: ignore[method-assign]
        raise kubernetes_actuator._Conflict("the object has been modified")

    act._patch = undone_by_hand_first  # type: ignore[method-assign]
    with pytest.raises(ActuationError, match="pod template of Deployment llm/epp changed since roll the router back"):
        await act.carry_out(approved)
    image = server.get(DEPLOYMENTS, NS, "epp")["spec"]["template"]["spec"]["containers"][0]["image"]  # type: ignore[index]
    assert image == "epp:v1-cache-aware"


async def test_rollback_of_a_deployment_restores_its_previous_template(server: ApiServer,
                                                                       api: client.ApiClient) -> None:
    epp = server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    server.put(REPLICASETS, replica_set(epp, 4, "epp:v1-cache-aware", "2026-11-20T10:00:00Z"))
    server.put(REPLICASETS, replica_set(epp, 5, "epp:v2-round-robin", "2026-12-01T09:55:00Z"))
    # The bad revision added keys of its own, which the previous template does not have.
    bad = server.get(DEPLOYMENTS, NS, "epp")
    assert bad is not None
    bad["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "bad"}
    bad["spec"]["template"]["metadata"]["annotations"] = {"bad": "yes"}
    server.put(DEPLOYMENTS, bad)
    server.fail("PATCH", "/deployments/epp", 409, "the object has been modified")  # retried on a fresh read
    act = actuator(api)
    approved = (await act.observe()).router_template  # the template is as approved on both reads
    done = await act.carry_out(replace(order(ActionKind.ROLLBACK, RollBack("router"), pool="decode"),
                                       from_template=approved))
    assert done == {"rolled_back": "Deployment llm/epp", "to_revision": "4"}
    template = server.get(DEPLOYMENTS, NS, "epp")["spec"]["template"]  # type: ignore[index]
    assert template["spec"]["containers"][0]["image"] == "epp:v1-cache-aware"
    assert "pod-template-hash" not in template["metadata"]["labels"]
    assert "nodeSelector" not in template["spec"] and "annotations" not in template["metadata"], "the old one, whole"
    with pytest.raises(ActuationError, match="no workload|no previous revision"):
        server.put(DEPLOYMENTS, deployment())
        await actuator(api).carry_out(order(ActionKind.ROLLBACK, RollBack("decode"), action_id=8))


async def test_an_argo_rollout_is_aborted(server: ApiServer, api: client.ApiClient) -> None:
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS}, "spec": {"replicas": 2}})
    done = await actuator(api).carry_out(order(ActionKind.ROLLBACK, RollBack("canary"), pool="canary"))
    assert done == {"aborted": "Rollout llm/vllm-canary"}
    assert server.get(ROLLOUTS, NS, "vllm-canary")["status"]["abort"] is True  # type: ignore[index]


async def test_cordon_evicts_once_the_budget_allows(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    server.put(PODS, pod("vllm-decode-a", node="gpu-node-1"))
    server.put(PODS, pod("vllm-decode-b", node="gpu-node-2"))
    server.pdb_blocks["vllm-decode-a"] = 1  # the PodDisruptionBudget holds it back once
    clock = Clock()
    act = actuator(api, clock)
    # The node failed: its engine no longer answers, so there is nothing to wait for.
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), answering={"vllm-decode-b"})
    first = await act.carry_out(o)
    assert first["wait"]["pods"] == ["vllm-decode-a"]
    assert server.get(NODES, None, "gpu-node-1")["spec"]["unschedulable"] is True  # type: ignore[index]
    refused = await act.resume(o, first["wait"], clock.t + 1)  # idle, but the budget refuses
    assert refused["wait"]["pods"] == ["vllm-decode-a"]
    done = await act.resume(o, refused["wait"], clock.t + 2)
    assert done == {"cordoned": "gpu-node-1", "evicted": ["vllm-decode-a"], "waited_for_idle": True}
    assert server.get(PODS, NS, "vllm-decode-a") is None and server.get(PODS, NS, "vllm-decode-b") is not None


async def test_the_action_annotation_stops_a_repeat(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    act = actuator(api)
    o = order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=42)
    assert await act.applied(o) is False
    await act.carry_out(o)
    assert await act.applied(o) == {"already_applied": "Deployment llm/vllm-decode"}
    again = await act.carry_out(o)  # a new leader that cannot tell whether the old one got this far
    assert again == {"already_applied": "Deployment llm/vllm-decode"}
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 4  # type: ignore[index]
    # A store started afresh numbers its actions from 1 again: its own action 42 is not the earlier one.
    afresh = Order(42, ActionKind.SCALE_POOL, "decode", ScaleTo(5), "a test", created_at=1_800_000_000.0)
    assert await act.applied(afresh) is False
    assert (await act.carry_out(afresh))["replicas"] == 5


async def test_a_scale_whose_count_was_written_and_not_stamped_is_found_by_its_count(server: ApiServer,
                                                                                    api: client.ApiClient) -> None:
    """The count is written, then stamped: a leader stopped between the two left the pool at the count this scale
    asked for, and its successor recorded the action as never applied (no cooldown after it, a false audit log)."""
    server.put(DEPLOYMENTS, deployment(replicas=3))
    o = replace(order(ActionKind.SCALE_POOL, ScaleTo(4)), from_replicas=3)
    act = actuator(api)
    assert await act.applied(o) is False  # still at the count it was approved at: not made
    dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert dep is not None
    dep["spec"]["replicas"] = 4  # the scale subresource's write, and no stamp after it
    server.put(DEPLOYMENTS, dep)
    found = await act.applied(o)
    assert isinstance(found, dict) and found["replicas"] == 4 and "found by its count" in found["unstamped"]
    assert await act.applied(replace(o, from_replicas=4)) is False  # nothing moved since it was approved


async def test_a_successor_records_a_scale_found_by_its_count_as_made(server: ApiServer, api: client.ApiClient) -> None:
    from controlplane.actions import ActionState
    from controlplane.clock import VirtualClock
    from controlplane.config import parse_config
    from controlplane.loop import ControlLoop
    from controlplane.observe import Observation
    from controlplane.store.memory import MemoryStore
    from controlplane.store.records import NewAction
    from controlplane.telemetry import Telemetry
    from policies.types import change_as_dict

    class Quiet:
        async def observe(self, now: float) -> Observation:
            return Observation(signals=[])

    server.put(DEPLOYMENTS, deployment(replicas=4))  # the stopped leader's count, and no stamp
    clock, store = VirtualClock(), MemoryStore()
    a = await store.create_action(NewAction(None, "scale_pool", "decode", {"change": change_as_dict(ScaleTo(4)),
                                                                          "from_replicas": 3, "replicas": 4},
                                            "act", "more decode engines"), clock.now())
    await store.transition(a.id, ActionState.PROPOSED, ActionState.APPROVED, clock.now(), {"by": "rails"},
                           approved_by="rails")
    await store.transition(a.id, ActionState.APPROVED, ActionState.STARTED, clock.now(), {"actuator": "kubernetes"})
    clock.advance(5)
    config = parse_config("mode: act\npools:\n  - {name: decode, role: decode, model: m, replicas: {min: 1, max: 8}}\n"
                          "rails: {cooldown: 60s, verify_after: 5m, max_actions_per_hour: 20}\n")
    act = KubernetesActuator(api, Kubernetes(drain_grace=60.0, timeout=2.0),
                             {"decode": Workload(kind="Deployment", namespace=NS, name="vllm-decode")}, clock=clock.now)
    loop = ControlLoop(config=config, source=Quiet(), store=store, policies=[], actuator=act, clock=clock,
                       telemetry=Telemetry())
    await loop.start()  # the successor takes over
    [done] = await store.actions()
    assert done.state is ActionState.SUCCEEDED, [(e.event, e.detail) for e in await store.audit_log(a.id)]


async def test_server_side_dry_run_changes_nothing(server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    before = server.get(DEPLOYMENTS, NS, "vllm-decode")
    act = actuator(api, dry_run=True)
    assert act.dry_run is True
    await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4)))
    await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True)))
    assert server.get(DEPLOYMENTS, NS, "vllm-decode") == before
    assert events(server) == []
    writes = [r for r in server if str(r.method.value) in ("PATCH", "POST")]
    assert writes and all(r.params.get("dryRun") == "All" for r in writes)


async def test_the_configmap_kill_switch(server: ApiServer, api: client.ApiClient) -> None:
    switch = ConfigMapSwitch(api, ConfigMapFlag(namespace=NS, name="fleet-controlplane"))
    missing = await switch.paused()  # a switch named and deleted: not a way to turn acting back on
    assert missing is not None and "does not exist: not acting" in missing
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "fleet-controlplane", "namespace": NS}}
    server.put(CONFIGMAPS, {**configmap, "data": {"paused": "false"}})
    assert await switch.paused() is None
    server.put(CONFIGMAPS, {**configmap, "data": {"paused": "True"}})
    assert await switch.paused() == "ConfigMap llm/fleet-controlplane has paused: true"
    server.fail("GET", "/configmaps/fleet-controlplane", 500, "etcd down")
    reason = await switch.paused()
    assert reason is not None and "cannot be read" in reason, "unknown state means not acting"


def test_the_rbac_it_needs_is_what_it_calls() -> None:
    """The verbs each call path uses are the ones VERBS lists (and the deploy base grants)."""
    assert ("apps", "deployments/scale", "patch") in VERBS and ("", "pods/eviction", "create") in VERBS
    assert not any(verb in ("*", "update", "deletecollection", "escalate", "bind") for _, _, verb in VERBS)
    assert not any(resource == "secrets" for _, resource, _ in VERBS)


def tokens(server: ApiServer) -> int:
    args = server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    return int(json.loads(args[args.index("--speculative-config") + 1])["num_speculative_tokens"])


async def test_a_write_whose_answer_was_lost_is_not_made_twice(server: ApiServer, api: client.ApiClient) -> None:
    # The server made the write; its answer timed out and the resend lost to the write itself (409). A relative
    # change computed again from the fresh read would go a second step.
    server.put(DEPLOYMENTS, deployment())
    act = actuator(api)
    patch, lost = act._patch, []

    async def made_but_lost(w: Workload, body: dict[str, Any], what: str) -> dict[str, Any]:
        done = await patch(w, body, what)
        if not lost:
            lost.append(what)
            raise kubernetes_actuator._Conflict("the resend found the object changed")
        return done

    act._patch = made_but_lost  # type: ignore[method-assign]
    before = tokens(server)
    o = order(ActionKind.TUNE_SPECULATION, Speculation(step=-1))
    done = await act.carry_out(o)
    assert "already_applied" in done and tokens(server) == before - 1
    # What the change replaced comes back with it, as from a new leader: the revert sets it back.
    for found in (done, await act.carry_out(o)):
        assert (found["from"], found["num_speculative_tokens"]) == (before, before - 1)
    assert revert_of(o.kind, o.change, done) == (ActionKind.TUNE_SPECULATION, Speculation(before))
    # Another action's stamp since: the result kept is not this one's.
    await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=8))
    assert await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=8)) == {
        "already_applied": "Deployment llm/vllm-decode"}


async def test_a_failed_scale_down_puts_its_drained_engines_back(server: ApiServer, api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    server.fail("PATCH", "/scale", 422, "admission webhook denied the request")
    with pytest.raises(ActuationError, match="denied.*routed again"):
        await act.resume(o, wait, Clock().t + 5)
    back = server.get(PODS, NS, "vllm-decode-a")
    assert back is not None and back["metadata"]["labels"]["llm-d.ai/routed"] == "true", "not left serving nothing"


async def test_the_pods_drained_are_those_the_controller_removes(server: ApiServer, api: client.ApiClient) -> None:
    statefulset(server)
    dying = pod("vllm-kv-2", app="vllm-kv")
    dying["metadata"]["deletionTimestamp"] = "2026-12-05T10:00:00Z"  # its node was lost
    server.put(PODS, dying)
    act = actuator(api)
    act.workloads["kv"] = Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")
    first = await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(2), pool="kv"))
    assert first["wait"]["pods"] == [], "ordinal 1 stays: draining it would leave it out of routing for good"
    # A ReplicaSet removes a pod that is not ready before any other: only the rest are drained.
    server.put(DEPLOYMENTS, deployment(replicas=3))
    for name in ("vllm-decode-a", "vllm-decode-b"):
        server.put(PODS, pod(name))
    starting = pod("vllm-decode-c")
    starting["status"] = {"phase": "Pending"}
    server.put(PODS, starting)
    evicted = pod("vllm-decode-old")  # an evicted pod lingers: the controller counts it as no replica at all
    evicted["status"] = {"phase": "Failed", "reason": "Evicted"}
    server.put(PODS, evicted)
    assert (await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(2), action_id=8)))["wait"]["pods"] == []
    assert (await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(1), action_id=9,
                                      busy={"vllm-decode-a": 2.0, "vllm-decode-b": 0.0})))["wait"]["pods"] == [
        "vllm-decode-b"]


async def test_a_scale_down_taken_over_after_its_scale_is_done_not_failed(server: ApiServer,
                                                                         api: client.ApiClient) -> None:
    old_leader, o, wait = await scaling_down(server, api)
    await old_leader.resume(o, wait, Clock().t + 5)  # the old leader scaled, then died unrecorded
    again = await actuator(api).resume(o, wait, Clock().t + 20)  # the new leader resumes its wait
    done = scaled(again)  # and verifies the removal as the old leader would have
    assert "already_applied" in done and done["replicas"] == 2
    assert "llm-d.ai/routed" not in server.get(PODS, NS, "vllm-decode-a")["metadata"]["labels"]  # type: ignore[index]
    remove(server, "vllm-decode-a")
    assert (await actuator(api).resume(o, again["wait"], Clock().t + 35))["removed"] == ["vllm-decode-a"]


async def test_an_unreadable_router_leaves_the_pools_known_and_a_gone_pod_is_drained(server: ApiServer,
                                                                                    api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    server.fail("GET", "/deployments/epp", 503, "etcd timeout", times=2)
    view = await actuator(api).observe()
    assert "decode" in view.pools and "router" not in view.changed_at
    server.put(PODS, pod("vllm-decode-a"))
    o = order(ActionKind.DRAIN_ENGINE, Drain("vllm-decode-a"), busy={"vllm-decode-a": 0.0})
    first = await actuator(api).carry_out(o)
    server.fail("DELETE", "/pods/vllm-decode-a", 404, "pods \"vllm-decode-a\" not found")  # gone with its node
    done = await actuator(api).resume(o, first["wait"], Clock().t + 5)
    assert done["drained"] == ["vllm-decode-a"]


async def test_a_drain_taken_over_after_its_pod_was_replaced_deletes_nothing(server: ApiServer,
                                                                            api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=2))
    server.put(PODS, pod("vllm-decode-a"))
    o = order(ActionKind.DRAIN_ENGINE, Drain("vllm-decode-a"), busy={"vllm-decode-a": 0.0})
    first = await actuator(api).carry_out(o)
    await actuator(api).resume(o, first["wait"], Clock().t + 5)  # deleted; the old leader died unrecorded
    server.put(PODS, pod("vllm-decode-a"))  # its controller made a new engine under the same name
    await actuator(api).resume(o, first["wait"], Clock().t + 90)  # the new leader resumes the wait, past its grace
    assert server.get(PODS, NS, "vllm-decode-a") is not None, "the new engine is not deleted"


async def test_a_statefulset_whose_ordinals_start_later_drains_its_top_ordinal(server: ApiServer,
                                                                             api: client.ApiClient) -> None:
    sts = deployment("vllm-kv", replicas=4)
    sts["kind"] = "StatefulSet"
    sts["spec"] = {"replicas": 4, "selector": sts["spec"]["selector"], "serviceName": "vllm-kv",
                   "ordinals": {"start": 5}, "template": sts["spec"]["template"]}
    server.put(STATEFULSETS, sts)
    for i in range(5, 9):
        server.put(PODS, pod(f"vllm-kv-{i}", app="vllm-kv"))
    act = actuator(api)
    act.workloads["kv"] = Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")
    first = await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(3), pool="kv"))
    assert first["wait"]["pods"] == ["vllm-kv-8"]


async def test_drained_pods_stay_drained_once_the_count_is_written(server: ApiServer, api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)

    async def times_out(w: Workload, body: dict[str, Any], what: str) -> dict[str, Any]:
        raise ActuationError(f"{what}: ReadTimeoutError")

    act._patch = times_out  # type: ignore[method-assign]  # the stamp after the scale fails
    later = await act.resume(o, wait, Clock().t + 5)
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 2  # type: ignore[index]
    assert "llm-d.ai/routed" not in server.get(PODS, NS, "vllm-decode-a")["metadata"]["labels"], (  # type: ignore[index]
        "the ReplicaSet removes it: never routed again")
    # The change is made, not failed: what follows it, the check that the drained engine went, still runs.
    removing = later["wait"]
    assert removing["then"] == "verify" and removing["pods"] == ["vllm-decode-a"]
    assert "ReadTimeoutError" in removing["done"]["unstamped"] and removing["done"]["replicas"] == 2


async def test_a_drain_deletes_its_pod_even_where_the_pools_pods_cannot_be_listed(server: ApiServer,
                                                                                 api: client.ApiClient) -> None:
    dep = deployment(replicas=2)
    dep["spec"]["selector"] = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["vllm-decode"]}]}
    server.put(DEPLOYMENTS, dep)
    server.put(PODS, pod("vllm-decode-a"))
    o = order(ActionKind.DRAIN_ENGINE, Drain("vllm-decode-a"), busy={"vllm-decode-a": 0.0})
    first = await actuator(api).carry_out(o)
    await actuator(api).resume(o, first["wait"], Clock().t + 5)
    assert server.get(PODS, NS, "vllm-decode-a") is None


def mid_rollout(server: ApiServer, old: int, new: int, allowed: int) -> dict[str, Any]:
    """vllm-decode at 4 replicas (maxSurge 2, maxUnavailable 0) rolling out: `old` pods on revision 1, `new` on 2,
    each ReplicaSet annotated with the count the Deployment last allowed; the pods are named a1.., b1.."""
    dep = deployment(replicas=4)
    dep["spec"]["strategy"]["rollingUpdate"] = {"maxSurge": 2, "maxUnavailable": 0}
    dep = server.put(DEPLOYMENTS, dep)
    for revision, count, created, prefix in ((1, old, "2026-11-20T10:00:00Z", "a"),
                                             (2, new, "2026-12-05T09:00:00Z", "b")):
        rs = replica_set(dep, revision, f"vllm/vllm-openai:v0.1{revision}.0", created)
        rs["spec"]["replicas"] = count
        rs["metadata"]["annotations"]["deployment.kubernetes.io/max-replicas"] = str(allowed)
        server.put(REPLICASETS, rs)
        for i in range(1, count + 1):
            server.put(PODS, owned_pod(server, f"vllm-decode-{prefix}{i}", rs["metadata"]["name"]))
    return dep


def owned_pod(server: ApiServer, name: str, replica_set: str) -> dict[str, Any]:
    """A decode engine's pod that `replica_set` controls."""
    rs = server.get(REPLICASETS, NS, replica_set)
    assert rs is not None
    p = pod(name)
    p["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True,
                                         "name": replica_set, "uid": rs["metadata"]["uid"]}]
    return p


def routed(server: ApiServer, name: str, namespace: str = NS) -> bool:
    return "llm-d.ai/routed" in server.get(PODS, namespace, name)["metadata"]["labels"]  # type: ignore[index]


async def test_a_scale_down_mid_rollout_drains_each_replicasets_share(server: ApiServer,
                                                                      api: client.ApiClient) -> None:
    # 4 old and 2 new pods, 6 allowed; at 2 replicas 4 are: the controller takes one from each ReplicaSet
    # (round(4 * 4 / 6) = 3, round(2 * 4 / 6) = 1), whichever engines are idlest.
    mid_rollout(server, old=4, new=2, allowed=6)
    clock = Clock()
    act = actuator(api, clock)
    busy = {"vllm-decode-a1": 4.0, "vllm-decode-a2": 3.0, "vllm-decode-a3": 5.0, "vllm-decode-a4": 6.0,
            "vllm-decode-b1": 0.0, "vllm-decode-b2": 1.0}
    o = order(ActionKind.SCALE_POOL, ScaleTo(2), busy=busy)
    first = await act.carry_out(o)
    assert sorted(first["wait"]["pods"]) == ["vllm-decode-a2", "vllm-decode-b1"], "not the two idlest, b1 and b2"
    assert routed(server, "vllm-decode-b2")
    # The rollout goes on while they drain: the old ReplicaSet gives up a2 (the lowest deletion cost) and a new pod
    # is ready. At 3 and 3 the scale now takes a second old engine, which drains too before the count is written.
    remove(server, "vllm-decode-a2")
    for revision in (1, 2):
        rs = server.get(REPLICASETS, NS, f"vllm-decode-h{revision}")
        assert rs is not None
        rs["spec"]["replicas"] = 3
        server.put(REPLICASETS, rs)
    server.put(PODS, owned_pod(server, "vllm-decode-b3", "vllm-decode-h2"))
    idle = order(ActionKind.SCALE_POOL, ScaleTo(2), busy={**busy, "vllm-decode-a2": 0.0, "vllm-decode-b3": 2.0})
    clock.t += 20
    more = await act.resume(idle, first["wait"], clock.t)
    assert more["wait"]["pods"][2:] == ["vllm-decode-a1"] and more["wait"]["deadline"] == clock.t + 60
    assert not routed(server, "vllm-decode-a1")
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 4  # type: ignore[index]
    done = scaled(await act.resume(order(ActionKind.SCALE_POOL, ScaleTo(2),
                                         busy={**idle.busy, "vllm-decode-a1": 0.0}), more["wait"], clock.t + 5))
    assert done["replicas"] == 2 and done["idle"] is True and "spared" not in done, "a2 is gone, not spared"
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 2  # type: ignore[index]


async def test_a_drain_that_cannot_grow_puts_every_drained_engine_back(server: ApiServer,
                                                                     api: client.ApiClient) -> None:
    mid_rollout(server, old=4, new=2, allowed=6)
    act = actuator(api)
    busy = {"vllm-decode-a1": 4.0, "vllm-decode-a2": 0.0, "vllm-decode-a3": 5.0, "vllm-decode-a4": 6.0,
            "vllm-decode-b1": 0.0, "vllm-decode-b2": 1.0}
    o = order(ActionKind.SCALE_POOL, ScaleTo(2), busy=busy)
    wait = (await act.carry_out(o))["wait"]
    assert sorted(wait["pods"]) == ["vllm-decode-a2", "vllm-decode-b1"]
    rs = server.get(REPLICASETS, NS, "vllm-decode-h1")
    assert rs is not None
    rs["spec"]["replicas"] = 5  # more old engines than the split counted on: a second old one goes now
    server.put(REPLICASETS, rs)
    server.put(PODS, owned_pod(server, "vllm-decode-a5", "vllm-decode-h1"))
    server.fail("PATCH", "/pods/vllm-decode-a1", 403, "pods is forbidden")
    with pytest.raises(ActuationError, match="forbidden.*routed again"):
        await act.resume(o, wait, Clock().t + 5)
    assert all(routed(server, p) for p in ("vllm-decode-a2", "vllm-decode-b1")), "none left serving nothing"
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 4  # type: ignore[index]


async def test_a_workload_unreadable_at_the_scale_puts_the_drained_engines_back(server: ApiServer,
                                                                                api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    server.fail("GET", "/deployments/vllm-decode", 403, "deployments is forbidden")
    with pytest.raises(ActuationError, match="forbidden; not scaled; the drained engines are routed again"):
        await act.resume(o, wait, Clock().t + 5)
    assert routed(server, "vllm-decode-a")


async def test_a_drained_engine_that_crashed_is_not_routed_again(server: ApiServer, api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    unready(server, "vllm-decode-a")  # its ReplicaSet removes it first anyway
    done = scaled(await act.resume(o, wait, Clock().t + 5))
    assert done["replicas"] == 2 and "spared" not in done and not routed(server, "vllm-decode-a")


async def test_a_spared_engine_that_cannot_be_routed_again_stops_the_scale(server: ApiServer,
                                                                          api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    unready(server, "vllm-decode-c")
    server.fail("PATCH", "/pods/vllm-decode-a", 403, "pods is forbidden")
    with pytest.raises(ActuationError, match="forbidden; not scaled"):
        await act.resume(o, wait, Clock().t + 5)
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 3, (  # type: ignore[index]
        "at the drain's deletion cost it could be the one removed, and the one that should go stay out of routing")


async def test_a_drained_engine_the_scale_no_longer_removes_serves_again(server: ApiServer,
                                                                        api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    unready(server, "vllm-decode-c")  # the ReplicaSet removes it first
    done = await act.resume(o, wait, Clock().t + 5)
    assert done["replicas"] == 2 and done["spared"] == ["vllm-decode-a"]
    back = server.get(PODS, NS, "vllm-decode-a")
    assert back is not None and back["metadata"]["labels"]["llm-d.ai/routed"] == "true"
    assert "controller.kubernetes.io/pod-deletion-cost" not in back["metadata"].get("annotations", {}), (
        "before the scale: the ReplicaSet must not take it over a ready engine")


async def test_a_rollout_with_a_workload_ref_changes_the_deployment_it_follows(server: ApiServer,
                                                                              api: client.ApiClient) -> None:
    # An Argo Rollout that names a Deployment (scaled to 0) instead of carrying a template: its controller rolls out
    # whatever that Deployment's template becomes, so that is where new engine arguments go and what is digested.
    server.put(DEPLOYMENTS, deployment("vllm-canary-source", replicas=0))
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS},
                          "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "vllm-canary-source"}},
                                   "workloadRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                                   "name": "vllm-canary-source", "scaleDown": "onsuccess"}}})
    act = actuator(api)
    first = (await act.observe()).pools["canary"].template
    assert first is not None
    o = order(ActionKind.TUNE_SPECULATION, Speculation(step=-1), pool="canary", action_id=11)
    done = await act.carry_out(o)
    assert done["patched"] == "Deployment llm/vllm-canary-source" and done["num_speculative_tokens"] == 2
    assert (await act.observe()).pools["canary"].template not in (first, None)
    assert server.get(ROLLOUTS, NS, "vllm-canary")["metadata"]["annotations"][ACTION_ANNOTATION] == "11@0"  # type: ignore[index]
    # The Rollout's stamp lost (its leader died between the writes): a new leader reads the change as made, and
    # carrying it out again does not take the step twice.
    rollout = server.get(ROLLOUTS, NS, "vllm-canary")
    assert rollout is not None
    del rollout["metadata"]["annotations"][ACTION_ANNOTATION]
    server.put(ROLLOUTS, rollout)
    # A new leader finds it made, and what it reported then: the revert sets the speculation back to 3.
    found = await act.applied(o)
    assert isinstance(found, dict) and (found["from"], found["num_speculative_tokens"]) == (3, 2)
    again = await act.carry_out(o)
    assert "already_applied" in again and (again["from"], again["num_speculative_tokens"]) == (3, 2)
    args = server.get(DEPLOYMENTS, NS, "vllm-canary-source")["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[index]
    assert json.loads(args[args.index("--speculative-config") + 1])["num_speculative_tokens"] == 2
    assert server.get(ROLLOUTS, NS, "vllm-canary")["metadata"]["annotations"][ACTION_ANNOTATION] == "11@0"  # type: ignore[index]
    assert "template" not in server.get(ROLLOUTS, NS, "vllm-canary")["spec"]  # type: ignore[index]
    rollout["spec"]["workloadRef"] = {"apiVersion": "v1", "kind": "PodTemplate", "name": "vllm"}
    server.put(ROLLOUTS, rollout)
    with pytest.raises(ActuationError, match="refers to PodTemplate vllm: only a Deployment"):
        await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True, 1000, 3000, 8), pool="canary", action_id=12))
    seen = (await act.observe()).pools["canary"]
    assert seen.desired == 2 and seen.template is None, "its count is still known, its template not"


async def test_a_rollout_that_takes_its_selector_from_the_deployment_it_follows_scales_down(
        server: ApiServer, api: client.ApiClient) -> None:
    # Argo lets a Rollout with a workloadRef leave out its selector (its controller takes the Deployment's), and its
    # template empty: the engines are found, and changed, through the Deployment.
    server.put(DEPLOYMENTS, deployment("vllm-canary-source", replicas=0))
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS},
                          "spec": {"replicas": 2, "template": {"spec": {"containers": []}},
                                   "workloadRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                                   "name": "vllm-canary-source"}}})
    for name in ("vllm-canary-a", "vllm-canary-b"):
        server.put(PODS, pod(name, app="vllm-canary-source"))
    act = actuator(api)
    wait = (await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(1), pool="canary",
                                      busy={"vllm-canary-a": 0.0, "vllm-canary-b": 2.0})))["wait"]
    assert wait["pods"] == ["vllm-canary-a"]
    done = await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True, 1000, 3000, 8), pool="canary", action_id=13))
    assert done["patched"] == "Deployment llm/vllm-canary-source"


async def test_a_rollout_following_a_deployment_is_routed_again_with_its_label(server: ApiServer,
                                                                              api: client.ApiClient) -> None:
    source = deployment("vllm-canary-source", replicas=0)
    source["spec"]["template"]["metadata"]["labels"]["llm-d.ai/routed"] = "decode"  # the router selects on the value
    server.put(DEPLOYMENTS, source)
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS},
                          "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "vllm-canary-source"}},
                                   "workloadRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                                   "name": "vllm-canary-source"}}})
    for name in ("vllm-canary-a", "vllm-canary-b"):
        server.put(PODS, pod(name, app="vllm-canary-source"))
    act = actuator(api)
    o = order(ActionKind.SCALE_POOL, ScaleTo(1), pool="canary", busy={"vllm-canary-a": 0.0, "vllm-canary-b": 2.0})
    wait = (await act.carry_out(o))["wait"]
    server.fail("PATCH", "/scale", 422, "admission webhook denied the request")
    with pytest.raises(ActuationError, match="routed again"):
        await act.resume(o, wait, Clock().t + 5)
    back = server.get(PODS, NS, "vllm-canary-a")
    assert back is not None and back["metadata"]["labels"]["llm-d.ai/routed"] == "decode"
    # The Rollout's own stamp fails after the Deployment took the change: the change is made, and says so.
    server.fail("PATCH", "/rollouts/vllm-canary", 503, "etcd timeout", times=2)
    done = await act.carry_out(order(ActionKind.ENABLE_EPLB, Eplb(True, 1000, 3000, 8), pool="canary", action_id=13))
    assert done["patched"] == "Deployment llm/vllm-canary-source" and done["eplb"] is True


async def test_a_drained_engine_that_crashed_but_stays_is_routed_again(server: ApiServer,
                                                                       api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    unready(server, "vllm-decode-a")  # restarting, on its node
    replaced = pod("vllm-decode-c2")  # c was evicted; its replacement waits for a node, and goes before a
    replaced["spec"].pop("nodeName")
    replaced["status"] = {"phase": "Pending"}
    server.put(PODS, replaced)
    c = server.get(PODS, NS, "vllm-decode-c")
    assert c is not None
    c["status"] = {"phase": "Failed", "reason": "Evicted"}
    server.put(PODS, c)
    done = await act.resume(o, wait, Clock().t + 5)
    assert done["replicas"] == 2 and done["spared"] == ["vllm-decode-a"] and routed(server, "vllm-decode-a")


async def test_a_removal_that_cannot_be_verified_routes_the_drained_engines_again(server: ApiServer,
                                                                                 api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    removing = await act.resume(o, wait, Clock().t + 5)
    server.fail("GET", "/deployments/vllm-decode", 403, "deployments is forbidden", times=4)
    assert "wait" in await act.resume(o, removing["wait"], Clock().t + 30), "read again next tick"
    done = await act.resume(o, removing["wait"], Clock().t + 66)
    assert "forbidden" in done["unverified"] and routed(server, "vllm-decode-a")


async def test_a_take_over_after_the_count_does_not_wait_on_a_spared_engine(server: ApiServer,
                                                                           api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    unready(server, "vllm-decode-c")
    await act.resume(o, wait, Clock().t + 5)  # a spared, routed again; the count written; the leader dies
    again = await actuator(api).resume(o, wait, Clock().t + 20)  # the new leader resumes the drain's wait
    remove(server, "vllm-decode-c")
    done = await actuator(api).resume(o, again["wait"], Clock().t + 35)
    assert done["removed"] == [] and routed(server, "vllm-decode-a"), "a serves; c, never drained, went"


def mid_canary(server: ApiServer) -> None:
    """vllm-canary, an Argo Rollout of 10 at its 20 % step: 8 stable engines (s1..s8) and 2 canary ones (c1, c2),
    each set owned by the Rollout and told apart by its pod-template hash."""
    labels = {"app": "vllm-canary"}
    template = {"metadata": {"labels": {**labels, "llm-d.ai/routed": "true"}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": list(ARGS)}]}}
    rollout = server.put(ROLLOUTS, {
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "metadata": {"name": "vllm-canary", "namespace": NS},
        "spec": {"replicas": 10, "selector": {"matchLabels": labels}, "template": template,
                 "strategy": {"canary": {"maxSurge": "25%", "maxUnavailable": 0,
                                         "steps": [{"setWeight": 20}, {"pause": {}}]}}},
        "status": {"replicas": 10, "readyReplicas": 10, "currentPodHash": "c7d9", "stableRS": "5b8f",
                   "currentStepIndex": 1}})
    for hash_, count, prefix in (("5b8f", 8, "s"), ("c7d9", 2, "c")):
        name = f"vllm-canary-{hash_}"
        own = {**labels, "rollouts-pod-template-hash": hash_}
        server.put(REPLICASETS, {
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": name, "namespace": NS, "labels": own,
                         "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                                              "name": "vllm-canary", "uid": rollout["metadata"]["uid"],
                                              "controller": True}]},
            "spec": {"replicas": count, "selector": {"matchLabels": own},
                     "template": {**template, "metadata": {"labels": {**own, "llm-d.ai/routed": "true"}}}}})
        for i in range(1, count + 1):
            p = owned_pod(server, f"vllm-canary-{prefix}{i}", name)
            p["metadata"]["labels"] = {**own, "llm-d.ai/routed": "true"}
            server.put(PODS, p)


async def test_an_argo_rollouts_revision_is_dated_by_its_newest_replicaset(server: ApiServer,
                                                                           api: client.ApiClient) -> None:
    """What the canary policy judges a rollout from: without it an Argo Rollout's canary was never judged."""
    mid_canary(server)
    server.put(DEPLOYMENTS, deployment("epp", replicas=1))
    # Listed oldest first, and numbered by Argo's own annotation (no Deployment's).
    for name, revision, created in (("vllm-canary-5b8f", "1", "2026-12-01T09:00:00Z"),
                                    ("vllm-canary-c7d9", "2", "2026-12-01T09:30:00Z")):
        rs = server.get(REPLICASETS, NS, name)
        assert rs is not None
        rs["metadata"]["annotations"] = {"rollout.argoproj.io/revision": revision}
        rs["metadata"]["creationTimestamp"] = created
        server.put(REPLICASETS, rs)
    view = await actuator(api).observe()
    assert view.changed_at["canary"] == 1_796_117_400.0  # 09:30, the canary's ReplicaSet


@pytest.mark.parametrize(("replicas", "stable", "drained"), [
    # At 5, Argo keeps 20 %: 1 canary and 4 stable engines. The two idlest are both canaries, but only one goes.
    (5, "5b8f", ["vllm-canary-c1", "vllm-canary-s1", "vllm-canary-s2", "vllm-canary-s3", "vllm-canary-s4"]),
    # At 8 the split nearest 20 % is 2 and 7 (9 in all, within maxSurge): one stable engine, and no canary.
    (8, "5b8f", ["vllm-canary-s1"]),
    # Promoted: the new set grows to 7 and the old one goes with the update, drained or not: nothing to drain.
    (7, "c7d9", []),
])
async def test_a_scale_down_mid_canary_drains_by_the_canarys_weight(server: ApiServer, api: client.ApiClient,
                                                                   replicas: int, stable: str,
                                                                   drained: list[str]) -> None:
    mid_canary(server)
    rollout = server.get(ROLLOUTS, NS, "vllm-canary")
    assert rollout is not None
    rollout["status"]["stableRS"] = stable
    server.put(ROLLOUTS, rollout)
    busy = {**{f"vllm-canary-s{i}": float(i) for i in range(1, 9)}, "vllm-canary-c1": 0.0, "vllm-canary-c2": 0.5}
    first = await actuator(api).carry_out(order(ActionKind.SCALE_POOL, ScaleTo(replicas), pool="canary", busy=busy))
    assert sorted(first["wait"]["pods"]) == drained
    assert all(routed(server, p) != (p in drained) for p in busy)


async def test_the_emulator_holds_custom_resources_to_their_crds(server: ApiServer) -> None:
    # The check this module's bodies pass is not vacuous: what the API server would refuse, or prune, is caught.
    group = lws()
    group["spec"]["rolloutStrategy"] = {"rollingUpdateConfiguration": {"maxUnavailable": 1}}  # `type` defaulted
    server.put(LWS, group)
    del group["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    server.put(LWS, group)
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "metadata": {"name": "r"},
                          "spec": {"replicas": "two", "strategy": {"canary": {"setWeight": 20}}}})
    found, server.invalid[:] = list(server.invalid), []
    assert len(found) == 3 and "'workerTemplate' is a required property" in found[0]
    assert "'two' is not of type 'integer'" in found[1] and ".spec.strategy.canary.setWeight: unknown field" in found[2]


def decode_with_replica_set(server: ApiServer, names: Sequence[str]) -> None:
    """The decode Deployment with one ReplicaSet that controls `names`."""
    dep = server.put(DEPLOYMENTS, deployment(replicas=len(names)))
    server.put(REPLICASETS, replica_set(dep, 1, "vllm/vllm-openai:v0.11.0", "2026-12-01T09:30:00Z"))
    for name in names:
        server.put(PODS, owned_pod(server, name, "vllm-decode-h1"))


async def test_pods_another_controller_owns_are_never_drained(server: ApiServer, api: client.ApiClient) -> None:
    decode_with_replica_set(server, ["vllm-decode-a", "vllm-decode-b"])
    # Another workload's pod with the same labels (the Deployment an Argo Rollout replaced, kept running): not
    # answering this pool's scrapes, it would look idle and be drained first, while the decode ReplicaSet removes
    # a busy engine of its own that nobody drained.
    foreign = pod("vllm-decode-old-x")
    foreign["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True,
                                               "name": "vllm-decode-old-h7", "uid": "5b1c0e0a-old"}]
    server.put(PODS, foreign)
    o = order(ActionKind.SCALE_POOL, ScaleTo(1), busy={"vllm-decode-a": 2.0, "vllm-decode-b": 1.0},
              answering={"vllm-decode-a", "vllm-decode-b"})
    first = await actuator(api).carry_out(o)
    assert first["wait"]["pods"] == ["vllm-decode-b"]
    assert routed(server, "vllm-decode-old-x") and routed(server, "vllm-decode-a")


async def test_a_selectors_match_expressions_narrow_its_pods(server: ApiServer, api: client.ApiClient) -> None:
    dep = deployment(replicas=2)
    dep["spec"]["selector"]["matchExpressions"] = [{"key": "tier", "operator": "In", "values": ["gpu"]}]
    dep["spec"]["template"]["metadata"]["labels"]["tier"] = "gpu"
    server.put(DEPLOYMENTS, dep)
    for name, tier in (("vllm-decode-a", "gpu"), ("vllm-decode-b", "gpu"), ("vllm-decode-cpu", "cpu")):
        p = pod(name)
        p["metadata"]["labels"]["tier"] = tier
        server.put(PODS, p)
    o = order(ActionKind.SCALE_POOL, ScaleTo(1), busy={"vllm-decode-a": 2.0, "vllm-decode-b": 1.0},
              answering={"vllm-decode-a", "vllm-decode-b"})
    assert (await actuator(api).carry_out(o))["wait"]["pods"] == ["vllm-decode-b"]
    assert routed(server, "vllm-decode-cpu")


async def test_a_cordon_moves_every_pools_engines_on_the_node_and_a_gangs_whole_group(
        server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    server.put(LWS, lws(replicas=1, size=2))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    server.put(PODS, pod("vllm-decode-a", node="gpu-node-1"))
    server.put(PODS, pod("vllm-decode-b", node="gpu-node-2"))
    leader, worker = group_pod(0, 0), group_pod(0, 1)  # one group: its leader on the node, its worker elsewhere
    worker["spec"]["nodeName"] = "gpu-node-2"
    server.put(PODS, leader)
    server.put(PODS, worker)
    server.put(PODS, pod("batch-job", app="batch", node="gpu-node-1"))  # no pool's: not the control plane's
    clock = Clock()
    act = actuator(api, clock)
    # The faulty GPU may serve any pool's engine: gpu_health asks through one pool, the loop's view is of them all.
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"),
              busy={"vllm-decode-a": 0.0, "vllm-prefill-0": 2.0, "vllm-prefill-0-1": 1.0},
              answering={"vllm-decode-a", "vllm-decode-b", "vllm-prefill-0", "vllm-prefill-0-1"})
    server.fail("GET", "rollouts/vllm-canary", 403, "forbidden")  # a pool whose engines cannot be found now
    first = await act.carry_out(o)
    assert first["wait"]["pods"] == ["vllm-decode-a", "vllm-prefill-0", "vllm-prefill-0-1"]
    assert not any(routed(server, p) for p in first["wait"]["pods"])
    held = await act.resume(o, first["wait"], clock.t + 1)  # the idle one goes; the busy group finishes first
    assert held["wait"]["pods"] == ["vllm-prefill-0", "vllm-prefill-0-1"] and server.get(PODS, NS, "vllm-decode-a") is None
    assert held["wait"]["groups"] == {"vllm-prefill-0": "vllm-prefill-0", "vllm-prefill-0-1": "vllm-prefill-0"}
    done = await act.resume(o, held["wait"], clock.t + 61)
    # The group goes as one: its leader is evicted, and the LeaderWorkerSet recreates the whole group elsewhere.
    assert done["cordoned"] == "gpu-node-1" and server.get(PODS, NS, "vllm-prefill-0") is None
    assert server.get(PODS, NS, "vllm-prefill-0-1") is not None, "not evicted on its own: the group is recreated"
    assert "forbidden" in done["unmoved"]["canary"], "said, not hidden behind a success"
    assert routed(server, "vllm-decode-b") and routed(server, "batch-job")


async def test_a_gang_goes_once_its_leader_is_idle_where_its_workers_report_nothing(
        server: ApiServer, api: client.ApiClient) -> None:
    server.put(LWS, lws(replicas=1, size=2))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    server.put(PODS, group_pod(0, 0))
    server.put(PODS, group_pod(0, 1))
    server.put(DEPLOYMENTS, deployment())
    clock = Clock()
    act = actuator(api, clock)
    # Read from Prometheus: which engines answer is not known, and a Ray worker exports no vLLM counts.
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), pool="prefill", busy={"vllm-prefill-0": 0.0})
    first = await act.carry_out(o)
    # A member that reports requests but whose count is late (an overloaded data-parallel rank) is waited for.
    late = replace(o, counted=frozenset({"vllm-prefill-0", "vllm-prefill-0-1"}))
    assert "wait" in await act.resume(late, first["wait"], clock.t + 1)
    done = await act.resume(o, first["wait"], clock.t + 1)
    assert done["waited_for_idle"] is True and server.get(PODS, NS, "vllm-prefill-0") is None


async def test_a_cordon_evicts_no_new_pod_under_a_cordoned_ones_name(server: ApiServer,
                                                                     api: client.ApiClient) -> None:
    statefulset(server)  # vllm-kv-0 to -2
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    for name in ("vllm-kv-0", "vllm-kv-1"):
        server.put(PODS, pod(name, app="vllm-kv", node="gpu-node-1"))
    clock = Clock()
    act = actuator(api, clock)
    act.workloads = {"kv": Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")}
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), pool="kv",
              busy={"vllm-kv-0": 2.0, "vllm-kv-1": 0.0, "vllm-kv-2": 0.0}, answering={"vllm-kv-0", "vllm-kv-1", "vllm-kv-2"})
    first = await act.carry_out(o)
    # vllm-kv-0 failed meanwhile and its StatefulSet made it again under the same name, on another node.
    server.put(PODS, pod("vllm-kv-0", app="vllm-kv", node="gpu-node-2"))
    done = await act.resume(o, first["wait"], clock.t + 1)
    assert done["cordoned"] == "gpu-node-1" and server.get(PODS, NS, "vllm-kv-0") is not None
    assert server.get(PODS, NS, "vllm-kv-1") is None and server.get(PODS, NS, "vllm-kv-2") is None


def spread(server: ApiServer) -> None:
    """The decode pool's engines a and b on gpu-node-1, c on gpu-node-2."""
    server.put(DEPLOYMENTS, deployment())
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    for name in ("vllm-decode-a", "vllm-decode-b"):
        server.put(PODS, pod(name, node="gpu-node-1"))
    server.put(PODS, pod("vllm-decode-c", node="gpu-node-2"))


def packed(server: ApiServer, api: client.ApiClient) -> tuple[KubernetesActuator, Clock]:
    """The decode pool's three engines all on gpu-node-1, and an actuator on a clock of its own."""
    server.put(DEPLOYMENTS, deployment(replicas=3))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    for name in ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c"):
        server.put(PODS, pod(name, node="gpu-node-1"))
    clock = Clock()
    return actuator(api, clock), clock


async def test_a_pool_that_serves_only_from_the_cordoned_node_keeps_one_engine_routed_until_another_serves(
        server: ApiServer, api: client.ApiClient) -> None:
    """Eight engines on one node, one GPU faulty: taken out all at once, the pool would serve nothing until their
    replacements had started elsewhere."""
    act, clock = packed(server, api)
    # The faulty GPU's engine answers no scrape: it is not the one kept.
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy={"vllm-decode-b": 2.0, "vllm-decode-c": 4.0},
              answering={"vllm-decode-b", "vllm-decode-c"})
    first = await act.carry_out(o)
    assert first["wait"]["pods"] == ["vllm-decode-a", "vllm-decode-c"] and first["wait"]["kept"] == {
        "decode": ["vllm-decode-b"]}
    assert routed(server, "vllm-decode-b") and not routed(server, "vllm-decode-c")
    held = await act.resume(o, first["wait"], clock.t + 61)  # the grace ended: the two go; b serves on
    assert server.get(PODS, NS, "vllm-decode-a") is None and server.get(PODS, NS, "vllm-decode-c") is None
    assert held["wait"]["pods"] == [] and routed(server, "vllm-decode-b")
    replacement = pod("vllm-decode-d", node="gpu-node-2")
    replacement["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    server.put(PODS, replacement)
    held = await act.resume(o, held["wait"], clock.t + 90)
    assert routed(server, "vllm-decode-b"), "a replacement starting serves nothing yet"
    replacement["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    server.put(PODS, replacement)
    draining = await act.resume(o, held["wait"], clock.t + 120)  # one serves elsewhere: b goes, with a grace
    assert draining["wait"]["pods"] == ["vllm-decode-b"] and "kept" not in draining["wait"]
    assert not routed(server, "vllm-decode-b") and server.get(PODS, NS, "vllm-decode-b") is not None
    done = await act.resume(replace(o, busy={"vllm-decode-b": 0.0}), draining["wait"], clock.t + 125)
    assert done["evicted"] == ["vllm-decode-a", "vllm-decode-c", "vllm-decode-b"]
    assert done["kept_back"] == {"vllm-decode-b": "replaced"} and server.get(PODS, NS, "vllm-decode-b") is None
    # Where no replacement serves within the hold (the cluster has no room), the kept one goes all the same.
    for name in ("vllm-decode-x", "vllm-decode-y"):
        server.put(PODS, pod(name, node="gpu-node-3"))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-3"}})
    server.get(PODS, NS, "vllm-decode-d")["metadata"]["labels"].pop("llm-d.ai/routed")  # type: ignore[index]
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-3"), action_id=9)
    first = await act.carry_out(o)
    assert first["wait"]["kept"] == {"decode": ["vllm-decode-x"]}
    still = await act.resume(o, first["wait"], clock.t + 899)
    assert still["wait"]["kept"] and routed(server, "vllm-decode-x")
    late = await act.resume(o, still["wait"], clock.t + 900)
    assert "kept" not in late["wait"] and not routed(server, "vllm-decode-x")
    assert late["wait"]["kept_back"] == {"vllm-decode-x": "hold ended"}
    assert not server.invalid


async def test_a_kept_group_spanning_the_node_stays_until_another_serves_and_then_goes_whole(
        server: ApiServer, api: client.ApiClient) -> None:
    """Group 0's leader and group 1's worker on the cordoned node, the others elsewhere: group 1 is kept. Its own
    leader off the node read as another engine serving, so it was released the next tick, and only its worker there
    was evicted, its leader routed and reported gone: the pool served nothing."""
    server.put(DEPLOYMENTS, deployment())
    server.put(LWS, lws(replicas=2, size=2))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    leader0, worker0, leader1, worker1 = group_pod(0, 0), group_pod(0, 1), group_pod(1, 0), group_pod(1, 1)
    worker0["spec"]["nodeName"] = leader1["spec"]["nodeName"] = "gpu-node-2"
    for p in (leader0, worker0, leader1, worker1):
        server.put(PODS, p)
    clock = Clock()
    act = actuator(api, clock)
    every = ("vllm-prefill-0", "vllm-prefill-0-1", "vllm-prefill-1", "vllm-prefill-1-1")
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), pool="prefill", answering=set(every),
              busy={"vllm-prefill-0": 3.0, "vllm-prefill-0-1": 3.0, "vllm-prefill-1": 1.0, "vllm-prefill-1-1": 1.0})
    first = await act.carry_out(o)
    assert first["wait"]["kept"] == {"prefill": ["vllm-prefill-1", "vllm-prefill-1-1"]}
    idle = replace(o, busy=dict.fromkeys(every, 0.0))
    held = await act.resume(idle, first["wait"], clock.t + 15)  # group 0 goes; nothing else serves yet
    assert held["wait"]["kept"] and routed(server, "vllm-prefill-1") and routed(server, "vllm-prefill-1-1")
    assert server.get(PODS, NS, "vllm-prefill-1-1") is not None
    # Group 0 made again on another node, serving: group 1 goes, all of it, through its leader.
    for p in (group_pod(0, 0), group_pod(0, 1)):
        p["spec"]["nodeName"] = "gpu-node-3"
        server.put(PODS, p)
    out = await act.resume(idle, held["wait"], clock.t + 30)
    assert server.get(PODS, NS, "vllm-prefill-1") is None  # its leader evicted for the group
    assert not routed(server, "vllm-prefill-1-1")  # out of routing until its group is made again
    assert out["kept_back"] == {"vllm-prefill-1": "replaced", "vllm-prefill-1-1": "replaced"}, out


async def test_a_pool_of_ray_gangs_keeps_a_group_whose_leader_answers(server: ApiServer, api: client.ApiClient) -> None:
    """A Ray gang's workers run no vLLM server and answer no scrape: required to, no group was ever kept, and a cordon
    of the node their leaders share took the whole pool out of routing."""
    server.put(DEPLOYMENTS, deployment())
    server.put(LWS, lws(replicas=2, size=2))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    for g in range(2):  # both leaders on gpu-node-1, both workers elsewhere
        worker = group_pod(g, 1)
        worker["spec"]["nodeName"] = "gpu-node-2"
        server.put(PODS, group_pod(g, 0))
        server.put(PODS, worker)
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), pool="prefill",
              busy={"vllm-prefill-0": 2.0, "vllm-prefill-1": 1.0}, answering={"vllm-prefill-0", "vllm-prefill-1"})
    first = await actuator(api, Clock()).carry_out(o)
    assert first["wait"]["kept"] == {"prefill": ["vllm-prefill-1", "vllm-prefill-1-1"]}
    assert routed(server, "vllm-prefill-1") and not routed(server, "vllm-prefill-0")


async def test_kept_engine_that_vanished_does_not_fail_the_cordon(server: ApiServer, api: client.ApiClient) -> None:
    """The node goes NotReady; the node controller evicts its pods after 5 min (< cordon_hold 15 min); the kept
    Deployment pod is gone. At the hold's end the cordon should finish, not fail."""
    act, clock = packed(server, api)
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy={"vllm-decode-b": 0.0, "vllm-decode-c": 4.0})
    first = await act.carry_out(o)
    assert first["wait"]["kept"] == {"decode": ["vllm-decode-a"]}
    held = await act.resume(o, first["wait"], clock.t + 61)  # b and c evicted, a kept
    assert held["wait"]["kept"]
    server.objects[PODS, NS, "vllm-decode-a"].delete()  # the kept pod vanishes (the node lifecycle evicts it)
    out = await act.resume(o, held["wait"], clock.t + 901)  # the hold ends: nothing left to move
    assert out["cordoned"] == "gpu-node-1" and out["kept_back"] == {"vllm-decode-a": "gone"}


async def test_kept_statefulset_pod_recreated_elsewhere_is_not_evicted(server: ApiServer,
                                                                       api: client.ApiClient) -> None:
    """A kept StatefulSet pod is deleted and recreated under its name on another node (the cordoned one is
    unschedulable). The release takes the new, healthy engine out of routing and evicts it."""
    statefulset(server)  # vllm-kv-0..2 on gpu-node-1
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    clock = Clock()
    act = actuator(api, clock)
    act.workloads = {"kv": Workload(kind="StatefulSet", namespace=NS, name="vllm-kv")}
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), pool="kv",
              busy={"vllm-kv-0": 0.0, "vllm-kv-1": 3.0, "vllm-kv-2": 3.0})
    first = await act.carry_out(o)
    assert first["wait"]["kept"] == {"kv": ["vllm-kv-0"]}
    held = await act.resume(o, first["wait"], clock.t + 61)  # kv-1 and kv-2 evicted; kv-0 kept
    assert held["wait"]["kept"]
    # kv-0 dies and its StatefulSet recreates it on gpu-node-2, where it serves (it is the only one serving).
    server.objects[PODS, NS, "vllm-kv-0"].delete()
    server.put(PODS, pod("vllm-kv-0", app="vllm-kv", node="gpu-node-2"))
    out = await act.resume(o, held["wait"], clock.t + 120)
    assert server.get(PODS, NS, "vllm-kv-0") is not None, f"the new vllm-kv-0 on gpu-node-2 was evicted: {out}"
    assert routed(server, "vllm-kv-0"), "the new vllm-kv-0 on gpu-node-2 was taken out of routing by the cordon"


async def test_a_failed_release_of_one_pool_does_not_strand_anothers_kept_engine(server: ApiServer,
                                                                                 api: client.ApiClient) -> None:
    """Two pools packed on the node, each keeps one engine. At the hold's end the first pool's kept engine is
    taken out of routing, the second's unroute fails: the action fails and routes back the wait's pods and the
    second pool's, but not the first pool's kept engine, which stays out of routing, not evicted, serving nothing."""
    server.put(DEPLOYMENTS, deployment(replicas=2))
    server.put(DEPLOYMENTS, deployment("vllm-other", replicas=2))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    for name in ("vllm-decode-a", "vllm-decode-b"):
        server.put(PODS, pod(name, node="gpu-node-1"))
    for name in ("vllm-other-a", "vllm-other-b"):
        server.put(PODS, pod(name, app="vllm-other", node="gpu-node-1"))
    clock = Clock()
    act = actuator(api, clock)
    act.workloads = {"decode": Workload(kind="Deployment", namespace=NS, name="vllm-decode"),
                     "other": Workload(kind="Deployment", namespace=NS, name="vllm-other")}
    busy = {"vllm-decode-a": 0.0, "vllm-decode-b": 1.0, "vllm-other-a": 0.0, "vllm-other-b": 1.0}
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy=busy)
    first = await act.carry_out(o)
    assert first["wait"]["kept"] == {"decode": ["vllm-decode-a"], "other": ["vllm-other-a"]}
    held = await act.resume(o, first["wait"], clock.t + 61)
    assert held["wait"]["kept"] and held["wait"]["pods"] == []
    server.fail("PATCH", "/pods/vllm-other-a", 403, "forbidden by a webhook")
    with pytest.raises(ActuationError, match="forbidden"):  # the action fails: its wait is dropped, nothing releases
        await act.resume(o, held["wait"], clock.t + 901)
    assert server.get(PODS, NS, "vllm-decode-a") is not None
    assert routed(server, "vllm-decode-a"), "decode's kept engine is left out of routing, never evicted"


async def test_a_cordon_redone_after_a_take_over_keeps_a_routed_engine(server: ApiServer,
                                                                         api: client.ApiClient) -> None:
    """The leader took a and c out of routing (b kept) and stopped before its wait was noted; the new leader
    redoes the cordon (`applied` is always False for one). a and c, drained, are now the idlest: one of them is
    'kept' (it is out of routing already) and b, the one engine that served, is taken out: the pool serves nothing."""
    act, clock = packed(server, api)
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"),
              busy={"vllm-decode-a": 3.0, "vllm-decode-b": 1.0, "vllm-decode-c": 4.0})
    first = await act.carry_out(o)
    assert first["wait"]["kept"] == {"decode": ["vllm-decode-b"]}
    # take-over: a fresh order, the drained engines idle now, b serving
    again = await actuator(api, clock).carry_out(
        order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"),
              busy={"vllm-decode-a": 0.0, "vllm-decode-b": 2.0, "vllm-decode-c": 0.0}))
    assert again["wait"]["kept"] == {"decode": ["vllm-decode-b"]} and routed(server, "vllm-decode-b")


async def test_a_cordon_whose_eviction_fails_routes_its_engines_again(server: ApiServer,
                                                                     api: client.ApiClient) -> None:
    spread(server)  # the pool serves elsewhere too: both move at once
    clock = Clock()
    act = actuator(api, clock)
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy={"vllm-decode-a": 0.0, "vllm-decode-b": 3.0},
              answering={"vllm-decode-a", "vllm-decode-b"})
    first = await act.carry_out(o)
    server.fail("POST", "vllm-decode-a/eviction", 500, "etcdserver: request timed out", times=2)
    with pytest.raises(ActuationError, match="evicting pod llm/vllm-decode-a.*routed again"):
        await act.resume(o, first["wait"], clock.t + 1)
    assert routed(server, "vllm-decode-a") and routed(server, "vllm-decode-b"), "none left running, serving nothing"
    server.pdb_blocks["vllm-decode-a"] = 99  # a budget that never allows it within the grace
    again = await act.carry_out(replace(o, action_id=8))
    # Past the grace everything goes at once; the budget gets one more grace, as a drain's does.
    held = await act.resume(replace(o, action_id=8), again["wait"], clock.t + 61)
    assert held["wait"]["pods"] == ["vllm-decode-a"] and server.get(PODS, NS, "vllm-decode-b") is None
    with pytest.raises(ActuationError, match="could not be evicted.*routed again"):
        await act.resume(replace(o, action_id=8), held["wait"], clock.t + 121)
    assert routed(server, "vllm-decode-a")


async def test_a_drained_engine_is_evicted_within_its_budget(server: ApiServer, api: client.ApiClient) -> None:
    act, clock, o, wait = await draining(server, api, busy=0.0)
    server.pdb_blocks["vllm-decode-a"] = 1  # another engine of the pool is down: the budget allows none now
    held = await act.resume(o, wait, clock.t + 1)
    assert held["wait"]["pods"] == ["vllm-decode-a"] and server.get(PODS, NS, "vllm-decode-a") is not None
    done = await act.resume(o, held["wait"], clock.t + 20)
    assert done["drained"] == ["vllm-decode-a"] and server.get(PODS, NS, "vllm-decode-a") is None
    # A budget that never allows it: routed again one grace after the drain's, rather than left serving nothing.
    server.put(PODS, pod("vllm-decode-b"))
    server.pdb_blocks["vllm-decode-b"] = 99
    ob = order(ActionKind.DRAIN_ENGINE, Drain("vllm-decode-b"), busy={"vllm-decode-b": 0.0}, action_id=9)
    wait = (await act.carry_out(ob))["wait"]
    assert "wait" in await act.resume(ob, wait, clock.t + 100)
    with pytest.raises(ActuationError, match="drained but not evicted.*routed again"):
        await act.resume(ob, wait, clock.t + 121)
    assert routed(server, "vllm-decode-b")


async def test_a_scale_made_while_the_count_is_written_is_not_overwritten(server: ApiServer,
                                                                         api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    listing = act._victims_now

    async def operator_scales_meanwhile(*args: Any) -> Any:
        server.put(DEPLOYMENTS, deployment(replicas=5))  # between the drain's read and its write
        return await listing(*args)

    act._victims_now = operator_scales_meanwhile  # type: ignore[method-assign]
    with pytest.raises(ActuationError, match="went from 3 to 5 engines"):
        await act.resume(o, wait, Clock().t + 5)
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 5  # type: ignore[index]
    assert routed(server, "vllm-decode-a")


async def test_a_conflicting_scale_is_written_again_on_a_fresh_read(server: ApiServer, api: client.ApiClient) -> None:
    act, o, wait = await scaling_down(server, api)
    server.fail("PATCH", "deployments/vllm-decode/scale", 409, "the object has been modified", times=1)
    removing = await act.resume(o, wait, Clock().t + 5)  # its controller bumped the status meanwhile, say
    assert removing["wait"]["then"] == "verify"
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 2  # type: ignore[index]
    server.fail("PATCH", "deployments/vllm-decode/scale", 409, "the object has been modified", times=1)
    up = await act.carry_out(order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=11))
    assert up["replicas"] == 4


def hpa(target: str, kind: str = "Deployment", api_version: str = "apps/v1", name: str | None = None
        ) -> dict[str, Any]:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name or f"keda-hpa-{target}", "namespace": NS},
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target},
                     "minReplicas": 1, "maxReplicas": 8,
                     "metrics": [{"type": "External", "external": {
                         "metric": {"name": "s0-prometheus"},
                         "target": {"type": "AverageValue", "averageValue": "5"}}}]}}


async def test_a_pool_an_hpa_scales_is_marked_so_and_an_unlistable_namespace_marks_none(
        server: ApiServer, api: client.ApiClient, caplog: pytest.LogCaptureFixture) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    server.put(HPAS, hpa("vllm-decode"))  # KEDA's, from a ScaledObject on the decode pool's queue
    server.put(HPAS, hpa("vllm-decode", api_version="example.com/v1", name="other"))  # another group's Deployment
    view = await actuator(api).observe()
    assert view.pools["decode"].scaled_by == "HorizontalPodAutoscaler llm/keda-hpa-vllm-decode"
    act = actuator(api)
    await act.observe()
    server.fail("GET", "/horizontalpodautoscalers", 503, "etcd timeout", times=2)
    kept = await act.observe()  # one failed list keeps the last one read
    assert kept.pools["decode"].scaled_by == "HorizontalPodAutoscaler llm/keda-hpa-vllm-decode"
    server.fail("GET", "/horizontalpodautoscalers", 403, "forbidden: an older Role", times=4)
    fresh = actuator(api)  # a Role without the grant: warned of once, none counted
    assert (await fresh.observe()).pools["decode"].scaled_by is None
    await fresh.observe()
    assert caplog.text.count("pools there are scaled as if by the last list (none yet)") == 1


async def test_a_failed_cordon_routes_each_pools_engines_back_as_that_pool_routes_them(
        server: ApiServer, api: client.ApiClient) -> None:
    dep = deployment()
    dep["spec"]["template"]["metadata"]["labels"]["llm-d.ai/routed"] = "decode"  # this router pool's value
    server.put(DEPLOYMENTS, dep)
    server.put(LWS, lws(replicas=1, size=1))  # its template names no value: routed as `true`
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    engine = pod("vllm-decode-a")
    engine["metadata"]["labels"]["llm-d.ai/routed"] = "decode"
    server.put(PODS, engine)
    server.put(PODS, group_pod(0, 0))
    act = actuator(api)
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy={"vllm-decode-a": 0.0, "vllm-prefill-0": 0.0},
              answering={"vllm-decode-a", "vllm-prefill-0"})
    first = await act.carry_out(o)
    assert first["wait"]["pools"] == {"vllm-decode-a": "decode", "vllm-prefill-0": "prefill"}
    server.fail("POST", "/eviction", 500, "etcdserver: leader changed", times=2)
    with pytest.raises(ActuationError, match="routed again"):
        await act.resume(o, first["wait"], Clock().t + 1)
    labels = {p: server.get(PODS, NS, p)["metadata"]["labels"]["llm-d.ai/routed"]  # type: ignore[index]
              for p in ("vllm-decode-a", "vllm-prefill-0")}
    assert labels == {"vllm-decode-a": "decode", "vllm-prefill-0": "true"}


async def test_a_cordon_moves_the_engines_of_pools_in_other_namespaces_and_routes_them_back_there(
        server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    batch = deployment("vllm-batch")
    batch["metadata"]["namespace"] = "batch"
    server.put(DEPLOYMENTS, batch)
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    server.put(PODS, pod("vllm-decode-a"))
    other = pod("vllm-batch-a", app="vllm-batch")
    other["metadata"]["namespace"] = "batch"
    server.put(PODS, other)
    twin = pod("vllm-decode-a", app="vllm-batch")  # the same name in the other namespace: left there, and said
    twin["metadata"]["namespace"] = "batch"
    workloads = {"decode": Workload(kind="Deployment", namespace=NS, name="vllm-decode"),
                 "batch": Workload(kind="Deployment", namespace="batch", name="vllm-batch")}
    act = KubernetesActuator(api, Kubernetes(drain_grace=60.0, timeout=2.0), workloads, clock=Clock(),
                             instance="fleet-controlplane-0")
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy={"vllm-decode-a": 0.0, "vllm-batch-a": 0.0},
              answering={"vllm-decode-a", "vllm-batch-a"})
    first = await act.carry_out(o)
    assert first["wait"]["pools"] == {"vllm-decode-a": "decode", "vllm-batch-a": "batch"}
    assert not routed(server, "vllm-batch-a", "batch")
    server.fail("POST", "/eviction", 500, "etcdserver: leader changed", times=2)
    with pytest.raises(ActuationError, match="routed again"):
        await act.resume(o, first["wait"], Clock().t + 1)
    assert routed(server, "vllm-batch-a", "batch") and routed(server, "vllm-decode-a")
    again = await act.carry_out(replace(o, action_id=8))
    done = await act.resume(replace(o, action_id=8), again["wait"], Clock().t + 1)
    assert done["evicted"] == ["vllm-batch-a", "vllm-decode-a"]
    assert server.get(PODS, "batch", "vllm-batch-a") is None and server.get(PODS, NS, "vllm-decode-a") is None
    server.put(PODS, pod("vllm-decode-a"))
    server.put(PODS, twin)
    clash = await act.carry_out(replace(o, action_id=9))
    assert clash["wait"]["pools"] == {"vllm-decode-a": "decode"} and "share a name" in clash["wait"]["unmoved"]["batch"]


async def test_an_engine_flag_change_is_not_made_on_a_template_changed_since_its_approval(
        server: ApiServer, api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment())
    act = actuator(api)
    approved = (await act.observe()).pools["decode"].template
    before = tokens(server)
    dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert dep is not None
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v0.12.0"  # a rollout by hand
    server.put(DEPLOYMENTS, dep)
    o = replace(order(ActionKind.TUNE_SPECULATION, Speculation(step=-1)), from_template=approved)
    with pytest.raises(ActuationError, match="pod template of Deployment llm/vllm-decode changed since"):
        await act.carry_out(o)
    assert tokens(server) == before
    now_running = (await act.observe()).pools["decode"].template
    assert (await act.carry_out(replace(o, action_id=8, from_template=now_running)))["num_speculative_tokens"] == before - 1


async def test_an_abort_whose_answer_was_lost_is_found_made(server: ApiServer, api: client.ApiClient) -> None:
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS}, "spec": {"replicas": 2}})
    server.slow("PATCH", "/rollouts/vllm-canary/status", 2.5, times=2, stored=True)
    done = await actuator(api).carry_out(order(ActionKind.ROLLBACK, RollBack("canary"), pool="canary"))
    assert done == {"aborted": "Rollout llm/vllm-canary"}
    rollout = server.get(ROLLOUTS, NS, "vllm-canary")
    assert rollout is not None and rollout["status"]["abort"] is True
    assert rollout["metadata"]["annotations"][ACTION_ANNOTATION] == "7@0"


async def test_an_abort_made_is_not_failed_for_its_stamp(server: ApiServer, api: client.ApiClient) -> None:
    server.put(ROLLOUTS, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                          "metadata": {"name": "vllm-canary", "namespace": NS}, "spec": {"replicas": 2}})
    server.slow("PATCH", "/rollouts/vllm-canary/status", 0.01, stored=True)  # the abort goes through ...
    server.fail("PATCH", "/rollouts/vllm-canary", 503, times=2)  # ... and its stamp gets no answer
    done = await actuator(api).carry_out(order(ActionKind.ROLLBACK, RollBack("canary"), pool="canary"))
    assert done == {"aborted": "Rollout llm/vllm-canary"}
    rollout = server.get(ROLLOUTS, NS, "vllm-canary")
    assert rollout is not None and rollout["status"]["abort"] is True


@pytest.mark.parametrize("how", ["scale-down", "drain", "cordon"])
async def test_an_engine_whose_unroute_went_unanswered_is_routed_again(server: ApiServer, api: client.ApiClient,
                                                                       how: str) -> None:
    """The PATCH is stored and its answer lost twice: the action fails, and the engine is put back in routing, or it
    would run on, counted as capacity, and serve nothing."""
    server.put(DEPLOYMENTS, deployment(replicas=3))
    server.put(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1"}})
    for name in ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c"):
        server.put(PODS, pod(name))
    if how == "cordon":  # the pool serves off the node too, so none of it stays routed there
        server.put(PODS, pod("vllm-decode-d", node="gpu-node-2"))
    busy = {"vllm-decode-a": 5.0, "vllm-decode-b": 1.0, "vllm-decode-c": 9.0}
    o = {"scale-down": order(ActionKind.SCALE_POOL, ScaleTo(2), busy=busy),
         "drain": order(ActionKind.DRAIN_ENGINE, Drain("vllm-decode-b"), busy=busy),
         "cordon": order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy=busy)}[how]
    server.slow("PATCH", "/pods/vllm-decode-b", 2.5, times=2, stored=True)
    with pytest.raises(ActuationError, match="routed again"):
        await actuator(api).carry_out(o)
    assert routed(server, "vllm-decode-b")


async def test_a_leaderworkersets_budget_in_percent_counts_whole_groups(server: ApiServer,
                                                                        api: client.ApiClient) -> None:
    group = lws(replicas=4, size=2)
    group["spec"]["rolloutStrategy"] = {"rollingUpdateConfiguration": {"maxUnavailable": "50%"}}
    server.put(LWS, group)
    assert (await actuator(api).observe()).pools["prefill"].max_unavailable == 4  # two groups of two


async def test_a_scale_up_whose_reread_after_a_conflict_goes_unanswered_is_found_made(server: ApiServer,
                                                                                       api: client.ApiClient) -> None:
    server.put(DEPLOYMENTS, deployment(replicas=3))
    act = actuator(api)
    read, reads = act._read, []

    async def reread_unanswered(w: Workload) -> dict[str, Any]:
        reads.append(w.name)
        if len(reads) == 2:  # the fresh read after the conflict
            raise kubernetes_actuator._Unanswered(f"reading {w.name}: ReadTimeoutError")
        return await read(w)

    act._read = reread_unanswered  # type: ignore[method-assign]
    # The write is stored and its answer lost, its resend loses to it (409), and the fresh read after the conflict
    # goes unanswered: the count read back then says the scale is made.
    server.slow("PATCH", "/deployments/vllm-decode/scale", 2.5, times=1, stored=True)
    done = await act.carry_out(replace(order(ActionKind.SCALE_POOL, ScaleTo(4), action_id=1), from_replicas=3))
    assert done["replicas"] == 4 and "ReadTimeoutError" in done["unanswered"] and len(reads) == 3
    dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
    assert dep is not None and dep["spec"]["replicas"] == 4 and dep["metadata"]["annotations"][ACTION_ANNOTATION] == "1@0"
    # The same with nothing stored: the action fails, and says why.
    reads.clear()
    server.fail("PATCH", "/deployments/vllm-decode/scale", 409, "the object has been modified")
    with pytest.raises(ActuationError, match="ReadTimeoutError"):
        await act.carry_out(replace(order(ActionKind.SCALE_POOL, ScaleTo(5), action_id=2), from_replicas=4))
    assert server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 4  # type: ignore[index]


@pytest.mark.parametrize("times", [1, 2])
async def test_a_conflict_on_a_pod_patch_is_retried_once_then_routes_back_what_was_taken_out(
        server: ApiServer, api: client.ApiClient, times: int) -> None:
    """A 409 on one pod's patch (a webhook, the server's own retries) escaped every route-back: the engines already
    taken out of a scale-down, or off a cordoned node, stayed out of routing, at the lowest deletion cost, for good."""
    server.put(DEPLOYMENTS, deployment(replicas=3))
    for name in ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c"):
        server.put(PODS, pod(name))
    act = actuator(api, Clock())
    o = order(ActionKind.SCALE_POOL, ScaleTo(1), busy={"vllm-decode-a": 0.0, "vllm-decode-b": 1.0, "vllm-decode-c": 9.0})
    server.fail("PATCH", "/pods/vllm-decode-b", 409, "the object has been modified", times=times)
    if times == 1:
        note = await act.carry_out(o)
        assert sorted(note["wait"]["pods"]) == ["vllm-decode-a", "vllm-decode-b"]
        assert not routed(server, "vllm-decode-b")
        return
    with pytest.raises(ActuationError, match="409 conflict twice"):
        await act.carry_out(o)
    a = server.get(PODS, NS, "vllm-decode-a")
    assert a is not None and routed(server, "vllm-decode-a")
    assert DELETION_COST not in (a["metadata"].get("annotations") or {})


async def test_a_conflict_during_a_cordons_unroutes_routes_the_others_back(server: ApiServer,
                                                                           api: client.ApiClient) -> None:
    spread(server)
    act = actuator(api, Clock())
    o = order(ActionKind.CORDON_NODE, Cordon("gpu-node-1"), busy={"vllm-decode-a": 0.0, "vllm-decode-b": 3.0})
    server.fail("PATCH", "/pods/vllm-decode-b", 409, "the object has been modified", times=2)
    with pytest.raises(ActuationError, match="409 conflict twice"):
        await act.carry_out(o)
    assert routed(server, "vllm-decode-a")
