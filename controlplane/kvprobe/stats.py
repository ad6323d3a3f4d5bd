"""Pure arithmetic of the KV-path probe: transfer records, percentiles, throughput, block-size parsing and the
per-block-size summary. No clock and no I/O: every time is an argument.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "REASONS",
    "TransferRecord",
    "bandwidth",
    "parse_block_size",
    "percentile",
    "summarize",
    "throughput",
]

# Why a probe slot failed. `metadata_exchange_failed` is the startup single point of failure (no usable
# metadata from the decode side); `peer_unreachable` a peer that was reachable once and is gone.
REASONS: tuple[str, ...] = ("timeout", "error", "metadata_exchange_failed", "peer_unreachable")
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1024**3, "gib": 1024**3}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One probe slot: a WRITE of one block to one peer, or the reason it could not happen.

    Times are seconds; `started_at` (the slot began) and `posted_at` (the WRITE was posted) are on the monotonic
    clock. `post_s` and `xfer_s` come from NIXL's per-transfer telemetry; `wall_s` is the wall clock from posting
    to seeing DONE, polling included. A slot that failed before posting has no `posted_at`.
    """

    dst: str
    block_bytes: int
    started_at: float
    ok: bool
    reason: str | None = None
    posted_at: float | None = None
    post_s: float | None = None
    xfer_s: float | None = None
    wall_s: float | None = None
    bytes: int = 0
    detail: str = ""


def parse_block_size(text: str) -> int:
    """`262144`, `256KiB`, `1MiB`, `4m` -> bytes (binary units); ValueError on anything else or on zero."""
    m = _SIZE.match(text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"not a block size: {text!r} (use bytes or a KiB/MiB/GiB suffix)")
    size = int(m.group(1)) * _UNITS[m.group(2)]
    if size <= 0:
        raise ValueError(f"block size must be positive: {text!r}")
    return size


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between closest ranks; None without values."""
    if not values:
        return None
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile out of range: {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def throughput(total_bytes: float, start: float, end: float) -> float | None:
    """Bytes per second moved between `start` and `end`; None for an empty interval."""
    if end <= start:
        return None
    return total_bytes / (end - start)


def bandwidth(records: Iterable[TransferRecord]) -> float | None:
    """Bytes per second while transfers were in flight: bytes over summed NIXL transfer times."""
    moved = 0
    busy = 0.0
    for r in records:
        if r.ok and r.xfer_s is not None:
            moved += r.bytes
            busy += r.xfer_s
    return moved / busy if busy > 0 else None


def _distribution(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {label: percentile(values, q) for label, q in QUANTILES}
    out["max"] = max(values) if values else None
    out["mean"] = sum(values) / len(values) if values else None
    return out


def _failures(records: Sequence[TransferRecord]) -> dict[str, int]:
    counts = dict.fromkeys(REASONS, 0)
    for r in records:
        if not r.ok:
            key = r.reason or "error"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _block(block_bytes: int, records: Sequence[TransferRecord], start: float, end: float) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    moved = sum(r.bytes for r in done)
    return {
        "block_bytes": block_bytes,
        "transfers": len(records),
        "succeeded": len(done),
        "failures": len(records) - len(done),
        "failures_by_reason": _failures(records),
        "transfer_seconds": _distribution([r.xfer_s for r in done if r.xfer_s is not None]),
        "wall_seconds": _distribution([r.wall_s for r in done if r.wall_s is not None]),
        "post_seconds": _distribution([r.post_s for r in done if r.post_s is not None]),
        "bytes": moved,
        "throughput_bytes_per_s": throughput(moved, start, end),
        "bandwidth_bytes_per_s": bandwidth(done),
    }


def summarize(records: Sequence[TransferRecord], block_sizes: Sequence[int], start: float, end: float) -> dict[str, Any]:
    """Per-block-size percentiles of transfer, wall and post time, throughput and counts, plus totals.

    `start` and `end` bound the run (seconds on the clock the records use); throughput is bytes over that span.
    """
    sizes = list(dict.fromkeys([*block_sizes, *(r.block_bytes for r in records)]))
    per_block = [_block(size, [r for r in records if r.block_bytes == size], start, end) for size in sizes]
    done = [r for r in records if r.ok]
    moved = sum(r.bytes for r in done)
    return {
        "duration_s": max(0.0, end - start),
        "transfers": len(records),
        "succeeded": len(done),
        "failures": len(records) - len(done),
        "failures_by_reason": _failures(records),
        "bytes": moved,
        "throughput_bytes_per_s": throughput(moved, start, end),
        "bandwidth_bytes_per_s": bandwidth(done),
        "per_block": per_block,
    }
