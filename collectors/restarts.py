"""Telling a scraped process that restarted from its own exposition.

Every prometheus_client process exports when it started (vLLM's API server included), so a new value
under the same pod is a new process: a crash, an OOM kill, a container restarted in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from collectors.types import Sample

__all__ = ["PROCESS_START", "process_start", "restarted_since"]

PROCESS_START = "process_start_time_seconds"


def process_start(samples: Iterable[Sample]) -> float | None:
    """When the scraped process started (seconds since the epoch), or None where it does not say."""
    return next((s.value for s in samples if s.name == PROCESS_START and math.isfinite(s.value)), None)


def restarted_since(before: float | None, now: float) -> bool:
    """Whether a process start read as `now` is a later process than the one read as `before`."""
    # The exposition rounds the start to about ten milliseconds; a whole second apart is another process.
    return before is not None and now > before + 1.0
