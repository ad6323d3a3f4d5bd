"""Signals and targets read from a Prometheus that already scrapes the fleet, over its HTTP API.

For fleets too large for one process to scrape: Prometheus (or several, behind a query frontend)
does the scraping, and each tick issues PromQL instant queries for the signals our vLLM
collector derives (`collectors/vllm.py`), per engine and per pool, with the same names and
subjects (`engine/<pool>/<pod>/<engine>`, `pool/<pool>`). Prometheus does the arithmetic, so a
tick moves one number per engine and signal instead of every engine's exposition.

This module owns the PromQL (query building and the escaping of every configured label value),
the mapping of series labels to subjects, and the translation of API failures into
`PrometheusUnavailable` and `QueryFailed`. A signal whose metric families exist nowhere under the
selector is reported in `ApiOutput.missing`, never dropped silently.

Counter windows, two modes:

* `rate` (default): `rate()` and `increase()` over `[window]`, as dashboards compute them.
  Prometheus extrapolates them to the window edges, so they differ from our scraper's rates by up
  to one scrape interval's worth of increase at each edge.
* `delta`: the two-point difference `x - x offset window`, a decrease counted as a restart from
  zero (`x` itself), exactly as our scraper diffs two scrapes. Evaluated at a scrape-aligned time
  it agrees with our collectors to float rounding (`tests/real/test_prometheus_api_source.py`).

In both modes a reset is detected per series, so per histogram bucket; our collector treats a
whole histogram as restarted when any bucket or its count fell. They differ only for a bucket
that did not fall across a restart (one that was empty, or nearly so, before it).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from urllib3.util.retry import Retry

from catalog.fleet import Role
from catalog.redaction import without_credentials
from collectors.derive import share_above
from collectors.types import Objectives, Signal, Target, engine_subject, pool_subject

__all__ = [
    "OBJECTIVE_SIGNALS",
    "SIGNALS",
    "ApiOutput",
    "CounterMode",
    "Down",
    "Labels",
    "Malformed",
    "Missing",
    "PrometheusClient",
    "PrometheusError",
    "PrometheusSource",
    "PrometheusUnavailable",
    "QueryFailed",
    "SignalSpec",
    "build_query",
    "escape_label_value",
    "escape_regex",
    "selector",
    "shorten",
]

log = logging.getLogger(__name__)

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_REGEX_META = frozenset("\\.+*?()|[]{}^$")
_STATUS = re.compile(r"HTTP Status Code (\d{3})")
_BODY = re.compile(r"\((b'.*'|b\".*\")\)\Z", re.DOTALL)
QUERY_SHOWN = 200
FAIL_FAST = 3  # queries failed in a row: Prometheus is down or hanging, and the evaluation stops
MAX_FAILED = 8  # queries failed in one evaluation past which what is left is not the fleet's picture


# --- errors ---------------------------------------------------------------------------------------


class PrometheusError(Exception):
    """A Prometheus API call failed; `query` is the PromQL, shortened, `status` the HTTP status."""

    def __init__(self, message: str, *, query: str = "", status: int | None = None) -> None:
        self.query = shorten(query)
        self.status = status
        super().__init__(f"{message}; query: {self.query}" if query else message)


class PrometheusUnavailable(PrometheusError):
    """Prometheus could not answer: connection refused, timeout, HTTP 429 or 5xx."""


class QueryFailed(PrometheusError):
    """Prometheus answered but not with a result: HTTP 4xx (bad query), an error status, a malformed body."""


def shorten(query: str, limit: int = QUERY_SHOWN) -> str:
    """The query on one line, cut to `limit` characters with its full length noted."""
    flat = " ".join(query.split())
    return flat if len(flat) <= limit else f"{flat[: limit - 1]}… ({len(flat)} chars)"


# --- PromQL building ------------------------------------------------------------------------------


def escape_label_value(value: str) -> str:
    """`value` as the inside of a double-quoted PromQL string: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_regex(value: str) -> str:
    """`value` as an RE2 regular expression that matches exactly it (before string escaping)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in value)


def _label_name(name: str) -> str:
    if not _LABEL_NAME.match(name):
        raise ValueError(f"not a Prometheus label name: {name!r}")
    return name


def selector(matchers: Sequence[tuple[str, str, str]]) -> str:
    """`{name op "value", ...}` from (label, operator, raw value) triples; values are escaped here."""
    parts = []
    for name, op, value in matchers:
        if op not in ("=", "!=", "=~", "!~"):
            raise ValueError(f"not a label matcher operator: {op!r}")
        parts.append(f'{_label_name(name)}{op}"{escape_label_value(value)}"')
    return "{" + ",".join(parts) + "}" if parts else ""


class CounterMode(StrEnum):
    """How counter windows are computed: Prometheus' extrapolating `rate()` or a two-point delta."""

    RATE = "rate"
    DELTA = "delta"


@dataclass(frozen=True, slots=True)
class Labels:
    """Which series labels name the pool, the pod, the engine (data-parallel rank) and the target.

    Fleets without a pod label can use `Labels(pod="instance")`.
    """

    pool: str = "pool"
    pod: str = "pod"
    engine: str = "engine"
    instance: str = "instance"
    job: str = "job"

    def __post_init__(self) -> None:
        for name in (self.pool, self.pod, self.engine, self.instance, self.job):
            _label_name(name)

    def engine_grouping(self) -> tuple[str, ...]:
        """Labels that tell engines apart, without duplicates; and the job, so that an engine two jobs scrape (a
        ServiceMonitor and a PodMonitor) reads as two series, not one at twice its rate."""
        return tuple(dict.fromkeys((self.pool, self.pod, self.instance, self.engine, self.job)))

    def target_grouping(self) -> str:
        """The labels that name a scrape target and its pool, for a `group by`."""
        return ", ".join(dict.fromkeys((self.instance, self.pod, self.pool)))

    def target_of(self, labels: Mapping[str, str], pools: Mapping[str, str]) -> tuple[str, str, str | None]:
        """A series' instance, pod (the instance where it has no pod label) and pool (its pool label, else
        `pools[pod]`; None with neither)."""
        instance = labels.get(self.instance, "")
        pod = labels.get(self.pod) or instance
        return instance, pod, labels.get(self.pool) or pools.get(pod)


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One signal: how to compute it, from which metric families (alternative spellings, current first), and from
    which others where a group has none of them (`fallback`: another metric standing in, not a rename)."""

    name: str
    kind: Literal["rate", "ratio", "one_plus_ratio", "quantile", "sum", "avg", "max", "count", "count_pods"]
    families: tuple[tuple[str, ...], ...]  # each alternative: the families it needs, in order
    q: float = 0.0
    pools_only: bool = False  # a count of engines or pods: the scraper, too, gives it for pools alone
    fallback: tuple[tuple[str, ...], ...] = ()


_PREFIX = (("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
           ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"))
_ITL = (("vllm:inter_token_latency_seconds",), ("vllm:time_per_output_token_seconds",))
_KV = (("vllm:kv_cache_usage_perc",), ("vllm:gpu_cache_usage_perc",))
_SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"

SIGNALS: tuple[SignalSpec, ...] = (
    SignalSpec("request_rate", "rate", (("vllm:request_success_total",),)),
    SignalSpec("prompt_tokens_rate", "rate", (("vllm:prompt_tokens_total",),)),
    SignalSpec("generation_tokens_rate", "rate", (("vllm:generation_tokens_total",),)),
    SignalSpec("preemption_rate", "rate", (("vllm:num_preemptions_total",),)),
    SignalSpec("prefix_cache_query_rate", "rate", tuple((queries,) for _, queries in _PREFIX)),
    SignalSpec("prefix_cache_hit_rate", "ratio", _PREFIX),
    SignalSpec("spec_acceptance_rate", "ratio", ((_SPEC_ACCEPTED, "vllm:spec_decode_num_draft_tokens_total"),)),
    SignalSpec("spec_mean_acceptance_length", "one_plus_ratio", ((_SPEC_ACCEPTED, "vllm:spec_decode_num_drafts_total"),)),
    # Accepted per generated token: with the tokens per draft, how many steps draft at all (ngram drafts only where the
    # context repeats), which the advisor's speed-up turns on.
    SignalSpec("spec_yield", "ratio", ((_SPEC_ACCEPTED, "vllm:generation_tokens_total"),)),
    SignalSpec("ttft_p50", "quantile", (("vllm:time_to_first_token_seconds",),), 0.5),
    SignalSpec("ttft_p95", "quantile", (("vllm:time_to_first_token_seconds",),), 0.95),
    SignalSpec("ttft_p99", "quantile", (("vllm:time_to_first_token_seconds",),), 0.99),
    # Older engines have no per-request TPOT; the collector falls back to the inter-token latency.
    SignalSpec("tpot_p95", "quantile", (("vllm:request_time_per_output_token_seconds",),), 0.95, fallback=_ITL),
    SignalSpec("itl_p95", "quantile", _ITL, 0.95),
    SignalSpec("e2e_p95", "quantile", (("vllm:e2e_request_latency_seconds",),), 0.95),
    SignalSpec("queue_time_p95", "quantile", (("vllm:request_queue_time_seconds",),), 0.95),
    SignalSpec("kv_cache_usage", "avg", _KV),
    SignalSpec("kv_cache_usage_max", "max", _KV),
    SignalSpec("requests_running", "sum", (("vllm:num_requests_running",),)),
    SignalSpec("requests_waiting", "sum", (("vllm:num_requests_waiting",),)),
    # The lengths' quantiles are the autoscaler's prompt-length spread; the counts tell engines (data-parallel ranks)
    # from the pods the workload counts.
    SignalSpec("prompt_len_p50", "quantile", (("vllm:request_prompt_tokens",),), 0.5),
    SignalSpec("prompt_len_p95", "quantile", (("vllm:request_prompt_tokens",),), 0.95),
    SignalSpec("output_len_p50", "quantile", (("vllm:request_generation_tokens",),), 0.5),
    SignalSpec("output_len_p95", "quantile", (("vllm:request_generation_tokens",),), 0.95),
    # Their means, over the requests that finished (the token counters count a prompt when it is prefilled).
    SignalSpec("prompt_len_mean", "ratio", (("vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count"),)),
    SignalSpec("output_len_mean", "ratio",
               (("vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count"),)),
    SignalSpec("engines_reporting", "count", (("vllm:num_requests_running",),), pools_only=True),
    SignalSpec("pods_reporting", "count_pods", (("vllm:num_requests_running",),), pools_only=True),
)
# A pool's share of requests over its objective (signal, `Objectives`' field, the histogram's spellings), from the
# pool's bucket increases.
OBJECTIVE_SIGNALS: tuple[tuple[str, str, tuple[tuple[tuple[str, ...], ...], ...]], ...] = tuple(
    (Objectives.signal(objective), objective, groups) for objective, groups in (
        ("ttft", ((("vllm:time_to_first_token_seconds",),),)),
        ("tpot", ((("vllm:request_time_per_output_token_seconds",),), _ITL))))


@dataclass(frozen=True, slots=True)
class _Window:
    mode: CounterMode
    seconds: float

    @property
    def duration(self) -> str:
        return f"{max(1, round(self.seconds * 1000))}ms"

    def increase(self, series: str) -> str:
        """Per-series increase of a counter (or bucket) selector over the window."""
        if self.mode is CounterMode.RATE:
            return f"increase({series}[{self.duration}])"
        d = f"({series} - {series} offset {self.duration})"
        return f"(({d} >= 0) or ({series} and ({d} < 0)))"

    def rate(self, series: str) -> str:
        """Per-series per-second rate of a counter selector over the window."""
        if self.mode is CounterMode.RATE:
            return f"rate({series}[{self.duration}])"
        # Over the time between the two samples read, as the scraper divides: after a gap in Prometheus' samples
        # (its own restart), the one `offset` finds is older than the window, and the increase spans the gap.
        elapsed = f"(timestamp({series}) - timestamp({series} offset {self.duration}))"
        return f"({self.increase(series)} / ({elapsed} > 0))"


def build_query(spec: SignalSpec, sel: str, by: tuple[str, ...], window: _Window,
                pod: tuple[str, ...] = ("pod", "instance"),
                engine: tuple[str, ...] = Labels().engine_grouping()) -> str:
    """The PromQL of one signal (`pod`: the labels that tell pods apart; `engine`, engines). A family's alternative
    spellings are joined with `or` series by series, inside the aggregation: in a rolling upgrade each engine is read
    in the spelling it has (one with both, in the current one), where a choice per pool would drop every engine still
    on the other. A fallback, another metric, stands in per group where an engine has only it: read from the engines
    that have the signal's own, a pool midway through an upgrade would be read from part of it (as the scraper
    merges)."""
    main = _aggregated(spec, spec.families, sel, by, window, pod)
    if not spec.fallback:
        return main
    if not set(engine) <= set(by):  # a group of engines: one of them may lack the signal's own
        main = f"({main}) unless on ({', '.join(by)}) {_lacking(spec.families, spec.fallback, sel, by, engine)}"
    return f"({main}) or ({_aggregated(spec, spec.fallback, sel, by, window, pod)})"


def _lacking(main: tuple[tuple[str, ...], ...], other: tuple[tuple[str, ...], ...], sel: str, by: tuple[str, ...],
             engine: tuple[str, ...]) -> str:
    """The groups (`by`) with an engine (told apart by the `engine` labels) that has a histogram of `other` and none
    of `main`."""
    each = ", ".join(dict.fromkeys((*by, *engine)))

    def engines(spellings: tuple[tuple[str, ...], ...]) -> str:
        return f"group by ({each}) ({' or '.join(f'({fams[0]}_count{sel})' for fams in spellings)})"

    return f"count by ({', '.join(by)}) ({engines(other)} unless on ({each}) {engines(main)})"


def _aggregated(spec: SignalSpec, spellings: tuple[tuple[str, ...], ...], sel: str, by: tuple[str, ...],
                window: _Window, pod: tuple[str, ...]) -> str:
    grouping = ", ".join(by)

    def each(position: int, series: Callable[[str], str]) -> str:
        parts = [series(fams[position]) for fams in spellings]
        return parts[0] if len(parts) == 1 else " or ".join(f"({p})" for p in parts)

    if spec.kind == "rate":
        return f"sum by ({grouping}) ({each(0, lambda f: window.rate(f + sel))})"
    if spec.kind in ("ratio", "one_plus_ratio"):
        num, den = (f"sum by ({grouping}) ({each(i, lambda f: window.increase(f + sel))})" for i in (0, 1))
        ratio = f"{num} / ({den} > 0)"
        return ratio if spec.kind == "ratio" else f"1 + ({ratio})"
    if spec.kind == "quantile":
        inner = each(0, lambda f: window.increase(f"{f}_bucket{sel}"))
        return f"histogram_quantile({spec.q!r}, sum by ({', '.join((*by, 'le'))}) ({inner}))"
    if spec.kind == "count_pods":  # the pods behind the engines: one series per pod, then counted
        return f"count by ({grouping}) (count by ({', '.join(dict.fromkeys((*by, *pod)))}) ({each(0, lambda f: f + sel)}))"
    return f"{spec.kind} by ({grouping}) ({each(0, lambda f: f + sel)})"


# --- results --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Missing:
    """A signal none of whose metric families exist under the selector; `scope` is engine or a pool."""

    signal: str
    scope: str
    query: str


# The kinds whose value is NaN when the window holds no observations (0/0): a quantile, a ratio. Any other kind's NaN
# comes from a series under it.
_EMPTY_IS_NAN = frozenset({"ratio", "one_plus_ratio", "quantile"})


@dataclass(frozen=True, slots=True)
class Malformed:
    """A signal that could not be computed for `scope` because Prometheus answered with series it cannot read."""

    signal: str
    scope: str
    problem: str
    query: str


# A series every serving vLLM engine exports: what discovery and the down check find engines by.
ENGINE_SERIES = "vllm:num_requests_running"


@dataclass(frozen=True, slots=True)
class Down:
    """An engine of `pool` that Prometheus failed to scrape over the last window: the pool's sums lack its series."""

    pool: str
    instance: str


@dataclass(slots=True)
class ApiOutput:
    """Signals of one evaluation, what could not be computed, and series no pool could be given to."""

    signals: list[Signal] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    down: list[Down] = field(default_factory=list)
    failed: list[Malformed] = field(default_factory=list)  # signals whose query Prometheus did not answer
    failing: int = 0  # queries failed in a row, now
    unattributed: list[str] = field(default_factory=list)
    # Per pool, why its sums cannot be trusted: an engine counted twice, or pods left out of the labelled aggregate.
    doubtful: dict[str, str] = field(default_factory=dict)
    queries: int = 0


Row = tuple[dict[str, str], float]


def _parse_result(result: Any, query: str) -> list[Row]:
    if not isinstance(result, list):
        raise QueryFailed(f"expected a vector result, got {type(result).__name__}", query=query)
    rows: list[Row] = []
    for item in result:
        try:
            metric, (_, value) = item["metric"], item["value"]
            if not isinstance(metric, dict):
                raise TypeError("metric is not an object")
            rows.append(({str(k): str(v) for k, v in metric.items()}, float(value)))
        except (KeyError, TypeError, ValueError) as exc:
            raise QueryFailed(f"malformed vector sample {shorten(repr(item), 120)}: {exc}", query=query) from None
    return rows


def _http_status(exc: PrometheusApiClientException) -> int | None:
    found = _STATUS.search(str(exc))
    return int(found.group(1)) if found else None


def _api_error(exc: PrometheusApiClientException) -> str:
    """Prometheus' own `error` field from the body the client library quotes as a bytes repr."""
    text = str(exc)
    found = _BODY.search(text)
    if found:
        try:
            body = ast.literal_eval(found.group(1)).decode("utf-8", errors="replace")
        except (ValueError, SyntaxError, AttributeError):
            body = found.group(1)
        try:
            text = str(json.loads(body).get("error") or body)
        except (ValueError, AttributeError):
            text = body
    return shorten(text, 300)


# --- the source -----------------------------------------------------------------------------------


class PrometheusClient(Protocol):
    """What the source needs of `prometheus_api_client.PrometheusConnect`."""

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> Any:
        """The `data.result` of an instant query."""
        ...

    def close(self) -> None:
        """Release the HTTP session."""
        ...


class PrometheusSource:
    """vLLM signals and scrape targets from a Prometheus HTTP API.

    `selector` adds equality matchers to every query (e.g. `{"job": "vllm", "namespace": "llm"}`).
    `client` replaces the `PrometheusConnect` built from `url`, `headers`, `timeout` and `retries`
    (retries apply to refused connections and HTTP 502/503/504, with a short backoff). Calls block:
    from an event loop, run them with `asyncio.to_thread`.
    """

    def __init__(
        self,
        url: str,
        *,
        client: PrometheusClient | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        labels: Labels | None = None,
        selector: Mapping[str, str] | None = None,
        mode: CounterMode | str = CounterMode.RATE,
        retries: int = 1,
    ) -> None:
        self.url = url
        self.shown = without_credentials(url)  # basic auth rides in the URL: never in a message
        self.labels = labels or Labels()
        self.mode = CounterMode(mode)
        self._matchers = [(_label_name(k), "=", v) for k, v in sorted((selector or {}).items())]
        if client is None:
            retry = Retry(total=retries, read=0, backoff_factor=0.1, status_forcelist=(502, 503, 504), raise_on_status=False)
            client = PrometheusConnect(url, headers=dict(headers) if headers else None, timeout=timeout, retry=retry)
        self._client: PrometheusClient = client

    @property
    def matchers(self) -> list[tuple[str, str, str]]:
        """The fleet file's `selector` as label matchers: what every query this source asks is narrowed to."""
        return list(self._matchers)

    def close(self) -> None:
        """Release the HTTP session."""
        self._client.close()

    def query(self, expr: str, ts: float) -> list[tuple[dict[str, str], float]]:
        """One instant query at `ts`: (labels, value) per series; failures as PrometheusError."""
        try:
            result = self._client.custom_query(expr, params={"time": f"{ts:.3f}"})
        except PrometheusApiClientException as exc:
            status = _http_status(exc)
            kind = QueryFailed if status is not None and 400 <= status < 500 and status != 429 else PrometheusUnavailable
            raise kind(f"Prometheus at {self.shown} answered HTTP {status}: {_api_error(exc)}", query=expr,
                       status=status) from None
        except requests.exceptions.JSONDecodeError as exc:
            why = without_credentials(str(exc))
            raise QueryFailed(f"Prometheus at {self.shown} answered a body that is not JSON: {why}", query=expr) from None
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.RetryError) as exc:
            why = shorten(without_credentials(str(exc)), 200)
            raise PrometheusUnavailable(f"Prometheus at {self.shown} unreachable: {type(exc).__name__}: {why}",
                                        query=expr) from None
        except requests.RequestException as exc:
            why = without_credentials(str(exc))
            raise PrometheusUnavailable(f"request to Prometheus at {self.shown} failed: {type(exc).__name__}: {why}",
                                        query=expr) from None
        except (KeyError, TypeError) as exc:
            raise QueryFailed(f"Prometheus at {self.shown} answered without data.result ({exc!r})", query=expr) from None
        return _parse_result(result, expr)

    # signals ----------------------------------------------------------------------------------

    def signals(self, ts: float, window_s: float, pools: Mapping[str, str] | None = None,
                objectives: Mapping[str, Objectives] | None = None) -> ApiOutput:
        """Every signal in `SIGNALS` per engine and per pool, evaluated at `ts` over `window_s`, and for the pools
        with `objectives` the share of their requests over them (`OBJECTIVE_SIGNALS`).

        A series' pool is its pool label; series without one take `pools[<pod label value>]`, and
        those with neither are listed in `unattributed`. Signals are stamped `ts`.
        """
        if window_s <= 0:
            raise ValueError(f"window must be positive, got {window_s!r}")
        window = _Window(self.mode, window_s)
        lb = self.labels
        pools = dict(pools or {})
        out = ApiOutput()
        present: dict[str, bool] = {}  # "family{selector}" -> has series
        by_engine = lb.engine_grouping()
        engine_sel = selector(self._matchers)
        scopes: list[tuple[str, str, tuple[str, ...], str | None]] = [
            ("engine", engine_sel, by_engine, None),
            ("pool", selector([*self._matchers, (lb.pool, "!=", "")]), (lb.pool,), None),
        ]
        by_pool: dict[str, list[str]] = {}
        for pod, pool in sorted(pools.items()):
            by_pool.setdefault(pool, []).append(pod)
        for pool, pods in sorted(by_pool.items()):
            regex = "|".join(escape_regex(p) for p in pods)
            sel = selector([*self._matchers, (lb.pool, "=", ""), (lb.pod, "=~", regex)])
            scopes.append((f"pool/{pool}", sel, (), pool))

        seen_engines: dict[str, str] = {}
        seen_pools: set[tuple[str, str]] = set()
        for spec in SIGNALS:
            for scope, sel, by, fixed_pool in scopes:
                if spec.pools_only and scope == "engine":
                    continue
                expr = build_query(spec, sel, by, window, (lb.pod, lb.instance), by_engine)
                rows = self._answer(spec.name, scope, expr, ts, out)
                if rows is None:
                    continue
                if not rows:
                    # The label-based pool scope is empty whenever the engine scope is, or no series has the label.
                    if scope != "pool" and not self._families_exist(spec, scope, sel, ts, present, out):
                        out.missing.append(Missing(spec.name, scope, shorten(expr)))
                    continue
                for labels, value in rows:
                    if not math.isfinite(value):
                        if spec.kind not in _EMPTY_IS_NAN:
                            # A sum or rate is no number only where a series under it is none: dropped, the signal's
                            # last value would be read as now's; kept, one engine's NaN would hide the others'.
                            where = (pool_subject(labels.get(lb.pool, "")) if scope == "pool" else scope)
                            out.malformed.append(Malformed(spec.name, where, f"the {spec.kind} is {value} ({labels}): a "
                                                           "series under it is no number", shorten(expr)))
                        continue  # no observations in the window, as the scraper emits nothing then
                    if scope == "engine":
                        subject = self._engine_subject(labels, pools, seen_engines, out)
                    else:
                        subject = pool_subject(fixed_pool if fixed_pool is not None else labels.get(lb.pool, ""))
                        if (subject, spec.name) in seen_pools:
                            # A mapped pool that also has labelled series: the labelled aggregate stands.
                            note = f"{subject}: some series carry the {lb.pool} label and some are only mapped; kept the labelled"
                            if note not in out.unattributed:
                                out.unattributed.append(note)
                                out.doubtful.setdefault(subject.removeprefix("pool/"), f"{spec.name}: {note}, which "
                                                        "lacks the mapped pods")
                            subject = None
                        else:
                            seen_pools.add((subject, spec.name))
                    if subject is not None:
                        out.signals.append(Signal(ts, subject, spec.name, value))
        for name, field_name, groups in OBJECTIVE_SIGNALS:
            wanted = {pool: v for pool, o in (objectives or {}).items() if (v := getattr(o, field_name)) is not None}
            for _, sel, by, fixed_pool in scopes[1:] if wanted else ():
                if fixed_pool is not None and fixed_pool not in wanted:
                    continue
                scope_wants = {fixed_pool} if fixed_pool is not None else set(wanted)
                for pool, buckets in self._pool_buckets(name, groups, sel, by, fixed_pool, scope_wants,
                                                        window, ts, out).items():
                    share = share_above(wanted[pool], buckets)
                    if math.isfinite(share) and (pool_subject(pool), name) not in seen_pools:
                        seen_pools.add((pool_subject(pool), name))
                        out.signals.append(Signal(ts, pool_subject(pool), name, share))
        out.down = self._down(ts, window_s, pools, out)
        return out

    def _down(self, ts: float, window_s: float, pools: Mapping[str, str], out: ApiOutput) -> list[Down]:
        """The engines under the selector that answered within the last ten windows (at least ten minutes) but whose
        latest scrape by Prometheus failed, with their pools (by label or `pools`; one with neither is no pool's). A
        failed scrape marks every series of the target stale at once, so a pool's sums over its engines lack a down
        one's from then on, and look like less load, not like a gap. An engine still starting (a scale-up, a crash
        loop) has never answered, and is no engine of the sums yet, as a pod not Ready is no target of the control
        plane's own scrapes."""
        lb = self.labels
        sel = selector(self._matchers)
        recent, last = _Window(self.mode, max(600.0, 10 * window_s)).duration, _Window(self.mode, window_s).duration
        rows = self.query(f"group by ({lb.target_grouping()}) ((last_over_time(up{sel}[{last}]) == 0) and on "
                          f"({lb.instance}) (count_over_time({ENGINE_SERIES}{sel}[{recent}]) > 0))", ts)
        out.queries += 1
        down = set()
        for labels, _ in rows:
            instance, _, pool = lb.target_of(labels, pools)
            if pool:
                down.add(Down(pool, instance))
        return sorted(down, key=lambda d: (d.pool, d.instance))

    def _answer(self, signal: str, scope: str, expr: str, ts: float, out: ApiOutput) -> list[Row] | None:
        """One query of an evaluation; None where Prometheus did not answer it (kept in `out.failed`): one query it
        refuses (too many samples, a timeout under load) leaves the others' signals. `FAIL_FAST` failures in a row
        (Prometheus unreachable, or hanging: each costs a timeout), or more than `MAX_FAILED` in all, end it."""
        out.queries += 1
        try:
            rows = self.query(expr, ts)
        except PrometheusError as exc:
            out.failing += 1
            if out.failing >= FAIL_FAST or len(out.failed) >= MAX_FAILED:
                raise
            out.failed.append(Malformed(signal, scope, f"its query failed: {exc}", shorten(expr)))
            return None
        out.failing = 0
        return rows

    def _pool_buckets(self, signal: str, groups: tuple[tuple[tuple[str, ...], ...], ...], sel: str,
                      by: tuple[str, ...], fixed_pool: str | None, wanted: set[str], window: _Window, ts: float,
                      out: ApiOutput) -> dict[str, list[tuple[float, float]]]:
        """Per pool of `wanted`, a histogram's cumulative bucket increases over the window, each pool from the first
        group of metrics every engine of it has (the histogram, else the one standing in for it), each engine in the spelling
        it has (a rolling upgrade mixes them). A pool with a bucket bound that is no number gets none, with the
        series in `out.malformed`: its share cannot be read, and the other pools' still can."""
        grouping = ", ".join((*by, "le"))
        buckets: dict[str, list[tuple[float, float]]] = {}
        broken: set[str] = set()
        for i, spellings in enumerate(groups):
            families = spellings[0]
            inner = " or ".join(f"({window.increase(f'{fams[0]}_bucket{sel}')})" for fams in spellings)
            query = f"sum by ({grouping}) ({inner})"
            if later := tuple(fams for group in groups[i + 1:] for fams in group):  # as `build_query`'s fallback
                lacking = _lacking(spellings, later, sel, by, self.labels.engine_grouping())
                query = f"({query}) unless on ({', '.join(by)}) {lacking}"
            rows = self._answer(signal, pool_subject(fixed_pool) if fixed_pool is not None else "pool", query, ts, out)
            if rows is None:
                break
            found: dict[str, list[tuple[float, float]]] = {}
            for labels, value in rows:
                pool = fixed_pool if fixed_pool is not None else labels.get(self.labels.pool, "")
                if (pool not in wanted or pool in buckets or pool in broken or "le" not in labels
                        or not math.isfinite(value)):
                    continue
                try:
                    bound = float(labels["le"])
                except ValueError:
                    broken.add(pool)
                    out.malformed.append(Malformed(signal, pool_subject(pool),
                                                   f"bucket bound le={labels['le']!r} of {families[0]} is not a number",
                                                   shorten(query)))
                    continue
                found.setdefault(pool, []).append((bound, value))
            buckets.update((pool, b) for pool, b in found.items() if pool not in broken)
            if wanted <= buckets.keys() | broken:
                break
        return buckets

    def _engine_subject(self, labels: Mapping[str, str], pools: Mapping[str, str], seen: dict[str, str],
                        out: ApiOutput) -> str | None:
        lb = self.labels
        instance, pod, pool = lb.target_of(labels, pools)
        engine = labels.get(lb.engine) or "0"
        if not pool:
            note = f"{pod or '?'}: no {lb.pool} label and not in the pool mapping"
            if note not in out.unattributed:
                out.unattributed.append(note)
            return None
        subject = engine_subject(pool, pod, engine)
        where = "/".join(part for part in (instance, labels.get(lb.job)) if part)  # an instance, as a job scrapes it
        owner = seen.setdefault(subject, where)
        if owner != where:
            note = f"{subject}: served by both {owner} and {where}; kept {owner}"
            if note not in out.unattributed:
                out.unattributed.append(note)
                # The pool's own aggregates sum every series under the selector: that engine's, twice.
                out.doubtful.setdefault(pool, f"{note}, and the pool's sums count it twice")
            return None
        return subject

    def _families_exist(self, spec: SignalSpec, scope: str, sel: str, ts: float, present: dict[str, bool],
                        out: ApiOutput) -> bool:
        """Whether any spelling of the signal's families has series under the selector (cached per call); a query
        not answered counts as yes: the signal is unfit then (`out.failed`), not missing."""
        for fams in (*spec.families, *spec.fallback):
            names = [f"{fam}_count{sel}" if spec.kind == "quantile" else f"{fam}{sel}" for fam in fams]
            for name in names:
                if name not in present:
                    rows = self._answer(spec.name, scope, f"count({name})", ts, out)
                    if rows is None:
                        return True
                    present[name] = bool(rows)
            if all(present[name] for name in names):
                return True
        return False

    # targets ----------------------------------------------------------------------------------

    def discover_targets(
        self,
        ts: float,
        *,
        pools: Mapping[str, str] | None = None,
        roles: Mapping[str, Role] | None = None,
        metric: str = ENGINE_SERIES,
        include_down: bool = False,
        scheme: str = "http",
        metrics_path: str = "/metrics",
    ) -> list[Target]:
        """Scrape targets from the labels of `metric` series (one per instance) at `ts`.

        With `include_down`, targets whose `up` is 0 under the selector join them: set it only
        when the selector picks vLLM jobs alone. URLs are `<scheme>://<instance><metrics_path>`;
        the pool comes from the pool label or `pools[pod]`; the role from `roles[pool]`.
        Targets without a pool are left out and logged.
        """
        lb = self.labels
        if not _LABEL_NAME.match(metric.replace(":", "_")):
            raise ValueError(f"not a metric name: {metric!r}")
        sel = selector(self._matchers)
        grouping = lb.target_grouping()
        expr = f"group by ({grouping}) ({metric}{sel})"
        if include_down:
            expr += f" or group by ({grouping}) (up{sel} == 0)"
        pools = dict(pools or {})
        found: dict[str, Target] = {}
        for labels, _ in self.query(expr, ts):
            instance, pod, pool = lb.target_of(labels, pools)
            if not instance or instance in found:
                continue
            if not pool:
                log.warning("prometheus discovery: %s has no %s label and is not in the pool mapping", instance, lb.pool)
                continue
            role = (roles or {}).get(pool, Role.UNIFIED)
            found[instance] = Target(f"{scheme}://{instance}{metrics_path}", pool, pod, role)
        return sorted(found.values(), key=lambda t: (t.pool, t.pod, t.url))
