"""kmock's Kubernetes emulator with the API-server behaviour the actuator relies on.

kmock stores objects and serves them over HTTP to the official client; it merges patches as plain
dicts and does not know subresources, preconditions or dry runs. This subclass (a test double,
written because no real API server runs here) adds what the actuator's correctness depends on,
each as the API server documents it:

- every created object, every patched object and every subresource body is validated against
  the official OpenAPI schemas (`kubernetes-validate`), a custom resource against its project's
  CRD schema where the tests hold one (`crd_schemas`: Argo Rollouts and LeaderWorkerSets; any
  other for its Scale bodies only), and any invalid one is kept in `invalid` for the test to
  fail on;
- PATCH follows its content type: JSON merge patch (RFC 7386, `null` deletes) or strategic merge
  patch (lists of named items such as `containers` merged by name), with the body's
  `metadata.resourceVersion` as a precondition (409 when stale; a Scale's is its object's); every
  write bumps the version;
- `?dryRun=All` validates and answers without storing anything;
- the `scale` subresource reads and writes `spec.replicas` (answering a Scale object), `status`
  patches the status, `eviction` deletes a pod unless a PodDisruptionBudget (`pdb_blocks`) refuses
  with 429;
- lists honour `labelSelector` (equality- and set-based) and `fieldSelector` `spec.nodeName`;
- `fail(...)` answers the next matching requests with an error status, `slow(...)` delays them.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
import kubernetes_validate

from controlplane.selectors import LabelSelector
from tests.crd_schemas import crd_name, problems, schema

K8S_VERSION = kubernetes_validate.latest_version()
VALIDATED_GROUPS = {"", "apps", "policy", "events.k8s.io", "coordination.k8s.io", "autoscaling"}
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
REPLICASETS = kmock.resource("apps", "v1", "replicasets")
PODS = kmock.resource("", "v1", "pods")
NODES = kmock.resource("", "v1", "nodes")
EVENTS = kmock.resource("events.k8s.io", "v1", "events")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
HPAS = kmock.resource("autoscaling", "v2", "horizontalpodautoscalers")


@dataclass
class _Fault:
    method: str
    path: str  # a substring of the request path
    status: int
    message: str
    times: int
    delay: float = 0.0
    stored: bool = False  # the request is carried out before the delay (a write made whose answer is lost)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    return _merge(target, patch, by_name=False)


def strategic_merge(target: Any, patch: Any) -> Any:
    """Strategic merge patch, as far as pod templates need it: lists of dicts with a `name` merge by name."""
    return _merge(target, patch, by_name=True)


def _merge(target: Any, patch: Any, *, by_name: bool) -> Any:
    if isinstance(patch, dict):
        out = dict(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = _merge(out.get(key), value, by_name=by_name)
        return out
    if by_name and isinstance(patch, list) and patch and isinstance(target, list) \
            and all(isinstance(i, dict) and "name" in i for i in patch):
        by = {i.get("name"): i for i in target if isinstance(i, dict)}
        named = {p["name"] for p in patch}
        return [_merge(by.get(i["name"]), i, by_name=True) for i in patch] + \
            [i for i in target if isinstance(i, dict) and i.get("name") not in named]
    return patch


def _status(code: int, message: str, reason: str = "") -> aiohttp.web.Response:
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
            "message": message, "reason": reason, "code": code}
    return aiohttp.web.json_response(body, status=code)


def rbac_of(request: kmock.Request) -> tuple[str, str, str] | None:
    """The RBAC (API group, resource[/subresource], verb) a request needs; None for non-resource paths."""
    if request.resource is None:
        return None
    resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    method = str(request.method.value)
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method)
    if verb is None:
        verb = "get" if request.name is not None else "watch" if request.params.get("watch") == "true" else "list"
    return request.resource.group or "", resource, verb


def _labels_match(obj: dict[str, Any], selector: str) -> bool:
    return LabelSelector.parse(selector).matches((obj.get("metadata") or {}).get("labels"))


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with preconditions, content-typed patches, subresources, dry runs and validation."""

    invalid: list[str] = attrs.field(factory=list)
    pdb_blocks: dict[str, int] = attrs.field(factory=dict)  # pod -> evictions still refused
    _faults: list[_Fault] = attrs.field(factory=list)
    _versions: Any = attrs.field(factory=lambda: itertools.count(100))

    # test controls ---------------------------------------------------------------------------

    def fail(self, method: str, path: str, status: int, message: str = "injected", times: int = 1) -> None:
        """The next `times` requests with this method and a path containing `path` get `status`."""
        self._faults.append(_Fault(method.upper(), path, status, message, times))

    def slow(self, method: str, path: str, seconds: float, times: int = 1, *, stored: bool = False) -> None:
        """The next `times` matching requests answer only after `seconds` (a client that gives up first cancels
        them), or with `stored`, are carried out at once and answered after `seconds`."""
        self._faults.append(_Fault(method.upper(), path, 0, "", times, seconds, stored))

    def put(self, resource: Any, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as if created through the API (validated, versioned)."""
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", "2026-12-01T10:00:00Z")
        meta["resourceVersion"] = str(next(self._versions))
        self._validate(obj, f"put {resource}")
        self.objects[resource, meta.get("namespace"), meta["name"]] = obj
        return obj

    def terminate(self, namespace: str, pod: str) -> None:
        """What a controller's delete does to a pod first: it terminates (`deletionTimestamp` set), still listed."""
        obj = self.get(PODS, namespace, pod)
        assert obj is not None, pod
        obj["metadata"]["deletionTimestamp"] = "2026-12-05T10:00:00Z"
        self.put(PODS, obj)

    def get(self, resource: Any, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The stored object, or None."""
        key = (resource, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return dict(self.objects[key].raw)

    # validation ------------------------------------------------------------------------------

    def _validate(self, obj: dict[str, Any], where: str) -> None:
        api = str(obj.get("apiVersion", ""))
        group = api.split("/")[0] if "/" in api else ""
        if group not in VALIDATED_GROUPS:
            crd = schema(crd_name(api, str(obj.get("kind", ""))))
            if crd is not None:
                self.invalid.extend(f"{where}: {problem}" for problem in problems(obj, crd))
            return
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            self.invalid.append(f"{where}: {getattr(exc, 'message', exc)}")

    # serving ---------------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        for fault in self._faults:
            if fault.times > 0 and fault.method == str(request.method.value) and fault.path in request.url.path:
                fault.times -= 1
                if fault.delay and fault.stored:
                    answer = await self._serve(request)
                    await asyncio.sleep(fault.delay)
                    return answer
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                    break
                return _status(fault.status, fault.message)
        return await self._serve(request)

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await super()._handle(request)
        action = request.action
        if action == kmock.action.LIST:
            return self._list(request)
        if action == kmock.action.CREATE or request.subresource == "eviction":  # a POST to a named pod
            return self._create(request)
        if action == kmock.action.UPDATE:
            return self._patch(request)
        if action == kmock.action.DELETE and request.name is not None:
            return self._delete(request)
        if action == kmock.action.FETCH and request.subresource == "scale":
            obj = self.get(request.resource, request.namespace, request.name)
            if obj is None:
                return _status(404, f"{request.name} not found", "NotFound")
            return aiohttp.web.json_response(self._scale_of(obj))
        return await super()._handle(request)

    def _dry(self, request: kmock.Request) -> bool:
        return request.params.get("dryRun") == "All"

    def _list(self, request: kmock.Request) -> aiohttp.web.Response:
        items = []
        for (resource, namespace, _name), obj in self.objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            raw = dict(obj.raw)
            if not _labels_match(raw, request.params.get("labelSelector", "")):
                continue
            node = request.params.get("fieldSelector", "")
            if node.startswith("spec.nodeName=") and (raw.get("spec") or {}).get("nodeName") != node.split("=", 1)[1]:
                continue
            items.append(raw)
        return aiohttp.web.json_response({"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items})

    def _create(self, request: kmock.Request) -> aiohttp.web.Response:
        body = dict(request.data or {})
        if request.subresource == "eviction":
            self._validate(body, f"eviction of {request.name}")
            if self.pdb_blocks.get(request.name or "", 0) > 0:
                self.pdb_blocks[request.name or ""] -= 1
                return _status(429, "Cannot evict pod as it would violate the pod's disruption budget.",
                               "TooManyRequests")
            if not self._dry(request):
                key = (PODS, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    self.objects[key].delete()
            return _status(201, "evicted")
        meta = body.setdefault("metadata", {})
        if "name" not in meta and "generateName" in meta:
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("namespace", request.namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        self._validate(body, f"create {request.resource}")
        if self.get(request.resource, meta.get("namespace"), meta["name"]) is not None:
            return _status(409, f"{meta['name']} already exists", "AlreadyExists")
        if not self._dry(request):
            self.objects[request.resource, meta.get("namespace"), meta["name"]] = body
        return aiohttp.web.json_response(body, status=201)

    def _patch(self, request: kmock.Request) -> aiohttp.web.Response:
        current = self.get(request.resource, request.namespace, request.name)
        if current is None:
            return _status(404, f"{request.resource.plural} {request.name!r} not found", "NotFound")
        patch = request.data
        kind = request.headers.get("Content-Type", "")
        wanted = ((patch or {}).get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"] and request.subresource != "status":
            return _status(409, "the object has been modified; please apply your changes to the latest version",
                           "Conflict")
        if request.subresource == "scale":
            scale = self._scale_of(current)
            scale = merge_patch(scale, patch)
            self._validate(scale, f"scale of {request.name}")
            updated = merge_patch(current, {"spec": {"replicas": scale["spec"]["replicas"]}})
        elif request.subresource == "status":
            updated = merge_patch(current, {"status": (patch or {}).get("status", {})})
        else:
            merge = strategic_merge if "strategic" in kind else merge_patch
            updated = merge(current, patch)
        updated.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
        self._validate(updated, f"patch of {request.resource.plural}/{request.name}")
        if not self._dry(request):
            key = (request.resource, request.namespace, request.name)
            del self.objects[key]
            self.objects[key] = updated
        answer = self._scale_of(updated) if request.subresource == "scale" else updated
        return aiohttp.web.json_response(answer)

    def _delete(self, request: kmock.Request) -> aiohttp.web.Response:
        current = self.get(request.resource, request.namespace, request.name)
        if current is None:
            return _status(404, f"{request.name} not found", "NotFound")
        if not self._dry(request):
            self.objects[request.resource, request.namespace, request.name].delete()
        return aiohttp.web.json_response(current)

    @staticmethod
    def _scale_of(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                             "resourceVersion": meta.get("resourceVersion")},
                "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
                "status": {"replicas": (obj.get("status") or {}).get("replicas", 0)}}
