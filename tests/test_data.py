"""The data the project ships, and bad data files as users meet them.

The manifest covers every shipped file and every checksum holds; a changed shipped file is
refused; missing, truncated, non-gzip and non-UTF-8 files name themselves. Through the CLI, a
missing, malformed or truncated scenario, trace or profile ends in one line naming the file and
exit code 3, never a traceback. Nothing in the project reads a folder beside the checkout.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import controlplane.data as data
from controlplane.data import DATA_DIR, MANIFEST, read_bytes, read_lines, read_text, shipped
from controlplane.errors import DataError
from controlplane.sim.scenario import load_scenario
from controlplane.sim.traces import TRACES, load_azure, read_trace, trace_format

ROOT = Path(__file__).resolve().parents[1]
AZURE_ROWS = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:15:{s:02d}.0000000,{100 + s},{10 + s}\n" for s in range(40))


def manifest() -> dict[str, str]:
    return {name: digest for digest, name in (line.split("  ", 1) for line in MANIFEST.read_text().splitlines())}


def test_manifest_lists_every_shipped_file_with_its_checksum() -> None:
    listed = manifest()
    on_disk = {p.relative_to(DATA_DIR).as_posix() for p in DATA_DIR.rglob("*")
               if p.is_file() and p.name not in ("SHA256SUMS", "NOTICE.md") and p.suffix not in (".py", ".pyc")}
    assert on_disk == set(listed)
    for name, digest in listed.items():
        assert hashlib.sha256((DATA_DIR / name).read_bytes()).hexdigest() == digest, name


def test_every_named_trace_and_the_notice_ship() -> None:
    for rel in TRACES.values():
        assert shipped(rel).is_file()
    notice = (DATA_DIR / "NOTICE.md").read_text()
    for source in ("AzurePublicDataset", "Mooncake", "ServeGen", "dynamo", "splitwise-sim", "integrations-core"):
        assert source in notice
    for license_ in ("CC-BY-4.0", "Apache-2.0", "MIT", "BSD-3-Clause"):
        assert license_ in notice


@pytest.fixture
def data_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The data folder's manifest and one trace copied aside, with the module pointed at the copy."""
    root = tmp_path / "data"
    rel = TRACES["azure/code"]
    (root / rel).parent.mkdir(parents=True)
    shutil.copy(DATA_DIR / rel, root / rel)
    shutil.copy(MANIFEST, root / "SHA256SUMS")
    monkeypatch.setattr(data, "DATA_DIR", root)
    monkeypatch.setattr(data, "MANIFEST", root / "SHA256SUMS")
    monkeypatch.setattr(data, "_manifest", None)
    monkeypatch.setattr(data, "_verified", {})
    return root


def test_a_changed_shipped_file_is_refused(data_copy: Path) -> None:
    path = data_copy / TRACES["azure/code"]
    assert read_bytes(path)  # intact: reads
    raw = gzip.decompress(path.read_bytes()).replace(b"4808", b"4809", 1)
    path.write_bytes(gzip.compress(raw))
    with pytest.raises(DataError, match=r"AzureLLMInferenceTrace_code.csv.gz: checksum mismatch"):
        read_bytes(path)
    extra = data_copy / "traces" / "extra.csv"
    extra.write_text("x\n")
    with pytest.raises(DataError, match="not in the shipped manifest"):
        read_text(extra)


def test_bad_files_name_themselves(tmp_path: Path) -> None:
    missing = tmp_path / "missing.csv.gz"
    with pytest.raises(DataError, match=r"missing.csv.gz: no such file"):
        read_bytes(missing)
    whole = gzip.compress(AZURE_ROWS.encode() * 200)
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"cut.csv.gz: truncated"):
        list(read_lines(cut))
    plain = tmp_path / "plain.csv.gz"
    plain.write_text(AZURE_ROWS)
    with pytest.raises(DataError, match=r"plain.csv.gz: not a gzip file"):
        read_text(plain)
    latin = tmp_path / "latin.csv"
    latin.write_bytes("TIMESTAMP,Context\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.csv: not UTF-8"):
        list(read_lines(latin))
    with pytest.raises(DataError, match="is a folder"):
        read_bytes(tmp_path)


def test_user_traces_in_every_format_plain_or_gzipd(tmp_path: Path) -> None:
    csv_gz = tmp_path / "mine.csv.gz"
    csv_gz.write_bytes(gzip.compress(AZURE_ROWS.encode()))
    csv_plain = tmp_path / "mine.csv"
    csv_plain.write_text(AZURE_ROWS)
    assert list(load_azure(csv_gz)) == list(load_azure(csv_plain))
    assert len(list(read_trace(csv_gz, trace_format(csv_gz), start_s=10, duration_s=10))) == 10
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 600, "output_length": 5,
                                         "hash_ids": [1, 2]}) + "\n" for i in range(5)))
    assert [r.hash_ids for r in read_trace(jsonl, trace_format(jsonl))] == [(1, 2)] * 5
    folder = tmp_path / "sg"
    folder.mkdir()
    (folder / "chunk-3-trace.csv.gz").write_bytes(gzip.compress(b"0,2,1,,0,0\n600,3,1,,0,0\n"))
    assert trace_format(folder) == "servegen"
    reqs = list(read_trace(folder, "servegen", duration_s=1200, default_lengths=(10, 5)))
    assert 2000 < len(reqs) < 4000 and {r.client for r in reqs} == {"3"}
    other = tmp_path / "mine.parquet"
    other.write_bytes(b"x")
    with pytest.raises(DataError, match="cannot tell the trace's format"):
        trace_format(other)


def test_scenario_traces_and_profiles_lie_beside_the_file(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "mine.csv").write_text(AZURE_ROWS)
    scenario = tmp_path / "mine.yaml"
    scenario.write_text(SCENARIO.format(trace="{path: traces/mine.csv}", profile=""))
    sc = load_scenario(str(scenario))
    assert sc.trace.source() == (tmp_path / "traces" / "mine.csv", "azure")
    sc.check()
    assert next(sc.requests()).input_tokens == 100


SCENARIO = """\
name: mine
trace: {trace}
duration: 1m
fleet:
  pools:
    - {{name: chat, role: unified, replicas: 1{profile}}}
"""


def fleetctl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, "COLUMNS": "200"})


def _dynamo_copy(folder: Path, *, truncate: bool = False) -> None:
    folder.mkdir()
    for name in ("prefill_raw_data.npz", "decode_raw_data.npz"):
        raw = (DATA_DIR / "perf" / "dynamo_h200_llama31_8b_fp8" / name).read_bytes()
        (folder / name).write_bytes(raw[: len(raw) // 3] if truncate and name.startswith("decode") else raw)


@pytest.mark.slow
def test_bad_scenarios_traces_and_profiles_through_the_cli(tmp_path: Path) -> None:
    def scenario(name: str, trace: str, profile: str = "") -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(SCENARIO.format(trace=trace, profile=profile))
        return str(path)

    (tmp_path / "good.csv").write_text(AZURE_ROWS)
    many = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{i / 100:011.8f},{100 + i % 900},{10 + i % 50}\n" for i in range(4000))
    whole = gzip.compress(many.encode())
    (tmp_path / "cut.csv.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "bad-row.csv").write_text(AZURE_ROWS.replace(",105,", ",many,"))
    (tmp_path / "broken.yaml").write_text("name: x\ntrace: [unclosed\n")
    _dynamo_copy(tmp_path / "cut-profile", truncate=True)
    (tmp_path / "odd-profile").mkdir()
    np.savez(tmp_path / "odd-profile" / "prefill_raw_data.npz", prefill_isl=np.arange(3))
    np.savez(tmp_path / "odd-profile" / "decode_raw_data.npz", x_kv_usage=np.ones(2))
    cases = {
        "missing scenario": ((str(tmp_path / "nope.yaml"),), "nope.yaml: invalid"),
        "malformed scenario": ((str(tmp_path / "broken.yaml"),), "broken.yaml"),
        "missing trace": ((scenario("a", "{path: nowhere.csv}"),), "nowhere.csv: no such trace file or folder"),
        "truncated trace": ((scenario("b", "{path: cut.csv.gz}"),), "cut.csv.gz: truncated"),
        "malformed trace row": ((scenario("c", "{path: bad-row.csv}"),), "bad-row.csv:7: ContextTokens must be an integer"),
        "unknown shipped trace": ((scenario("d", "{name: azure/weekly}"),), "unknown trace 'azure/weekly'"),
        "truncated profile": ((scenario("e", "{path: good.csv}", ", profile: cut-profile"),),
                              "decode_raw_data.npz: not a readable npz file"),
        "incomplete profile": ((scenario("f", "{path: good.csv}", ", profile: odd-profile"),),
                               "prefill_raw_data.npz: missing arrays prefill_ttft"),
        "missing profile": ((scenario("g", "{path: good.csv}", ", profile: no-such-profile"),), "no such profile"),
    }
    # Both commands load a scenario the same way; each case goes through one of them in turn (a process start
    # costs seconds), so each command meets every kind of input: scenario, trace and profile.
    for i, (what, (args, message)) in enumerate(cases.items()):
        command = (("sim", "run", *args, "--db", f"sqlite:///{tmp_path / 'x.db'}") if i % 2 == 0 else
                   ("eval", "--scenario", *args, "--workdir", str(tmp_path / "eval")))
        res = fleetctl(*command)
        assert res.returncode == 3, (what, command[0], res.returncode, res.stderr[-2000:])
        assert "Traceback" not in res.stderr, (what, res.stderr)
        assert message in " ".join(res.stderr.split()), (what, command[0], res.stderr)


def test_nothing_reads_a_folder_beside_the_checkout() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    beside = ("../" + "shared", "FLEET_" + "SHARED_DIR", 'parents[2] / "' + 'shared"')
    for name in tracked:
        if name.endswith((".py", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini")) or name in ("Makefile", ".ci/run"):
            text = (ROOT / name).read_text(encoding="utf-8")
            assert not any(b in text for b in beside), name
