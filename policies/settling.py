"""Pools that do not settle: fewer engines ready than their workload asks for, for longer than a
scale-up or a rollout takes.

A pool short of ready engines is settling, and the rails hold its actions until it has settled. When
the missing engines never come (no free GPU to schedule them, an image that does not pull, a crash
loop), waiting for it would hold the pool's size for good: the autoscaler could not even take back
the engines it asked for. The loop marks such a pool stalled once it has been short for
`rails.settle_timeout`, or three times its measured start-up if longer, with no new template rolled
out and no four scrapes in a row with every engine ready meanwhile (`stalled_since`, from the replica
counts it records each tick: an engine that flaps Ready does not restart the count); the rails then
let a scale-down through that gives up only engines it waits for, and `PoolStalled` keeps a finding
open meanwhile, so a person sees why.
"""

from __future__ import annotations

from catalog.settings import SwitchSettings
from policies.autoscale import DESIRED, READY, ROLLING
from policies.common import removed_pools
from policies.types import FindingKey, FindingReport, PolicyInput, PolicyResult, Severity
from policies.windows import SignalWindows

__all__ = ["KIND", "PoolStalled", "PoolStalledSettings", "stalled_since"]

KIND = "pool_stalled"


def stalled_since(windows: SignalWindows, pool: str, now: float, desired: int, ready: int, gap: float) -> float | None:
    """Since when the pool has been short of ready engines, from its recorded counts up to `desired` and `ready` now;
    None where it has not been short since it last had what it asks for for `gap` seconds. Readiness held for less
    than `gap` (an engine that flaps Ready) does not end the run, so a crash-looping engine cannot keep its pool
    from counting as stalled. A tick that rolled out a new template ends it (its engines restarted), and so do
    counts more than `gap` apart (the workload unreadable, the control plane down): what happened between them is
    not known."""
    subject = f"pool/{pool}"
    asked = dict(windows.series(subject, DESIRED))
    rolling = dict(windows.series(subject, ROLLING))
    points = [(now, ready < desired)] + [(ts, got < asked[ts]) for ts, got in reversed(windows.series(subject, READY))
                                         if ts < now and ts in asked]
    since: float | None = None
    newer = now  # the tick after the one looked at
    full_until = now  # where the stretch of full readiness being crossed ends
    for ts, short in points:
        if rolling.get(ts) or newer - ts > gap:
            break
        if short:
            since, full_until = ts, ts
        elif full_until - ts >= gap:
            break  # it had what it asked for long enough to have settled
        newer = ts
    return since


class PoolStalledSettings(SwitchSettings):
    """`policies.pool_stalled` in the fleet file; when a pool counts as stalled is `rails.settle_timeout`."""


class PoolStalled:
    """A finding per pool short of ready engines for longer than `rails.settle_timeout`, open while it is."""

    kind = KIND
    reads: tuple[str, ...] = (DESIRED, READY)

    def __init__(self, settings: PoolStalledSettings | None = None) -> None:
        self.settings = settings or PoolStalledSettings()

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        result = PolicyResult()
        for name, pool in sorted(inp.pools.items()):
            key = FindingKey(KIND, f"pool/{name}")
            if pool.stalled_for is not None:
                minutes = pool.stalled_for / 60
                result.findings.append(FindingReport(
                    key, Severity.WARNING,
                    f"{name}: short of ready engines for {minutes:.0f} min ({pool.ready} of {pool.desired} ready now)",
                    f"the missing engines have not come up in {minutes:.0f} min (no free GPU to schedule them, an image "
                    "that does not pull, a crash loop): only a scale-down acts on the pool meanwhile",
                    {"desired": pool.desired, "ready": pool.ready, "stalled_for_s": round(pool.stalled_for)},
                    KIND))
            elif key in inp.open_findings and pool.ready >= pool.desired:
                # Short but not judged stalled this tick (unreadable, rolling out, a gap): it stays open, not flapping.
                result.resolved.append((key, "every engine it asks for is ready"))
        result.resolved += removed_pools(inp, KIND)
        return result
