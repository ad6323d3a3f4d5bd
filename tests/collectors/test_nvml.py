"""NVML collector against a fake NVML module: every signal, rates between calls, refused calls, NvmlUnavailable."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from collectors import dcgm
from collectors import nvml as nvml_mod
from collectors.nvml import NvmlCollector, NvmlUnavailable, open_nvml

ROOT = Path(__file__).resolve().parents[2]
NOT_SUPPORTED = 3
INVALID_ARGUMENT = 2
LIBRARY_NOT_FOUND = 12
_MESSAGES = {NOT_SUPPORTED: "Not Supported", INVALID_ARGUMENT: "Invalid Argument",
             LIBRARY_NOT_FOUND: "NVML Shared Library Not Found"}


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError: carries the NVML return code in `value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    """What one fake device reports; `refuses` names NVML functions that answer NOT_SUPPORTED."""

    util_pct: int = 50
    used: int = 60 * 2**30
    free: int = 20 * 2**30
    temp: int = 61
    power_mw: int = 350_000
    sm_clock: int = 1755
    energy_mj: int = 1_000_000
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    pcie_tx_kbps: int = 1000
    pcie_rx_kbps: int = 3000
    replays: int = 0
    power_violation_ns: int = 0
    thermal_violation_ns: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)  # corrected, uncorrectable, pending, failure
    refuses: set[str] = field(default_factory=set)


class FakeNvml:
    """The slice of pynvml the collector uses; constants carry pynvml's values."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_PERF_POLICY_POWER = 0
    NVML_PERF_POLICY_THERMAL = 1

    def __init__(self, *gpus: FakeGpu) -> None:
        self.gpus = list(gpus)
        self.init_error: int | None = None
        self.refuse_count = False
        self.refuse_handles: set[int] = set()
        self.shutdowns = 0

    def _gpu(self, handle: int, fn: str) -> FakeGpu:
        gpu = self.gpus[handle]
        if fn in gpu.refuses:
            raise FakeNVMLError(NOT_SUPPORTED)
        return gpu

    @staticmethod
    def _expect(arg: int, *allowed: int) -> None:
        if arg not in allowed:
            raise FakeNVMLError(INVALID_ARGUMENT)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.refuse_count:
            raise FakeNVMLError(NOT_SUPPORTED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index in self.refuse_handles:
            raise FakeNVMLError(NOT_SUPPORTED)
        return index

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._gpu(h, "nvmlDeviceGetUtilizationRates").util_pct, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=g.used + g.free, used=g.used, free=g.free)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        self._expect(sensor, self.NVML_TEMPERATURE_GPU)
        return self._gpu(h, "nvmlDeviceGetTemperature").temp

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        self._expect(clock, self.NVML_CLOCK_SM)
        return self._gpu(h, "nvmlDeviceGetClockInfo").sm_clock

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter_type: int) -> int:
        self._expect(counter_type, self.NVML_VOLATILE_ECC)
        g = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        if error_type == self.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return g.ecc_corrected
        self._expect(error_type, self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        return g.ecc_uncorrected

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        self._expect(counter, self.NVML_PCIE_UTIL_TX_BYTES, self.NVML_PCIE_UTIL_RX_BYTES)
        g = self._gpu(h, "nvmlDeviceGetPcieThroughput")
        return g.pcie_tx_kbps if counter == self.NVML_PCIE_UTIL_TX_BYTES else g.pcie_rx_kbps

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetPcieReplayCounter").replays

    def nvmlDeviceGetViolationStatus(self, h: int, policy: int) -> SimpleNamespace:
        self._expect(policy, self.NVML_PERF_POLICY_POWER, self.NVML_PERF_POLICY_THERMAL)
        g = self._gpu(h, "nvmlDeviceGetViolationStatus")
        ns = g.power_violation_ns if policy == self.NVML_PERF_POLICY_POWER else g.thermal_violation_ns
        return SimpleNamespace(referenceTime=0, violationTime=ns)

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._gpu(h, "nvmlDeviceGetRemappedRows").remapped


def by_key(signals: list[Any]) -> dict[tuple[str, str], float]:
    return {(s.subject, s.name): s.value for s in signals}


@pytest.fixture
def fake() -> FakeNvml:
    # GPU 1 has no energy counter (NOT_SUPPORTED), as on boards before Volta.
    return FakeNvml(FakeGpu(), FakeGpu(util_pct=0, refuses={"nvmlDeviceGetTotalEnergyConsumption"}))


# --- gauges ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("gpu_utilization", 0.5, id="utilization-percent-to-ratio"),
        pytest.param("gpu_memory_used_bytes", 60 * 2**30, id="memory-used-bytes"),
        pytest.param("gpu_memory_free_bytes", 20 * 2**30, id="memory-free-bytes"),
        pytest.param("gpu_temperature_celsius", 61, id="temperature"),
        pytest.param("gpu_power_watts", 350.0, id="power-mw-to-watts"),
        pytest.param("gpu_sm_clock_mhz", 1755, id="sm-clock"),
        pytest.param("gpu_pcie_tx_bytes_rate", 1000 * 1024, id="pcie-tx-kb-to-bytes"),
        pytest.param("gpu_pcie_rx_bytes_rate", 3000 * 1024, id="pcie-rx-kb-to-bytes"),
        pytest.param("gpu_row_remap_failure", 0, id="row-remap-failure"),
    ],
)
def test_gauges_on_the_first_call(fake: FakeNvml, name: str, expected: float) -> None:
    sig = by_key(NvmlCollector(fake, "node-a").collect(100.0))
    assert sig[("gpu/node-a/0", name)] == pytest.approx(expected)


def test_subjects_are_host_and_index(fake: FakeNvml) -> None:
    signals = NvmlCollector(fake, "node-a").collect(100.0)
    assert {s.subject for s in signals} == {"gpu/node-a/0", "gpu/node-a/1"}
    assert all(s.ts == 100.0 for s in signals)


def test_first_call_has_no_rates(fake: FakeNvml) -> None:
    names = {s.name for s in NvmlCollector(fake, "node-a").collect(100.0)}
    assert not {n for n in names if n.endswith("_rate") and "pcie_tx" not in n and "pcie_rx" not in n}
    assert "gpu_remapped_rows_uncorrectable" not in names


# --- rates between two calls ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attr", "before", "after", "seconds", "name", "expected"),
    [
        pytest.param("energy_mj", 1_000_000, 1_450_000, 15, "gpu_energy_joules_rate", 30.0, id="energy-mj-to-watts"),
        pytest.param("energy_mj", 5_000_000, 600_000, 15, "gpu_energy_joules_rate", 40.0, id="energy-after-reset"),
        pytest.param("ecc_corrected", 4, 34, 10, "gpu_ecc_sbe_rate", 3.0, id="ecc-corrected"),
        pytest.param("ecc_uncorrected", 0, 1, 20, "gpu_ecc_dbe_rate", 0.05, id="ecc-uncorrected"),
        pytest.param("replays", 10, 40, 15, "gpu_pcie_replay_rate", 2.0, id="pcie-replays"),
        pytest.param("power_violation_ns", 0, 15_000_000_000, 15, "gpu_power_violation_seconds_rate", 1.0,
                     id="power-violation-ns"),
        pytest.param("thermal_violation_ns", 2_000_000_000, 5_000_000_000, 30, "gpu_thermal_violation_seconds_rate", 0.1,
                     id="thermal-violation-ns"),
    ],
)
def test_rates_between_two_calls(fake: FakeNvml, attr: str, before: int, after: int, seconds: float, name: str,
                                 expected: float) -> None:
    collector = NvmlCollector(fake, "node-a")
    setattr(fake.gpus[0], attr, before)
    collector.collect(1000.0)
    setattr(fake.gpus[0], attr, after)
    sig = by_key(collector.collect(1000.0 + seconds))
    assert sig[("gpu/node-a/0", name)] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [pytest.param(2, 3, 1.0, id="one-new-row"), pytest.param(2, 2, 0.0, id="unchanged")],
)
def test_remapped_rows_are_an_increase(fake: FakeNvml, before: int, after: int, expected: float) -> None:
    collector = NvmlCollector(fake, "node-a")
    fake.gpus[0].remapped = (0, before, 0, 0)
    collector.collect(0.0)
    fake.gpus[0].remapped = (0, after, 0, 1)
    sig = by_key(collector.collect(15.0))
    assert sig[("gpu/node-a/0", "gpu_remapped_rows_uncorrectable")] == expected
    assert sig[("gpu/node-a/0", "gpu_row_remap_failure")] == 1.0


@pytest.mark.parametrize("second", [pytest.param(100.0, id="same-time"), pytest.param(90.0, id="time-went-back")])
def test_no_rate_without_elapsed_time(fake: FakeNvml, second: float) -> None:
    collector = NvmlCollector(fake, "node-a")
    collector.collect(100.0)
    fake.gpus[0].energy_mj += 1000
    assert ("gpu/node-a/0", "gpu_energy_joules_rate") not in by_key(collector.collect(second))


def test_rate_spans_a_refused_read(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake, "node-a")
    gpu = fake.gpus[0]
    gpu.energy_mj = 1_000_000
    collector.collect(0.0)
    gpu.refuses.add("nvmlDeviceGetTotalEnergyConsumption")
    assert ("gpu/node-a/0", "gpu_energy_joules_rate") not in by_key(collector.collect(10.0))
    gpu.refuses.clear()
    gpu.energy_mj = 7_000_000
    assert by_key(collector.collect(20.0))[("gpu/node-a/0", "gpu_energy_joules_rate")] == pytest.approx(300.0)


# --- refused calls never fail the collection ------------------------------------------------------------


def test_not_supported_skips_one_signal_of_one_device(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake, "node-a")
    collector.collect(0.0)
    fake.gpus[0].energy_mj += 3_000_000
    sig = by_key(collector.collect(10.0))
    assert sig[("gpu/node-a/0", "gpu_energy_joules_rate")] == pytest.approx(300.0)
    assert ("gpu/node-a/1", "gpu_energy_joules_rate") not in sig
    assert sig[("gpu/node-a/1", "gpu_utilization")] == 0.0  # the rest of GPU 1 is there
    names_0 = {n for s, n in sig if s == "gpu/node-a/0"}
    names_1 = {n for s, n in sig if s == "gpu/node-a/1"}
    assert names_0 - names_1 == {"gpu_energy_joules_rate"}
    assert collector.errors == ["gpu 1: energy: Not Supported"]


@pytest.mark.parametrize(
    ("refused", "missing"),
    [
        pytest.param("nvmlDeviceGetUtilizationRates", {"gpu_utilization"}, id="utilization"),
        pytest.param("nvmlDeviceGetMemoryInfo", {"gpu_memory_used_bytes", "gpu_memory_free_bytes"}, id="memory"),
        pytest.param("nvmlDeviceGetTemperature", {"gpu_temperature_celsius"}, id="temperature"),
        pytest.param("nvmlDeviceGetPowerUsage", {"gpu_power_watts"}, id="power"),
        pytest.param("nvmlDeviceGetClockInfo", {"gpu_sm_clock_mhz"}, id="sm-clock"),
        pytest.param("nvmlDeviceGetPcieThroughput", {"gpu_pcie_tx_bytes_rate", "gpu_pcie_rx_bytes_rate"}, id="pcie"),
        pytest.param("nvmlDeviceGetTotalEccErrors", {"gpu_ecc_sbe_rate", "gpu_ecc_dbe_rate"}, id="ecc-disabled"),
        pytest.param("nvmlDeviceGetPcieReplayCounter", {"gpu_pcie_replay_rate"}, id="pcie-replays"),
        pytest.param("nvmlDeviceGetViolationStatus",
                     {"gpu_power_violation_seconds_rate", "gpu_thermal_violation_seconds_rate"}, id="violations"),
        pytest.param("nvmlDeviceGetRemappedRows", {"gpu_remapped_rows_uncorrectable", "gpu_row_remap_failure"},
                     id="remapped-rows"),
    ],
)
def test_each_refused_call_drops_only_its_signals(refused: str, missing: set[str]) -> None:
    full = FakeNvml(FakeGpu())
    partial = FakeNvml(FakeGpu(refuses={refused}))
    names = []
    for fake in (full, partial):
        collector = NvmlCollector(fake, "h")
        collector.collect(0.0)
        names.append({s.name for s in collector.collect(10.0)})
    assert names[0] - names[1] == missing
    assert names[1] <= names[0]


def test_a_call_missing_from_an_old_pynvml_is_skipped() -> None:
    # An nvidia-ml-py that predates the call.
    old_nvml = type("OldNvml", (FakeNvml,), {"nvmlDeviceGetRemappedRows": None})
    collector = NvmlCollector(old_nvml(FakeGpu()), "h")
    names = {s.name for s in collector.collect(0.0)}
    assert "gpu_row_remap_failure" not in names and "gpu_power_watts" in names
    assert collector.errors == ["gpu 0: remapped rows: nvmlDeviceGetRemappedRows is not in this pynvml"]


def test_a_device_without_handle_is_skipped(fake: FakeNvml) -> None:
    fake.refuse_handles = {0}
    collector = NvmlCollector(fake, "node-a")
    assert {s.subject for s in collector.collect(0.0)} == {"gpu/node-a/1"}
    assert collector.errors[0] == "gpu 0: handle: Not Supported"


def test_no_device_count_means_no_signals(fake: FakeNvml) -> None:
    fake.refuse_count = True
    collector = NvmlCollector(fake, "node-a")
    assert collector.collect(0.0) == []
    assert collector.errors == ["device count: Not Supported"]


def test_errors_describe_only_the_last_collect(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake, "node-a")
    collector.collect(0.0)
    fake.gpus[1].refuses.clear()
    collector.collect(10.0)
    assert collector.errors == []


def test_names_are_the_shared_gpu_signals(fake: FakeNvml) -> None:
    collector = NvmlCollector(fake, "node-a")
    collector.collect(0.0)
    names = {s.name for s in collector.collect(10.0)}
    assert names <= set(dcgm.SIGNALS)
    # What DCGM has and NVML does not: PROF activity ratios, memory temperature, NVLink and XIDs.
    assert set(dcgm.SIGNALS) - names == {
        "gpu_engine_active", "gpu_tensor_active", "gpu_dram_active", "gpu_memory_temperature_celsius",
        "gpu_nvlink_bytes_rate", "gpu_xid_last", "gpu_xid_errors", "gpu_xid_errors_window",
    }


# --- opening NVML ---------------------------------------------------------------------------------------


def test_open_nvml_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py package .* not installed"):
        open_nvml()


def test_open_nvml_without_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()
    fake.init_error = LIBRARY_NOT_FOUND
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(NvmlUnavailable, match="nvmlInit failed: NVML Shared Library Not Found"):
        open_nvml()


def test_open_nvml_initialises_and_returns_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(FakeGpu())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert open_nvml() is fake


def test_module_imports_without_pynvml() -> None:
    code = "import sys; sys.modules['pynvml'] = None; import collectors.nvml; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_fake_matches_the_real_pynvml_names() -> None:
    import pynvml  # nvidia-ml-py is a test dependency: it imports without a GPU
    used = [n for n in vars(FakeNvml) if n.startswith(("nvml", "NVML"))]
    assert [n for n in used if not hasattr(pynvml, n)] == []
    constants = {n: getattr(FakeNvml, n) for n in used if n.startswith("NVML_")}
    assert {n: getattr(pynvml, n) for n in constants} == constants


# --- python -m collectors.nvml --------------------------------------------------------------------------


def test_main_prints_json_lines_with_rates(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeNvml(FakeGpu(), FakeGpu(refuses={"nvmlDeviceGetTotalEnergyConsumption"}))
    clock = iter([100.0, 101.0])

    def sleep(seconds: float) -> None:
        fake.gpus[0].energy_mj += 250_000  # 250 J in one second

    monkeypatch.setattr(nvml_mod, "open_nvml", lambda: fake)
    monkeypatch.setattr(nvml_mod, "time", SimpleNamespace(time=lambda: next(clock), sleep=sleep))
    assert nvml_mod.main(["--hostname", "node-a", "--interval", "1"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(row) for row in out.splitlines()]
    assert {r["subject"] for r in rows} == {"gpu/node-a/0", "gpu/node-a/1"}
    assert {r["ts"] for r in rows} == {101.0}
    energy = [r["value"] for r in rows if r["name"] == "gpu_energy_joules_rate"]
    assert energy == [pytest.approx(250.0)]
    assert "skipped gpu 1: energy: Not Supported" in err
    assert fake.shutdowns == 1


def test_main_once_without_interval(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeNvml(FakeGpu())
    monkeypatch.setattr(nvml_mod, "open_nvml", lambda: fake)
    assert nvml_mod.main(["--hostname", "h", "--interval", "0"]) == 0
    names = {json.loads(row)["name"] for row in capsys.readouterr().out.splitlines()}
    assert "gpu_power_watts" in names and "gpu_energy_joules_rate" not in names


def test_main_reports_nvml_unavailable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def unavailable() -> Any:
        raise NvmlUnavailable("nvmlInit failed: Driver Not Loaded")

    monkeypatch.setattr(nvml_mod, "open_nvml", unavailable)
    assert nvml_mod.main(["--interval", "0"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "nvml unavailable: nvmlInit failed: Driver Not Loaded" in err
