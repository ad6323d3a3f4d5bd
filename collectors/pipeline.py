"""From scrape results to signals: parse, read entities, diff against the previous reading.

`SignalDeriver` keeps the previous reading of every entity in memory (a restart of the control
plane only costs one interval of rates). It performs no I/O and reads no clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from collectors import families, sources
from collectors.exposition import ExpositionError, Parser
from collectors.restarts import ProcessStarts, process_start
from collectors.types import Objectives, ScrapeResult, Signal, pod_subject, pool_subject, target_subject

__all__ = ["DeriveOutput", "SignalDeriver"]

# How long a target's process start is remembered while it does not answer: a crash-looping pod is out of
# discovery (not Ready) between its restarts, for its back-off (up to five minutes) and its model's load.
STARTED_KEPT_S = 3600.0


@dataclass(slots=True)
class DeriveOutput:
    """Signals of one round, plus what went wrong per target (key -> messages)."""

    signals: list[Signal] = field(default_factory=list)
    parse_errors: dict[str, list[str]] = field(default_factory=dict)  # the first 20 of each target's
    parse_error_counts: dict[str, int] = field(default_factory=dict)  # all of them
    missing_families: dict[str, list[str]] = field(default_factory=dict)


class SignalDeriver:
    """Turns rounds of scrape results into entity, pod and pool signals (with `objectives`, per pool, the share of its
    requests over them)."""

    def __init__(self, objectives: Mapping[str, Objectives] | None = None) -> None:
        self._objectives = dict(objectives or {})
        self._prev: dict[tuple[str, str], tuple[float, families.Reading]] = {}
        # One series cache for all targets: engines of a fleet expose the same series texts
        # (the pod is not a label of its own exposition), so the cache stays small and hot.
        self._parser = Parser(max_series=500_000)
        self._started = ProcessStarts(STARTED_KEPT_S)

    def new_term(self) -> None:
        """Forget the process starts read so far: after a gap in which another reader recorded the restarts, read
        against them here those restarts would be recorded twice."""
        self._started.forget()

    def derive(self, results: Sequence[ScrapeResult], ts: float) -> DeriveOutput:
        """Derive signals for one round; `ts` stamps the pool-level signals."""
        out = DeriveOutput()
        pool_deltas: dict[tuple[str, str], list[families.Delta]] = defaultdict(list)
        pool_pods: dict[tuple[str, str], set[str]] = defaultdict(set)  # targets (pods) behind each pool's deltas
        pool_up: dict[str, list[float]] = defaultdict(list)
        seen: set[tuple[str, str]] = set()
        held: dict[str, list[tuple[str, str]]] = defaultdict(list)  # per target, the entities read before
        for slot in self._prev:
            held[slot[0]].append(slot)
        for res in results:
            t = res.target
            if not res.late:  # a target the round had no time for is neither up nor down
                pool_up[t.pool].append(1.0 if res.ok else 0.0)
                out.signals.append(Signal(res.ts, target_subject(t), "up", 1.0 if res.ok else 0.0))
            health = target_subject(t)
            if not res.ok:
                # Keep the previous readings: the next good scrape spans the gap correctly.
                seen.update(held[t.key])
                continue
            source = sources.get(t.source)
            errors: list[ExpositionError] = []
            samples = list(self._parser.parse(res.body, errors=errors))
            if errors:
                out.parse_errors[t.key] = [str(e) for e in errors[:20]]
                out.parse_error_counts[t.key] = len(errors)
            out.signals.append(Signal(res.ts, health, "scrape_duration_seconds", res.duration_s))
            out.signals.append(Signal(res.ts, health, "scrape_samples", float(len(samples))))
            out.signals.append(Signal(res.ts, health, "scrape_body_bytes", float(res.size_bytes)))
            # vLLM's alone: a restart is read of the engines (the canary gate), and the scan costs a pass over the
            # samples of an exposition that lacks the line.
            if t.source == "vllm" and (started := process_start(samples)) is not None \
                    and self._started.restarted(t.key, started, res.ts):
                out.signals.append(Signal(res.ts, health, "restarts", 1.0))
            readings = source.read(samples)
            # The counters and histograms of lines dropped as malformed: exposed, but not read.
            index = source.families.index()
            hits = [hit for e in errors if (hit := index.get(e.metric)) is not None]
            dropped = {hit[:2] for hit in hits}
            unbucketed = {key for _, key, _, suffix in hits if suffix == "_bucket"}
            missing = families.missing_families(readings, source.families) + families.unnumbered_families(
                readings, source.families)
            if missing:
                out.missing_families[t.key] = missing
            pod_deltas: list[families.Delta] = []
            for entity, reading in readings.items():
                for kind, key in dropped:
                    reading.not_read(kind, key)
                # Without a bucket, no reading (as without +Inf): kept, it would be the next diff's baseline, which
                # spans only the bounds both share, and the next, clean tick read its quantiles off a bucket as wide as
                # the one dropped. Left out, the reading before is carried to that diff.
                for k in [k for k in reading.histograms if k.partition(":")[0] in unbucketed]:
                    del reading.histograms[k]
                    reading.histogram_series.pop(k, None)
                slot = (t.key, entity)
                seen.add(slot)
                prev = self._prev.get(slot)
                self._prev[slot] = (res.ts, reading)
                # A reading older than a series lives (a target down that long) is a baseline no more: an engine that
                # restarted meanwhile would have its counts since spread over the whole outage.
                if prev is None or res.ts - prev[0] > families.STALE_S:
                    continue
                d = families.advance(prev[1], reading, res.ts - prev[0])
                if d is None:
                    continue
                out.signals.extend(source.signals(d, res.ts, source.subject(t, entity, reading)))
                if source.aggregate:
                    pod_deltas.append(d)
                    pool_deltas[(t.pool, t.source)].append(d)
                    pool_pods[(t.pool, t.source)].add(t.key)
            # An entity the target reported within a series' life and lacks now (a data-parallel rank missing from its
            # pod's exposition, a GPU gone from DCGM's) is kept as the baseline it comes back to, and the sums it is
            # missing from said to be partial: dropped, the pool's rate read half, nothing said so, and its return
            # had no rate either.
            absent = sorted(k for k in held[t.key] if k not in seen and res.ts - self._prev[k][0] <= families.STALE_S)
            if absent:
                seen.update(absent)
                out.missing_families.setdefault(t.key, []).append(
                    f"the series of {', '.join(e for _, e in absent)}, which it reported before")
            if len(pod_deltas) > 1:
                pod = pod_subject(t.pool, t.pod)
                out.signals.extend(source.signals(families.merge_all(pod_deltas), res.ts, pod))
        for slot in list(self._prev):
            if slot not in seen:
                del self._prev[slot]  # target gone from the fleet
        self._started.forget(ts)
        for pool, ups in pool_up.items():
            subject = pool_subject(pool)
            out.signals.append(Signal(ts, subject, "targets_up", sum(ups)))
            out.signals.append(Signal(ts, subject, "targets", float(len(ups))))
        for (pool, source_name), deltas in pool_deltas.items():
            subject = pool_subject(pool)
            # Engines (one per data-parallel rank) and the pods they run in: the workload counts pods.
            out.signals.append(Signal(ts, subject, "engines_reporting", float(len(deltas))))
            out.signals.append(Signal(ts, subject, "pods_reporting", float(len(pool_pods[(pool, source_name)]))))
            source, merged = sources.get(source_name), families.merge_rates(_common_histograms(deltas))
            out.signals.extend(source.signals(merged, ts, subject))
            if (objectives := self._objectives.get(pool)) is not None and source.objective_signals is not None:
                out.signals.extend(source.objective_signals(merged, ts, subject, objectives))
        return out


def _common_histograms(deltas: list[families.Delta]) -> list[families.Delta]:
    """The deltas with only the histograms all of them have: one that some engines lack (an older vLLM's mid-upgrade:
    no per-request TPOT) merged from the others would be the pool's from part of it, its p95 read off the upgraded
    engines alone; left out, the pool reads what every engine has (TPOT from the inter-token latency)."""
    common = set.intersection(*(set(d.histograms) for d in deltas))
    if all(len(d.histograms) == len(common) for d in deltas):
        return deltas
    return [families.Delta(d.seconds, d.increases, {k: h for k, h in d.histograms.items() if k in common}, d.gauges)
            for d in deltas]
