"""NIXL exporter mapping: the real 1.5.1 output, version drift, µs -> s quantiles, errors by status, prometheus_mp."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from collectors import families, nixl, sources
from collectors.exposition import parse
from collectors.pipeline import SignalDeriver
from collectors.types import ScrapeResult, Target
from tests.conftest import FIXTURES

FIXTURE = FIXTURES / "nixl_metrics_nixl-cu12-1.5.1_cpu_loopback.txt"
MIB = 1048576
BOUNDS_US = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1000000,
             5000000, 10000000)
STATUSES = ("not_posted", "invalid_param", "backend", "not_found", "mismatch", "not_allowed", "repost_active",
            "unknown", "not_supported", "remote_disconnect", "canceled", "no_telemetry")
AGENT_A = 'agent_name="probeA",hostname="vm"'
EXPOSER = (
    "# TYPE exposer_scrapes_total counter\nexposer_scrapes_total 3\n"
    "# TYPE exposer_request_latencies summary\nexposer_request_latencies_count 0\n"
    'exposer_request_latencies{quantile="0.5"} Nan\n'
)


def together(*expositions: str) -> str:
    """Agents published by one exporter: its own series once, each agent's after them."""
    return EXPOSER + "".join(text.removeprefix(EXPOSER) for text in expositions)


def fixture_text() -> str:
    return FIXTURE.read_text()


def zeroed(text: str) -> str:
    """The same exposition with every agent value at 0: the exporter's state before any event."""
    return re.sub(r"^(agent_\S+) \S+$", r"\1 0", text, flags=re.MULTILINE)


@dataclass(frozen=True)
class Agent:
    """Cumulative state of one agent; transfer times are the observed µs values."""

    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_requests: int = 0
    rx_requests: int = 0
    registered: int = 0
    deregistered: int = 0
    xfer_us: tuple[float, ...] = ()
    post_us: tuple[float, ...] = ()
    errors: Mapping[str, int] = field(default_factory=dict)
    dropped: int = 0


def histogram(name: str, labels: str, observations: tuple[float, ...]) -> str:
    lines = [f"# TYPE {name} histogram"]
    for le in BOUNDS_US:
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {sum(1 for o in observations if o <= le)}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {len(observations)}')
    lines.append(f"{name}_sum{{{labels}}} {sum(observations)}")
    lines.append(f"{name}_count{{{labels}}} {len(observations)}")
    return "\n".join(lines) + "\n"


def exposition(a: Agent, *, version: str = "head", labels: str = AGENT_A) -> str:
    """One agent as the named exporter release lays it out (reference §1.3 version-drift table)."""

    def lab(category: str) -> str:
        return f'category="{category}",{labels}' if version in ("beta", "v1.1") else labels

    transfer, memory, perf = lab("NIXL_TELEMETRY_TRANSFER"), lab("NIXL_TELEMETRY_MEMORY"), lab("NIXL_TELEMETRY_PERFORMANCE")
    last_xfer = a.xfer_us[-1] if a.xfer_us else 0
    last_post = a.post_us[-1] if a.post_us else 0
    out = [EXPOSER]
    if version == "beta":
        for name, value in (("agent_tx_bytes", a.tx_bytes), ("agent_rx_bytes", a.rx_bytes),
                            ("agent_tx_requests_num", a.tx_requests), ("agent_rx_requests_num", a.rx_requests)):
            out.append(f"# TYPE {name} counter\n{name}{{{transfer}}} {value}\n")
        out.append(f"agent_xfer_time{{{perf}}} {last_xfer}\nagent_xfer_post_time{{{perf}}} {last_post}\n")
        out.append(f"agent_memory_registered{{{memory}}} {a.registered}\nagent_memory_deregistered{{{memory}}} 0\n")
        return "".join(out)
    for name, value, lab_ in (
        ("agent_tx_bytes_total", a.tx_bytes, transfer), ("agent_rx_bytes_total", a.rx_bytes, transfer),
        ("agent_tx_requests_num_total", a.tx_requests, transfer), ("agent_rx_requests_num_total", a.rx_requests, transfer),
        ("agent_memory_registered_total", a.registered, memory), ("agent_memory_deregistered_total", a.deregistered, memory),
        ("agent_xfer_time_total", sum(a.xfer_us), perf), ("agent_xfer_post_time_total", sum(a.post_us), perf),
    ):
        out.append(f"# TYPE {name} counter\n{name}{{{lab_}}} {value}\n")
    if version in ("v1.1", "v1.3"):
        out.append(f"agent_memory_registered{{{memory}}} {a.registered}\n")
        return "".join(out)
    out.append("# TYPE agent_errors_total counter\n")
    out.extend(f'agent_errors_total{{{labels},status="{s}"}} {a.errors.get(s, 0)}\n' for s in STATUSES)
    out.append(f"agent_telemetry_events_dropped_total{{{labels}}} {a.dropped}\n")
    out.append(f"agent_xfer_time{{{labels}}} {last_xfer}\nagent_xfer_post_time{{{labels}}} {last_post}\n")
    out.append(f"agent_memory_registered_last_bytes{{{labels}}} {a.registered}\n")
    if version == "head":
        out.append(histogram("agent_xfer_time_us", labels, a.xfer_us))
        out.append(histogram("agent_xfer_post_time_us", labels, a.post_us))
    return "".join(out)


def read(text: str) -> dict[str, families.Reading]:
    return nixl.SOURCE.read(parse(text))


def signal_map(prev_text: str, cur_text: str, seconds: float = 10.0, entity: str = "vm/probeA") -> dict[str, float]:
    d = families.delta(read(prev_text)[entity], read(cur_text)[entity], seconds)
    assert d is not None
    return {s.name: s.value for s in nixl.signals(d, 100.0, f"nixl/{entity}")}


# Two scrapes 10 s apart: 5 MiB and 5 requests sent, 1 received, six transfers of 300 µs.
PREV = Agent(tx_bytes=10 * MIB, tx_requests=10, rx_requests=2, registered=4 * MIB, xfer_us=(200.0,) * 12,
             post_us=(20.0,) * 12)
CUR = dataclasses.replace(PREV, tx_bytes=15 * MIB, rx_bytes=MIB, tx_requests=15, rx_requests=3,
                          xfer_us=PREV.xfer_us + (300.0,) * 6, post_us=PREV.post_us + (40.0,) * 6)


# --- the real exporter output ---------------------------------------------------------------------------


def test_fixture_reads_two_agents_with_every_series() -> None:
    readings = read(fixture_text())
    assert set(readings) == {"vm/probeA", "vm/probeB"}
    for r in readings.values():
        assert r.attrs["hostname"] == "vm"
        assert len([k for k in r.counters if k.startswith("errors:")]) == len(STATUSES)
        assert set(r.histograms) == {"xfer_time", "post_time"}
        # Every mapped family is there, zeros included; the exposer's own series are not.
        assert r.families == {
            "agent_tx_bytes_total", "agent_rx_bytes_total", "agent_tx_requests_num_total", "agent_rx_requests_num_total",
            "agent_memory_registered_total", "agent_memory_deregistered_total", "agent_xfer_time_total",
            "agent_xfer_post_time_total", "agent_errors_total", "agent_telemetry_events_dropped_total",
            "agent_xfer_time_us", "agent_xfer_post_time_us",
        }
    a, b = readings["vm/probeA"], readings["vm/probeB"]
    assert a.counters["tx_bytes"] == 5 * MIB and a.counters["tx_requests"] == 5
    assert a.counters["xfer_time_us"] == 12523 and a.histograms["xfer_time"].count == 5
    assert dict(a.histograms["xfer_time"].buckets)[100.0] == 1  # bounds stay as exposed (µs) in the reading
    assert b.counters["tx_bytes"] == 0 and b.histograms["xfer_time"].count == 0
    assert a.gauges["memory_registered_net"] == b.gauges["memory_registered_net"] == MIB
    assert families.missing_families(readings, nixl.FAMILIES) == []


def test_fixture_signals_against_the_pre_created_zero_state() -> None:
    text = fixture_text()
    sig = signal_map(zeroed(text), text, seconds=10.0)
    assert sig["nixl_tx_bytes_rate"] == pytest.approx(5 * MIB / 10)
    assert sig["nixl_tx_request_rate"] == pytest.approx(0.5)
    assert sig["nixl_rx_bytes_rate"] == 0 and sig["nixl_rx_request_rate"] == 0
    # Transfer buckets: 1 <= 100 µs, 3 <= 250 µs, 4 <= 1000 µs, 5 <= 25000 µs.
    # p50: rank 2.5 lies in (100, 250] holding 2 -> 100 + 150 * 1.5 / 2 = 212.5 µs.
    assert sig["nixl_xfer_time_p50"] == pytest.approx(212.5e-6)
    # p95: rank 4.75 lies in (10000, 25000] holding 1 -> 10000 + 15000 * 0.75 = 21250 µs.
    assert sig["nixl_xfer_time_p95"] == pytest.approx(0.02125)
    assert sig["nixl_xfer_time_mean"] == pytest.approx(12523e-6 / 5)
    assert sig["nixl_post_time_p50"] == pytest.approx(212.5e-6)
    assert sig["nixl_post_time_mean"] == pytest.approx(1414e-6 / 5)
    assert sig["nixl_xfer_bandwidth"] == pytest.approx(5 * MIB / 12523e-6)
    assert sig["nixl_error_rate"] == 0 and not any(k.startswith("nixl_errors_") for k in sig)
    assert sig["nixl_telemetry_dropped_rate"] == 0
    assert sig["nixl_memory_registered_bytes"] == MIB
    idle = signal_map(zeroed(text), text, entity="vm/probeB")
    assert idle["nixl_tx_bytes_rate"] == 0
    assert not any(k.startswith(("nixl_xfer_time", "nixl_post_time", "nixl_xfer_bandwidth")) for k in idle)


# --- version drift ----------------------------------------------------------------------------------------

VERSIONS = [
    pytest.param("head", True, True, True, id="main-1.5-histograms"),
    pytest.param("v1.4", False, True, True, id="v1.4-errors-no-histograms"),
    pytest.param("v1.3", False, False, True, id="v1.3-no-error-metrics"),
    pytest.param("v1.1", False, False, True, id="v1.1-category-label"),
    pytest.param("beta", False, False, False, id="beta-0.9-counters-without-total"),
]


@pytest.mark.parametrize(("version", "quantiles", "errors", "totals"), VERSIONS)
def test_every_exporter_release_gives_the_same_rates(version: str, quantiles: bool, errors: bool, totals: bool) -> None:
    readings = read(exposition(CUR, version=version))
    assert set(readings) == {"vm/probeA"}  # the `category` label never splits an agent
    sig = signal_map(exposition(PREV, version=version), exposition(CUR, version=version))
    assert sig["nixl_tx_bytes_rate"] == pytest.approx(5 * MIB / 10)
    assert sig["nixl_rx_bytes_rate"] == pytest.approx(MIB / 10)
    assert sig["nixl_tx_request_rate"] == pytest.approx(0.5)
    assert sig["nixl_rx_request_rate"] == pytest.approx(0.1)
    assert sig["nixl_request_rate"] == pytest.approx(0.6)  # READs and WRITEs: what its errors are a share of
    assert ("nixl_xfer_time_p95" in sig) is quantiles
    assert ("nixl_error_rate" in sig) is errors
    assert ("nixl_memory_registered_bytes" in sig) is totals
    if totals:
        # Six requests (5 tx + 1 rx) took 1800 µs: the histogram and the µs total agree.
        assert sig["nixl_xfer_time_mean"] == pytest.approx(300e-6)
        assert sig["nixl_post_time_mean"] == pytest.approx(40e-6)
        assert sig["nixl_memory_registered_bytes"] == 4 * MIB
    else:
        # The beta plugin only had last-request gauges for times: no mean can be derived.
        assert not any(k.startswith(("nixl_xfer_time", "nixl_post_time")) for k in sig)


def test_current_spelling_wins_over_the_beta_one() -> None:
    text = exposition(CUR) + f"agent_tx_bytes{{{AGENT_A}}} 999\n"
    assert read(text)["vm/probeA"].counters["tx_bytes"] == 15 * MIB


# --- quantiles and means in seconds ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("observations", "p50", "p95", "p99"),
    [
        # Six in (250, 500] µs: rank 3 of 6 is halfway -> 375 µs; 5.7 -> 487.5 µs; 5.94 -> 497.5 µs.
        pytest.param((300.0,) * 6, 375e-6, 487.5e-6, 497.5e-6, id="one-bucket"),
        # 80, 80 in (50, 100]; 2000 in (1000, 2500]; 40000 in (25000, 50000].
        pytest.param((80.0, 80.0, 2000.0, 40000.0), 100e-6, 0.045, 0.049, id="across-decades"),
        # Past the last bound (10 s): PromQL answers the highest finite bound.
        pytest.param((2e7,), 10.0, 10.0, 10.0, id="beyond-last-bound"),
    ],
)
def test_quantiles_are_microsecond_buckets_read_as_seconds(observations: tuple[float, ...], p50: float, p95: float,
                                                           p99: float) -> None:
    before = Agent(xfer_us=(5.0,) * 7, post_us=(5.0,) * 7)  # earlier transfers are not in the window
    after = dataclasses.replace(before, tx_requests=len(observations), xfer_us=before.xfer_us + observations,
                                post_us=before.post_us + observations)
    sig = signal_map(exposition(before), exposition(after))
    for prefix in ("nixl_xfer_time", "nixl_post_time"):
        assert sig[f"{prefix}_p50"] == pytest.approx(p50)
        assert sig[f"{prefix}_p95"] == pytest.approx(p95)
        assert sig[f"{prefix}_p99"] == pytest.approx(p99)
        assert sig[f"{prefix}_mean"] == pytest.approx(sum(observations) / len(observations) / 1e6)


def test_an_interval_without_transfers_has_no_transfer_times() -> None:
    sig = signal_map(exposition(PREV), exposition(PREV))
    assert sig["nixl_tx_request_rate"] == 0
    assert not any(k.startswith(("nixl_xfer_time", "nixl_post_time", "nixl_xfer_bandwidth")) for k in sig)


# --- errors, drops, memory ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        pytest.param({}, {"backend": 3, "remote_disconnect": 1}, {"backend": 0.3, "remote_disconnect": 0.1},
                     id="two-statuses"),
        pytest.param({"canceled": 5}, {"canceled": 5, "no_telemetry": 2}, {"no_telemetry": 0.2}, id="unchanged-status-silent"),
        pytest.param({"backend": 7}, {"backend": 2}, {"backend": 0.2}, id="counter-reset"),
        pytest.param({}, {}, {}, id="no-errors"),
    ],
)
def test_error_rate_by_status(before: dict[str, int], after: dict[str, int], expected: dict[str, float]) -> None:
    sig = signal_map(exposition(Agent(errors=before)), exposition(Agent(errors=after)))
    assert sig["nixl_error_rate"] == pytest.approx(sum(expected.values()))
    by_status = {k: v for k, v in sig.items() if k.startswith("nixl_errors_")}
    assert by_status == pytest.approx({f"nixl_errors_{s}_rate": v for s, v in expected.items()})


def test_dropped_events_and_net_registered_memory() -> None:
    before = Agent(registered=8 * MIB, deregistered=2 * MIB, dropped=10)
    after = dataclasses.replace(before, registered=9 * MIB, deregistered=6 * MIB, dropped=40)
    sig = signal_map(exposition(before), exposition(after))
    assert sig["nixl_telemetry_dropped_rate"] == pytest.approx(3.0)
    assert sig["nixl_memory_registered_bytes"] == 3 * MIB


# --- entities -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label_sets", "entities"),
    [
        pytest.param(['agent_name="a",hostname="h"'], {"h/a"}, id="prometheus-plugin"),
        pytest.param(['agent_name="a",hostname="h",pid="11",agent_instance="0"',
                      'agent_name="a",hostname="h",pid="12",agent_instance="0"'], {"h/a/11", "h/a/12"}, id="mp-pid"),
        pytest.param(['agent_name="a",hostname="h",pid="11",agent_instance="0",local_rank="0"',
                      'agent_name="a",hostname="h",pid="12",agent_instance="0",local_rank="1"'], {"h/a/0", "h/a/1"},
                     id="mp-local-rank"),
        pytest.param(['agent_name="a",hostname="h",pid="11",agent_instance="0",local_rank="0"',
                      'agent_name="a",hostname="h",pid="11",agent_instance="1",local_rank="0"'], {"h/a/0"},
                     id="mp-agent-instances-summed"),
    ],
)
def test_prometheus_mp_labels_name_the_entity(label_sets: list[str], entities: set[str]) -> None:
    text = together(*(exposition(Agent(tx_bytes=100, tx_requests=1), labels=labels) for labels in label_sets))
    readings = read(text)
    assert set(readings) == entities
    assert sum(r.counters["tx_bytes"] for r in readings.values()) == 100 * len(label_sets)
    for entity, r in readings.items():
        assert entity.startswith(f"{r.attrs['hostname']}/{r.attrs['agent_name']}")


def test_restarted_rank_keeps_its_entity_and_counts_nothing_twice() -> None:
    old = 'agent_name="a",hostname="h",pid="11",agent_instance="0",local_rank="0"'
    new = 'agent_name="a",hostname="h",pid="99",agent_instance="0",local_rank="0"'
    before = exposition(Agent(tx_bytes=1000, tx_requests=10), labels=old)
    # The owner still publishes the dead process until its TTL; then only the new pid remains.
    overlap = together(before, exposition(Agent(tx_bytes=300, tx_requests=3), labels=new))
    after = exposition(Agent(tx_bytes=500, tx_requests=5), labels=new)
    assert signal_map(before, overlap, entity="h/a/0")["nixl_tx_bytes_rate"] == pytest.approx(30.0)
    # The dead process's series leaves the sum: the new one sent 200 bytes more. Read as a reset of the sum, the
    # 300 already counted came again (50 bytes a second).
    assert signal_map(overlap, after, entity="h/a/0")["nixl_tx_bytes_rate"] == pytest.approx(20.0)
    # A process restarted under the same labels still reads as a reset.
    again = exposition(Agent(tx_bytes=40, tx_requests=1), labels=new)
    assert signal_map(after, again, entity="h/a/0")["nixl_tx_bytes_rate"] == pytest.approx(4.0)


def test_series_without_an_agent_are_ignored() -> None:
    assert read(EXPOSER + "agent_tx_bytes_total 5\n") == {}


# --- missing families -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "missing"),
    [
        pytest.param("head", [], id="main"),
        pytest.param("v1.4", ["agent_xfer_time_us"], id="v1.4"),
        pytest.param("v1.3", ["agent_xfer_time_us", "agent_errors_total"], id="v1.3"),
        # The beta spelling of the byte counter counts as present.
        pytest.param("beta", ["agent_xfer_time_total", "agent_xfer_time_us", "agent_errors_total"], id="beta"),
    ],
)
def test_missing_families_for_a_transfer_latency_policy(version: str, missing: list[str]) -> None:
    policy = dataclasses.replace(nixl.FAMILIES, expected=(
        "agent_tx_bytes_total", "agent_xfer_time_total", "agent_xfer_time_us", "agent_errors_total"))
    assert families.missing_families(read(exposition(CUR, version=version)), policy) == missing


def test_default_expected_families_are_exposed_names() -> None:
    exposed = {name for group in (*nixl.FAMILIES.counters.values(), *nixl.FAMILIES.histograms.values()) for name in group}
    assert set(nixl.FAMILIES.expected) <= exposed


# --- through the pipeline -------------------------------------------------------------------------------


def test_pipeline_derives_agent_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sources.SOURCES, nixl.SOURCE.name, nixl.SOURCE)
    target = Target("http://p0:9090/metrics", "prefill", "p0", source="nixl")
    deriver = SignalDeriver()
    first = deriver.derive([ScrapeResult(target, 0.0, ok=True, body=zeroed(fixture_text()))], 0.0)
    assert first.missing_families == {}
    out = deriver.derive([ScrapeResult(target, 10.0, ok=True, body=fixture_text())], 10.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert sig[("nixl/vm/probeA", "nixl_tx_bytes_rate")] == pytest.approx(5 * MIB / 10)
    assert sig[("nixl/vm/probeB", "nixl_tx_bytes_rate")] == 0
    assert not any(subject.startswith("pool/") and name.startswith("nixl_") for subject, name in sig)


@pytest.mark.parametrize("reads", [False, True], ids=["writes", "reads"])
def test_an_agents_errors_are_a_share_of_its_reads_and_writes(reads: bool) -> None:
    """A decode worker that pulls its KV posts READs, which NIXL counts as rx: weighed by tx alone, a background of
    one error a scrape among 200 READs a second read as every transfer failing, a critical finding."""
    from policies.kv_transfer import KvTransferLag
    from policies.types import PolicyInput
    from policies.windows import SignalWindows

    labels, step = 'agent_name="decode-0",hostname="node-a"', 15.0

    def text(requests: int, errors: int) -> str:
        tx, rx = (0, requests) if reads else (requests, 0)
        done = [f'agent_xfer_time_us_bucket{{{labels},le="{le}"}} {requests if le >= 5000 else 0}'
                for le in (1000, 5000)]
        return "\n".join([
            f"agent_tx_bytes_total{{{labels}}} {tx * MIB}", f"agent_rx_bytes_total{{{labels}}} {rx * MIB}",
            f"agent_tx_requests_num_total{{{labels}}} {tx}", f"agent_rx_requests_num_total{{{labels}}} {rx}",
            f'agent_errors_total{{{labels},status="backend"}} {errors}', *done,
            f'agent_xfer_time_us_bucket{{{labels},le="+Inf"}} {requests}',
            f"agent_xfer_time_us_sum{{{labels}}} {4000 * requests}", f"agent_xfer_time_us_count{{{labels}}} {requests}",
        ]) + "\n"

    w = SignalWindows(horizon_s=7200)
    prev = None
    for i in range(13):
        cur = nixl.read_agents(parse(text(int(200 * step) * (i + 1), max(0, i - 10))))["node-a/decode-0"]
        if prev is not None:
            for s in nixl.signals(families.delta(prev, cur, step), i * step, "nixl/node-a/decode-0"):
                w.add(s.ts, s.subject, s.name, s.value)
        prev = cur
    assert not KvTransferLag().evaluate(PolicyInput(12 * step, w, {}, {})).findings
