"""The Prometheus API source against a real Prometheus, on the windows our collectors used.

Same run as `test_prometheus_agreement.py`: for each of our scrape windows the source evaluates
at our scrape time `s_k` with `window_s` equal to our interval. In `delta` mode its PromQL is the
two-point difference our scraper computes, so every signal it produces (rates, ratios, quantiles,
gauges; per engine and per pool, restart window included) must match ours within 1 %. The
extrapolating `rate` mode is reported, not asserted (on a 2-second staircase it cannot agree).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from catalog.fleet import Role
from collectors.prometheus_api import (
    OBJECTIVE_SIGNALS,
    SIGNALS,
    CounterMode,
    Labels,
    PrometheusSource,
    QueryFailed,
    escape_regex,
    selector,
)
from collectors.types import Objectives, Signal
from controlplane.lab.engine import free_port
from tests.real.prometheus import prometheus_binary
from tests.real.scenario import OBJECTIVES, TOLERANCE, Run, rel_diff

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

NAMES = {spec.name for spec in SIGNALS} | {name for name, _, _ in OBJECTIVE_SIGNALS}
NOT_IN_SIM = {"spec_acceptance_rate", "spec_mean_acceptance_length", "spec_yield"}  # the simulator has no speculative decoding


def _ours(run: Run, k: int) -> dict[tuple[str, str], float]:
    return {(subject, name): v for (kk, subject, name), v in run.ours.items()
            if kk == k and name in NAMES and subject.startswith(("engine/", "pool/"))}


def _theirs(signals: list[Signal]) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for s in signals:
        assert (s.subject, s.name) not in out, f"duplicate {s.subject} {s.name}"
        out[(s.subject, s.name)] = s.value
    return out


def test_delta_mode_agrees_with_our_collectors(prometheus_run: Run) -> None:
    run = prometheus_run
    source = PrometheusSource(run.prometheus.url, mode=CounterMode.DELTA, selector={"job": "vllm"}, timeout=5.0)
    worst: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    try:
        for w in run.windows:
            out = source.signals(w.ts, w.seconds, objectives=OBJECTIVES)
            assert out.unattributed == [] and out.down == []  # every engine answers Prometheus
            assert {(m.signal, m.scope) for m in out.missing} == {(n, "engine") for n in NOT_IN_SIM}
            ours, theirs = _ours(run, w.k), _theirs(out.signals)
            assert set(theirs) == set(ours), (w.k, sorted(set(theirs) ^ set(ours))[:6])
            for key, value in ours.items():
                worst[key[1]] = max(worst[key[1]], rel_diff(value, theirs[key]))
                counts[key[1]] += 1
    finally:
        source.close()
    print("\nPrometheusSource (delta mode) vs ours, max relative difference per signal:")
    for name in sorted(worst):
        print(f"  {name:<26} {worst[name]:.2e} over {counts[name]} values")
    assert set(worst) == NAMES - NOT_IN_SIM
    assert all(v <= TOLERANCE for v in worst.values()), dict(worst)


def test_pool_mapping_stands_in_for_a_missing_pool_label(prometheus_run: Run) -> None:
    run = prometheus_run
    mapping = {t.pod: t.pool for t in run.targets}
    by_label = PrometheusSource(run.prometheus.url, mode="delta")
    by_mapping = PrometheusSource(run.prometheus.url, mode="delta", labels=Labels(pool="no_such_label"))
    try:
        w = run.windows[-1]
        expected = _theirs(by_label.signals(w.ts, w.seconds).signals)
        out = by_mapping.signals(w.ts, w.seconds, pools=mapping)
        assert out.unattributed == []
        assert _theirs(out.signals) == pytest.approx(expected, rel=1e-12)
        assert {m.scope for m in out.missing} == {"engine", "pool/decode", "pool/prefill"}
        # Without the mapping every engine is reported, none is guessed.
        bare = by_mapping.signals(w.ts, w.seconds)
        assert bare.signals == [] and len(bare.unattributed) == len(run.targets)
    finally:
        by_label.close()
        by_mapping.close()


def test_rate_mode_report(prometheus_run: Run) -> None:
    """How far the extrapolating `rate` mode lands from our collectors, over five of our intervals."""
    run = prometheus_run
    span = 5
    source = PrometheusSource(run.prometheus.url, mode="rate")
    diffs: dict[str, list[float]] = defaultdict(list)
    try:
        for w in run.windows[span - 1:]:
            ks = range(w.k - span + 1, w.k + 1)
            out = source.signals(w.ts, w.seconds * span)
            theirs = _theirs(out.signals)
            ours = [_ours(run, k) for k in ks]
            for (subject, name), value in theirs.items():
                if run.restart_k in ks and subject == run.subject(run.restarted):
                    continue  # a mean over a restart is not comparable
                if name in ("request_rate", "prompt_tokens_rate", "generation_tokens_rate"):
                    mean = statistics.fmean(o[(subject, name)] for o in ours)
                elif name == "prefix_cache_hit_rate":  # hits over queries across the five windows
                    queries = [o[(subject, "prefix_cache_query_rate")] for o in ours]
                    mean = sum(o[(subject, name)] * q for o, q in zip(ours, queries, strict=True)) / sum(queries)
                elif name in ("kv_cache_usage", "requests_running"):
                    mean = ours[-1][(subject, name)]  # gauges: the value at ts
                else:
                    continue
                diffs[name].append(rel_diff(mean, value))
    finally:
        source.close()
    print(f"\nPrometheusSource (rate mode, extrapolated, {span} of our intervals) vs ours over the same span:")
    for name in sorted(diffs):
        print(f"  {name:<26} median {statistics.median(diffs[name]):.2%}  max {max(diffs[name]):.2%}"
              f"  over {len(diffs[name])} values")
    # Gauges are read at one instant in both modes.
    assert max(diffs["kv_cache_usage"]) <= TOLERANCE and max(diffs["requests_running"]) <= TOLERANCE


def test_discover_targets_from_series_labels(prometheus_run: Run) -> None:
    run = prometheus_run
    source = PrometheusSource(run.prometheus.url, selector={"job": "vllm"})
    try:
        roles = {"prefill": Role.PREFILL, "decode": Role.DECODE}
        found = source.discover_targets(run.scrape_ts[-1], roles=roles, include_down=True)
    finally:
        source.close()
    assert found == sorted(run.targets, key=lambda t: (t.pool, t.pod, t.url))


def test_escaped_values_parse_in_real_promql_and_errors_translate(prometheus_run: Run) -> None:
    run = prometheus_run
    source = PrometheusSource(run.prometheus.url, retries=0)
    ts = run.scrape_ts[-1]
    weird = 'pre"fill\\\n}|.*'
    try:
        assert source.query(f"up{selector([('pod', '=', weird)])}", ts) == []
        assert len(source.query(f"up{selector([('pod', '!=', weird)])}", ts)) == len(run.targets)
        pods = [weird, "prefill-0", "(.*)"]
        regex = "|".join(escape_regex(p) for p in pods)
        [(labels, _)] = source.query(f"up{selector([('pod', '=~', regex)])}", ts)
        assert labels["pod"] == "prefill-0"
        with pytest.raises(QueryFailed) as caught:
            source.query("sum by (pool) (rate(vllm:prompt_tokens_total[1m])", ts)
        assert caught.value.status == 400 and "parse error" in str(caught.value)
    finally:
        source.close()


@contextmanager
def _serving(tmp_path: Path, lines: list[str]) -> Iterator[PrometheusSource]:
    """A real Prometheus serving `lines` (OpenMetrics samples with timestamps, written as TSDB blocks), read in delta
    mode under `job="vllm"`."""
    (tmp_path / "data.om").write_text("\n".join(lines) + "\n# EOF\n")
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(tmp_path / "data.om"),
                    str(tmp_path / "tsdb")], check=True, capture_output=True, timeout=60)
    (tmp_path / "prometheus.yml").write_text("global: {}\n")
    port = free_port()
    proc = subprocess.Popen([prometheus_binary(), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    source = PrometheusSource(f"http://127.0.0.1:{port}", mode=CounterMode.DELTA, selector={"job": "vllm"}, timeout=5.0)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield source
    finally:
        source.close()
        proc.terminate()
        proc.wait(10)


def _base() -> int:
    return (int(time.time()) // 7200 - 2) * 7200  # two hours back, on a block boundary


def test_delta_mode_divides_by_the_time_between_the_samples_it_read(tmp_path: Path) -> None:
    """Prometheus down for two minutes (its own restart writes no staleness markers): a minute after, `x offset 60s`
    falls back to the sample before the gap, and the increase since spans the gap, not the window."""
    base = _base()
    labels = 'engine="0",instance="10.0.0.1:8000",job="vllm",model_name="m",pod="pod-a",pool="p"'
    times = [base + 15 * i for i in range(41) if not 300 < 15 * i < 420]
    lines = [f'vllm:request_success_total{{{labels},finished_reason="stop"}} {10.0 * (t - base)} {t}' for t in times]
    lines += [f"vllm:num_requests_running{{{labels}}} 5 {t}" for t in times]
    with _serving(tmp_path, lines) as source:
        out = source.signals(base + 435.0, 60.0)  # two scrapes after the gap
    rates = {(s.subject, s.name): s.value for s in out.signals}
    assert rates[("pool/p", "request_rate")] == pytest.approx(10.0), "a steady 10 requests a second"


def test_a_pool_midway_through_an_upgrade_reads_tpot_as_every_engine_has_it(tmp_path: Path) -> None:
    """Pool `p`: one engine on a vLLM with the per-request TPOT histogram beside its inter-token latency, one still
    before it. Read from the first alone, the pool's TPOT p95 was half the pool's (0.049 s); it is the latency both
    have, as the scraper reads it (0.024 s). Pool `q`, upgraded whole, reads the per-request one."""
    base = _base()
    per_request, per_token = "vllm:request_time_per_output_token_seconds", "vllm:inter_token_latency_seconds"

    def histogram(family: str, labels: str, t: int, per_step: int, inside: str) -> list[str]:
        n = per_step * (t - base) // 15  # every observation in the bucket ending at `inside`
        return [f'{family}_bucket{{{labels},le="{le}"}} {n if float(le) >= float(inside) else 0} {t}'
                for le in ("0.01", "0.025", "0.05", "+Inf")] + [f"{family}_count{{{labels}}} {n} {t}",
                                                                 f"{family}_sum{{{labels}}} {n * float(inside)} {t}"]

    lines = []
    for t in range(base, base + 601, 15):
        for pool, pod, new in (("p", "pod-a", True), ("p", "pod-b", False), ("q", "pod-c", True)):
            labels = f'engine="0",instance="{pod}:8000",job="vllm",model_name="m",pod="{pod}",pool="{pool}"'
            lines.append(f"vllm:num_requests_running{{{labels}}} 5 {t}")
            lines += histogram(per_token, labels, t, 100, "0.025")
            if new:
                lines += histogram(per_request, labels, t, 10, "0.05")
    with _serving(tmp_path, lines) as source:
        out = source.signals(base + 300.0, 60.0, objectives={"p": Objectives(tpot=0.03), "q": Objectives(tpot=0.03)})
    read = {(s.subject, s.name): s.value for s in out.signals}
    assert read[("pool/p", "tpot_p95")] == pytest.approx(0.02425)
    assert read[("pool/q", "tpot_p95")] == pytest.approx(0.04875)
    assert read[("engine/p/pod-a/0", "tpot_p95")] == pytest.approx(0.04875)  # an engine reads what it has
    assert read[("pool/p", "tpot_over_slo")] == 0.0 and read[("pool/q", "tpot_over_slo")] == pytest.approx(0.8)
