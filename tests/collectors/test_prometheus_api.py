"""The Prometheus API source without a Prometheus: PromQL building and escaping, canned API answers.

Escaping is checked against a PromQL string-literal parser written here from the PromQL lexer's
rules (Go escapes; a raw newline or an unescaped quote ends or breaks the literal). Canned
answers go through the real `PrometheusConnect` and `requests`, with a transport adapter in place
of the network, so error translation sees exactly what the client library raises.
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st
from prometheus_api_client import PrometheusConnect
from requests.adapters import BaseAdapter

from catalog.fleet import Role
from collectors.prometheus_api import (
    FAIL_FAST,
    SIGNALS,
    CounterMode,
    Labels,
    PrometheusSource,
    PrometheusUnavailable,
    QueryFailed,
    build_query,
    escape_label_value,
    escape_regex,
    selector,
    shorten,
)
from collectors.prometheus_api import _Window as Window
from collectors.types import Objectives, Signal, Target

URL = "http://prometheus.test:9090"
SPECS = {spec.name: spec for spec in SIGNALS}

# --- a PromQL string literal parser (double-quoted, as the PromQL lexer reads it) ----------------------

_SIMPLE = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\", '"': '"'}


def parse_string(text: str, start: int = 0) -> tuple[str, int]:
    """The value of the double-quoted literal at `text[start]` and the index after its closing quote."""
    if text[start:start + 1] != '"':
        raise ValueError("not a string literal")
    out: list[str] = []
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            return "".join(out), i + 1
        if c == "\n":
            raise ValueError("unterminated quoted string")
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = text[i + 1:i + 2]
        if e in _SIMPLE:
            out.append(_SIMPLE[e])
            i += 2
        elif e in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[e]
            digits = text[i + 2:i + 2 + width]
            if len(digits) != width or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                raise ValueError("bad hex escape")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        elif re.fullmatch(r"[0-7]{3}", text[i + 1:i + 4]):
            out.append(chr(int(text[i + 1:i + 4], 8)))
            i += 4
        else:
            raise ValueError(f"unknown escape sequence {e!r}")
    raise ValueError("unterminated quoted string")


def parse_selector(text: str) -> list[tuple[str, str, str]]:
    """`{name op "value", ...}` back into (name, op, value) triples."""
    assert text.startswith("{") and text.endswith("}")
    out = []
    i = 1
    while text[i] != "}":
        name = re.match(r"[a-zA-Z_][a-zA-Z0-9_]*", text[i:])
        assert name is not None
        i += name.end()
        op = re.match(r"=~|!~|!=|=", text[i:])
        assert op is not None
        i += op.end()
        value, i = parse_string(text, i)
        out.append((name.group(), op.group(), value))
        if text[i] == ",":
            i += 1
    assert i == len(text) - 1, "text after the closing brace"
    return out


def test_the_parser_reads_go_escapes() -> None:
    literal = r'"a\"b\\c\nd\x41\u00e9\101"'
    assert parse_string(literal + " x") == ('a"b\\c\ndAé' + "A", len(literal))
    for bad in ('"open', '"new\nline"', r'"\q"', "'single'"):
        with pytest.raises(ValueError):
            parse_string(bad)


# --- escaping ---------------------------------------------------------------------------------------


def test_escape_label_value_examples() -> None:
    assert escape_label_value('pre"fill') == 'pre\\"fill'
    assert escape_label_value("a\\b") == "a\\\\b"
    assert escape_label_value("two\nlines") == "two\\nlines"
    assert escape_label_value('\\"') == '\\\\\\"'  # backslash first, so the quote's escape is not doubled
    assert escape_label_value("plain-value_1") == "plain-value_1"


@given(st.text())
def test_escaped_values_round_trip_through_a_promql_literal(value: str) -> None:
    literal = f'"{escape_label_value(value)}"'
    assert parse_string(literal + ' or x{a="b"}') == (value, len(literal))


@given(st.text())
def test_escaped_values_hold_no_raw_newline_and_no_unescaped_quote(value: str) -> None:
    escaped = escape_label_value(value)
    assert "\n" not in escaped
    # Every quote is preceded by an odd number of backslashes.
    for m in re.finditer('"', escaped):
        run = len(escaped[: m.start()]) - len(escaped[: m.start()].rstrip("\\"))
        assert run % 2 == 1


@given(st.lists(st.tuples(st.sampled_from(["job", "pool", "pod", "_x1"]), st.sampled_from(["=", "!=", "=~", "!~"]),
                          st.text()), max_size=4))
def test_selectors_parse_back_to_their_matchers(matchers: list[tuple[str, str, str]]) -> None:
    text = selector(matchers)
    assert (parse_selector(text) if text else []) == matchers


@given(st.lists(st.text(min_size=1), min_size=1, max_size=4, unique=True), st.text())
def test_escaped_regex_alternatives_match_exactly_the_listed_values(values: list[str], other: str) -> None:
    pattern = "|".join(escape_regex(v) for v in values)
    assert all(re.fullmatch(pattern, v, flags=re.DOTALL) for v in values)
    assert bool(re.fullmatch(pattern, other, flags=re.DOTALL)) == (other in values)


def test_configured_label_names_are_validated() -> None:
    with pytest.raises(ValueError, match="label name"):
        Labels(pool="pool-name")
    with pytest.raises(ValueError, match="label name"):
        selector([('job"}', "=", "x")])
    with pytest.raises(ValueError, match="operator"):
        selector([("job", "==", "x")])
    with pytest.raises(ValueError, match="label name"):
        PrometheusSource(URL, client=FakeClient(lambda q: []), selector={"bad label": "x"})
    assert Labels(pod="instance").engine_grouping() == ("pool", "instance", "engine", "job")


def test_shorten_keeps_short_queries_and_notes_the_length_of_long_ones() -> None:
    assert shorten("sum(\n  x)") == "sum( x)"
    long = "x" * 500
    assert shorten(long) == "x" * 199 + "… (500 chars)"


# --- query building -------------------------------------------------------------------------------

ENGINE = ("pool", "pod", "instance", "engine")
SEL = '{job="vllm"}'


def test_rate_mode_queries() -> None:
    w = Window(CounterMode.RATE, 15.0)
    assert build_query(SPECS["request_rate"], SEL, ENGINE, w) == (
        'sum by (pool, pod, instance, engine) (rate(vllm:request_success_total{job="vllm"}[15000ms]))'
    )
    assert build_query(SPECS["ttft_p95"], SEL, ("pool",), w) == (
        'histogram_quantile(0.95, sum by (pool, le) (increase(vllm:time_to_first_token_seconds_bucket{job="vllm"}[15000ms])))'
    )
    # A renamed family: each engine in the spelling it has, inside the aggregation (in a rolling upgrade a choice per
    # pool would drop every engine still on the other).
    assert build_query(SPECS["kv_cache_usage_max"], SEL, ("pool",), w) == (
        'max by (pool) ((vllm:kv_cache_usage_perc{job="vllm"}) or (vllm:gpu_cache_usage_perc{job="vllm"}))'
    )
    assert build_query(SPECS["spec_mean_acceptance_length"], "", ("pool",), w) == (
        "1 + (sum by (pool) (increase(vllm:spec_decode_num_accepted_tokens_total[15000ms]))"
        " / (sum by (pool) (increase(vllm:spec_decode_num_drafts_total[15000ms])) > 0))"
    )
    # TPOT's stand-in, the inter-token latency, is another metric, not a spelling: per pool, outside the aggregation
    # (mixed in, old engines' per-token observations would outnumber the new ones' per-request ones); its own two
    # spellings inside.
    # Per pool where every engine has the signal's own histogram: midway through an upgrade the pool reads what all
    # of its engines have, as the scraper merges them.
    tpot = build_query(SPECS["tpot_p95"], "", ("pool",), w)
    engine = "pool, pod, instance, engine, job"
    per_request = f"group by ({engine}) ((vllm:request_time_per_output_token_seconds_count))"
    per_token = (f"group by ({engine}) ((vllm:inter_token_latency_seconds_count) or "
                 "(vllm:time_per_output_token_seconds_count))")
    assert tpot == ("((histogram_quantile(0.95, sum by (pool, le) (increase("
                    "vllm:request_time_per_output_token_seconds_bucket[15000ms])))) unless on (pool) "
                    f"count by (pool) ({per_token} unless on ({engine}) {per_request})) or "
                    "(histogram_quantile(0.95, sum by (pool, le) ((increase(vllm:inter_token_latency_seconds_bucket"
                    "[15000ms])) or (increase(vllm:time_per_output_token_seconds_bucket[15000ms])))))")
    assert "unless" not in build_query(SPECS["tpot_p95"], "", Labels().engine_grouping(), w), "an engine has it or not"
    # Each side of a ratio, likewise.
    hit = build_query(SPECS["prefix_cache_hit_rate"], "", ("pool",), w)
    assert hit == ("sum by (pool) ((increase(vllm:prefix_cache_hits_total[15000ms])) or "
                   "(increase(vllm:gpu_prefix_cache_hits_total[15000ms]))) / (sum by (pool) "
                   "((increase(vllm:prefix_cache_queries_total[15000ms])) or "
                   "(increase(vllm:gpu_prefix_cache_queries_total[15000ms]))) > 0)")
    # Engines (one series each, per data-parallel rank) and the pods they run in, as the scraper counts them.
    assert build_query(SPECS["engines_reporting"], SEL, ("pool",), w) == (
        'count by (pool) (vllm:num_requests_running{job="vllm"})')
    assert build_query(SPECS["pods_reporting"], SEL, (), w, ("pod", "instance")) == (
        'count by () (count by (pod, instance) (vllm:num_requests_running{job="vllm"}))')
    assert SPECS["engines_reporting"].pools_only and SPECS["pods_reporting"].pools_only


def test_delta_mode_is_a_two_point_difference_with_resets() -> None:
    w = Window(CounterMode.DELTA, 2.5)
    x = 'vllm:prompt_tokens_total{job="vllm"}'
    d = f"({x} - {x} offset 2500ms)"
    # Divided by the time between the two samples read, which after a gap in Prometheus' samples is not the window.
    elapsed = f"(timestamp({x}) - timestamp({x} offset 2500ms))"
    assert build_query(SPECS["prompt_tokens_rate"], SEL, ("pool",), w) == (
        f"sum by (pool) (((({d} >= 0) or ({x} and ({d} < 0))) / ({elapsed} > 0)))"
    )
    quantile = build_query(SPECS["ttft_p50"], SEL, (), w)
    assert quantile.startswith("histogram_quantile(0.5, sum by (le) ((((vllm:time_to_first_token_seconds_bucket{")
    assert "offset 2500ms" in quantile


def test_configured_values_are_escaped_in_every_query() -> None:
    seen: list[str] = []
    source = PrometheusSource(URL, client=FakeClient(lambda q: seen.append(q) or []), selector={"job": 'v"llm\n'})
    source.signals(100.0, 15.0, pools={'pod"1': 'po\\ol'})
    assert seen
    for q in seen:
        assert "\n" not in q
        for m in re.finditer(r'job="', q):
            assert parse_string(q, m.end() - 1)[0] == 'v"llm\n'
    mapped = [q for q in seen if "pod=~" in q]
    assert mapped and all(parse_string(q, q.index("pod=~") + 5)[0] == 'pod"1' for q in mapped)


# --- canned answers -------------------------------------------------------------------------------


class FakeClient:
    """Stands in for PrometheusConnect: answers `custom_query` from a function of the query."""

    def __init__(self, answer: Callable[[str], Any]) -> None:
        self.answer = answer
        self.params: list[dict[str, Any]] = []
        self.queries: list[str] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> Any:
        self.params.append(params or {})
        self.queries.append(query)
        return self.answer(query)

    def close(self) -> None:
        pass


def _row(value: float | str, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [100.0, str(value)]}


def _engines(query: str, by: str = "pool, pod, instance, engine") -> bool:
    """Whether a query is of the engine scope: its outermost aggregation, the first, is by engine (a pool's may count
    its engines inside)."""
    return f"by ({by}" in query and query.index(f"by ({by}") == query.index("by (")


def _answer(query: str) -> list[dict[str, Any]]:
    """A fleet of two labelled engines and one without a pool label; no speculative decoding."""
    if query.startswith("count("):
        return [] if "spec_decode" in query else [_row(1)]
    if "spec_decode" in query:
        return []
    if _engines(query):
        nan_for_b = "histogram_quantile" in query
        return [
            _row(2.0, pool="prefill", pod="p-0", instance="10.0.0.1:8000", engine="0"),
            _row("NaN" if nan_for_b else 3.0, pool="prefill", pod="p-0", instance="10.0.0.1:8000", engine="1"),
            _row(4.0, pod="orphan", instance="10.0.0.9:8000", engine="0"),
        ]
    if "by (pool" in query:
        return [_row(5.0, pool="prefill")]
    return []


def test_signals_from_canned_results() -> None:
    client = FakeClient(_answer)
    out = PrometheusSource(URL, client=client).signals(1234.5, 30.0)
    assert {p["time"] for p in client.params} == {"1234.500"}
    by_key = {(s.subject, s.name): s for s in out.signals}
    assert by_key[("engine/prefill/p-0/0", "request_rate")] == Signal(1234.5, "engine/prefill/p-0/0", "request_rate", 2.0)
    assert by_key[("engine/prefill/p-0/1", "request_rate")].value == 3.0
    assert ("engine/prefill/p-0/1", "ttft_p95") not in by_key  # NaN: no observations in the window
    assert by_key[("pool/prefill", "ttft_p95")].value == 5.0
    spec_decode = {"spec_acceptance_rate", "spec_mean_acceptance_length", "spec_yield"}
    assert {name for _, name in by_key} == {spec.name for spec in SIGNALS} - spec_decode
    assert [(m.signal, m.scope) for m in out.missing] == [("spec_acceptance_rate", "engine"),
                                                          ("spec_mean_acceptance_length", "engine"),
                                                          ("spec_yield", "engine")]
    assert "spec_decode_num_accepted_tokens_total" in out.missing[0].query
    assert out.unattributed == ["orphan: no pool label and not in the pool mapping"] and out.doubtful == {}
    assert not any(s.subject.startswith("engine/") and "orphan" in s.subject for s in out.signals)


def test_a_pool_mapping_attributes_series_without_a_pool_label() -> None:
    out = PrometheusSource(URL, client=FakeClient(_answer)).signals(1.0, 30.0, pools={"orphan": "decode"})
    subjects = {s.subject for s in out.signals}
    assert "engine/decode/orphan/0" in subjects and out.unattributed == []


def test_a_family_present_without_data_is_not_missing() -> None:
    # An idle fleet: the counters exist, the ratios have nothing to divide.
    def answer(q: str) -> list[dict[str, Any]]:
        return [_row(1)] if q.startswith("count(") else []

    out = PrometheusSource(URL, client=FakeClient(answer)).signals(1.0, 30.0)
    assert out.signals == [] and out.missing == []


def test_an_engine_seen_on_two_instances_is_kept_once() -> None:
    def answer(q: str) -> list[dict[str, Any]]:
        if not _engines(q):
            return [_row(1)] if q.startswith("count(") else []
        same = {"pool": "a", "pod": "p", "engine": "0"}
        return [_row(1.0, instance="h1:1", **same), _row(2.0, instance="h2:1", **same)]

    out = PrometheusSource(URL, client=FakeClient(answer)).signals(1.0, 30.0)
    assert {s.value for s in out.signals if s.name == "request_rate"} == {1.0}
    assert out.unattributed == ["engine/a/p/0: served by both h1:1 and h2:1; kept h1:1"]
    assert "the pool's sums count it twice" in out.doubtful["a"]


def test_an_engine_two_jobs_scrape_is_kept_once_and_its_pools_sums_are_doubtful() -> None:
    """A ServiceMonitor and a PodMonitor on the same engine: the pool's sums count its requests twice."""
    def answer(q: str) -> list[dict[str, Any]]:
        if not _engines(q, "pool, pod, instance, engine, job"):
            return [_row(1)] if q.startswith("count(") else []
        same = {"pool": "a", "pod": "p", "engine": "0", "instance": "10.0.0.1:8000"}
        return [_row(10.0, job="vllm-service", **same), _row(10.0, job="vllm-pods", **same)]

    out = PrometheusSource(URL, client=FakeClient(answer)).signals(1.0, 30.0)
    assert [s.value for s in out.signals if s.name == "request_rate"] == [10.0]
    assert out.unattributed == ["engine/a/p/0: served by both 10.0.0.1:8000/vllm-service and 10.0.0.1:8000/vllm-pods; "
                                "kept 10.0.0.1:8000/vllm-service"]
    assert "the pool's sums count it twice" in out.doubtful["a"]


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrometheusSource(URL, client=FakeClient(_answer)).signals(1.0, 0.0)


def test_discover_targets_from_series_labels(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    def answer(q: str) -> list[dict[str, Any]]:
        seen.append(q)
        return [
            _row(1, instance="10.0.0.2:8000", pod="d-0", pool="decode"),
            _row(1, instance="10.0.0.1:8000", pod="p-0", pool="prefill"),
            _row(1, instance="10.0.0.1:8000", pod="p-0", pool="prefill"),
            _row(1, instance="10.0.0.3:8000"),
            _row(1, instance="10.0.0.4:8000", pod="x-0"),
        ]

    source = PrometheusSource(URL, client=FakeClient(answer), selector={"job": "vllm"})
    with caplog.at_level(logging.WARNING):
        found = source.discover_targets(50.0, pools={"x-0": "decode"}, roles={"prefill": Role.PREFILL}, include_down=True)
    assert seen == ['group by (instance, pod, pool) (vllm:num_requests_running{job="vllm"})'
                    ' or group by (instance, pod, pool) (up{job="vllm"} == 0)']
    assert found == [
        Target("http://10.0.0.2:8000/metrics", "decode", "d-0", Role.UNIFIED),
        Target("http://10.0.0.4:8000/metrics", "decode", "x-0", Role.UNIFIED),
        Target("http://10.0.0.1:8000/metrics", "prefill", "p-0", Role.PREFILL),
    ]
    assert "10.0.0.3:8000 has no pool label" in caplog.text
    with pytest.raises(ValueError, match="metric name"):
        source.discover_targets(50.0, metric='up{job="x"}')


# --- errors, through the real client library ----------------------------------------------------------


class CannedAdapter(BaseAdapter):
    """A requests transport that answers from a function of the PromQL query, or raises."""

    def __init__(self, respond: Callable[[str], tuple[int, str | bytes] | BaseException]) -> None:
        super().__init__()
        self.respond = respond

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        query = parse_qs(urlparse(request.url or "").query).get("query", [""])[0]
        answer = self.respond(query)
        if isinstance(answer, BaseException):
            raise answer
        status, body = answer
        resp = requests.Response()
        resp.status_code = status
        resp._content = body.encode() if isinstance(body, str) else body
        resp.headers["Content-Type"] = "application/json"
        resp.url = request.url or ""
        resp.request = request
        return resp

    def close(self) -> None:
        pass


def canned(respond: Callable[[str], tuple[int, str | bytes] | BaseException]) -> PrometheusSource:
    session = requests.Session()
    client = PrometheusConnect(URL, session=session)
    session.mount(URL, CannedAdapter(respond))  # replaces the retrying adapter the client mounted
    return PrometheusSource(URL, client=client)


def _ok(result: list[dict[str, Any]]) -> tuple[int, str]:
    return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


def test_a_vector_answer_is_parsed() -> None:
    source = canned(lambda q: _ok([_row("+Inf", pool="a"), _row("0.25", pool="b")]))
    assert source.query("x", 1.0) == [({"pool": "a"}, math.inf), ({"pool": "b"}, 0.25)]


LONG_QUERY = "sum by (pool) (rate(vllm:request_success_total[15000ms])) " * 10


@pytest.mark.parametrize(
    ("answer", "error", "status", "text"),
    [
        ((400, '{"status":"error","errorType":"bad_data","error":"1:5: parse error: unexpected \\"}\\""}'),
         QueryFailed, 400, 'answered HTTP 400: 1:5: parse error: unexpected "}"; query: '),
        ((422, '{"status":"error","errorType":"execution","error":"many-to-many matching not allowed"}'),
         QueryFailed, 422, "many-to-many matching"),
        ((503, "service unavailable"), PrometheusUnavailable, 503, "HTTP 503"),
        ((429, "slow down"), PrometheusUnavailable, 429, "HTTP 429"),
        ((200, "<html>proxy login</html>"), QueryFailed, None, "not JSON"),
        ((200, ""), QueryFailed, None, "not JSON"),
        ((200, '{"status":"success"}'), QueryFailed, None, "without data.result"),
        ((200, '{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1]}]}}'),
         QueryFailed, None, "malformed vector sample"),
        ((200, '{"status":"success","data":{"resultType":"scalar","result":[1, "2"]}}'),
         QueryFailed, None, "malformed vector sample"),
        (requests.ConnectTimeout("connect timed out"), PrometheusUnavailable, None, "ConnectTimeout"),
        (requests.ConnectionError("Connection refused"), PrometheusUnavailable, None, "unreachable"),
    ],
)
def test_api_failures_become_our_errors(answer: Any, error: type[Exception], status: int | None, text: str) -> None:
    source = canned(lambda q: answer)
    with pytest.raises(error) as caught:
        source.query(LONG_QUERY, 1.0)
    exc = caught.value
    assert text in str(exc)
    assert getattr(exc, "status", None) == status
    assert getattr(exc, "query", "").endswith(f"({len(' '.join(LONG_QUERY.split()))} chars)")
    assert len(getattr(exc, "query", "")) < 230


@pytest.mark.parametrize("answered", [0, 1])
def test_signals_raise_once_prometheus_stops_answering(answered: int) -> None:
    asked: list[str] = []

    def down(query: str) -> tuple[int, str]:
        asked.append(query)
        return _ok(_answer(query)) if len(asked) <= answered else (503, "down")

    with pytest.raises(PrometheusUnavailable):
        canned(down).signals(1.0, 15.0)
    assert len(asked) == answered + FAIL_FAST, "a Prometheus that is down or hangs is not asked every query"


def test_a_query_prometheus_refuses_loses_only_its_own_signal() -> None:
    # A query over too many samples is refused (422) while the others answer: the tick keeps their signals.
    def answer(query: str) -> tuple[int, str]:
        if query.startswith("histogram_quantile(0.95, sum by (pool, le)") and "time_to_first_token" in query:
            return 422, json.dumps({"status": "error", "errorType": "execution",
                                    "error": "query processing would load too many samples into memory"})
        return _ok(_answer(query))

    out = canned(answer).signals(1.0, 15.0)
    assert [(f.signal, f.scope) for f in out.failed] == [("ttft_p95", "pool")]
    assert "too many samples" in out.failed[0].problem
    names = {(s.subject, s.name) for s in out.signals}
    assert ("pool/prefill", "request_rate") in names and ("pool/prefill", "ttft_p95") not in names
    assert ("engine/prefill/p-0/0", "ttft_p95") in names


def test_connection_refused_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        source = PrometheusSource(f"http://127.0.0.1:{port}", retries=0, timeout=2.0)
        with pytest.raises(PrometheusUnavailable, match="unreachable"):
            source.query("up", 1.0)
        source.close()


def test_a_pool_both_labelled_and_mapped_keeps_the_labelled_aggregate() -> None:
    def answer(q: str) -> list[dict[str, Any]]:
        if q.startswith("count("):
            return [_row(1)]
        if 'pool=""' in q:  # the mapped pods of pool "prefill"
            return [_row(9.0)]
        return [_row(5.0, pool="prefill")] if 'pool!=""' in q else []

    out = PrometheusSource(URL, client=FakeClient(answer)).signals(1.0, 30.0, pools={"p-9": "prefill"})
    assert {s.value for s in out.signals if s.subject == "pool/prefill"} == {5.0}
    assert out.unattributed == ["pool/prefill: some series carry the pool label and some are only mapped; kept the labelled"]
    assert "lacks the mapped pods" in out.doubtful["prefill"]


def test_a_pool_with_objectives_gets_its_share_of_requests_over_them() -> None:
    """From the pool's bucket increases: exact where the objective sits on a bound; the first spelling of the
    histogram that has series; none for pools without an objective."""
    queries: list[str] = []

    def answer(query: str) -> list[dict[str, Any]]:
        queries.append(query)
        if "_bucket" in query and "sum by (pool, le)" in query and "histogram_quantile" not in query:
            if "request_time_per_output_token" in query:
                return []  # an older engine: TPOT falls back to the inter-token latency
            return [_row(v, pool=pool, le=le) for pool in ("prefill", "decode")
                    for le, v in (("0.01", 90.0), ("0.025", 97.0), ("+Inf", 100.0))]
        return _answer(query)

    out = PrometheusSource(URL, client=FakeClient(answer)).signals(
        1.0, 30.0, objectives={"prefill": Objectives(ttft=0.025, tpot=0.01), "decode": Objectives(tpot=None)})
    over = {(s.subject, s.name): s.value for s in out.signals if s.name.endswith("_over_slo")}
    assert over == {("pool/prefill", "ttft_over_slo"): pytest.approx(0.03),
                    ("pool/prefill", "tpot_over_slo"): pytest.approx(0.10)}
    assert any("inter_token_latency_seconds_bucket" in q and "sum by (pool, le)" in q for q in queries)
    plain = PrometheusSource(URL, client=FakeClient(answer)).signals(1.0, 30.0)
    assert not any(s.name.endswith("_over_slo") for s in plain.signals)


def test_each_pool_reads_its_share_from_the_histogram_spelling_it_has() -> None:
    """Pools on different engine versions: one exports the TPOT histogram, the other only the inter-token latency;
    each pool's share comes from its own, never from the two mixed."""

    def answer(query: str) -> list[dict[str, Any]]:
        if "_bucket" in query and "sum by (pool, le)" in query and "histogram_quantile" not in query:
            if "request_time_per_output_token" in query:
                return [_row(v, pool="new", le=le) for le, v in (("0.01", 90.0), ("+Inf", 100.0))]
            if "inter_token_latency" in query:
                return [_row(v, pool=pool, le=le) for pool in ("new", "old")
                        for le, v in (("0.01", 50.0), ("0.02", 80.0), ("+Inf", 100.0))]
            return []
        return _answer(query)

    client = FakeClient(answer)
    out = PrometheusSource(URL, client=client).signals(
        1.0, 30.0, objectives={"new": Objectives(tpot=0.01), "old": Objectives(tpot=0.01)})
    over = {s.subject: s.value for s in out.signals if s.name == "tpot_over_slo"}
    assert over == {"pool/new": pytest.approx(0.10), "pool/old": pytest.approx(0.50)}
    # A pool midway through an upgrade reads the inter-token latency: the per-request buckets are asked only of the
    # pools none of whose engines lacks them (checked against a real Prometheus in tests/real).
    [per_request] = [q for q in client.queries if "request_time_per_output_token_seconds_bucket" in q
                     and "histogram_quantile" not in q]
    assert per_request.endswith(" unless on (pool) count by (pool) (group by (pool, pod, instance, engine, job) "
                                "((vllm:inter_token_latency_seconds_count{pool!=\"\"}) or "
                                "(vllm:time_per_output_token_seconds_count{pool!=\"\"})) unless on (pool, pod, "
                                "instance, engine, job) group by (pool, pod, instance, engine, job) "
                                "((vllm:request_time_per_output_token_seconds_count{pool!=\"\"})))")


def ttft_buckets_of(second: str) -> Callable[[str], list[dict[str, Any]]]:
    """Pool a's TTFT buckets (10 % over 0.5 s) and pool `second`'s, whose 0.5 s bound reads `le="half"`."""
    def answer(query: str) -> list[dict[str, Any]]:
        if "_bucket" in query and "sum by (pool, le)" in query and "histogram_quantile" not in query:
            if "time_to_first_token" not in query:
                return []
            return [_row(90.0, pool="a", le="0.5"), _row(100.0, pool="a", le="+Inf"),
                    _row(90.0, pool=second, le="half"), _row(100.0, pool=second, le="+Inf")]
        return _answer(query)

    return answer


def test_a_bucket_bound_that_is_no_number_loses_that_pools_share_only() -> None:
    out = PrometheusSource(URL, client=FakeClient(ttft_buckets_of("b"))).signals(
        1.0, 30.0, objectives={"a": Objectives(ttft=0.5), "b": Objectives(ttft=0.5)})
    assert {s.subject: s.value for s in out.signals if s.name == "ttft_over_slo"} == {"pool/a": pytest.approx(0.10)}
    [bad] = out.malformed
    assert (bad.signal, bad.scope) == ("ttft_over_slo", "pool/b")
    assert "le='half'" in bad.problem and "vllm:time_to_first_token_seconds" in bad.problem


def test_targets_prometheus_failed_to_scrape_are_named_with_their_pools() -> None:
    def answer(query: str) -> list[dict[str, Any]]:
        if query.startswith("group by (instance, pod, pool) ((last_over_time(up") and "count_over_time(vllm:" in query:
            return [_row(1, instance="10.0.0.2:8000", pod="p-1", pool="prefill"),
                    _row(1, instance="10.0.0.3:8000", pod="d-0"),  # mapped
                    _row(1, instance="10.0.0.4:9400", pod="dcgm-x")]  # no pool's
        return _answer(query)

    out = PrometheusSource(URL, client=FakeClient(answer)).signals(1.0, 30.0, pools={"d-0": "decode"})
    assert [(d.pool, d.instance) for d in out.down] == [("decode", "10.0.0.3:8000"), ("prefill", "10.0.0.2:8000")]
    assert PrometheusSource(URL, client=FakeClient(_answer)).signals(1.0, 30.0).down == []


def test_a_sum_that_is_no_number_is_malformed_not_dropped_but_an_empty_ratio_is_no_reading() -> None:
    # One engine of pool prefill exposes NaN requests waiting: PromQL's sum is NaN. Dropped, the pool's last value
    # would stand for now's.
    def answer(query: str) -> list[dict[str, Any]]:
        if "num_requests_waiting" in query and "by (pool)" in query:
            return [_row("NaN", pool="prefill")]
        return _answer(query)

    out = PrometheusSource(URL, client=FakeClient(answer)).signals(1.0, 30.0)
    [bad] = out.malformed
    assert (bad.signal, bad.scope) == ("requests_waiting", "pool/prefill") and "the sum is nan" in bad.problem
    assert ("pool/prefill", "requests_waiting") not in {(s.subject, s.name) for s in out.signals}
    # The engine scope's NaN TTFT quantile of `_answer` is no observations, not malformed.
    assert not any(m.signal == "ttft_p95" for m in out.malformed)


def test_a_pool_without_an_objective_is_not_read_for_a_share() -> None:
    # Pool c has no TTFT objective: its buckets, bad bound and all, are none of the share's business.
    out = PrometheusSource(URL, client=FakeClient(ttft_buckets_of("c"))).signals(
        1.0, 30.0, objectives={"a": Objectives(ttft=0.5)})
    assert {s.subject: s.value for s in out.signals if s.name == "ttft_over_slo"} == {"pool/a": pytest.approx(0.10)}
    assert out.malformed == []
