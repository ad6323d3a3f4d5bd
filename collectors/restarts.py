"""Telling a scraped process that restarted from its own exposition.

Every prometheus_client process exports when it started (vLLM's API server included), so a new value
under the same pod is a new process: a crash, an OOM kill, a container restarted in place.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

from collectors.types import Sample

__all__ = ["PROCESS_START", "ProcessStarts", "process_start"]

PROCESS_START = "process_start_time_seconds"


def process_start(samples: Iterable[Sample]) -> float | None:
    """When the scraped process started (seconds since the epoch), or None where it does not say."""
    return next((s.value for s in samples if s.name == PROCESS_START and math.isfinite(s.value)), None)


class ProcessStarts:
    """Each target's process start as last read, kept while the target is not read (a crash-looping pod is out of
    its Service's routing, and of discovery, between its restarts), for `kept_s` at most."""

    def __init__(self, kept_s: float = math.inf) -> None:
        self.kept_s = kept_s
        self._read: dict[Hashable, tuple[float, float]] = {}  # target -> (its process start, when read)

    def restarted(self, target: Hashable, started: float, ts: float) -> bool:
        """Note `target`'s process start as read at `ts`; whether it is a later process than the one read before."""
        before = self._read.get(target)
        self._read[target] = (started, ts)
        # The exposition rounds the start to about ten milliseconds: a whole second apart is another process.
        return before is not None and ts - before[1] <= self.kept_s and started > before[0] + 1.0

    def __len__(self) -> int:
        return len(self._read)

    def forget(self, now: float | None = None) -> None:
        """Forget the starts read more than `kept_s` before `now`, or all of them."""
        self._read = {} if now is None else {k: v for k, v in self._read.items() if now - v[1] <= self.kept_s}
