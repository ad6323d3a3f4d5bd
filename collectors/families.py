"""Generic machinery every source module shares: map metric families to per-entity readings,
diff two readings, aggregate deltas.

A source declares a `FamilyMap` (reading key -> exposed family names, preferred spelling first)
and how an entity is named from a sample's labels; `read` does the rest. Pure, no I/O.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from catalog.signals import STALE_S
from collectors.derive import EMPTY_HISTOGRAM, Histogram, counter_increase, histogram_increase
from collectors.types import Objectives, Sample, Signal

__all__ = ["STALE_S", "Delta", "FamilyMap", "FamilySource", "Reading", "SignalList", "advance", "delta", "merge_all",
           "merge_rates", "missing_families", "read", "unnumbered_families"]


EntityOf = Callable[[Mapping[str, str]], str | None]

if TYPE_CHECKING:
    from collectors.types import Target


@dataclass(frozen=True, slots=True)
class FamilyMap:
    """What a source reads. Keys are the source's own names; values list the exposed family
    names (counters with their `_total`), the current spelling first, older ones after.

    `split_by` names extra labels whose values become part of the key (`key:value`), e.g. a
    per-position counter or a waiting-by-reason gauge; otherwise extra labels are summed.
    """

    counters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gauges: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    histograms: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    split_by: Mapping[str, str] = field(default_factory=dict)  # reading key -> label
    expected: tuple[str, ...] = ()  # families whose absence would blind a policy
    _index: Mapping[str, tuple[str, str, int, str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", self._build_index())  # read for every sample of every scrape

    def index(self) -> Mapping[str, tuple[str, str, int, str]]:
        """exposed sample name -> (kind, key, spelling rank, histogram suffix or '')."""
        return self._index

    def _build_index(self) -> dict[str, tuple[str, str, int, str]]:
        idx: dict[str, tuple[str, str, int, str]] = {}
        for kind, table in (("counter", self.counters), ("gauge", self.gauges)):
            for key, fams in table.items():
                for rank, fam in enumerate(fams):
                    idx[fam] = (kind, key, rank, "")
        for key, fams in self.histograms.items():
            for rank, fam in enumerate(fams):
                for suffix in ("_bucket", "_sum", "_count"):
                    idx[fam + suffix] = ("histogram", key, rank, suffix)
        return idx


@dataclass(slots=True)
class Reading:
    """One entity's cumulative counters, gauges and histograms at one scrape, plus the
    attribution labels the source chose to keep (pod, namespace, hostname, ...)."""

    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    families: set[str] = field(default_factory=set)
    attrs: dict[str, str] = field(default_factory=dict)
    # Each counter's and histogram's series by their labels (a histogram's without `le`): a series that vanishes from
    # a sum, or restarts, is no reset of the whole sum.
    counter_series: dict[str, dict[frozenset[tuple[str, str]], float]] = field(default_factory=dict)
    histogram_series: dict[str, dict[frozenset[tuple[str, str]], Histogram]] = field(default_factory=dict)
    # Series this reading lacked, carried from earlier ones for the next diff (`advance`): how much older their values
    # are than this reading, by (table, key, labels).
    carried: dict[tuple[str, str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    not_numbers: set[str] = field(default_factory=set)  # families with a value that was NaN or infinite: no reading
    # Histogram families whose buckets lack `+Inf` (its line dropped, or never written): no reading, since what fell
    # above the highest bound would vanish from a merge and every quantile read low.
    unbounded: set[str] = field(default_factory=set)
    # Counter and histogram keys this entity's earlier readings had (`advance` keeps it): a key outside it is new, its
    # series created since (lazily, at their first event: a first XID, a first error code) and counted from zero.
    known: set[str] = field(default_factory=set)
    # Counter and histogram keys this reading exposed but could not read (a value that is no number, a DCGM sentinel,
    # a line dropped as malformed, buckets without +Inf): missing from it, such a key is not new next time, where its
    # whole history would be counted at once. One never exposed (created since, at its first event) still is.
    unread: set[str] = field(default_factory=set)

    def not_read(self, kind: str, key: str) -> None:
        """Record a key exposed but not read (`unread`); a gauge's value has no history to miscount, so it is not."""
        if kind != "gauge":
            self.unread.add(key)


@dataclass(slots=True)
class Delta:
    """What happened on an entity (or an aggregate of entities) between two scrapes."""

    seconds: float
    increases: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    gauges: dict[str, list[float]] = field(default_factory=dict)

    def merge(self, other: Delta) -> Delta:
        """Aggregate: sum increases and buckets (as `sum by (le)`), collect gauge values."""
        out = Delta(max(self.seconds, other.seconds))
        for key in self.increases.keys() | other.increases.keys():
            out.increases[key] = self.increases.get(key, 0.0) + other.increases.get(key, 0.0)
        for key in self.histograms.keys() | other.histograms.keys():
            a, b = self.histograms.get(key), other.histograms.get(key)
            out.histograms[key] = a + b if a is not None and b is not None else (a or b)  # type: ignore[assignment]
        for key in self.gauges.keys() | other.gauges.keys():
            out.gauges[key] = self.gauges.get(key, []) + other.gauges.get(key, [])
        return out

    def over(self, seconds: float) -> Delta:
        """The same rates over `seconds`: increases and buckets scaled by `seconds / self.seconds`."""
        k = seconds / self.seconds
        if k == 1.0:
            return self
        return Delta(seconds, {key: v * k for key, v in self.increases.items()},
                     {key: h.scaled(k) for key, h in self.histograms.items()}, self.gauges)


def merge_all(deltas: list[Delta]) -> Delta:
    """Aggregate a non-empty list of deltas: what they observed together (counts, not rates)."""
    total = deltas[0]
    for d in deltas[1:]:
        total = total.merge(d)
    return total


def merge_rates(deltas: list[Delta]) -> Delta:
    """Aggregate a non-empty list of deltas whose intervals may differ (an engine whose scrapes failed for a while):
    each brought to the shortest interval at its own rate, so the aggregate's rates are the sum of theirs, as
    `sum(rate(...))` is, and no engine's observations count more than they were."""
    shortest = min(d.seconds for d in deltas)
    return merge_all([d.over(shortest) for d in deltas])


class _HistogramBuilder:
    __slots__ = ("buckets", "count", "family", "sum")

    def __init__(self, family: str) -> None:
        self.family = family
        self.buckets: dict[float, float] = {}
        self.sum: float | None = None
        self.count: float | None = None

    def build(self) -> Histogram | None:
        # Without its `_count` line (dropped as malformed) a histogram still counts what its `+Inf` bucket holds;
        # without that too, it is no reading (read as 0, it would look reset, and its next reading all new). Without
        # its `_sum` it is no reading either: read as 0, the sum's increase would be minus its whole history, then
        # all of it at once (a mean of -50 s, then of 51 s).
        count = self.count if self.count is not None else self.buckets.get(math.inf)
        if count is None or self.sum is None or math.inf not in self.buckets:
            return None
        return Histogram(tuple(sorted(self.buckets.items())), self.sum, count)


def _le(value: str) -> float:
    return math.inf if value in ("+Inf", "Inf", "inf") else float(value)


def read(
    samples: Iterable[Sample],
    fmap: FamilyMap,
    entity_of: EntityOf,
    attrs_of: Callable[[Mapping[str, str]], dict[str, str]] | None = None,
) -> dict[str, Reading]:
    """Group samples into per-entity readings; a current family spelling wins over an old one.

    `entity_of` returns None for samples that belong to no entity (they are ignored). A NaN or infinite value is no
    reading (its family still counts as exposed; the reading lists it in `not_numbers`): summed with the others it
    would hide every engine's.
    """
    idx = fmap.index()
    entities: dict[str, Reading] = {}
    # (entity, key, rank) -> partial values, so spellings never mix.
    counters: dict[tuple[str, str, int], float] = {}
    series: dict[tuple[str, str, int], dict[frozenset[tuple[str, str]], float]] = defaultdict(dict)
    gauges: dict[tuple[str, str, int], float] = {}
    hists: dict[tuple[str, str, int], dict[frozenset[tuple[str, str]], _HistogramBuilder]] = defaultdict(dict)
    split = fmap.split_by
    for s in samples:
        hit = idx.get(s.name)
        if hit is None:
            continue
        entity = entity_of(s.labels)
        if entity is None:
            continue
        kind, key, rank, suffix = hit
        if key in split:
            key = f"{key}:{s.labels.get(split[key], '')}"
        r = entities.get(entity)
        if r is None:
            r = entities[entity] = Reading(attrs=attrs_of(s.labels) if attrs_of else {})
        family = s.name[: -len(suffix)] if suffix else s.name
        r.families.add(family)
        if not math.isfinite(s.value):
            r.not_numbers.add(family)
            r.not_read(kind, key)
            continue
        if kind == "counter":
            counters[(entity, key, rank)] = counters.get((entity, key, rank), 0.0) + s.value
            part = series[(entity, key, rank)]
            labels = frozenset(s.labels.items())
            part[labels] = part.get(labels, 0.0) + s.value
        elif kind == "gauge":
            gauges[(entity, key, rank)] = gauges.get((entity, key, rank), 0.0) + s.value
        else:
            one = frozenset((k, v) for k, v in s.labels.items() if k != "le")
            b = hists[(entity, key, rank)].get(one)
            if b is None:
                b = hists[(entity, key, rank)][one] = _HistogramBuilder(family)
            if suffix == "_bucket":
                le = s.labels.get("le")
                if le is None:
                    continue
                bound = _le(le)
                b.buckets[bound] = b.buckets.get(bound, 0.0) + s.value
            elif suffix == "_sum":
                b.sum = (b.sum or 0.0) + s.value
            else:
                b.count = (b.count or 0.0) + s.value

    for parts, attr in ((counters, "counters"), (gauges, "gauges")):
        best = _preferred(parts)
        for (entity, key, rank), value in parts.items():
            if best[(entity, key)] == rank:
                getattr(entities[entity], attr)[key] = value
                if attr == "counters":
                    entities[entity].counter_series[key] = series[(entity, key, rank)]
    best = _preferred(hists)
    for (entity, key, rank), builders in hists.items():
        if best[(entity, key)] != rank:
            continue
        built = {labels: h for labels, b in builders.items() if b.buckets and (h := b.build()) is not None}
        if unbounded := {b.family for b in builders.values() if b.buckets and math.inf not in b.buckets}:
            entities[entity].unbounded |= unbounded
            entities[entity].not_read("histogram", key)
        if built:
            whole = next(iter(built.values())) if len(built) == 1 else sum(built.values(), EMPTY_HISTOGRAM)
            entities[entity].histograms[key] = whole
            entities[entity].histogram_series[key] = built
    return entities


def _preferred(parts: Mapping[tuple[str, str, int], object]) -> dict[tuple[str, str], int]:
    best: dict[tuple[str, str], int] = {}
    for entity, key, rank in parts:
        if rank < best.get((entity, key), rank + 1):
            best[(entity, key)] = rank
    return best


def missing_families(readings: Mapping[str, Reading], fmap: FamilyMap) -> list[str]:
    """Expected families that no entity of a target exposed (older spellings count)."""
    present: set[str] = set()
    for r in readings.values():
        present |= r.families
    return [fam for fam in fmap.expected if not present.intersection(_spellings(fmap, fam))]


def _spellings(fmap: FamilyMap, fam: str) -> tuple[str, ...]:
    """Every spelling of an expected family (itself where the map lists it under none)."""
    return next((g for g in (*fmap.counters.values(), *fmap.gauges.values(), *fmap.histograms.values()) if fam in g),
                (fam,))


def unnumbered_families(readings: Mapping[str, Reading], fmap: FamilyMap) -> list[str]:
    """Expected families (any spelling) of which some entity of a target exposed a value that is no number, or a
    histogram without its `+Inf` bucket, each with why and the entities: that reading is missing from the sums as much
    as an absent family's."""
    if not any(r.not_numbers or r.unbounded for r in readings.values()):
        return []  # every scrape of every target comes here: nothing to look up where all values are numbers
    expected = {name for fam in fmap.expected for name in _spellings(fmap, fam)}
    bad: dict[tuple[str, str], list[str]] = {}
    for entity, r in sorted(readings.items()):
        for why, families in (("a value that is no number", r.not_numbers), ("no +Inf bucket", r.unbounded)):
            for fam in sorted(families & expected):
                bad.setdefault((fam, why), []).append(entity)
    return [f"{fam} ({why}: {', '.join(entities)})" for (fam, why), entities in bad.items()]


def advance(prev: Reading, cur: Reading, seconds: float) -> Delta | None:
    """The change from `prev` to `cur`, read `seconds` apart; then `cur` keeps what `prev` had and it lacks, for its
    next diff (`_carry`). In that order: a value carried into `cur` first would read as no change."""
    d = delta(prev, cur, seconds)
    # A clock stepped back reads a negative interval: no delta, and what is carried does not grow younger.
    _carry(prev, cur, max(seconds, 0.0))
    cur.known |= prev.known | prev.counters.keys() | prev.histograms.keys()
    return d


def _carry(prev: Reading, cur: Reading, seconds: float, horizon: float = STALE_S) -> None:
    """Keep in `cur`, for its next diff, the last value of each counter and histogram series that `prev` (read
    `seconds` earlier) had and `cur` lacks, for up to `horizon` seconds after it was last read: a series missing from
    one scrape (its line dropped as malformed) is then diffed against that value when it comes back, not counted from
    zero, which in a sum of several series would add its whole history at once."""
    for table in ("counter_series", "histogram_series"):
        mine = getattr(cur, table)
        for key, series in getattr(prev, table).items():
            here = mine.get(key)
            for labels, value in series.items():
                if here is not None and labels in here:
                    continue
                age = prev.carried.get((table, key, labels), 0.0) + seconds
                if age <= horizon:
                    # Only what is carried makes a key: an empty one would read a family back after the horizon as
                    # all new series, counted from zero.
                    here = mine.setdefault(key, {})
                    here[labels] = value
                    cur.carried[(table, key, labels)] = age


def delta(prev: Reading | None, cur: Reading, seconds: float) -> Delta | None:
    """The change between two readings of one entity; None without a previous one."""
    if prev is None or seconds <= 0:
        return None
    out = Delta(seconds)

    def share(table: str, key: str, labels: frozenset[tuple[str, str]]) -> float:
        # A series carried over a gap rose over the gap and this interval: this interval's part of it.
        return seconds / (seconds + prev.carried.get((table, key, labels), 0.0))

    def unread(key: str) -> bool:
        # A malformed line names its family, not the label a key is split by (`finished:length`): the family's base
        # key marks every split key of it.
        return key in prev.unread or key.partition(":")[0] in prev.unread

    def new(key: str, table: Mapping[str, object]) -> bool:
        # Neither in the last reading (carried series included) nor in any before it. One that was, and has been
        # missing past the carry's horizon, is not new: counted from zero it would add its whole history at once. Nor
        # is one the last reading may have lacked only for being unreadable: its first diff is the next one.
        return key not in table and key not in prev.known and not unread(key)

    for key, value in cur.counters.items():
        before, now = prev.counter_series.get(key), cur.counter_series.get(key)
        if before is None and new(key, prev.counters):
            out.increases[key] = value
            continue
        if before is not None and now is not None:
            # Series by series, as PromQL's sum(increase()): one that vanished (an agent instance reaped, a label
            # gone) adds nothing, one that appeared counts from zero (unless a line of the key went unread: then it
            # may have been there), one that fell restarted.
            out.increases[key] = sum((0.0 if unread(key) else v) if (b := before.get(s)) is None else
                                     (v if v < b else v - b) * share("counter_series", key, s) for s, v in now.items())
            continue
        inc = counter_increase(prev.counters.get(key), value)
        if inc is not None:
            out.increases[key] = inc
    for key, hist in cur.histograms.items():
        series_before, series_now = prev.histogram_series.get(key), cur.histogram_series.get(key)
        if series_before is None and new(key, prev.histograms):
            out.histograms[key] = hist
            continue
        if series_before is not None and series_now is not None:
            # Series by series, as for counters: one engine's restart (or a rank reaped) is not the whole sum's.
            out.histograms[key] = sum(((EMPTY_HISTOGRAM if unread(key) else h)
                                       if (was := series_before.get(s)) is None else
                                       (histogram_increase(was, h) or h).scaled(share("histogram_series", key, s))
                                       for s, h in series_now.items()), EMPTY_HISTOGRAM)
            continue
        inc_h = histogram_increase(prev.histograms.get(key), hist)
        if inc_h is not None:
            out.histograms[key] = inc_h
    for key, value in cur.gauges.items():
        out.gauges[key] = [value]
    return out


@dataclass(frozen=True, slots=True)
class FamilySource:
    """A source module assembled from its parts: how it reads entities, names them, and derives signals.

    `aggregate` is True when a pool's signals are the merge of its entities' deltas (engines).
    """

    name: str
    families: FamilyMap
    aggregate: bool
    read: Callable[[Iterable[Sample]], dict[str, Reading]]
    signals: Callable[[Delta, float, str], list[Signal]]
    subject_of: Callable[[Target, str], str]
    # A pool's share of requests over its latency objectives, from its merged delta (sources whose histograms hold
    # requests' latencies).
    objective_signals: Callable[[Delta, float, str, Objectives], list[Signal]] | None = None

    def subject(self, target: Target, entity: str, reading: Reading) -> str:
        """The signal subject of one entity of one target."""
        return self.subject_of(target, entity)


class SignalList(list[Signal]):
    """The signals of one subject at one time, built by a source's `signals()`; skips missing values."""

    def __init__(self, ts: float, subject: str) -> None:
        super().__init__()
        self.ts = ts
        self.subject = subject

    def emit(self, name: str, value: float | None) -> None:
        """Add a signal unless the value is missing, NaN or infinite."""
        if value is not None and math.isfinite(value):
            self.append(Signal(self.ts, self.subject, name, value))

    def rates(self, pairs: Iterable[tuple[str, str]], d: Delta) -> None:
        """Per-second rates of counter increases: (increase key, signal name) pairs present in `d`."""
        per_s = 1.0 / d.seconds
        for key, name in pairs:
            if key in d.increases:
                self.emit(name, d.increases[key] * per_s)
