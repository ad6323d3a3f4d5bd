"""Public workload traces as one stream of `Request` records.

Owns reading traces: the ones the project ships (`controlplane/data`, see its NOTICE) by name,
and a user's own by path, in the same three formats: the Azure LLM inference traces 2023 (CSV:
`TIMESTAMP,ContextTokens,GeneratedTokens`), the Mooncake FAST'25 traces (JSONL with 512-token
prefix-block hashes) and ServeGen's per-client rate series (a folder of `chunk-<client>-trace.csv`,
turned into arrivals), each file plain or gzip'd. Every loader takes a window of trace time
(`start_s`, `duration_s`) and a `speedup`; a request's `arrival_s` is `(trace time - start_s) /
speedup`. File loaders are generators that read line by line; a missing, truncated or malformed
file raises `DataError` (`TraceError` for a bad row) naming the file and line. Everything is
deterministic.
"""

from __future__ import annotations

import csv
import json
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from controlplane.data import DATA_DIR, read_lines, read_text, shipped
from controlplane.errors import DataError

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "SERVEGEN_WINDOW_S",
    "TRACES",
    "TRACE_FORMATS",
    "RateWindow",
    "Request",
    "ServeGenModel",
    "TraceError",
    "TraceFormat",
    "load_azure",
    "load_mooncake",
    "load_servegen",
    "load_trace",
    "read_trace",
    "servegen_requests",
    "shipped_trace",
    "trace_format",
    "trace_path",
    "trace_span",
]

MOONCAKE_BLOCK_TOKENS = 512
SERVEGEN_WINDOW_S = 600.0
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SERVEGEN_DISTS = ("Gamma", "Weibull", "")
SERVEGEN_DIR = "traces/servegen"

TraceFormat = Literal["azure", "mooncake", "servegen"]
TRACE_FORMATS: tuple[str, ...] = get_args(TraceFormat)

# Names accepted by `load_trace`, relative to the data folder; ServeGen models are `servegen/<kind>/<model>`.
TRACES: dict[str, str] = {
    "mooncake/conversation": "traces/mooncake/conversation_trace.jsonl.gz",
    "mooncake/synthetic": "traces/mooncake/synthetic_trace.jsonl.gz",
    "azure/code": "traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv.gz",
    "azure/conv": "traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv.gz",
}


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: when it arrives and how much work it brings."""

    arrival_s: float  # seconds from the window start, after the speed-up
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # prefix-block hashes in prompt order; empty where the trace has none
    block_tokens: int = 0  # tokens per hashed block (512 for Mooncake); 0 without hashes
    client: str = ""  # the API customer, where the trace names one (ServeGen)
    category: str = ""  # the trace's class of traffic: "code", "conv", "conversation", "language/m-large", ...
    index: int = 0  # 0-based data row in the source file, or generation order for ServeGen


class TraceError(DataError):
    """A malformed trace row; the message names the file and the line."""

    def __init__(self, path: Path | str, line: int, message: str) -> None:
        super().__init__(path, message, line)


def trace_path(name: str) -> Path:
    """The shipped file of a named trace (a key of `TRACES`), checked against the manifest."""
    if name not in TRACES:
        raise KeyError(f"unknown trace {name!r}; known: {', '.join(sorted(TRACES))}")
    return shipped(TRACES[name])


def shipped_servegen() -> list[str]:
    """The ServeGen models that ship, as `servegen/<kind>/<model>` names."""
    root = DATA_DIR / SERVEGEN_DIR
    return sorted(f"servegen/{p.parent.name}/{p.name}" for p in root.glob("*/*") if p.is_dir())


def shipped_trace(name: str) -> tuple[Path, TraceFormat]:
    """(path, format) of a shipped trace: a key of `TRACES` or `servegen/<kind>/<model>`."""
    if name.startswith("servegen/"):
        folder = DATA_DIR / SERVEGEN_DIR / name.removeprefix("servegen/")
        if not folder.is_dir() or name.count("/") != 2:
            raise KeyError(f"unknown trace {name!r}; shipped ServeGen models: {', '.join(shipped_servegen())}")
        return folder, "servegen"
    path = trace_path(name)
    return path, "mooncake" if name.startswith("mooncake/") else "azure"


def trace_format(path: Path) -> TraceFormat:
    """A user's trace format from its path: a folder is ServeGen, `.jsonl` Mooncake, `.csv` Azure (`.gz` or not)."""
    if path.is_dir():
        return "servegen"
    if not path.exists():
        raise DataError(path, "no such trace file or folder")
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        return "mooncake"
    if name.endswith(".csv"):
        return "azure"
    raise DataError(path, "cannot tell the trace's format from its name (.csv is Azure, .jsonl Mooncake, a folder "
                          "ServeGen, each may end in .gz); set the trace's format")


def load_trace(name: str, *, start_s: float = 0.0, duration_s: float | None = None,
               speedup: float = 1.0) -> Iterator[Request]:
    """Requests of a named shipped file trace (a key of `TRACES`) within a window."""
    path = trace_path(name)
    if name.startswith("mooncake/"):
        return load_mooncake(path, start_s=start_s, duration_s=duration_s, speedup=speedup)
    return load_azure(path, start_s=start_s, duration_s=duration_s, speedup=speedup)


def read_trace(path: Path, fmt: TraceFormat, *, start_s: float = 0.0, duration_s: float | None = None,
               speedup: float = 1.0, seed: int = 0, clients: Iterable[str] | None = None, sample: float = 1.0,
               default_lengths: tuple[int, int] = (0, 0)) -> Iterator[Request]:
    """Requests of a trace in any format within a window; ServeGen's arrivals are generated with `seed`."""
    if fmt == "servegen":
        model = load_servegen(path)
        return servegen_requests(model, start_s=start_s, duration_s=duration_s, speedup=speedup, seed=seed,
                                 clients=clients, default_lengths=default_lengths, sample=sample)
    if fmt == "mooncake":
        return load_mooncake(path, start_s=start_s, duration_s=duration_s, speedup=speedup)
    return load_azure(path, start_s=start_s, duration_s=duration_s, speedup=speedup)


def trace_span(path: Path, fmt: TraceFormat) -> float | None:
    """Seconds from a recorded trace's first arrival to its last; None for ServeGen's generated days."""
    if fmt == "servegen":
        return None
    last = 0.0
    for r in read_trace(path, fmt):
        last = r.arrival_s
    return last


@dataclass(frozen=True, slots=True)
class _Window:
    start: float
    end: float
    speedup: float

    def arrival(self, t: float) -> float:
        return (t - self.start) / self.speedup


def _window(start_s: float, duration_s: float | None, speedup: float) -> _Window:
    if not math.isfinite(start_s) or start_s < 0:
        raise ValueError(f"start_s must be a finite number >= 0, got {start_s}")
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be a finite number > 0 or None, got {duration_s}")
    if not (speedup > 0 and math.isfinite(speedup)):
        raise ValueError(f"speedup must be a finite number > 0, got {speedup}")
    return _Window(start_s, math.inf if duration_s is None else start_s + duration_s, speedup)


# Mooncake ----------------------------------------------------------------------------------------


def _int_field(row: Mapping[str, object], key: str, path: Path, line: int, minimum: int = 0) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, f"{key} must be >= {minimum}, got {value}")
    return value


_Row = tuple[float, int, int, tuple[int, ...], int]  # trace seconds, input, output, hash ids, data row


def _mooncake_rows(path: Path, block_tokens: int) -> Iterator[_Row]:
    """Every row of a Mooncake trace, its fields and time order checked."""
    last = -math.inf
    index = 0
    for line, text in enumerate(read_lines(path), start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(path, line, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise TraceError(path, line, f"expected a JSON object, got {type(row).__name__}")
        ts = row.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
            raise TraceError(path, line, f"timestamp must be a number of ms >= 0, got {ts!r}")
        inp = _int_field(row, "input_length", path, line, minimum=1)
        out = _int_field(row, "output_length", path, line)
        raw = row.get("hash_ids", [])
        if not isinstance(raw, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in raw):
            raise TraceError(path, line, f"hash_ids must be a list of integers, got {str(raw)[:60]}")
        if raw and len(raw) != -(-inp // block_tokens):
            raise TraceError(path, line, f"hash_ids has {len(raw)} blocks but input_length {inp} needs "
                                         f"{-(-inp // block_tokens)} of {block_tokens} tokens")
        t = ts / 1000.0
        if t < last:
            raise TraceError(path, line, f"timestamp {ts} goes back in time (previous row at {last * 1000:g})")
        last = t
        yield t, inp, out, tuple(raw), index
        index += 1


def load_mooncake(path: Path | str, *, start_s: float = 0.0, duration_s: float | None = None, speedup: float = 1.0,
                  spread_s: float = 0.0, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                  category: str | None = None) -> Iterator[Request]:
    """Requests of a Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    The conversation trace's timestamps are quantized (about 3 s apart, ~10 requests each);
    `spread_s` > 0 spreads the requests of one timestamp evenly over that many seconds, never past
    the next timestamp. The window applies to the spread times.
    """
    path = Path(path)
    win = _window(start_s, duration_s, speedup)
    if spread_s < 0:
        raise ValueError(f"spread_s must be >= 0, got {spread_s}")
    cat = category if category is not None else path.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix("_trace")
    rows = _mooncake_rows(path, block_tokens)
    if spread_s == 0:
        for t, inp, out, hashes, index in rows:
            if t >= win.end:
                return
            if t >= win.start:
                yield Request(win.arrival(t), inp, out, hashes, block_tokens if hashes else 0, "", cat, index)
        return
    group: list[_Row] = []
    for row in rows:
        if group and row[0] != group[0][0]:
            yield from _spread(group, min(spread_s, row[0] - group[0][0]), win, block_tokens, cat)
            if group[0][0] >= win.end:
                return
            group = []
        group.append(row)
    if group:
        yield from _spread(group, spread_s, win, block_tokens, cat)


def _spread(group: list[_Row], width: float, win: _Window, block_tokens: int, cat: str) -> Iterator[Request]:
    n = len(group)
    for k, (t0, inp, out, hashes, index) in enumerate(group):
        t = t0 + width * k / n
        if win.start <= t < win.end:
            yield Request(win.arrival(t), inp, out, hashes, block_tokens if hashes else 0, "", cat, index)


# Azure LLM inference trace 2023 ------------------------------------------------------------------


def _azure_seconds(text: str, path: Path, line: int) -> tuple[int, float]:
    """(day ordinal, seconds of day) of `YYYY-MM-DD HH:MM:SS.fffffff`, keeping its 100 ns resolution."""
    try:
        day, clock = text.strip().split(" ")
        hh, mm, ss = clock.split(":")
        seconds = int(hh) * 3600 + int(mm) * 60 + float(ss)
        ordinal = date.fromisoformat(day).toordinal()
    except ValueError:
        raise TraceError(path, line, f"TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS.fffffff'") from None
    if not (0 <= seconds < 86_401):
        raise TraceError(path, line, f"TIMESTAMP {text!r} has a time of day out of range")
    return ordinal, seconds


def _nonneg_int(text: str, column: str, path: Path, line: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, line, f"{column} must be an integer, got {text!r}") from None
    if value < 0:
        raise TraceError(path, line, f"{column} must be >= 0, got {value}")
    return value


def load_azure(path: Path | str, *, start_s: float = 0.0, duration_s: float | None = None, speedup: float = 1.0,
               category: str | None = None) -> Iterator[Request]:
    """Requests of an Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).

    Trace time 0 is the first row's timestamp. The category defaults to the file's suffix (`code`, `conv`).
    """
    path = Path(path)
    win = _window(start_s, duration_s, speedup)
    cat = category if category is not None else path.name.removesuffix(".gz").removesuffix(".csv").rsplit("_", 1)[-1]
    reader = csv.reader(read_lines(path))
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
        raise TraceError(path, 1, f"expected header {','.join(AZURE_HEADER)}, got {header!r}")
    origin: tuple[int, float] | None = None
    last = -math.inf
    index = 0
    for line, row in _csv_rows(reader, path, AZURE_HEADER):
        day, sod = _azure_seconds(row[0], path, line)
        ctx = _nonneg_int(row[1], "ContextTokens", path, line)
        gen = _nonneg_int(row[2], "GeneratedTokens", path, line)
        if origin is None:
            origin = (day, sod)
        t = (day - origin[0]) * 86_400 + (sod - origin[1])
        if t < last:
            raise TraceError(path, line, f"TIMESTAMP {row[0]} goes back in time")
        last = t
        if t >= win.end:
            return
        if t >= win.start:
            yield Request(win.arrival(t), ctx, gen, (), 0, "", cat, index)
        index += 1


# ServeGen --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RateWindow:
    """One client's 10-minute window: mean rate and the fitted inter-arrival distribution."""

    start_s: float  # from local midnight of day 0
    rate: float  # requests per second; 0 when the client was idle
    cv: float  # coefficient of variation of inter-arrival times
    dist: str  # "Gamma", "Weibull" or "" (no fit)
    shape: float
    scale: float


@dataclass(frozen=True)
class ServeGenModel:
    """One ServeGen model folder: every client's rate series, and its length PMFs where shipped."""

    category: str  # e.g. "language/m-large"
    folder: Path
    clients: dict[str, tuple[RateWindow, ...]]  # client id -> windows in time order
    _lengths: dict[str, dict[float, tuple[_Pmf, _Pmf]]] = field(default_factory=dict, repr=False)

    def window_starts(self) -> list[float]:
        """Every window start any client has, in order."""
        return sorted({w.start_s for ws in self.clients.values() for w in ws})

    def aggregate_rates(self) -> list[tuple[float, float]]:
        """(window start, sum of client rates) for every window: the model-level arrival rate."""
        total: dict[float, float] = {}
        for ws in self.clients.values():
            for w in ws:
                total[w.start_s] = total.get(w.start_s, 0.0) + w.rate
        return sorted(total.items())

    def lengths(self, client: str) -> dict[float, tuple[_Pmf, _Pmf]]:
        """The client's (input, output) token PMFs per 6-hour window, from its `chunk-<id>-dataset.json`;
        empty windows left out, and empty when the folder ships none (the language models)."""
        if client not in self._lengths:
            name = f"chunk-{client}-dataset.json"
            path = self.folder / name
            self._lengths[client] = _read_dataset(path if path.is_file() else self.folder / f"{name}.gz")
        return self._lengths[client]


@dataclass(frozen=True, slots=True)
class _Pmf:
    values: np.ndarray
    probs: np.ndarray


def _client_id(path: Path) -> str:
    return path.name.removesuffix(".gz").removeprefix("chunk-").removesuffix("-trace.csv").removesuffix("-dataset.json")


def _float(text: str, column: str, path: Path, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(path, line, f"{column} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(path, line, f"{column} must be a finite number >= 0, got {text!r}")
    return value


def _csv_rows(reader: Any, path: Path, columns: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    """(line number, row) of a CSV reader, blank lines skipped, every row checked for its column count."""
    for row in reader:
        if not row:
            continue
        if len(row) != len(columns):
            raise TraceError(path, reader.line_num,
                             f"expected {len(columns)} columns ({', '.join(columns)}), got {len(row)}")
        yield reader.line_num, row


def _read_rates(path: Path) -> tuple[RateWindow, ...]:
    out: list[RateWindow] = []
    for line, row in _csv_rows(csv.reader(read_lines(path)), path,
                               ("window_start_s", "rate", "cv", "dist", "shape", "scale")):
        start = _float(row[0], "window_start_s", path, line)
        rate = _float(row[1], "rate", path, line)
        cv = _float(row[2], "cv", path, line)
        dist = row[3].strip()
        if dist not in SERVEGEN_DISTS:
            raise TraceError(path, line, f"iat_dist must be Gamma, Weibull or empty, got {dist!r}")
        shape = _float(row[4], "shape", path, line)
        scale = _float(row[5], "scale", path, line)
        if dist and rate > 0 and shape <= 0:
            raise TraceError(path, line, f"a {dist} fit needs shape > 0, got {shape}")
        if out and start <= out[-1].start_s:
            raise TraceError(path, line, f"window_start_s {row[0]} is not after the previous window")
        out.append(RateWindow(start, rate, cv, dist, shape, scale))
    return tuple(out)


def _parse_pmf(text: object, path: Path, where: str) -> _Pmf | None:
    """A PMF string `{tokens: prob, ...}`; None when empty."""
    if not isinstance(text, str):
        raise TraceError(path, 1, f"{where} must be a string '{{tokens: prob, ...}}', got {type(text).__name__}")
    body = text.strip().removeprefix("{").removesuffix("}").strip()
    if not body:
        return None
    values: list[float] = []
    probs: list[float] = []
    try:
        for item in body.split(","):
            k, v = item.split(":")
            values.append(float(k))
            probs.append(float(v))
    except ValueError:
        raise TraceError(path, 1, f"{where} is not a '{{tokens: prob, ...}}' mapping") from None
    p = np.asarray(probs)
    if (p < 0).any() or p.sum() <= 0:
        raise TraceError(path, 1, f"{where} has negative or all-zero probabilities")
    return _Pmf(np.asarray(values), p / p.sum())


def _read_dataset(path: Path) -> dict[float, tuple[_Pmf, _Pmf]]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise TraceError(path, exc.lineno, f"not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise TraceError(path, 1, "expected a JSON object keyed by window start")
    out: dict[float, tuple[_Pmf, _Pmf]] = {}
    for key, entry in doc.items():
        if not isinstance(entry, dict):
            raise TraceError(path, 1, f"window {key}: expected an object")
        try:
            start = float(key)
        except ValueError:
            raise TraceError(path, 1, f"window key {key!r} is not a number of seconds") from None
        inp = _parse_pmf(entry.get("input_tokens"), path, f"window {key} input_tokens")
        out_ = _parse_pmf(entry.get("output_tokens"), path, f"window {key} output_tokens")
        if inp is not None and out_ is not None:
            out[start] = (inp, out_)
    return dict(sorted(out.items()))


def load_servegen(model: str | Path) -> ServeGenModel:
    """Read every client of a ServeGen model folder: a path, or a shipped model (`language/m-large`)."""
    folder = Path(model)
    if isinstance(model, str) and not folder.is_dir():
        folder = shipped_trace(f"servegen/{model}")[0]
    if not folder.is_dir():
        raise DataError(folder, "no such ServeGen folder")
    files = sorted([*folder.glob("chunk-*-trace.csv"), *folder.glob("chunk-*-trace.csv.gz")],
                   key=lambda p: (len(_client_id(p)), _client_id(p)))
    if not files:
        raise DataError(folder, "no chunk-<client>-trace.csv (or .csv.gz) files in this ServeGen folder")
    clients = {_client_id(p): _read_rates(p) for p in files}
    category = f"{folder.parent.name}/{folder.name}"
    return ServeGenModel(category, folder, clients)


def _stable(text: str) -> int:
    return zlib.crc32(text.encode())


def _gaps(rng: np.random.Generator, w: RateWindow, n: int) -> np.ndarray:
    """n inter-arrival gaps with the window's distribution shape, scaled to a mean of 1/rate."""
    mean = 1.0 / w.rate
    if w.dist == "Gamma":
        return rng.gamma(w.shape, mean / w.shape, n)
    if w.dist == "Weibull":
        return rng.weibull(w.shape, n) * (mean / math.gamma(1.0 + 1.0 / w.shape))
    if w.cv > 0 and abs(w.cv - 1.0) > 1e-9:  # no fit: a Gamma with the window's CV
        k = 1.0 / (w.cv * w.cv)
        return rng.gamma(k, mean / k, n)
    return rng.exponential(mean, n)


def _window_arrivals(rng: np.random.Generator, w: RateWindow, length: float) -> np.ndarray:
    """Offsets within [0, length) of one client's renewal process in one window."""
    expected = w.rate * length
    times: list[np.ndarray] = []
    t = 0.0
    while t < length:
        chunk = np.cumsum(_gaps(rng, w, int(expected * 1.2) + 16)) + t
        times.append(chunk)
        t = float(chunk[-1])
    arr = np.concatenate(times)
    return arr[arr < length]


def _pick_lengths(pmfs: Mapping[float, tuple[_Pmf, _Pmf]], t: float) -> tuple[_Pmf, _Pmf] | None:
    """The length PMFs of the latest window starting at or before t (else the first one)."""
    if not pmfs:
        return None
    chosen = None
    for start, pair in pmfs.items():
        if start <= t:
            chosen = pair
        elif chosen is None:
            return pair
    return chosen


def servegen_requests(model: ServeGenModel, *, start_s: float = 0.0, duration_s: float | None = None,
                      speedup: float = 1.0, seed: int = 0, clients: Iterable[str] | None = None,
                      default_lengths: tuple[int, int] = (0, 0), sample: float = 1.0) -> Iterator[Request]:
    """Arrivals generated from ServeGen's per-client rate windows, in time order, window by window.

    Each active (client, window) is a renewal process whose gaps have the window's fitted shape
    (Gamma or Weibull; a Gamma of the window's CV when there is no fit) scaled to a mean of
    1/rate: the published scales are not in seconds. Every (client, window) draws from its own
    seeded generator, so a request is the same whatever window is asked for. Input and output
    tokens come from the client's length PMFs where the folder ships them (deepseek-r1), else
    `default_lengths`. Trace time 0 is local midnight of day 0. `sample` < 1 keeps that share of
    arrivals (independently per request): a day compressed into minutes at a load a test fleet takes.
    """
    if not 0.0 < sample <= 1.0:
        raise ValueError(f"sample must be in (0, 1], got {sample}")
    win = _window(start_s, duration_s, speedup)
    chosen = list(model.clients) if clients is None else [c for c in clients if c in model.clients]
    cat = _stable(model.category)
    index = 0
    for start in model.window_starts():
        end = start + SERVEGEN_WINDOW_S
        if end <= win.start:
            continue
        if start >= win.end:
            return
        batch_t: list[np.ndarray] = []
        batch_in: list[np.ndarray] = []
        batch_out: list[np.ndarray] = []
        batch_client: list[str] = []
        for client in chosen:
            w = _window_of(model.clients[client], start)
            if w is None or w.rate <= 0:
                continue
            rng = np.random.default_rng([seed, cat, _stable(client), int(start)])
            t = _window_arrivals(rng, w, SERVEGEN_WINDOW_S) + start
            pair = _pick_lengths(model.lengths(client), start)
            if pair is None:
                inp = np.full(len(t), default_lengths[0])
                out = np.full(len(t), default_lengths[1])
            else:
                inp = rng.choice(pair[0].values, size=len(t), p=pair[0].probs)
                out = rng.choice(pair[1].values, size=len(t), p=pair[1].probs)
            keep = (t >= win.start) & (t < win.end)
            if sample < 1.0:
                keep &= rng.random(len(t)) < sample
            batch_t.append(t[keep])
            batch_in.append(inp[keep])
            batch_out.append(out[keep])
            batch_client.extend([client] * int(keep.sum()))
        if not batch_t:
            continue
        ts = np.concatenate(batch_t)
        ins = np.concatenate(batch_in).astype(np.int64)
        outs = np.concatenate(batch_out).astype(np.int64)
        for i in np.argsort(ts, kind="stable"):
            yield Request(win.arrival(float(ts[i])), int(ins[i]), int(outs[i]), (), 0, batch_client[i], model.category, index)
            index += 1


def _window_of(windows: tuple[RateWindow, ...], start: float) -> RateWindow | None:
    # Clients share one 600 s grid starting at 0; fall back to a search if a file skips windows.
    i = int(start // SERVEGEN_WINDOW_S)
    if 0 <= i < len(windows) and windows[i].start_s == start:
        return windows[i]
    return next((w for w in windows if w.start_s == start), None)
