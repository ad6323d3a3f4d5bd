"""The Kubernetes API client: credentials and connection, shared by discovery and the actuators.

Owns loading a kubeconfig file or the in-cluster service account into a client of its own (never
the global default), with client-side retries off: the loop retries on its next tick, and the
client's own retries would only multiply a timeout.
"""

from __future__ import annotations

import json

from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from controlplane.errors import ConfigError

__all__ = ["api_client", "api_message"]


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
