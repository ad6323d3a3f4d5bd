"""`fleetctl rules export`: the PrometheusRule manifest as a file and on standard output.

Covers: the YAML parses into a monitoring.coreos.com/v1 PrometheusRule; every rule carries alert,
expr, labels.severity and summary/description/runbook_url; every finding kind has a runbook link
built from --runbook-base-url; --namespace; per-pool SLO thresholds from --config; `for` as a
Prometheus duration; an unwritable --out is an input error (exit 3).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from controlplane.cli import cli
from controlplane.rules_export import DEFAULT_RUNBOOK_BASE_URL, build_manifest, format_duration, runbook_url
from policies.static_rules import KINDS, STATIC_RULES, promql_number

ROOT = Path(__file__).resolve().parents[2]


def export(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["rules", "export", *args])
    return result.exit_code, result.output


def test_export_writes_a_prometheus_rule_with_a_runbook_for_every_kind(tmp_path: Path) -> None:
    out = tmp_path / "rules.yaml"
    code, _ = export("--out", str(out), "--namespace", "monitoring", "--runbook-base-url", "https://runbooks.test/fleet/")
    assert code == 0
    doc = yaml.safe_load(out.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["metadata"]["namespace"] == "monitoring" and doc["metadata"]["name"] == "fleet-controlplane-rules"
    rules = [r for g in doc["spec"]["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rules] == [r.alert for r in STATIC_RULES]
    by_alert = {r.alert: r for r in STATIC_RULES}
    links = {}
    for r in rules:
        rule = by_alert[r["alert"]]
        assert r["expr"] == rule.expr
        assert r.get("for") == (format_duration(rule.for_s) if rule.for_s else None)
        assert r["labels"] == {"severity": str(rule.severity), "kind": rule.kind}
        assert set(r["annotations"]) == {"summary", "description", "runbook_url"}
        assert "{{ $value" in r["annotations"]["description"]
        links[rule.kind] = r["annotations"]["runbook_url"]
    assert links == {k: f"https://runbooks.test/fleet/{k}" for k in KINDS}
    assert [g["name"] for g in doc["spec"]["groups"]] == [f"fleet-controlplane.{k}" for k in KINDS]


def test_export_to_stdout_uses_the_default_links_and_no_namespace() -> None:
    code, text = export()
    assert code == 0
    doc = yaml.safe_load(text)
    assert "namespace" not in doc["metadata"]
    urls = {r["annotations"]["runbook_url"] for g in doc["spec"]["groups"] for r in g["rules"]}
    assert urls == {f"{DEFAULT_RUNBOOK_BASE_URL}/{k}" for k in KINDS}


def test_slo_rules_follow_the_fleet_files_objectives() -> None:
    code, text = export("--config", str(ROOT / "deploy" / "fleet.example.yaml"))
    assert code == 0
    rules = [r for g in yaml.safe_load(text)["spec"]["groups"] for r in g["rules"]]
    ttft = [r for r in rules if r["alert"] == "VLLMTimeToFirstTokenHigh"]
    assert [(r["labels"].get("pool"), r["expr"].rsplit(" ", 1)[1]) for r in ttft] == [("prefill", "1"), (None, "2")]
    assert 'bucket{pool="prefill"}' in ttft[0]["expr"] and 'bucket{pool!~"prefill"}' in ttft[1]["expr"]
    tpot = [r for r in rules if r["alert"] == "VLLMTimePerOutputTokenHigh"]
    assert [r["expr"].rsplit(" ", 1)[1] for r in tpot] == ["0.06", "0.1"]
    # the runbook links the control plane's own alerts carry, from the same fleet file
    assert {r["annotations"]["runbook_url"].rsplit("/", 1)[0] for r in rules} == {
        "https://runbooks.example.com/fleet-controlplane"}


def test_an_unwritable_out_file_is_an_input_error(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "rules.yaml"
    done = subprocess.run([sys.executable, "-m", "controlplane.cli", "rules", "export", "--out", str(target)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 3 and "cannot write the manifest" in done.stderr


@pytest.mark.parametrize(("seconds", "text"), [(300, "5m"), (0, "0s"), (90, "1m30s"), (5400, "1h30m"), (86400, "1d")])
def test_durations_are_written_as_prometheus_writes_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("value", "text"), [(1.0, "1"), (0.06, "0.06"), (1.2345678, "1.2345678"), (1e-7, "1e-07")])
def test_thresholds_are_written_as_the_in_process_rule_compares_them(value: float, text: str) -> None:
    """An SLO of more than six digits, rounded, would fire in one place and not in the other."""
    assert promql_number(value) == text and float(text) == value


def test_runbook_links_accept_a_kind_placeholder() -> None:
    assert runbook_url("slo_burn", "https://git.test/runbooks/{kind}.md") == "https://git.test/runbooks/slo_burn.md"
    assert runbook_url("slo_burn", "https://r.test/") == "https://r.test/slo_burn"
    assert build_manifest(name="x")["metadata"]["name"] == "x"
