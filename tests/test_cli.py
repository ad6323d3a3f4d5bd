"""`fleetctl` as users and CI call it: exit codes, --json, and the long-running commands.

Covers: config check, db upgrade/current/downgrade, runbook, findings/actions listing with
approval, the demo (exit 0 and a finding plus an action in the database), `run` serving
/metrics, /healthz and /readyz and stopping cleanly on SIGTERM, and the ingest benchmark.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from controlplane.demo import demo_fleet
from controlplane.lab.engine import free_port
from controlplane.sim.server import SimServer
from controlplane.store.records import NewAction
from controlplane.store.writer import SqlStore
from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[1]


def fleetctl(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_config_check(tmp_path: Path) -> None:
    ok = fleetctl("config", "check", "deploy/fleet.example.yaml", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["valid"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - name: Prefill\n    role: prefill\n    model: m\n    replicas: {max: 2}\n")
    res = fleetctl("config", "check", str(bad), "--json")
    assert res.returncode == 1
    [problem] = json.loads(res.stdout)["problems"]
    assert problem.startswith("pools[0].name (line 2)") and "'Prefill'" in problem
    assert fleetctl("config", "check", str(tmp_path / "missing.yaml")).returncode == 1


def test_usage_errors_exit_3() -> None:
    res = fleetctl("runbook", "no_such_kind")
    assert res.returncode == 3 and "no runbook for 'no_such_kind'" in res.stderr
    assert fleetctl("config", "check").returncode == 3


def test_bad_input_is_a_clear_error_naming_it_never_a_traceback(tmp_path: Path) -> None:
    binary = tmp_path / "fleet.yaml"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe")
    res = fleetctl("config", "check", str(binary))
    assert res.returncode == 1 and "not UTF-8 text" in res.stdout + res.stderr and "Traceback" not in res.stderr
    res = fleetctl("config", "check", "deploy/fleet.example.yaml", env={"FLEETCTL_MODE": "enforce"})
    assert res.returncode == 1 and "FLEETCTL_MODE" in res.stdout + res.stderr and "Traceback" not in res.stderr
    # An unreadable store URL is not echoed: it may carry a password.
    for url in ("postgresql//u:s3cret@db/fleet", "postgresql+psycopg://u:s3cret@db:54x2/fleet"):
        res = fleetctl("findings", "--db", url)
        assert res.returncode == 4 and "the store URL cannot be read" in res.stderr and "s3cret" not in res.stderr
    res = fleetctl("db", "upgrade", "--revision", "bogus", "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert res.returncode == 3 and "--revision" in res.stderr and "'bogus'" in res.stderr
    for args in (["9223372036854775808"], ["7", "--by", " "]):
        res = fleetctl("actions", "approve", *args, "--db", f"sqlite:///{tmp_path / 'x.db'}")
        assert res.returncode == 3 and "Traceback" not in res.stderr, args
    res = fleetctl("gate", "--pool", "p", "--baseline", "a=b", "--canary", "a=c", "--report", "junit",
                   "--out", str(tmp_path / "no" / "such" / "r.xml"), "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert res.returncode == 3 and "--out" in res.stderr and "cannot be written" in res.stderr


def test_a_defect_exits_70_not_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Python's own status for an uncaught exception is 1, which a pipeline reads as a failed canary (a rollback).
    from controlplane import cli

    def broken(**_: object) -> None:
        raise ValueError("could not convert string to float: 'x'")

    monkeypatch.setattr(cli.cli, "main", broken)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == cli.INTERNAL_ERROR == 70
    assert "could not convert string to float" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--config", "missing.yaml"], "'missing.yaml' does not exist"),
    (["--step", "abc"], "--step: expected a duration"),
    (["--fleet", "deploy/fleet.example.yaml", "--step", "10s"],
     "--step 10s is shorter than the scrape interval (15s): steps without a scrape hold no data"),
    (["--source", "prometheus", "--prometheus-url", "http://127.0.0.1:9",
      "--baseline", "app.kubernetes.io/version=v1", "--canary", "app.kubernetes.io/version=v2"],
     "not a Prometheus label name: 'app.kubernetes.io/version'"),
    (["--source", "targets", "--fleet", "deploy/fleet.example.yaml", "--baseline", "pod=llama-decode-0",
      "--canary", "pod=~.*canary.*"], "no canary target matches its selector 'pool=decode,pod=~.*canary.*'"),
    (["--source", "targets", "--fleet", "deploy/fleet.example.yaml", "--start", "1000"],
     "--source targets reads the pods live and keeps no history"),
    # A start ahead waited for it in silence (epoch milliseconds: decades); NaN judged forever.
    (["--start", str(int(time.time() * 1000))], "Invalid value for --start"),
    (["--start", "nan"], "nan is not a time up to now"),
    # A mistyped pool read as no data for the whole window, then inconclusive.
    (["--fleet", "deploy/fleet.example.yaml", "--pool", "decod"], "'decod' is not a pool of"),
    (["--source", "prometheus", "--prometheus-url", "http://[::1"], "is not an http(s) URL with a host"),
])
def test_a_gate_asked_wrongly_exits_3_not_as_a_failed_canary(tmp_path: Path, args: list[str], says: str) -> None:
    arms = [] if "--baseline" in args else ["--baseline", "pod=a", "--canary", "pod=b"]
    res = fleetctl("gate", "--pool", "decode", *arms, *args, "--db", f"sqlite:///{tmp_path / 'gate.db'}")
    assert res.returncode == 3 and says in res.stderr, res.stderr


def test_credentials_in_a_prometheus_url_are_never_printed(tmp_path: Path) -> None:
    # Basic auth rides in the URL (the fleet file's prometheus section has no other way): every error quoted it.
    res = fleetctl("gate", "--pool", "decode", "--baseline", "pod=a", "--canary", "pod=b", "--source", "prometheus",
                   "--prometheus-url", "http://gate:s3cret-pw@127.0.0.1:9", "--start", str(int(time.time()) - 3600))
    assert res.returncode == 3 and "unreachable" in res.stderr and "s3cret-pw" not in res.stdout + res.stderr


@pytest.mark.parametrize("kind", ["prefix_cache_hit_drop", "kv_transfer_lag"])
def test_runbook_lists_and_prints(kind: str) -> None:
    assert kind in fleetctl("runbook").stdout.split()
    text = fleetctl("runbook", kind).stdout
    for section in ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation", "## What the control plane does"):
        assert section in text


def test_db_commands(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    # A file that is not there is told, not made: a mistyped path left an empty database behind.
    for read in (["db", "current"], ["findings"], ["actions"]):
        res = fleetctl(*read, "--db", db)
        assert res.returncode == 4 and "no such file" in res.stderr and not (tmp_path / "x.db").exists(), read
    assert fleetctl("db", "upgrade", "--db", db).returncode == 0
    cur = fleetctl("db", "current", "--db", db, "--json")
    assert cur.returncode == 0 and json.loads(cur.stdout)["up_to_date"] is True
    assert fleetctl("db", "downgrade", "--db", db, "--revision", "base").returncode == 0
    assert fleetctl("db", "current", "--db", db).returncode == 1  # not migrated: a negative result
    res = fleetctl("findings", "--db", db)
    assert res.returncode == 4 and "fleetctl db upgrade" in res.stderr


def test_unreachable_store_exits_4() -> None:
    res = fleetctl("run", "--config", "deploy/fleet.example.yaml", "--db", "postgresql://x@127.0.0.1:1/none", "--once")
    assert res.returncode == 4 and "unreachable" in res.stderr


@pytest.mark.slow
def test_demo_leaves_a_finding_and_an_action(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'demo.db'}"
    res = fleetctl("demo", "--minutes", "0.5", "--no-pace", "--db", db, "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["ok"] and summary["findings"] and summary["actions"]
    assert "finding opened" in res.stderr
    assert re.search(r"action #\d+ rollback prefill: roll the router back to its previous revision", " ".join(res.stderr.split()))
    [rollback] = [a for a in summary["actions"] if a["kind"] == "rollback"]
    assert rollback["state"] == "succeeded"
    assert {a["kind"] for a in summary["actions"]} <= {"rollback", "scale_pool"}, "the autoscaler sizes the pools beside it"
    store = SqlStore.open(db)
    try:
        assert store.findings_since(0) and store.actions()
    finally:
        store.close()
    listing = fleetctl("findings", "--db", db, "--all", "--json")
    assert "prefix_cache_hit_drop" in {f["kind"] for f in json.loads(listing.stdout)["findings"]}


def test_approve_and_reject(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'a.db'}"
    fleetctl("db", "upgrade", "--db", db)
    store = SqlStore.open(db)
    ids = [store.create_action(NewAction(None, "scale_pool", pool, {}, "propose", "r"), 1.0).id for pool in "pq"]
    store.close()
    # As the group's option, and after the id as the dashboard and the runbooks write it.
    assert fleetctl("actions", "--db", db, "approve", str(ids[0]), "--by", "alice").returncode == 0
    assert fleetctl("actions", "reject", str(ids[1]), "--by", "bob", "--db", db).returncode == 0
    again = fleetctl("actions", "--db", db, "approve", str(ids[1]))
    assert again.returncode == 3 and "not awaiting approval (it is rejected)" in again.stderr
    missing = fleetctl("actions", "--db", db, "approve", "99")
    assert missing.returncode == 3 and "no action 99" in missing.stderr
    rows = {a["id"]: a for a in json.loads(fleetctl("actions", "--db", db, "--json").stdout)["actions"]}
    assert (rows[ids[0]]["state"], rows[ids[0]]["approved_by"]) == ("approved", "alice")
    assert rows[ids[1]]["state"] == "rejected"
    # With the fleet file, one past its rails.proposal_ttl is expired, as the API says (this one was proposed in 1970).
    store = SqlStore.open(db)
    late = store.create_action(NewAction(None, "scale_pool", "r", {}, "propose", "r"), 1.0).id
    store.close()
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pools:\n  - {name: r, role: unified, model: m, replicas: {min: 1, max: 4}}\n")
    expired = fleetctl("actions", "approve", str(late), "--db", db, "--config", str(fleet))
    assert expired.returncode == 3 and "(it is expired)" in expired.stderr



@pytest.mark.slow
def test_run_serves_health_and_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    fleet = demo_fleet(now=time.time())
    server = SimServer(fleet)
    server.sync()
    port = free_port()
    db = f"sqlite:///{tmp_path / 'run.db'}"
    targets = "\n".join(f'  - {{url: "{t.url}", pool: {t.pool}, pod: {t.pod}, source: {t.source}}}'
                        for t in server.targets())
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(
        f"store: {{url: '{db}'}}\nscrape: {{interval: 1s, timeout: 500ms, spread: 200ms}}\nserver: {{port: {port}}}\n"
        "pools:\n  - {name: prefill, role: prefill, model: m, replicas: {min: 1, max: 4}}\n"
        "  - {name: decode, role: decode, model: m, replicas: {min: 1, max: 4}}\n"
        f"targets:\n{targets}\n"
    )
    assert fleetctl("db", "upgrade", "--db", db).returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "run", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"{base}/readyz", timeout=1)
                if ready.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert ready is not None and ready.status_code == 200, "never became ready"
        assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
        time.sleep(2.5)
        metrics = httpx.get(f"{base}/metrics").text
        assert "fleet_controlplane_tick_duration_seconds_bucket" in metrics
        assert f'fleet_controlplane_targets{{state="up"}} {len(server.targets())}.0' in metrics
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.close()
    store = SqlStore.open(db)
    try:
        assert store.count_signals() > 0
    finally:
        store.close()


def goals_of(res: subprocess.CompletedProcess[str], names: int) -> dict[str, dict]:
    """The report's goals, checked for their shape; the exit code says whether they all hold."""
    goals = json.loads(res.stdout)["goals"]
    assert len(goals) == names and all(set(g) == {"name", "value", "goal", "holds"} for g in goals), goals
    assert all(isinstance(g["holds"], bool) and g["goal"][:2] in (">=", "<=", "==") for g in goals)
    assert res.returncode == (0 if all(g["holds"] for g in goals) else 1), (res.returncode, goals, res.stderr[-500:])
    return {g["name"]: g for g in goals}


@pytest.mark.slow
@pytest.mark.postgres
def test_bench_ingest_reports_both_stores(pg_admin: str) -> None:
    res = fleetctl("bench", "ingest", "--rows", "20000", "--json", "--postgres", PG_ADMIN_URL, timeout=300)
    goals = goals_of(res, 2)
    results = {r["store"]: r for r in json.loads(res.stdout)["results"]}
    assert set(results) == {"sqlite", "postgresql"}
    for store, r in results.items():
        assert goals[f"{store} rows per second"]["value"] == r["rows_per_s"] > 0
        assert 50 < r["bytes_per_row"] < 1000


@pytest.mark.slow
def test_bench_parse_reports_ratio_and_identity() -> None:
    res = fleetctl("bench", "parse", "--seconds", "0.05", "--json", timeout=300)
    goals = goals_of(res, 2)
    result = json.loads(res.stdout)
    assert goals["samples identical to prometheus_client's"]["holds"]
    assert result["identical"] is True
    assert {r["input"] for r in result["inputs"]} == {"1 engine", "8 engines"}
    assert result["ratio"] == pytest.approx(result["samples_per_s"] / result["reference_samples_per_s"])
    assert result["inputs"][1]["samples"] > 6 * result["inputs"][0]["samples"]  # process_* series are not per engine


@pytest.mark.slow
def test_bench_scrape_measures_the_whole_path() -> None:
    res = fleetctl("bench", "scrape", "--pods", "40", "--ticks", "1", "--json", timeout=300)
    goals = goals_of(res, 3)
    assert goals["targets up"]["holds"]
    result = json.loads(res.stdout)
    assert result["targets_up"] == 40 and result["signals_per_interval"] > 40 * 10
    assert result["cpu_s_per_interval"] > 0 and result["peak_rss_bytes"] > 0


@pytest.mark.slow
def test_sim_validate_and_bench_sim() -> None:
    res = fleetctl("sim", "validate", "--json", timeout=300)
    assert all(g["holds"] for g in goals_of(res, 3).values()), "the simulator matches its published figures"
    assert json.loads(res.stdout)["ok"] is True
    bench = fleetctl("bench", "sim", "--json", timeout=300)
    assert goals_of(bench, 2)["every request of the trace finished"]["holds"]
    assert json.loads(bench.stdout)["replay_requests_per_s"] > 0


def _commands_in(text: str) -> list[str]:
    """The `fleetctl ...` commands a document asks a person to run, up to the end of the line or its backquote."""
    return [m.group(0) for m in re.finditer(r"fleetctl [^`\n\"]+", text)]


def test_every_command_a_runbook_or_alert_gives_names_a_command_with_its_required_options() -> None:
    """Copied from a runbook or an alert in the middle of an incident, a command must not stop at a missing option."""
    import click

    from controlplane.cli import cli

    docs = [*sorted((ROOT / "controlplane" / "runbooks").glob("*.md")), ROOT / "deploy" / "base" / "controlplane-alerts.yaml"]
    checked = 0
    for doc in docs:
        for command in _commands_in(doc.read_text()):
            words = command.split()[1:]
            leaf: click.Command = cli
            while isinstance(leaf, click.Group) and words and words[0] in leaf.commands:
                leaf = leaf.commands[words.pop(0)]
            assert leaf is not cli, f"{doc.name}: {command!r} names no fleetctl command"
            given = set(words)
            missing = [p.opts[0] for p in leaf.params if isinstance(p, click.Option) and p.required
                       and not given & set(p.opts)]
            assert not missing, f"{doc.name}: {command!r} lacks {missing}"
            checked += 1
    assert checked >= 10
