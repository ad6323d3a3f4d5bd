"""Prometheus text exposition (format 0.0.4) parser.

`parse(text)` yields `Sample`s in input order. In strict mode a malformed line raises
`ExpositionError` naming its line number; in lenient mode (`errors=[...]`) the error is
recorded there and the rest of the scrape survives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from collectors.types import Sample

__all__ = ["ExpositionError", "parse"]

_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class ExpositionError(ValueError):
    """A line of an exposition that is not valid text format."""

    def __init__(self, line_no: int, problem: str, line: str) -> None:
        shown = line if len(line) <= 120 else line[:117] + "..."
        super().__init__(f"line {line_no}: {problem}: {shown!r}")
        self.line_no = line_no
        self.problem = problem


def _parse_float(token: str) -> float:
    # float() accepts 'nan', 'inf', '+Inf', 'Infinity' case-insensitively, and also '1_0';
    # the underscore form is not valid exposition, so reject it explicitly.
    if "_" in token:
        raise ValueError(token)
    return float(token)


def _parse_labels(text: str, start: int, line_no: int, line: str) -> tuple[dict[str, str], int]:
    """Parse `{a="b",...}` starting after '{'; return labels and the index after '}'."""
    labels: dict[str, str] = {}
    i = start
    n = len(text)
    while True:
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == "}":
            return labels, i + 1
        eq = text.find("=", i)
        if eq < 0:
            raise ExpositionError(line_no, "label without '='", line)
        name = text[i:eq].strip()
        if not name or not (name[0].isalpha() or name[0] == "_") or not name.replace("_", "a").isalnum():
            raise ExpositionError(line_no, f"invalid label name {name!r}", line)
        i = eq + 1
        while i < n and text[i] in " \t":
            i += 1
        if i >= n or text[i] != '"':
            raise ExpositionError(line_no, f"label {name!r} value is not quoted", line)
        i += 1
        # Fast path: no escapes before the closing quote.
        close = text.find('"', i)
        bslash = text.find("\\", i)
        if close < 0:
            raise ExpositionError(line_no, f"label {name!r} value is not terminated", line)
        if bslash < 0 or bslash > close:
            value = text[i:close]
            i = close + 1
        else:
            chars: list[str] = []
            while True:
                if i >= n:
                    raise ExpositionError(line_no, f"label {name!r} value is not terminated", line)
                c = text[i]
                if c == "\\":
                    if i + 1 >= n:
                        raise ExpositionError(line_no, "dangling escape in label value", line)
                    nxt = text[i + 1]
                    # Unknown escapes are kept literally, as Prometheus does.
                    chars.append(_ESCAPES.get(nxt, "\\" + nxt))
                    i += 2
                elif c == '"':
                    i += 1
                    break
                else:
                    chars.append(c)
                    i += 1
            value = "".join(chars)
        if name in labels:
            raise ExpositionError(line_no, f"duplicate label {name!r}", line)
        labels[name] = value
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == ",":
            i += 1
            continue
        if i < n and text[i] == "}":
            return labels, i + 1
        raise ExpositionError(line_no, "expected ',' or '}' after a label", line)


def _parse_line(line: str, line_no: int) -> Sample:
    brace = line.find("{")
    if brace < 0:
        parts = line.split()
        name = parts[0]
        labels: dict[str, str] = {}
        rest = parts[1:]
    else:
        name = line[:brace].strip()
        labels, end = _parse_labels(line, brace + 1, line_no, line)
        rest = line[end:].split()
    if not name or not (name[0].isalpha() or name[0] in "_:"):
        raise ExpositionError(line_no, f"invalid metric name {name!r}", line)
    if not rest:
        raise ExpositionError(line_no, "sample has no value", line)
    if len(rest) > 2:
        raise ExpositionError(line_no, "trailing text after value and timestamp", line)
    try:
        value = _parse_float(rest[0])
    except ValueError:
        raise ExpositionError(line_no, f"value {rest[0]!r} is not a number", line) from None
    timestamp = None
    if len(rest) == 2:
        try:
            timestamp = int(rest[1]) / 1000.0
        except ValueError:
            raise ExpositionError(line_no, f"timestamp {rest[1]!r} is not an integer (ms)", line) from None
    return Sample(name, labels, value, timestamp)


def parse(text: str, *, errors: list[ExpositionError] | None = None) -> Iterator[Sample]:
    """Yield the samples of a text exposition.

    With `errors` given, malformed lines are appended to it and skipped; otherwise the first
    malformed line raises `ExpositionError`.
    """
    for line_no, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        try:
            yield _parse_line(line, line_no)
        except ExpositionError as exc:
            if errors is None:
                raise
            errors.append(exc)


def is_finite(value: float) -> bool:
    """True for values a signal may carry (no NaN or infinities)."""
    return not (math.isnan(value) or math.isinf(value))
