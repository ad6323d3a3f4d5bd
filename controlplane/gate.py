"""The canary gate: consult the judge every step, from the first interval of the rollout until it decides.

What it owns: which pods are the baseline and which the canary (`ArmSelector`), turning what a
source has for one step into the judge's `Interval` (live targets scraped directly, a Prometheus
that scrapes them, or the control plane's own store), the consult-every-step loop with its
bounded patience for a failing source, and the reports CI jobs read. The statistics live in
`policies/canary.py`; storing the verdict and acting on it belong to the caller.
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import logging
import math
import re
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import re2

from collectors import families
from collectors.exposition import ExpositionError, Parser
from collectors.prometheus_api import PrometheusError, PrometheusSource, escape_regex, selector
from collectors.restarts import PROCESS_START, ProcessStarts, process_start
from collectors.scraper import Scraper
from collectors.types import Signal, Target
from collectors.vllm import FAMILIES, read_engines
from controlplane.actuators.base import TargetSource
from controlplane.clock import Clock
from controlplane.errors import FleetError, GateError, GateInputError, StoreUnavailable
from controlplane.selectors import LabelSelector, split_clauses
from controlplane.store.records import NewVerdict
from policies.canary import (
    ENGINE_MEANS,
    ERRORS,
    Dist,
    GateSettings,
    Interval,
    MetricRule,
    Outcome,
    Verdict,
    arms_tpot_reading,
    engine_dists,
    judge,
    merge_into,
    step_problem,
    tpot_reading,
)

__all__ = [
    "EXIT_CODES",
    "ArmSelector",
    "GateBook",
    "GateKey",
    "GateSession",
    "GateSource",
    "PromGateSource",
    "StoreGateSource",
    "TargetsGateSource",
    "dists_of",
    "report",
    "rerun_after",
    "run_gate",
    "tpot_spelling",
]

log = logging.getLogger(__name__)

# A marginal canary is not promoted without a person, as Argo treats Kayenta's marginal score: inconclusive.
EXIT_CODES = {Outcome.PASS: 0, Outcome.FAIL: 1, Outcome.MARGINAL: 2, Outcome.INCONCLUSIVE: 2}
# Gate metric -> the vLLM histogram it reads (the current spelling first, as the collector reads them).
HISTOGRAMS: Mapping[str, tuple[str, ...]] = {k: FAMILIES.histograms[k] for k in ("ttft", "tpot", "itl", "e2e", "queue_time")}
_UNREAD = ""  # a metric not read this step (see `_TpotReading`)
MAX_SOURCE_ERRORS = 4  # consecutive failed steps before the gate gives up, as Argo's consecutiveErrorLimit
# A failed gate asked again after this many of its steps, and at least RERUN_MIN_S, without a question is a new run
# (a retry): an analysis asks every interval until a fail, and a lost answer is asked for again at the next.
RERUN_STEPS = 3
RERUN_MIN_S = 300.0
_REGEX_CLAUSE = re.compile(r"^\s*(?P<key>[A-Za-z0-9_./-]+)\s*(?P<op>=~|!~)\s*(?P<value>.*?)\s*$")

# Selector regexes come over the HTTP API from whoever asks: RE2 matches in linear time (a backtracking `(a|aa)*`
# would stall the event loop the control loop shares) and is the syntax PromQL's `=~` speaks.
_RE2 = re2.Options()
_RE2.log_errors = False


@dataclass(frozen=True, slots=True)
class ArmSelector:
    """Which pods form an arm: a Kubernetes label selector over the labels a source knows (every source
    knows `pool`, `pod` and `role`), plus `key=~regex` and `key!~regex` clauses matched in full."""

    text: str
    labels: LabelSelector
    regexes: tuple[tuple[str, bool, Any], ...] = ()  # (label, wanted, an RE2 pattern)

    @classmethod
    def parse(cls, text: str) -> ArmSelector:
        """GateError names the selector and the clause it cannot read."""
        plain, regexes = [], []
        try:
            clauses = split_clauses(text)
        except ValueError as exc:
            raise GateInputError(f"selector {text!r}: {exc}") from None
        for clause in clauses:
            if m := _REGEX_CLAUSE.match(clause):
                try:
                    regexes.append((m["key"], m["op"] == "=~", re2.compile(m["value"], _RE2)))
                except re2.error as exc:
                    why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
                    raise GateInputError(f"selector {text!r}: clause {clause!r} is not a regular expression "
                                         f"(RE2, as PromQL): {why}") from None
            else:
                plain.append(clause)
        try:
            labels = LabelSelector.parse(",".join(plain))
        except ValueError as exc:
            raise GateInputError(f"selector {text!r}: {exc}") from None
        if not labels.requirements and not regexes:
            raise GateInputError(f"selector {text!r} selects every pod: name the canary's or the baseline's pods")
        return cls(text, labels, tuple(regexes))

    def narrowed(self, other: ArmSelector) -> ArmSelector:
        """The pods both select."""
        return ArmSelector(f"{self.text},{other.text}", LabelSelector(self.labels.requirements + other.labels.requirements),
                           self.regexes + other.regexes)

    def keys(self) -> set[str]:
        """The labels it names."""
        return {r.key for r in self.labels.requirements} | {key for key, _, _ in self.regexes}

    def matches(self, labels: Mapping[str, str]) -> bool:
        if not self.labels.matches(labels):
            return False
        return all(bool(rx.fullmatch(labels.get(key, ""))) == want for key, want, rx in self.regexes)

    def promql(self) -> list[tuple[str, str, str]]:
        """The same selection as PromQL label matchers."""
        out: list[tuple[str, str, str]] = []
        for r in self.labels.requirements:
            values = "|".join(escape_regex(v) for v in sorted(r.values))
            out.append({"=": (r.key, "=", next(iter(r.values), "")), "!=": (r.key, "!=", next(iter(r.values), "")),
                        "in": (r.key, "=~", values), "notin": (r.key, "!~", values),
                        "exists": (r.key, "!=", ""), "!exists": (r.key, "=", "")}[r.op])
        out.extend((key, "=~" if want else "!~", rx.pattern) for key, want, rx in self.regexes)
        return out


def dists_of(deltas: Iterable[families.Delta], names: Iterable[str],
             read_as: Mapping[str, str] | None = None) -> dict[str, Dist]:
    """One arm's observations for each metric, summed over its engines' deltas (buckets as `sum by (le)`), each read
    from the histogram `read_as` names for it (default: its own)."""
    given = list(deltas)
    out: dict[str, Dist] = {}
    if not given:
        return out
    merged = families.merge_all(given)
    for name in names:
        if name == ERRORS:
            finished = sum(v for k, v in merged.increases.items() if k.startswith("finished:"))
            if finished > 0:
                out[name] = Dist.of_events(merged.increases.get("finished:error", 0.0), finished)
            continue
        hist = merged.histograms.get((read_as or {}).get(name, name))
        if hist is not None and hist.count > 0:
            out[name] = Dist(hist.count, hist.sum, hist.buckets)
    return out


def tpot_spelling(engines: Iterable[families.Reading | families.Delta]) -> dict[str, str]:
    """Where both arms' TPOT is read, from every engine of both: the per-request histogram when each has it, else the
    inter-token latency for both (engines before it). Each arm on its own would compare a per-request mean with a
    token-weighted one."""
    return tpot_reading("tpot" in e.histograms for e in engines)


class _TpotReading:
    """Where one gate reads TPOT, decided once both arms report (`tpot_spelling`'s rule) and kept for the whole gate,
    so that its blocks never mix a per-request mean with a token-weighted one; until then TPOT is not read."""

    def __init__(self, names: Iterable[str]) -> None:
        self._as: dict[str, str] | None = None if "tpot" in names else {}

    def read_as(self, decide: Callable[[], dict[str, str] | None]) -> dict[str, str]:
        """The metric -> histogram map for this step; `decide` gives it, or None while an arm has nothing yet."""
        if self._as is None:
            self._as = decide()
        return {"tpot": _UNREAD} if self._as is None else self._as


class _Owed:
    """The canary's restarts a source has read and no step has carried yet: one read in a step that failed (a
    canary pod down, a query refused) goes in the next step read."""

    def __init__(self) -> None:
        self._pods: list[str] = []

    def add(self, pod: str) -> None:
        """One restart of `pod`."""
        self._pods.append(pod)

    def take(self) -> tuple[str, ...]:
        """Every restart owed, once."""
        pods, self._pods = tuple(self._pods), []
        return pods


class GateSource(Protocol):
    """Where a gate's numbers come from: both arms' observations over one step."""

    # Seconds after a step ends before all of its numbers can be read: a step read sooner would miss points stamped
    # within it but written later, and the next step, which starts at its end, would never read them.
    settle: float

    async def interval(self, start: float, end: float) -> Interval:
        """What each arm observed between `start` and `end` (raises on a failed read)."""
        ...


def _check_rules(rules: Sequence[MetricRule], known: Iterable[str], source: str) -> None:
    unknown = sorted({r.name for r in rules} - set(known))
    if unknown:
        raise GateInputError(f"metric(s) {unknown} cannot be read from {source}; it knows {sorted(set(known))}")


class TargetsGateSource:
    """The pods' own `/metrics`, scraped at every step; each step is the difference from the last scrape.

    The arms are selected afresh each step from the source's vLLM targets (a pod's `pool`, `pod` and `role`), so the
    canary's new pods count as its rollout scales it up and the stable's removed ones drop out. A pod discovery no
    longer lists (deleted, or not Ready: out of its Service's routing too) is no longer read.
    """

    settle = 0.0  # each step is scraped when it ends

    def __init__(self, scraper: Scraper, found: TargetSource, baseline: ArmSelector, canary: ArmSelector,
                 rules: Sequence[MetricRule]) -> None:
        _check_rules(rules, [*HISTOGRAMS, ERRORS], "the pods' /metrics")
        self._scraper, self._found, self._selectors = scraper, found, {"baseline": baseline, "canary": canary}
        self._names = [r.name for r in rules]
        self._parser = Parser()
        self._prev: dict[tuple[str, str], tuple[float, families.Reading]] = {}  # (target, engine) -> its last reading
        self._answered: set[str] = set()  # canary targets that answered a scrape of this gate
        self._started = ProcessStarts()  # the canary's targets', kept while one is not listed
        self._restarted = _Owed()
        self._stepped = False
        self._tpot = _TpotReading(self._names)

    async def arms(self) -> dict[str, list[Target]]:
        """Each arm's targets now. GateInputError for a pod in both, or, before the first step, an arm with none;
        after it, an arm with none or a failed listing is a failed step (GateError)."""
        try:
            found = await self._found.targets()
        except FleetError as exc:  # the Kubernetes API down for a while: the gate's patience covers it
            if not self._stepped or isinstance(exc, GateError):
                raise
            raise GateError(f"listing the pods: {exc}") from None
        arms: dict[str, list[Target]] = {"baseline": [], "canary": []}
        for t in found:
            labels = {"pool": t.pool, "pod": t.pod, "role": str(t.role)}
            for arm, sel in self._selectors.items():
                if t.source == "vllm" and sel.matches(labels):
                    arms[arm].append(t)
        both = sorted({t.key for t in arms["baseline"]} & {t.key for t in arms["canary"]})
        if both:  # a pod in both arms would be compared with itself, and read twice a step
            raise GateInputError(f"{', '.join(both)} match both the baseline's and the canary's selector")
        for arm, targets in arms.items():
            if not targets:
                why = f"no {arm} target matches its selector {self._selectors[arm].text!r}"
                raise GateError(why + " now") if self._stepped else GateInputError(why)
        return arms

    async def interval(self, start: float, end: float) -> Interval:
        seen: dict[str, list[families.Delta]] = {}
        arms = await self.arms()
        self._stepped = True
        listed = {t.key for targets in arms.values() for t in targets}
        self._prev = {slot: r for slot, r in self._prev.items() if slot[0] in listed}  # pods gone leave no readings
        for arm, targets in arms.items():
            results = await self._scraper.scrape(targets, end)
            deltas = []
            for res in results:
                if not res.ok:
                    continue  # the next good scrape spans the gap
                errors: list[ExpositionError] = []  # a malformed line is skipped, the rest still counts
                samples = list(self._parser.parse(res.body, errors=errors))
                if errors:
                    log.warning("%s: %d malformed exposition line(s), first: %s", res.target.url, len(errors), errors[0])
                if arm == "canary" and (started := process_start(samples)) is not None \
                        and self._started.restarted(res.target.key, started, res.ts):
                    self._restarted.add(res.target.pod)
                for entity, reading in read_engines(samples).items():
                    prev = self._prev.get((res.target.key, entity))
                    self._prev[(res.target.key, entity)] = (res.ts, reading)
                    if prev is None:
                        continue  # its first reading: a delta from the next step on
                    # Over the time since its last good scrape, which failed ones since make longer than a step (never
                    # under a step: a scrape stamped late, behind slow ones, would leave the next one a shorter span).
                    if (d := families.advance(prev[1], reading, max(res.ts - prev[0], end - start))) is not None:
                        deltas.append(d)
            if not any(r.ok for r in results):
                raise GateError(f"no {arm} target answered: " + "; ".join(f"{r.target.url}: {r.error}" for r in results))
            if arm == "canary":
                # A canary pod still routed that stopped answering would leave the step judged on its healthy ones
                # alone (its requests fail before vLLM counts them): no step counts while one that answered before is
                # down, and the gate stops if it stays down. One that has not answered yet is starting (loading its
                # model).
                down = [r for r in results if not r.ok and r.target.key in self._answered]
                self._answered.update(r.target.key for r in results if r.ok)
                if down:
                    raise GateError("canary pod(s) not answering: "
                                    + "; ".join(f"{r.target.url}: {r.error}" for r in down))
            seen[arm] = deltas
        # Decided from every engine of the arms that has answered in this gate, its first reading included: an older
        # one whose scrape failed in the deciding step would be left out for good.
        read_as = self._tpot.read_as(lambda: tpot_spelling(r for _, r in self._prev.values()) if all(seen.values()) else None)
        dists = {arm: dists_of(deltas, self._names, read_as) for arm, deltas in seen.items()}
        return Interval(start, end, dists["baseline"], dists["canary"], self._restarted.take())


class PromGateSource:
    """A Prometheus that scrapes the engines: bucket, sum and count increases per arm over each step."""

    settle = 0.0  # increase() over a step reads the samples Prometheus holds by its end

    def __init__(self, prom: PrometheusSource, baseline: ArmSelector, canary: ArmSelector,
                 rules: Sequence[MetricRule]) -> None:
        _check_rules(rules, [*HISTOGRAMS, ERRORS], "Prometheus")
        self._prom = prom
        # The fleet file's selector narrows every query (one Prometheus may hold staging and production), and `pod` and
        # `pool` are read through its label names.
        named = {"pod": prom.labels.pod, "pool": prom.labels.pool}
        try:
            self._arms = {arm: selector([*prom.matchers, *((named.get(k, k), op, v) for k, op, v in sel.promql())])
                          for arm, sel in (("baseline", baseline), ("canary", canary))}
        except ValueError as exc:  # a Kubernetes label key (app.kubernetes.io/version) is no Prometheus label name
            raise GateInputError(f"a selector cannot be asked of Prometheus: {exc}") from None
        if self._arms["baseline"] == self._arms["canary"]:
            raise GateInputError(f"the baseline's and the canary's selectors are the same ({baseline.text!r}): the "
                                 "canary would be compared with itself")
        self._names = [r.name for r in rules]
        self._families: dict[tuple[str, str], str] = {}  # (metric, arm's selector) -> the spelling that arm has
        self._tpot = _TpotReading(self._names)
        self._served: set[tuple[str, str]] = set()  # the canary's vLLM targets (pod, instance) that served in this gate
        self._started = ProcessStarts()  # each of them: (pod, instance)
        self._restarted = _Owed()
        self._sampled = False  # whether a step was seen to hold two samples of a baseline series

    def _query(self, expr: str, ts: float) -> list[tuple[dict[str, str], float]]:
        return self._prom.query(expr, ts)

    def _family(self, name: str, sel: str, ts: float, window: str) -> str | None:
        # Per arm: a canary on a newer vLLM may export the current spelling where its baseline has the old one.
        if (name, sel) not in self._families:
            for fam in HISTOGRAMS[name]:
                if self._query(f"count(last_over_time({fam}_count{sel}[{window}]))", ts):
                    self._families[(name, sel)] = fam
                    break
            else:
                return None
        return self._families[(name, sel)]

    def _spelling(self, end: float, window: str) -> dict[str, str] | None:
        # The per-request histogram where each arm exports it, else the inter-token latency for both (an arm on a
        # vLLM before the per-request one); None while an arm exports neither (not serving yet).
        for name, read_as in (("tpot", {}), ("itl", {"tpot": "itl"})):
            if all(self._family(name, sel, end, window) is not None for sel in self._arms.values()):
                return read_as
        return None

    def _arm(self, sel: str, start: float, end: float, read_as: Mapping[str, str]) -> dict[str, Dist]:
        window = _window(start, end)
        out: dict[str, Dist] = {}
        inner = sel[1:-1] if sel else ""
        for name in self._names:
            if name == ERRORS:
                total = self._scalar(f"sum(increase(vllm:request_success_total{sel}[{window}]))", end)
                failed = "{" + (inner + "," if inner else "") + 'finished_reason="error"}'
                errors = self._scalar(f"sum(increase(vllm:request_success_total{failed}[{window}]))", end)
                if total:
                    out[name] = Dist.of_events(errors or 0.0, total)
                continue
            source = read_as.get(name, name)
            fam = None if source == _UNREAD else self._family(source, sel, end, window)
            if fam is None:
                continue
            count = self._scalar(f"sum(increase({fam}_count{sel}[{window}]))", end)
            if not count:
                continue
            total = self._scalar(f"sum(increase({fam}_sum{sel}[{window}]))", end) or 0.0
            rows = self._query(f"sum by (le) (increase({fam}_bucket{sel}[{window}]))", end)
            buckets = sorted((le, v) for labels, v in rows
                             if (le := _bound(labels.get("le"))) is not None and math.isfinite(v))
            out[name] = Dist(count, total, tuple(buckets) if buckets and math.isinf(buckets[-1][0]) else ())
        return out

    def _scalar(self, expr: str, ts: float) -> float | None:
        rows = self._query(expr, ts)
        return rows[0][1] if rows and math.isfinite(rows[0][1]) else None

    def _check_arms(self, start: float, end: float) -> None:
        """Refuse pods that both arms select (a baseline regex that also matches the canary's pods): the canary
        would be diluted into its own baseline, and a regression read smaller than it is. Note the canary's pods
        whose process restarted, and skip a step in which one is down."""
        window, pod, instance = _window(start, end), self._prom.labels.pod, self._prom.labels.instance
        by = ", ".join(dict.fromkeys((pod, instance)))  # one label where the fleet's pods are named by instance
        seen = [self._query(f"group by ({by}) (last_over_time(vllm:num_requests_running{sel}[{window}]))", end)
                for sel in (self._arms["baseline"], self._arms["canary"])]
        pods = [{labels.get(pod) for labels, _ in rows} for rows in seen]
        both = sorted(p for p in pods[0] & pods[1] if p)
        if both:
            raise GateInputError(f"pod(s) {', '.join(both)} match both the baseline's and the canary's selector")
        if pods[0] and not self._sampled:
            # increase() needs two samples of a series within the step: with Prometheus scraping no more often than
            # the step, every step would be empty and the gate wait out its window for nothing.
            per_series = self._scalar(f"max(count_over_time(vllm:num_requests_running{self._arms['baseline']}"
                                      f"[{window}]))", end)
            if per_series is not None and per_series < 2:
                raise GateInputError(f"Prometheus holds {per_series:g} sample of the baseline's series in a step of "
                                     f"{end - start:g}s: it scrapes them no more often than that; make the step at "
                                     "least twice its scrape interval")
            self._sampled = per_series is not None
        # A canary pod Prometheus cannot scrape drops out of the arm's sums: the step would be judged on the others.
        # Only a vLLM target that served in this gate counts (one still loading its model is starting, and other
        # scrape jobs of the same pods are not the engine); asked by its instance, since `up` carries the target's
        # labels only, and the arm's selector may name one that only vLLM's series carry.
        # By pod as well: an address a deleted canary pod had may be another pod's soon after.
        self._served.update((labels.get(pod, ""), i) for labels, _ in seen[1] if (i := labels.get(instance)))
        if not self._served:
            return
        instances = "|".join(escape_regex(i) for i in sorted({i for _, i in self._served}))
        served = selector([*self._prom.matchers, (instance, "=~", instances)])
        for labels, started in self._query(f"max by ({by}) ({PROCESS_START}{served})", end):
            if ((slot := (labels.get(pod, ""), labels.get(instance, ""))) in self._served and math.isfinite(started)
                    and self._started.restarted(slot, started, end)):
                self._restarted.add(slot[0] or slot[1])
        rows = self._query(f"up{served} == 0", end)
        if down := sorted({labels.get(pod) or labels.get(instance, "?") for labels, _ in rows
                           if (labels.get(pod, ""), labels.get(instance)) in self._served}):
            raise GateError(f"canary pod(s) {', '.join(down)} not answering Prometheus's scrapes")

    async def interval(self, start: float, end: float) -> Interval:
        try:
            await asyncio.to_thread(self._check_arms, start, end)
            window = _window(start, end)
            read_as = await asyncio.to_thread(self._tpot.read_as, lambda: self._spelling(end, window))
            base = await asyncio.to_thread(self._arm, self._arms["baseline"], start, end, read_as)
            can = await asyncio.to_thread(self._arm, self._arms["canary"], start, end, read_as)
        except PrometheusError as exc:
            raise GateError(str(exc)) from None
        return Interval(start, end, base, can, self._restarted.take())


class SignalReader(Protocol):
    """What the store source needs of the store."""

    async def load_signals(self, since: float, names: Iterable[str] | None = None,
                           until: float | None = None) -> list[Signal]: ...


class StoreGateSource:
    """The control plane's own store: each engine's interval mean, weighted by how many observations it holds.

    The store keeps means and quantiles per engine, not buckets, so only the `mean` statistic is exact
    here; rules on quantiles need a histogram source (Prometheus or the pods themselves).
    """

    def __init__(self, store: SignalReader, pool: str, baseline: ArmSelector, canary: ArmSelector,
                 rules: Sequence[MetricRule], role: str | None = None, scrape_interval: float = 0.0) -> None:
        # The loop stamps a scrape when its round starts and writes it when the round ends, within an interval.
        self.settle = scrape_interval
        _check_rules(rules, [*ENGINE_MEANS, ERRORS], "the store")
        # An engine in the store is known by its pool and pod (and its pool's role, from the fleet file): a selector on
        # another label would match no pod, or every one, and the gate wait its whole window for nothing.
        self._known = {"pool": pool, **({"role": role} if role else {})}
        for sel in (baseline, canary):
            if unknown := sorted(sel.keys() - {*self._known, "pod"}):
                hint = " (a pool's role comes from the fleet file: pass --fleet)" if "role" in unknown else ""
                raise GateInputError(f"selector {sel.text!r} names {', '.join(unknown)}: the store knows the engines' "
                                     f"{', '.join(sorted({*self._known, 'pod'}))}{hint}")
        quantiles = [r.label for r in rules if r.statistic != "mean"]
        if quantiles:
            raise GateInputError(f"rule(s) {quantiles}: the store keeps per-engine quantiles, which cannot be merged "
                            f"across pods; judge the mean, or read Prometheus or the pods")
        self._store, self._pool, self._arms = store, pool, {"baseline": baseline, "canary": canary}
        self._names = [r.name for r in rules]
        self._answered: set[str] = set()  # the canary's pods whose scrapes succeeded in this gate
        self._restarted = _Owed()
        self._read_to: float | None = None  # the end of the last step read from the store
        self._arm: dict[str, str | None] = {}  # a pod of the pool -> its arm
        self._tpot = _TpotReading(self._names)

    async def interval(self, start: float, end: float) -> Interval:
        tpot = {"tpot_per_request", *ENGINE_MEANS["itl"]} if "tpot" in self._names else set()
        wanted = {"up", "restarts", "request_rate", "request_error_rate", "generation_tokens_rate", *tpot,
                  *(ENGINE_MEANS[n][0] for n in self._names if n in ENGINE_MEANS)}
        # Two steps back, so the first point in the window knows how long its interval was; nothing after the step,
        # so a replica catching up on a long gate reads each step's rows, not every row since, once per step.
        # Restarts since the last step read: one in a step the store failed to give is counted in the next.
        since = start if self._read_to is None else min(start, self._read_to)
        try:
            signals = await self._store.load_signals(min(since, start - 2 * (end - start)), names=wanted, until=end)
        except StoreUnavailable as exc:  # a database blip is a failed step, which the gate's patience covers
            raise GateError(str(exc)) from None
        self._read_to = end
        engines: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
        latest: dict[str, float] = {}  # the pool's vLLM targets: each pod's last `up` by `end`, a step back at most
        for s in sorted(signals, key=lambda s: s.ts):
            if s.subject.startswith(f"engine/{self._pool}/") and s.ts <= end:
                engines[s.subject][s.name].append((s.ts, s.value))
            elif s.subject.startswith(f"target/{self._pool}/") and s.subject.endswith("/vllm"):
                pod = s.subject.split("/")[2]
                if s.name == "restarts" and since < s.ts <= end and self._arm_of(pod) == "canary":
                    self._restarted.add(pod)
                elif s.name == "up" and 2 * start - end < s.ts <= end:
                    latest[pod] = s.value
                    if s.value >= 1 and self._arm_of(pod) == "canary":
                        self._answered.add(pod)
        arms: dict[str, dict[str, Dist]] = {"baseline": {}, "canary": {}}
        armed = {subject: arm for subject in engines
                 if (arm := self._arm_of(subject.split("/", 3)[2])) is not None}  # engine/<pool>/<pod>/<rank>
        both = {arm: [engines[s] for s, a in armed.items() if a == arm] for arm in arms}

        # Which TPOT both arms are read on (an engine upgraded past the per-request histogram beside older ones),
        # decided once they say and kept for the gate.
        read_as = self._tpot.read_as(lambda: arms_tpot_reading(both["baseline"], both["canary"], start - (end - start)))
        for subject, arm in armed.items():
            for name, d in engine_dists(engines[subject], self._names, start, end, read_as).items():
                merge_into(arms[arm], name, d)
        # A canary pod still scraped that stopped answering would leave the step judged on its healthy ones alone: as
        # the other sources, no step counts while one that answered in this gate fails the loop's scrapes (its last
        # `up` by the step's end, so that one written after the read leaves the step before's; a pod deleted or out
        # of discovery is scraped no more, and its last one goes by a step later). A fleet read through Prometheus
        # records no `up`, and is not checked here.
        if down := sorted(pod for pod, up in latest.items() if up < 1 and pod in self._answered):
            raise GateError(f"canary pod(s) {', '.join(down)} failing the control plane's scrapes")
        return Interval(start, end, arms["baseline"], arms["canary"], self._restarted.take())

    def _arm_of(self, pod: str) -> str | None:
        if pod not in self._arm:  # asked for every series of every step: matched once per pod
            matched = [a for a, sel in self._arms.items() if sel.matches({**self._known, "pod": pod})]
            if len(matched) == 2:  # the canary diluted into its own baseline would read a regression smaller
                raise GateInputError(f"pod {pod} matches both the baseline's and the canary's selector")
            self._arm[pod] = matched[0] if matched else None
        return self._arm[pod]


class GateSession:
    """One canary's gate: every step since `start` read once from the source, judged whenever asked."""

    def __init__(self, source: GateSource, settings: GateSettings, start: float) -> None:
        self.source, self.settings, self.start = source, settings, start
        self.intervals: list[Interval] = []
        self._t = start
        self._failures = 0
        self.verdict: Verdict | None = None  # the first decided verdict: the gate's answer from then on
        self.answered_at: float | None = None  # when the decided verdict was last answered
        self.marked_at = -math.inf  # when this replica last told the others the gate is asked (`GateBook._mark`)
        self.elected: bool | None = None  # whether this replica records it; None until the store has said

    @property
    def next_step_at(self) -> float:
        """When the next step can be read: its end, and the source's settling time after it."""
        return self._t + self.settings.step + self.source.settle

    async def consult(self, now: float) -> Verdict:
        """Read every step that can be read by `now`, judging after each as a gate asked every step would; once
        decided, the answer stays. GateError after more than `MAX_SOURCE_ERRORS` failed steps in a row."""
        if self.verdict is not None:
            return self.verdict
        verdict: Verdict | None = None  # the last judgement, where a step was read
        while self.next_step_at <= now + 1e-9 and not self._final:
            end = self._t + self.settings.step
            try:
                self.intervals.append(await self.source.interval(self._t, end))
                self._failures = 0
            except GateInputError:
                raise  # asked wrongly: waiting does not mend it
            except GateError as exc:
                self._failures += 1
                if self._failures > MAX_SOURCE_ERRORS:
                    raise GateError(f"{self._failures} steps in a row without data: {exc}") from None
            self._t = end
            # A catch-up (a replica that did not start the gate, a past start) stops at the first step a gate asked
            # all along would have decided at: the answer depends on the data, not on when it was asked.
            if self.intervals and (verdict := judge(self.intervals, self.settings, final=self._final)).decided:
                break
        if verdict is None:
            verdict = judge(self.intervals, self.settings, final=self._final) if self.intervals else Verdict(
                Outcome.INCONCLUSIVE, self._final, None, "no step has produced data yet", (), self.start, self._t)
        if verdict.decided:
            self.verdict = verdict
        return verdict

    @property
    def _final(self) -> bool:
        return self._t - self.start >= self.settings.max_window - 1e-9


async def run_gate(source: GateSource, settings: GateSettings, clock: Clock, *, start: float | None = None,
                   on_step: Callable[[Verdict], Awaitable[None] | None] | None = None) -> Verdict:
    """Judge every `step` from `start` (now by default; a past start catches up at once) until the judge
    decides or `max_window` has passed; returns the verdict. GateError when the source keeps failing."""
    session = GateSession(source, settings, clock.now() if start is None else start)
    while True:
        wait = session.next_step_at - clock.now()
        if wait > 0:
            await clock.sleep(wait)
        verdict = await session.consult(clock.now())
        if on_step is not None:
            maybe = on_step(verdict)
            if maybe is not None:
                await maybe
        if verdict.decided:
            return verdict


SourceFactory = Callable[[str, ArmSelector, ArmSelector, Sequence[MetricRule]], GateSource]


@dataclass(frozen=True, slots=True)
class GateKey:
    """One rollout's gate: the pool, both selectors, the revision (a new one starts a new gate) and the settings the
    caller asked for, if any (a caller asking for another window or step gets a gate of its own, never the one a
    rollout controller consults)."""

    pool: str
    baseline: str
    canary: str
    revision: str = ""
    settings: str = ""

    @property
    def id(self) -> str:
        """A short stable name of this gate (the store's claims are keyed by it)."""
        text = "\0".join((self.pool, self.baseline, self.canary, self.revision)) + (
            f"\0{self.settings}" if self.settings else "")
        return hashlib.sha256(text.encode()).hexdigest()[:40]


def rerun_after(settings: GateSettings) -> float:
    """The silence after a verdict that did not pass past which the gate asked again is a new run of it."""
    return max(RERUN_STEPS * settings.step, RERUN_MIN_S)


# (key, value, stale_before) -> (the value claimed, whether this call claimed it): `Store.claim`.
Claim = Callable[[str, float, float], Awaitable[tuple[float, bool]]]


class GateBook:
    """The gates the HTTP API runs for Argo Rollouts and Flagger: one session per rollout, started by its
    first consultation and answered from then on; a decided verdict is recorded once.

    With `claim` (the store's), every replica behind the API's Service judges a rollout from the same start
    and one of them records its verdict: a replica without the session (another one started it, or it
    restarted) catches up on the steps since from the store. Without it, each process starts its own.
    A failed gate asked again after a silence (`rerun_after`) is a new run of the same revision: `kubectl
    argo rollouts retry` after the abort keeps the pod-template hash, so the same gate, and Argo's
    analysis stops asking at a fail. So is a run that neither failed nor passed (an analysis that ended
    Inconclusive pauses the rollout, and is retried), whichever replica the retry reaches, and, with no
    other replica, one not yet decided. A pass stays the answer (it promoted), as every verdict does for
    Flagger's hooks (`reruns`).
    Sessions idle for twice the window are forgotten.
    """

    def __init__(self, make_source: SourceFactory, settings: GateSettings | None = None,
                 record: Callable[[NewVerdict], Awaitable[int]] | None = None, max_sessions: int = 256,
                 claim: Claim | None = None, scrape_interval: float = 0.0) -> None:
        self._make, self.settings, self._record, self._claim = make_source, settings or GateSettings(), record, claim
        self._interval = scrape_interval  # how often the sources' numbers are scraped: no step may be shorter
        self._max = max_sessions
        self._sessions: dict[GateKey, tuple[GateSession, float]] = {}
        self._locks: dict[GateKey, asyncio.Lock] = {}
        # Decided verdicts this process is to record and has not yet (the store refused), per gate and run: asked
        # again at every consultation, since the claim that made this process the recorder keeps every other from it.
        self._owed: dict[tuple[GateKey, float], NewVerdict] = {}
        self._recording = asyncio.Lock()
        self._settling: asyncio.Task[None] | None = None  # retries of what the store refused, beside the answers
        self._tasks: set[asyncio.Task[None]] = set()  # store writes made beside the answers (kept from collection)

    async def consult(self, key: GateKey, now: float, settings: GateSettings | None = None, *,
                      reruns: bool = True) -> Verdict:
        """The verdict of this rollout's gate now; `settings` for a gate not yet started; without `reruns` every
        verdict stays the answer however long the silence. GateInputError for a bad selector or a step shorter than
        the scrape interval, GateError for a failing source."""
        self._forget(now)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            return await self._consult(key, lock, now, settings, reruns)
        finally:
            # A bad selector or a full book: nothing to keep a lock for (unless another consultation waits on it).
            if key not in self._sessions and not lock.locked():
                self._locks.pop(key, None)

    async def _consult(self, key: GateKey, lock: asyncio.Lock, now: float, settings: GateSettings | None,
                       reruns: bool) -> Verdict:
        async with lock:  # Argo and a person may ask at once: one read of each step
            entry = self._sessions.get(key)
            s = entry[0].settings if entry is not None else settings or self.settings
            arms = None
            if entry is None:  # asked wrongly (400) before a full book (503), and both before the store is written
                if why := step_problem(s.step, self._interval):
                    raise GateInputError(f"step {why}")
                if len(self._sessions) >= self._max and not self._make_room(now):
                    raise GateError(f"{self._max} gates are running: finish some before starting {key.pool}'s")
                arms = ArmSelector.parse(key.baseline), ArmSelector.parse(key.canary)
            start = await self._start(key, entry, s, now, reruns)
            if entry is None or entry[0].start != start:  # a new gate, or a new run of it
                if entry is not None:  # the run it replaces is recorded by someone, if the store lets it be settled
                    await self._elect(key, entry[0])
                base, can = arms or (ArmSelector.parse(key.baseline), ArmSelector.parse(key.canary))
                entry = (GateSession(self._make(key.pool, base, can, s.metrics), s, start), now)
            session = entry[0]
            self._sessions[key] = (session, now)
            verdict = await session.consult(now)
            self._mark(key, session, now)
            fresh = verdict.decided and await self._answered(key, session, verdict, now)
        if fresh and not self._recording.locked():  # recorded as it is answered, while the store takes it
            await self._record_owed(only=(key, session.start))
        # What the store refused before is retried beside the answer, which a store down must not delay.
        self._settle_later()
        return verdict

    def _settle_later(self) -> None:
        """Retry the elections and records the store refused, in the background (one retry at a time)."""
        pending = bool(self._owed) or any(s.verdict is not None and s.elected is None for s, _ in self._sessions.values())
        if pending and (self._settling is None or self._settling.done()):
            self._settling = self._beside(self._record_owed(), "recording the gates' verdicts")

    def _beside(self, work: Awaitable[None], what: str) -> asyncio.Task[None]:
        """Run `work` beside the answers, its failure logged."""
        async def quietly() -> None:
            try:
                await work
            except Exception:
                log.exception("%s failed", what)

        task = asyncio.get_running_loop().create_task(quietly())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settled(self) -> None:
        """Wait for the store writes running beside the answers (at shutdown, and in tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks)

    def _mark(self, key: GateKey, session: GateSession, now: float) -> None:
        """Tell the other replicas the gate is still asked, at most twice a window and beside the answer: a replica
        that never held it (a new one, one restarted) joins this run, however old its start, instead of taking it
        for an earlier rollout's."""
        claim = self._claim
        # Often enough for a silence of `rerun_after` to tell a retry: every replica marks it at least twice that long.
        if claim is None or now - session.marked_at < min(session.settings.max_window, rerun_after(session.settings)) / 2:
            return
        session.marked_at = now

        async def mark() -> None:
            try:
                await claim(f"gate-asked:{key.id}", now, now)
            except FleetError as exc:
                log.warning("%s's gate: that it is still asked cannot be told to the other replicas now: %s",
                            key.pool, exc)

        self._beside(mark(), f"marking {key.pool}'s gate as asked")

    async def _answered(self, key: GateKey, session: GateSession, verdict: Verdict, now: float) -> bool:
        """After a decided answer: its run's first elects the replica that records the verdict (asked again while the
        store refuses: `_record_owed`); one that did not pass is marked as answered now, for every replica, the ones
        holding the run undecided included, to tell a retry (asked after a silence) from the same run asked again (at
        most one write a step). Whether this answer made the verdict this replica's to record."""
        session.answered_at = now
        if self._claim is not None and verdict.outcome is not Outcome.PASS:
            try:
                # The key's name is older than its meaning (a fail only), and rows of it still mean what they did.
                await self._claim(f"gate-failed:{key.id}", now, max(session.start, now - session.settings.step))
            except FleetError as exc:
                log.warning("%s's gate: its %s verdict cannot be marked with the other replicas now: %s", key.pool,
                            verdict.outcome.value, exc)
        return await self._elect(key, session)

    async def _elect(self, key: GateKey, session: GateSession) -> bool:
        """Settle whether this replica records the session's decided verdict, once per run (not while the store fails);
        whether this call made it owed here."""
        verdict = session.verdict
        if verdict is None or session.elected is not None:
            return False
        try:
            elected = self._claim is None or (await self._claim(f"gate-verdict:{key.id}", session.start,
                                                                session.start))[1]
        except FleetError as exc:
            log.warning("%s's gate: who records its %s verdict cannot be settled now: %s", key.pool,
                        verdict.outcome.value, exc)
            return False
        session.elected = elected
        if not elected or self._record is None:
            return False
        self._owed[key, session.start] = NewVerdict(
            "api", key.pool, key.baseline, key.canary, verdict.started_at, verdict.ended_at, verdict.outcome.value,
            verdict.score, {**verdict.as_dict(), "revision": key.revision})
        return True

    async def _start(self, key: GateKey, entry: tuple[GateSession, float] | None, s: GateSettings, now: float,
                     reruns: bool) -> float:
        """Where this consultation's run of the gate starts: the held session's while it is asked, else the one every
        replica claimed; now for a new run (none yet, an earlier rollout's under the same key, or a retry: a run
        whose verdict did not pass, asked again after a silence since that verdict was last answered)."""
        rerun = rerun_after(s)
        answered = 0.0  # when this replica last answered the held run's verdict, one that did not pass
        if entry is not None:
            session, seen = entry
            # Asked all along: the run goes on; a pass stays the answer (it promoted).
            if not reruns or now - seen <= rerun or (session.verdict is not None and session.verdict.outcome is
                                                     Outcome.PASS):
                return session.start
            if self._claim is None:
                # A retry (after an Inconclusive end, too little traffic, as after a fail); one not yet decided, asked
                # after a silence, is a retry too, as no other replica asks it.
                return now
            answered = session.answered_at or 0.0  # set only once decided
        elif self._claim is None:
            return now
        try:
            start = (await self._claim(f"gate-start:{key.id}", now, -1.0))[0]
            if entry is None and start < now - 2 * s.max_window:
                # An earlier rollout's under the same key, unless a replica was asked about it within two windows (a
                # long analysis; a held session is younger than that in any case).
                asked = (await self._claim(f"gate-asked:{key.id}", 0.0, -1.0))[0]
                if asked < now - 2 * s.max_window:
                    start = (await self._claim(f"gate-start:{key.id}", now, start + 1e-3))[0]
            # When a verdict other than a pass was last answered by any replica: 0 if never (or long ago: a row
            # expired), before `start` if in an earlier run; this replica's own answer counts where the store refused
            # its mark. A run this replica holds undecided that another decided is retried as that one's.
            ended_at = max((await self._claim(f"gate-failed:{key.id}", 0.0, -1.0))[0], answered)
            if reruns and ended_at > start and now - ended_at > rerun:
                start = (await self._claim(f"gate-start:{key.id}", now, ended_at + 1e-3))[0]
        except FleetError as exc:
            if entry is None:
                raise
            # The run this replica holds goes on without the store (a Prometheus or targets source needs none).
            log.warning("%s's gate: its start cannot be checked with the other replicas (%s); going on", key.pool, exc)
            return entry[0].start
        return start

    async def _record_owed(self, only: tuple[GateKey, float] | None = None) -> None:
        """Record every decided verdict still owed (or `only` one gate's run's), whichever gate is consulted now (a
        rollout that aborted on its verdict asks no more), after settling the elections the store refused. The
        verdict is the rollout's answer whether or not it is on record yet."""
        for key, (session, _) in list(self._sessions.items()) if only is None else ():
            if session.verdict is not None and session.elected is None:
                await self._elect(key, session)
        if not self._owed or self._record is None:
            return
        async with self._recording:  # two consultations at once must not record one verdict twice
            for (key, start), owed in [(k, v) for k, v in self._owed.items() if only is None or k == only]:
                try:
                    await self._record(owed)
                except FleetError as exc:
                    log.warning("%s's gate verdict (%s) not recorded yet, asked again at the next consultation: %s",
                                key.pool, owed.result, exc)
                    return
                self._owed.pop((key, start), None)

    def _make_room(self, now: float) -> bool:
        """Forget the session consulted longest ago, if no one has asked it for two of its steps (a rollout asks every
        step), so that gates started and left behind cannot keep the next rollout's from starting. With a claim, one
        asked again later catches up from the store."""
        idle = [(seen, key) for key, (session, seen) in self._sessions.items() if now - seen > 2 * session.settings.step]
        if not idle:
            return False
        self._drop(min(idle, key=lambda entry: entry[0])[1])
        return True

    def _forget(self, now: float) -> None:
        for key, (session, seen) in list(self._sessions.items()):
            if now - seen > 2 * session.settings.max_window:
                self._drop(key)

    def _drop(self, key: GateKey) -> None:
        session, _ = self._sessions.pop(key)
        if session.verdict is not None and session.elected is None:
            log.error("%s's gate verdict (%s) may never be recorded: the store refused to settle who records it until "
                      "its gate was forgotten", key.pool, session.verdict.outcome.value)
        self._locks.pop(key, None)
        for owed_key in [k for k in self._owed if k[0] == key]:
            lost = self._owed.pop(owed_key)
            log.error("%s's gate verdict (%s) was never recorded: the store refused it until its gate was forgotten",
                      key.pool, lost.result)


def report(verdict: Verdict, fmt: str, *, gate: str, pool: str, baseline: str, canary: str) -> str:
    """The verdict as `json`, `markdown` or `junit` (one test case per metric, where a fail is a failure and an
    inconclusive metric is skipped, and one for the gate's verdict, a failure unless it passed, so that a CI that
    reads only the failures never shows an inconclusive gate as green)."""
    head = {"gate": gate, "pool": pool, "baseline": baseline, "canary": canary}
    if fmt == "json":
        return json.dumps({**head, **verdict.as_dict()}, indent=2)
    if fmt == "markdown":
        lines = [f"## Canary gate {gate}: **{verdict.outcome.value}**", "",
                 f"Pool `{pool}`, baseline `{baseline}`, canary `{canary}`, "
                 f"{(verdict.ended_at - verdict.started_at) / 60:.1f} min. {verdict.reason}", "",
                 "| metric | result | baseline | canary | shift | interval | allowed | blocks |",
                 "|---|---|---|---|---|---|---|---|"]
        for m in verdict.metrics:
            lines.append(f"| {m.name}{' (critical)' if m.critical else ''} | {m.outcome.value} | {_num(m.baseline)} | "
                         f"{_num(m.canary)} | {_num(m.estimate)} | {_num(m.lower)} to {_num(m.upper)} | "
                         f"{_num(m.threshold)} | {m.blocks} |")
        lines += ["", *(f"- {m.reason}" for m in verdict.metrics)]
        return "\n".join(lines) + "\n"
    if fmt == "junit":
        cases = []
        for m in verdict.metrics:
            body = ""
            if m.outcome in (Outcome.FAIL, Outcome.MARGINAL):
                body = f'<failure type="{m.outcome.value}" message="{html.escape(m.reason)}"/>'
            elif m.outcome is Outcome.INCONCLUSIVE:
                body = f'<skipped message="{html.escape(m.reason)}"/>'
            cases.append(f'  <testcase classname="canary.{html.escape(pool)}" name="{html.escape(m.name)}">{body}'
                         f"</testcase>")
        passed = verdict.outcome is Outcome.PASS
        whole = "" if passed else f'<failure type="{verdict.outcome.value}" message="{html.escape(verdict.reason)}"/>'
        cases.append(f'  <testcase classname="canary.{html.escape(pool)}" name="verdict">{whole}</testcase>')
        failures = sum(m.outcome in (Outcome.FAIL, Outcome.MARGINAL) for m in verdict.metrics) + (not passed)
        skipped = sum(m.outcome is Outcome.INCONCLUSIVE for m in verdict.metrics)
        return ('<?xml version="1.0" encoding="UTF-8"?>\n'
                f'<testsuite name="canary gate {html.escape(gate)}: {verdict.outcome.value}" '
                f'tests="{len(cases)}" failures="{failures}" skipped="{skipped}" '
                f'time="{verdict.ended_at - verdict.started_at:.0f}">\n'
                f'  <properties><property name="result" value="{verdict.outcome.value}"/>'
                f'<property name="reason" value="{html.escape(verdict.reason)}"/></properties>\n'
                + "\n".join(cases) + "\n</testsuite>\n")
    raise GateInputError(f"report format {fmt!r}: expected junit, json or markdown")


def _window(start: float, end: float) -> str:
    """A PromQL range covering `start` to `end`, in whole seconds."""
    return f"{max(1, round(end - start))}s"


def _bound(le: str | None) -> float | None:
    """A bucket's `le` as a number; None where it is none (a series Prometheus relabelled, say): that bucket is left
    out rather than the gate stopped."""
    try:
        return float(le) if le is not None else None
    except ValueError:
        return None


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"
