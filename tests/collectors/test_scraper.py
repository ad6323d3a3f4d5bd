"""The scraper: concurrency, errors recorded per target, backoff for costly failures driven by the given time.

HTTP is faked with httpx.MockTransport; a hanging target is a handler that never answers.
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from collectors.scraper import Scraper
from collectors.types import Target

GOOD = 'vllm:num_requests_running{engine="0",model_name="m"} 1\n'


def handler(request: httpx.Request) -> httpx.Response:
    host = request.url.host
    if host == "good":
        return httpx.Response(200, text=GOOD, headers={"content-type": "text/plain; version=0.0.4"})
    if host == "html":
        return httpx.Response(200, text="<html><body>login</body></html>", headers={"content-type": "text/html"})
    if host == "error":
        return httpx.Response(503, text="unavailable")
    if host == "dead":
        raise httpx.ConnectError("connection refused", request=request)
    raise AssertionError(host)


async def hanging(request: httpx.Request) -> httpx.Response:
    if request.url.host == "slow":
        await asyncio.sleep(3600)
    return handler(request)


def t(host: str) -> Target:
    return Target(f"http://{host}/metrics", "pool", host)


async def test_each_failure_is_recorded_and_the_rest_succeed() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(hanging)) as client:
        scraper = Scraper(client, timeout_s=0.2)
        results = await scraper.scrape([t("good"), t("html"), t("error"), t("dead"), t("slow")], now=100.0)
    by = {r.target.pod: r for r in results}
    assert by["good"].ok and by["good"].body == GOOD and by["good"].size_bytes == len(GOOD)
    assert "HTML" in (by["html"].error or "") or "text/html" in (by["html"].error or "")
    assert by["error"].error == "HTTP 503 from http://error/metrics"
    assert "ConnectError" in (by["dead"].error or "")
    assert by["slow"].error == "timed out after 0.2s"


async def test_backoff_skips_a_timing_out_target_until_its_time() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(hanging)) as client:
        scraper = Scraper(client, timeout_s=0.05, backoff_base_s=15.0, backoff_max_s=60.0)
        first = await scraper.scrape([t("slow")], now=0.0)
        second = await scraper.scrape([t("slow")], now=15.0)  # first failure retries next tick
        third = await scraper.scrape([t("slow")], now=20.0)
        assert not first[0].skipped and not second[0].skipped
        assert third[0].skipped and third[0].error == "timed out after 0.05s"
        health = scraper.health["pool/slow/vllm"]
        assert health.consecutive_failures == 2
        assert 15.0 + 15.0 * 0.8 <= health.next_attempt_at <= 15.0 + 15.0 * 1.2
        later = await scraper.scrape([t("slow")], now=health.next_attempt_at)
        assert not later[0].skipped and scraper.health["pool/slow/vllm"].consecutive_failures == 3


async def test_httpx_own_timeout_backs_off_as_well() -> None:
    def read_timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("read timed out", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(read_timeout)) as client:
        scraper = Scraper(client, backoff_base_s=15.0)
        for now in (0.0, 15.0):
            await scraper.scrape([t("slow")], now=now)
        [res] = await scraper.scrape([t("slow")], now=20.0)
    assert res.skipped and res.error == "timed out after 5s"


async def test_cheap_failures_are_asked_every_round_and_a_recovered_pod_counts_at_once() -> None:
    # A refused connection or an error status costs nothing to ask again; skipping it would read the pod as failing
    # for up to backoff_max after it answers again (and hold its pool's inputs unfit, or a canary gate's steps).
    answering = {"dead": False, "error": False}

    def flaky(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        return handler(httpx.Request("GET", "http://good/metrics")) if answering[host] else handler(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(flaky)) as client:
        scraper = Scraper(client, backoff_base_s=15.0, backoff_max_s=300.0)
        for now in range(0, 300, 15):
            results = await scraper.scrape([t("dead"), t("error")], now=float(now))
            assert not any(r.skipped or r.ok for r in results)
        assert scraper.health["pool/dead/vllm"].consecutive_failures == 20
        answering.update(dead=True, error=True)
        results = await scraper.scrape([t("dead"), t("error")], now=300.0)
    assert all(r.ok and r.body == GOOD for r in results)


async def test_backoff_counts_costly_failures_only_and_never_overflows() -> None:
    async def slow_refusal(request: httpx.Request) -> httpx.Response:
        if request.url.host == "slow":
            await asyncio.sleep(0.6)  # most of the timeout spent, then an error status: as costly as a timeout
            return httpx.Response(503, text="busy")
        return await hanging(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(slow_refusal)) as client:
        scraper = Scraper(client, timeout_s=1.0, backoff_base_s=15.0, backoff_max_s=60.0)
        for now in (0.0, 15.0, 30.0, 45.0):
            await scraper.scrape([t("dead")], now=now)  # refused four times: cheap, asked every round
        # Then it hangs once (warming up): a first costly failure is asked again next round, not after the longest wait.
        scraper.health["pool/slow/vllm"] = scraper.health.pop("pool/dead/vllm")
        await scraper.scrape([t("slow")], now=60.0)
        health = scraper.health["pool/slow/vllm"]
        assert (health.consecutive_failures, health.costly_failures, health.next_attempt_at) == (5, 1, 0.0)
        [again] = await scraper.scrape([t("slow")], now=75.0)
        assert not again.skipped and again.error == "HTTP 503 from http://slow/metrics"
        assert health.costly_failures == 2 and 75.0 + 12.0 <= health.next_attempt_at <= 75.0 + 15.0
        # Failing for days: the wait stays at backoff_max rather than overflowing the float (which failed every tick).
        health.costly_failures, at = 5000, health.next_attempt_at
        await scraper.scrape([t("slow")], now=at)
        assert health.costly_failures == 5001 and at + 48.0 <= health.next_attempt_at <= at + 60.0
        # Still jittered at the cap: a dead node's targets do not come back in one round.
        waits = set()
        for _ in range(8):
            at = health.next_attempt_at
            await scraper.scrape([t("slow")], now=at)
            waits.add(round(health.next_attempt_at - at, 6))
        assert len(waits) > 1 and all(48.0 <= w <= 60.0 for w in waits)


async def test_body_size_limit() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = Scraper(client, max_body_bytes=10, backoff_base_s=15.0)
        [res] = await scraper.scrape([t("good")], now=0.0)
        await scraper.scrape([t("good")], now=15.0)
        [again] = await scraper.scrape([t("good")], now=20.0)  # reading the body is costly: it backs off
    assert not res.ok and "exceeds 10 bytes" in (res.error or "")
    assert again.skipped


async def test_removed_targets_forget_their_health() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = Scraper(client)
        await scraper.scrape([t("dead"), t("good")], now=0.0)
        await scraper.scrape([t("good")], now=15.0)
    assert list(scraper.health) == ["pool/good/vllm"]


async def test_gzip_bodies_are_decoded() -> None:
    import gzip

    def gz(request: httpx.Request) -> httpx.Response:
        assert "gzip" in request.headers.get("accept-encoding", "")
        return httpx.Response(200, content=gzip.compress(GOOD.encode()), headers={"content-encoding": "gzip"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(gz)) as client:
        [res] = await Scraper(client).scrape([t("good")], now=0.0)
    assert res.ok and res.body == GOOD


async def test_spread_scrapes_each_target_at_its_own_fixed_offset() -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = Scraper(client, spread_s=3.0, sleep=fake_sleep)
        targets = [Target(f"http://good/metrics?{i}", "pool", f"pod-{i}") for i in range(50)]
        first = await scraper.scrape(targets, now=100.0)
        second = await scraper.scrape(targets, now=115.0)
    offsets = [r.ts - 100.0 for r in first]
    assert all(0.0 <= o <= 3.0 for o in offsets) and len(set(offsets)) > 40
    # Intervals stay exact, but for the moment a target waits for a free slot.
    assert [b.ts - a.ts for a, b in zip(first, second, strict=True)] == pytest.approx([15.0] * 50, abs=0.05)
    assert sorted(slept[:50]) == pytest.approx(sorted(offsets), abs=0.05)


async def test_a_target_whose_url_is_not_valid_fails_alone() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        results = await Scraper(client).scrape([Target("http://vllm-0:80O0/metrics", "pool", "typo"), t("good")],
                                               now=100.0)
    by = {r.target.pod: r for r in results}
    assert by["good"].ok
    assert not by["typo"].ok and "invalid URL 'http://vllm-0:80O0/metrics'" in (by["typo"].error or "")


async def test_a_target_that_waited_for_a_slot_is_stamped_when_it_was_read() -> None:
    # One slot, a hanging target ahead: the good one is read 0.2 s late, and its rates must divide by that.
    async with httpx.AsyncClient(transport=httpx.MockTransport(hanging)) as client:
        scraper = Scraper(client, timeout_s=0.2, concurrency=1)
        slow, good = await scraper.scrape([t("slow"), t("good")], now=100.0)
    assert slow.ts == pytest.approx(100.0, abs=0.05) and good.ok and good.ts >= 100.19


async def test_a_round_ends_on_time_and_what_it_had_no_time_for_is_late_not_failing() -> None:
    # One slot and a hanging target ahead: without an end the round would last the hanging one's timeout and then the
    # good one's read; with it, both come back by its end, neither counted as the target's failure.
    async with httpx.AsyncClient(transport=httpx.MockTransport(hanging)) as client:
        scraper = Scraper(client, timeout_s=5.0, concurrency=1, round_s=0.2)
        began = asyncio.get_running_loop().time()
        slow, good = await scraper.scrape([t("slow"), t("good")], now=100.0)
        took = asyncio.get_running_loop().time() - began
    assert took < 1.0
    assert slow.late and not slow.ok and "the round ended (0.2s)" in (slow.error or "")
    assert good.late and not good.ok and "every slot was taken until the round's end" in (good.error or "")
    for key in ("pool/slow/vllm", "pool/good/vllm"):
        health = scraper.health[key]
        assert (health.consecutive_failures, health.costly_failures, health.next_attempt_at) == (0, 0, 0.0)


async def test_a_hung_target_cut_off_by_the_round_after_half_its_timeout_still_fails_and_backs_off() -> None:
    # Behind a slow one for a slot every round, a hung target gets only part of its timeout: half is enough to count.
    async def slow_then_hanging(request: httpx.Request) -> httpx.Response:
        if request.url.host == "busy":
            await asyncio.sleep(0.1)
            return handler(httpx.Request("GET", "http://good/metrics"))
        return await hanging(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(slow_then_hanging)) as client:
        scraper = Scraper(client, timeout_s=0.3, concurrency=1, round_s=0.35, backoff_base_s=15.0)
        for i in range(2):
            busy, slow = await scraper.scrape([t("busy"), t("slow")], now=15.0 * i)
            assert busy.ok and not slow.late and "(the round's end)" in (slow.error or "")
    health = scraper.health["pool/slow/vllm"]
    assert health.consecutive_failures == 2 and health.next_attempt_at > 15.0


async def test_within_the_round_a_target_keeps_its_own_timeout_and_the_rest_are_read() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(hanging)) as client:
        scraper = Scraper(client, timeout_s=0.1, concurrency=1, round_s=2.0)
        slow, good = await scraper.scrape([t("slow"), t("good")], now=100.0)
    assert not slow.late and slow.error == "timed out after 0.1s"
    assert scraper.health["pool/slow/vllm"].consecutive_failures == 1
    assert good.ok and not good.late


async def test_a_round_too_short_for_the_fleet_reads_those_it_left_late_first() -> None:
    # One slot, each read 0.2 s, a round of 0.6 s: two of three targets fit (the third gets less than half its timeout
    # and is cut off). Without turns the third would be late every round and its pool never fit to act on; with them
    # no target is late two rounds in a row.
    async def slow_reads(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.2)
        return handler(httpx.Request("GET", "http://good/metrics"))

    targets = [t("a"), t("b"), t("c")]
    late_rounds = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow_reads)) as client:
        scraper = Scraper(client, timeout_s=1.0, concurrency=1, round_s=0.6)
        for i in range(4):
            results = await scraper.scrape(targets, now=15.0 * i)
            assert [r.target for r in results] == targets  # still in the targets' order
            late_rounds.append({r.target.pod for r in results if r.late})
    assert all(len(late) == 1 for late in late_rounds)
    assert late_rounds[0] == {"c"} and all(a.isdisjoint(b) for a, b in itertools.pairwise(late_rounds))


async def test_a_slot_handed_to_a_read_the_round_cut_off_goes_to_the_next() -> None:
    from collectors.scraper import _Slots

    slots = _Slots(1)
    await slots.acquire(0)
    first = asyncio.ensure_future(slots.acquire(0))
    second = asyncio.ensure_future(slots.acquire(0))
    await asyncio.sleep(0)
    slots.release()  # handed to `first`, which is cancelled before it runs
    first.cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    assert first.cancelled() and second.done() and slots.busy()
    slots.release()
    assert not slots.busy()


async def test_a_targets_credentials_are_in_no_error_it_reports() -> None:
    def refusing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="unavailable")

    async with httpx.AsyncClient(transport=httpx.MockTransport(refusing)) as client:
        [result] = await Scraper(client).scrape([Target("http://scraper:p@ss@good/metrics", "pool", "good")], now=0.0)
    assert result.error == "HTTP 503 from http://***@good/metrics"
