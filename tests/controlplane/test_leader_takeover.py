"""Two `fleetctl run` processes, one API emulator, one store: only the leader acts, and a kill -9 of
the leader in the middle of an action loses nothing and repeats nothing.

The action is a drained scale-down (3 -> 2 engines): the leader takes the least busy engine out of
routing and waits for it to go idle. It is killed while it waits. The follower takes the Lease once
the leader's record has not changed for the lease duration, resumes the wait from the audit log,
scales the Deployment when the engine is idle, and ends the action once the engine is removed. Each
process has its own credentials, so the emulator's request log says who wrote what.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.web
import httpx
import pytest

from controlplane.actions import ActionState
from controlplane.actuators.kubernetes import ACTION_ANNOTATION
from controlplane.lab.engine import free_port
from controlplane.store import migrate
from controlplane.store.records import NewAction
from controlplane.store.writer import SqlStore
from policies.types import ScaleTo, change_as_dict
from tests.controlplane.apiserver import DEPLOYMENTS, LEASES, PODS, ApiServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NS = "llm"
PODS_OF_POOL = ("vllm-decode-a", "vllm-decode-b", "vllm-decode-c")



class Engines:
    """vLLM's /metrics for three engines; `busy` sets the requests each is running."""

    def __init__(self) -> None:
        self.busy = dict.fromkeys(PODS_OF_POOL, 3)

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        pod = request.match_info["pod"]
        text = (f'vllm:num_requests_running{{model_name="m"}} {self.busy[pod]}\n'
                'vllm:num_requests_waiting{model_name="m"} 0\n')
        return aiohttp.web.Response(text=text, content_type="text/plain")


@pytest.fixture
async def engines() -> AsyncIterator[tuple[Engines, int]]:
    state = Engines()
    app = aiohttp.web.Application()
    app.router.add_get("/metrics/{pod}", state.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    yield state, port
    await runner.cleanup()


def kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": token, "user": {"token": token}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": token}}],
    }))
    return path


def fleet_file(tmp: Path, name: str, db: str, engines_port: int, config: Path) -> tuple[Path, int]:
    port = free_port()
    targets = "\n".join(f"  - {{url: 'http://127.0.0.1:{engines_port}/metrics/{p}', pool: decode, pod: {p}}}"
                        for p in PODS_OF_POOL)
    path = tmp / f"{name}.yaml"
    path.write_text(f"""
mode: act
store: {{url: '{db}'}}
scrape: {{interval: 1s, timeout: 500ms, spread: 100ms}}
server: {{port: {port}}}
pools:
  - name: decode
    role: decode
    model: m
    replicas: {{min: 1, max: 4}}
    workload: {{kind: Deployment, namespace: {NS}, name: vllm-decode}}
targets:
{targets}
kubernetes:
  kubeconfig: {config}
  drain_grace: 10m
  timeout: 2s
  leader_election: {{namespace: {NS}, lease_duration: 3s, renew_deadline: 2s, retry_period: 500ms}}
""")
    return path, port


def deployment() -> dict[str, Any]:
    labels = {"app": "vllm-decode"}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm-decode", "namespace": NS},
            "spec": {"replicas": 3, "selector": {"matchLabels": labels},
                     "strategy": {"rollingUpdate": {"maxUnavailable": 1}},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]}}},
            "status": {"replicas": 3, "readyReplicas": 3}}


def writes(server: ApiServer, token: str) -> list[str]:
    """The writes made with `token`, as 'METHOD path', leases left out."""
    return [f"{r.method.value} {r.url.path}" for r in server
            if str(r.method.value) in ("POST", "PATCH", "PUT", "DELETE") and "/leases" not in r.url.path
            and r.headers.get("Authorization") == f"Bearer {token}"]


def only(store: SqlStore) -> Any:
    [action] = store.actions()
    return action


async def until(what: str, check: Any) -> None:
    try:
        async with asyncio.timeout(40):
            while not check():
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_the_follower_takes_over_a_killed_leaders_action_once(
        tmp_path: Path, server: ApiServer, engines: tuple[Engines, int]) -> None:
    state, engines_port = engines
    server.put(DEPLOYMENTS, deployment())
    for name in PODS_OF_POOL:
        server.put(PODS, {"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": name, "namespace": NS,
                                       "labels": {"app": "vllm-decode", "llm-d.ai/routed": "true"}},
                          "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
                          "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    migrate.upgrade(db)
    store = SqlStore.open(db)
    now = time.time()
    action = store.create_action(NewAction(None, "scale_pool", "decode",
                                           {"change": change_as_dict(ScaleTo(2)), "from_replicas": 3, "replicas": 2},
                                           "act", "fewer decode engines"), now)
    store.decide(action.id, approve=True, by="alice", now=now, via="cli")

    api = str(server.url).rstrip("/")
    procs: dict[str, asyncio.subprocess.Process] = {}
    ports: dict[str, int] = {}
    logs: dict[str, Path] = {}
    files = contextlib.ExitStack()
    try:
        for name in ("a", "b"):
            config = kubeconfig(tmp_path / f"kube-{name}.json", api, f"replica-{name}")
            path, ports[name] = fleet_file(tmp_path, name, db, engines_port, config)
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "controlplane.cli", "run", "--config", str(path), cwd=ROOT,
                stdout=asyncio.subprocess.DEVNULL, stderr=files.enter_context(logs[name].open("w")))
            if name == "a":  # a starts first and takes the Lease; b follows
                await until("a to lead", lambda: server.get(LEASES, NS, "fleet-controlplane") is not None)

        def audit() -> list[str]:
            return [e.event for e in store.action_events(action.id)]

        await until("the leader to drain an engine and wait", lambda: "waiting" in audit())
        b_status: dict[str, Any] = {}
        async with httpx.AsyncClient() as http:
            for _ in range(100):
                try:
                    b_status = (await http.get(f"http://127.0.0.1:{ports['b']}/api/status")).json()
                    break
                except httpx.HTTPError:
                    assert procs["b"].returncode is None, logs["b"].read_text()
                    await asyncio.sleep(0.2)
        assert b_status["leading"] is False and b_status["status"] == "standby"
        assert writes(server, "replica-b") == [], "the follower changed nothing"
        drained = writes(server, "replica-a")
        assert drained == [f"PATCH /api/v1/namespaces/{NS}/pods/vllm-decode-a",
                           f"POST /apis/events.k8s.io/v1/namespaces/{NS}/events"], drained
        routed = server.get(PODS, NS, "vllm-decode-a")
        assert routed is not None and "llm-d.ai/routed" not in routed["metadata"]["labels"]

        procs["a"].send_signal(signal.SIGKILL)  # in the middle of the action
        await procs["a"].wait()
        holder_a = server.get(LEASES, NS, "fleet-controlplane")["spec"]["holderIdentity"]  # type: ignore[index]

        await until("b to take over", lambda: "taken_over" in audit())
        state.busy["vllm-decode-a"] = 0  # the drained engine finishes its requests
        await until("b to scale", lambda: server.get(DEPLOYMENTS, NS, "vllm-decode")["spec"]["replicas"] == 2)  # type: ignore[index]
        server.terminate(NS, "vllm-decode-a")  # the ReplicaSet removes the drained engine
        await until("the action to finish", lambda: only(store).state is not ActionState.STARTED)

        done = only(store)
        assert done.state is ActionState.SUCCEEDED, (done, audit(), logs["b"].read_text()[-3000:])
        events = audit()
        assert events.count("started") == 1 and events.count("succeeded") == 1, events
        assert events[-4:] == ["waiting", "taken_over", "waiting", "succeeded"], events  # the drain, then the removal
        scales = [w for w in writes(server, "replica-a") + writes(server, "replica-b") if w.endswith("/scale")]
        assert scales == [f"PATCH /apis/apps/v1/namespaces/{NS}/deployments/vllm-decode/scale"], "scaled once"
        assert writes(server, "replica-b").count(f"PATCH /api/v1/namespaces/{NS}/pods/vllm-decode-a") == 0, \
            "b resumed the wait; it did not drain again"
        dep = server.get(DEPLOYMENTS, NS, "vllm-decode")
        assert dep is not None and dep["spec"]["replicas"] == 2
        assert dep["metadata"]["annotations"][ACTION_ANNOTATION] == f"{action.id}@{action.created_at:.0f}", \
            "the annotation and the audit agree"
        lease = server.get(LEASES, NS, "fleet-controlplane")
        assert lease is not None and lease["spec"]["holderIdentity"] != holder_a and lease["spec"]["leaseTransitions"] == 1
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 20)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        files.close()
        store.close()
