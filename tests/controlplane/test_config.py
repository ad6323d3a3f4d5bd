"""The fleet file: a valid example, and errors that name file, field path, line and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.config import EnvOverrides, Mode, load_config, parse_config
from controlplane.demo import demo_config
from controlplane.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "fleet.example.yaml"

VALID = """
mode: propose
store: {url: "sqlite:///x.db", raw_retention: 48h}
pools:
  - name: prefill
    role: prefill
    model: m
    replicas: {min: 1, max: 4}
    slo: {ttft_p95: 800ms}
targets:
  - {url: "http://10.0.0.1:8000/metrics", pool: prefill, pod: prefill-0}
"""


def test_valid_file_and_durations() -> None:
    cfg = parse_config(VALID)
    assert cfg.mode is Mode.PROPOSE
    assert cfg.store.raw_retention == 48 * 3600
    assert cfg.pools[0].slo.ttft_p95 == pytest.approx(0.8)
    assert cfg.scrape.interval == 15.0


def test_shipped_example_and_demo_fleet_are_valid() -> None:
    assert load_config(EXAMPLE).pools
    assert demo_config("sqlite://").mode is Mode.ACT


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "fleet.yaml")
    assert str(info.value).startswith("fleet.yaml: invalid fleet configuration")
    return info.value.problems


def test_errors_name_path_line_and_value() -> None:
    text = VALID.replace("role: prefill", "role: prefil").replace("max: 4", "max: 0")
    found = problems(text)
    assert any(p.startswith("pools[0].role (line 6)") and "'prefil'" in p for p in found), found
    assert any(p.startswith("pools[0].replicas.max (line 8)") for p in found), found



def test_an_error_about_a_url_does_not_print_its_credentials() -> None:
    text = VALID.replace('url: "http://10.0.0.1:8000/metrics"', 'url: "htp://scraper:s3c@ret@10.0.0.1:8000/metrics"')
    [problem] = problems(text)
    assert problem.startswith("targets[0].url") and "'htp://***@10.0.0.1:8000/metrics'" in problem
    assert "s3c" not in problem and "ret@" not in problem


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(("min: 1, max: 4", "min: 5, max: 4"), "min (5) must not exceed max (4)", id="min-over-max"),
        pytest.param(("pool: prefill, pod", "pool: decode, pod"), "targets[0].pool 'decode' names no pool",
                     id="unknown-pool"),
        pytest.param(("raw_retention: 48h", "raw_retention: soon"), "expected a duration", id="bad-duration"),
        pytest.param(("raw_retention: 48h", "raw_retention: 48h, record_retention: 1d"),
                     "record_retention must be at least raw_retention", id="records-before-their-signals"),
        pytest.param(("raw_retention: 48h", "raw_retention: 3h, minute_retention: 3h, hour_retention: 3h, "
                                            "record_retention: 3h"),
                     "record_retention (10800s) must be at least the", id="records-before-the-rails-read-them"),
        # A new leader rebuilds the loop's windows from the raw signals: 10 minutes of them for 3 hours of windows.
        pytest.param(("raw_retention: 48h", "raw_retention: 10m"), "raw_retention 600s is shorter than the 10800s",
                     id="raw-signals-shorter-than-the-loops-history"),
        pytest.param(("mode: propose", "mode: yolo"), "mode (line 2): Input should be 'observe', 'propose' or 'act'",
                     id="bad-mode"),
        pytest.param(("mode: propose", "mode: propose\nextra_key: 1"), "extra_key", id="unknown-key"),
        pytest.param(("mode: propose", "mode: propose\nrails: {settle_timeout: 4h}"),
                     "settle_timeout (14400s) must be shorter than the history the loop keeps", id="stall-beyond-history"),
        pytest.param(("mode: propose", "mode: propose\nscrape: {interval: 200s}"),
                     "interval (200s) must be at most 150s: a series not read", id="scrape-past-a-series-life"),
        pytest.param(("mode: propose", "mode: propose\npolicies: {canary_regression: {gate: {max_window: 4h}}}"),
                     "gate.max_window", id="canary-window-beyond-history"),
        pytest.param(("mode: propose", "mode: propose\nautoscaling: {scale_down_after: 4h}"),
                     "autoscaling.scale_down_after", id="scale-down-hold-beyond-history"),
        pytest.param(("mode: propose", "mode: propose\nautoscaling: {history: 4h}"),
                     "autoscaling.history", id="autoscale-history-beyond-history"),
        pytest.param(("targets:\n  - {url: \"http://10.0.0.1:8000/metrics\", pool: prefill, pod: prefill-0}",
                      "discovery: {namespace: llm, selector: app=vllm, port: 80800}"), "port 80800 is not 1 to 65535",
                     id="discovery-port-out-of-range"),
        pytest.param(("targets:\n  - {url: \"http://10.0.0.1:8000/metrics\", pool: prefill, pod: prefill-0}",
                      "discovery: {namespace: llm, selector: app=vllm, port: Metrics_Port}"),
                     "'Metrics_Port' is no container port name", id="discovery-port-name"),
        pytest.param(("model: m", "model: m\n    engine: {tensor_parallel: 8}"),
                     "tensor_parallel 8 does not divide gpus 1", id="tp-beyond-the-engines-gpus"),
        pytest.param(("model: m", "model: m\n    engine: {gpus: 4, tensor_parallel: 4, kv_heads: 6}"),
                     "kv_heads 6 and tensor_parallel 4: one must divide the other", id="kv-heads-over-tp"),
        pytest.param(("model: m", "model: m\n    engine: {eplb: true, expert_parallel: false}"),
                     "eplb with expert_parallel false", id="eplb-without-expert-parallelism"),
        pytest.param(("model: m", "model: m\n    role: decode"), "pools[0].role (line 8): given again, after line 6",
                     id="yaml-duplicate-key"),
    ],
)
def test_each_problem_is_named(change: tuple[str, str], expected: str) -> None:
    text = VALID.replace(*change)
    assert any(expected in p for p in problems(text))


def test_not_yaml_and_not_a_mapping() -> None:
    assert "line 1, column" in problems("pools: [unclosed")[0]
    assert "expected a mapping" in problems("- a\n- b\n")[0]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "nope.yaml")


def test_environment_overrides(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(VALID)
    cfg = load_config(path, EnvOverrides(store_url="postgresql://db/fleet", mode=Mode.OBSERVE))
    assert cfg.store.url == "postgresql://db/fleet" and cfg.mode is Mode.OBSERVE


def test_discovery_section() -> None:
    text = VALID.split("targets:")[0] + "discovery: {namespace: llm, selector: 'app=vllm,tier in (prefill,decode)'}\n"
    cfg = parse_config(text)
    assert cfg.discovery is not None and cfg.discovery.port == "metrics"
    found = problems(text.replace("tier in (prefill,decode)", "tier in (prefill"))
    assert any(p.startswith("discovery.selector (line") and "unbalanced" in p for p in found), found
    both = problems(VALID + "discovery: {namespace: llm, selector: app=vllm}\n")
    assert any("either a static `targets` list or `discovery`" in p for p in both), both


def test_kubernetes_credentials_missing_is_a_config_error(tmp_path: Path) -> None:
    import contextlib

    from controlplane.runtime import discovered_targets

    text = VALID.split("targets:")[0] + f"discovery: {{namespace: llm, selector: app=vllm, kubeconfig: {tmp_path}/none}}\n"
    with contextlib.ExitStack() as stack, pytest.raises(ConfigError, match="cannot load Kubernetes credentials"):
        discovered_targets(parse_config(text), stack)


def test_settings_that_leave_a_detector_unable_to_judge_are_rejected() -> None:
    """A real lab at a 5 s interval with a 120 s spec-decode baseline: 20 baseline points besides the
    8 recent ones need 140 s, so the detector would never evaluate and a collapse would go unreported."""
    text = ("scrape: {interval: 5s, timeout: 1s, spread: 0s}\n"
            "pools: [{name: lab, role: unified, model: m, replicas: {max: 2}}]\n"
            "policies:\n"
            "  spec_decode_collapse: {baseline: 120s}\n"
            "  prefix_cache_hit_drop: {baseline: 2m}\n"
            "  slo_burn: {fast_short_window: 10s}\n")
    assert problems(text) == [
        "policies.spec_decode_collapse.baseline (line 4): 120s is shorter than the 140s the detector needs at a 5s "
        "scrape interval (20 baseline points besides its 8 recent ones), so it would never judge; make it at least 140s",
        "policies.slo_burn.fast_short_window (line 6): 10s is shorter than the 15s the detector needs at a 5s scrape "
        "interval (3 points in each short window), so it would never judge; make it at least 15s",
    ]
    # Windows that hold what the detectors need pass, and a disabled detector is not judged.
    parse_config(text.replace("{baseline: 120s}", "{baseline: 140s}").replace("10s}", "15s}"))
    parse_config(text.replace("{baseline: 120s}", "{baseline: 120s, enabled: false}").replace("10s}", "15s}"))
    # The canary gate's step is judged even with the loop's canary judge off: the HTTP API's gates run by it.
    gate = ("scrape: {interval: 15s}\npools: [{name: lab, role: unified, model: m, replicas: {max: 2}}]\n"
            "policies: {canary_regression: {enabled: false, gate: {step: 10s}}}\n")
    assert problems(gate) == ["policies.canary_regression.gate.step (line 3): 10s is shorter than the scrape interval "
                              "(15s): steps without a scrape hold no data"]


def test_policy_sections_are_the_policies_own_settings() -> None:
    """Every field a policy has is settable in the fleet file, under the name the file documents."""
    from policies.kv_transfer import KvTransferSettings
    from policies.spec_decode import SpecDecodeSettings

    cfg = parse_config("pools: [{name: p, role: unified, model: m, replicas: {max: 2}}]\n"
                       "policies: {kv_transfer_lag: {baseline: 10m, min_abs: 5ms, min_peers: 3},"
                       " spec_decode_collapse: {recent_points: 6, off_s: 1m}}\n")
    kv = cfg.policies.kv_transfer_lag
    assert isinstance(kv, KvTransferSettings) and (kv.baseline_s, kv.min_abs_s, kv.min_peers) == (600.0, 0.005, 3)
    sd = cfg.policies.spec_decode_collapse
    assert isinstance(sd, SpecDecodeSettings) and (sd.recent_points, sd.off_s) == (6, 60.0)
    assert any("recent_points" in p and "greater than or equal to 2" in p for p in problems(
        "pools: [{name: p, role: unified, model: m, replicas: {max: 2}}]\n"
        "policies: {spec_decode_collapse: {recent_points: 1}}\n"))


def test_two_pools_on_one_workload_are_a_config_error() -> None:
    text = EXAMPLE.read_text().replace("name: llama-decode}", "name: llama-prefill}")
    with pytest.raises(ConfigError, match="pools 'prefill' and 'decode' both name Deployment llm/llama-prefill"):
        parse_config(text)


def test_a_lease_call_leaves_the_leader_time_to_retry_before_its_renew_deadline() -> None:
    from controlplane.config import LeaderElection

    election = LeaderElection(namespace="fleet-system")  # renew deadline 10 s, retry every 2 s
    assert election.call_timeout(10.0) == 4.0 and election.call_timeout(3.0) == 3.0


def test_a_key_given_twice_is_refused_with_both_lines() -> None:
    # YAML keeps the last of two: a `rails:` block appended below a tightened one undid it in silence.
    text = ("mode: act\npools: [{name: p, role: prefill, model: m, replicas: {max: 2}}]\n"
            "rails: {max_step: 3, max_actions_per_hour: 2}\nscrape: {interval: 15s, interval: 30s}\nrails: {}\n")
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    assert exc.value.problems == ["scrape.interval (line 4): given again, after line 4",
                                  "rails (line 5): given again, after line 3"]
