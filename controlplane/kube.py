"""The Kubernetes API client: credentials and connection, shared by discovery and the actuators.

Owns loading a kubeconfig file or the in-cluster service account into a client of its own (never
the global default), with client-side retries off: the loop retries on its next tick, and the
client's own retries would only multiply a timeout; and what both read of an object the same way
(a field of a JSON body or of a client model, whether a pod is ready).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from controlplane.errors import ConfigError

__all__ = ["api_client", "api_message", "dig", "field", "int_or_percent", "pod_ready"]


def api_client(kubeconfig: str | None, section: str) -> kclient.ApiClient:
    """A client from `kubeconfig`, or the in-cluster service account when None; ConfigError names `section`."""
    cfg = kclient.Configuration()
    try:
        if kubeconfig:
            kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            kconfig.load_incluster_config(client_configuration=cfg)
    except (kconfig.ConfigException, OSError) as exc:
        where = kubeconfig or "the in-cluster service account"
        raise ConfigError(section, [f"cannot load Kubernetes credentials from {where}: {exc}"]) from None
    cfg.retries = 0
    return kclient.ApiClient(cfg)


def api_message(exc: ApiException) -> str:
    """An API error as one line: its status and the API server's own message."""
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return f"HTTP {exc.status} {exc.reason or ''}".rstrip() + (f": {message}" if message else "")


def dig(obj: Any, path: Sequence[str], default: Any = None) -> Any:
    """The value at `path` (keys) in a JSON body; `default` where a key on the way is missing."""
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return default
        obj = obj[key]
    return obj


def field(obj: Any, name: str) -> Any:
    """`name` (the API's camelCase) of a JSON dict or of a kubernetes client model; None where it has none."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    attribute_map: Mapping[str, str] = getattr(obj, "attribute_map", {})
    for attr, json_name in attribute_map.items():
        if json_name == name:
            return getattr(obj, attr)
    return None


def pod_ready(pod: Any) -> bool:
    """Whether a pod (a JSON dict or a client model) is running, not being deleted, with its Ready condition true."""
    status = field(pod, "status")
    if field(status, "phase") != "Running" or field(field(pod, "metadata"), "deletionTimestamp"):
        return False
    return any(field(c, "type") == "Ready" and field(c, "status") == "True" for c in field(status, "conditions") or [])


def int_or_percent(value: Any, total: int, *, round_up: bool) -> int:
    """An int-or-percent field of a rolling update (maxSurge, maxUnavailable) as a number of pods. A string is a
    percentage with or without its `%`, as Argo Rollouts' (deprecated) parser reads it, its own defaults being
    written "25"; the Deployment API accepts no string without one."""
    if isinstance(value, str):
        share = float(value.removesuffix("%")) * total / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value)
