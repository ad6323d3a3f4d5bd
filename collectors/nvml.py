"""Direct GPU collection through NVML, for nodes without dcgm-exporter.

`NvmlCollector` reads every GPU of this node through an NVML module object (`pynvml` from the
nvidia-ml-py package, or a fake in tests) and produces the same signals as `collectors.dcgm`,
for subjects `gpu/<hostname>/<index>`. Counters (energy, ECC, PCIe replays, violation time)
become rates between two `collect` calls, with the time passed in; remapped rows an increase. A
call NVML refuses (not supported, no permission, ...) or an older pynvml lacks skips that one
signal. `pynvml` is imported only by `open_nvml`, so this module imports where it is absent.

`python -m collectors.nvml` prints one collection as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from collectors.dcgm import gpu_subject
from collectors.derive import counter_increase
from collectors.types import Signal

__all__ = ["NvmlCollector", "NvmlUnavailable", "main", "open_nvml"]

NvmlModule = Any  # `pynvml`, or any object with the same functions, constants and NVMLError

KIB = 1024.0


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine; the message says why (package, library or driver)."""


def open_nvml() -> NvmlModule:
    """Import `pynvml` and initialise NVML; raises NvmlUnavailable naming the reason."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable("the nvidia-ml-py package (module pynvml) is not installed") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"nvmlInit failed: {exc} (no NVIDIA driver or GPU on this machine?)") from exc
    return pynvml


class NvmlCollector:
    """Reads the GPUs of one host through NVML; keeps the previous counter values for rates."""

    def __init__(self, nvml: NvmlModule, hostname: str) -> None:
        self._nvml = nvml
        self.hostname = hostname
        self._prev: dict[tuple[int, str], tuple[float, float]] = {}  # (index, counter) -> (ts, value)
        self.errors: list[str] = []  # what the last collect skipped, and why

    def collect(self, ts: float) -> list[Signal]:
        """One reading of every GPU at time `ts`; rates need a previous call."""
        self.errors = []
        out: list[Signal] = []
        count = self._call("device count", "nvmlDeviceGetCount")
        if count is None:
            return out
        for index in range(int(count)):
            handle = self._call(f"gpu {index}: handle", "nvmlDeviceGetHandleByIndex", index)
            if handle is not None:
                out.extend(self._device(index, handle, ts))
        return out

    def _call(self, what: str, function: str, *args: Any) -> Any:
        fn: Callable[..., Any] | None = getattr(self._nvml, function, None)
        if fn is None:  # an nvidia-ml-py older than the call
            self.errors.append(f"{what}: {function} is not in this pynvml")
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            self.errors.append(f"{what}: {exc}")
            return None

    def _device(self, index: int, handle: Any, ts: float) -> list[Signal]:
        nv = self._nvml
        subject = gpu_subject(self.hostname, str(index))
        out: list[Signal] = []

        def emit(name: str, value: float | None) -> None:
            if value is not None:
                out.append(Signal(ts, subject, name, float(value)))

        def read(name: str, function: str, *args: Any) -> Any:
            return self._call(f"gpu {index}: {name}", function, handle, *args)

        def rate(name: str, key: str, value: float | None, scale: float = 1.0) -> None:
            # Rate of a cumulative counter since the last successful read of this counter.
            if value is None:
                return
            prev = self._prev.get((index, key))
            self._prev[(index, key)] = (ts, float(value))
            if prev is None or ts <= prev[0]:
                return
            inc = counter_increase(prev[1], float(value))
            if inc is not None:
                emit(name, inc * scale / (ts - prev[0]))

        def increase(name: str, key: str, value: float | None) -> None:
            if value is None:
                return
            prev = self._prev.get((index, key))
            self._prev[(index, key)] = (ts, float(value))
            if prev is not None:
                emit(name, counter_increase(prev[1], float(value)))

        util = read("utilization", "nvmlDeviceGetUtilizationRates")
        emit("gpu_utilization", None if util is None else util.gpu / 100.0)
        mem = read("memory", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            emit("gpu_memory_used_bytes", mem.used)
            emit("gpu_memory_free_bytes", mem.free)
        emit("gpu_temperature_celsius", read("temperature", "nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU))
        power_mw = read("power", "nvmlDeviceGetPowerUsage")
        emit("gpu_power_watts", None if power_mw is None else power_mw / 1000.0)
        emit("gpu_sm_clock_mhz", read("sm clock", "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM))
        for direction, counter in (("tx", nv.NVML_PCIE_UTIL_TX_BYTES), ("rx", nv.NVML_PCIE_UTIL_RX_BYTES)):
            kbps = read(f"pcie {direction}", "nvmlDeviceGetPcieThroughput", counter)
            emit(f"gpu_pcie_{direction}_bytes_rate", None if kbps is None else kbps * KIB)

        rate("gpu_energy_joules_rate", "energy_mj", read("energy", "nvmlDeviceGetTotalEnergyConsumption"), 1e-3)
        for name, kind, err_type in (("gpu_ecc_sbe_rate", "corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                     ("gpu_ecc_dbe_rate", "uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            errors = read(f"ecc {kind}", "nvmlDeviceGetTotalEccErrors", err_type, nv.NVML_VOLATILE_ECC)
            rate(name, name, errors)
        rate("gpu_pcie_replay_rate", "pcie_replay", read("pcie replay", "nvmlDeviceGetPcieReplayCounter"))
        for name, kind, policy in (("gpu_power_violation_seconds_rate", "power", nv.NVML_PERF_POLICY_POWER),
                                   ("gpu_thermal_violation_seconds_rate", "thermal", nv.NVML_PERF_POLICY_THERMAL)):
            violation = read(f"{kind} violation", "nvmlDeviceGetViolationStatus", policy)
            rate(name, name, None if violation is None else violation.violationTime, 1e-9)  # ns
        rows = read("remapped rows", "nvmlDeviceGetRemappedRows")
        if rows is not None:
            _corrected, uncorrectable, _pending, failure = rows
            increase("gpu_remapped_rows_uncorrectable", "remapped_uncorrectable", uncorrectable)
            emit("gpu_row_remap_failure", failure)
        return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print one collection of this node's GPUs as JSON lines; skipped calls go to stderr."""
    parser = argparse.ArgumentParser(prog="python -m collectors.nvml", description=main.__doc__)
    parser.add_argument("--hostname", default=socket.gethostname(), help="host part of the subjects")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between the two reads that rates need; 0 reads once (no rates)")
    args = parser.parse_args(argv)
    try:
        nv = open_nvml()
    except NvmlUnavailable as exc:
        print(f"nvml unavailable: {exc}", file=sys.stderr)
        return 1
    try:
        collector = NvmlCollector(nv, args.hostname)
        signals = collector.collect(time.time())
        if args.interval > 0:
            time.sleep(args.interval)
            signals = collector.collect(time.time())
        for s in signals:
            print(json.dumps({"ts": s.ts, "subject": s.subject, "name": s.name, "value": s.value}))
        for err in collector.errors:
            print(f"skipped {err}", file=sys.stderr)
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
