"""The synthetic KV-data-path probe's `/metrics` (`fleet_kvprobe_*`, served by `controlplane.kvprobe`) mapped to
per-path readings and signals.

An entity is one probed path, `<src>-><dst>` (a prefill-side agent writing into a decode-side agent's buffers).
Transfer times are split by the `block_bytes` label, so each block size gets its own quantiles besides the
overall ones; failures are split by `reason` (timeout, error, metadata_exchange_failed, peer_unreachable).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from collectors.derive import Histogram, histogram_quantile, ratio
from collectors.families import Delta, FamilyMap, FamilySource, Reading, SignalList, read
from collectors.types import Sample, Signal, Target

__all__ = ["FAMILIES", "REASONS", "SOURCE", "path_entity", "read_paths", "signals", "size_label"]

REASONS: tuple[str, ...] = ("timeout", "error", "metadata_exchange_failed", "peer_unreachable")

FAMILIES = FamilyMap(
    counters={
        "transfers": ("fleet_kvprobe_transfers_total",),
        "failures": ("fleet_kvprobe_failures_total",),
        "bytes": ("fleet_kvprobe_bytes_total",),
    },
    gauges={
        "up": ("fleet_kvprobe_up",),
    },
    histograms={
        "transfer": ("fleet_kvprobe_transfer_seconds",),
        "post": ("fleet_kvprobe_post_seconds",),
        "wall": ("fleet_kvprobe_transfer_wall_seconds",),
    },
    split_by={"transfer": "block_bytes", "failures": "reason"},
    expected=("fleet_kvprobe_transfers_total", "fleet_kvprobe_failures_total", "fleet_kvprobe_transfer_seconds",
              "fleet_kvprobe_up"),
)
_KIB = 1024
_MIB = 1024 * 1024


def size_label(block_bytes: int) -> str:
    """A block size as it appears in signal names: `256kib`, `1mib`, `4mib`, else plain bytes (`1000b`)."""
    if block_bytes >= _MIB and block_bytes % _MIB == 0:
        return f"{block_bytes // _MIB}mib"
    if block_bytes >= _KIB and block_bytes % _KIB == 0:
        return f"{block_bytes // _KIB}kib"
    return f"{block_bytes}b"


def path_entity(labels: Mapping[str, str]) -> str | None:
    """`<src>-><dst>`; samples without both labels belong to no path."""
    src, dst = labels.get("src"), labels.get("dst")
    if src is None or dst is None:
        return None
    return f"{src}->{dst}"


def read_paths(samples: Iterable[Sample]) -> dict[str, Reading]:
    """A probe's samples as readings per path."""
    return read(samples, FAMILIES, path_entity)


def _quantiles(hist: Histogram) -> tuple[float, float]:
    return histogram_quantile(0.5, hist.buckets), histogram_quantile(0.99, hist.buckets)


def signals(d: Delta, ts: float, subject: str) -> list[Signal]:
    """Turn one path's delta into named signals for `subject` at time `ts`."""
    out = SignalList(ts, subject)
    emit = out.emit

    inc = d.increases
    per_s = 1.0 / d.seconds
    transfers = inc.get("transfers")
    if transfers is not None:
        emit("kv_transfer_rate", transfers * per_s)
    if "bytes" in inc:
        emit("kv_throughput_bytes_per_s", inc["bytes"] * per_s)
    failures = {k.split(":", 1)[1]: v for k, v in inc.items() if k.startswith("failures:")}
    if failures:
        total = sum(failures.values())
        emit("kv_failure_rate", total * per_s)
        emit("kv_failure_ratio", ratio(total, transfers))
        for reason, value in sorted(failures.items()):
            if reason:
                emit(f"kv_failure_{reason}_rate", value * per_s)

    merged: Histogram | None = None
    for key, hist in sorted(d.histograms.items()):
        if not key.startswith("transfer:"):
            continue
        merged = hist if merged is None else merged + hist
        if hist.count <= 0:
            continue
        try:
            label = size_label(int(key.split(":", 1)[1]))
        except ValueError:
            continue
        p50, p99 = _quantiles(hist)
        emit(f"kv_transfer_p50_seconds_{label}", p50)
        emit(f"kv_transfer_p99_seconds_{label}", p99)
    if merged is not None and merged.count > 0:
        p50, p99 = _quantiles(merged)
        emit("kv_transfer_p50", p50)
        emit("kv_transfer_p99", p99)
        emit("kv_transfer_mean", merged.sum / merged.count)
    post = d.histograms.get("post")
    if post is not None and post.count > 0:
        emit("kv_post_p99", histogram_quantile(0.99, post.buckets))
    wall = d.histograms.get("wall")
    if wall is not None and wall.count > 0:
        emit("kv_transfer_wall_p99", histogram_quantile(0.99, wall.buckets))

    up = d.gauges.get("up")
    if up:
        emit("kv_up", min(up))
    return out


def _subject(target: Target, entity: str) -> str:
    """`kvpath/<src>-><dst>`."""
    return f"kvpath/{entity}"


# The KV-path probe source: entities are probed paths; there is no pool aggregate.
SOURCE = FamilySource("kvprobe", FAMILIES, aggregate=False, read=read_paths, signals=signals, subject_of=_subject)
