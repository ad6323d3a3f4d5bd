"""Dynamo's SLA planner, driven one tick at a time over stdin/stdout; runs in the Dynamo virtual environment.

The benchmark (`bench/dynamo_shootout.py`) starts this with the Dynamo environment's Python and talks JSON,
one object per line, so Dynamo's pinned dependencies never meet the product's. Requests:

- `{"op": "start", "config": {...}, "capabilities": {"prefill": {...} | null, "decode": {...}},
  "benchmark": {"prefill": [fpm, ...], "decode": [fpm, ...], "mixed": [fpm, ...]}}`: builds the planner through Dynamo's own
  offline replay adapter, installs the benchmark forward-pass metrics as its replay does, and answers
  `{"first_tick_s": t}`;
- `{"op": "tick", "result": {...}}`: one planner tick on the snapshot the adapter reads (the keys of
  `ReplayPlannerAdapter.on_tick`); answers `{"target_prefill", "target_decode", "next_tick_s"}`;
- `{"op": "close"}`.

A failure answers `{"error": "..."}` and the worker carries on; only `close` or the end of input stops it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

# The planner and its plugins log and print freely; the protocol keeps the real stdout to itself.
_PROTOCOL = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
sys.stdout = sys.stderr
logging.basicConfig(level=os.environ.get("DYNAMO_PLANNER_LOG", "WARNING"), stream=sys.stderr)
# Replay runs the planner on a virtual clock, which Dynamo allows only in its test mode.
os.environ.setdefault("DYNAMO_PLANNER_TEST", "1")

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics  # noqa: E402
from dynamo.planner.config.planner_config import PlannerConfig  # noqa: E402
from dynamo.planner.core.types import EngineCapabilities, WorkerCapabilities  # noqa: E402
from dynamo.planner.offline.replay_adapter import ReplayPlannerAdapter, create_replay_planner_adapter  # noqa: E402


def _fpm(d: dict[str, Any]) -> ForwardPassMetrics:
    return ForwardPassMetrics(wall_time=float(d["wall_time"]), scheduled_requests=ScheduledRequestMetrics(
        num_prefill_requests=int(d.get("num_prefill_requests", 0)),
        sum_prefill_tokens=int(d.get("sum_prefill_tokens", 0)),
        num_decode_requests=int(d.get("num_decode_requests", 0)),
        sum_decode_kv_tokens=int(d.get("sum_decode_kv_tokens", 0))))


def _caps(d: dict[str, Any] | None) -> EngineCapabilities | None:
    return None if d is None else EngineCapabilities(**d)


def start(msg: dict[str, Any]) -> tuple[ReplayPlannerAdapter, dict[str, Any]]:
    """Build the planner as Dynamo's offline replay does, with the benchmark's forward-pass metrics installed."""
    config = PlannerConfig(**msg["config"])
    caps = msg.get("capabilities") or {}
    adapter = create_replay_planner_adapter(
        config, WorkerCapabilities(prefill=_caps(caps.get("prefill")), decode=_caps(caps.get("decode"))),
        capture_details=False)
    bench = msg.get("benchmark") or {}
    prefill = [_fpm(d) for d in bench.get("prefill", [])]
    decode = [_fpm(d) for d in bench.get("decode", [])]
    mixed = [_fpm(d) for d in bench.get("mixed", [])]
    if config.optimization_target == "sla" and (prefill or decode):
        if config.mode == "agg":
            adapter.install_benchmark_fpms(agg_fpms=prefill + decode + mixed)
        else:
            adapter.install_benchmark_fpms(prefill_fpms=prefill, decode_fpms=decode)
    adapter.start()
    return adapter, {"first_tick_s": adapter.initial_tick_ms() / 1000.0}


def tick(adapter: ReplayPlannerAdapter, msg: dict[str, Any]) -> dict[str, Any]:
    """One planner tick; targets are absolute, None where unchanged."""
    out = adapter.on_tick(msg["result"])
    next_ms = out.get("next_tick_ms")
    return {"target_prefill": out.get("target_prefill"), "target_decode": out.get("target_decode"),
            "next_tick_s": None if next_ms is None else next_ms / 1000.0}


def capped(adapter: ReplayPlannerAdapter, msg: dict[str, Any]) -> dict[str, Any]:
    """The driver applied fewer engines than a target asked (every strategy's pools stop at one ceiling): the adapter
    waits for the count it applied, or it would wait for ever for one that never comes and decide nothing more."""
    for role in ("prefill", "decode"):
        if msg.get(role) is not None:
            name = f"_scaling_target_{role}"
            if not hasattr(adapter, name):  # another version of the adapter: say so, never set a name it ignores
                raise RuntimeError(f"this ai-dynamo's replay adapter keeps no {name}")
            setattr(adapter, name, int(msg[role]))
    return {}


def main() -> None:
    """Answer requests until `close` or the end of input."""
    adapter: ReplayPlannerAdapter | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "close":
                break
            if op == "start":
                adapter, reply = start(msg)
            elif op == "tick":
                if adapter is None:
                    raise RuntimeError("tick before start")
                reply = tick(adapter, msg)
            elif op == "capped":
                if adapter is None:
                    raise RuntimeError("capped before start")
                reply = capped(adapter, msg)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # the driver reports it with the tick that caused it
            logging.exception("planner request failed")
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _PROTOCOL.write(json.dumps(reply) + "\n")
    if adapter is not None:
        adapter.close()


if __name__ == "__main__":
    main()
