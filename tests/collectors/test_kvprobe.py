"""KV-path probe mapping: paths as entities, per-block-size quantiles, failures by reason, the pipeline."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from collectors import families, kvprobe, sources
from collectors.exposition import parse
from collectors.pipeline import SignalDeriver
from collectors.types import ScrapeResult, Target

KIB = 1024
MIB = 1024 * KIB
BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.1, 1.0)
PAIR = 'src="prefill-0",dst="decode-0"'


@dataclass(frozen=True)
class Path:
    """Cumulative state of one probed path: observations (seconds) per block size, failures by reason."""

    xfer: Mapping[int, tuple[float, ...]] = field(default_factory=dict)
    post: Mapping[int, tuple[float, ...]] = field(default_factory=dict)
    failures: Mapping[str, int] = field(default_factory=dict)
    up: float = 1.0


def _histogram(name: str, labels: str, obs: tuple[float, ...]) -> list[str]:
    lines = [f'{name}_bucket{{{labels},le="{le}"}} {sum(1 for o in obs if o <= le)}' for le in BOUNDS]
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {len(obs)}')
    lines.append(f"{name}_sum{{{labels}}} {sum(obs)}")
    lines.append(f"{name}_count{{{labels}}} {len(obs)}")
    return lines


def exposition(p: Path, pair: str = PAIR) -> str:
    """The path as `prometheus_client` lays it out (failed slots count as transfers)."""
    sizes = sorted(set(p.xfer) | {256 * KIB})
    out = ["# TYPE fleet_kvprobe_transfers_total counter"]
    fails = sum(p.failures.values())
    for i, size in enumerate(sizes):
        extra = fails if i == 0 else 0  # every failure is attributed to the first block size's slots
        out.append(f'fleet_kvprobe_transfers_total{{{pair},block_bytes="{size}"}} {len(p.xfer.get(size, ())) + extra}')
        out.append(f'fleet_kvprobe_transfers_created{{{pair},block_bytes="{size}"}} 1.7e9')
        out.append(f'fleet_kvprobe_bytes_total{{{pair},block_bytes="{size}"}} {len(p.xfer.get(size, ())) * size}')
        for reason in kvprobe.REASONS:
            value = p.failures.get(reason, 0) if i == 0 else 0
            out.append(f'fleet_kvprobe_failures_total{{{pair},block_bytes="{size}",reason="{reason}"}} {value}')
    out.append("# TYPE fleet_kvprobe_transfer_seconds histogram")
    for size in sizes:
        out += _histogram("fleet_kvprobe_transfer_seconds", f'{pair},block_bytes="{size}"', p.xfer.get(size, ()))
        out += _histogram("fleet_kvprobe_post_seconds", f'{pair},block_bytes="{size}"', p.post.get(size, ()))
        out += _histogram("fleet_kvprobe_transfer_wall_seconds", f'{pair},block_bytes="{size}"', p.xfer.get(size, ()))
    out.append(f"fleet_kvprobe_up{{{pair}}} {p.up}")
    return "\n".join(out) + "\n"


def read(text: str) -> dict[str, families.Reading]:
    return kvprobe.SOURCE.read(parse(text))


def signal_map(prev: Path, cur: Path, seconds: float = 10.0) -> dict[str, float]:
    d = families.delta(read(exposition(prev))["prefill-0->decode-0"], read(exposition(cur))["prefill-0->decode-0"],
                       seconds)
    assert d is not None
    return {s.name: s.value for s in kvprobe.signals(d, 100.0, "kvpath/prefill-0->decode-0")}


# Ten seconds: ten 256 KiB writes of 0.8 ms, ten 1 MiB writes of 3 ms (one of 50 ms), two timeouts.
PREV = Path(xfer={256 * KIB: (0.0008,) * 5, MIB: (0.003,) * 5}, post={256 * KIB: (0.0003,) * 5, MIB: (0.0003,) * 5})
CUR = dataclasses.replace(
    PREV,
    xfer={256 * KIB: (0.0008,) * 15, MIB: (0.003,) * 14 + (0.05,)},
    post={256 * KIB: (0.0003,) * 15, MIB: (0.0003,) * 14 + (0.004,)},
    failures={"timeout": 2},
    up=0.0,
)


def test_size_labels() -> None:
    assert kvprobe.size_label(256 * KIB) == "256kib"
    assert kvprobe.size_label(MIB) == "1mib"
    assert kvprobe.size_label(4 * MIB) == "4mib"
    assert kvprobe.size_label(1536 * KIB) == "1536kib"
    assert kvprobe.size_label(1000) == "1000b"


def test_entities_are_paths_and_split_by_block_size() -> None:
    two = exposition(CUR) + exposition(PREV, pair='src="prefill-0",dst="decode-1"')
    readings = read(two)
    assert set(readings) == {"prefill-0->decode-0", "prefill-0->decode-1"}
    r = readings["prefill-0->decode-0"]
    assert set(r.histograms) == {f"transfer:{256 * KIB}", f"transfer:{MIB}", "post", "wall"}
    assert r.histograms["post"].count == 30  # post is not split: both sizes summed
    assert r.counters["transfers"] == 32 and r.counters["bytes"] == 15 * 256 * KIB + 15 * MIB
    assert r.counters["failures:timeout"] == 2 and r.counters["failures:error"] == 0
    assert r.gauges["up"] == 0.0
    assert families.missing_families(readings, kvprobe.FAMILIES) == []


def test_samples_without_a_pair_are_ignored() -> None:
    assert read('fleet_kvprobe_up{dst="decode-0"} 1\nfleet_kvprobe_transfers_total 3\n') == {}


def test_signals_per_block_size_overall_and_failures() -> None:
    sig = signal_map(PREV, CUR)
    # 256 KiB: ten observations in (0.0005, 0.001] -> p50 at rank 5 of 10 -> 0.0005 + 0.0005 * 0.5.
    assert sig["kv_transfer_p50_seconds_256kib"] == pytest.approx(0.00075)
    assert sig["kv_transfer_p99_seconds_256kib"] == pytest.approx(0.0005 + 0.0005 * 0.99)
    # 1 MiB: nine in (0.002, 0.005], one in (0.01, 0.1]; p99 rank 9.9 lies in the slow bucket.
    assert sig["kv_transfer_p50_seconds_1mib"] == pytest.approx(0.002 + 0.003 * 5 / 9)
    assert sig["kv_transfer_p99_seconds_1mib"] == pytest.approx(0.01 + 0.09 * 0.9)
    # Overall: twenty observations merged as `sum by (le)`.
    assert sig["kv_transfer_p50"] == pytest.approx(0.001)
    assert sig["kv_transfer_p99"] == pytest.approx(0.01 + 0.09 * 0.8)
    assert sig["kv_transfer_mean"] == pytest.approx((10 * 0.0008 + 9 * 0.003 + 0.05) / 20)
    assert sig["kv_post_p99"] == pytest.approx(0.002 + 0.003 * 0.8)
    assert sig["kv_throughput_bytes_per_s"] == pytest.approx((10 * 256 * KIB + 10 * MIB) / 10)
    assert sig["kv_transfer_rate"] == pytest.approx(22 / 10)
    assert sig["kv_failure_rate"] == pytest.approx(0.2)
    assert sig["kv_failure_ratio"] == pytest.approx(2 / 22)
    assert sig["kv_failure_timeout_rate"] == pytest.approx(0.2)
    assert sig["kv_failure_peer_unreachable_rate"] == 0
    assert sig["kv_failure_metadata_exchange_failed_rate"] == 0
    assert sig["kv_up"] == 0.0


def test_a_path_that_only_fails_has_rates_but_no_quantiles() -> None:
    dead = Path(failures={"metadata_exchange_failed": 3}, up=0.0)
    later = dataclasses.replace(dead, failures={"metadata_exchange_failed": 8})
    sig = signal_map(dead, later, seconds=5.0)
    assert sig["kv_failure_metadata_exchange_failed_rate"] == pytest.approx(1.0)
    assert sig["kv_failure_ratio"] == pytest.approx(1.0)
    assert sig["kv_throughput_bytes_per_s"] == 0
    assert not any(k.startswith(("kv_transfer_p", "kv_post")) for k in sig)


def test_restarted_probe_counts_as_a_reset() -> None:
    fresh = Path(xfer={256 * KIB: (0.0008,) * 3}, post={256 * KIB: (0.0003,) * 3})
    sig = signal_map(CUR, fresh)
    assert sig["kv_transfer_rate"] == pytest.approx(0.3)
    assert sig["kv_failure_rate"] == 0


def test_pipeline_subjects_are_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sources.SOURCES, "kvprobe", kvprobe.SOURCE)
    target = Target("http://127.0.0.1:9/metrics", "kvprobe", "prober-0", source="kvprobe")
    deriver = SignalDeriver()
    first = deriver.derive([ScrapeResult(target, 0.0, True, exposition(PREV))], 0.0)
    assert not [s for s in first.signals if s.subject.startswith("kvpath/")]
    out = deriver.derive([ScrapeResult(target, 10.0, True, exposition(CUR))], 10.0)
    names = {s.name for s in out.signals if s.subject == "kvpath/prefill-0->decode-0"}
    assert {"kv_transfer_p99", "kv_transfer_p99_seconds_1mib", "kv_failure_timeout_rate", "kv_up"} <= names
    assert out.missing_families == {}
