"""The exposition parser: agreement with prometheus_client, escapes, special values, errors.

Covers: recorded fixtures (vLLM from the simulator, dcgm-exporter, NIXL), hypothesis-generated
expositions compared sample by sample with prometheus_client, and malformed lines.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.parse import identical, reference_samples
from collectors.exposition import ExpositionError, Parser, parse
from controlplane.demo import demo_fleet
from controlplane.sim.exporters import render_dcgm, render_nixl, render_vllm
from tests.conftest import FIXTURES as FIXTURE_DIR

FIXTURES = sorted(FIXTURE_DIR.glob("*.txt"))


# The reference with its one documented difference, and the comparison, are the benchmark's own.
reference = reference_samples
same = identical


def ours(text: str) -> list[tuple[str, dict[str, str], float, float | None]]:
    return [(s.name, s.labels, s.value, s.timestamp) for s in parse(text)]


def test_recorded_fixtures_are_present() -> None:
    assert len(FIXTURES) >= 3, f"the shipped fixtures under {FIXTURE_DIR} are missing"


@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_recorded_fixtures_parse_like_prometheus_client(path: Path) -> None:
    text = path.read_text()
    assert same(ours(text), reference(text))


def test_simulated_vllm_exposition_parses_like_prometheus_client() -> None:
    fleet = demo_fleet(now=1000.0)
    fleet.advance_to(1060.0)
    prefill, decode = fleet.members["prefill"][0], fleet.members["decode"][0]
    text = render_vllm(prefill, "m").decode()
    assert "vllm:prefix_cache_hits_total" in text
    assert same(ours(text), reference(text))
    for body in (render_vllm(decode, "m"), render_dcgm(decode), render_nixl(decode)):
        assert same(ours(body.decode()), reference(body.decode()))


def test_escapes_special_values_and_timestamps() -> None:
    text = (
        '# HELP m a metric\n# TYPE m gauge\n'
        'm{path="a\\\\b",quote="say \\"hi\\"",nl="x\\ny"} 1.5 1700000000000\n'
        "m{k=\"}\"} NaN\n"
        'm{k="inf"} +Inf\n'
        'm{k="neg"} -Inf\n'
        'm{k="sci"} 1e-3\n'
    )
    got = list(parse(text))
    assert got[0].labels == {"path": "a\\b", "quote": 'say "hi"', "nl": "x\ny"}
    assert got[0].timestamp == 1_700_000_000.0
    assert got[1].labels == {"k": "}"} and math.isnan(got[1].value)
    assert got[2].value == math.inf and got[3].value == -math.inf
    assert got[4].value == 0.001


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        pytest.param("m{a=b} 1", "not quoted", id="unquoted-label"),
        pytest.param('m{a="b} 1', "not terminated", id="unterminated-value"),
        pytest.param("m", "no value", id="no-value"),
        pytest.param("m abc", "not a number", id="bad-value"),
        pytest.param("m 1 12.5", "timestamp", id="float-timestamp"),
        pytest.param('m{a="1",a="2"} 1', "duplicate label", id="duplicate-label"),
        pytest.param("<html> 1", "invalid metric name", id="html"),
        pytest.param("ok 3", "already given in this exposition", id="duplicate-series"),
        pytest.param('m{a="1"b="2"} 1', "expected ',' or '}' after a label", id="labels-without-a-comma"),
        pytest.param('m_bucket{le="NaN"} 1', "bucket bound le='NaN' is not a number", id="nan-bucket-bound"),
    ],
)
def test_malformed_lines_name_line_and_problem(line: str, problem: str) -> None:
    text = f"ok 1\n{line}\nalso_ok 2\n"
    with pytest.raises(ExpositionError, match=f"line 2: .*{problem}"):
        list(parse(text))
    errors: list[ExpositionError] = []
    survivors = list(parse(text, errors=errors))
    assert [s.value for s in survivors] == [1.0, 2.0]
    assert len(errors) == 1 and errors[0].line_no == 2


label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(lambda n: not n.startswith("__"))
label_values = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
values = st.one_of(st.floats(allow_nan=False, width=64), st.just(math.nan), st.integers(-10**9, 10**9).map(float))


def _fmt_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def expositions(draw: st.DrawFn) -> str:
    lines = []
    for i in range(draw(st.integers(1, 6))):
        name = f"fam_{i}"
        lines.append(f"# TYPE {name} gauge")
        seen: set[tuple] = set()
        for _ in range(draw(st.integers(1, 4))):
            labels = draw(st.dictionaries(label_names, label_values, max_size=4))
            key = tuple(sorted(labels.items()))
            if key in seen:
                continue
            seen.add(key)
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            ts = draw(st.one_of(st.none(), st.integers(0, 2**41)))
            line = f"{name}{{{body}}} {_fmt_value(draw(values))}" if labels else f"{name} {_fmt_value(draw(values))}"
            lines.append(line + (f" {ts}" if ts is not None else ""))
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(expositions())
def test_generated_expositions_match_prometheus_client(text: str) -> None:
    assert same(ours(text), reference(text))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_crashes_in_lenient_mode(text: str) -> None:
    errors: list[ExpositionError] = []
    for s in parse(text, errors=errors):
        assert isinstance(s.value, float)


def om_reference(text: str) -> list[tuple[str, dict[str, str], float, float | None]]:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

    out = []
    for family in om_families(text):
        for s in family.samples:
            ts = None if s.timestamp is None else float(s.timestamp)
            out.append((s.name, dict(s.labels), s.value, ts))
    return out


@st.composite
def openmetrics(draw: st.DrawFn) -> str:
    lines = []
    for i in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["gauge", "counter"]))
        name = f"om_{i}"
        lines.append(f"# HELP {name} family {i}")
        lines.append(f"# TYPE {name} {kind}")
        seen: set[tuple] = set()
        for _ in range(draw(st.integers(1, 3))):
            labels = draw(st.dictionaries(label_names, label_values, max_size=3))
            key = tuple(sorted(labels.items()))
            if key in seen:
                continue
            seen.add(key)
            body = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""
            value = draw(st.floats(min_value=0, max_value=1e12, allow_nan=False))
            ts = draw(st.one_of(st.none(), st.integers(0, 2**31).map(lambda t: f"{t}.5")))
            sample = f"{name}_total{body} {value!r}" if kind == "counter" else f"{name}{body} {value!r}"
            if ts is not None:
                sample += f" {ts}"
            if kind == "counter" and draw(st.booleans()):
                sample += ' # {trace_id="abc"} 1.0'
            lines.append(sample)
            if kind == "counter" and draw(st.booleans()):
                # OpenMetrics: within a group, all samples have a timestamp or none does.
                lines.append(f"{name}_created{body} 1700000000.0" + (f" {ts}" if ts is not None else ""))
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


@settings(max_examples=200, deadline=None)
@given(openmetrics())
def test_generated_openmetrics_match_prometheus_client(text: str) -> None:
    assert same(ours(text), om_reference(text))


def test_openmetrics_exemplars_eof_and_float_timestamps() -> None:
    text = (
        "# TYPE req counter\n# UNIT req requests\n"
        'req_total{path="/"} 7 1700000000.250 # {trace_id="t1"} 1.0 1700000000.1\n'
        'req_created{path="/"} 1600000000\n# EOF\n'
    )
    got = list(parse(text))
    assert [(s.name, s.value, s.timestamp) for s in got] == [("req_total", 7.0, 1_700_000_000.25),
                                                             ("req_created", 1_600_000_000.0, None)]
    errors: list[ExpositionError] = []
    list(parse(text + "late 1\n", errors=errors, openmetrics=True))
    assert errors and "after '# EOF'" in str(errors[0])


def test_series_cache_gives_identical_samples_on_repeat_scrapes() -> None:
    from collectors.exposition import Parser

    fleet = demo_fleet(now=1000.0)
    parser = Parser()
    for t in (1060.0, 1120.0, 1180.0):
        fleet.advance_to(t)
        text = render_vllm(fleet.members["decode"][0], "m").decode()
        assert list(parser.parse(text)) == list(parse(text))


def test_cache_never_confuses_a_brace_inside_a_label_value() -> None:
    from collectors.exposition import Parser

    parser = Parser()
    text = 'm{a="x"} 1\nm{a="x} y"} 2\nm{re="a} b",z="1"} 3\n'
    for _ in range(2):
        got = [(s.labels, s.value) for s in parser.parse(text)]
        assert got == [({"a": "x"}, 1.0), ({"a": "x} y"}, 2.0), ({"re": "a} b", "z": "1"}, 3.0)]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("vllm:num_requests_running{engine=\"0\",model_na", id="truncated-mid-label"),
        pytest.param("vllm:num_requests_running{engine=\"0\"} ", id="truncated-before-value"),
        pytest.param("<!DOCTYPE html><html><body>Login</body></html>", id="html"),
        pytest.param("m{" + ",".join(f'l{i}="{i}"' for i in range(2000)) + "} 1", id="huge-label-set"),
        pytest.param("m 1\nm 2\n", id="duplicate-series"),
    ],
)
def test_bad_bodies_are_recorded_not_fatal(body: str) -> None:
    errors: list[ExpositionError] = []
    samples = list(parse("ok 1\n" + body + "\nalso_ok 2\n", errors=errors))
    assert samples[0].name == "ok" and samples[-1].name == "also_ok"
    # Either a line of the body is rejected with its number, or it is a valid (if odd) sample.
    assert all(2 <= e.line_no <= 1 + len(body.splitlines()) for e in errors)
    if body == "m 1\nm 2\n":  # the second is refused, the first kept
        assert [e.line_no for e in errors] == [3] and [s.value for s in samples if s.name == "m"] == [1.0]


@pytest.mark.parametrize("text", ["foo 1\n   \nbar 2\n# EOF\n", "foo 1\r\n\r\nbar 2\r\n# EOF\r\n"])
def test_a_blank_line_in_openmetrics_is_an_error_of_its_line(text: str) -> None:
    errors: list[ExpositionError] = []
    assert [(s.name, s.value) for s in parse(text, errors=errors)] == [("foo", 1.0), ("bar", 2.0)]
    [error] = errors
    assert error.line_no == 2 and "only whitespace" in str(error)


def test_the_same_series_with_its_labels_in_another_order_is_a_duplicate() -> None:
    errors: list[ExpositionError] = []
    parser = Parser()
    for _ in range(2):  # parsed, then read from the parser's cache of series texts
        errors.clear()
        text = 'm{a="1",b="2"} 1\nm{b="2",a="1"} 2\nm{a="1",b="3"} 3\n'
        assert [s.value for s in parser.parse(text, errors=errors)] == [1.0, 3.0]
        assert [e.line_no for e in errors] == [2] and "already given" in str(errors[0])


def test_a_malformed_line_does_not_block_a_good_one_of_the_same_series() -> None:
    errors: list[ExpositionError] = []
    assert [(s.name, s.value) for s in parse("ok 1x\nok 2\n", errors=errors)] == [("ok", 2.0)]
    assert [e.line_no for e in errors] == [1]
