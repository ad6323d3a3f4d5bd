"""Stalled pools: how long a pool has been short of ready engines, from its recorded counts, and the
finding that stays open while it is stalled."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.settling import PoolStalled, stalled_since
from policies.types import FindingKey, OpenFinding, PolicyInput, PoolState, Severity
from policies.windows import SignalWindows

NOW = 100_000.0


def recorded(counts: list[tuple[int, int]], step: float = 15.0) -> SignalWindows:
    """(desired, ready) per tick, the last one `step` before NOW."""
    w = SignalWindows(7200)
    for i, (desired, ready) in enumerate(counts):
        ts = NOW - step * (len(counts) - i)
        w.add(ts, "pool/decode", "replicas_desired", desired)
        w.add(ts, "pool/decode", "replicas_ready", ready)
    return w


GAP = 60.0


def test_a_pool_short_since_its_scale_up() -> None:
    w = recorded([(6, 6)] * 4 + [(8, 6)] * 10)
    assert stalled_since(w, "decode", NOW, 8, 6, GAP) == NOW - 150
    assert stalled_since(w, "decode", NOW, 8, 8, GAP) == NOW - 150, "all ready now, but not yet for long"
    assert stalled_since(w, "decode", NOW, 8, 7, GAP) == NOW - 150, "one more engine is no break"
    assert stalled_since(recorded([]), "decode", NOW, 8, 6, GAP) == NOW, "nothing recorded: short from now"
    assert stalled_since(recorded([(8, 8)]), "decode", NOW, 8, 6, GAP) == NOW


def test_a_rollout_is_a_break() -> None:
    # A new template rolled out until two ticks ago: its engines restarted, none was missing.
    w = recorded([(8, 6)] * 10)
    for i, rolling in enumerate([1.0] * 8 + [0.0] * 2):
        w.add(NOW - 15.0 * (10 - i), "pool/decode", "replicas_rolling", rolling)
    assert stalled_since(w, "decode", NOW, 8, 6, GAP) == NOW - 30


def test_a_gap_in_the_record_is_a_break() -> None:
    # Short, then 20 minutes unreadable (it may have settled meanwhile), then short again: counted from after the gap.
    w = recorded([(8, 7)] * 4, step=15.0)
    late = NOW + 1200
    for ts in (late - 30, late - 15):
        w.add(ts, "pool/decode", "replicas_desired", 8)
        w.add(ts, "pool/decode", "replicas_ready", 7)
    assert stalled_since(w, "decode", late, 8, 7, GAP) == late - 30
    assert stalled_since(w, "decode", NOW + 61, 8, 7, GAP) == NOW + 61, "the last record too old: from now"


def test_an_engine_that_flaps_ready_does_not_end_the_run() -> None:
    # 7 of 8 for 10 minutes, with the crash-looping engine seen Ready on two single ticks: still short since the start.
    counts = [(8, 7)] * 40
    counts[10] = counts[25] = (8, 8)
    assert stalled_since(recorded(counts), "decode", NOW, 8, 7, GAP) == NOW - 600
    # All 8 ready for four scrapes (GAP) is settled: counted from after that.
    counts[20:24] = [(8, 8)] * 4
    assert stalled_since(recorded(counts), "decode", NOW, 8, 7, GAP) == NOW - 15 * 16
    # And so is a pool ready for GAP up to now.
    assert stalled_since(recorded(counts[:-4] + [(8, 8)] * 4), "decode", NOW, 8, 8, GAP) is None
    assert stalled_since(recorded([(8, 8)] * 4), "decode", NOW, 8, 8, GAP) is None, "never short"


def settled_scan(counts: list[tuple[int, int]], desired: int, ready: int) -> float | None:
    """The definition, over runs of ticks in one state (oldest first, now last): a run of full readiness that held
    for GAP or longer (up to the next short tick, or now) settles the pool; the answer is the first short tick after
    the last such run."""
    timeline = [(NOW - 15.0 * (len(counts) - i), got < asked) for i, (asked, got) in enumerate(counts)]
    timeline.append((NOW, ready < desired))
    runs: list[tuple[bool, float]] = []  # (short, first tick)
    for ts, short in timeline:
        if not runs or runs[-1][0] != short:
            runs.append((short, ts))
    since = None
    for k, (short, first) in enumerate(runs):
        end = runs[k + 1][1] if k + 1 < len(runs) else NOW
        if not short and end - first >= GAP:
            since = None
        elif short and since is None:
            since = first
    return since


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), max_size=30), st.integers(1, 4), st.integers(0, 4))
def test_the_run_matches_its_definition(counts: list[tuple[int, int]], desired: int, ready: int) -> None:
    assert stalled_since(recorded(counts), "decode", NOW, desired, ready, GAP) == settled_scan(counts, desired, ready)


def state(ready: int, stalled_for: float | None) -> PoolState:
    return PoolState("decode", "decode", 8, ready, 1, 8, stalled_for=stalled_for)


def test_the_finding_opens_while_stalled_and_resolves_when_the_engines_come() -> None:
    policy = PoolStalled()
    key = FindingKey("pool_stalled", "pool/decode")
    [finding] = policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"decode": state(6, 960.0)}, {})).findings
    assert finding.key == key and finding.severity is Severity.WARNING and finding.proposals == ()
    assert finding.evidence == {"desired": 8, "ready": 6, "stalled_for_s": 960}
    assert finding.summary == "decode: short of ready engines for 16 min (6 of 8 ready now)"
    assert policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"decode": state(6, None)}, {})).findings == [], (
        "settling, not stalled")
    open_ = {key: OpenFinding(key, NOW - 60, {})}
    held = policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"decode": state(6, None)}, open_))
    assert held.findings == [] and held.resolved == [], "short, not judged this tick (unreadable, rolling): stays open"
    done = policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"decode": state(8, None)}, open_))
    assert done.findings == [] and done.resolved == [(key, "every engine it asks for is ready")]
    gone = policy.evaluate(PolicyInput(NOW, SignalWindows(60), {"prefill": state(8, None)}, open_))
    assert gone.resolved == [(key, "the pool is no longer in the fleet file")]
