"""Pod discovery: label selectors, the pod-to-target mapping, and the target source against an API emulator.

The integration tests drive the official `kubernetes` client, unchanged, over HTTP against kmock's
KubernetesEmulator on a loopback port. Pods are created and deleted with the client and made ready
by patching their status subresource, as the kubelet would; every pod object is validated against
the official Pod schema. The emulator ignores `labelSelector`, so the selector tests exercise the
client-side filter that guards against any server or proxy that drops it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import kmock
import kubernetes_validate
import pytest
from kubernetes import client

from catalog.fleet import Role
from collectors.types import ScrapeResult, Target
from controlplane.discovery import DiscoveryError, KubernetesPodTargets, SkippedPod, targets_from_pods
from controlplane.errors import FleetError
from controlplane.observe import ScrapeSource
from controlplane.selectors import LabelSelector, Requirement

NS = "llm"
POOL = "llm-d.ai/pool"
ROLE = "llm-d.ai/role"
K8S_VERSION = kubernetes_validate.latest_version()
PODS = kmock.resource("", "v1", "pods")


# fixtures for the pure tests --------------------------------------------------------------------


def manifest(name: str, *, labels: dict[str, str] | None = None, port_name: str = "metrics", port: int = 8000,
             finalizers: list[str] | None = None) -> dict[str, Any]:
    """A Pod as a Deployment would create it (no status yet)."""
    meta: dict[str, Any] = {"name": name, "labels": {"app": "vllm", **(labels or {})}}
    if finalizers:
        meta["finalizers"] = finalizers
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": [
                {"name": "sidecar", "image": "envoyproxy/envoy:v1.31", "ports": [{"name": "admin", "containerPort": 9901}]},
                {"name": "vllm", "image": "vllm/vllm-openai:v0.10.1",
                 "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}]},
            ]
        },
    }


def ready_status(ip: str = "10.1.0.7", *, ready: bool = True, phase: str = "Running") -> dict[str, Any]:
    """What the kubelet reports for a started pod."""
    return {
        "phase": phase,
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }


def pod(name: str = "vllm-0", *, pool: str | None = "prefill", role: str | None = None, status: dict[str, Any] | None = None,
        deleting: bool = False, port_name: str = "metrics", extra: dict[str, str] | None = None) -> dict[str, Any]:
    labels = dict(extra or {})
    if pool is not None:
        labels[POOL] = pool
    if role is not None:
        labels[ROLE] = role
    p = manifest(name, labels=labels, port_name=port_name)
    p["status"] = ready_status() if status is None else status
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return p


def valid(obj: dict[str, Any]) -> dict[str, Any]:
    """The object, after checking it against the official schema (strict: no unknown fields)."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return obj


# label selectors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        pytest.param("", {}, True, id="empty-selects-all"),
        pytest.param("app=vllm", {"app": "vllm"}, True, id="equal"),
        pytest.param("app==vllm", {"app": "vllm"}, True, id="double-equal"),
        pytest.param("app=vllm", {"app": "sglang"}, False, id="equal-other-value"),
        pytest.param("app=vllm", {}, False, id="equal-missing-key"),
        pytest.param("tier!=canary", {"tier": "canary"}, False, id="not-equal"),
        pytest.param("tier!=canary", {}, True, id="not-equal-missing-key"),
        pytest.param("llm-d.ai/pool", {"llm-d.ai/pool": "decode"}, True, id="exists-prefixed-key"),
        pytest.param("llm-d.ai/pool", {"app": "vllm"}, False, id="exists-missing"),
        pytest.param("!canary", {"canary": "true"}, False, id="not-exists"),
        pytest.param("!canary", {}, True, id="not-exists-missing"),
        pytest.param("role in (prefill, decode)", {"role": "decode"}, True, id="in"),
        pytest.param("role in (prefill,decode)", {"role": "both"}, False, id="in-other-value"),
        pytest.param("role in (prefill)", {}, False, id="in-missing-key"),
        pytest.param("role notin (both)", {"role": "prefill"}, True, id="notin"),
        pytest.param("role notin (both)", {"role": "both"}, False, id="notin-excluded"),
        pytest.param("role notin (both)", {}, True, id="notin-missing-key"),
        pytest.param("app=vllm, role in (a,b), !canary, tier", {"app": "vllm", "role": "b", "tier": "x"}, True,
                     id="all-clauses-hold"),
        pytest.param("app=vllm,role in (a,b),!canary", {"app": "vllm", "role": "b", "canary": "1"}, False,
                     id="one-clause-fails"),
        pytest.param("version=", {"version": ""}, True, id="empty-value"),
    ],
)
def test_label_selector_matches(selector: str, labels: dict[str, str], selected: bool) -> None:
    assert LabelSelector.parse(selector).matches(labels) is selected


@pytest.mark.parametrize(
    "selector",
    [
        pytest.param("app=vllm,", id="trailing-comma"),
        pytest.param("app in (a,b", id="unbalanced-open"),
        pytest.param("app in a,b)", id="unbalanced-close"),
        pytest.param("app in ()", id="in-without-values"),
        pytest.param("app=a=b", id="two-equals"),
        pytest.param("app>1", id="unknown-operator"),
        pytest.param("-app=vllm", id="bad-key"),
    ],
)
def test_label_selector_rejects(selector: str) -> None:
    with pytest.raises(ValueError, match="label selector"):
        LabelSelector.parse(selector)


def test_label_selector_parses_and_prints_canonically() -> None:
    sel = LabelSelector.parse(" app = vllm , role in (decode, prefill),!canary,tier!=x, llm-d.ai/pool ")
    assert sel.requirements == (
        Requirement("app", "=", frozenset({"vllm"})),
        Requirement("role", "in", frozenset({"prefill", "decode"})),
        Requirement("canary", "!exists"),
        Requirement("tier", "!=", frozenset({"x"})),
        Requirement("llm-d.ai/pool", "exists"),
    )
    assert str(sel) == "app=vllm,role in (decode,prefill),!canary,tier!=x,llm-d.ai/pool"
    assert LabelSelector.parse(str(sel)) == sel


# pods -> targets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "options", "urls", "skipped"),
    [
        pytest.param(pod(), {}, ["http://10.1.0.7:8000/metrics"], [], id="ready"),
        pytest.param(pod(status=ready_status(ready=False)), {}, [], [], id="unready"),
        pytest.param(pod(status={"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]}), {}, [], [],
                     id="pending"),
        pytest.param(pod(status=ready_status(phase="Succeeded")), {}, [], [], id="finished"),
        pytest.param(pod(deleting=True), {}, [], [], id="terminating"),
        pytest.param(pod(status={**ready_status(), "podIP": None, "podIPs": []}), {}, [], [], id="no-ip"),
        pytest.param(pod(pool=None), {}, [], [SkippedPod("vllm-0", f"no {POOL} label")], id="no-pool-label"),
        pytest.param(pod(pool=None, status=ready_status(ready=False)), {}, [], [], id="no-pool-label-unready-not-reported"),
        pytest.param(pod(port_name="http"), {"port": "http"}, ["http://10.1.0.7:8000/metrics"], [], id="named-port"),
        pytest.param(pod(), {"port": "admin"}, ["http://10.1.0.7:9901/metrics"], [], id="named-port-other-container"),
        pytest.param(pod(port_name="http"), {}, [], [SkippedPod("vllm-0", "no container port named 'metrics'")],
                     id="named-port-missing"),
        pytest.param(pod(), {"port": 9400, "path": "/stats"}, ["http://10.1.0.7:9400/stats"], [], id="numeric-port"),
        pytest.param(pod(), {"port": "9400"}, ["http://10.1.0.7:9400/metrics"], [], id="numeric-port-as-text"),
        pytest.param(pod(status=ready_status("fd00:10:1::7")), {}, ["http://[fd00:10:1::7]:8000/metrics"], [], id="ipv6"),
        pytest.param(pod(extra={"app": "sglang"}), {"selector": "app=vllm"}, [], [], id="selector-rejects"),
        pytest.param(pod(pool="batch"), {"pool_roles": {"prefill": Role.PREFILL}}, [],
                     [SkippedPod("vllm-0", f"pool 'batch' (label {POOL}) is not in the fleet file")], id="pool-not-configured"),
    ],
)
def test_targets_from_pods_filters(p: dict[str, Any], options: dict[str, Any], urls: list[str],
                                   skipped: list[SkippedPod]) -> None:
    targets, skips = targets_from_pods([p], **options)
    assert [t.url for t in targets] == urls
    assert skips == skipped


@pytest.mark.parametrize(
    ("role_label_value", "pool_roles", "role"),
    [
        pytest.param("decode", {"prefill": Role.PREFILL}, Role.DECODE, id="label-wins"),
        pytest.param("both", None, Role.UNIFIED, id="llm-d-both-is-unified"),
        pytest.param("prefill-decode", None, Role.UNIFIED, id="prefill-decode-is-unified"),
        pytest.param(None, {"prefill": Role.PREFILL}, Role.PREFILL, id="pool-role-without-label"),
        pytest.param(None, None, Role.UNIFIED, id="unified-without-label-or-pool"),
    ],
)
def test_targets_from_pods_maps_role(role_label_value: str | None, pool_roles: dict[str, Role] | None, role: Role) -> None:
    targets, _ = targets_from_pods([pod(role=role_label_value)], role_label=ROLE, pool_roles=pool_roles)
    assert targets == [Target(url="http://10.1.0.7:8000/metrics", pool="prefill", pod="vllm-0", role=role)]


def test_targets_from_pods_skips_an_unknown_role() -> None:
    targets, skipped = targets_from_pods([pod(role="router")], role_label=ROLE)
    assert targets == []
    reason = f"label {ROLE}='router' is not a role (prefill, decode, unified, both, prefill-decode)"
    assert skipped == [SkippedPod("vllm-0", reason)]


def test_targets_from_pods_sorts_and_sets_source() -> None:
    pods = [pod("d-1", pool="decode", status=ready_status("10.0.0.4")), pod("p-1", status=ready_status("10.0.0.2")),
            pod("d-0", pool="decode", status=ready_status("10.0.0.3")), pod("p-0", status=ready_status("10.0.0.1"))]
    targets, _ = targets_from_pods(pods, source="vllm")
    assert [(t.pool, t.pod) for t in targets] == [("decode", "d-0"), ("decode", "d-1"), ("prefill", "p-0"), ("prefill", "p-1")]
    assert {t.source for t in targets} == {"vllm"}


def test_targets_from_pods_reads_client_models_like_json() -> None:
    """V1Pod objects (as the client returns them by default) map exactly as their JSON does."""
    raw = [valid(pod("a", role="decode")), valid(pod("b", pool=None)), valid(pod("c", deleting=True))]
    with client.ApiClient() as api_client:
        models = [api_client.deserialize(_Json(p), "V1Pod") for p in raw]
    assert all(isinstance(m, client.V1Pod) for m in models)
    assert targets_from_pods(models, role_label=ROLE) == targets_from_pods(raw, role_label=ROLE)
    assert len(targets_from_pods(models, role_label=ROLE)[0]) == 1


class _Json:
    """The minimal response object ApiClient.deserialize reads."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.data = json.dumps(obj)


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="between 1 and 65535"):
        targets_from_pods([], port=70000)
    with pytest.raises(ValueError, match="label selector"):
        KubernetesPodTargets(None, namespace=NS, selector="app in (")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must start with"):
        KubernetesPodTargets(None, namespace=NS, selector="app", path="metrics")  # type: ignore[arg-type]


def test_discovery_error_is_a_fleet_error() -> None:
    """The loop keeps running through FleetErrors; a DiscoveryError fails one tick, not the process."""
    assert issubclass(DiscoveryError, FleetError)


# against the API emulator -----------------------------------------------------------------------


@pytest.fixture
async def k8s() -> AsyncIterator[kmock.KubernetesEmulator]:
    """A Kubernetes API emulator on a loopback port."""
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
        yield emulator


@pytest.fixture
def api(k8s: kmock.KubernetesEmulator) -> Iterator[client.CoreV1Api]:
    """The official client, pointed at the emulator."""
    cfg = client.Configuration(host=str(k8s.url).rstrip("/"))
    with client.ApiClient(cfg) as api_client:
        yield client.CoreV1Api(api_client)


class Cluster:
    """Pod lifecycle through the official client: create, kubelet status updates, delete."""

    def __init__(self, k8s: kmock.KubernetesEmulator, api: client.CoreV1Api) -> None:
        self.k8s = k8s
        self.api = api

    async def create(self, name: str, *, namespace: str = NS, **kwargs: Any) -> None:
        body = valid(manifest(name, **kwargs))
        await asyncio.to_thread(self.api.create_namespaced_pod, namespace, body, _preload_content=False)

    async def start(self, name: str, ip: str, *, ready: bool = True, namespace: str = NS) -> None:
        await asyncio.to_thread(self.api.patch_namespaced_pod_status, name, namespace, {"status": ready_status(ip, ready=ready)},
                                _preload_content=False)
        valid(self.k8s.objects[PODS, namespace, name].raw)

    async def run(self, name: str, ip: str, *, namespace: str = NS, **kwargs: Any) -> None:
        await self.create(name, namespace=namespace, **kwargs)
        await self.start(name, ip, namespace=namespace)

    async def delete(self, name: str, *, namespace: str = NS) -> None:
        await asyncio.to_thread(self.api.delete_namespaced_pod, name, namespace, _preload_content=False)

    def fail_next(self, count: int, *payload: Any) -> None:
        """The next `count` pod lists get `payload` (slices index the history of matching requests)."""
        lists = self.k8s["list", PODS]
        start = len(lists)
        reaction = lists[start:start + count]
        for item in payload:
            reaction = reaction << item


@pytest.fixture
def cluster(k8s: kmock.KubernetesEmulator, api: client.CoreV1Api) -> Cluster:
    return Cluster(k8s, api)


def source(api: client.CoreV1Api, **kwargs: Any) -> KubernetesPodTargets:
    options: dict[str, Any] = {"namespace": NS, "selector": "app=vllm", "role_label": ROLE, "timeout_s": 0.5,
                               "pool_roles": {"prefill": Role.PREFILL, "decode": Role.DECODE}}
    return KubernetesPodTargets(api, **(options | kwargs))


def status_body(code: int, message: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": code, "message": message}


async def test_selector_and_namespace_limit_the_targets(k8s: kmock.KubernetesEmulator, api: client.CoreV1Api,
                                                        cluster: Cluster) -> None:
    await cluster.run("prefill-0", "10.1.0.1", labels={POOL: "prefill"})
    await cluster.run("decode-0", "10.1.0.2", labels={POOL: "decode", ROLE: "decode"})
    await cluster.run("router-0", "10.1.0.3", labels={POOL: "prefill", "app": "router"})
    await cluster.run("prefill-9", "10.9.0.1", namespace="elsewhere", labels={POOL: "prefill"})

    targets = await source(api).targets()

    assert targets == [
        Target(url="http://10.1.0.2:8000/metrics", pool="decode", pod="decode-0", role=Role.DECODE),
        Target(url="http://10.1.0.1:8000/metrics", pool="prefill", pod="prefill-0", role=Role.PREFILL),
    ]
    sent = list(k8s["list", PODS])[-1]
    assert sent.params["labelSelector"] == "app=vllm"
    assert sent.namespace == NS


async def test_pod_that_becomes_ready_appears_on_the_next_call(api: client.CoreV1Api, cluster: Cluster) -> None:
    discovery = source(api, port="http")
    await cluster.create("decode-0", labels={POOL: "decode"}, port_name="http", port=8200)
    assert await discovery.targets() == []
    await cluster.start("decode-0", "10.1.0.5", ready=False)
    assert await discovery.targets() == []
    await cluster.start("decode-0", "10.1.0.5")
    assert await discovery.targets() == [Target(url="http://10.1.0.5:8200/metrics", pool="decode", pod="decode-0",
                                                role=Role.DECODE)]


async def test_deleted_and_terminating_pods_disappear(api: client.CoreV1Api, cluster: Cluster) -> None:
    discovery = source(api)
    await cluster.run("prefill-0", "10.1.0.1", labels={POOL: "prefill"})
    await cluster.run("prefill-1", "10.1.0.2", labels={POOL: "prefill"})
    await cluster.run("prefill-2", "10.1.0.3", labels={POOL: "prefill"}, finalizers=["example.com/drain"])
    assert [t.pod for t in await discovery.targets()] == ["prefill-0", "prefill-1", "prefill-2"]

    await cluster.delete("prefill-0")
    await cluster.delete("prefill-2")  # held by its finalizer: still listed, with a deletionTimestamp

    listed = await asyncio.to_thread(cluster.api.list_namespaced_pod, NS)
    assert {p.metadata.name for p in listed.items} == {"prefill-1", "prefill-2"}
    assert [t.pod for t in await discovery.targets()] == ["prefill-1"]


async def test_pod_without_pool_label_is_reported_once(api: client.CoreV1Api, cluster: Cluster,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    discovery = source(api)
    await cluster.run("stray-0", "10.1.0.9")
    await cluster.run("prefill-0", "10.1.0.1", labels={POOL: "prefill"})
    with caplog.at_level(logging.WARNING, logger="controlplane.discovery"):
        for _ in range(3):
            assert [t.pod for t in await discovery.targets()] == ["prefill-0"]
    reports = [r.getMessage() for r in caplog.records if "stray-0" in r.getMessage()]
    assert reports == [f"pod {NS}/stray-0 is not scraped: no {POOL} label"]


async def test_failures_serve_the_last_list_then_raise(api: client.CoreV1Api, cluster: Cluster,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    discovery = source(api, max_stale_failures=2)
    await cluster.run("prefill-0", "10.1.0.1", labels={POOL: "prefill"})
    good = await discovery.targets()
    assert len(good) == 1 and not discovery.stale

    cluster.fail_next(3, 500, status_body(500, "etcdserver: request timed out " + "x" * 2000))
    with caplog.at_level(logging.WARNING, logger="controlplane.discovery"):
        assert await discovery.targets() == good
        assert await discovery.targets() == good
    assert discovery.stale and discovery.consecutive_failures == 2
    assert "serving the last 1 target(s)" in caplog.text
    with pytest.raises(DiscoveryError) as err:
        await discovery.targets()
    assert err.value.status == 500
    assert err.value.body.startswith("etcdserver: request timed out")
    assert len(err.value.body) <= 300
    assert "traceback" not in str(err.value).lower()

    await cluster.run("prefill-1", "10.1.0.2", labels={POOL: "prefill"})
    assert [t.pod for t in await discovery.targets()] == ["prefill-0", "prefill-1"]
    assert not discovery.stale and discovery.consecutive_failures == 0


# An engine's exposition with every family the pools' sums need.
ENGINE = "".join(
    [f"# TYPE vllm:{name} {kind}\nvllm:{name}{{engine=\"0\"}} {value}\n" for name, kind, value in (
        ("request_success_total", "counter", 10), ("prefix_cache_queries_total", "counter", 100),
        ("prefix_cache_hits_total", "counter", 50), ("kv_cache_usage_perc", "gauge", 0.5),
        ("num_requests_running", "gauge", 3), ("num_requests_waiting", "gauge", 0))]
    + [f"# TYPE vllm:{name} histogram\nvllm:{name}_bucket{{engine=\"0\",le=\"0.1\"}} 5\n"
       f"vllm:{name}_bucket{{engine=\"0\",le=\"+Inf\"}} 10\nvllm:{name}_sum{{engine=\"0\"}} 1.0\n"
       f"vllm:{name}_count{{engine=\"0\"}} 10\n" for name in ("time_to_first_token_seconds", "inter_token_latency_seconds")])


class AllAnswer:
    """Every target answers its scrape: what is judged is the list, not the engines."""

    def __init__(self) -> None:
        self.health: dict[str, Any] = {}

    async def scrape(self, targets: list[Target], now: float) -> list[ScrapeResult]:
        return [ScrapeResult(t, now, ok=True, body=ENGINE) for t in targets]


async def test_a_stale_pod_list_leaves_no_pool_fit_to_act_on(api: client.CoreV1Api, cluster: Cluster) -> None:
    """An engine that became ready while the API failed is in no pool's sums: nothing acts on them meanwhile."""
    discovery = source(api)
    observe = ScrapeSource(discovery, AllAnswer())  # type: ignore[arg-type]
    await cluster.run("prefill-0", "10.1.0.1", labels={POOL: "prefill"})
    fresh = await observe.observe(0.0)
    assert "vllm" not in fresh.unfit_inputs(["prefill", "decode"]).get("prefill", {})
    cluster.fail_next(1, 503, status_body(503, "the server is currently unable to handle the request"))
    stale = (await observe.observe(15.0)).unfit_inputs(["prefill", "decode"])
    assert discovery.stale and "the pod list is the last one read" in stale["prefill"]["vllm"]
    assert "vllm" in stale["decode"], "a pool whose every engine came since is no fitter"
    again = await observe.observe(30.0)
    assert not discovery.stale and "vllm" not in again.unfit_inputs(["prefill"]).get("prefill", {})


async def test_forbidden_without_a_previous_list_raises_at_once(api: client.CoreV1Api, cluster: Cluster) -> None:
    cluster.fail_next(1, 403, status_body(403, 'pods is forbidden: User "system:serviceaccount:llm:fleet" cannot list '
                                               'resource "pods" in API group "" in the namespace "llm"'))
    with pytest.raises(DiscoveryError, match="HTTP 403 Forbidden: pods is forbidden") as err:
        await source(api).targets()
    assert err.value.status == 403


async def test_timeouts_do_not_block_the_event_loop(api: client.CoreV1Api, cluster: Cluster) -> None:
    discovery = source(api, timeout_s=0.2, max_stale_failures=1)
    await cluster.run("prefill-0", "10.1.0.1", labels={POOL: "prefill"})
    good = await discovery.targets()
    release = asyncio.Event()

    async def hang() -> dict[str, Any]:
        await release.wait()
        return {"kind": "PodList", "items": []}

    # Enough hung answers for the client's own retries of a timed-out GET.
    cluster.fail_next(20, hang)
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            await asyncio.sleep(0.01)
            beats += 1

    beating = asyncio.create_task(heartbeat())
    try:
        assert await discovery.targets() == good
        with pytest.raises(DiscoveryError, match="Timeout") as err:
            await discovery.targets()
    finally:
        beating.cancel()
        release.set()
    assert err.value.status is None
    assert beats > 10


async def test_unreadable_answer_is_a_discovery_error(api: client.CoreV1Api, cluster: Cluster) -> None:
    cluster.fail_next(1, b"<html>proxy error</html>")
    with pytest.raises(DiscoveryError, match="unreadable"):
        await source(api).targets()


async def test_unreachable_api_is_a_discovery_error() -> None:
    cfg = client.Configuration(host="http://127.0.0.1:9")
    cfg.retries = False
    with client.ApiClient(cfg) as api_client:
        with pytest.raises(DiscoveryError, match="NewConnectionError|MaxRetryError") as err:
            await source(client.CoreV1Api(api_client)).targets()
    assert err.value.status is None


async def test_pages_are_followed_and_an_expired_token_restarts_the_list(k8s: kmock.KubernetesEmulator,
                                                                         api: client.CoreV1Api) -> None:
    first, second = pod("prefill-0", status=ready_status("10.1.0.1")), pod("prefill-1", status=ready_status("10.1.0.2"))
    expired = iter([True])

    def paged(request: kmock.Request) -> kmock.Response:
        token = request.params.get("continue")
        if token is None:
            return kmock.Response(status=200, payload={"kind": "PodList", "metadata": {"continue": "t1"}, "items": [first]})
        if next(expired, False):
            return kmock.Response(status=410, payload=status_body(410, "The provided continue parameter is too old"))
        return kmock.Response(status=200, payload={"kind": "PodList", "metadata": {}, "items": [second]})

    k8s["list", PODS] << paged
    targets = await source(api, page_size=1).targets()
    assert [t.pod for t in targets] == ["prefill-0", "prefill-1"]
    requests = list(k8s["list", PODS])
    assert [r.params.get("continue") for r in requests] == [None, "t1", None, "t1"]
    assert {r.params["limit"] for r in requests} == {"1"}
