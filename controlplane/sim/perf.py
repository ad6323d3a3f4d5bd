"""Serving-time model of one engine, calibrated from measured performance profiles.

Owns reading the profiles (the shipped ones under `controlplane/data/perf`, or a user's own of the
same formats by path), fitting them, and answering how long a
prefill of some prompt tokens (part of them cached) and one decode step of a batch take.

Profiles (`load_profiles`):
- `dynamo/h200/llama3.1-8b-fp8`: NVIDIA Dynamo's pre-deployment profile (vLLM, 1×H200, TP1):
  TTFT of a lone request against its input length; ITL against concurrency n at context C,
  with n = kv_usage × max_kv_tokens / C (the raw npz files).
- `splitwise/<model>/<hardware>/tp<N>`: Splitwise's measured model (DGX-A100/H100, Llama2-70B,
  BLOOM-176B): prompt time at batch 1 against prompt length; time per output token against
  batch at prompt 512 and against prompt and output length at batch 1, with C = prompt + output/2.
  Medians over the repeats. Prompt times of batches of 512-token prompts (a pass of B·512 tokens)
  shape the fitted curve and extend the measured one past the longest lone prompt; a batch that
  prefilled faster than a smaller one is dropped as an anomaly, with its token times.

The model, in seconds, for one forward pass computing N = Σ new tokens of prompts whose earlier
`cached` tokens are already in the KV cache (one request: N = new):

    prefill = (a + b·N + c·(N² + 2·Σ new·cached)) · r_p(N)
    decode_step(n, C) = (d + e·m + f·m·C) · r_d(n, C),   m = min(n, max_batch)

a..f come from non-negative least squares on relative residuals (fixed overhead, per-token
compute, attention over the context; per-step weight reads, per-sequence work, KV reads). The
ratios r_p and r_d make the model pass through the measurements: within the measured range, r
is the piecewise-linear interpolation of the measured times divided by the fitted curve
(r_d along n within each measured context, then linearly across contexts); beyond it, r is held
at the edge value, so the model extrapolates with the fitted curve's shape. Times never fall as
a prompt or a batch grows, so measured points that do (noise: Splitwise's H100 TP8 prompt of 128
tokens is slower than that of 256) are first pooled by isotonic regression, along the prompt
length and along the batch within a context. Every time is divided by `speed`, the per-pool
speed factor (2.0: twice as fast as the profiled hardware).
"""

from __future__ import annotations

import csv
import functools
import io
import math
import statistics
import zipfile
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from controlplane.data import DATA_DIR, read_bytes, read_lines
from controlplane.errors import DataError

__all__ = ["DYNAMO_PROFILE", "PerfModel", "Profile", "fit", "load_dynamo", "load_model", "load_profile", "load_profiles",
           "load_splitwise"]

DYNAMO_PROFILE = "dynamo/h200/llama3.1-8b-fp8"
# vLLM V1's default max_num_seqs on GPUs of 70 GB and more; the profile's C=350 points past it
# (n = 1049..1573) stop getting slower because the extra requests wait instead of running.
DYNAMO_MAX_BATCH = 1024


@dataclass(frozen=True, slots=True)
class Profile:
    """Measured points of one model on one hardware configuration, in tokens and seconds."""

    name: str
    source: str
    prefill: tuple[tuple[int, float], ...]  # (prompt tokens, seconds) for one request, nothing cached
    decode: tuple[tuple[int, float, float], ...]  # (batch size, context tokens per sequence, seconds per step)
    prefill_batches: tuple[tuple[int, int, float], ...] = ()  # held out: (batch, prompt tokens each, seconds)
    max_batch: int | None = None


@dataclass(frozen=True, slots=True)
class PerfModel:
    """A fitted profile: prefill and decode-step times in seconds, scaled by `speed`."""

    profile: str
    prefill_coef: tuple[float, float, float]  # a [s], b [s/token], c [s/token²]
    decode_coef: tuple[float, float, float]  # d [s], e [s/sequence], f [s/(sequence·token)]
    prefill_knots: tuple[tuple[float, ...], tuple[float, ...]]  # tokens per pass, measured seconds (pooled)
    decode_rows: tuple[tuple[float, tuple[float, ...], tuple[float, ...]], ...]  # context, batches, measured seconds
    max_batch: int | None = None
    speed: float = 1.0
    decode_speed: float | None = None  # decode steps' own factor (memory-bound), when it differs from `speed`

    def with_speed(self, speed: float, decode_speed: float | None = None) -> PerfModel:
        """The same model for a pool `speed` times as fast as the profiled hardware (`decode_speed` for decode
        steps: a GPU whose memory bandwidth and compute differ from the profiled one's in different ratios)."""
        for name, value in (("speed", speed), ("decode_speed", speed if decode_speed is None else decode_speed)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        return replace(self, speed=speed, decode_speed=decode_speed)

    # prefill --------------------------------------------------------------------------------

    def prefill_fit_seconds(self, chunks: Iterable[tuple[int, int]]) -> float:
        """The fitted curve alone for one forward pass over (new, cached) token chunks, before speed."""
        a, b, c = self.prefill_coef
        total = cross = 0
        for new, cached in chunks:
            total += new
            cross += new * cached
        return a + b * total + c * (total * total + 2 * cross)

    def prefill_batch_seconds(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One forward pass over several prompts, each as (new tokens, cached tokens before them)."""
        items = [(int(n), int(c)) for n, c in chunks]
        for new, cached in items:
            if new < 0 or cached < 0:
                raise ValueError(f"token counts must be >= 0, got new={new} cached={cached}")
        total_new = sum(n for n, _ in items)
        if total_new == 0:
            return 0.0
        return self.prefill_fit_seconds(items) * self._prefill_ratio(total_new) / self.speed

    def _prefill_ratio(self, tokens: float) -> float:
        xs, ys = self.prefill_knots
        x = min(max(tokens, xs[0]), xs[-1])
        a, b, c = self.prefill_coef
        return _interp(x, xs, ys) / (a + b * x + c * x * x)

    def prefill_seconds(self, input_tokens: int, cached_tokens: int = 0) -> float:
        """Time to first token of one request alone: its uncached tokens computed over the cached prefix."""
        if cached_tokens > input_tokens:
            raise ValueError(f"cached_tokens ({cached_tokens}) exceeds input_tokens ({input_tokens})")
        return self.prefill_batch_seconds([(input_tokens - cached_tokens, cached_tokens)])

    # decode ---------------------------------------------------------------------------------

    def decode_fit_seconds(self, batch_size: float, context_tokens: float) -> float:
        """The fitted curve alone for one decode step, before speed."""
        d, e, f = self.decode_coef
        m = batch_size if self.max_batch is None else min(batch_size, self.max_batch)
        return d + e * m + f * m * context_tokens

    def decode_step_seconds(self, batch_size: int, context_tokens: float) -> float:
        """One decode step (the inter-token latency) of `batch_size` sequences of mean context `context_tokens`."""
        if batch_size < 0 or context_tokens < 0:
            raise ValueError(f"batch_size and context_tokens must be >= 0, got {batch_size}, {context_tokens}")
        if batch_size == 0:
            return 0.0
        speed = self.speed if self.decode_speed is None else self.decode_speed
        return self.decode_fit_seconds(batch_size, context_tokens) * self._decode_ratio(batch_size, context_tokens) / speed

    def _row_ratio(self, row: tuple[float, tuple[float, ...], tuple[float, ...]], n: float) -> float:
        ctx, xs, ys = row
        x = min(max(n, xs[0]), xs[-1])
        return _interp(x, xs, ys) / self.decode_fit_seconds(x, ctx)

    def _decode_ratio(self, n: float, ctx: float) -> float:
        rows = self.decode_rows
        contexts = [r[0] for r in rows]
        k = bisect_left(contexts, ctx)
        if k == len(rows):
            return self._row_ratio(rows[-1], n)
        if k == 0 or contexts[k] == ctx:
            return self._row_ratio(rows[k], n)
        lo, hi = rows[k - 1], rows[k]
        w = (ctx - lo[0]) / (hi[0] - lo[0])
        return (1 - w) * self._row_ratio(lo, n) + w * self._row_ratio(hi, n)


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear through (xs, ys), constant beyond the ends; xs ascending."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    k = bisect_right(xs, x)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _nnls_relative(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative residuals."""
    a = features / y[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(a / norms, np.ones(len(y)))
    return np.asarray(coef / norms, dtype=float)


def fit(profile: Profile) -> PerfModel:
    """Fit a profile: the physical curves, and the (pooled) measured times the model passes through."""
    if len(profile.prefill) < 2 or not profile.decode:
        raise ValueError(f"profile {profile.name} needs at least 2 prefill points and 1 decode point")
    prefill = sorted(profile.prefill)
    shape = prefill + [(b * p, s) for b, p, s in profile.prefill_batches]
    n = np.array([p[0] for p in shape], dtype=float)
    y = np.array([p[1] for p in shape], dtype=float)
    pc = _nnls_relative(np.c_[np.ones_like(n), n, n * n], y)
    prefill_coef = (float(pc[0]), float(pc[1]), float(pc[2]))

    batch = np.array([p[0] for p in profile.decode], dtype=float)
    ctx = np.array([p[1] for p in profile.decode], dtype=float)
    yd = np.array([p[2] for p in profile.decode], dtype=float)
    m = batch if profile.max_batch is None else np.minimum(batch, profile.max_batch)
    dc = _nnls_relative(np.c_[np.ones_like(m), m, m * ctx], yd)

    merged: dict[int, list[float]] = defaultdict(list)
    for lone, seconds in prefill:
        merged[lone].append(seconds)
    longest = prefill[-1][0]
    for b, p, seconds in profile.prefill_batches:
        if b * p > longest:  # only batches measure passes longer than the longest lone prompt
            merged[b * p].append(seconds)
    tokens = sorted(merged)
    measured = _isotonic([statistics.fmean(merged[k]) for k in tokens])
    by_ctx: dict[float, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for bs, c, seconds in profile.decode:
        by_ctx[float(c)][int(bs)].append(seconds)
    rows = tuple(
        (c, tuple(float(b) for b in sorted(pts)), tuple(_isotonic([statistics.fmean(pts[b]) for b in sorted(pts)])))
        for c, pts in sorted(by_ctx.items())
    )
    return PerfModel(profile.name, prefill_coef, (float(dc[0]), float(dc[1]), float(dc[2])),
                     (tuple(float(k) for k in tokens), tuple(measured)), rows, profile.max_batch)


def _isotonic(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


# loading ------------------------------------------------------------------------------------


DYNAMO_DIR = DATA_DIR / "perf" / "dynamo_h200_llama31_8b_fp8"
SPLITWISE_CSV = DATA_DIR / "perf" / "splitwise" / "perf_model.csv.gz"


def _npz(path: Path, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """The named arrays of an npz file; a missing, damaged or incomplete file is a `DataError`."""
    try:
        with np.load(io.BytesIO(read_bytes(path))) as arrays:
            missing = [k for k in keys if k not in arrays.files]
            if missing:
                raise DataError(path, f"missing arrays {', '.join(missing)} (has {', '.join(arrays.files) or 'none'})")
            out = {k: np.asarray(arrays[k], dtype=float) for k in keys}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise DataError(path, f"not a readable npz file ({exc})") from None
    sizes = {len(out[k]) for k in keys if k != "max_kv_tokens"}
    if len(sizes) != 1 or not sizes.pop():
        raise DataError(path, f"arrays {', '.join(keys)} must be non-empty and of one length")
    return out


def load_dynamo(folder: Path | None = None) -> Profile:
    """A Dynamo planner profile from its raw npz files (ms converted to s); the shipped H200 one by default."""
    folder = folder or DYNAMO_DIR
    pre = _npz(folder / "prefill_raw_data.npz", ("prefill_isl", "prefill_ttft"))
    dec = _npz(folder / "decode_raw_data.npz", ("x_kv_usage", "y_context_length", "z_itl", "max_kv_tokens"))
    max_kv = float(dec["max_kv_tokens"][0])
    prefill = tuple((int(i), float(t) / 1e3) for i, t in zip(pre["prefill_isl"], pre["prefill_ttft"], strict=True))
    decode = tuple(
        (round(float(u) * max_kv / float(c)), float(c), float(t) / 1e3)
        for u, c, t in zip(dec["x_kv_usage"], dec["y_context_length"], dec["z_itl"], strict=True)
    )
    name = DYNAMO_PROFILE if folder == DYNAMO_DIR else f"dynamo/{folder.name}"
    return Profile(name, str(folder), prefill, decode, (), DYNAMO_MAX_BATCH)


SPLITWISE_COLUMNS = ("model", "hardware", "prompt_size", "batch_size", "token_size", "prompt_time", "token_time",
                     "tensor_parallel")


def load_splitwise(path: Path | None = None) -> dict[str, Profile]:
    """Every (model, hardware, tensor parallel) of a Splitwise perf_model.csv as a profile; the shipped one by default."""
    path = path or SPLITWISE_CSV
    prompt: dict[tuple[str, str, int], dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    token: dict[tuple[str, str, int], dict[tuple[int, int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    reader = csv.DictReader(read_lines(path))
    missing = [c for c in SPLITWISE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise DataError(path, f"missing columns {', '.join(missing)}", 1)
    for row in reader:
        try:
            key = (row["model"], row["hardware"], int(row["tensor_parallel"]))
            p, b, t = int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"])
            pt, tt = float(row["prompt_time"]) / 1e3, float(row["token_time"]) / 1e3
        except (TypeError, ValueError) as exc:
            raise DataError(path, f"malformed row ({exc})", reader.line_num) from None
        prompt[key][(b, p)].append(pt)
        token[key][(b, p, t)].append(tt)
    if not prompt:
        raise DataError(path, "no rows")
    out: dict[str, Profile] = {}
    for key in sorted(prompt):
        model, hardware, tp = key
        name = f"splitwise/{model}/{hardware}/tp{tp}"
        pre = tuple((p, statistics.median(v)) for (b, p), v in sorted(prompt[key].items()) if b == 1)
        batches: list[tuple[int, int, float]] = []
        dropped: set[tuple[int, int]] = set()
        for (b, p), v in sorted(prompt[key].items()):
            if b == 1:
                continue
            seconds = statistics.median(v)
            if batches and batches[-1][1] == p and seconds < batches[-1][2]:
                # A batch prefilled faster than a smaller one did not run as labelled (llama2-70b TP2,
                # batch 64: its token times fall too); the whole measurement goes.
                dropped.add((b, p))
                continue
            batches.append((b, p, seconds))
        # Mean context over the outputs: the prompt plus half of them.
        dec = tuple(sorted((b, p + t / 2, statistics.median(v)) for (b, p, t), v in token[key].items() if (b, p) not in dropped))
        out[name] = Profile(name, str(path), pre, dec, tuple(batches), None)
    return out


def load_profiles() -> dict[str, Profile]:
    """Every shipped profile, by name."""
    profiles = {DYNAMO_PROFILE: load_dynamo()}
    profiles.update(load_splitwise())
    return profiles


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a user's: a Dynamo profile folder (`prefill_raw_data.npz`,
    `decode_raw_data.npz`) or a Splitwise CSV holding exactly one model, hardware and TP."""
    path = Path(name_or_path)
    if name_or_path == DYNAMO_PROFILE:
        return load_dynamo()
    if name_or_path.startswith("splitwise/") and not path.exists():
        profiles = load_splitwise()
        if name_or_path not in profiles:
            raise DataError(name_or_path, f"no such shipped profile; shipped: {', '.join(load_profiles())}")
        return profiles[name_or_path]
    if path.is_dir():
        return load_dynamo(path)
    if path.is_file():
        found = load_splitwise(path)
        if len(found) != 1:
            raise DataError(path, f"holds {len(found)} profiles ({', '.join(found)}); keep one model, hardware and TP")
        return next(iter(found.values()))
    raise DataError(name_or_path, f"no such profile file or folder, and no shipped profile of that name; "
                                  f"shipped: {', '.join(load_profiles())}")


@functools.cache
def load_model(name: str = DYNAMO_PROFILE, speed: float = 1.0, decode_speed: float | None = None) -> PerfModel:
    """The fitted model of a profile (a shipped name or a path, see `load_profile`) at a pool speed factor."""
    return fit(load_profile(name)).with_speed(speed, decode_speed)
