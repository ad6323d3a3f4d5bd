"""The real lab: two vLLM engines (CPU build) behind the router, trace-driven traffic in phases, and
the control loop scraping them on the wall clock.

The slow test runs one timeline and checks that the faults it injects change the engines' real
metrics as the collectors derive them: the prefix-cache hit rate collapses under unique
prefixes and comes back after, and speculative decoding's yield vanishes under random sampling
and under JSON-schema constrained decoding. Its report goes to `tests/artifacts/lab-report.json`
and the engine logs to `tests/artifacts/lab-logs/`. The fast tests check the router, the load
generator and the phase syntax against small fake engines.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tornado.netutil
import tornado.web
from tornado.httpserver import HTTPServer

from controlplane.lab.lab import Lab, LabSettings, Phase, parse_phases, run_lab
from controlplane.lab.loadgen import (
    TRIAGE_SCHEMA,
    LoadGen,
    LoadSettings,
    PromptBuilder,
    Traffic,
    TrafficStats,
    lab_blocks,
    lab_trace,
)
from controlplane.lab.router import RoutePolicy, Router, RouterSettings, Upstream, prefix_key
from controlplane.sim.traces import Request
from controlplane.store.writer import SqlStore
from tests.real.vllm_setup import ensure_vllm

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
WORDS = [f"w{i}" for i in range(40)]


# fake engines ----------------------------------------------------------------------------------


class FakeEngine:
    """An OpenAI-ish completions endpoint that answers after `delay_s`, fails every `fail_every`-th call."""

    def __init__(self, delay_s: float = 0.0, fail_every: int = 0) -> None:
        self.delay_s = delay_s
        self.fail_every = fail_every
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.bodies: list[dict[str, Any]] = []
        self.server: HTTPServer | None = None
        self.url = ""

    async def start(self) -> FakeEngine:
        engine = self

        class Completions(tornado.web.RequestHandler):
            async def post(self) -> None:
                engine.calls += 1
                n = engine.calls
                engine.active += 1
                engine.max_active = max(engine.max_active, engine.active)
                try:
                    body = json.loads(self.request.body)
                    engine.bodies.append(body)
                    await asyncio.sleep(engine.delay_s)
                    if engine.fail_every and n % engine.fail_every == 0:
                        self.set_status(500)
                        self.write({"error": "boom"})
                        return
                    if body.get("stream"):
                        for i in range(3):
                            self.write(f"data: {i}\n\n")
                            await self.flush()
                        self.write("data: [DONE]\n\n")
                        return
                    text = '{"status":"ok","count":1,"tags":[]}' if "response_format" in body else "x"
                    self.write({"choices": [{"text": text, "finish_reason": "stop" if "response_format" in body else "length"}],
                                "usage": {"prompt_tokens": 10, "completion_tokens": body.get("max_tokens", 1)}})
                finally:
                    engine.active -= 1

        app = tornado.web.Application([(r"/v1/(?:chat/)?completions", Completions)])
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        self.server = HTTPServer(app)
        self.server.add_sockets(sockets)
        return self

    async def close(self) -> None:
        assert self.server is not None
        self.server.stop()
        await self.server.close_all_connections()


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeEngine]]:
    engines = [await FakeEngine().start(), await FakeEngine().start()]
    yield engines
    for e in engines:
        await e.close()


def _prompt(rng: random.Random, n: int = 300) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# phases ----------------------------------------------------------------------------------------


def test_phases_parse_modes_aliases_and_router_overrides() -> None:
    phases = parse_phases("normal:60, unique:30,random:5.5,json:10,burst:10,round_robin:20,unique@round_robin:5")
    assert [(p.traffic, p.seconds, p.router) for p in phases] == [
        (Traffic.NORMAL, 60, None), (Traffic.UNIQUE, 30, None), (Traffic.RANDOM, 5.5, None), (Traffic.JSON, 10, None),
        (Traffic.BURST, 10, None), (Traffic.NORMAL, 20, RoutePolicy.ROUND_ROBIN),
        (Traffic.UNIQUE, 5, RoutePolicy.ROUND_ROBIN),
    ]
    assert [p.name for p in phases[-2:]] == ["round_robin", "unique@round_robin"]
    assert parse_phases("unique_prefixes:1,structured:1")[1].traffic is Traffic.JSON


@pytest.mark.parametrize(("text", "message"), [
    ("normal", "expected MODE:SECONDS"),
    ("normal:abc", "'abc' is not a number"),
    ("normal:0", "seconds must be > 0"),
    ("sideways:10", "unknown mode"),
    ("normal@random:10", "unknown mode"),
])
def test_phases_reject_bad_input_naming_the_phase(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_phases(f"normal:5,{text}")
    assert "phase 2" in str(info.value)


def test_cli_reports_a_bad_timeline_as_a_usage_error() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "controlplane.cli", "lab", "--phases", "normal:10,sideways:5"],
                          capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert "sideways" in proc.stderr and "unknown mode" in proc.stderr


# router ----------------------------------------------------------------------------------------


def test_prefix_key_reads_text_chat_and_token_prompts() -> None:
    s = RouterSettings(prefix_blocks=2, block_chars=4, block_tokens=3)
    assert prefix_key({"prompt": "abcdefghijkl"}, s) == b"abcdefgh"
    assert prefix_key({"prompt": ["abcdefghij", "zzz"]}, s) == b"abcdefgh"
    assert prefix_key({"prompt": list(range(10))}, s) == b"ids:0,1,2,3,4,5"
    chat = {"messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "defgh"}]}]}
    assert prefix_key(chat, s) == b"abcdefgh"
    assert prefix_key({}, s) == b""


def test_prefix_policy_is_consistent_spreads_keys_and_bounds_load() -> None:
    ups = [Upstream("a", "http://a"), Upstream("b", "http://b")]
    router = Router(ups, RoutePolicy.PREFIX, RouterSettings(block_chars=64, prefix_blocks=1))
    rng = random.Random(1)
    prompts = [_prompt(rng) for _ in range(40)]
    first = [router.pick({"prompt": p}).name for p in prompts]
    assert first == [router.pick({"prompt": p}).name for p in prompts]  # the same prefix, the same engine
    assert 8 <= first.count("a") <= 32  # and different prefixes spread over both
    # Same first block, different tails: one engine.
    assert len({router.pick({"prompt": prompts[0][:64] + f" tail {i}"}).name for i in range(10)}) == 1
    # Bounded loads: an engine far above its share of requests in flight is passed over.
    home = router.pick({"prompt": prompts[0]}).name
    router.stats[home].in_flight = 5
    assert router.pick({"prompt": prompts[0]}).name != home
    # Rendezvous ranking: a third engine takes keys only for itself; the others keep theirs.
    bigger = Router([*ups, Upstream("c", "http://c")], RoutePolicy.PREFIX, RouterSettings(block_chars=64, prefix_blocks=1))
    moved = [(x, bigger.pick({"prompt": p}).name) for x, p in zip(first, prompts, strict=True)]
    assert all(new in (old, "c") for old, new in moved)


def test_round_robin_alternates_and_policy_switches_at_runtime() -> None:
    router = Router([Upstream("a", "http://a"), Upstream("b", "http://b")], RoutePolicy.PREFIX)
    assert router.set_policy("round_robin") is RoutePolicy.PREFIX
    body = {"prompt": "same prompt every time"}
    assert [router.pick(body).name for _ in range(4)] == ["a", "b", "a", "b"]
    assert router.policy_changes == [(RoutePolicy.PREFIX, RoutePolicy.ROUND_ROBIN)]
    with pytest.raises(ValueError):
        router.set_policy("sideways")
    with pytest.raises(ValueError, match="unique"):
        Router([Upstream("a", "http://a"), Upstream("a", "http://b")])


async def test_router_forwards_counts_streams_and_switches_over_http(fakes: list[FakeEngine]) -> None:
    router = await Router([Upstream("e0", fakes[0].url), Upstream("e1", fakes[1].url)], RoutePolicy.ROUND_ROBIN).start()
    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
            for i in range(4):
                resp = await client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
                assert resp.headers["x-routed-to"] == f"e{i % 2}"
            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200
            async with client.stream("POST", "/v1/completions", json={"prompt": "s", "stream": True}) as stream:
                text = "".join([chunk async for chunk in stream.aiter_text()])
            assert text.endswith("data: [DONE]\n\n") and text.count("data:") == 4
            assert (await client.put("/router/policy", json={"policy": "prefix"})).json() == {
                "policy": "prefix", "previous": "round_robin"}
            bad = await client.put("/router/policy", json={"policy": "sideways"})
            assert bad.status_code == 400 and "round_robin" in bad.json()["error"]["message"]
            assert (await client.post("/v1/completions", content=b"not json")).status_code == 400
            stats = (await client.get("/router")).json()
        assert stats["policy"] == "prefix"
        assert {n: s["requests"] for n, s in stats["upstreams"].items()} == {"e0": 3, "e1": 3}
        assert fakes[0].calls + fakes[1].calls == 6
    finally:
        await router.close()


async def test_router_answers_502_naming_an_unreachable_engine() -> None:
    router = await Router([Upstream("gone", "http://127.0.0.1:9")]).start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(f"{router.url}/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 502
        assert "gone" in resp.json()["error"]["message"]
        assert router.stats["gone"].errors == 1 and router.stats["gone"].in_flight == 0
    finally:
        await router.close()


# load generator --------------------------------------------------------------------------------


def test_trace_blocks_become_lab_blocks() -> None:
    s = LoadSettings(block_tokens=128, max_prompt_blocks=3)
    mooncake = Request(0.0, 1100, 50, (0, 7, 9), 512)
    assert lab_blocks(mooncake, s) == [("h0", 128), ("h7", 128), ("h9", 19)]  # 76 trace tokens left: 19 lab tokens
    long = Request(0.0, 5000, 50, tuple(range(10)), 512)
    assert [b for b, _ in lab_blocks(long, s)] == ["h0", "h1", "h2"]
    azure = Request(0.0, 700, 20, (), 0, category="conv", index=12)
    assert lab_blocks(azure, s) == [("sys:conv", 128), ("r12:1", 47)]


def test_traffic_modes_shape_the_requests() -> None:
    reqs = [Request(0.0, 1024, 500, (0, 1), 512), Request(1.0, 1024, 5, (0, 2), 512)]
    gen = LoadGen("http://x", reqs, PromptBuilder(WORDS, block_tokens=8), LoadSettings(block_tokens=8, max_output_tokens=24))
    normal = [gen.body(r, Traffic.NORMAL) for r in reqs]
    assert normal[0]["prompt"].split()[:8] == normal[1]["prompt"].split()[:8]  # shared block 0: a shared prefix
    assert normal[0]["prompt"] != normal[1]["prompt"]
    assert len(normal[0]["prompt"].split()) == 16 and normal[0]["prompt"].startswith(" ")
    assert [b["max_tokens"] for b in normal] == [24, 5] and normal[0]["temperature"] == 0.0 and normal[0]["ignore_eos"]
    unique = [gen.body(reqs[0], Traffic.UNIQUE) for _ in range(2)]
    first_blocks = {tuple(b["prompt"].split()[:8]) for b in [*unique, normal[0]]}
    assert len(first_blocks) == 3  # a block of its own every time
    assert unique[0]["prompt"].split()[8:] == normal[0]["prompt"].split()[8:]
    assert gen.body(reqs[0], Traffic.RANDOM)["temperature"] == 1.0
    js = gen.body(reqs[0], Traffic.JSON)
    assert js["response_format"]["json_schema"]["schema"] == TRIAGE_SCHEMA and "ignore_eos" not in js


def test_arrivals_keep_the_trace_shape_at_the_asked_rate() -> None:
    reqs = lab_trace("mooncake", 600)
    gen = LoadGen("http://x", reqs, PromptBuilder(WORDS), LoadSettings(rate=4.0))
    gaps = gen._gaps
    assert len(gaps) == len(reqs)
    assert sum(gaps[1:]) / (len(gaps) - 1) == pytest.approx(0.25, rel=1e-9)
    assert max(gaps) > 2 * min(gaps)  # the trace's unevenness survives the rescaling


async def test_loadgen_bounds_concurrency_counts_errors_and_drains() -> None:
    engine = await FakeEngine(delay_s=0.2, fail_every=3).start()
    reqs = [Request(float(i), 600, 8, (0, i + 1), 512, index=i) for i in range(50)]
    gen = LoadGen(engine.url, reqs, PromptBuilder(WORDS, block_tokens=16),
                  LoadSettings(rate=200.0, max_in_flight=4, block_tokens=16, timeout_s=5))
    stop = asyncio.Event()
    task = asyncio.create_task(gen.run(stop))
    try:
        await asyncio.sleep(0.8)
        gen.set_traffic("json")
        before = gen.total.copy()
        await asyncio.sleep(0.5)
        assert await gen.drain(timeout_s=5)
        assert gen.in_flight == 0
        paused_at = engine.calls
        await asyncio.sleep(0.3)
        assert engine.calls == paused_at  # paused: nothing new goes out
        gen.resume()
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await task
        await engine.close()
    assert engine.max_active <= 4
    total = gen.total
    assert total.sent == total.ok + total.errors == engine.calls
    assert total.errors == engine.calls // 3 and total.error_kinds == {"http_500": total.errors}
    json_part = gen.by_traffic[Traffic.JSON]
    assert json_part.json_valid == json_part.ok > 0 and json_part.json_invalid == 0
    assert gen.total.minus(before).sent >= json_part.sent
    assert TrafficStats().mean_latency_s is None


# the real lab ----------------------------------------------------------------------------------

# Long enough for the detectors' baselines at a 5 s scrape: the prefix-cache policy judges after 8
# points, the speculative-decoding one after 20 (unique prefixes leave speculation as it was).
PHASES = "normal:60,unique:25,normal:35,random:30,normal:35,json:25"


def _group_members(pgid: int) -> list[int]:
    """Live processes still in process group `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":  # after the command: state, ppid, pgrp; zombies are dead
            out.append(int(entry))
    return out


@pytest.mark.slow
@pytest.mark.exclusive
@pytest.mark.timeout(900)  # a fresh machine installs vLLM first (minutes)
async def test_lab_faults_move_the_real_signals(tmp_path: Path) -> None:
    venv = ensure_vllm()
    db = f"sqlite:///{tmp_path / 'lab.db'}"
    settings = LabSettings(engines=2, db_url=db, venv=venv, log_dir=ARTIFACTS / "lab-logs", scrape_interval=5.0,
                           load=LoadSettings(rate=3.0))
    phases = parse_phases(PHASES)
    seen: dict[str, Any] = {}

    def ready(lab: Lab) -> None:
        seen["pids"] = [e.pid for e in lab.engines]
        seen["fleet"] = lab.fleet_config()

    started = time.monotonic()
    report = await run_lab(settings, phases, on_ready=ready)
    wall = time.monotonic() - started
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "lab-report.json").write_text(json.dumps(report.as_dict() | {"wall_s": round(wall, 1)}, indent=2,
                                                          default=str) + "\n")

    # Every engine process group is gone: nothing outlives the lab.
    assert all(pid is not None for pid in seen["pids"])
    assert {pid: _group_members(pid) for pid in seen["pids"]} == {pid: [] for pid in seen["pids"]}

    # The control loop scraped the engines through the fleet file the lab wrote.
    fleet = seen["fleet"]
    assert [(t.pool, t.pod) for t in fleet.targets] == [("lab", "vllm-0"), ("lab", "vllm-1")]
    assert len(report.ticks) >= 12
    assert sum(t.targets_up == 2 for t in report.ticks) >= len(report.ticks) - 1
    store = SqlStore.open(db)
    try:
        stored = store.load_signals(0.0, names=["prefix_cache_hit_rate", "spec_yield"])
    finally:
        store.close()
    assert {s.subject for s in stored} >= {"pool/lab", "engine/lab/vllm-0/0", "engine/lab/vllm-1/0"}

    by_name: dict[str, list[Any]] = {}
    for p in report.phases:
        by_name.setdefault(p.name, []).append(p)
    assert [p.name for p in report.phases] == [p.name for p in phases] and not report.interrupted
    normal, unique, normal_again = by_name["normal"][0], by_name["unique"][0], by_name["normal"][1]
    random_, json_ = by_name["random"][0], by_name["json"][0]
    for p in report.phases:
        t = p.traffic_stats
        assert t.ok >= 0.25 * 3.0 * (p.ended_at - p.started_at), (p.name, t)
        assert t.errors <= 0.02 * t.sent, (p.name, t.error_kinds)
        assert p.settled, p.name
        assert all(n > 0 for n in p.routed.values()), (p.name, p.routed)  # the prefix router uses both engines

    def hit(p: Any) -> float:
        return p.pool["prefix_cache_hit_rate"]

    # Unique prefixes: not one token of any prompt can come from the cache; shared ones come back after.
    assert hit(normal) >= 0.08, hit(normal)
    assert hit(unique) <= 0.02, hit(unique)
    assert hit(normal_again) >= max(0.08, 0.5 * hit(normal)), (hit(normal), hit(normal_again))

    def yield_(p: Any) -> float:
        return p.pool["spec_yield"]

    def drafts_per_token(p: Any) -> float:
        return p.pool["spec_draft_rate"] / p.pool["generation_tokens_rate"]

    # Greedy decoding of the tiny model repeats itself: the ngram drafter's proposals get accepted.
    assert yield_(normal) >= 0.15 and yield_(normal_again) >= 0.15, (yield_(normal), yield_(normal_again))
    assert drafts_per_token(normal) >= 0.05
    # Random sampling: no n-gram repeats, so drafts vanish and so does their yield.
    assert yield_(random_) <= 0.25 * yield_(normal), (yield_(random_), yield_(normal))
    assert drafts_per_token(random_) <= 0.25 * drafts_per_token(normal)
    # JSON schema: compact records hold no n-gram the prompt or the record repeats.
    assert yield_(json_) <= 0.5 * yield_(normal), (yield_(json_), yield_(normal))
    assert drafts_per_token(json_) <= 0.5 * drafts_per_token(normal)
    assert json_.traffic_stats.json_valid >= 0.8 * json_.traffic_stats.ok and json_.traffic_stats.json_invalid == 0
    unique_ticks = [t for t in report.ticks if t.phase == "unique" and "prefix_cache_hit_rate" in t.signals]
    assert unique_ticks and min(t.signals["prefix_cache_hit_rate"] for t in unique_ticks) <= 0.02

    # The detectors on the real signals: each opens while its fault runs and resolves once the
    # traffic is normal again.
    def lifecycle(kind: str, fault: str) -> tuple[int, int]:
        name = f"{kind} pool/lab"
        opened = next((i for i, t in enumerate(report.ticks) if name in t.opened), None)
        assert opened is not None, (kind, [(t.phase, t.opened) for t in report.ticks if t.opened])
        assert report.ticks[opened].phase == fault, (kind, report.ticks[opened].phase)
        resolved = next((i for i, t in enumerate(report.ticks) if i > opened and name in t.resolved), None)
        assert resolved is not None, (kind, "never resolved")
        assert report.ticks[resolved].phase == "normal", (kind, report.ticks[resolved].phase)
        return opened, resolved

    lifecycle("prefix_cache_hit_drop", "unique")
    lifecycle("spec_decode_collapse", "random")


def test_phase_names_round_trip() -> None:
    assert [p.name for p in parse_phases(PHASES)] == ["normal", "unique", "normal", "random", "normal", "json"]
    assert Phase(Traffic.BURST, 1.0).name == "burst"
