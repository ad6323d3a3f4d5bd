"""The performance model: profiles read as published, the model through every measured point,
sane extrapolation (monotone, positive), cached prefixes, and the per-pool speed factor."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest

from controlplane.data import read_lines, read_text, shipped
from controlplane.errors import DataError
from controlplane.sim.perf import (
    DYNAMO_DIR,
    DYNAMO_PROFILE,
    SPLITWISE_CSV,
    PerfModel,
    Profile,
    fit,
    load_dynamo,
    load_model,
    load_profiles,
    load_splitwise,
)


@pytest.fixture(scope="module")
def profiles() -> dict[str, Profile]:
    return load_profiles()


@pytest.fixture(scope="module")
def models(profiles: dict[str, Profile]) -> dict[str, PerfModel]:
    return {name: fit(p) for name, p in profiles.items()}


def test_dynamo_profile_matches_its_derived_csv() -> None:
    p = load_dynamo(DYNAMO_DIR)
    assert len(p.prefill) == 17 and len(p.decode) == 41 and p.max_batch == 1024
    rows = list(csv.DictReader(read_lines(shipped("perf/dynamo_h200_llama31_8b_fp8/prefill_derived.csv"))))
    assert [n for n, _ in p.prefill] == [int(r["isl_tokens"]) for r in rows]
    assert [s for _, s in p.prefill] == pytest.approx([float(r["ttft_ms"]) / 1e3 for r in rows])
    rows = list(csv.DictReader(read_lines(shipped("perf/dynamo_h200_llama31_8b_fp8/decode_derived.csv"))))
    assert [(b, c) for b, c, _ in p.decode] == [(int(float(r["implied_concurrency"])), float(r["context_length_tokens"]))
                                                for r in rows]
    assert [s for _, _, s in p.decode] == pytest.approx([float(r["itl_ms"]) / 1e3 for r in rows])


def test_splitwise_profiles(profiles: dict[str, Profile]) -> None:
    names = [n for n in profiles if n.startswith("splitwise/")]
    assert len(names) == 12
    h100 = profiles["splitwise/llama2-70b/h100-80gb/tp4"]
    assert [n for n, _ in h100.prefill] == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert dict(h100.prefill)[512] == pytest.approx(0.0596, abs=5e-4)  # datasets.md: 60 ms
    assert dict(h100.prefill)[8192] == pytest.approx(0.954, abs=1e-3)
    decode = {(b, c): s for b, c, s in h100.decode}
    assert decode[(1, 576.0)] == pytest.approx(0.0294, abs=5e-4) and decode[(64, 576.0)] == pytest.approx(0.0524, abs=5e-4)
    assert [b for b, _, _ in h100.prefill_batches] == [2, 4, 8, 16, 32, 64]
    # The anomalous TP2 batch-64 prompt time (faster than batch 32) is dropped.
    tp2 = profiles["splitwise/llama2-70b/h100-80gb/tp2"]
    assert [b for b, _, _ in tp2.prefill_batches] == [2, 4, 8, 16, 32]
    assert max(b for b, _, _ in tp2.decode) == 32  # its token times go with it


def test_splitwise_malformed_row(tmp_path: Path) -> None:
    src = read_text(SPLITWISE_CSV).splitlines()
    path = tmp_path / "perf_model.csv"
    path.write_text("\n".join([*src[:3], src[3].replace(",512,", ",big,", 1)]) + "\n")
    with pytest.raises(DataError, match=r"perf_model.csv:4: malformed row"):
        load_splitwise(path)


def test_model_meets_every_measured_point(profiles: dict[str, Profile], models: dict[str, PerfModel]) -> None:
    for name, p in profiles.items():
        m = models[name]
        for n, s in p.prefill:
            assert m.prefill_seconds(n) == pytest.approx(s, rel=0.10), (name, n)
        for b, c, s in p.decode:
            assert m.decode_step_seconds(b, c) == pytest.approx(s, rel=0.10), (name, b, c)


def test_model_is_exact_where_the_measurements_are_monotone(profiles: dict[str, Profile], models: dict[str, PerfModel]) -> None:
    dynamo = models[DYNAMO_PROFILE]
    for n, s in profiles[DYNAMO_PROFILE].prefill:
        assert dynamo.prefill_seconds(n) == pytest.approx(s, rel=1e-9)
    for b, c, s in profiles[DYNAMO_PROFILE].decode:
        if c != 350:  # past n=787 the C=350 row falls and rises again: pooled
            assert dynamo.decode_step_seconds(b, c) == pytest.approx(s, rel=1e-9)
    # Splitwise H100 TP8 measured 128 tokens slower than 256 and 512: the three become their mean.
    tp8 = models["splitwise/llama2-70b/h100-80gb/tp8"]
    measured = dict(profiles["splitwise/llama2-70b/h100-80gb/tp8"].prefill)
    assert measured[128] > measured[512] > measured[256]
    pooled = (measured[128] + measured[256] + measured[512]) / 3
    assert [tp8.prefill_seconds(n) for n in (128, 256, 512)] == pytest.approx([pooled] * 3)
    assert tp8.prefill_seconds(1024) == pytest.approx(measured[1024])


def test_prefill_never_falls_with_length(models: dict[str, PerfModel]) -> None:
    for name, m in models.items():
        times = [m.prefill_seconds(n) for n in range(1, 40_000, 97)]
        assert all(b >= a - 1e-12 for a, b in itertools.pairwise(times)), name


def test_published_dynamo_figures(models: dict[str, PerfModel]) -> None:
    m = models[DYNAMO_PROFILE]
    assert m.prefill_seconds(3151) == pytest.approx(0.0632, abs=1e-4)
    assert m.prefill_seconds(16372) == pytest.approx(0.3755, abs=1e-4)
    assert m.decode_step_seconds(1, 2997) == pytest.approx(0.00443, abs=1e-5)
    assert m.decode_step_seconds(241, 2997) == pytest.approx(0.0318, abs=1e-4)
    # Between points it stays between its neighbours.
    assert 0.0632 < m.prefill_seconds(3500) < 0.0873
    assert 0.0099 < m.decode_step_seconds(70, 2997) < 0.0155


@pytest.mark.parametrize("tokens", [1, 10, 100, 1000, 8192, 16384, 32768, 65536, 131072])
def test_prefill_is_positive_and_grows(models: dict[str, PerfModel], tokens: int) -> None:
    for m in models.values():
        t = m.prefill_seconds(tokens)
        assert 0 < t < m.prefill_seconds(tokens * 2)


def test_prefill_with_a_cached_prefix(models: dict[str, PerfModel]) -> None:
    m = models[DYNAMO_PROFILE]
    full = m.prefill_seconds(8000)
    assert m.prefill_seconds(8000, 4000) < full
    assert m.prefill_seconds(8000, 7000) < m.prefill_seconds(8000, 4000)
    # Attention over the cached prefix makes the rest dearer than the same tokens alone.
    assert m.prefill_seconds(8000, 4000) > m.prefill_seconds(4000)
    assert m.prefill_seconds(8000, 8000) == 0.0
    with pytest.raises(ValueError):
        m.prefill_seconds(100, 101)
    with pytest.raises(ValueError):
        m.prefill_batch_seconds([(-1, 0)])


def test_prefill_batch_is_one_pass_over_the_total(models: dict[str, PerfModel]) -> None:
    m = models[DYNAMO_PROFILE]
    assert m.prefill_batch_seconds([(1000, 0), (1000, 0)]) == pytest.approx(m.prefill_seconds(2000))
    assert m.prefill_batch_seconds([]) == 0.0


def test_decode_fit_grows_with_batch_and_context(models: dict[str, PerfModel]) -> None:
    for m in models.values():
        for ctx in (128, 2048, 16384, 131072):
            times = [m.decode_fit_seconds(b, ctx) for b in (1, 2, 8, 64, 256)]
            assert times == sorted(times) and times[0] > 0
        assert m.decode_fit_seconds(8, 1000) <= m.decode_fit_seconds(8, 10_000)


def test_decode_step_never_falls_with_batch(models: dict[str, PerfModel]) -> None:
    for name, m in models.items():
        for ctx in (100, 350, 1000, 2997, 4000, 12_000, 60_000):
            times = [m.decode_step_seconds(n, ctx) for n in range(1, 1500, 7)]
            assert all(b >= a - 1e-12 for a, b in itertools.pairwise(times)), (name, ctx)


def test_decode_step_edges(models: dict[str, PerfModel]) -> None:
    m = models[DYNAMO_PROFILE]
    assert m.decode_step_seconds(0, 1000) == 0.0
    assert m.decode_step_seconds(1, 0) > 0
    # Past max_num_seqs the step no longer grows with the requests waiting.
    assert m.decode_step_seconds(4000, 350) == pytest.approx(m.decode_step_seconds(1573, 350))
    with pytest.raises(ValueError):
        m.decode_step_seconds(-1, 10)
    # Far outside the profile it follows the fitted curve, scaled to the nearest measured point.
    assert m.decode_step_seconds(64, 100_000) > m.decode_step_seconds(64, 13_585)


def test_speed_factor_scales_every_time(models: dict[str, PerfModel]) -> None:
    m = models[DYNAMO_PROFILE]
    fast = m.with_speed(2.0)
    assert fast.prefill_seconds(5000, 1000) == pytest.approx(m.prefill_seconds(5000, 1000) / 2)
    assert fast.decode_step_seconds(32, 4000) == pytest.approx(m.decode_step_seconds(32, 4000) / 2)
    assert load_model(DYNAMO_PROFILE, speed=0.5).prefill_seconds(1117) == pytest.approx(2 * 0.038494131)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError):
            m.with_speed(bad)
    with pytest.raises(DataError, match="no such profile"):
        load_model("nope")
    # A decode-class GPU: a fifth of the compute, most of the memory bandwidth.
    h20 = m.with_speed(0.2, decode_speed=0.8)
    assert h20.prefill_seconds(5000) == pytest.approx(m.prefill_seconds(5000) * 5)
    assert h20.decode_step_seconds(32, 4000) == pytest.approx(m.decode_step_seconds(32, 4000) / 0.8)
    with pytest.raises(ValueError, match="decode_speed"):
        m.with_speed(1.0, decode_speed=0.0)


def test_fit_needs_points() -> None:
    with pytest.raises(ValueError):
        fit(Profile("empty", "", ((100, 0.01),), ((1, 100.0, 0.01),)))
