"""The fleet file: one YAML document validated by pydantic.

Errors name the file, the field path, the line, the value and what is expected, and all
problems are reported at once. Durations accept seconds or `30s`, `5m`, `48h`, `7d`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from catalog.fleet import Role, Source
from catalog.redaction import without_credentials
from catalog.settings import NonNegativeSeconds, Seconds, Settings
from catalog.signals import STALE_S
from controlplane.errors import ConfigError
from controlplane.selectors import LabelSelector
from policies.advice import AdviceSettings
from policies.autoscale import AutoscaleSettings
from policies.canary_rollout import CanaryRolloutSettings
from policies.ep_imbalance import EpImbalanceSettings
from policies.gpu_health import GpuHealthSettings
from policies.inputs import StaleInputsSettings
from policies.kv_transfer import KvTransferSettings
from policies.pool_at_max import PoolAtMaxSettings
from policies.prefix_cache import PrefixCacheSettings
from policies.saturation import SaturationSettings
from policies.settling import PoolStalledSettings
from policies.slo_burn import SloBurnSettings
from policies.spec_decode import SpecDecodeSettings
from policies.types import ActionKind
from policies.windows import HISTORY_S

PolicySettings = (PrefixCacheSettings | KvTransferSettings | SpecDecodeSettings | SloBurnSettings | SaturationSettings
                  | GpuHealthSettings | EpImbalanceSettings | StaleInputsSettings | PoolStalledSettings | PoolAtMaxSettings
                  | CanaryRolloutSettings)

__all__ = ["FleetConfig", "Mode", "Seconds", "Speculative", "load_config", "parse_config", "parse_yaml"]

class Mode(StrEnum):
    """How far the control plane may go: detect only, propose for approval, or act."""

    OBSERVE = "observe"
    PROPOSE = "propose"
    ACT = "act"




class Workload(Settings):
    """The Kubernetes workload a pool (or the router) maps to: scaled through its scale subresource,
    its engine container's arguments patched, rolled back to its previous revision."""

    kind: str = Field("Deployment", pattern=r"^(Deployment|StatefulSet|LeaderWorkerSet|Rollout)$")
    namespace: str = Field("default", min_length=1)
    name: str = Field(min_length=1)
    container: str = "vllm"  # the container whose arguments carry --speculative-config and the EPLB flags

    @property
    def by_ordinal(self) -> bool:
        """Whether its pods are ordinals kept under their names (a StatefulSet, a LeaderWorkerSet's groups): it
        removes its highest, not the pods a drain chose, and its rollout recreates pods under their names."""
        return self.kind in ("StatefulSet", "LeaderWorkerSet")


class ConfigMapFlag(Settings):
    """A ConfigMap key that is a flag: `true` (any case) sets it."""

    namespace: str = Field(min_length=1)
    name: str = "fleet-controlplane"
    key: str = "paused"


class LeaderElection(Settings):
    """Several control-plane replicas, one leader, through a coordination.k8s.io Lease."""

    namespace: str = Field(min_length=1)
    name: str = "fleet-controlplane"
    lease_duration: Seconds = 15.0  # a follower takes over once the holder has not renewed for this long
    renew_deadline: Seconds = 10.0  # the leader stops acting when it could not renew for this long
    retry_period: Seconds = 2.0  # how often the lease is renewed or tried

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElection:
        if not self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(f"retry_period ({self.retry_period:g}s) < renew_deadline ({self.renew_deadline:g}s) "
                             f"< lease_duration ({self.lease_duration:g}s) must hold, or two replicas could "
                             "act at once")
        return self

    def call_timeout(self, api_timeout: float) -> float:
        """How long one Lease call may take: the API's timeout, but short enough that a stalled call leaves the leader
        time for another before its renew deadline (one stalled renewal would otherwise cost it leadership)."""
        return min(api_timeout, (self.renew_deadline - self.retry_period) / 2)


class Kubernetes(Settings):
    """Acting on the fleet through the Kubernetes API (the pools' `workload`s)."""

    kubeconfig: str | None = None  # None: the in-cluster service account
    router: Workload | None = None  # rolled back when a routing fault follows its new revision
    switch: ConfigMapFlag | None = None  # a kill switch operators can flip with kubectl
    dry_run: bool = False  # send every write as a server-side dry run: validated and admitted, never stored
    drain_grace: Seconds = 120.0  # how long a drained engine may take to finish its requests
    # How long a cordon keeps one engine of a pool that serves nowhere else routed on the node, waiting for its other
    # engines' replacements to serve elsewhere (start-up included) before that one goes too.
    cordon_hold: Seconds = 900.0
    routing_label: str = "llm-d.ai/routed"  # removed from a pod to take it out of the router's pool
    timeout: Seconds = 10.0
    leader_election: LeaderElection | None = None  # None: this replica always leads (run only one)


class Replicas(Settings):
    """Bounds the rails keep a pool within."""

    min: int = Field(1, ge=0)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Replicas:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class Slo(Settings):
    """Latency objectives of a pool, in seconds at the 95th percentile."""

    ttft_p95: Seconds | None = None
    tpot_p95: Seconds | None = None


class Speculative(Settings):
    """A pool's `--speculative-config`: method and draft length; `none` serves without speculation."""

    method: str = Field("none", pattern=r"^(none|ngram|eagle|eagle3|mtp|medusa)$")
    num_speculative_tokens: int = Field(0, ge=0, le=16)


class Engine(Settings):
    """What one engine of a pool is, for the autoscaler's prior until the fleet's own data take over:
    a measured profile (shipped by name, or a folder or CSV by path) scaled by `speed`, and its vLLM flags."""

    profile: str = "dynamo/h200/llama3.1-8b-fp8"
    speed: float = Field(1.0, gt=0)  # times as fast as the profiled hardware
    decode_speed: float | None = Field(None, gt=0)  # decode steps' own factor when it differs (memory-bound GPUs)
    kv_blocks: int = Field(30_000, ge=64)  # of 16 tokens
    max_num_seqs: int = Field(256, ge=1)
    max_batched_tokens: int = Field(8192, ge=64)
    gpus: int = Field(1, ge=1)  # per engine: what a replica costs
    # For the advisor: what the GPUs are (a type priced in `advisor.gpu_types`), and the flags it weighs.
    gpu_type: str = "h200"
    kv_cache_dtype: str = Field("auto", pattern=r"^(auto|fp8)$")  # --kv-cache-dtype
    kv_bytes_per_token: float = Field(131072.0, gt=0)  # all layers at the model's dtype: 2 x layers x kv_heads x head_dim x 2 B
    tensor_parallel: int = Field(1, ge=1)
    kv_heads: int = Field(8, ge=1)
    speculative: Speculative = Speculative()
    # --enable-expert-parallel: a MoE model's experts spread over the engine's ranks. Only such a pool has experts
    # for EPLB to balance; vLLM refuses EPLB without it.
    expert_parallel: bool = False
    eplb: bool = False  # --enable-eplb
    native_mtp: bool = False  # the model ships multi-token-prediction heads

    @model_validator(mode="after")
    def _layout(self) -> Engine:
        # What vLLM itself refuses to start with, and what every cost the advisor states is priced by.
        tp, heads = self.tensor_parallel, self.kv_heads
        if self.gpus % tp:
            raise ValueError(f"tensor_parallel {tp} does not divide gpus {self.gpus}: an engine holds whole "
                             "tensor-parallel groups (gpus is what a replica costs)")
        if (tp % heads) if tp >= heads else (heads % tp):
            raise ValueError(f"kv_heads {heads} and tensor_parallel {tp}: one must divide the other "
                             "(vLLM splits or replicates the KV heads over the ranks)")
        if self.eplb and not self.expert_parallel:
            raise ValueError("eplb with expert_parallel false: vLLM refuses --enable-eplb without "
                             "--enable-expert-parallel")
        return self

    @model_validator(mode="before")
    @classmethod
    def _eplb_runs_expert_parallel(cls, data: Any) -> Any:
        # vLLM runs EPLB only with expert parallelism: an engine with it on has both (a fleet file written before
        # expert_parallel existed keeps loading, and its EPLB is judged as before).
        if isinstance(data, dict) and data.get("eplb") and "expert_parallel" not in data:
            return {**data, "expert_parallel": True}
        return data


class Pool(Settings):
    """A set of identical engines with one role."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    role: Role
    model: str = Field(min_length=1)
    workload: Workload | None = None
    replicas: Replicas
    slo: Slo = Slo()
    engine: Engine = Engine()


def _check_source(value: str) -> str:
    if value not in Source._value2member_map_:
        raise ValueError(f"unknown source {value!r}; expected one of {', '.join(sorted(Source))}")
    return value


class StaticTarget(Settings):
    """One scrape endpoint listed by hand."""

    url: str = Field(pattern=r"^https?://")
    pool: str
    pod: str = Field(min_length=1)
    source: str = "vllm"  # which collector reads it: a catalog.fleet.Source

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        return _check_source(value)


class Discovery(Settings):
    """Targets found in Kubernetes: the Running, Ready pods matching a label selector in one namespace."""

    namespace: str = Field(min_length=1)
    selector: str = Field(min_length=1)  # e.g. "app.kubernetes.io/name=vllm"
    pool_label: str = "llm-d.ai/pool"  # the pod label naming its pool (our convention)
    role_label: str | None = "llm-d.ai/role"  # prefill | decode | both, as llm-d deployments label pods
    port: int | str = "metrics"  # a number, or a named container port
    path: str = Field("/metrics", pattern=r"^/")

    @field_validator("port")
    @classmethod
    def _a_port(cls, value: int | str) -> int | str:
        # Kubernetes' own rules: a number 1 to 65535, or a container port's name (IANA_SVC_NAME).
        if isinstance(value, int) and not 1 <= value <= 65535:
            raise ValueError(f"port {value} is not 1 to 65535")
        if isinstance(value, str) and not re.fullmatch(r"(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", value):
            raise ValueError(f"port {value!r} is no container port name (1 to 15 lowercase letters, digits and "
                             "inner dashes, with a letter)")
        return value
    source: str = "vllm"
    max_stale_failures: int = Field(3, ge=0)  # API failures during which the last list is kept
    timeout: Seconds = 10.0
    kubeconfig: str | None = None  # None: the in-cluster service account

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        return _check_source(value)

    @field_validator("selector")
    @classmethod
    def _parses(cls, value: str) -> str:
        LabelSelector.parse(value)
        return value


class PrometheusApi(Settings):
    """Read the fleet's signals from a Prometheus that already scrapes it, instead of scraping."""

    url: str = Field(pattern=r"^https?://")
    window: Seconds = 60.0  # the range of rate()/increase(): a few scrape intervals of Prometheus
    mode: str = Field("rate", pattern=r"^(rate|delta)$")  # delta: two-point differences, as our scraper
    selector: dict[str, str] = Field(default_factory=dict)  # equality matchers added to every query, e.g. {job: vllm}
    pool_label: str = "pool"
    pod_label: str = "pod"
    timeout: Seconds = 10.0


class Store(Settings):
    """Where signals, findings and the audit log live, and how long raw data is kept."""

    url: str = "sqlite:///fleet.db"
    raw_retention: Seconds = 48 * 3600.0  # raw signals: two days answer "what changed since yesterday"
    minute_retention: Seconds = 14 * 86400.0  # 1-minute rollups: two weeks of incident review
    hour_retention: Seconds = 400 * 86400.0  # 1-hour rollups: a year of capacity planning
    # Findings, finished actions and their audit log, verdicts, advice: a year of incident and change review.
    record_retention: Seconds = 400 * 86400.0
    compact_every: Seconds = 300.0  # how often rollups and retention run

    @model_validator(mode="after")
    def _retention_grows(self) -> Store:
        if not self.raw_retention <= self.minute_retention <= self.hour_retention:
            raise ValueError("retention must grow with coarseness: raw <= minute <= hour")
        if self.raw_retention < HISTORY_S:
            # A leader taking over rebuilds its windows (baselines, burn windows, the sizer's history) from raw signals.
            raise ValueError(f"raw_retention {self.raw_retention:g}s is shorter than the {HISTORY_S:g}s of history the "
                             "loop keeps: a new leader would rebuild its policies' windows from part of it")
        if self.record_retention < self.raw_retention:
            # The loop judges and reverts actions, and reads their history, from what the raw signals still hold.
            raise ValueError("record_retention must be at least raw_retention: an action would go before the "
                             "signals it was decided and judged on")
        return self


class Scrape(Settings):
    """How targets are scraped."""

    interval: Seconds = 15.0  # vLLM's own dashboards assume 15 s
    timeout: Seconds = 5.0
    # Scrapes in flight. httpx's connection pool costs more CPU per request as it grows: 16
    # measured cheapest per scrape (bench scrape: 1,000 pods, 1.0 CPU-s at 16, 2.4 CPU-s at 64).
    concurrency: int = Field(16, ge=1, le=4096)
    # The longest wait before a target whose failures cost a slot (timed out, took half the timeout, or sent too much)
    # is asked again; others are asked every round. It costs a slot that often, and a target reads as failing for up
    # to that long after it answers again.
    backoff_max: Seconds = 60.0
    # Targets are scraped at fixed offsets within this part of each interval so a large fleet is
    # not hit at one instant (Prometheus spreads its targets the same way).
    spread: NonNegativeSeconds = 3.0

    @property
    def round_s(self) -> float:
        """How long a round of scrapes may take: four fifths of the interval, the rest the tick's own (its writes,
        detection, acting), and at least one target's offset and timeout. A target the round has no time for is
        read next round."""
        return max(self.spread + self.timeout, 0.8 * self.interval)

    @model_validator(mode="after")
    def _timeout_fits(self) -> Scrape:
        if 2 * self.interval > STALE_S:
            raise ValueError(f"interval ({self.interval:g}s) must be at most {STALE_S / 2:g}s: a series not read for "
                             f"{STALE_S:g}s is gone (Prometheus' lookback), and one missed scrape would make it so")
        if self.timeout >= self.interval:
            raise ValueError(f"timeout ({self.timeout:g}s) must be shorter than interval ({self.interval:g}s)")
        if self.spread + self.timeout >= self.interval:
            raise ValueError(
                f"spread ({self.spread:g}s) plus timeout ({self.timeout:g}s) must be shorter than interval "
                f"({self.interval:g}s)"
            )
        return self


class Policies(Settings):
    """Per-policy settings: each section is the policy's own settings type."""

    prefix_cache_hit_drop: PrefixCacheSettings = PrefixCacheSettings()
    kv_transfer_lag: KvTransferSettings = KvTransferSettings()
    spec_decode_collapse: SpecDecodeSettings = SpecDecodeSettings()
    slo_burn: SloBurnSettings = SloBurnSettings()
    saturation: SaturationSettings = SaturationSettings()
    gpu_health: GpuHealthSettings = GpuHealthSettings()
    ep_imbalance: EpImbalanceSettings = EpImbalanceSettings()
    stale_inputs: StaleInputsSettings = StaleInputsSettings()
    pool_stalled: PoolStalledSettings = PoolStalledSettings()
    pool_at_max: PoolAtMaxSettings = PoolAtMaxSettings()
    canary_regression: CanaryRolloutSettings = CanaryRolloutSettings()

    def enabled(self) -> dict[str, PolicySettings]:
        """The enabled sections by their fleet-file name."""
        return {name: getattr(self, name) for name in type(self).model_fields if getattr(self, name).enabled}

    def problems(self, interval: float) -> list[tuple[tuple[str, ...], str]]:
        """(field path, problem) for settings of enabled policies under which a detector could never judge, and of the
        canary gate's, which the HTTP API's gates judge by whether or not the loop's canary judge runs."""
        sections = {**self.enabled(), "canary_regression": self.canary_regression}
        return [(("policies", name, field), message) for name, settings in sections.items()
                for field, message in settings.problems(interval)]


class Rails(Settings):
    """Safety rails every action passes through."""

    cooldown: Seconds = 300.0  # per pool and kind of action, after an action finishes
    cooldowns: dict[ActionKind, Seconds] = Field(default_factory=dict)  # a kind's own cooldown, e.g. enable_eplb: 1h
    max_step: int = Field(1, ge=1)  # replicas changed by one action at most
    max_actions_per_hour: int = Field(6, ge=1)  # fleet-wide rate limit
    verify_after: Seconds = 600.0  # when an action's outcome is judged
    # A proposal nobody decided on (or an approved action that could not run) expires after this:
    # an approval given hours later would act on a fleet nobody looked at.
    proposal_ttl: Seconds = 3600.0
    # An approved revert of a change that did not help waits this long for the rails (a pause, another pool's
    # rollout): the change it undoes stays in place meanwhile, so it outlives `proposal_ttl`, but not for ever.
    revert_ttl: Seconds = 6 * 3600.0
    # A watched gauge that held one non-zero value this long is not trusted to act on (0: never).
    frozen_after: NonNegativeSeconds = 900.0
    # A pool short of ready engines this long is stalled, not settling (its missing engines may never come): a
    # scale-down may run on it, and a `pool_stalled` finding says so.
    settle_timeout: Seconds = 900.0

    @model_validator(mode="after")
    def _settle_within_history(self) -> Rails:
        if self.settle_timeout >= HISTORY_S:
            raise ValueError(f"settle_timeout ({self.settle_timeout:g}s) must be shorter than the history the loop "
                             f"keeps ({HISTORY_S:g}s): a stall that long could never be seen")
        return self

    def cooldown_for(self, kind: str) -> float:
        """The cooldown after an action of `kind` on a pool."""
        return self.cooldowns.get(ActionKind(kind), self.cooldown)

    def ttl_for(self, params: Mapping[str, Any], approved: bool = True) -> tuple[str, float]:
        """The setting, and its seconds, for how long an action with these params may wait from its creation to run:
        `revert_ttl` for an approved revert (the change it undoes stays in place meanwhile), else `proposal_ttl` (a
        revert awaiting a person waits as any proposal)."""
        if approved and "reverts" in params:
            return "revert_ttl", self.revert_ttl
        return "proposal_ttl", self.proposal_ttl

    @property
    def history_s(self) -> float:
        """How far back, by creation, the rails must see actions: the rate limit's hour or the longest cooldown,
        which counts from an action's finish, up to the longest wait (`proposal_ttl`, `revert_ttl`) and
        `verify_after` after its creation."""
        return (max(3600.0, self.cooldown, *self.cooldowns.values()) + max(self.proposal_ttl, self.revert_ttl)
                + self.verify_after)


class Tracing(StrEnum):
    """Where OpenTelemetry spans go."""

    OFF = "off"
    CONSOLE = "console"
    OTLP = "otlp"


def _yaml_off(value: Any) -> Any:
    # YAML 1.1 reads a bare `off` as false; the user meant the string.
    return "off" if value is False else value


class Telemetry(Settings):
    """The control plane's own observability."""

    tracing: Annotated[Tracing, BeforeValidator(_yaml_off)] = Tracing.OFF
    otlp_endpoint: str | None = None  # e.g. http://otel-collector:4318/v1/traces


class Server(Settings):
    """The control plane's HTTP server (/metrics, /healthz, /readyz)."""

    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535)


_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
GROUP_BY_ALL = "..."  # Alertmanager's group_by value for one group per distinct label set


class AlertReceiver(Settings):
    """One Alertmanager-compatible webhook; secrets come from the environment, never from this file."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    url: str | None = Field(None, pattern=r"^https?://")
    url_env: str | None = Field(None, pattern=_ENV_NAME)  # for a URL that carries a secret (basic auth, a token path)
    bearer_token_env: str | None = Field(None, pattern=_ENV_NAME)  # sent as `Authorization: Bearer ...`
    send_resolved: bool = True
    timeout: Seconds = 10.0
    retries: int = Field(2, ge=0, le=10)  # attempts after the first one, with exponential backoff
    max_alerts: int = Field(0, ge=0)  # alerts per notification, 0 for all (Alertmanager's max_alerts)

    @model_validator(mode="after")
    def _one_url(self) -> AlertReceiver:
        if (self.url is None) == (self.url_env is None):
            raise ValueError("give either url or url_env")
        if self.url is not None and "@" in self.url.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError("the url carries credentials: put the whole URL in an environment variable named by "
                             "url_env, or the token in one named by bearer_token_env")
        return self


class Alerting(Settings):
    """Alert delivery to webhook receivers, grouped and timed as Alertmanager does."""

    receivers: list[AlertReceiver] = Field(min_length=1)
    group_by: list[str] = Field(default_factory=lambda: ["alertname", "pool"])  # label names, or `...` for all
    group_wait: NonNegativeSeconds = 30.0  # before a new group's first notice
    group_interval: Seconds = 300.0  # between notices about changes of one group
    repeat_interval: Seconds = 4 * 3600.0  # before an unchanged firing group is sent again
    runbook_base_url: str | None = Field(None, pattern=r"^https?://")  # runbook_url = <base>/<kind>
    external_url: str | None = Field(None, pattern=r"^https?://")  # the dashboard, for externalURL and generatorURL

    @field_validator("group_by")
    @classmethod
    def _label_names(cls, v: list[str]) -> list[str]:
        # Alertmanager's rules: label names, or its `...` (one group per label set) alone.
        if GROUP_BY_ALL in v and len(v) > 1:
            raise ValueError(f"{GROUP_BY_ALL!r} groups by every label: it cannot be given with other labels")
        bad = [name for name in v if name != GROUP_BY_ALL and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not a label name")
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> Alerting:
        names = [r.name for r in self.receivers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"receiver name {', '.join(map(repr, dupes))} is used more than once")
        return self


class FleetConfig(Settings):
    """The whole fleet file."""

    mode: Mode = Mode.OBSERVE
    store: Store = Store()
    scrape: Scrape = Scrape()
    pools: list[Pool] = Field(min_length=1)
    targets: list[StaticTarget] = Field(default_factory=list)
    discovery: Discovery | None = None
    prometheus: PrometheusApi | None = None
    policies: Policies = Policies()
    rails: Rails = Rails()
    telemetry: Telemetry = Telemetry()
    server: Server = Server()
    alerting: Alerting | None = None
    kubernetes: Kubernetes | None = None
    autoscaling: AutoscaleSettings = AutoscaleSettings()
    advisor: AdviceSettings = AdviceSettings()

    @model_validator(mode="after")
    def _cross_checks(self) -> FleetConfig:
        names = [p.name for p in self.pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        problems = [f"pool name {n!r} is used more than once" for n in dupes]
        for i, t in enumerate(self.targets):
            if t.pool not in names:
                problems.append(f"targets[{i}].pool {t.pool!r} names no pool (pools: {', '.join(names)})")
        urls = [t.url for t in self.targets]
        problems += [f"target url {_masked(u)} is listed more than once" for u in sorted({u for u in urls if urls.count(u) > 1})]
        given = [name for name, on in (("targets", bool(self.targets)), ("discovery", self.discovery is not None),
                                        ("prometheus", self.prometheus is not None)) if on]
        if len(given) > 1:
            problems.append(f"use one source of targets, not {' and '.join(given)}: either a static `targets` list "
                            "or `discovery`, or `prometheus`")
        if self.discovery is not None and self.discovery.timeout >= self.scrape.interval:
            problems.append(f"discovery.timeout ({self.discovery.timeout:g}s) must be shorter than scrape.interval")
        pods = [(t.pool, t.pod, t.source) for t in self.targets]
        problems += [f"target {p}/{q} ({src}) is listed more than once"
                     for p, q, src in sorted({k for k in pods if pods.count(k) > 1})]
        if self.kubernetes is not None:
            problems += [f"pools[{i}].workload is required to act on Kubernetes (kubernetes is set)"
                         for i, p in enumerate(self.pools) if p.workload is None]
        # Two pools on one workload would both size and change it, each within its own rails: never one at a time.
        objects = [(p.name, (w.kind, w.namespace, w.name)) for p in self.pools if (w := p.workload) is not None]
        seen: dict[tuple[str, str, str], str] = {}
        for name, obj in objects:
            if obj in seen:
                problems.append(f"pools {seen[obj]!r} and {name!r} both name {obj[0]} {obj[1]}/{obj[2]} as their "
                                "workload: a workload is one pool's")
            seen.setdefault(obj, name)
        priced = self.advisor.gpu_types
        problems += [f"pools[{i}].engine.gpu_type {p.engine.gpu_type!r} has no price in advisor.gpu_types "
                     f"({', '.join(sorted(priced))})" for i, p in enumerate(self.pools) if p.engine.gpu_type not in priced]
        problems += [f"advisor.{name} {value!r} has no price in advisor.gpu_types ({', '.join(sorted(priced))})"
                     for name, value in (("prefill_gpu", self.advisor.prefill_gpu), ("decode_gpu", self.advisor.decode_gpu))
                     if value is not None and value not in priced]
        if self.store.record_retention < self.rails.history_s:
            # The rails (cooldowns, rate limit, reverts) read the actions of that long: gone early, they would allow
            # what those actions hold back.
            problems.append(f"store.record_retention ({self.store.record_retention:g}s) must be at least the "
                            f"{self.rails.history_s:g}s of actions the rails read (cooldowns, waits and verify_after)")
        if self.telemetry.tracing is Tracing.OTLP and not self.telemetry.otlp_endpoint:
            problems.append("telemetry.otlp_endpoint is required when telemetry.tracing is 'otlp'")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def cross_problems(self) -> list[tuple[tuple[str, ...], str]]:
        """Settings valid one by one that do not work together: (field path, problem)."""
        return self.policies.problems(self.scrape.interval) + [
            (("autoscaling", name), why) for name, why in self.autoscaling.problems(self.scrape.interval)]

    def pool(self, name: str) -> Pool:
        """The pool called `name`; KeyError if there is none."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)


class EnvOverrides(BaseSettings):
    """Settings a deployment may override from the environment (FLEETCTL_STORE_URL, FLEETCTL_MODE)."""

    model_config = SettingsConfigDict(env_prefix="FLEETCTL_", extra="ignore")

    store_url: str | None = None
    mode: Mode | None = None


_M = TypeVar("_M", bound=BaseModel)


def _line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """The 1-based YAML line of the node at a pydantic error location, as far as it resolves."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        else:
            nxt = None
        if nxt is None:
            break
        node = nxt
        line = node.start_mark.line + 1
    return line


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "function_")):
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def parse_config(text: str, source: str = "<string>") -> FleetConfig:
    """Validate a fleet document; raises ConfigError listing every problem."""
    return parse_yaml(text, FleetConfig, source)


def parse_yaml(text: str, model: type[_M], source: str = "<string>") -> _M:
    """Validate a YAML document against `model`; ConfigError names the source, field paths and lines."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(source, [f"{where}not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, [f"expected a mapping at the top level, got {type(data).__name__}"])
    if twice := _repeated_keys(root):
        # YAML keeps the last of two: a `rails:` block appended below a tightened one would undo it in silence.
        raise ConfigError(source, twice)
    try:
        valid = model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = tuple(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            shown = err["type"] != "missing" and not isinstance(err["input"], dict | list)
            given = f": got {_masked(err['input'])}" if shown else ""
            problems.append(f"{_path(loc)}{_where(root, loc)}: {msg}{given}")
        raise ConfigError(source, problems) from None
    # Then what is valid field by field but cannot work together (a window no detector can fill).
    cross = getattr(valid, "cross_problems", None)
    together = cross() if cross is not None else []
    if together:
        raise ConfigError(source, [f"{_path(loc)}{_where(root, loc)}: {msg}" for loc, msg in together])
    return valid


def _repeated_keys(node: yaml.Node | None, path: tuple[int | str, ...] = ()) -> list[str]:
    """Every key given twice in one mapping, with both lines."""
    out: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in first:
                    out.append(f"{_path((*path, key.value))} (line {line}): given again, after line {first[key.value]}")
                first.setdefault(key.value, line)
                out += _repeated_keys(value, (*path, key.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out += _repeated_keys(item, (*path, i))
    return out


def _masked(value: object) -> str:
    """The value as an error shows it, credentials in a URL hidden."""
    return without_credentials(repr(value))


def _where(root: yaml.Node | None, loc: tuple[int | str, ...]) -> str:
    line = _line_of(root, loc)
    return f" (line {line})" if line else ""


def load_config(path: str | Path, env: EnvOverrides | None = None) -> FleetConfig:
    """Read and validate a fleet file, then apply FLEETCTL_* environment overrides."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(p), [f"cannot read the file: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), [f"not UTF-8 text (byte {exc.start}): a fleet file is YAML"]) from None
    cfg = parse_config(text, str(p))
    if env is None:
        try:
            env = EnvOverrides()
        except ValidationError as exc:
            raise ConfigError("the environment", [f"FLEETCTL_{str(e['loc'][0]).upper()}: {e['msg']}"
                                                  for e in exc.errors()]) from None
    updates: dict[str, Any] = {}
    if env.store_url:
        updates["store"] = cfg.store.model_copy(update={"url": env.store_url})
    if env.mode:
        updates["mode"] = env.mode
    return cfg.model_copy(update=updates) if updates else cfg
