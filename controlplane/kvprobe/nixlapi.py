"""Loading the real NIXL Python API and the few conventions the probe's two sides share on top of it.

NIXL comes from the `nixl-cu12` wheel (installed by `scripts/ensure-nixl.sh` without torch). Its Python
logger writes to stdout at INFO; that would corrupt a `--json` report and the agent's ready line, so its
records are sent through the application's own logging instead.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

from controlplane.errors import FleetError

__all__ = ["ENSURE_HINT", "NixlUnavailable", "failure_reason", "load_nixl", "make_agent"]

ENSURE_HINT = "run scripts/ensure-nixl.sh (it installs numpy and `nixl nixl-cu12` with --no-deps, no torch)"
_CANDIDATES = ("nixl_cu12", "nixl_cu13")
_loaded: ModuleType | None = None


class NixlUnavailable(FleetError):
    """The NIXL library cannot be imported in this Python."""

    exit_code = 3


def load_nixl() -> ModuleType:
    """NIXL's `_api` module (`nixl_agent`, `nixl_agent_config`); NixlUnavailable when none imports."""
    global _loaded
    if _loaded is not None:
        return _loaded
    errors: list[str] = []
    # NIXL switches logging's global error reporting off at import; keep the application's setting.
    raise_exceptions = logging.raiseExceptions
    try:
        for name in _CANDIDATES:
            try:
                api = importlib.import_module(f"{name}._api")
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
                continue
            _quiet_logger()
            _loaded = api
            return api
    finally:
        logging.raiseExceptions = raise_exceptions
    raise NixlUnavailable(f"NIXL is not importable ({'; '.join(errors)}); {ENSURE_HINT}")


def _quiet_logger() -> None:
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def make_agent(name: str, *, telemetry: bool) -> Any:
    """A NIXL agent with the UCX backend and no progress thread.

    NIXL's progress thread polls with no delay and takes a whole core; on a small node that starves the
    engine it measures. The initiator drives progress by polling its transfers and the target by polling
    for notifications, as an engine's step loop does.
    """
    api = load_nixl()
    config = api.nixl_agent_config(enable_prog_thread=False, capture_telemetry=telemetry, backends=["UCX"])
    agent = api.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise NixlUnavailable(f"NIXL agent {name!r} has no UCX backend (plugins: {agent.get_plugin_list()})")
    return agent


def failure_reason(exc: BaseException) -> str:
    """The probe's failure reason for an exception NIXL raised on a transfer."""
    if type(exc).__name__ == "nixlRemoteDisconnectError":
        return "peer_unreachable"
    return "error"
