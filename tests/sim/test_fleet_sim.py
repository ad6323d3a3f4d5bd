"""The engine-level simulator: scheduler behaviour, calibration, routing, MoE, speculation, scenarios."""

from __future__ import annotations

from pathlib import Path

import pytest

from catalog.fleet import Role
from controlplane.sim.engine import EngineConfig, SimEngine, SimRequest
from controlplane.sim.exporters import render_dcgm
from controlplane.sim.fleet import FleetSpec, PoolSpec, SimFleet, SystemPrompts
from controlplane.sim.moe import EplbConfig, ExpertParallel, MoeSpec
from controlplane.sim.perf import load_model
from controlplane.sim.scenario import FAULT_KINDS, Fault, FaultTimeline, builtin_scenarios, load_scenario
from controlplane.sim.speculation import SpecConfig, step_gain
from controlplane.sim.traces import Request

MODEL = load_model()


def engine(**kw: object) -> SimEngine:
    return SimEngine("p", "p-0", MODEL, EngineConfig(**kw), now=0.0)  # type: ignore[arg-type]


def ttft_mean(e: SimEngine) -> float:
    h = e.ranks[0].hists["vllm:time_to_first_token_seconds"]
    return h.sum / sum(h.counts)


def test_a_lone_request_takes_the_calibrated_prefill_and_decode_times() -> None:
    e = engine()
    e.submit(SimRequest(0, 0.0, 3000, 101))
    e.run_until(100.0)
    assert ttft_mean(e) == pytest.approx(MODEL.prefill_seconds(3000), rel=0.01)
    itl = e.ranks[0].hists["vllm:inter_token_latency_seconds"]
    assert sum(itl.counts) == pytest.approx(100)
    assert itl.sum / 100 == pytest.approx(MODEL.decode_step_seconds(1, 3050), rel=0.05)
    assert e.ranks[0].finished == {"stop": 1.0} or e.ranks[0].finished == {"length": 1.0}


def test_chunked_prefill_spreads_a_long_prompt_over_several_iterations() -> None:
    e = engine(max_batched_tokens=2048)
    e.submit(SimRequest(0, 0.0, 8192, 2))
    e.run_until(60.0)
    assert e.steps >= 4 + 1
    assert ttft_mean(e) > MODEL.prefill_seconds(8192) * 0.9


def test_a_repeated_prefix_hits_the_cache() -> None:
    e = engine()
    blocks = tuple(range(8))
    e.submit(SimRequest(0, 0.0, 4096, 2, blocks, 512))
    e.run_until(10.0)
    e.submit(SimRequest(1, 10.0, 4096, 2, blocks, 512))
    e.run_until(20.0)
    c = e.ranks[0].counters
    assert c["vllm:prefix_cache_queries"] == 8192
    assert c["vllm:prefix_cache_hits"] == 4095  # all but the last token, as vLLM computes it


def test_kv_pressure_preempts_and_still_finishes_everything() -> None:
    e = engine(kv_blocks=400, max_num_seqs=64)
    for i in range(40):
        e.submit(SimRequest(i, 0.0, 600, 400))
    e.run_until(3600.0)
    stats = e.ranks[0]
    assert stats.counters["vllm:num_preemptions"] > 0
    assert sum(stats.finished.values()) == 40
    assert e.used_blocks == 0 and e.idle()


def test_constrained_traffic_collapses_acceptance_and_random_sampling_starves_ngram() -> None:
    eagle = SpecConfig("eagle", 3)
    text, json = step_gain(eagle, ["text"] * 4), step_gain(eagle, ["json"] * 4)
    assert text is not None and json is not None
    assert json.mean_accepted < 0.5 * text.mean_accepted
    assert text.per_position[0] > text.per_position[1] > text.per_position[2]
    ngram = step_gain(SpecConfig("ngram", 4), ["random"] * 4)
    assert ngram is not None and ngram.draft_share == 0.0 and ngram.mean_accepted == 0.0


def test_speculation_shortens_tpot_for_text_and_lengthens_it_for_json() -> None:
    def tpot(spec: SpecConfig, cls: str) -> float:
        e = SimEngine("p", "p-0", MODEL, EngineConfig(), now=0.0, spec=spec)
        for i in range(16):
            e.submit(SimRequest(i, 0.0, 1000, 300, cls=cls))
        e.run_until(600.0)
        h = e.ranks[0].hists["vllm:request_time_per_output_token_seconds"]
        return h.sum / sum(h.counts)

    plain = tpot(SpecConfig(), "text")
    assert tpot(SpecConfig("eagle", 3), "text") < 0.75 * plain
    assert tpot(SpecConfig("eagle", 3), "json") > plain


def test_a_hot_expert_slows_the_group_and_eplb_rebalances_it() -> None:
    ep = ExpertParallel(MoeSpec(experts=64, ranks=4, zipf_s=0.4, seed=1))
    calm = ep.step_factor()
    ep.make_hot(0.3)
    assert ep.imbalance > 1.5 and ep.step_factor() > calm * 1.2
    ep.set_eplb(EplbConfig(window_size=100, step_interval=300, num_redundant_experts=4))
    ep.advance(299, 0.0)
    assert ep.rearrangements == 0
    ep.advance(1, 0.0)
    assert ep.rearrangements == 1 and ep.stall_s > 0
    assert ep.imbalance < 1.2
    assert max(ep.rank_activity()) == 1.0 and min(ep.rank_activity()) > 0.8


def test_cache_aware_routing_keeps_hit_rates_that_round_robin_loses() -> None:
    def hit_rate(router: str) -> float:
        spec = FleetSpec(pools=(PoolSpec("u", Role.UNIFIED, 3, engine=EngineConfig(kv_blocks=6000), speed=0.5),),
                         router=router, system_prompts=SystemPrompts(count=120, blocks=8, block_tokens=256, zipf_s=0.6))
        reqs = [Request(i * 0.1, 2100, 20) for i in range(6000)]
        fleet = SimFleet(spec, reqs)
        fleet.advance_to(600.0)
        c = [s.counters for m in fleet.members["u"] for s in m.engine.ranks]
        return sum(x["vllm:prefix_cache_hits"] for x in c) / sum(x["vllm:prefix_cache_queries"] for x in c)

    cache_aware, round_robin = hit_rate("cache_aware"), hit_rate("round_robin")
    assert cache_aware > round_robin + 0.15


def test_a_scaled_trace_arrives_in_bursts_unless_its_copies_are_spread() -> None:
    """At 8x its load each arrival is 8 prompts: at one instant they queue behind each other; spread over a
    second they mostly find the engine free. Either way every copy arrives."""
    trace = [Request(i * 2.0, 1500, 20) for i in range(30)]

    def ttft(spread: float) -> tuple[float, float]:
        fleet = SimFleet(FleetSpec(pools=(PoolSpec("u", Role.UNIFIED, 1),), load=8, load_spread_s=spread), trace)
        fleet.advance_to(70.0)
        h = fleet.members["u"][0].engine.ranks[0].hists["vllm:time_to_first_token_seconds"]
        return h.sum / sum(h.counts), sum(h.counts)

    (burst, n_burst), (spread, n_spread) = ttft(0.0), ttft(1.0)
    assert n_burst == n_spread == 240
    assert spread < burst / 2


def test_a_fault_timeline_makes_and_undoes_each_fault_in_time() -> None:
    fleet = SimFleet(FleetSpec(pools=(PoolSpec("u", Role.UNIFIED, 1),), load=2), [Request(i * 1.0, 500, 20) for i in range(60)])
    timeline = FaultTimeline([Fault(kind="burst", at=10.0, end=20.0, params={"factor": 3.0})], 0.0)
    assert timeline.advance(fleet, 5.0) == [] and fleet.rate_scale == 2
    (at, fault, started), = timeline.advance(fleet, 15.0)
    assert (at, fault.kind, started) == (10.0, "burst", True) and fleet.rate_scale == 6 and fleet.now == 10.0
    (at, _, started), = timeline.advance(fleet, 25.0)
    assert (at, started) == (20.0, False) and fleet.rate_scale == 2


def test_gpus_are_sampled_by_the_fleet_not_by_whoever_reads_the_exporter() -> None:
    fleet = SimFleet(FleetSpec(pools=(PoolSpec("u", Role.UNIFIED, 1),)), [Request(i * 0.05, 2000, 200) for i in range(2000)])
    fleet.advance_to(30.0)
    m = fleet.members["u"][0]
    body = render_dcgm(m)
    assert render_dcgm(m) == body, "a second scraper must read what the first one read"
    assert 0.5 < m.gpu.utilization <= 1.0
    assert 30 * 120.0 < m.gpu.energy_j <= 30 * 650.0  # between idle and full power for 30 s
    fleet.members["u"][0].gpu.throttled = True
    fleet.advance_to(40.0)
    assert m.gpu.thermal_violation_s == pytest.approx(6.0)


def test_disaggregated_requests_hand_their_kv_to_decode_and_finish_there() -> None:
    spec = FleetSpec(pools=(PoolSpec("pre", Role.PREFILL, 2), PoolSpec("dec", Role.DECODE, 2)), link_gbps=100.0)
    reqs = [Request(i * 0.5, 2000, 50) for i in range(100)]
    fleet = SimFleet(spec, reqs)
    fleet.advance_to(120.0)
    decode = [s for m in fleet.members["dec"] for s in m.engine.ranks]
    assert sum(sum(s.finished.values()) for s in decode) == 100
    assert sum(s.counters["vllm:external_prefix_cache_hits"] for s in decode) == 100 * 2000
    transfers = [m.transfer for m in fleet.members["dec"]]
    assert sum(t.count for t in transfers) == 100
    # 2000 tokens * 128 KiB over 100 Gb/s is about 21 ms, plus the link latency.
    mean = sum(t.xfer.sum for t in transfers) / 100
    assert 0.02 < mean < 0.05


def test_scaling_adds_engines_after_startup_and_drains_removed_ones() -> None:
    spec = FleetSpec(pools=(PoolSpec("u", Role.UNIFIED, 2, startup_s=60.0),))
    fleet = SimFleet(spec, [Request(i * 0.2, 500, 50) for i in range(3000)])
    fleet.advance_to(30.0)
    fleet.scale("u", 3)
    fleet.advance_to(60.0)
    assert len(fleet.ready("u")) == 2
    fleet.advance_to(100.0)
    assert len(fleet.ready("u")) == 3
    fleet.scale("u", 1)
    assert len(fleet.ready("u")) == 1
    fleet.advance_to(200.0)
    assert len(fleet.members["u"]) == 1


def test_shipped_scenarios_load_and_cover_every_fault_kind_with_ground_truth() -> None:
    names = builtin_scenarios()
    assert len(names) >= 10
    kinds = set()
    fault_free = 0
    for name in names:
        sc = load_scenario(name)
        sc.fleet_spec()
        sc.controlplane_config("sqlite://")
        for f in sc.faults:
            kinds.add(f.kind)
            assert f.truth, f"{name}: fault {f.kind} without ground truth"
        fault_free += not sc.faults
    assert fault_free >= 4
    assert {"router_flip", "system_prompt", "prompt_scale", "hot_expert", "class_mix", "canary", "kv_lag",
            "gpu_xid"} <= kinds <= set(FAULT_KINDS)


def test_the_soak_scenarios_load_are_fault_free_and_long() -> None:
    """`bench/scenarios/soak-*.yaml` are what the false-alarm figures in the README rest on."""
    soaks = sorted((Path(__file__).resolve().parents[2] / "bench" / "scenarios").glob("soak-*.yaml"))
    assert len(soaks) >= 3
    for path in soaks:
        sc = load_scenario(str(path))
        sc.controlplane_config("sqlite://")
        assert not sc.faults and sc.duration >= 24 * 3600, path.name
        assert next(sc.requests()).arrival_s >= 0


def test_a_bad_scenario_names_the_field_and_line(tmp_path: object) -> None:
    from controlplane.errors import ConfigError

    path = Path(str(tmp_path)) / "bad.yaml"
    path.write_text("name: x\ntrace: {name: azure/conv}\nduration: 10m\nfleet:\n  pools:\n"
                    "    - {name: a, role: unified, replicas: 0}\nfaults:\n  - {kind: meteor, at: 1m}\n")
    with pytest.raises(ConfigError) as exc:
        load_scenario(str(path))
    text = str(exc.value)
    assert "fleet.pools[0].replicas (line 6)" in text and "faults[0].kind (line 8)" in text


def test_the_fleet_takes_eplb_speculation_canary_and_rollback_actions() -> None:
    moe = PoolSpec("moe", Role.UNIFIED, 2, moe=MoeSpec(ranks=4, seed=3), startup_s=30.0)
    fleet = SimFleet(FleetSpec(pools=(moe,)), [Request(i * 0.2, 800, 60) for i in range(6000)])
    fleet.advance_to(60.0)
    for m in fleet.members["moe"]:
        assert m.engine.moe is not None
        m.engine.moe.make_hot(0.3)
    skew = [m.engine.moe.imbalance for m in fleet.members["moe"] if m.engine.moe]
    fleet.set_eplb("moe", EplbConfig(window_size=100, step_interval=200, num_redundant_experts=4))
    fleet.advance_to(240.0)
    after = [m.engine.moe.imbalance for m in fleet.members["moe"] if m.engine.moe]
    assert all(a < 0.8 * s for a, s in zip(after, skew, strict=True))
    fleet.set_speculation("moe", SpecConfig("mtp", 2))
    fleet.advance_to(300.0)
    assert all(s.counters["vllm:spec_decode_num_drafts"] > 0 for m in fleet.members["moe"] for s in m.engine.ranks)
    pods = fleet.rollout("moe", "v2", share=0.5, slowdown=1.15)
    assert pods == ["moe-v2-0"]
    fleet.advance_to(400.0)
    assert sorted(m.pod for m in fleet.ready("moe")) == ["moe-0", "moe-v2-0"]
    assert fleet.member("moe-v2-0").engine.slowdown == 1.15
    fleet.rollback("moe")
    fleet.advance_to(500.0)
    assert sorted(m.pod for m in fleet.ready("moe")) == ["moe-0", "moe-2"]
    with pytest.raises(ValueError, match="serves no MoE model"):
        SimFleet(FleetSpec(pools=(PoolSpec("d", Role.UNIFIED, 1),)), []).set_eplb("d", None)


def test_a_scenario_replays_identically_for_a_seed_and_differently_for_another() -> None:
    def counters(seed: int) -> list[float]:
        sc = load_scenario("json-surge").model_copy(update={"seed": seed})
        fleet = SimFleet(sc.fleet_spec(), sc.requests())
        fleet.advance_to(300.0)
        return [v for m in fleet.members["chat"] for s in m.engine.ranks for v in s.counters.values()]

    assert counters(7) == counters(7)
    assert counters(7) != counters(8)


# accounting the evaluations rest on -------------------------------------------------------------


def test_a_decode_workers_first_token_is_one_step_after_its_kv_whatever_the_run_it_rides() -> None:
    # Stamped at the end of a bulk decode run, a decode worker's TTFT read as the refresh window (0.8 s for one
    # idle worker), against the 1 s objective the Mooncake evaluation judges a decode pool by; its TPOT lost the run.
    step = MODEL.decode_step_seconds(1, 12_001)
    e = engine()
    e.submit(SimRequest(0, 0.0, 12_000, 50, remote_kv=True, handoff_at=0.0))
    e.run_until(5.0)
    ttft = e.ranks[0].hists["vllm:time_to_first_token_seconds"]
    tpot = e.ranks[0].hists["vllm:request_time_per_output_token_seconds"]
    assert sum(ttft.counts) == 1 and ttft.sum < 2 * step
    assert sum(tpot.counts) == 1 and tpot.sum > 0.5 * step
    fleet = SimFleet(FleetSpec(pools=(PoolSpec("pre", Role.PREFILL, 1), PoolSpec("dec", Role.DECODE, 1))),
                     [Request(0.1, 4000, 400)])
    fleet.advance_to(30.0)
    ttft = fleet.members["dec"][0].engine.ranks[0].hists["vllm:time_to_first_token_seconds"]
    assert sum(ttft.counts) == 1 and ttft.sum < 0.1


@pytest.mark.parametrize("output", [50, 1])
def test_a_prompt_preempted_in_the_iteration_that_prefilled_it_has_no_first_token(output: int) -> None:
    # Its blocks went to the decode growth of an older request: back in the queue with nothing computed, it once got
    # a TTFT (and a one-token request crashed the engine, completed while no longer running).
    e = engine(kv_blocks=100)
    a = SimRequest(0, 0.0, 160, 1000)
    e.submit(a)
    while a.generated < 16:  # until A's next token needs a block more than its 11
        e.run_until(e.t + 1e-9)
    b = SimRequest(1, e.t, 89 * 16 - 1, output)  # the 89 blocks left, exactly
    e.submit(b)
    e.run_until(e.t + 1e-9)
    assert b in e.waiting and e.ranks[0].counters["vllm:num_preemptions"] == 1
    assert b.first_token is None and sum(e.ranks[0].hists["vllm:time_to_first_token_seconds"].counts) == 1
    e.run_until(e.t + 600.0)
    assert sum(e.ranks[0].finished.values()) == 2


@pytest.mark.parametrize("how", ["scale-down", "drain"])
def test_kv_on_its_way_to_a_worker_that_drains_is_served_not_lost(how: str) -> None:
    # A slow link: the 4,000-token prompt's KV takes seconds to land on the decode worker.
    spec = FleetSpec(pools=(PoolSpec("pre", Role.PREFILL, 1), PoolSpec("dec", Role.DECODE, 1, startup_s=0.5)),
                     link_gbps=0.5)
    fleet = SimFleet(spec, [Request(1.0, 4000, 20)])
    fleet.scale("dec", 2)
    decode = [m.engine for m in fleet.members["dec"]]
    target = None
    for t in range(2, 10):
        fleet.advance_to(float(t))
        target = next((m for m in fleet.members["dec"] if m.inflight), None)
        if target is not None:
            break
    assert target is not None and target.engine.idle()
    if how == "drain":
        fleet.replace(target.pod)
    else:
        fleet.scale("dec", 1)  # drains the newer engine, the one the router sent the KV to
    assert target.draining
    fleet.advance_to(200.0)
    decode += [m.engine for m in fleet.members["dec"] if m.engine not in decode]
    assert sum(sum(r.finished.values()) for e in decode for r in e.ranks) == 1


def test_a_saturated_gpu_reads_busy_in_every_window_whatever_its_iteration_length() -> None:
    # Iterations longer than DCGM's window put more than a window's busy time in one: clamped, a GPU working flat
    # out read 0 % in the window after.
    fleet = SimFleet(FleetSpec(pools=(PoolSpec("u", Role.UNIFIED, 1, speed=0.15),)),
                     [Request(1.0 + 0.1 * i, 8000, 1) for i in range(300)])
    m = fleet.members["u"][0]
    util = []
    for t in range(2, 40):
        fleet.advance_to(float(t))
        util.append(m.gpu.utilization)
    assert min(util) > 0.9 and sum(util) >= 37.0
