"""Prometheus text exposition (format 0.0.4) and OpenMetrics text parser.

`parse(text)` yields `Sample`s in input order. In strict mode a malformed line raises
`ExpositionError` naming its line number; in lenient mode (`errors=[...]`) the error is
recorded there and the rest of the scrape survives.

`Parser` adds a series cache, as Prometheus' own scrape loop keeps one: a target exposes the
same series every scrape, so the text before the value (`name{labels}`) is parsed once and
looked up afterwards. Samples from the cache share their `labels` dict: treat it as read-only.

Samples are those `prometheus_client`'s parsers yield, with one deliberate difference: a
counter sample exposed without `_total` keeps its exposed name here (prometheus_client renames
it to `<name>_total`; Prometheus itself stores it as exposed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

from collectors.types import Sample

__all__ = ["ExpositionError", "Parser", "parse"]

_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_NAME_START = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_:")
_NAME_CHARS = _NAME_START | set("0123456789")
_LABEL_START = _NAME_START - {":"}
_LABEL_CHARS = _LABEL_START | set("0123456789")


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class ExpositionError(ValueError):
    """A line of an exposition that is not valid text format."""

    def __init__(self, line_no: int, problem: str, line: str) -> None:
        shown = line if len(line) <= 120 else line[:117] + "..."
        super().__init__(f"line {line_no}: {problem}: {shown!r}")
        self.line_no = line_no
        self.problem = problem
        # The sample name the line begins with ("" for none): what the dropped line would have been a value of.
        self.metric = m.group(0) if (m := _NAME.match(line.lstrip())) else ""


def _parse_float(token: str) -> float:
    # float() also accepts '1_0' and 'infinity'; neither is valid exposition.
    if "_" in token or "y" in token or "Y" in token:
        raise ValueError(token)
    return float(token)


def _valid_name(name: str) -> bool:
    return bool(name) and name[0] in _NAME_START and all(c in _NAME_CHARS for c in name)


def _parse_labels(text: str, start: int, line_no: int, line: str) -> tuple[dict[str, str], int]:
    """Parse `a="b",...}` starting after '{'; return labels and the index after '}'."""
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
        if not name or name[0] not in _LABEL_START or any(c not in _LABEL_CHARS for c in name):
            raise ExpositionError(line_no, f"invalid label name {name!r}", line)
        i = eq + 1
        while i < n and text[i] in " \t":
            i += 1
        if i >= n or text[i] != '"':
            raise ExpositionError(line_no, f"label {name!r} value is not quoted", line)
        i += 1
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


# The common shape, matched in C: a name and labels without escapes or odd spacing.
_FAST_SERIES = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"(?:,|(?=\})))*)\}')
_FAST_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"')


def _parse_series(line: str, line_no: int) -> tuple[str, dict[str, str], int]:
    """The metric name and labels at the start of a sample line, and where they end."""
    m = _FAST_SERIES.match(line)
    if m is not None:
        body = m.group(2)
        labels = dict(_FAST_LABEL.findall(body))
        if len(labels) == body.count('="') and not body.endswith(",,"):
            return m.group(1), labels, m.end()
    brace = line.find("{")
    head = line[:brace] if brace >= 0 else ""
    if brace < 0 or " " in head.strip() or "\t" in head.strip():
        parts = line.split(None, 1)
        name, labels, end = parts[0], {}, len(parts[0])
    else:
        name = head.rstrip()
        labels, end = _parse_labels(line, brace + 1, line_no, line)
    if not _valid_name(name):
        raise ExpositionError(line_no, f"invalid metric name {name!r}", line)
    return name, labels, end


class Parser:
    """An exposition parser that remembers the series it has seen (bounded by `max_series`)."""

    def __init__(self, max_series: int = 200_000) -> None:
        # series text -> (name, labels, identity): the identity is the same for the same labels in any order
        self._series: dict[str, tuple[str, dict[str, str], tuple[str, frozenset[tuple[str, str]]]]] = {}
        self._max = max_series

    def parse(self, text: str, *, errors: list[ExpositionError] | None = None,
              openmetrics: bool | None = None) -> Iterator[Sample]:
        """Yield the samples of `text`; OpenMetrics is detected from its `# EOF` unless given."""
        if openmetrics is None:
            tail = text.rstrip()
            openmetrics = tail.endswith("# EOF")
        cache = self._series
        if len(cache) > self._max:
            cache.clear()  # a target whose series churn without end must not grow us forever
        ended = False
        seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
        for line_no, raw in enumerate(text.split("\n"), start=1):
            line = raw.strip() if openmetrics is False else raw
            if not line:
                continue
            if line.isspace():  # OpenMetrics allows no blank lines; the text format's are stripped above
                _record(errors, ExpositionError(line_no, "a line of only whitespace", line))
                continue
            if ended:
                if _record(errors, ExpositionError(line_no, "content after '# EOF'", line)):
                    continue
                return
            if line[0] == "#":
                if openmetrics and line == "# EOF":
                    ended = True
                continue
            try:
                # The series text ends at the first '} ' (or the first blank without labels); a
                # '} ' inside a quoted label value only causes a cache miss, never a wrong hit,
                # because the cache holds complete, valid series texts only.
                close = line.find("} ")
                if close < 0:
                    close = line.find("}\t")
                key = line[: close + 1] if close >= 0 else line.split(None, 1)[0]
                hit = cache.get(key)
                if hit is not None:
                    name, labels, ident = hit
                    rest = line[len(key):]
                else:
                    name, labels, end = _parse_series(line, line_no)
                    if name.endswith("_bucket") and "le" in labels:
                        _bound(labels["le"], line_no, line)
                    ident = (name, frozenset(labels.items()))
                    cache[line[:end]] = (name, labels, ident)
                    rest = line[end:]
                if ident in seen:
                    # Prometheus refuses the scrape; summed, the series would count twice, and look reset when the
                    # copy goes. Told by name and labels, so the same labels in another order are caught too.
                    raise ExpositionError(line_no, "a series already given in this exposition: the first value is "
                                                   "kept", line)
                parts = rest.split()
                if len(parts) == 1 and not openmetrics:
                    # The hot path: a plain value. '_' and 'y' would pass float() but are invalid.
                    token = parts[0]
                    try:
                        if "_" in token or "y" in token:
                            raise ValueError(token)
                        value = float(token)
                    except ValueError:
                        raise ExpositionError(line_no, f"value {token!r} is not a number", line) from None
                    seen.add(ident)
                    yield Sample(name, labels, value, None)
                    continue
                sample = _sample(name, labels, rest, openmetrics, line_no, line)
                seen.add(ident)
                yield sample
            except ExpositionError as exc:
                if not _record(errors, exc):
                    raise


def _bound(le: str, line_no: int, line: str) -> None:
    """A histogram bucket's `le` must be a number (or `+Inf`): every quantile and share is read off the bounds."""
    try:
        bound = float(le)
    except ValueError:
        raise ExpositionError(line_no, f"bucket bound le={le!r} is not a number", line) from None
    if math.isnan(bound):
        raise ExpositionError(line_no, f"bucket bound le={le!r} is not a number", line)


def _record(errors: list[ExpositionError] | None, exc: ExpositionError) -> bool:
    if errors is None:
        raise exc
    errors.append(exc)
    return True


def _sample(name: str, labels: dict[str, str], rest: str, openmetrics: bool, line_no: int, line: str) -> Sample:
    if openmetrics:
        hash_at = rest.find(" # ")
        if hash_at >= 0:
            rest = rest[:hash_at]  # exemplar: kept out of the sample, as prometheus_client does
    parts = rest.split()
    if not parts:
        raise ExpositionError(line_no, "sample has no value", line)
    if len(parts) > 2:
        raise ExpositionError(line_no, "trailing text after value and timestamp", line)
    try:
        value = _parse_float(parts[0])
    except ValueError:
        raise ExpositionError(line_no, f"value {parts[0]!r} is not a number", line) from None
    if len(parts) == 1:
        return Sample(name, labels, value, None)
    try:
        # Text format timestamps are integer milliseconds; OpenMetrics uses seconds.
        ts = float(parts[1]) if openmetrics else int(parts[1]) / 1000.0
    except ValueError:
        unit = "seconds" if openmetrics else "an integer (ms)"
        raise ExpositionError(line_no, f"timestamp {parts[1]!r} is not {unit}", line) from None
    return Sample(name, labels, value, ts)


def parse(text: str, *, errors: list[ExpositionError] | None = None, openmetrics: bool | None = None) -> Iterator[Sample]:
    """Yield the samples of an exposition (no series cache; see `Parser` for repeated scrapes)."""
    return Parser().parse(text, errors=errors, openmetrics=openmetrics)
