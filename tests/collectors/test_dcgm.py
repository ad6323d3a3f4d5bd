"""dcgm-exporter mapping: GPU and MIG entities, hostname spellings, attribution, sentinels, units, rates, XIDs."""

from __future__ import annotations

import math
from typing import Any

import pytest

from collectors import dcgm, families, sources
from collectors.exposition import parse
from collectors.pipeline import SignalDeriver
from collectors.types import ScrapeResult, Signal, Target
from tests.conftest import FIXTURES

FIXTURE = FIXTURES / "dcgm_metrics_datadog_integrations_core_t4.txt"
MIB = 1048576


def fixture_text() -> str:
    return FIXTURE.read_text()


def line(name: str, value: float | str, *, gpu: str = "0", host: str | None = "node-a", host_key: str = "Hostname",
         **extra: str) -> str:
    """One dcgm-exporter series in the current label order."""
    labels = {"gpu": gpu, "UUID": f"GPU-{gpu}", "pci_bus_id": f"00000000:0{gpu}:00.0", "device": f"nvidia{gpu}",
              "modelName": "NVIDIA H100 80GB HBM3"}
    if host is not None:
        labels[host_key] = host
    labels.update(extra)
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{body}}} {value}\n"


def expo(values: dict[str, float | str], **kw: Any) -> str:
    return "".join(line(name, value, **kw) for name, value in values.items())


def read(text: str) -> dict[str, families.Reading]:
    return dcgm.SOURCE.read(parse(text))


def signal_map(prev_text: str, cur_text: str, seconds: float = 15.0, entity: str = "node-a/0") -> dict[str, float]:
    d = families.delta(read(prev_text)[entity], read(cur_text)[entity], seconds)
    assert d is not None
    return {s.name: s.value for s in dcgm.signals(d, 100.0, "gpu/node-a/0")}


def steady(values: dict[str, float | str], **kw: Any) -> dict[str, float]:
    """Signals of two identical scrapes: gauges as they are, every rate zero."""
    text = expo(values, **kw)
    return signal_map(text, text)


# --- the real exporter output ---------------------------------------------------------------------------


def test_fixture_entities_are_host_and_gpu_index() -> None:
    readings = read(fixture_text())
    # 551bdf382151 only exposes families this source does not read, so it is no entity.
    assert set(readings) == {"424773df46e0/0", "ip-11111/0"}


@pytest.mark.parametrize(
    ("entity", "expected"),
    [
        pytest.param("424773df46e0/0", {"hostname": "424773df46e0", "UUID": "GPU-20c56d28-0da5-6d26-a36a-e7af1ce2586e",
                                        "modelName": "Tesla T4", "device": "nvidia0",
                                        "DCGM_FI_DRIVER_VERSION": "460.106.00"}, id="t4-without-pod"),
        pytest.param("ip-11111/0", {"hostname": "ip-11111", "UUID": "GPU-abc", "modelName": "NVIDIA A10G",
                                    "device": "nvidia0", "DCGM_FI_DRIVER_VERSION": "550.144.03",
                                    "pod": "ray-1111111", "namespace": "ray-llm", "container": "ray-worker"},
                     id="a10g-with-pod"),
    ],
)
def test_fixture_attrs(entity: str, expected: dict[str, str]) -> None:
    assert read(fixture_text())[entity].attrs == expected


def test_fixture_reading_keeps_exposed_names_and_values() -> None:
    r = read(fixture_text())["424773df46e0/0"]
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" in r.families  # a counter exposed without `_total`
    assert r.counters["energy_mj"] == 128996013
    assert r.gauges["fb_free_mib"] == 15109
    assert r.gauges["power_w"] == pytest.approx(8.969)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("gpu_sm_clock_mhz", 300, id="sm-clock"),
        pytest.param("gpu_temperature_celsius", 25, id="temperature"),
        pytest.param("gpu_power_watts", 8.969, id="power"),
        pytest.param("gpu_utilization", 0.0, id="utilization"),
        pytest.param("gpu_memory_free_bytes", 15109 * MIB, id="fb-free-mib-to-bytes"),
        pytest.param("gpu_memory_used_bytes", 0.0, id="fb-used"),
        pytest.param("gpu_energy_joules_rate", 0.0, id="energy-unchanged"),
        pytest.param("gpu_pcie_replay_rate", 0.0, id="pcie-replays"),
        pytest.param("gpu_nvlink_bytes_rate", 0.0, id="nvlink"),
    ],
)
def test_fixture_signals(name: str, expected: float) -> None:
    r = read(fixture_text())["424773df46e0/0"]
    d = families.delta(r, r, 30.0)
    assert d is not None
    sig = {s.name: s.value for s in dcgm.signals(d, 1.0, "gpu/424773df46e0/0")}
    assert sig[name] == pytest.approx(expected)
    assert "gpu_xid_last" not in sig  # DCGM_FI_DEV_XID_ERRORS is 0: no XID seen


def test_fixture_has_every_expected_family() -> None:
    assert families.missing_families(read(fixture_text()), dcgm.FAMILIES) == []


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        pytest.param("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTILIZATION", ["DCGM_FI_DEV_GPU_UTIL"], id="renamed-util"),
        pytest.param("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_DRAW", ["DCGM_FI_DEV_POWER_USAGE"], id="renamed-power"),
        pytest.param("DCGM_FI_DEV_GPU_UTIL", "dcgm_gpu_utilization", [], id="old-spelling-counts"),
    ],
)
def test_missing_families_reports_a_renamed_metric(old: str, new: str, missing: list[str]) -> None:
    text = fixture_text().replace(f"{old}{{", f"{new}{{")
    assert families.missing_families(read(text), dcgm.FAMILIES) == missing


# --- entities, hostnames, attribution -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "entity", "subject"),
    [
        pytest.param({"host_key": "Hostname"}, "node-a/0", "gpu/node-a/0", id="Hostname-up-to-4.5.3"),
        pytest.param({"host_key": "hostname"}, "node-a/0", "gpu/node-a/0", id="hostname-on-main"),
        pytest.param({"host": None}, "/0", "gpu/pod-7/0", id="no-hostname-label-uses-pod"),
        pytest.param({"host": ""}, "/0", "gpu/pod-7/0", id="empty-hostname-uses-pod"),
    ],
)
def test_hostname_label_variants(labels: dict[str, str | None], entity: str, subject: str) -> None:
    readings = read(expo({"DCGM_FI_DEV_GPU_UTIL": 50}, **labels))
    assert set(readings) == {entity}
    target = Target("http://node:9400/metrics", "gpus", "pod-7", source="dcgm")
    assert dcgm.SOURCE.subject(target, entity, readings[entity]) == subject


def test_lowercase_hostname_wins_when_both_are_present() -> None:
    readings = read(line("DCGM_FI_DEV_GPU_UTIL", 50, Hostname="old-name", hostname="new-name", host=None))
    assert set(readings) == {"new-name/0"}
    assert readings["new-name/0"].attrs["hostname"] == "new-name"


def test_gpus_of_one_host_are_separate_entities() -> None:
    text = expo({"DCGM_FI_DEV_GPU_UTIL": 10}, gpu="0") + expo({"DCGM_FI_DEV_GPU_UTIL": 90}, gpu="1")
    readings = read(text)
    assert {k: r.gauges["gpu_util_pct"] for k, r in readings.items()} == {"node-a/0": 10, "node-a/1": 90}


def test_mig_instances_are_their_own_entities() -> None:
    text = (
        expo({"DCGM_FI_DEV_GPU_TEMP": 40})
        + expo({"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.25}, GPU_I_PROFILE="1g.10gb", GPU_I_ID="3")
        + expo({"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.75}, GPU_I_PROFILE="3g.40gb", GPU_I_ID="1")
    )
    readings = read(text)
    assert set(readings) == {"node-a/0", "node-a/0/3", "node-a/0/1"}
    mig = readings["node-a/0/3"]
    assert mig.gauges == {"engine_active": 0.25}
    assert mig.attrs["GPU_I_PROFILE"] == "1g.10gb" and mig.attrs["GPU_I_ID"] == "3"
    target = Target("http://node:9400/metrics", "gpus", "pod-7", source="dcgm")
    assert dcgm.SOURCE.subject(target, "node-a/0/3", mig) == "gpu/node-a/0/3"


def test_empty_mig_label_means_the_whole_gpu() -> None:
    assert set(read(expo({"DCGM_FI_DEV_GPU_TEMP": 40}, GPU_I_ID="", GPU_I_PROFILE=""))) == {"node-a/0"}


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        pytest.param({"pod": "vllm-0", "namespace": "llm", "container": "engine"},
                     {"pod": "vllm-0", "namespace": "llm", "container": "engine"}, id="kubernetes"),
        pytest.param({"pod_name": "vllm-0", "pod_namespace": "llm", "container_name": "engine"},
                     {"pod": "vllm-0", "namespace": "llm", "container": "engine"}, id="use-old-namespace"),
        pytest.param({"pod": "", "namespace": "", "container": ""}, {}, id="gpu-without-pod-empty-labels"),
        pytest.param({"pod": "vllm-0", "namespace": "llm", "pod_uid": "abc-123"},
                     {"pod": "vllm-0", "namespace": "llm", "pod_uid": "abc-123"}, id="pod-uid"),
    ],
)
def test_attribution_labels(labels: dict[str, str], expected: dict[str, str]) -> None:
    attrs = read(expo({"DCGM_FI_DEV_GPU_UTIL": 5}, **labels))["node-a/0"].attrs
    assert {k: v for k, v in attrs.items() if k in ("pod", "namespace", "container", "pod_uid")} == expected
    assert attrs["UUID"] == "GPU-0" and attrs["modelName"] == "NVIDIA H100 80GB HBM3"
    assert attrs["hostname"] == "node-a" and attrs["pci_bus_id"] == "00000000:00:00.0"


@pytest.mark.parametrize(
    "extra",
    [pytest.param({"nvlink": "2"}, id="nvlink-entity"), pytest.param({"nvswitch": "1"}, id="nvswitch-entity")],
)
def test_link_and_switch_series_are_not_gpus(extra: dict[str, str]) -> None:
    assert read(expo({"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 5}, **extra)) == {}


def test_series_without_gpu_label_are_ignored() -> None:
    assert read('DCGM_FI_DEV_GPU_UTIL{Hostname="node-a"} 10\nDCGM_FI_DEV_GPU_UTIL{gpu="",Hostname="node-a"} 10\n') == {}


# --- sentinels ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("9223372036854775794", id="int64-not-supported"),
        pytest.param("9223372036854775792", id="int64-blank"),
        pytest.param("9223372036854775795", id="int64-no-permission"),
        pytest.param("140737488355328", id="fp64-blank"),
        pytest.param("140737488355330", id="fp64-not-supported"),
        pytest.param("NaN", id="nan"),
    ],
)
def test_blank_values_are_missing_not_emitted(value: str) -> None:
    values = {"DCGM_FI_DEV_GPU_UTIL": 40, "DCGM_FI_DEV_MEMORY_TEMP": value, "DCGM_FI_DEV_POWER_USAGE": value,
              "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": value}
    r = read(expo(values))["node-a/0"]
    assert "memory_temp" not in r.gauges and "power_w" not in r.gauges and "energy_mj" not in r.counters
    # The family is exposed, just without a value: that is not a missing family.
    assert "DCGM_FI_DEV_POWER_USAGE" in r.families
    assert "DCGM_FI_DEV_POWER_USAGE" not in families.missing_families({"node-a/0": r}, dcgm.FAMILIES)
    sig = steady(values)
    assert sig["gpu_utilization"] == pytest.approx(0.4)
    assert not {"gpu_memory_temperature_celsius", "gpu_power_watts", "gpu_energy_joules_rate"} & set(sig)


def test_gpu_with_only_blank_values_is_an_entity_without_signals() -> None:
    text = expo({"DCGM_FI_DEV_GPU_UTIL": "9223372036854775794"})
    r = read(text)["node-a/0"]
    assert r.gauges == {} and r.families == {"DCGM_FI_DEV_GPU_UTIL"}
    assert signal_map(text, text) == {}


@pytest.mark.parametrize(
    ("value", "blank"),
    [
        pytest.param(0.0, False, id="zero"),
        pytest.param(9.1e18, False, id="huge-but-real"),
        pytest.param(9.2e18, True, id="threshold"),
        pytest.param(float(2**47), True, id="fp64-blank"),
        pytest.param(float(2**47 + 4), False, id="next-to-fp64-sentinels"),
        pytest.param(math.nan, True, id="nan"),
    ],
)
def test_is_blank(value: float, blank: bool) -> None:
    assert dcgm.is_blank(value) is blank


# --- units ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "value", "signal", "expected"),
    [
        pytest.param("DCGM_FI_DEV_GPU_UTIL", 87, "gpu_utilization", 0.87, id="util-percent-to-ratio"),
        pytest.param("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.62, "gpu_engine_active", 0.62, id="engine-active-ratio"),
        pytest.param("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.31, "gpu_tensor_active", 0.31, id="tensor-active-ratio"),
        pytest.param("DCGM_FI_PROF_DRAM_ACTIVE", 0.55, "gpu_dram_active", 0.55, id="dram-active-ratio"),
        pytest.param("DCGM_FI_DEV_FB_USED", 70000, "gpu_memory_used_bytes", 70000 * MIB, id="fb-used-mib"),
        pytest.param("DCGM_FI_DEV_FB_FREE", 11000, "gpu_memory_free_bytes", 11000 * MIB, id="fb-free-mib"),
        pytest.param("DCGM_FI_DEV_GPU_TEMP", 64, "gpu_temperature_celsius", 64, id="gpu-temp"),
        pytest.param("DCGM_FI_DEV_MEMORY_TEMP", 71, "gpu_memory_temperature_celsius", 71, id="memory-temp"),
        pytest.param("DCGM_FI_DEV_POWER_USAGE", 512.25, "gpu_power_watts", 512.25, id="power-watts"),
        pytest.param("DCGM_FI_DEV_SM_CLOCK", 1980, "gpu_sm_clock_mhz", 1980, id="sm-clock"),
        pytest.param("DCGM_FI_PROF_PCIE_TX_BYTES", 2.5e9, "gpu_pcie_tx_bytes_rate", 2.5e9, id="pcie-tx-bytes-per-s"),
        pytest.param("DCGM_FI_PROF_PCIE_RX_BYTES", 1.5e9, "gpu_pcie_rx_bytes_rate", 1.5e9, id="pcie-rx-bytes-per-s"),
        pytest.param("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", 2000, "gpu_pcie_tx_bytes_rate", 2000 * 1024, id="pcie-tx-kb-fallback"),
        pytest.param("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", 3000, "gpu_pcie_rx_bytes_rate", 3000 * 1024, id="pcie-rx-kb-fallback"),
        pytest.param("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", 386586, "gpu_nvlink_bytes_rate", 386586 * MIB,
                     id="nvlink-mib-per-s"),
        pytest.param("DCGM_FI_DEV_ROW_REMAP_FAILURE", 1, "gpu_row_remap_failure", 1, id="row-remap-failure"),
        pytest.param("DCGM_EXP_XID_ERRORS_COUNT", 2, "gpu_xid_errors_window", 2, id="xid-window-count"),
    ],
)
def test_gauge_units(family: str, value: float, signal: str, expected: float) -> None:
    assert steady({family: value})[signal] == pytest.approx(expected)


def test_prof_pcie_wins_over_the_nvml_throughput_field() -> None:
    sig = steady({"DCGM_FI_PROF_PCIE_TX_BYTES": 1e9, "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": 5})
    assert sig["gpu_pcie_tx_bytes_rate"] == pytest.approx(1e9)


def test_nvlink_bandwidth_is_read_as_the_rate_it_is() -> None:
    # Field 449 is already MiB/s: a falling value is less traffic, not a counter reset.
    sig = signal_map(expo({"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 24531}),
                     expo({"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 12129}))
    assert sig["gpu_nvlink_bytes_rate"] == pytest.approx(12129 * MIB)


@pytest.mark.parametrize(
    ("old", "signal", "value", "expected"),
    [
        pytest.param("dcgm_gpu_utilization", "gpu_utilization", 50, 0.5, id="gpu-utilization"),
        pytest.param("dcgm_fb_used", "gpu_memory_used_bytes", 100, 100 * MIB, id="fb-used"),
        pytest.param("dcgm_fb_free", "gpu_memory_free_bytes", 200, 200 * MIB, id="fb-free"),
        pytest.param("dcgm_gpu_temp", "gpu_temperature_celsius", 55, 55, id="gpu-temp"),
        pytest.param("dcgm_memory_temp", "gpu_memory_temperature_celsius", 60, 60, id="memory-temp"),
        pytest.param("dcgm_power_usage", "gpu_power_watts", 300, 300, id="power-usage"),
        pytest.param("dcgm_sm_clock", "gpu_sm_clock_mhz", 1410, 1410, id="sm-clock"),
        pytest.param("dcgm_fi_prof_gr_engine_active", "gpu_engine_active", 0.5, 0.5, id="gr-engine-active"),
        pytest.param("dcgm_fi_prof_pipe_tensor_active", "gpu_tensor_active", 0.2, 0.2, id="tensor-active"),
        pytest.param("dcgm_fi_prof_dram_active", "gpu_dram_active", 0.3, 0.3, id="dram-active"),
        pytest.param("dcgm_fi_prof_pcie_tx_bytes", "gpu_pcie_tx_bytes_rate", 1e6, 1e6, id="prof-pcie-tx"),
        pytest.param("dcgm_pcie_rx_throughput", "gpu_pcie_rx_bytes_rate", 10, 10 * 1024, id="pcie-rx-throughput"),
        pytest.param("dcgm_nvlink_bandwidth_total", "gpu_nvlink_bytes_rate", 3, 3 * MIB, id="nvlink-bandwidth"),
        pytest.param("dcgm_xid_errors", "gpu_xid_last", 48, 48, id="xid-errors"),
    ],
)
def test_1x_compatibility_names(old: str, signal: str, value: float, expected: float) -> None:
    assert steady({old: value})[signal] == pytest.approx(expected)


def test_current_name_wins_over_1x_name() -> None:
    assert steady({"dcgm_gpu_temp": 99, "DCGM_FI_DEV_GPU_TEMP": 50})["gpu_temperature_celsius"] == 50


# --- counters across two scrapes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "before", "after", "seconds", "signal", "expected"),
    [
        pytest.param("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1_000_000, 1_450_000, 15, "gpu_energy_joules_rate", 30.0,
                     id="energy-mj-to-watts"),
        pytest.param("dcgm_total_energy_consumption", 0, 9_000_000, 30, "gpu_energy_joules_rate", 300.0,
                     id="energy-1x-name"),
        pytest.param("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 5_000_000, 600_000, 15, "gpu_energy_joules_rate", 40.0,
                     id="energy-after-driver-reload"),
        pytest.param("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 10, 40, 15, "gpu_pcie_replay_rate", 2.0, id="pcie-replays"),
        pytest.param("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 3, 33, 10, "gpu_ecc_sbe_rate", 3.0, id="ecc-sbe"),
        pytest.param("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0, 2, 20, "gpu_ecc_dbe_rate", 0.1, id="ecc-dbe"),
        pytest.param("dcgm_ecc_sbe_volatile_total", 1, 11, 10, "gpu_ecc_sbe_rate", 1.0, id="ecc-sbe-1x-name"),
        pytest.param("DCGM_FI_DEV_THERMAL_VIOLATION", 0, 7_500_000_000, 15, "gpu_thermal_violation_seconds_rate", 0.5,
                     id="thermal-violation-ns"),
        pytest.param("DCGM_FI_DEV_POWER_VIOLATION", 1e9, 16e9, 15, "gpu_power_violation_seconds_rate", 1.0,
                     id="power-violation-ns"),
        pytest.param("dcgm_power_violation", 0, 3e9, 30, "gpu_power_violation_seconds_rate", 0.1,
                     id="power-violation-1x-name"),
        pytest.param("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 2, 3, 15, "gpu_remapped_rows_uncorrectable", 1.0,
                     id="remapped-rows-increase"),
        pytest.param("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 2, 2, 15, "gpu_remapped_rows_uncorrectable", 0.0,
                     id="remapped-rows-unchanged"),
    ],
)
def test_counter_rates_across_two_scrapes(family: str, before: float, after: float, seconds: float, signal: str,
                                          expected: float) -> None:
    sig = signal_map(expo({family: before}), expo({family: after}), seconds)
    assert sig[signal] == pytest.approx(expected)


def test_counters_need_two_scrapes() -> None:
    r = read(expo({"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 1000}))["node-a/0"]
    assert families.delta(None, r, 15.0) is None


# --- XIDs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "emitted"),
    [pytest.param(0, None, id="no-xid-no-signal"), pytest.param(79, 79.0, id="fell-off-the-bus"),
     pytest.param(13, 13.0, id="graphics-exception")],
)
def test_xid_last_is_the_code_not_a_count(code: int, emitted: float | None) -> None:
    # The same code in both scrapes is the same last XID, reported as it is, never as an increase.
    sig = signal_map(expo({"DCGM_FI_DEV_XID_ERRORS": code}), expo({"DCGM_FI_DEV_XID_ERRORS": code}))
    assert sig.get("gpu_xid_last") == emitted
    assert "gpu_xid_errors" not in sig


def _xid_total(counts: dict[str, float]) -> str:
    return "".join(line("DCGM_EXP_XID_ERRORS_TOTAL", n, xid=xid) for xid, n in counts.items())


def test_xid_total_increase_is_summed_over_xid_labels() -> None:
    before = _xid_total({"13": 2, "31": 1})
    after = _xid_total({"13": 3, "31": 1, "79": 1})  # a new XID code appears as a new series
    sig = signal_map(before, after)
    assert sig["gpu_xid_errors"] == 2.0


def test_the_first_xid_on_a_gpu_counts_though_its_family_is_new() -> None:
    # dcgm-exporter writes no XID series until the first error: the GPU's first XID is the one that matters most.
    util = line("DCGM_FI_DEV_GPU_UTIL", 50)
    assert signal_map(util, util + _xid_total({"79": 1}))["gpu_xid_errors"] == 1.0


def test_a_counter_blank_in_a_gpus_first_scrape_is_not_counted_from_zero_when_it_reads() -> None:
    """dcgm-exporter prints a sentinel before a field is first sampled: the energy since the driver loaded (ten days
    at a kilowatt) is not one interval's."""
    util = line("DCGM_FI_DEV_GPU_UTIL", 50)
    blank = read(util + line("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 9223372036854775792))["node-a/0"]
    first = read(util + line("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 864_000_000_000))["node-a/0"]
    d = families.advance(blank, first, 15.0)
    assert d is not None and not d.increases
    later = read(util + line("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 864_000_015_000))["node-a/0"]
    d = families.advance(first, later, 15.0)
    assert d is not None and list(d.increases.values()) == [15_000]


def test_the_first_xid_counts_beside_a_field_the_exporter_never_reads() -> None:
    """An L4's exporter prints a sentinel for memory temperature every scrape: that field is unread, not the XIDs."""
    util = line("DCGM_FI_DEV_GPU_UTIL", 50) + line("DCGM_FI_DEV_MEMORY_TEMP", 9223372036854775794)
    assert signal_map(util, util + _xid_total({"79": 1}))["gpu_xid_errors"] == 1.0


def test_a_family_missing_past_the_carry_is_not_counted_from_zero_when_it_is_back() -> None:
    util = line("DCGM_FI_DEV_GPU_UTIL", 50)
    first = read(util + _xid_total({"13": 40}))["node-a/0"]
    gone = read(util)["node-a/0"]
    assert families.advance(first, gone, families.STALE_S + 60) is not None
    back = read(util + _xid_total({"13": 41}))["node-a/0"]
    d = families.advance(gone, back, 15.0)
    assert d is not None and "xid_total" not in d.increases, "its 40 earlier ones are no increase"


def test_a_clock_stepped_back_reads_no_interval_and_carries_nothing_younger() -> None:
    util = line("DCGM_FI_DEV_GPU_UTIL", 50)
    first = read(util + _xid_total({"13": 2, "31": 1}))["node-a/0"]
    stepped = read(util + _xid_total({"13": 2}))["node-a/0"]  # 31's line dropped, 10 s earlier by the clock
    assert families.advance(first, stepped, -10.0) is None
    assert all(age >= 0 for age in stepped.carried.values())
    back = read(util + _xid_total({"13": 3, "31": 1}))["node-a/0"]
    d = families.advance(stepped, back, 10.0)
    assert d is not None and d.increases["xid_total"] == 1.0


def test_xid_window_gauge_is_summed_not_differentiated() -> None:
    text = line("DCGM_EXP_XID_ERRORS_COUNT", 2, xid="13", window_size_in_ms="300000") + line(
        "DCGM_EXP_XID_ERRORS_COUNT", 1, xid="79", window_size_in_ms="300000")
    sig = signal_map(text, text)
    assert sig["gpu_xid_errors_window"] == 3.0
    assert "gpu_xid_errors" not in sig


# --- the source as the pipeline uses it -----------------------------------------------------------------


def test_source_shape() -> None:
    src = dcgm.SOURCE
    assert (src.name, src.aggregate, src.families) == ("dcgm", False, dcgm.FAMILIES)
    assert set(dcgm.FAMILIES.expected) == {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP",
                                           "DCGM_FI_DEV_POWER_USAGE"}


# One sample of every family the source reads: between two such scrapes every signal is emitted.
EVERY_FAMILY: dict[str, float | str] = {
    "DCGM_FI_DEV_GPU_UTIL": 10, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.1, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.1,
    "DCGM_FI_PROF_DRAM_ACTIVE": 0.1, "DCGM_FI_DEV_FB_USED": 1, "DCGM_FI_DEV_FB_FREE": 1, "DCGM_FI_DEV_GPU_TEMP": 1,
    "DCGM_FI_DEV_MEMORY_TEMP": 1, "DCGM_FI_DEV_POWER_USAGE": 1, "DCGM_FI_DEV_SM_CLOCK": 1,
    "DCGM_FI_PROF_PCIE_TX_BYTES": 1, "DCGM_FI_PROF_PCIE_RX_BYTES": 1, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 1,
    "DCGM_FI_DEV_XID_ERRORS": 43, "DCGM_EXP_XID_ERRORS_COUNT": 1, "DCGM_EXP_XID_ERRORS_TOTAL": 1,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 1, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 1,
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 1, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 1,
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 1, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
    "DCGM_FI_DEV_THERMAL_VIOLATION": 1, "DCGM_FI_DEV_POWER_VIOLATION": 1,
}


def test_every_emitted_name_is_a_declared_gpu_signal() -> None:
    assert set(steady(EVERY_FAMILY)) == set(dcgm.SIGNALS)


def _scrape(text: str, ts: float) -> ScrapeResult:
    return ScrapeResult(Target("http://node-a:9400/metrics", "gpus", "dcgm-exporter-x", source="dcgm"), ts, ok=True,
                        body=text)


def test_pipeline_derives_per_gpu_signals_without_pool_rollup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sources.SOURCES, "dcgm", dcgm.SOURCE)

    def scrape(energy_mj: float, util: float) -> str:
        return (expo({"DCGM_FI_DEV_GPU_UTIL": util, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": energy_mj}, gpu="0")
                + expo({"DCGM_FI_DEV_GPU_UTIL": 0, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 0}, gpu="1"))

    deriver = SignalDeriver()
    first = deriver.derive([_scrape(scrape(0, 10), 0.0)], 0.0)
    assert not [s for s in first.signals if s.subject.startswith("gpu/")]
    out = deriver.derive([_scrape(scrape(6_000_000, 90), 15.0)], 15.0)
    sig = {(s.subject, s.name): s.value for s in out.signals}
    assert sig[("gpu/node-a/0", "gpu_utilization")] == pytest.approx(0.9)
    assert sig[("gpu/node-a/0", "gpu_energy_joules_rate")] == pytest.approx(400.0)
    assert sig[("gpu/node-a/1", "gpu_energy_joules_rate")] == 0.0
    assert ("pool/gpus", "engines_reporting") not in sig  # GPUs are not engines: nothing to aggregate
    assert not [s for s in out.signals if s.subject.startswith("pod/") and s.name.startswith("gpu_")]
    # This exposition lacks three expected families; the target reports them.
    assert out.missing_families["gpus/dcgm-exporter-x/dcgm"] == ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP",
                                                            "DCGM_FI_DEV_POWER_USAGE"]
    assert all(isinstance(s, Signal) for s in out.signals)


def test_a_gpu_shared_by_pods_is_read_once_not_summed() -> None:
    # --kubernetes-virtual-gpus: one copy of every series per pod on the GPU. Summed, 61 °C twice read 122 °C and an
    # application XID (31) twice a hardware one (62), which proposes cordoning the node.
    shared = "".join(expo({"DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_XID_ERRORS": 31, "DCGM_FI_DEV_POWER_USAGE": 300},
                          pod=pod, namespace="llm", vgpu=str(i)) for i, pod in enumerate(("decode-0", "decode-1")))
    sig = steady_text(shared)
    assert (sig["gpu_temperature_celsius"], sig["gpu_xid_last"], sig["gpu_power_watts"]) == (61.0, 31.0, 300.0)
    # Series that differ by more than their pod stay apart and are summed: the XIDs in the window, by code.
    window = "".join(line("DCGM_EXP_XID_ERRORS_COUNT", n, xid=xid, pod=pod) for pod in ("decode-0", "decode-1")
                     for xid, n in (("13", 2), ("79", 1)))
    assert steady_text(window)["gpu_xid_errors_window"] == 3.0


def test_a_shared_gpus_counters_do_not_restart_when_its_pods_change() -> None:
    # The copies listed in another order, then one pod gone: the GPU's energy counter is one series throughout.
    def energy(mj: float, pods: tuple[str, ...]) -> str:
        return "".join(line("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", mj, pod=p, vgpu=str(i)) for i, p in enumerate(pods))

    first, swapped, alone = energy(1e12, ("a", "b")), energy(1e12 + 15000, ("b", "a")), energy(1e12 + 30000, ("b",))
    assert signal_map(first, swapped)["gpu_energy_joules_rate"] == pytest.approx(1.0)  # 15 J in 15 s
    assert signal_map(swapped, alone)["gpu_energy_joules_rate"] == pytest.approx(1.0)
    assert read(first)["node-a/0"].attrs["pod"] == "a", "the first copy's pod attributes the GPU"


def steady_text(text: str) -> dict[str, float]:
    return signal_map(text, text)
