"""dcgm-exporter `/metrics` families mapped to per-GPU readings and the shared GPU signals.

An entity is one GPU, `<hostname>/<gpu index>`, or one MIG instance, `<hostname>/<gpu>/<GPU_I_ID>`.
Both hostname label keys are read: `Hostname` (releases up to 4.5.3) and `hostname` (main). The
lowercase 1.x compatibility names (`dcgm_gpu_utilization`, ...) are read as older spellings.
DCGM's sentinel values (blank, not found, not supported, no permission) count as missing. The
signal names here are shared with the NVML collector (`collectors/nvml.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from collectors.families import Delta, FamilyMap, FamilySource, Reading, SignalList, read
from collectors.types import Sample, Signal, Target

__all__ = ["FAMILIES", "SIGNALS", "SOURCE", "gpu_subject", "is_blank", "read_gpus", "signals"]

MIB = 1048576.0

FAMILIES = FamilyMap(
    counters={
        "energy_mj": ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "dcgm_total_energy_consumption"),
        "pcie_replay": ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "dcgm_pcie_replay_counter"),
        "xid_total": ("DCGM_EXP_XID_ERRORS_TOTAL",),
        "ecc_sbe": ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "dcgm_ecc_sbe_volatile_total"),
        "ecc_dbe": ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "dcgm_ecc_dbe_volatile_total"),
        "remapped_uncorrectable": ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",),
        "thermal_violation_ns": ("DCGM_FI_DEV_THERMAL_VIOLATION", "dcgm_thermal_violation"),
        "power_violation_ns": ("DCGM_FI_DEV_POWER_VIOLATION", "dcgm_power_violation"),
    },
    gauges={
        "gpu_util_pct": ("DCGM_FI_DEV_GPU_UTIL", "dcgm_gpu_utilization"),
        "engine_active": ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "dcgm_fi_prof_gr_engine_active"),
        "tensor_active": ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "dcgm_fi_prof_pipe_tensor_active"),
        "dram_active": ("DCGM_FI_PROF_DRAM_ACTIVE", "dcgm_fi_prof_dram_active"),
        "fb_used_mib": ("DCGM_FI_DEV_FB_USED", "dcgm_fb_used"),
        "fb_free_mib": ("DCGM_FI_DEV_FB_FREE", "dcgm_fb_free"),
        "gpu_temp": ("DCGM_FI_DEV_GPU_TEMP", "dcgm_gpu_temp"),
        "memory_temp": ("DCGM_FI_DEV_MEMORY_TEMP", "dcgm_memory_temp"),
        "power_w": ("DCGM_FI_DEV_POWER_USAGE", "dcgm_power_usage"),
        "sm_clock": ("DCGM_FI_DEV_SM_CLOCK", "dcgm_sm_clock"),
        # The 1.x file declares these two `counter`, but the DCGM field is the same bytes/s rate.
        "pcie_tx_bps": ("DCGM_FI_PROF_PCIE_TX_BYTES", "dcgm_fi_prof_pcie_tx_bytes"),
        "pcie_rx_bps": ("DCGM_FI_PROF_PCIE_RX_BYTES", "dcgm_fi_prof_pcie_rx_bytes"),
        # NVML's PCIe throughput in KB/s, the default before the PROF fields; read when those are absent.
        "pcie_tx_kbps": ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "dcgm_pcie_tx_throughput"),
        "pcie_rx_kbps": ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "dcgm_pcie_rx_throughput"),
        # Field 449 is typed `counter` in released CSVs, yet DCGM publishes an instantaneous MiB/s
        # rate (dcgm-exporter#417, #658): its increase is meaningless, its value is the throughput.
        "nvlink_mibps": ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "dcgm_nvlink_bandwidth_total"),
        "xid_last": ("DCGM_FI_DEV_XID_ERRORS", "dcgm_xid_errors"),
        # A gauge: XIDs seen within the exporter's window (-x, 5 min), not a running count.
        "xid_window": ("DCGM_EXP_XID_ERRORS_COUNT",),
        "row_remap_failure": ("DCGM_FI_DEV_ROW_REMAP_FAILURE",),
    },
    expected=("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"),
)

SIGNALS: tuple[str, ...] = (
    "gpu_utilization",
    "gpu_engine_active",
    "gpu_tensor_active",
    "gpu_dram_active",
    "gpu_memory_used_bytes",
    "gpu_memory_free_bytes",
    "gpu_temperature_celsius",
    "gpu_memory_temperature_celsius",
    "gpu_power_watts",
    "gpu_sm_clock_mhz",
    "gpu_energy_joules_rate",
    "gpu_pcie_tx_bytes_rate",
    "gpu_pcie_rx_bytes_rate",
    "gpu_nvlink_bytes_rate",
    "gpu_pcie_replay_rate",
    "gpu_xid_last",
    "gpu_xid_errors",
    "gpu_xid_errors_window",
    "gpu_ecc_sbe_rate",
    "gpu_ecc_dbe_rate",
    "gpu_remapped_rows_uncorrectable",
    "gpu_row_remap_failure",
    "gpu_thermal_violation_seconds_rate",
    "gpu_power_violation_seconds_rate",
)
"""Every signal name a GPU collector (this one or NVML) may emit."""

# Older exporters printed DCGM's sentinels instead of skipping them: the int64 ones start at
# 0x7ffffffffffffff0 (blank, not found, not supported, no permission); the fp64 ones at 2**47.
_INT64_BLANK = 9.2e18
_FP64_BLANKS = frozenset(float(2**47 + i) for i in range(4))

# Label -> attribute kept on the reading; where two labels name the same attribute the first wins
# (the current spelling before the `--use-old-namespace` one).
_ATTR_LABELS: tuple[tuple[str, str], ...] = (
    ("hostname", "hostname"),
    ("Hostname", "hostname"),
    ("UUID", "UUID"),
    ("uuid", "UUID"),
    ("modelName", "modelName"),
    ("pci_bus_id", "pci_bus_id"),
    ("device", "device"),
    ("GPU_I_ID", "GPU_I_ID"),
    ("GPU_I_PROFILE", "GPU_I_PROFILE"),
    ("DCGM_FI_DRIVER_VERSION", "DCGM_FI_DRIVER_VERSION"),
    ("pod", "pod"),
    ("pod_name", "pod"),
    ("namespace", "namespace"),
    ("pod_namespace", "namespace"),
    ("container", "container"),
    ("container_name", "container"),
    ("pod_uid", "pod_uid"),
)


def is_blank(value: float) -> bool:
    """True for DCGM's sentinel values (and NaN): the field has no reading."""
    return math.isnan(value) or value >= _INT64_BLANK or value in _FP64_BLANKS


def gpu_subject(hostname: str, device: str) -> str:
    """Subject naming: GPUs are `gpu/<hostname>/<gpu index>[/<MIG instance>]`."""
    return f"gpu/{hostname}/{device}"


def _hostname(labels: Mapping[str, str]) -> str:
    return labels.get("hostname") or labels.get("Hostname") or ""


def _entity(labels: Mapping[str, str]) -> str | None:
    gpu = labels.get("gpu")
    # NVLink and NVSwitch entity series carry `gpu` too, but describe a link or a switch.
    if not gpu or labels.get("nvlink") or labels.get("nvswitch"):
        return None
    key = f"{_hostname(labels)}/{gpu}"
    mig = labels.get("GPU_I_ID")
    return f"{key}/{mig}" if mig else key


def _attrs(labels: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for label, attr in _ATTR_LABELS:
        value = labels.get(label)
        if value:  # older releases printed empty pod labels for GPUs without a pod
            out.setdefault(attr, value)
    return out


# Labels that only say which pod uses a GPU: with `--kubernetes-virtual-gpus` (GPUs shared by time-slicing) the
# exporter prints one copy of each GPU series per pod (and `vgpu`), all of the same reading.
_POD_LABELS = frozenset({"pod", "pod_name", "namespace", "pod_namespace", "container", "container_name", "pod_uid",
                         "vgpu"})


def read_gpus(samples: Iterable[Sample]) -> dict[str, Reading]:
    """A target's samples as readings per GPU or MIG instance; sentinel values are left out, and the per-pod copies of
    a shared GPU's series are read once (summed, two pods at 61 °C would read 122 °C, and XID 31 twice XID 62)."""
    kept: list[Sample] = []
    blank: list[Sample] = []
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    attrs: dict[str, dict[str, str]] = {}
    for s in samples:
        if s.name not in FAMILIES.index() or (entity := _entity(s.labels)) is None:
            continue
        attrs.setdefault(entity, _attrs(s.labels))
        # The GPU's series, whichever pod's copy comes first: keyed by its pod, a copy listed in another order, or a
        # pod that left, would read as a new series and count a counter's whole history at once.
        labels = {k: v for k, v in s.labels.items() if k not in _POD_LABELS}
        series = (s.name, frozenset(labels.items()))
        if series in seen:
            continue
        seen.add(series)
        (blank if is_blank(s.value) else kept).append(Sample(s.name, labels, s.value, s.timestamp))
    readings = read(kept, FAMILIES, _entity, lambda labels: attrs.get(_entity(labels) or "", {}))
    # A blank family is still exposed: record it, so only a real absence reads as missing.
    for s in blank:
        entity = _entity(s.labels)
        if s.name not in FAMILIES.index() or entity is None:
            continue
        reading = readings.get(entity)
        if reading is None:
            reading = readings[entity] = Reading(attrs=attrs.get(entity, {}))
        reading.families.add(s.name)
        kind, key, _, _ = FAMILIES.index()[s.name]
        reading.not_read(kind, key)
    return readings


def signals(d: Delta, ts: float, subject: str) -> list[Signal]:
    """Turn one GPU's delta into the shared GPU signals for `subject` at time `ts`."""
    out = SignalList(ts, subject)
    emit = out.emit

    def gauge(key: str, scale: float = 1.0) -> float | None:
        values = d.gauges.get(key)
        return sum(values) / len(values) * scale if values else None

    inc = d.increases
    per_s = 1.0 / d.seconds

    def rate(key: str, scale: float = 1.0) -> float | None:
        value = inc.get(key)
        return None if value is None else value * scale * per_s

    emit("gpu_utilization", gauge("gpu_util_pct", 0.01))
    emit("gpu_engine_active", gauge("engine_active"))
    emit("gpu_tensor_active", gauge("tensor_active"))
    emit("gpu_dram_active", gauge("dram_active"))
    emit("gpu_memory_used_bytes", gauge("fb_used_mib", MIB))
    emit("gpu_memory_free_bytes", gauge("fb_free_mib", MIB))
    emit("gpu_temperature_celsius", gauge("gpu_temp"))
    emit("gpu_memory_temperature_celsius", gauge("memory_temp"))
    emit("gpu_power_watts", gauge("power_w"))
    emit("gpu_sm_clock_mhz", gauge("sm_clock"))
    emit("gpu_energy_joules_rate", rate("energy_mj", 1e-3))
    for direction in ("tx", "rx"):
        bps = gauge(f"pcie_{direction}_bps")
        emit(f"gpu_pcie_{direction}_bytes_rate", bps if bps is not None else gauge(f"pcie_{direction}_kbps", 1024.0))
    emit("gpu_nvlink_bytes_rate", gauge("nvlink_mibps", MIB))
    emit("gpu_pcie_replay_rate", rate("pcie_replay"))
    xid = gauge("xid_last")
    if xid:  # the code of the last XID; 0 means none was seen
        emit("gpu_xid_last", xid)
    emit("gpu_xid_errors", inc.get("xid_total"))
    emit("gpu_xid_errors_window", gauge("xid_window"))
    emit("gpu_ecc_sbe_rate", rate("ecc_sbe"))
    emit("gpu_ecc_dbe_rate", rate("ecc_dbe"))
    emit("gpu_remapped_rows_uncorrectable", inc.get("remapped_uncorrectable"))
    emit("gpu_row_remap_failure", gauge("row_remap_failure"))
    emit("gpu_thermal_violation_seconds_rate", rate("thermal_violation_ns", 1e-9))
    emit("gpu_power_violation_seconds_rate", rate("power_violation_ns", 1e-9))
    return out


def _subject(target: Target, entity: str) -> str:
    """`gpu/<hostname>/<gpu>[/<GPU_I_ID>]`; the target's pod names a host without a hostname label."""
    host, _, device = entity.partition("/")
    return gpu_subject(host or target.pod, device)


# The dcgm-exporter source: entities are GPUs and MIG instances, never aggregated.
SOURCE = FamilySource("dcgm", FAMILIES, aggregate=False, read=read_gpus, signals=signals, subject_of=_subject)
