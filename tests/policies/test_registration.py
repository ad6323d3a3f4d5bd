"""The detection policies are built from the fleet file, with defaults that validate and settings that reach them."""

from __future__ import annotations

import pytest

from controlplane.config import parse_config
from controlplane.errors import ConfigError
from controlplane.runtime import build_policies
from policies.autoscale import TARGET
from policies.types import PolicyInput, PoolState
from policies.windows import SignalWindows

FLEET = """
pools:
  - {name: prefill, role: prefill, model: m, replicas: {min: 1, max: 4}, slo: {ttft_p95: 500ms}}
  - {name: decode, role: decode, model: m, replicas: {min: 1, max: 4}, slo: {tpot_p95: 50ms}}
"""


def test_every_policy_is_on_by_default_with_a_runbook() -> None:
    from controlplane import runbooks

    kinds = [p.kind for p in build_policies(parse_config(FLEET))]
    assert kinds == ["prefix_cache_hit_drop", "kv_transfer_lag", "spec_decode_collapse", "slo_burn", "saturation",
                     "gpu_health", "ep_imbalance", "stale_inputs", "pool_stalled", "pool_at_max", "canary_regression"]
    assert set(kinds) <= set(runbooks.available())


def test_every_finding_names_a_runbook_that_ships() -> None:
    """The pool-level findings, raised together on one input, each name a runbook the dashboard and alerts can load."""
    from controlplane import runbooks

    cfg = parse_config(FLEET)
    windows = SignalWindows(3600.0)
    windows.extend((t, "pool/decode", TARGET, 6.0) for t in range(0, 901, 15))
    pools = {"decode": PoolState("decode", "decode", 4, 3, 1, 4, tpot_p95_slo=0.05, stalled_for=1200.0,
                                 stale_inputs={"vllm": "target decode/d-1/vllm is down"})}
    inp = PolicyInput(900.0, windows, pools, {})
    findings = [f for p in build_policies(cfg) for f in p.evaluate(inp).findings]
    assert sorted(f.key.kind for f in findings) == ["pool_at_max", "pool_stalled", "stale_inputs"]
    for f in findings:
        assert runbooks.load(f.runbook), f.key.kind


def test_settings_reach_the_policies_and_policies_can_be_disabled() -> None:
    cfg = parse_config(FLEET + """
policies:
  spec_decode_collapse: {tpot_rise: 0.2}
  slo_burn: {budget: 0.05, fast_window: 30m, fast_short_window: 3m}
  saturation: {enabled: false}
  gpu_health: {fault_hold: 2h, node_pools: {node-a: decode}}
  ep_imbalance: {persist: 15m, eplb_enabled: {decode: 1767225600, prefill: null}, pod_host: "node-{pod}"}
""")
    by_kind = {p.kind: p for p in build_policies(cfg)}
    assert "saturation" not in by_kind
    assert by_kind["spec_decode_collapse"].settings.tpot_rise == 0.2
    slo = by_kind["slo_burn"].settings
    assert slo.budget == 0.05 and (slo.windows[0].long_s, slo.windows[0].short_s) == (1800.0, 180.0)
    gpu = by_kind["gpu_health"].settings
    assert gpu.fault_hold_s == 7200.0 and gpu.node_pools == {"node-a": "decode"}
    ep = by_kind["ep_imbalance"].settings
    assert ep.persist_s == 900.0 and ep.eplb_enabled == {"decode": 1767225600.0, "prefill": None}
    assert ep.pod_host == "node-{pod}"


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        pytest.param("slo_burn: {fast_short_window: 2h}", "must be shorter than fast_window", id="short-not-shorter"),
        pytest.param("slo_burn: {slow_window: 6h, slow_short_window: 30m}", "history the loop keeps",
                     id="window-beyond-history"),
        pytest.param("slo_burn: {budget: 0.1}", "can never be reached", id="burn-above-1-over-budget"),
        pytest.param("ep_imbalance: {resolve_ratio: 1.6}", "or findings flap", id="no-hysteresis"),
        pytest.param("ep_imbalance: {pod_host: 'node-{host}'}", "only {pool} and {pod}", id="bad-host-pattern"),
        pytest.param("saturation: {kv_full: 1.5}", "less than or equal to 1", id="kv-above-one"),
    ],
)
def test_inconsistent_settings_are_refused(policies: str, message: str) -> None:
    with pytest.raises(ConfigError, match="policies") as err:
        parse_config(FLEET + "policies:\n  " + policies + "\n")
    assert message in str(err.value)
