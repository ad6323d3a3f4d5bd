"""`fleetctl rules export`: the static alert rules as a PrometheusRule manifest.

One rule group per finding kind, each rule with `alert`, `expr`, `for`, `labels` (severity and
the finding kind, so Alertmanager routes them like the control plane's own alerts) and
`annotations` (summary, description, runbook_url). With a fleet file, SLO rules get one copy per
pool that sets the SLO, with the pool's objective as threshold, and a copy with the default
threshold for the other pools: the same thresholds `StaticRulePolicy` uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from controlplane.config import FleetConfig
from policies.static_rules import KINDS, STATIC_RULES, StaticRule, promql_number

__all__ = [
    "DEFAULT_NAME",
    "DEFAULT_RUNBOOK_BASE_URL",
    "build_manifest",
    "dump_manifest",
    "format_duration",
    "rule_groups",
    "runbook_url",
]

DEFAULT_NAME = "fleet-controlplane-rules"
# Where runbooks are published; a placeholder until the deployment sets its own. `fleetctl runbook
# KIND` prints the same text.
DEFAULT_RUNBOOK_BASE_URL = "https://runbooks.example.com/fleet-controlplane"


def runbook_url(kind: str, base: str | None = None) -> str:
    """The runbook link of a finding kind: `{base}/{kind}`, or `base` with `{kind}` filled in."""
    base = base or DEFAULT_RUNBOOK_BASE_URL
    if "{kind}" in base:
        return base.replace("{kind}", kind)
    return f"{base.rstrip('/')}/{kind}"


def format_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration (`5m`, `1h30m`, `45s`)."""
    total = round(seconds)
    if total <= 0:
        return "0s"
    out = ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, total = divmod(total, size)
        if count:
            out += f"{count}{unit}"
    return out


def _rule(rule: StaticRule, expr: str, threshold: float, base_url: str | None, pool: str | None = None) -> dict[str, Any]:
    op_text = f"{rule.op} {promql_number(threshold)}"
    held = f" for {format_duration(rule.for_s)}" if rule.for_s > 0 else ""
    description = (
        f"{rule.summary}. Value {{{{ $value | humanize }}}} {op_text}{held} "
        f"(our signal: {rule.signal} of {rule.subject_prefix}* subjects). {rule.rationale}"
    )
    out: dict[str, Any] = {"alert": rule.alert, "expr": expr}
    if rule.for_s > 0:
        out["for"] = format_duration(rule.for_s)
    out["labels"] = {"severity": str(rule.severity), "kind": rule.kind}
    if pool is not None:
        # The series carry the same pool; as a rule label it keeps the per-pool copies distinct rules.
        out["labels"]["pool"] = pool
    out["annotations"] = {
        "summary": rule.summary,
        "description": description,
        "runbook_url": runbook_url(rule.kind, base_url),
    }
    return out


def _slo_pools(rule: StaticRule, config: FleetConfig | None) -> dict[str, float]:
    if rule.slo is None or config is None:
        return {}
    out = {}
    for pool in config.pools:
        value = getattr(pool.slo, rule.slo, None)
        if value is not None:
            out[pool.name] = float(value)
    return out


def _rendered(rule: StaticRule, config: FleetConfig | None, base_url: str | None) -> list[dict[str, Any]]:
    pools = _slo_pools(rule, config)
    if not pools:
        return [_rule(rule, rule.expr, rule.threshold, base_url)]
    out = [_rule(rule, rule.render(slo, f'{{pool="{name}"}}'), slo, base_url, name) for name, slo in sorted(pools.items())]
    others = "|".join(sorted(pools))
    out.append(_rule(rule, rule.render(rule.threshold, f'{{pool!~"{others}"}}'), rule.threshold, base_url))
    return out


def rule_groups(
    rules: Sequence[StaticRule] = STATIC_RULES, *, config: FleetConfig | None = None, runbook_base_url: str | None = None,
) -> list[dict[str, Any]]:
    """Prometheus rule groups, one per finding kind (the `groups` of a rules file or of a PrometheusRule)."""
    kinds = sorted({r.kind for r in rules}, key=lambda k: KINDS.index(k))
    return [
        {"name": f"fleet-controlplane.{kind}",
         "rules": [item for r in rules if r.kind == kind for item in _rendered(r, config, runbook_base_url)]}
        for kind in kinds
    ]


def build_manifest(
    rules: Sequence[StaticRule] = STATIC_RULES,
    *,
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    runbook_base_url: str | None = None,
    config: FleetConfig | None = None,
) -> dict[str, Any]:
    """The PrometheusRule object (monitoring.coreos.com/v1) holding the static rules."""
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    metadata["labels"] = {"app.kubernetes.io/name": "fleet-controlplane", "app.kubernetes.io/component": "alert-rules"}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": metadata,
        "spec": {"groups": rule_groups(rules, config=config, runbook_base_url=runbook_base_url)},
    }


def dump_manifest(manifest: dict[str, Any]) -> str:
    """YAML text of a manifest, keys in the order Kubernetes users expect."""
    header = "# Generated by `fleetctl rules export` from policies/static_rules.py; edit the rules there.\n"
    return header + str(yaml.safe_dump(manifest, sort_keys=False, width=1000, allow_unicode=True))
