"""Inputs fit to act on: a pool's targets down, expected series absent or stopped, gauges that stopped changing.

The loop gathers what the collection says about each pool's inputs into `PoolState.stale_inputs`
(keys: a signal name, or a producer such as `vllm` or `dcgm` when a whole target is down), adding
`frozen_inputs` from this module; the rails hold back every action resting on a stale input, and
`StaleInputs` keeps a finding open per pool meanwhile, so a person sees why nothing acts. Acting on
a wrong number is worse than not acting: llm-d's autoscaler once held scale-down shut for hours on
an in-flight series that no longer changed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from catalog.settings import SwitchSettings
from catalog.signals import lookup
from policies.common import removed_pools
from policies.types import FindingKey, FindingReport, PolicyInput, PolicyResult, Severity
from policies.windows import SignalWindows

__all__ = ["FROZEN_WATCH", "KIND", "VANISH_WATCH", "StaleInputs", "StaleInputsSettings", "frozen_inputs",
           "stale_among", "vanished_inputs"]

KIND = "stale_inputs"
# Gauges that move while an engine serves: one held at the same non-zero value for long is a
# broken exporter or a stuck engine, not a steady fleet.
FROZEN_WATCH = ("requests_running", "requests_waiting", "kv_cache_usage")
# Pool signals a serving pool has at every scrape, idle or not (a latency quantile has none while nothing
# finishes): one that stops has lost its series (the engines' targets gone from discovery, a Prometheus
# relabelling that no longer matches), and its last value would be read as now's.
VANISH_WATCH = ("requests_running", "requests_waiting", "kv_cache_usage", "request_rate")


def stale_among(inputs: Collection[str], stale: Mapping[str, str]) -> dict[str, str]:
    """The entries of `stale` that `inputs` rest on: the signal itself, or a producer of it."""
    out = {}
    for name in inputs:
        spec = lookup(name)
        for key in (name, *(str(p) for p in (spec.producers if spec else ()))):
            if key in stale:
                out[key] = stale[key]
    return out


def frozen_inputs(windows: SignalWindows, now: float, after: float) -> dict[str, dict[str, str]]:
    """Per pool, the watched gauges of its engines that held one non-zero value for `after` seconds
    up to a recent point, with why. One pass over the engines for every pool."""
    out: dict[str, dict[str, str]] = {}
    if after <= 0:
        return out
    for name in FROZEN_WATCH:
        for subject in sorted(windows.subjects(name, prefix="engine/")):
            pool = subject.split("/")[1]
            if name in out.get(pool, {}):
                continue
            run = windows.unchanged(subject, name)
            # 0.8: the run's first and last scrapes fall inside the span, not on its edges.
            if run is None or run[0] == 0 or run[2] < 3 or run[1] < 0.8 * after:
                continue
            if name == "requests_running" and (windows.latest(subject, "requests_waiting") or 0.0) > 0:
                # A full batch with a queue behind it: each request that finishes is replaced at once, and the count
                # holds at max_num_seqs for as long as the engine is saturated, which is when capacity is needed.
                continue
            newest = windows.latest_ts(subject, name)
            if newest is not None and newest >= now - after:
                out.setdefault(pool, {})[name] = f"{name} of {subject} has been {run[0]:g} for {run[1] / 60:.0f} min"
    return out


def vanished_inputs(windows: SignalWindows, pools: list[str], now: float, after: float,
                    seen: Mapping[tuple[str, str], float] | None = None) -> dict[str, dict[str, str]]:
    """Per pool, the watched pool signals it had but has had no value of for `after` seconds, with why. `seen`:
    when each (pool, signal) last had a value, for those stopped so long ago that the windows no longer hold them."""
    out: dict[str, dict[str, str]] = {}
    for pool in pools:
        for name in VANISH_WATCH:
            newest = windows.latest_ts(f"pool/{pool}", name)
            if newest is None and seen is not None:
                newest = seen.get((pool, name))
            if newest is not None and newest < now - after:
                out.setdefault(pool, {})[name] = f"no value of {name} for {now - newest:.0f}s: its series stopped"
    return out


STOPPED_AFTER = 2.5  # scrape intervals without a value before a series counts as stopped: one late scrape is noise


def stopped_or_frozen(windows: SignalWindows, pools: list[str], now: float, interval: float, frozen_after: float,
                      seen: Mapping[tuple[str, str], float] | None = None) -> dict[str, dict[str, str]]:
    """Per pool, with why: the watched series of `pools` that stopped (`vanished_inputs`) and every pool's frozen
    gauges (`frozen_inputs`); what the loop and `fleetctl autoscale plan` alike hold back as stale."""
    out = vanished_inputs(windows, pools, now, STOPPED_AFTER * interval, seen)
    for pool, frozen in frozen_inputs(windows, now, frozen_after).items():
        out.setdefault(pool, {}).update(frozen)
    return out


class StaleInputsSettings(SwitchSettings):
    """`policies.stale_inputs` in the fleet file; when it counts as frozen is `rails.frozen_after`."""


class StaleInputs:
    """A finding per pool whose inputs are stale, open while they are."""

    kind = KIND
    reads: tuple[str, ...] = FROZEN_WATCH

    def __init__(self, settings: StaleInputsSettings | None = None) -> None:
        self.settings = settings or StaleInputsSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        result = PolicyResult()
        for name, pool in sorted(inp.pools.items()):
            key = FindingKey(KIND, f"pool/{name}")
            if pool.stale_inputs:
                reasons = "; ".join(f"{k}: {v}" for k, v in sorted(pool.stale_inputs.items()))
                result.findings.append(FindingReport(
                    key, Severity.WARNING, f"{name}: inputs stale, actions resting on them are held",
                    reasons, {"inputs": dict(pool.stale_inputs)}, KIND))
            elif key in inp.open_findings:
                result.resolved.append((key, "its inputs are fresh again"))
        result.resolved += removed_pools(inp, KIND)
        return result
