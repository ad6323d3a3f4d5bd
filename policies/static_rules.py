"""Static alert rules as production teams write them (threshold plus `for: 5m`), as data.

Each rule is one Prometheus alerting rule on the metric names the fleet really exports
(`vllm:*`, `DCGM_FI_*`, NIXL's `agent_*`) and, next to it, the signal our collectors derive from
the same families, so the one rule runs in two places: exported as a PrometheusRule
(`fleetctl rules export`) and evaluated here over signal windows (`StaticRulePolicy`), the
baseline the smarter policies are measured against.

The evaluation follows Prometheus' alerting-rule semantics. At every evaluation time (the
timestamps of the signal points) the condition is true or not; an alert is pending from the first
true evaluation of an unbroken run and firing once that run has lasted `for_s`; a false
evaluation or a missing one ends it. A rule over `rate(...[5m])` is evaluated on the points
inside the same five minutes: counter ratios exactly (hits over queries, weighted by the
denominator's rate), quantiles as the request-weighted mean of the per-interval quantiles, an
approximation of `histogram_quantile` over the merged buckets (our windows keep quantiles, not
buckets). A gauge rule sees the newest point; a missed scrape interval makes it absent, as a
staleness marker does in Prometheus.
"""

from __future__ import annotations

import functools
import statistics
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise
from string import Template

from policies.types import FindingKey, FindingReport, PolicyInput, PolicyResult, PoolState, Severity

__all__ = [
    "KINDS",
    "STATIC_RULES",
    "Aggregate",
    "Op",
    "RuleState",
    "StaticRule",
    "StaticRulePolicy",
    "rule_states",
    "rules_for",
    "static_policies",
]

# Finding kinds the rules cover, in the order the rules are listed.
KINDS: tuple[str, ...] = (
    "prefix_cache_hit_drop",
    "kv_transfer_lag",
    "ep_imbalance",
    "spec_decode_collapse",
    "slo_burn",
    "saturation",
    "gpu_health",
)

# A gauge point counts as missing once the next one is this many intervals late: one missed
# scrape, as Prometheus marks a failed scrape's series stale at once.
_STALE_INTERVALS = 1.5
# ... and at `now` a gauge must come from this tick's scrape (points of a tick lie between the
# tick's time and its scrape spread, well within half an interval): a series that the last scrape
# did not return is gone, as a staleness marker makes it.
_FRESH_INTERVALS = 0.5
_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


class Op(StrEnum):
    """The comparison of a rule, as PromQL writes it."""

    GT = ">"
    GE = ">="
    LT = "<"
    LE = "<="

    def holds(self, value: float, threshold: float) -> bool:
        """Whether `value op threshold` is true."""
        if self is Op.GT:
            return value > threshold
        if self is Op.GE:
            return value >= threshold
        if self is Op.LT:
            return value < threshold
        return value <= threshold


class Aggregate(StrEnum):
    """How the rule's signal turns into the value compared with the threshold."""

    NONE = "none"  # per subject
    MAX_OVER_MIN = "max_over_min"  # largest over smallest value among a pool's subjects


@dataclass(frozen=True, slots=True)
class StaticRule:
    """One alerting rule: its PromQL and the equivalent evaluation over our signals.

    `query` is the PromQL value (without the comparison); SLO rules carry `$matchers` where the
    export puts a pool matcher. `range_s` is the range of the query's rate()/increase() (0 for a
    gauge). `weight` names a rate signal that weights a ratio signal over the range, `per` one
    the signal is divided by. With `slo`, a pool's configured SLO (`ttft_p95`, `tpot_p95`)
    replaces `threshold`.
    """

    kind: str
    alert: str
    query: str
    signal: str
    subject_prefix: str
    op: Op
    threshold: float
    severity: Severity
    summary: str
    rationale: str
    for_s: float = 300.0
    range_s: float = 0.0
    weight: str | None = None
    per: str | None = None
    aggregate: Aggregate = Aggregate.NONE
    slo: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.alert}: unknown finding kind {self.kind!r}")
        if self.aggregate is Aggregate.MAX_OVER_MIN and self.range_s <= 0:
            raise ValueError(f"{self.alert}: max_over_min compares range values; give range_s")
        if self.weight and self.per:
            raise ValueError(f"{self.alert}: use weight or per, not both")
        if self.slo is not None and "$matchers" not in self.query:
            raise ValueError(f"{self.alert}: an SLO rule needs `$matchers` in its query for per-pool thresholds")

    def signals(self) -> tuple[str, ...]:
        """The signals the rule's evaluation reads."""
        return tuple(n for n in (self.signal, self.weight, self.per) if n)

    @property
    def expr(self) -> str:
        """The alerting expression with the default threshold, for every pool."""
        return self.render()

    def render(self, threshold: float | None = None, matchers: str = "") -> str:
        """The alerting expression with `threshold` and extra label `matchers` (e.g. `{pool="a"}`)."""
        query = Template(self.query).substitute(matchers=matchers)
        return f"{query} {self.op} {promql_number(self.threshold if threshold is None else threshold)}"

    def threshold_for(self, pool: PoolState | None) -> float:
        """The threshold for a pool: its SLO where the rule follows one and the pool sets it."""
        if self.slo is not None and pool is not None:
            slo = getattr(pool, f"{self.slo}_slo", None)
            if slo is not None:
                return float(slo)
        return self.threshold


def promql_number(value: float) -> str:
    """A threshold as a PromQL literal that reads back as the same float, so Prometheus compares with what the
    in-process rule compares with (`:g` alone rounds to six digits)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


STATIC_RULES: tuple[StaticRule, ...] = (
    StaticRule(
        kind="prefix_cache_hit_drop",
        alert="VLLMPrefixCacheHitRateLow",
        query="sum by (pool) (rate(vllm:prefix_cache_hits_total[5m])) "
              "/ sum by (pool) (rate(vllm:prefix_cache_queries_total[5m]))",
        signal="prefix_cache_hit_rate", subject_prefix="pool/", weight="prefix_cache_query_rate", range_s=300.0,
        op=Op.LT, threshold=0.3, severity=Severity.WARNING,
        summary="prefix-cache hit rate below 30% for 5 minutes",
        rationale="Shared system prompts and multi-turn chat keep well above 30%; below it the pool recomputes "
                  "prefixes it should reuse. Workloads differ too much for a tighter static number.",
    ),
    StaticRule(
        kind="kv_transfer_lag",
        alert="VLLMNixlTransferP99High",
        query="histogram_quantile(0.99, sum by (pool, pod, engine, le) (rate(vllm:nixl_xfer_time_seconds_bucket[5m])))",
        signal="nixl_xfer_time_p99", subject_prefix="engine/", weight="nixl_transfer_rate", range_s=300.0,
        op=Op.GT, threshold=0.1, severity=Severity.WARNING,
        summary="NIXL KV-transfer p99 above 100 ms for 5 minutes",
        rationale="A prompt's KV cache moves over RDMA in a few to tens of milliseconds; a 100 ms tail adds "
                  "visibly to TTFT, and 0.1 is one of vLLM's bucket bounds, so the quantile is not interpolated.",
    ),
    StaticRule(
        kind="kv_transfer_lag",
        alert="VLLMNixlTransferFailures",
        query="sum by (pool, pod, engine) (rate(vllm:nixl_num_failed_transfers_total[5m]))",
        signal="nixl_failed_transfer_rate", subject_prefix="engine/", range_s=300.0,
        op=Op.GT, threshold=0.0, severity=Severity.WARNING,
        summary="NIXL KV transfers failing for 5 minutes",
        rationale="A healthy KV path never fails a transfer; failures in every 5-minute window for 5 minutes "
                  "are a broken path, not a blip, and each one costs a prefill recompute.",
    ),
    StaticRule(
        kind="kv_transfer_lag",
        alert="NixlAgentTransferP99High",
        query="histogram_quantile(0.99, sum by (hostname, agent_name, local_rank, pid, le) "
              "(rate(agent_xfer_time_us_bucket[5m]))) / 1e6",
        signal="nixl_xfer_time_p99", subject_prefix="nixl/", range_s=300.0,
        op=Op.GT, threshold=0.1, severity=Severity.WARNING,
        summary="NIXL agent transfer p99 above 100 ms for 5 minutes",
        rationale="The same 100 ms tail as the vLLM connector's, seen by NIXL's own exporter (microseconds).",
    ),
    StaticRule(
        kind="ep_imbalance",
        alert="VLLMExpertParallelRankSkew",
        query="max by (pool) (sum by (pool, pod, engine) (rate(vllm:inter_token_latency_seconds_sum[5m])) "
              "/ sum by (pool, pod, engine) (rate(vllm:inter_token_latency_seconds_count[5m]))) "
              "/ min by (pool) (sum by (pool, pod, engine) (rate(vllm:inter_token_latency_seconds_sum[5m])) "
              "/ sum by (pool, pod, engine) (rate(vllm:inter_token_latency_seconds_count[5m])))",
        signal="itl_mean", subject_prefix="engine/", weight="generation_tokens_rate", range_s=300.0,
        aggregate=Aggregate.MAX_OVER_MIN,
        op=Op.GT, threshold=1.5, severity=Severity.WARNING,
        summary="slowest rank's mean inter-token latency over 1.5x the fastest's for 5 minutes",
        rationale="vLLM exports no expert-load metric; ranks of one pool serve alike, so a 50% gap in mean "
                  "inter-token latency between them is a hot-expert or placement problem, not noise.",
    ),
    StaticRule(
        kind="spec_decode_collapse",
        alert="VLLMSpecDecodeAcceptanceLow",
        query="sum by (pool) (rate(vllm:spec_decode_num_accepted_tokens_total[5m])) "
              "/ sum by (pool) (rate(vllm:spec_decode_num_draft_tokens_total[5m]))",
        signal="spec_acceptance_rate", subject_prefix="pool/", weight="spec_draft_rate", range_s=300.0,
        op=Op.LT, threshold=0.3, severity=Severity.WARNING,
        summary="speculative-decoding acceptance rate below 30% for 5 minutes",
        rationale="Healthy EAGLE/MTP drafters accept 50-80% of draft tokens; below 30% verification costs "
                  "more than the accepted tokens save and TPOT gets worse than without speculation.",
    ),
    StaticRule(
        kind="slo_burn",
        alert="VLLMTimeToFirstTokenHigh",
        query="histogram_quantile(0.95, sum by (pool, le) (rate(vllm:time_to_first_token_seconds_bucket$matchers[5m])))",
        signal="ttft_p95", subject_prefix="pool/", weight="request_rate", range_s=300.0, slo="ttft_p95",
        op=Op.GT, threshold=2.0, severity=Severity.CRITICAL,
        summary="TTFT p95 above its SLO for 5 minutes",
        rationale="The pool's TTFT p95 objective from the fleet file; 2 s where a pool sets none, the usual "
                  "bound for interactive chat. Five minutes over it is a breach users notice.",
    ),
    StaticRule(
        kind="slo_burn",
        alert="VLLMTimePerOutputTokenHigh",
        query="histogram_quantile(0.95, sum by (pool, le) "
              "(rate(vllm:request_time_per_output_token_seconds_bucket$matchers[5m])))",
        signal="tpot_p95", subject_prefix="pool/", weight="request_rate", range_s=300.0, slo="tpot_p95",
        op=Op.GT, threshold=0.1, severity=Severity.CRITICAL,
        summary="TPOT p95 above its SLO for 5 minutes",
        rationale="The pool's TPOT p95 objective from the fleet file; 100 ms (10 tokens/s, about reading "
                  "speed) where a pool sets none, and a bucket bound of vLLM's latency histograms.",
    ),
    StaticRule(
        kind="slo_burn",
        alert="VLLMRequestErrorRatioHigh",
        query='sum by (pool) (rate(vllm:request_success_total{finished_reason="error"}[5m])) '
              "/ sum by (pool) (rate(vllm:request_success_total[5m]))",
        signal="request_error_rate", subject_prefix="pool/", per="request_rate", range_s=300.0,
        op=Op.GT, threshold=0.01, severity=Severity.CRITICAL,
        summary="more than 1% of requests failing for 5 minutes",
        rationale="A 99% availability objective: 1% errors sustained for 5 minutes spends a month's error "
                  "budget in about seven hours.",
    ),
    StaticRule(
        kind="saturation",
        alert="VLLMKVCacheNearlyFull",
        query="max by (pool) (vllm:kv_cache_usage_perc)",
        signal="kv_cache_usage_max", subject_prefix="pool/",
        op=Op.GT, threshold=0.95, severity=Severity.WARNING,
        summary="an engine's KV cache above 95% for 5 minutes",
        rationale="Above 95% the scheduler has no blocks for new sequences: requests queue and running ones "
                  "are preempted. Short peaks are normal under load, hence the 5 minutes.",
    ),
    StaticRule(
        kind="saturation",
        alert="VLLMRequestsQueued",
        query="avg by (pool) (vllm:num_requests_waiting)",
        signal="requests_waiting", subject_prefix="pool/", per="engines_reporting",
        op=Op.GT, threshold=5.0, severity=Severity.WARNING,
        summary="more than 5 requests waiting per engine for 5 minutes",
        rationale="Bursts queue a few requests for seconds; five per engine on average for 5 minutes means the "
                  "pool lacks capacity and every queued request pays it in TTFT.",
    ),
    StaticRule(
        kind="gpu_health",
        alert="DCGMXidError",
        query="DCGM_FI_DEV_XID_ERRORS",
        signal="gpu_xid_last", subject_prefix="gpu/", for_s=0.0,
        op=Op.GT, threshold=0.0, severity=Severity.CRITICAL,
        summary="GPU reported an XID error",
        rationale="The field holds the last XID code, 0 when none was seen. Any XID is a driver-reported fault "
                  "worth a look at once; waiting would only let the engine fail requests.",
    ),
    StaticRule(
        kind="gpu_health",
        alert="DCGMDoubleBitEccErrors",
        query="increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL[5m])",
        signal="gpu_ecc_dbe_rate", subject_prefix="gpu/", range_s=300.0, for_s=0.0,
        op=Op.GT, threshold=0.0, severity=Severity.CRITICAL,
        summary="GPU memory reported uncorrectable (double-bit) ECC errors",
        rationale="An uncorrectable memory error corrupts whatever used that memory; no amount is acceptable.",
    ),
    StaticRule(
        kind="gpu_health",
        alert="DCGMRowRemapFailure",
        query="DCGM_FI_DEV_ROW_REMAP_FAILURE",
        signal="gpu_row_remap_failure", subject_prefix="gpu/", for_s=0.0,
        op=Op.GT, threshold=0.0, severity=Severity.CRITICAL,
        summary="GPU failed to remap a faulty memory row",
        rationale="The GPU ran out of spare rows: the fault stays in service memory until the GPU is replaced.",
    ),
    StaticRule(
        kind="gpu_health",
        alert="DCGMGpuTemperatureHigh",
        query="DCGM_FI_DEV_GPU_TEMP",
        signal="gpu_temperature_celsius", subject_prefix="gpu/",
        op=Op.GT, threshold=85.0, severity=Severity.WARNING,
        summary="GPU above 85 °C for 5 minutes",
        rationale="Data-center GPUs slow their clocks near 90 °C; 85 °C sustained leaves a margin to fix "
                  "cooling before throughput drops.",
    ),
)


def rules_for(kind: str, rules: Iterable[StaticRule] = STATIC_RULES) -> tuple[StaticRule, ...]:
    """The rules of one finding kind."""
    return tuple(r for r in rules if r.kind == kind)


@dataclass(frozen=True, slots=True)
class RuleState:
    """An active alert of one rule on one subject, as Prometheus would show it."""

    rule: StaticRule
    subject: str
    firing: bool  # False: pending
    active_at: float  # the first evaluation of the current unbroken run of true ones
    value: float
    threshold: float


def _pool_of(subject: str) -> str | None:
    kind, _, rest = subject.partition("/")
    if kind in ("pool", "engine", "pod", "target") and rest:
        return rest.split("/", 1)[0]
    return None


class _Series:
    """One signal of one subject with its optional weight or divisor, over the evaluation horizon."""

    def __init__(self, inp: PolicyInput, rule: StaticRule, subject: str, since: float) -> None:
        points = inp.windows.series(subject, rule.signal, since=since)
        self.times = [t for t, _ in points]
        self.values = [v for _, v in points]
        other = rule.weight or rule.per
        self.other = dict(inp.windows.series(subject, other, since=since)) if other else {}
        self.rule = rule
        times = self.times
        if len(times) < 2:
            # A gauge exported only while non-zero (the last XID) may have one point in the horizon;
            # its older points still tell the scrape interval.
            times = [t for t, _ in inp.windows.series(subject, rule.signal)]
        gaps = [b - a for a, b in pairwise(times)]
        self.interval = statistics.median(gaps) if gaps else None

    def value_at(self, t: float) -> float | None:
        """The rule's value at evaluation time `t`; None where PromQL's result would be empty or NaN."""
        rule = self.rule
        hi = bisect_right(self.times, t)
        if rule.range_s <= 0:
            if hi == 0 or self.times[hi - 1] != t:
                return None
            value = self.values[hi - 1]
            if rule.per is None:
                return value
            divisor = self.other.get(t)
            return None if not divisor else value / divisor
        lo = bisect_right(self.times, t - rule.range_s)
        if lo >= hi:
            return None
        times, values = self.times[lo:hi], self.values[lo:hi]
        if rule.weight is None and rule.per is None:
            return sum(values) / len(values)
        pairs = [(v, self.other[ts]) for ts, v in zip(times, values, strict=True) if ts in self.other]
        total = sum(w for _, w in pairs)
        if total <= 0:
            return None  # 0/0 in PromQL: NaN, and no comparison holds for NaN
        if rule.weight is not None:
            return sum(v * w for v, w in pairs) / total
        return sum(v for v, _ in pairs) / total

    def gap_limit(self) -> float:
        """The longest spacing of evaluations that keeps a run unbroken."""
        if self.rule.range_s > 0:
            return self.rule.range_s
        return _STALE_INTERVALS * self.interval if self.interval else float("inf")

    def fresh_limit(self) -> float:
        """How old the newest point may be at `now` and still count (a lone gauge point: only this tick's)."""
        if self.rule.range_s > 0:
            return self.rule.range_s
        return _FRESH_INTERVALS * self.interval if self.interval else 0.0


def _holds(op: Op, value: float, th: float) -> bool:
    return op.holds(value, th)


def _run(
    times: Sequence[float], value_at: Callable[[float], float | None], holds: Callable[[float], bool],
    now: float, for_s: float, gap: float, fresh: float,
) -> tuple[float, float] | None:
    """(active_at, newest value) of the unbroken run of true evaluations ending at the newest one.

    Walks back only as far as `for_s` needs: a run that long fires whatever lies before it.
    """
    if not times or now - times[-1] > fresh:
        return None
    active_at: float | None = None
    newest: float | None = None
    later: float | None = None
    for t in reversed(times):
        if later is not None and later - t > gap:
            break
        value = value_at(t)
        if value is None or not holds(value):
            break
        if newest is None:
            newest = value
        active_at = later = t
        if now - t >= for_s:
            break
    if active_at is None or newest is None:
        return None
    return active_at, newest


def rule_states(rule: StaticRule, inp: PolicyInput) -> list[RuleState]:
    """Pending and firing alerts of `rule` at `inp.now`, one per subject whose condition holds."""
    since = inp.now - rule.for_s - max(rule.range_s, 300.0) - 60.0
    subjects = sorted(inp.windows.subjects(rule.signal, prefix=rule.subject_prefix))
    out: list[RuleState] = []
    if rule.aggregate is Aggregate.NONE:
        for subject in subjects:
            series = _Series(inp, rule, subject, since)
            pool = _pool_of(subject)
            threshold = rule.threshold_for(inp.pools.get(pool) if pool else None)
            run = _run(series.times, series.value_at, functools.partial(_holds, rule.op, th=threshold), inp.now,
                       rule.for_s, series.gap_limit(), series.fresh_limit())
            if run is not None:
                out.append(RuleState(rule, subject, inp.now - run[0] >= rule.for_s, run[0], run[1], threshold))
        return out
    groups: dict[str, list[_Series]] = {}
    for subject in subjects:
        pool = _pool_of(subject)
        if pool is not None:
            groups.setdefault(pool, []).append(_Series(inp, rule, subject, since))
    for pool, members in sorted(groups.items()):
        if len(members) < 2:
            continue
        times = sorted({t for m in members for t in m.times})

        def spread(t: float, members: list[_Series] = members) -> float | None:
            values = [v for m in members if (v := m.value_at(t)) is not None]
            if len(values) < 2 or min(values) <= 0:
                return None
            return max(values) / min(values)

        threshold = rule.threshold_for(inp.pools.get(pool))
        run = _run(times, spread, functools.partial(_holds, rule.op, th=threshold), inp.now, rule.for_s, rule.range_s,
                   rule.range_s)
        if run is not None:
            out.append(RuleState(rule, f"pool/{pool}", inp.now - run[0] >= rule.for_s, run[0], run[1], threshold))
    return out


class StaticRulePolicy:
    """The static rules of one finding kind as a policy: a finding per subject while any rule fires."""

    def __init__(self, kind: str, rules: Sequence[StaticRule] | None = None) -> None:
        self.kind = kind
        self.rules = tuple(rules) if rules is not None else rules_for(kind)
        self.reads = tuple(dict.fromkeys(name for r in self.rules for name in r.signals()))
        if not self.rules:
            raise ValueError(f"no static rules for {kind!r}")
        wrong = [r.alert for r in self.rules if r.kind != kind]
        if wrong:
            raise ValueError(f"rules of another kind than {kind!r}: {', '.join(wrong)}")

    def states(self, inp: PolicyInput) -> list[RuleState]:
        """Every pending and firing alert of this kind's rules."""
        return [s for rule in self.rules for s in rule_states(rule, inp)]

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        """Findings for subjects with a firing rule; open findings with none resolve, as alerts do."""
        firing: dict[str, list[RuleState]] = {}
        for state in self.states(inp):
            if state.firing:
                firing.setdefault(state.subject, []).append(state)
        result = PolicyResult()
        for subject, states in sorted(firing.items()):
            result.findings.append(self._report(inp, subject, states))
        stale = [k for k in inp.open_findings if k.kind == self.kind and k.subject not in firing]
        for key in sorted(stale, key=lambda k: k.subject):
            result.resolved.append((key, "no static rule fires any longer"))
        return result

    def _report(self, inp: PolicyInput, subject: str, states: list[RuleState]) -> FindingReport:
        states.sort(key=lambda s: -_SEVERITY_RANK[s.rule.severity])
        top = states[0]
        key = FindingKey(self.kind, subject)
        opened = inp.open_findings.get(key)
        alerts = [
            {"alert": s.rule.alert, "expr": s.rule.render(s.threshold), "signal": s.rule.signal,
             "value": round(s.value, 6), "op": str(s.rule.op), "threshold": s.threshold, "for_s": s.rule.for_s,
             "active_at": s.active_at}
            for s in states
        ]
        evidence = {
            "signal": top.rule.signal,
            "value": round(top.value, 6),
            "threshold": top.threshold,
            "alerts": alerts,
            # The run's start as first seen; later evaluations look back only as far as `for` needs.
            "active_since": opened.evidence.get("active_since", top.active_at) if opened else top.active_at,
        }
        cause = "; ".join(
            f"{s.rule.alert}: {s.rule.signal} {s.value:.4g} {s.rule.op} {s.threshold:g} held {inp.now - s.active_at:.0f}s "
            f"(for {s.rule.for_s:.0f}s). {s.rule.rationale}"
            for s in states
        )
        return FindingReport(
            key=key,
            severity=top.rule.severity,
            summary=f"{top.rule.summary} ({subject}: {top.value:.4g})",
            cause=cause,
            evidence=evidence,
            runbook=self.kind,
        )


def static_policies(rules: Sequence[StaticRule] = STATIC_RULES) -> list[StaticRulePolicy]:
    """One policy per finding kind the rules cover, in rule order."""
    kinds = list(dict.fromkeys(r.kind for r in rules))
    return [StaticRulePolicy(k, rules_for(k, rules)) for k in kinds]
