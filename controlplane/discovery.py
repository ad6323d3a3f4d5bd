"""Target discovery: the vLLM engine pods of one namespace, found in Kubernetes by label selector.

Owns listing the pods, label-selector semantics, mapping ready pods to scrape targets, and what the
loop sees when the API fails. It must not change anything in the cluster, watch, or scrape.

Least privilege: it only needs `list` on `pods` in the one namespace it is given (a namespaced Role
and RoleBinding, not a ClusterRole); no `get`, `watch` or write verbs.

On API failure the last good target list is served, stale and with a warning, for up to
`max_stale_failures` consecutive failures, so one API hiccup does not drop every target (and `stale`
says so: the scrape source marks every pool's inputs unfit to act on meanwhile); after that,
and when no list ever succeeded, `targets()` raises DiscoveryError: the loop's tick fails (logged
and counted in `tick_failures`) until the API answers again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from catalog.fleet import Role
from collectors.types import Target
from controlplane.errors import FleetError
from controlplane.kube import field, pod_ready
from controlplane.selectors import LabelSelector

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, CoreV1Api, V1Pod

__all__ = [
    "DiscoveryError",
    "KubernetesPodTargets",
    "SkippedPod",
    "targets_from_pods",
]

log = logging.getLogger(__name__)

DEFAULT_POOL_LABEL = "llm-d.ai/pool"
# llm-d labels an engine that runs both phases "both" (some deployments "prefill-decode"); the fleet
# file calls it "unified".
_ROLE_ALIASES = {"both": Role.UNIFIED, "prefill-decode": Role.UNIFIED}
_BODY_LIMIT = 300


class DiscoveryError(FleetError):
    """The Kubernetes API could not list the pods (status is None when no HTTP answer came)."""

    exit_code = 4

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None, body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(message)


# pods -> targets (pure) ------------------------------------------------------------------------


class SkippedPod(NamedTuple):
    """A running, ready pod that cannot be made a target, and why."""

    pod: str
    reason: str


def _dig(obj: Any, *names: str) -> Any:
    for name in names:
        obj = field(obj, name)
    return obj


def _resolve_port(pod: Any, port: int | str) -> int | None:
    if isinstance(port, int):
        return port
    for container in _dig(pod, "spec", "containers") or []:
        for p in field(container, "ports") or []:
            if field(p, "name") == port:
                return int(field(p, "containerPort"))
    return None


def _role(value: str | None, pool: str, pool_roles: Mapping[str, Role] | None) -> Role | None:
    if value is None:
        return pool_roles[pool] if pool_roles is not None else Role.UNIFIED
    if value in _ROLE_ALIASES:
        return _ROLE_ALIASES[value]
    try:
        return Role(value)
    except ValueError:
        return None


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def targets_from_pods(
    pods: Iterable[V1Pod | Mapping[str, Any]],
    *,
    pool_label: str = DEFAULT_POOL_LABEL,
    role_label: str | None = None,
    port: int | str = "metrics",
    path: str = "/metrics",
    source: str = "vllm",
    pool_roles: Mapping[str, Role] | None = None,
    selector: LabelSelector | str | None = None,
) -> tuple[list[Target], list[SkippedPod]]:
    """Targets of the Running, Ready, not-terminating pods with an IP, sorted; plus the ready pods it had to skip.

    Pods the selector rejects and pods that are not ready are left out silently. With `pool_roles`,
    pods of a pool the fleet file does not know are skipped; without it every pool is accepted.
    """
    if isinstance(selector, str):
        selector = LabelSelector.parse(selector)
    port = _normalize_port(port)
    targets: list[Target] = []
    skipped: list[SkippedPod] = []
    for pod in pods:
        labels: Mapping[str, str] = _dig(pod, "metadata", "labels") or {}
        if selector is not None and not selector.matches(labels):
            continue
        if not pod_ready(pod) or not _dig(pod, "status", "podIP"):
            continue
        name = str(_dig(pod, "metadata", "name"))
        pool = labels.get(pool_label)
        if not pool:
            skipped.append(SkippedPod(name, f"no {pool_label} label"))
            continue
        if pool_roles is not None and pool not in pool_roles:
            skipped.append(SkippedPod(name, f"pool {pool!r} (label {pool_label}) is not in the fleet file"))
            continue
        role = _role(labels.get(role_label) if role_label else None, pool, pool_roles)
        if role is None:
            known = ", ".join([*Role, *_ROLE_ALIASES])
            skipped.append(SkippedPod(name, f"label {role_label}={labels.get(role_label or '')!r} is not a role ({known})"))
            continue
        number = _resolve_port(pod, port)
        if number is None:
            skipped.append(SkippedPod(name, f"no container port named {port!r}"))
            continue
        url = f"http://{_host(str(_dig(pod, 'status', 'podIP')))}:{number}{path}"
        targets.append(Target(url=url, pool=pool, pod=name, role=role, source=source))
    targets.sort(key=lambda t: (t.pool, t.pod, t.url))
    skipped.sort()
    return targets, skipped


def _normalize_port(port: int | str) -> int | str:
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if isinstance(port, int):
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} is not between 1 and 65535")
        return port
    if not port:
        raise ValueError("port must be a number or a container port name such as 'metrics'")
    return port


# the target source ------------------------------------------------------------------------------


def _shorten(text: Any, limit: int = _BODY_LIMIT) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _few(keys: set[str], limit: int = 5) -> str:
    shown = sorted(keys)[:limit]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return (", ".join(shown) + more) if shown else "none"


def _api_message(body: str | bytes | None) -> str:
    """The `message` of a Kubernetes Status body, else the body itself."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body or ""
    try:
        data = json.loads(text)
    except ValueError:
        return text
    return str(data.get("message") or text) if isinstance(data, dict) else text


class KubernetesPodTargets:
    """A TargetSource: the ready pods matching `selector` in `namespace`, one target each.

    The blocking client call runs in a worker thread. The selector is sent to the API server and
    also applied here, so a server (or proxy) that ignores it cannot widen the target set.
    """

    @classmethod
    def connect(cls, api: ApiClient, **settings: Any) -> KubernetesPodTargets:
        """Pod targets through an API client (`controlplane.kube.api_client`)."""
        from kubernetes.client import CoreV1Api

        return cls(CoreV1Api(api), **settings)

    def __init__(
        self,
        api: CoreV1Api,
        *,
        namespace: str,
        selector: str,
        pool_label: str = DEFAULT_POOL_LABEL,
        role_label: str | None = None,
        port: int | str = "metrics",
        path: str = "/metrics",
        source: str = "vllm",
        pool_roles: Mapping[str, Role] | None = None,
        max_stale_failures: int = 3,
        timeout_s: float = 10.0,
        page_size: int = 500,
        reuse_s: float = 0.0,
    ) -> None:
        if not namespace:
            raise ValueError("namespace must not be empty")
        if not path.startswith("/"):
            raise ValueError(f"path {path!r} must start with '/'")
        if max_stale_failures < 0 or timeout_s <= 0 or page_size < 1:
            raise ValueError("max_stale_failures must be >= 0, timeout_s > 0 and page_size >= 1")
        self._api = api
        self.namespace = namespace
        self.selector = LabelSelector.parse(selector)
        self._selector_text = str(self.selector)
        self._port = _normalize_port(port)
        self._pool_label = pool_label
        self._role_label = role_label
        self._path = path
        self._source = source
        self._pool_roles = dict(pool_roles) if pool_roles is not None else None
        self.max_stale_failures = max_stale_failures
        # The client treats a bare float as "no timeout" (it only accepts an int or a pair).
        self._timeout = (timeout_s, timeout_s)
        self._page_size = page_size
        self._last: list[Target] | None = None
        self._reported: dict[str, str] = {}
        self.consecutive_failures = 0
        # Callers within one tick (the scraper, a dry-run actuator) share one listing.
        self._reuse_s = reuse_s
        self._listed_at = -math.inf

    @property
    def stale(self) -> bool:
        """Whether the last answer was the previous good list, served because the API failed."""
        return self.consecutive_failures > 0 and self._last is not None

    async def targets(self) -> list[Target]:
        """The current targets; the last good list while the API fails (up to the limit), then DiscoveryError."""
        if self._last is not None and not self.consecutive_failures and time.monotonic() - self._listed_at < self._reuse_s:
            return list(self._last)
        try:
            pods = await asyncio.to_thread(self._list_pods)
        except DiscoveryError as exc:
            return self._on_failure(exc)
        targets, skipped = targets_from_pods(
            pods, pool_label=self._pool_label, role_label=self._role_label, port=self._port, path=self._path,
            source=self._source, pool_roles=self._pool_roles, selector=self.selector,
        )
        self._report(skipped)
        if self.consecutive_failures:
            log.info("pod discovery recovered after %d failure(s): %d target(s)", self.consecutive_failures, len(targets))
        self._log_changes(targets)
        self.consecutive_failures = 0
        self._last = targets
        self._listed_at = time.monotonic()
        return list(targets)

    def _on_failure(self, exc: DiscoveryError) -> list[Target]:
        self.consecutive_failures += 1
        if self._last is None or self.consecutive_failures > self.max_stale_failures:
            raise exc
        log.warning(
            "pod discovery failed (%d of %d tolerated): %s; serving the last %d target(s)",
            self.consecutive_failures, self.max_stale_failures, exc, len(self._last),
        )
        return list(self._last)

    def _report(self, skipped: Sequence[SkippedPod]) -> None:
        # Once per pod while it stays skipped; forgetting the others keeps this bounded under churn.
        current = {s.pod: s.reason for s in skipped}
        for pod, reason in current.items():
            if self._reported.get(pod) != reason:
                log.warning("pod %s/%s is not scraped: %s", self.namespace, pod, reason)
        self._reported = current

    def _log_changes(self, targets: Sequence[Target]) -> None:
        after = {t.key for t in targets}
        if self._last is None:
            log.info("pod discovery: %d target(s) in namespace %s", len(after), self.namespace)
            return
        before = {t.key for t in self._last}
        if before != after:
            log.info("pod discovery: %d target(s); added %s; removed %s", len(after),
                     _few(after - before), _few(before - after))

    def _list_pods(self) -> list[dict[str, Any]]:
        """All pages of the pod list as plain JSON (runs in a worker thread); errors become DiscoveryError."""
        try:
            return self._pages()
        except ApiException as exc:
            body = _shorten(_api_message(exc.body))
            raise DiscoveryError(
                f"listing pods in namespace {self.namespace!r} failed: HTTP {exc.status} {exc.reason or ''}".rstrip()
                + (f": {body}" if body else ""),
                status=exc.status, reason=exc.reason, body=body,
            ) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise DiscoveryError(
                f"listing pods in namespace {self.namespace!r} failed: {type(exc).__name__}: {_shorten(exc)}",
                reason=type(exc).__name__,
            ) from exc
        except ValueError as exc:  # not JSON, or not a list
            raise DiscoveryError(
                f"listing pods in namespace {self.namespace!r} returned an unreadable answer: {_shorten(exc)}",
                reason="unreadable",
            ) from exc

    def _pages(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token: str | None = None
        restarted = False
        while True:
            try:
                page = self._page(token)
            except ApiException as exc:
                # An expired continue token: the API says to start the list again, once is enough.
                if exc.status == 410 and token is not None and not restarted:
                    items, token, restarted = [], None, True
                    continue
                raise
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue") or None
            if token is None:
                return items

    def _page(self, token: str | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"_continue": token} if token else {}
        # Raw JSON, not V1Pod models: deserializing models costs far more CPU than the list itself.
        resp = self._api.list_namespaced_pod(
            self.namespace, label_selector=self._selector_text, limit=self._page_size,
            _preload_content=False, _request_timeout=self._timeout, **kwargs,
        )
        try:
            page = json.loads(resp.data)
        finally:
            resp.release_conn()
        if not isinstance(page, dict) or not isinstance(page.get("items", []), list):
            raise ValueError(f"expected a PodList, got {_shorten(page, 100)}")
        return page
