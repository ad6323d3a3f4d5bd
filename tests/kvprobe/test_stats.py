"""Fast checks of the probe's pure parts: percentiles, throughput, summaries, block sizes, the metadata document,
and the exporter/collector contract (what `ProbeMetrics` exposes is what `collectors.kvprobe` reads)."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable

import pytest

from collectors import families, kvprobe
from collectors.exposition import parse
from controlplane.kvprobe.metadata import BufferDesc, MetadataDoc, MetadataExchangeError, MetadataServer, fetch_metadata
from controlplane.kvprobe.probe import BUCKETS, ProbeMetrics
from controlplane.kvprobe.stats import (
    REASONS,
    TransferRecord,
    bandwidth,
    parse_block_size,
    percentile,
    summarize,
    throughput,
)

KIB = 1024
MIB = 1024 * KIB


def ok(size: int, xfer: float, at: float = 0.0, dst: str = "decode-0") -> TransferRecord:
    return TransferRecord(dst, size, at, True, post_s=xfer / 4, xfer_s=xfer, wall_s=xfer * 1.1, bytes=size)


def failed(size: int, reason: str, at: float = 0.0) -> TransferRecord:
    return TransferRecord("decode-0", size, at, False, reason)


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.99) == 7.0
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile(values, 0.9) == pytest.approx(90.1)
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 100.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0  # order does not matter
    with pytest.raises(ValueError):
        percentile(values, 1.5)


def test_throughput_and_bandwidth() -> None:
    assert throughput(10 * MIB, 5.0, 15.0) == pytest.approx(MIB)
    assert throughput(1.0, 3.0, 3.0) is None
    recs = [ok(MIB, 0.002), ok(MIB, 0.002), failed(MIB, "timeout")]
    assert bandwidth(recs) == pytest.approx(2 * MIB / 0.004)
    assert bandwidth([failed(MIB, "error")]) is None


def test_summary_per_block_size() -> None:
    recs = [ok(256 * KIB, 0.001 * (i + 1), at=float(i)) for i in range(10)]
    recs += [ok(MIB, 0.004), failed(MIB, "timeout"), failed(MIB, "peer_unreachable")]
    s = summarize(recs, [256 * KIB, MIB, 4 * MIB], 0.0, 10.0)
    assert s["transfers"] == 13 and s["succeeded"] == 11 and s["failures"] == 2
    assert s["failures_by_reason"] == {"timeout": 1, "error": 0, "metadata_exchange_failed": 0, "peer_unreachable": 1}
    small, mid, big = s["per_block"]
    assert small["block_bytes"] == 256 * KIB and small["transfers"] == 10
    assert small["transfer_seconds"]["p50"] == pytest.approx(0.0055)
    assert small["transfer_seconds"]["p90"] == pytest.approx(0.0091)
    assert small["transfer_seconds"]["max"] == pytest.approx(0.010)
    assert small["post_seconds"]["p50"] == pytest.approx(0.0055 / 4)
    assert small["wall_seconds"]["p99"] == pytest.approx(1.1 * 0.00991)
    assert small["throughput_bytes_per_s"] == pytest.approx(10 * 256 * KIB / 10.0)
    assert mid["failures"] == 2 and mid["succeeded"] == 1 and mid["bytes"] == MIB
    assert big["transfers"] == 0 and big["transfer_seconds"]["p99"] is None and big["throughput_bytes_per_s"] == 0
    assert s["bytes"] == 10 * 256 * KIB + MIB
    json.dumps(s)  # the report is JSON as it stands


@pytest.mark.parametrize(("text", "size"), [("262144", 262144), ("256KiB", 256 * KIB), ("1MiB", MIB), ("4m", 4 * MIB),
                                            (" 2 MB ", 2 * MIB), ("1GiB", 1024 * MIB)])
def test_block_sizes_parse(text: str, size: int) -> None:
    assert parse_block_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "1.5MiB", "-1", "4TB", "lots"])
def test_bad_block_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_block_size(text)


# --- the metadata document ---------------------------------------------------------------------------------

DOC = MetadataDoc("decode-0", "abc", 4242, 1.7e9, b"nixlSerDes-blob", (BufferDesc(MIB, 0x7F0000000000, 4),))


def test_document_round_trip_and_slots() -> None:
    back = MetadataDoc.from_json(DOC.to_json())
    assert back == DOC
    buf = back.buffer(MIB)
    assert buf is not None and back.buffer(256 * KIB) is None
    assert buf.slot_addr(0) == 0x7F0000000000 and buf.slot_addr(5) == 0x7F0000000000 + MIB


def _mangled(**changes: object) -> bytes:
    body = json.loads(DOC.to_json())
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize(("raw", "message"), [
    (b"\x00\xff garbage", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (_mangled(version=99), "version"),
    (_mangled(nixl_metadata="bm90IHRoZSBibG9i"), "checksum"),
    (_mangled(nixl_metadata="***"), "malformed"),
    (_mangled(buffers=[{"block_bytes": MIB}]), "malformed"),
    (_mangled(buffers=[{"block_bytes": MIB, "addr": 1, "slots": 0}]), "no blocks"),
    # A pointer written as a signed integer, one past the address space, a negative device: NIXL takes none of them.
    (_mangled(buffers=[{"block_bytes": MIB, "addr": -4096, "slots": 4}]), "cannot address"),
    (_mangled(buffers=[{"block_bytes": MIB, "addr": 2**64 - MIB, "slots": 4}]), "cannot address"),
    (_mangled(buffers=[{"block_bytes": MIB, "addr": 4096, "slots": 4, "dev": -1}]), "cannot address"),
])
def test_unusable_documents_are_exchange_failures(raw: bytes, message: str) -> None:
    with pytest.raises(MetadataExchangeError, match=message) as info:
        MetadataDoc.from_json(raw)
    assert not info.value.unreachable


def test_a_peer_url_that_cannot_be_parsed_is_an_exchange_failure() -> None:
    with pytest.raises(MetadataExchangeError, match="not valid"):
        fetch_metadata("http://[::1/metadata", 1.0)


def test_metadata_service_serves_and_fails_distinctly() -> None:
    published: list[bytes | None] = [None]
    server = MetadataServer(lambda: published[0], lambda: {"agent": "decode-0", "notifications": 3})
    try:
        with pytest.raises(MetadataExchangeError, match="HTTP 404") as info:
            fetch_metadata(server.url, 2.0)
        assert not info.value.unreachable
        published[0] = DOC.to_json()
        assert fetch_metadata(server.url, 2.0) == DOC
        with urllib.request.urlopen(server.url.replace("/metadata", "/healthz"), timeout=2) as resp:
            assert json.load(resp)["notifications"] == 3
        url = server.url
    finally:
        server.close()
    with pytest.raises(MetadataExchangeError, match="unreachable") as info:
        fetch_metadata(url, 1.0)
    assert info.value.unreachable


# --- exporter and collector agree --------------------------------------------------------------------------


def test_buckets_cover_sub_millisecond_to_seconds() -> None:
    assert BUCKETS[0] <= 0.0001 and BUCKETS[-1] >= 5.0
    assert list(BUCKETS) == sorted(BUCKETS)
    assert sum(1 for b in BUCKETS if b < 0.001) >= 5  # loopback writes of small blocks are sub-millisecond


def test_a_scrape_sees_each_slot_in_every_family_or_in_none() -> None:
    # The probe thread counts a slot in several families while the HTTP thread renders them one after
    # another: without one lock over both, a scrape could count a transfer's bytes but not the transfer.
    m = ProbeMetrics("prefill-0")
    m.prepare("decode-0", [MIB])
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            m.observe(ok(MIB, 0.001))

    worker = threading.Thread(target=observe)
    worker.start()
    try:
        for _ in range(300):
            values = {(s.name, s.labels.get("le")): s.value for s in parse(m.exposition())
                      if s.labels.get("block_bytes") == str(MIB)}
            n = values[("fleet_kvprobe_transfers_total", None)]
            assert values[("fleet_kvprobe_bytes_total", None)] == n * MIB
            assert values[("fleet_kvprobe_transfer_seconds_count", None)] == n
    finally:
        stop.set()
        worker.join()


def test_probe_metrics_read_back_by_the_collector() -> None:
    m = ProbeMetrics("prefill-0")
    m.prepare("decode-0", [256 * KIB, MIB])
    before = list(parse(m.exposition()))
    for i in range(10):
        m.observe(ok(256 * KIB, 0.0008 + i * 1e-5))
        m.observe(ok(MIB, 0.003))
    m.observe(failed(MIB, "timeout"))
    m.observe(failed(256 * KIB, "metadata_exchange_failed"))
    m.set_up("decode-0", False)
    m.exchanged("decode-0", True)
    after = list(parse(m.exposition()))

    prev = kvprobe.read_paths(before)["prefill-0->decode-0"]
    cur = kvprobe.read_paths(after)["prefill-0->decode-0"]
    assert prev.counters["transfers"] == 0 and prev.gauges["up"] == 0
    assert {f"failures:{r}" for r in REASONS} <= set(prev.counters)  # pre-created at zero
    assert families.missing_families({"p": cur}, kvprobe.FAMILIES) == []
    d = families.delta(prev, cur, 5.0)
    assert d is not None
    sig = {s.name: s.value for s in kvprobe.signals(d, 1.0, "kvpath/prefill-0->decode-0")}
    assert sig["kv_transfer_rate"] == pytest.approx(22 / 5)
    assert sig["kv_throughput_bytes_per_s"] == pytest.approx((10 * 256 * KIB + 10 * MIB) / 5)
    assert sig["kv_failure_timeout_rate"] == pytest.approx(0.2)
    assert sig["kv_failure_metadata_exchange_failed_rate"] == pytest.approx(0.2)
    assert sig["kv_failure_ratio"] == pytest.approx(2 / 22)
    assert 0.00075 <= sig["kv_transfer_p50_seconds_256kib"] <= 0.001
    assert 0.002 <= sig["kv_transfer_p99_seconds_1mib"] <= 0.003
    assert 0.00075 <= sig["kv_transfer_p50"] <= 0.003
    assert sig["kv_up"] == 0
    assert "kv_post_p99" in sig and "kv_transfer_wall_p99" in sig


def test_a_long_runs_summary_covers_the_slots_it_kept_over_their_own_span(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Past the slots it keeps, the summary counted the newest of them over the whole run's time: its throughput fell
    the longer the probe ran."""
    from controlplane.kvprobe import agent, probe

    class Slots:  # a slot a second, of 1 KiB each, 25 in all
        def __init__(self, *args: object, on_record: Callable[[TransferRecord], None], **kwargs: object) -> None:
            self.on_record, self.exchanges = on_record, {}

        def run(self, *args: object) -> tuple[float, float]:
            for i in range(25):
                self.on_record(TransferRecord("decode-0", KIB, float(i), True, posted_at=float(i), post_s=1e-5,
                                              xfer_s=1e-4, wall_s=1e-4, bytes=KIB))
            return 0.0, 25.0

        def close(self) -> None:
            pass

    monkeypatch.setattr(probe, "Prober", Slots)
    monkeypatch.setattr(agent, "SUMMARY_SLOTS", 10)
    assert agent.main(["--role", "initiator", "--peer", "decode-0=http://127.0.0.1:9/metadata",
                       "--block-sizes", str(KIB), "--duration", "1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["slots"] == {"summarized": 10, "run": 25}
    assert summary["transfers"] == 10 and summary["duration_s"] == 10.0
    assert summary["throughput_bytes_per_s"] == pytest.approx(KIB)
