"""Trace loaders: the first rows of the real files, windows and speed-up, and malformed inputs
reported with their file and line; ServeGen's generated arrivals are deterministic and follow the rates."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from controlplane.sim.traces import (
    Request,
    TraceError,
    load_azure,
    load_mooncake,
    load_servegen,
    load_trace,
    servegen_requests,
    trace_path,
)


def first(name: str, n: int = 3, **kw: float) -> list[Request]:
    return list(itertools.islice(load_trace(name, **kw), n))


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# real files ------------------------------------------------------------------------------------


def test_mooncake_conversation_first_rows() -> None:
    r = first("mooncake/conversation")
    assert r[0] == Request(0.0, 6758, 500, tuple(range(14)), 512, "", "conversation", 0)
    assert r[1].hash_ids[0] == 0 and r[1].hash_ids[1:] == tuple(range(14, 28))
    assert r[2].input_tokens == 7236 and r[2].output_tokens == 794 and r[2].index == 2


def test_mooncake_synthetic_first_row() -> None:
    (r,) = first("mooncake/synthetic", 1)
    assert (r.arrival_s, r.input_tokens, r.output_tokens, r.category) == (0.0, 40160, 6, "synthetic")
    assert r.hash_ids == tuple(range(79)) and r.block_tokens == 512


def test_azure_first_rows_keep_100ns_resolution() -> None:
    code = first("azure/code", 2)
    assert (code[0].input_tokens, code[0].output_tokens, code[0].category) == (4808, 10, "code")
    assert code[0].arrival_s == 0.0
    assert code[1].arrival_s == pytest.approx(0.052, abs=1e-7)  # 18:17:04.0319600 - 18:17:03.9799600
    conv = first("azure/conv", 2)
    assert (conv[0].input_tokens, conv[0].output_tokens, conv[0].category) == (374, 44, "conv")
    assert conv[1].arrival_s == pytest.approx(4.314579, abs=1e-7)
    assert conv[1].hash_ids == () and conv[1].block_tokens == 0


def test_window_and_speedup_select_and_rescale() -> None:
    whole = [r for r in load_trace("azure/code", duration_s=900) if 600 <= r.arrival_s < 660]
    window = list(load_trace("azure/code", start_s=600, duration_s=60, speedup=4))
    assert [r.index for r in window] == [r.index for r in whole]
    assert [r.arrival_s for r in window] == pytest.approx([(r.arrival_s - 600) / 4 for r in whole])
    assert all(0 <= r.arrival_s < 15 for r in window)


def test_mooncake_spread_keeps_order_and_count() -> None:
    path = trace_path("mooncake/conversation")
    plain = list(load_mooncake(path, duration_s=30))
    spread = list(load_mooncake(path, duration_s=30, spread_s=3.0))
    assert [r.index for r in spread] == [r.index for r in plain]
    times = [r.arrival_s for r in spread]
    assert times == sorted(times)
    assert len(set(times)) == len(times)  # no two requests share an instant any more
    assert all(s.arrival_s >= p.arrival_s for s, p in zip(spread, plain, strict=True))


@pytest.mark.parametrize("kw", [{"speedup": 0}, {"speedup": -1}, {"start_s": -1}, {"duration_s": 0}])
def test_bad_window_arguments(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        first("azure/conv", 1, **kw)


def test_unknown_trace_name() -> None:
    with pytest.raises(KeyError, match="known"):
        trace_path("mooncake/toolagent")


# malformed inputs -------------------------------------------------------------------------------

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param("{not json", "not valid JSON", id="json"),
        pytest.param("[1, 2]", "expected a JSON object", id="array"),
        pytest.param('{"timestamp": 5, "output_length": 5, "hash_ids": [1]}', "input_length must be an integer", id="missing"),
        pytest.param('{"timestamp": 5, "input_length": "9", "output_length": 5}', "input_length must be an integer", id="string"),
        pytest.param('{"timestamp": -1, "input_length": 9, "output_length": 5}', "timestamp must be", id="negative-time"),
        pytest.param('{"timestamp": 5, "input_length": 9, "output_length": -5}', "output_length must be >= 0", id="negative"),
        pytest.param('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "hash_ids has 1 blocks",
                     id="blocks"),
        pytest.param('{"timestamp": 5, "input_length": 9, "output_length": 5, "hash_ids": ["a"]}', "list of integers", id="ids"),
    ],
)
def test_mooncake_malformed_row_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, "t.jsonl", GOOD + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as err:
        list(load_mooncake(path))
    assert str(err.value).startswith(f"{path}:3: ")
    assert err.value.line == 3


def test_mooncake_time_going_back_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "t.jsonl", GOOD.replace('"timestamp": 0', '"timestamp": 9') + GOOD)
    with pytest.raises(TraceError, match=r"t.jsonl:2: timestamp 0 goes back in time"):
        list(load_mooncake(path))


def test_mooncake_without_hashes_and_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "x.jsonl", '\n{"timestamp": 1500, "input_length": 10, "output_length": 2}\n\n')
    assert list(load_mooncake(path)) == [Request(1.5, 10, 2, (), 0, "", "x", 0)]


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:17:03.9799600,4808,10\n"


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        pytest.param("time,in,out\n" + ROW, 1, "expected header", id="header"),
        pytest.param(HEADER + ROW + "2023-11-16 18:17:04,12\n", 3, "expected 3 columns", id="columns"),
        pytest.param(HEADER + ROW + "16/11/2023 18:17:04,1,2\n", 3, "is not 'YYYY-MM-DD", id="timestamp"),
        pytest.param(HEADER + ROW + "2023-11-16 18:17:04.1,x,2\n", 3, "ContextTokens must be an integer", id="tokens"),
        pytest.param(HEADER + ROW + "2023-11-16 18:17:04.1,5,-2\n", 3, "GeneratedTokens must be >= 0", id="negative"),
        pytest.param(HEADER + ROW + "2023-11-16 18:17:02.1,5,2\n", 3, "goes back in time", id="order"),
    ],
)
def test_azure_malformed_row_names_file_and_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = write(tmp_path, "AzureLLMInferenceTrace_code.csv", text)
    with pytest.raises(TraceError, match=message) as err:
        list(load_azure(path))
    assert str(err.value).startswith(f"{path}:{line}: ")


def test_azure_crosses_midnight(tmp_path: Path) -> None:
    path = write(tmp_path, "trace_conv.csv", HEADER + "2023-11-16 23:59:59.5,1,2\n2023-11-17 00:00:00.25,3,4\n")
    r = list(load_azure(path))
    assert r[1].arrival_s == pytest.approx(0.75) and r[1].category == "conv"


# ServeGen ----------------------------------------------------------------------------------------


def servegen_folder(tmp_path: Path, rows: dict[str, str]) -> Path:
    folder = tmp_path / "language" / "toy"
    folder.mkdir(parents=True)
    for client, text in rows.items():
        (folder / f"chunk-{client}-trace.csv").write_text(text, encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    ("row", "message"),
    [
        pytest.param("600,1,1,Gamma,1\n", "expected 6 columns", id="columns"),
        pytest.param("600,fast,1,Gamma,1,1\n", "rate must be a number", id="rate"),
        pytest.param("600,1,1,Lognormal,1,1\n", "iat_dist must be Gamma, Weibull or empty", id="dist"),
        pytest.param("600,-1,1,Gamma,1,1\n", "rate must be a finite number >= 0", id="negative"),
        pytest.param("600,1,1,Gamma,0,1\n", "needs shape > 0", id="shape"),
        pytest.param("0,1,1,Gamma,1,1\n", "is not after the previous window", id="order"),
    ],
)
def test_servegen_malformed_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    folder = servegen_folder(tmp_path, {"0": "0,0,0,,0,0\n" + row})
    with pytest.raises(TraceError, match=message) as err:
        load_servegen(folder)
    assert str(err.value).startswith(f"{folder / 'chunk-0-trace.csv'}:2: ")


def test_servegen_toy_rates_and_determinism(tmp_path: Path) -> None:
    folder = servegen_folder(tmp_path, {
        "0": "0,2,1,,0,0\n600,0,0,,0,0\n1200,4,2.0,Gamma,0.25,9\n",
        "1": "0,1,3,Weibull,0.5,7\n600,3,1,,0,0\n1200,0,0,,0,0\n",
    })
    model = load_servegen(folder)
    assert model.category == "language/toy"
    assert model.aggregate_rates() == [(0.0, 3.0), (600.0, 3.0), (1200.0, 4.0)]
    reqs = list(servegen_requests(model, seed=3, default_lengths=(100, 20)))
    assert reqs == list(servegen_requests(model, seed=3, default_lengths=(100, 20)))
    assert reqs != list(servegen_requests(model, seed=4, default_lengths=(100, 20)))
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 1800
    assert {(r.input_tokens, r.output_tokens) for r in reqs} == {(100, 20)}
    assert [r.index for r in reqs] == list(range(len(reqs)))
    per_window = np.histogram(times, bins=[0, 600, 1200, 1800])[0]
    assert per_window == pytest.approx([1800, 1800, 2400], rel=0.3)
    assert not any(r.client == "0" and 600 <= r.arrival_s < 1200 for r in reqs)  # idle window


def test_servegen_window_is_a_slice_of_the_whole(tmp_path: Path) -> None:
    folder = servegen_folder(tmp_path, {"7": "0,2,1,,0,0\n600,5,1.5,Gamma,0.44,1\n1200,1,1,,0,0\n"})
    model = load_servegen(folder)
    whole = [(r.arrival_s, r.client) for r in servegen_requests(model) if 900 <= r.arrival_s < 1500]
    part = [(r.arrival_s * 2 + 900, r.client) for r in servegen_requests(model, start_s=900, duration_s=600, speedup=2)]
    assert [c for _, c in part] == [c for _, c in whole]
    assert [t for t, _ in part] == pytest.approx([t for t, _ in whole])


@pytest.mark.slow
def test_servegen_deepseek_generates_the_published_rate_with_lengths() -> None:
    model = load_servegen("reason/deepseek-r1")
    assert len(model.clients) == 73 and len(model.window_starts()) == 144
    start, hours = 20 * 3600, 1
    reqs = list(servegen_requests(model, start_s=start, duration_s=hours * 3600, seed=1))
    expected = sum(r * 600 for s, r in model.aggregate_rates() if start <= s < start + hours * 3600)
    assert len(reqs) == pytest.approx(expected, rel=0.15)
    lengths = np.array([(r.input_tokens, r.output_tokens) for r in reqs])
    assert (lengths > 0).mean() > 0.99  # deepseek-r1 ships its length PMFs
    assert np.median(lengths[:, 1]) > 200  # reasoning outputs are long
    assert {r.category for r in reqs} == {"reason/deepseek-r1"}


@pytest.mark.slow
def test_servegen_language_model_reads_fourteen_days() -> None:
    model = load_servegen("language/m-large")
    assert len(model.clients) == 162
    starts = model.window_starts()
    assert (len(starts), starts[0], starts[-1]) == (2016, 0.0, 14 * 86400 - 600)
    reqs = list(itertools.islice(servegen_requests(model, start_s=72000, duration_s=60, default_lengths=(512, 128)), 500))
    assert len(reqs) == 500 and reqs[0].input_tokens == 512 and reqs[-1].arrival_s < 60
