"""The advisor's pure parts: the what-if sizing, the LRU replay, and each question's answer on known inputs."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.advice import (
    AdviceKind,
    AdviceSettings,
    AdvisorInput,
    BusyTtftMinute,
    GpuType,
    PoolFacts,
    PoolObserved,
    Recommendation,
    SpecFacts,
    advise,
    lru_hit_rates,
)
from policies.advice.capacity import Engine, Load, predict, prefill_cost, size_pool
from policies.advice.speculation import best_positions
from policies.advice.whatif import calibrate, fit_tail, on_gpu, peak_load, sized
from policies.autoscale import EngineCurves

# The shipped H200 profile's fit (controlplane.autoscaling.engine_curves), rounded.
CURVES = EngineCurves(prefill=(0.02, 1.37e-5, 5.6e-10), decode=(0.0045, 4.5e-5, 2.7e-8), kv_tokens=480_000)


def facts(**kw: object) -> PoolFacts:
    base = PoolFacts(name="chat", role="unified", replicas=4, curves=CURVES, ttft_p95_slo=2.0, tpot_p95_slo=0.05)
    return replace(base, **kw)  # type: ignore[arg-type]


def seen(**kw: object) -> PoolObserved:
    base = PoolObserved(arrivals=10.0, arrivals_peak=12.0, prompt_tokens=1500, output_tokens=250, hit_rate=0.5,
                        engines=4, minutes=60)
    return replace(base, **kw)  # type: ignore[arg-type]


def inp(pools: list[PoolFacts], observed: dict[str, PoolObserved], **kw: object) -> AdvisorInput:
    return AdvisorInput(now=3600.0, since=0.0, pools={p.name: p for p in pools}, observed=observed, **kw)  # type: ignore[arg-type]


# sizing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["unified", "prefill", "decode"])
def test_more_load_never_needs_fewer_engines(role: str) -> None:
    sizes = [size_pool(Load(rate, 3000, 300, 0.2), Engine(role, CURVES), ttft_slo=1.0, tpot_slo=0.04).engines
             for rate in (1, 5, 20, 60, 120)]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]


@pytest.mark.parametrize("role", ["unified", "prefill", "decode"])
def test_a_sizing_says_what_one_engine_fewer_would_break(role: str) -> None:
    sized = size_pool(Load(120.0, 3000, 300, 0.2), Engine(role, CURVES), ttft_slo=1.0, tpot_slo=0.04)
    assert sized.engines > 1
    fewer = sized.as_dict()["one_fewer"]
    assert isinstance(fewer, dict) and fewer["engines"] == sized.engines - 1
    assert fewer["breaks"] in ("ttft", "tpot", "kv"), fewer
    if fewer["breaks"] == "tpot" and role != "prefill":
        assert fewer["tpot_p95_s"] is None or fewer["tpot_p95_s"] > 0.04
    assert "one_fewer" not in size_pool(Load(0.1, 300, 30), Engine(role, CURVES), ttft_slo=1.0, tpot_slo=0.04).as_dict()


def test_a_small_kv_cache_limits_the_batch() -> None:
    load = Load(30.0, 2000, 400)
    roomy = size_pool(load, Engine("decode", CURVES), ttft_slo=None, tpot_slo=0.05)
    tight = size_pool(load, Engine("decode", replace(CURVES, kv_tokens=48_000)), ttft_slo=None, tpot_slo=0.05)
    assert tight.engines > roomy.engines and tight.limited_by == "kv"
    # A decoding sequence holds its prompt and, on average, half its answer.
    assert tight.batch <= 0.95 * 48_000 / load.context + 1e-6 and load.context == 2200


def test_a_unified_pool_pays_for_prefill_stalls_in_its_tpot() -> None:
    """Long prompts landing during a request's decode stretch its TPOT: a unified engine predicts a worse TPOT
    than a decode engine at the same per-engine load."""
    load = Load(4.0, 12000, 300)
    unified = size_pool(load, Engine("unified", CURVES), ttft_slo=None, tpot_slo=None, limit=4)
    decode = size_pool(load, Engine("decode", CURVES), ttft_slo=None, tpot_slo=None, limit=4)
    assert unified.tpot_p95 is not None and decode.tpot_p95 is not None
    assert unified.tpot_p95 > 1.5 * decode.tpot_p95


def test_a_lightly_loaded_prefill_engine_pays_each_pass_for_few_prompts() -> None:
    """A pass takes the prompts that came while the last one ran: at light load about one, which pays the profile's
    fixed cost alone; under heavy load passes fill and the fixed cost is shared."""
    a, b, c = CURVES.prefill
    alone = a + b * 400 + c * 400 * 400
    light = predict(1, Load(2.0, 400, 1), Engine("prefill", CURVES))
    assert light.utilisation / 2.0 == pytest.approx(alone, rel=0.05)
    busy = predict(1, Load(60.0, 400, 1), Engine("prefill", CURVES))
    assert busy.utilisation / 60.0 < 0.8 * alone


def test_a_prompt_pays_the_pass_quadratic_only_for_the_others_tokens_in_its_pass() -> None:
    """A pass of X tokens costs c*X^2: a prompt of N new tokens sharing it pays c*N*(X - N) beside its own c*N^2, and
    one long enough to fill its passes alone pays its own attention and nothing more (the simulator's pass cost)."""
    a, b, c = CURVES.prefill
    x = float(CURVES.max_batched_tokens)
    short = prefill_cost(CURVES, Load(1.0, 1000, 1), x).mean
    assert short == pytest.approx(1000 * (a / x + b) + c * 1000 * 1000 + c * 1000 * (x - 1000), rel=1e-6)
    long = prefill_cost(CURVES, Load(1.0, 40_000, 1), x).mean
    assert long == pytest.approx(40_000 * (a / x + b) + c * 40_000 * 40_000, rel=1e-6)


def test_near_the_knee_the_p95_tpot_outgrows_the_mean_batch() -> None:
    """A request's TPOT follows the batch during its own decode; the busier spans' batches grow faster than
    their arrivals where each added sequence slows the step for all: the p95 over the mean batch's step rises
    with the load."""
    def over_mean(lam: float) -> float:
        load = Load(lam, 1427, 255)
        s = predict(1, load, Engine("decode", CURVES))
        assert s.tpot_p95 is not None
        return s.tpot_p95 / CURVES.step_seconds(s.batch, load.context)

    light, busy, knee = over_mean(5.0), over_mean(20.0), over_mean(31.0)
    assert 1.0 < light < busy < knee and knee > 1.25


def test_the_tpot_calibration_reads_the_mean_not_the_bucketed_p95() -> None:
    """vLLM's TPOT buckets (10, 25, 50 ms) read a p95 inside one high: a pool whose exact mean agrees with the model
    keeps the model as it is, whatever its p95 read; one whose mean runs slower scales it."""
    pool, load = facts(replicas=4), seen(arrivals=30.0, arrivals_peak=34.0, prompt_tokens=3000, output_tokens=300)
    at = predict(4, peak_load(load), Engine("unified", CURVES))
    assert at.tpot_p95 is not None
    model_mean = at.tpot_base + at.tpot_stall
    agrees = calibrate(pool, replace(load, tpot_mean_peak=model_mean, tpot_p95_peak=3 * at.tpot_p95), AdviceSettings())
    assert agrees.tpot_stall == pytest.approx(1.0) and agrees.tpot_scale == pytest.approx(1.0)
    slower = calibrate(pool, replace(load, tpot_mean_peak=1.5 * model_mean), AdviceSettings())
    assert max(slower.tpot_stall, slower.tpot_scale) > 1.2
    # Stalls at a third of the model's (a router that spares decodes better than it counts on) are taken as
    # measured, not held to half.
    assert at.tpot_stall >= 0.2 * model_mean
    fewer = calibrate(pool, replace(load, tpot_mean_peak=at.tpot_base + at.tpot_stall / 3), AdviceSettings())
    assert fewer.tpot_stall == pytest.approx(1 / 3, rel=1e-6) and fewer.tpot_scale == pytest.approx(1.0)


def test_an_autoscaled_pool_is_calibrated_at_the_engines_that_served_its_busy_minutes() -> None:
    """2 engines at night and 8 by day, 4 on the mean: the day's load on 4 engines would read the model twice too slow
    and the pool's measured TPOT as stalls a fraction of the model's, and every size after it would come out short."""
    pool, load = facts(replicas=4), seen(arrivals=30.0, arrivals_peak=60.0, prompt_tokens=3000, output_tokens=300)
    at = predict(8, peak_load(load), Engine("unified", CURVES))
    measured = replace(load, engines_peak=8.0, tpot_mean_peak=at.tpot_base + at.tpot_stall)
    agrees = calibrate(pool, measured, AdviceSettings())
    assert agrees.tpot_stall == pytest.approx(1.0) and agrees.tpot_scale == pytest.approx(1.0)
    assert calibrate(pool, replace(measured, engines_peak=None), AdviceSettings()) != agrees


def test_the_share_over_the_objective_tells_the_steps_from_the_stalls() -> None:
    """The mean alone cannot say whether the model's steps or its stalls are off; the share of requests over the
    objective can, since stalls come in lumps: a pool measured with known factors gets those factors back."""
    load = seen(arrivals=10.0, arrivals_peak=12.0, prompt_tokens=8000, output_tokens=300, prompt_p50=4000,
                prompt_p95=30000)
    parts = predict(4, peak_load(load), Engine("unified", CURVES)).tpot_draws
    assert parts is not None
    steps, stalls = parts
    assert stalls.mean() >= 0.2 * steps.mean()
    measured = 1.2 * steps + 0.5 * stalls
    objective = float(np.quantile(measured, 0.95))
    share = float(np.mean(measured > objective))
    cal = calibrate(facts(tpot_p95_slo=objective),
                    replace(load, tpot_mean_peak=float(measured.mean()), tpot_over_slo_peak=share), AdviceSettings())
    fitted = cal.tpot_scale * steps + cal.tpot_stall * stalls
    assert fitted.mean() == pytest.approx(measured.mean()) and np.mean(fitted > objective) == pytest.approx(share, abs=0.002)
    # Drawn requests are discrete, so the split is found to within a few per cent of the mean.
    assert cal.tpot_stall == pytest.approx(0.5, abs=0.1) and cal.tpot_scale == pytest.approx(1.2, abs=0.05)
    # Without the share, the mean's difference is all the stalls'.
    alone = calibrate(facts(tpot_p95_slo=objective), replace(load, tpot_mean_peak=float(measured.mean())),
                      AdviceSettings())
    assert alone.tpot_scale == 1.0
    assert alone.tpot_stall == pytest.approx((measured.mean() - steps.mean()) / stalls.mean(), rel=1e-6)
    # A share no factors within bounds give (none over the objective, or most) leaves the mean to decide; so does a
    # tail the steps set alone, which any split of the mean reproduces.
    assert fit_tail(steps, stalls, float(measured.mean()), 0.0, objective) is None
    assert fit_tail(steps, stalls, float(measured.mean()), 0.9, objective) is None
    flat = np.full_like(stalls, stalls.mean())
    assert fit_tail(steps, flat, float(measured.mean()), 0.05, float(np.quantile(1.2 * steps + 0.5 * flat, 0.95))) is None


def test_a_split_decode_pool_takes_the_profiles_steps() -> None:
    """A unified pool's TPOT beyond the model's steps is its prefill's; the decode pool of a split runs none, so it
    is sized on the profile, however slow the unified pool ran."""
    s = AdviceSettings()
    load = seen(prompt_tokens=3000, output_tokens=300)
    at = predict(4, peak_load(load), Engine("unified", CURVES))
    slow = replace(load, tpot_mean_peak=1.6 * (at.tpot_base + at.tpot_stall))
    assert calibrate(facts(), slow, s).tpot_scale > 1.5  # the unified pool ran 60 % slower than its model
    [rec] = [r for r in advise(inp([facts()], {"chat": slow}), s) if r.kind is AdviceKind.DISAGGREGATION]
    plain = sized("decode", facts(), peak_load(slow), s)
    assert rec.evidence["decode_pool"]["engines"] == plain.engines
    assert rec.evidence["decode_pool"]["tpot_p95_s"] == pytest.approx(plain.tpot_p95, abs=1e-4)


def test_a_prefill_pool_holds_through_the_busy_ttft_minute() -> None:
    """A minute of long prompts sets TTFT without raising the arrival count the busy load is sized for: the pool is
    checked at that minute too, with its own load and the queueing measured there, and takes the larger size. A
    decode pool is not, nor a size that the busy load already needs."""
    s = AdviceSettings()
    pool = facts(ttft_p95_slo=7.5, replicas=16)
    load = seen(arrivals=6.0, arrivals_peak=7.5, prompt_tokens=13_000, output_tokens=350, hit_rate=0.3,
                prompt_p50=8000, prompt_p95=55_000, ttft_p95_peak=3.0)
    busy = sized("prefill", pool, peak_load(load), s, calibration=calibrate(pool, load, s))
    long = BusyTtftMinute(arrivals=5.5, prompt_tokens=16_000, hit_rate=0.2, ttft_p95=4.5, prompt_p50=9000,
                          prompt_p95=75_000)
    cal = calibrate(pool, replace(load, ttft_minute=long), s)
    assert cal.ttft_minute is not None and cal.ttft_minute.load.prompt_tokens == 16_000
    held = sized("prefill", pool, peak_load(load), s, calibration=cal)
    assert held.engines > busy.engines and held.at_ttft_minute and held.as_dict()["sized_at"] == "the busy TTFT minute"
    assert held.ttft_p95 is not None and held.ttft_p95 <= 7.5 and held.one_fewer is not None
    assert held.one_fewer.ttft_p95 is None or held.one_fewer.ttft_p95 > 7.5
    assert sized("decode", pool, peak_load(load), s, calibration=cal) == sized("decode", pool, peak_load(load), s,
                                                                              calibration=replace(cal, ttft_minute=None))
    # A minute like the busy load's own asks for nothing more.
    plain = BusyTtftMinute(arrivals=6.0, prompt_tokens=13_000, hit_rate=0.3, ttft_p95=3.0, prompt_p50=8000,
                           prompt_p95=55_000)
    same = sized("prefill", pool, peak_load(load), s, calibration=calibrate(pool, replace(load, ttft_minute=plain), s))
    assert same.engines == busy.engines and not same.at_ttft_minute
    # A tier's extra hits lighten that minute as they lighten the busy load.
    tiered = sized("prefill", pool, replace(peak_load(load), hit_rate=0.6), s, calibration=cal)
    assert tiered.engines < held.engines
    # The queueing measured in that minute, not the busy minutes': the same prompts measured quicker need fewer.
    quicker = calibrate(pool, replace(load, ttft_minute=replace(long, ttft_p95=3.0)), s)
    assert quicker.ttft_minute is not None and quicker.ttft_minute.calibration.ttft_queue < cal.ttft_minute.calibration.ttft_queue
    assert sized("prefill", pool, peak_load(load), s, calibration=quicker).engines < held.engines
    # Served by fewer engines than the window's (one restarting), the same TTFT says less about the model.
    short = calibrate(pool, replace(load, ttft_minute=replace(long, engines=12)), s)
    assert short.ttft_minute is not None and short.ttft_minute.calibration.ttft_queue < cal.ttft_minute.calibration.ttft_queue


def test_a_queue_aware_router_spares_decodes_while_some_engine_is_idle() -> None:
    """Routed by queue, a prompt lands on an engine with nothing decoding while one exists: a lightly loaded unified
    pool's decodes see fewer prefill stalls than under random routing; once every engine decodes, no fewer."""
    def p95(lam: float, aware: bool) -> float:
        s = predict(8, Load(lam, 12000, 300, prompt_sigma=1.0), Engine("unified", CURVES, load_aware=aware))
        assert s.tpot_p95 is not None
        return s.tpot_p95

    assert p95(2.0, True) < 0.8 * p95(2.0, False)
    assert p95(8.0, True) == pytest.approx(p95(8.0, False), rel=0.03)


def test_the_drawn_tpot_is_the_same_every_time() -> None:
    """The p95 comes from drawn requests: seeded, so a recommendation does not change between two runs."""
    load = Load(20.0, 3000, 300, 0.3, prompt_sigma=0.8, output_sigma=0.6)
    assert predict(3, load, Engine("unified", CURVES)) == predict(3, load, Engine("unified", CURVES))


def test_no_load_needs_one_engine() -> None:
    assert size_pool(Load(0.0, 1000, 100), Engine("unified", CURVES), ttft_slo=1.0, tpot_slo=0.05).engines == 1


# the LRU replay ------------------------------------------------------------------------------------


def _brute_lru(prompts: list[list[int]], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for blocks in prompts:
        leading = True
        for h in blocks:
            total += 1
            if leading and h in cache:
                hits += 1
            else:
                leading = False
        for h in blocks:
            cache[h] = None
            cache.move_to_end(h)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits / total if total else 0.0


def test_lru_replay_on_a_known_sequence() -> None:
    prompts = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3]]
    # With room for 3 blocks: [1,2,4] hits 1,2; [1,2,3] finds 1 evicted by 5 and 6.
    assert lru_hit_rates(prompts, [3, 6]) == pytest.approx([2 / 11, 5 / 11])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True), min_size=1, max_size=40),
       st.lists(st.integers(1, 30), min_size=1, max_size=4))
def test_lru_replay_matches_a_plain_lru_at_every_size(prompts: list[list[int]], capacities: list[int]) -> None:
    rates = lru_hit_rates(prompts, capacities)
    assert rates == pytest.approx([_brute_lru(prompts, c) for c in capacities])
    ordered = lru_hit_rates(prompts, sorted(capacities))
    assert ordered == sorted(ordered)


# the questions -------------------------------------------------------------------------------------


def test_a_small_fleet_keeps_one_pool_and_says_what_a_split_would_cost() -> None:
    s = AdviceSettings()
    recs = advise(inp([facts(replicas=2)], {"chat": seen(arrivals=1.0, arrivals_peak=1.5)}), s)
    [rec] = [r for r in recs if r.kind is AdviceKind.DISAGGREGATION]
    assert not rec.act and rec.change == {"layout": "unified"}
    assert rec.effect.saving_per_day is not None and rec.effect.saving_per_day < 0
    assert rec.evidence["one_pool"]["engines"] == 1


def test_cheap_decode_gpus_make_a_decode_heavy_split_pay() -> None:
    """The field's rule: a split pays when decode-class GPUs cost less than the ones prefill needs."""
    s = AdviceSettings(gpu_types={"h200": GpuType(price_per_hour=3.5),
                                  "l40s": GpuType(price_per_hour=1.0, speed=0.3, decode_speed=0.8)},
                       decode_gpu="l40s")
    recs = advise(inp([facts()], {"chat": seen(arrivals=40.0, arrivals_peak=45.0)}), s)
    [rec] = [r for r in recs if r.kind is AdviceKind.DISAGGREGATION]
    assert rec.act and rec.change["layout"] == "disaggregated" and rec.change["decode"]["gpu"] == "l40s"
    assert rec.effect.saving_per_day is not None and rec.effect.saving_per_day > 0
    assert rec.change["decode"]["replicas"] >= rec.change["prefill"]["replicas"]
    # Decode steps on the l40s take 1/0.8 of the H200's, prefill passes 1/0.3.
    curves = on_gpu(facts(), "l40s", s)
    assert curves.decode[1] == pytest.approx(CURVES.decode[1] / 0.8)
    assert curves.prefill[1] == pytest.approx(CURVES.prefill[1] / 0.3)


def test_a_smaller_gpu_holds_less_kv_and_one_too_small_for_the_model_gets_no_split() -> None:
    """The KV cache went with the pool to a GPU of a third the memory: its decode batch, and the split's saving, were
    sized for the H200's cache."""
    h200 = GpuType(price_per_hour=3.5, memory_gib=141)
    s = AdviceSettings(gpu_types={"h200": h200, "l40s": GpuType(price_per_hour=1.0, speed=0.3, decode_speed=0.8,
                                                                memory_gib=48)}, decode_gpu="l40s")
    # The weights and activations stay; 0.9 of the 93 GiB less is KV's: at 128 KiB a token, 685,670 tokens fewer.
    here = on_gpu(facts(curves=replace(CURVES, kv_tokens=800_000)), "l40s", s)
    assert here.kv_tokens == int(800_000 - 0.9 * 93 * 2**30 / 131_072)
    # Another type without its memory given: the cache is kept as it is, as before.
    unknown = s.model_copy(update={"gpu_types": {"h200": h200, "l40s": GpuType(price_per_hour=1.0)}})
    assert on_gpu(facts(curves=replace(CURVES, kv_tokens=800_000)), "l40s", unknown).kv_tokens == 800_000
    # A cache of fewer tokens than the memory lost: the model leaves the smaller GPU no KV room.
    small = facts(curves=replace(CURVES, kv_tokens=400_000))
    assert on_gpu(small, "l40s", s).kv_tokens == 0
    [rec] = [r for r in advise(inp([small], {"chat": seen(arrivals=40.0, arrivals_peak=45.0)}), s)
             if r.kind is AdviceKind.DISAGGREGATION]
    assert not rec.act and "l40s" in rec.advice and rec.change == {"layout": "unified"}


def test_an_fp8_cache_moves_half_the_bytes_a_split_would_send() -> None:
    obs = {"chat": seen(arrivals=20.0, arrivals_peak=22.0, prompt_tokens=16_000)}

    def split(dtype: str) -> Recommendation:
        [rec] = [r for r in advise(inp([facts(kv_cache_dtype=dtype)], obs), AdviceSettings(link_gbps=100.0))
                 if r.kind is AdviceKind.DISAGGREGATION]
        return rec

    bf16, fp8 = split("auto"), split("fp8")
    # 16,000 tokens x 131,072 B x 8 bits over 100 Gb/s, and half that in FP8.
    assert bf16.evidence["kv_transfer_s_per_request"] == pytest.approx(0.1678, abs=1e-4)
    assert fp8.evidence["kv_transfer_s_per_request"] == pytest.approx(0.0839, abs=1e-4)
    assert fp8.evidence["kv_transfer_gbps"] == pytest.approx(bf16.evidence["kv_transfer_gbps"] / 2, rel=0.01)


def test_a_split_fleet_gets_its_ratio_against_the_chat_first_cut() -> None:
    pools = [facts(name="pre", role="prefill", replicas=1, tpot_p95_slo=None),
             facts(name="dec", role="decode", replicas=8, ttft_p95_slo=None)]
    observed = {"pre": seen(arrivals=20.0, arrivals_peak=22.0, output_tokens=1),
                "dec": seen(arrivals=20.0, arrivals_peak=22.0)}
    recs = advise(inp(pools, observed), AdviceSettings())
    [ratio] = [r for r in recs if r.kind is AdviceKind.POOL_RATIO]
    assert ratio.pool == "pre+dec" and "1:3 to 1:5" in ratio.advice
    assert set(ratio.change) == {"pre", "dec"}


def test_constrained_traffic_disables_speculation() -> None:
    spec = SpecFacts("eagle", 4)
    obs = seen(spec_length=1.13, spec_acceptance=0.03, spec_positions=(0.1, 0.02, 0.01, 0.0))
    recs = advise(inp([facts(spec=spec)], {"chat": obs}), AdviceSettings())
    [rec] = [r for r in recs if r.kind is AdviceKind.SPECULATION]
    assert rec.act and rec.change == {"speculative": {"method": "none"}}
    assert rec.effect.after <= rec.effect.before
    # Mostly constrained, some free text: the first position still pays, the rest do not.
    mixed = seen(spec_length=1.5, spec_positions=(0.39, 0.08, 0.02, 0.01))
    [retune] = [r for r in advise(inp([facts(spec=spec)], {"chat": mixed}), AdviceSettings())
                if r.kind is AdviceKind.SPECULATION]
    assert retune.change == {"speculative": {"method": "eagle", "num_speculative_tokens": 1}}


def test_speculation_that_pays_is_kept_or_shortened() -> None:
    assert best_positions((0.8, 0.7, 0.6), 0.13) == (3, pytest.approx(3.1 / 1.39))
    assert best_positions((0.1, 0.05), 0.13)[0] == 0
    good = seen(spec_length=3.0, spec_positions=(0.8, 0.7, 0.5))
    [rec] = [r for r in advise(inp([facts(spec=SpecFacts("eagle", 3))], {"chat": good}), AdviceSettings())
             if r.kind is AdviceKind.SPECULATION]
    assert not rec.act and rec.advice.startswith("keep")


def test_ngram_speculation_is_judged_per_step_not_per_draft() -> None:
    """vLLM counts an ngram draft only where the context repeats: three tokens a draft, on one step in ten, is 1.2
    tokens a step, not 3, and the pool is sized at that."""
    per_draft = (0.9, 0.7, 0.4)  # 3.0 tokens a draft
    rare = seen(arrivals=30.0, arrivals_peak=30.0, spec_length=3.0, spec_positions=per_draft,
                spec_yield=0.2 / 1.2)  # a draft on 10 % of steps: 0.2 accepted per step, 1.2 tokens
    every = replace(rare, spec_yield=2.0 / 3.0)  # a draft on every step: 2 accepted per step, 3 tokens
    pool = facts(spec=SpecFacts("ngram", 3))

    def judged(obs: PoolObserved) -> Recommendation:
        [rec] = [r for r in advise(inp([pool], {"chat": obs}), AdviceSettings()) if r.kind is AdviceKind.SPECULATION]
        return rec

    rare_rec, every_rec = judged(rare), judged(every)
    assert rare_rec.evidence["draft_share"] == pytest.approx(0.1)
    assert rare_rec.evidence["tokens_per_step"] == pytest.approx(1.2)
    assert rare_rec.evidence["speedup_now"] == pytest.approx(1.2 / (1 + 0.1 * 3 * 0.03), abs=1e-3)
    assert every_rec.evidence["draft_share"] == pytest.approx(1.0)
    assert every_rec.evidence["speedup_now"] == pytest.approx(3.0 / (1 + 3 * 0.03), abs=1e-3)
    # Fewer tokens a step: more engines at the same SLOs.
    assert rare_rec.evidence["engines_now"]["engines"] > every_rec.evidence["engines_now"]["engines"]
    assert best_positions(per_draft, 0.03, share=0.1)[1] == pytest.approx(1.2 / 1.009, abs=1e-3)
    # A free drafter that finds a draft on 2 % of steps still pays where it does: kept, not disabled as if the traffic
    # rejected its drafts.
    seldom = judged(replace(rare, spec_positions=(0.67, 0.67, 0.67), spec_yield=0.02 * 2.01 / (1 + 0.02 * 2.01)))
    assert not seldom.act and seldom.advice.startswith("keep ngram")
    assert seldom.evidence["draft_share"] == pytest.approx(0.02, abs=1e-3)
    # A draft model drafts on every step: what a yield averaged over scrapes suggests otherwise is noise.
    [eagle] = [r for r in advise(inp([facts(spec=SpecFacts("eagle", 3))], {"chat": rare}), AdviceSettings())
               if r.kind is AdviceKind.SPECULATION]
    assert eagle.evidence["draft_share"] == 1.0 and eagle.evidence["tokens_per_step"] == 3.0


def test_fp8_kv_for_a_kv_bound_pool_only() -> None:
    tight = replace(CURVES, kv_tokens=64_000)
    bound = seen(arrivals=100.0, arrivals_peak=100.0, kv_usage_max=0.97, preemptions=0.5)
    [rec] = [r for r in advise(inp([facts(curves=tight)], {"chat": bound}), AdviceSettings())
             if r.kind is AdviceKind.KV_PRECISION]
    assert rec.act and rec.change["kv_cache_dtype"] == "fp8" and rec.effect.after < rec.effect.before
    assert "evaluation set" in rec.evidence["caveat"]
    relaxed = advise(inp([facts()], {"chat": seen(kv_usage_max=0.3)}), AdviceSettings())
    assert not [r for r in relaxed if r.kind is AdviceKind.KV_PRECISION]
    on_fp8 = advise(inp([facts(curves=tight, kv_cache_dtype="fp8")], {"chat": bound}), AdviceSettings())
    assert not [r for r in on_fp8 if r.kind is AdviceKind.KV_PRECISION]


def test_fp8_for_a_decode_pool_names_the_pools_it_moves_kv_with() -> None:
    tight = replace(CURVES, kv_tokens=64_000)
    bound = seen(arrivals=100.0, arrivals_peak=100.0, kv_usage_max=0.97, preemptions=0.5)
    pools = [facts(name="pre", role="prefill", tpot_p95_slo=None),
             facts(name="dec", role="decode", curves=tight, ttft_p95_slo=None)]
    [rec] = [r for r in advise(inp(pools, {"dec": bound}, kv_peers={"dec": ("pre", "dec-b")}), AdviceSettings())
             if r.kind is AdviceKind.KV_PRECISION]
    assert rec.act and rec.pool == "dec+pre+dec-b" and "dec and pre, dec-b, the pools it moves KV with" in rec.advice


def test_a_pool_no_size_of_which_meets_its_slos_is_never_a_saving() -> None:
    # Prompts of 62k tokens in a 64k-token cache: one sequence an engine, and no engine count meets TPOT. The
    # sizing's limit (4,096 engines) used to read as the pool's size, and FP8 as saving 4,095 engines.
    tight = replace(CURVES, kv_tokens=64_000)
    huge = seen(arrivals=0.05, arrivals_peak=0.05, prompt_tokens=62_000, output_tokens=200, hit_rate=0.0,
                engines=2, kv_usage_max=0.97, preemptions=0.2)
    recs = advise(inp([facts(curves=tight, replicas=2, tpot_p95_slo=0.2, ttft_p95_slo=60.0)], {"chat": huge}),
                  AdviceSettings())
    assert recs and all(r.effect.saving_per_day is None and "4096" not in r.advice for r in recs)
    [fp8] = [r for r in recs if r.kind is AdviceKind.KV_PRECISION]
    assert fp8.act and fp8.effect.before == 2 and "no size meets the SLOs now" in fp8.advice
    [split] = [r for r in recs if r.kind is AdviceKind.DISAGGREGATION]
    assert not split.act and "at no size" in split.advice
    # Collapsed speculation on it: disabled on its speed, from the pool's size to its size, saving nothing stated.
    collapsed = replace(huge, spec_length=1.13, spec_acceptance=0.03, spec_positions=(0.1, 0.02, 0.01, 0.0))
    [spec] = [r for r in advise(inp([facts(curves=tight, replicas=2, tpot_p95_slo=0.2, ttft_p95_slo=60.0,
                                           spec=SpecFacts("eagle", 4))], {"chat": collapsed}), AdviceSettings())
              if r.kind is AdviceKind.SPECULATION]
    assert (spec.effect.before, spec.effect.after, spec.effect.saving_per_day) == (2, 2, None)


def test_kv_tier_from_a_prefix_replay() -> None:
    """Prompts cycling over more shared prefixes than the cache holds: a larger cache turns misses into hits."""
    prompts = [[1000 * (i % 40) + b for b in range(8)] for i in range(800)]
    pool = facts(curves=replace(CURVES, kv_tokens=16 * 200))
    obs = seen(kv_usage=0.0, hit_rate=0.0, engines=1)
    recs = advise(inp([pool], {"chat": obs}, prefix_blocks={"chat": prompts}), AdviceSettings())
    [rec] = [r for r in recs if r.kind is AdviceKind.KV_TIERING]
    assert rec.act and rec.change == {"kv_tier_factor": 2.0}
    assert rec.effect.after > 0.9 and rec.evidence["lru_hit_rate"]["1x"] < 0.05


def test_layout_eplb_and_dcp_from_their_evidence() -> None:
    moe = facts(expert_parallel=8)
    recs = advise(inp([moe], {"chat": seen(rank_imbalance=1.8)}), AdviceSettings())

    assert [r.change for r in recs if r.kind is AdviceKind.PARALLEL_LAYOUT] == [{"enable_eplb": True}]
    assert not [r for r in advise(inp([replace(moe, eplb=True)], {"chat": seen(rank_imbalance=1.8)}), AdviceSettings())
                if r.kind is AdviceKind.PARALLEL_LAYOUT]
    dup = facts(tensor_parallel=8, kv_heads=2, curves=replace(CURVES, kv_tokens=64_000))
    bound = seen(arrivals=20.0, arrivals_peak=22.0, kv_usage_max=0.97)
    [dcp] = [r for r in advise(inp([dup], {"chat": bound}), AdviceSettings()) if r.kind is AdviceKind.PARALLEL_LAYOUT]
    assert dcp.change == {"decode_context_parallel_size": 4} and dcp.effect.after <= dcp.effect.before


def test_unknown_gpu_type_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="h100.*h200"):
        AdviceSettings().price("h100")
