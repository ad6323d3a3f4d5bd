"""The control plane's own metrics (prometheus-client) and traces (OpenTelemetry).

Built in the composition root and passed in: no registration at import time, so every test and
every demo run gets fresh metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controlplane.actions import SIGNAL_OUTCOMES, SLO_OUTCOMES
from controlplane.config import Telemetry as TelemetryConfig
from controlplane.config import Tracing
from policies.types import ActionKind

__all__ = ["Telemetry"]


class Telemetry:
    """Metrics registry and tracer for one control-plane process."""

    def __init__(self, config: TelemetryConfig | None = None, *, span_exporter: SpanExporter | None = None) -> None:
        """Metrics always; spans per `config.tracing`, or to `span_exporter` when one is given."""
        self.registry = CollectorRegistry(auto_describe=True)
        ns = "fleet_controlplane"
        self.tick_duration = Histogram(
            f"{ns}_tick_duration_seconds", "Wall time of one control-loop tick.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry,
        )
        self.ticks = Counter(f"{ns}_ticks", "Control-loop ticks completed.", registry=self.registry)
        self.tick_failures = Counter(
            f"{ns}_tick_failures", "Ticks abandoned on an error (store outage, ...).", registry=self.registry
        )
        self.sizing_failures = Counter(
            f"{ns}_sizing_failures", "Pools the sizer failed on in a tick (the pool kept its size).", ["pool"],
            registry=self.registry,
        )
        self.policy_failures = Counter(
            f"{ns}_policy_failures", "Policies that raised in a tick (their findings kept as they were).", ["policy"],
            registry=self.registry,
        )
        self.scrape_errors = Counter(
            f"{ns}_scrape_errors", "Failed scrapes by target.", ["target"], registry=self.registry
        )
        self.parse_errors = Counter(
            f"{ns}_parse_errors", "Malformed exposition lines by target.", ["target"], registry=self.registry
        )
        self.targets = Gauge(f"{ns}_targets", "Scrape targets by state.", ["state"], registry=self.registry)
        self.signals_written = Counter(f"{ns}_signals_written", "Signals stored.", registry=self.registry)
        self.open_findings = Gauge(
            f"{ns}_open_findings", "Open findings by kind and severity.", ["kind", "severity"], registry=self.registry
        )
        self.actions = Counter(
            f"{ns}_actions", "Actions and held-back proposals by kind and result.", ["kind", "result"],
            registry=self.registry,
        )
        self.outcomes = Counter(
            f"{ns}_action_outcomes", "Actions carried out, by kind and judged outcome (recovered, not_recovered, "
            "held, breached, unmeasured).", ["kind", "outcome"], registry=self.registry,
        )
        # Every series an action can count starts at zero: increase() misses the first count of one born at one. The
        # sizer's scales and cordons are judged by their pools' SLOs, and any kind a policy asks for by its signal.
        for kind in ActionKind:
            slo_judged = SLO_OUTCOMES if kind in (ActionKind.SCALE_POOL, ActionKind.CORDON_NODE) else ()
            for outcome in dict.fromkeys((*SIGNAL_OUTCOMES, *slo_judged)):
                self.outcomes.labels(kind, outcome)
        self.last_tick = Gauge(
            f"{ns}_last_tick_timestamp_seconds", "Loop time of the last completed tick.", registry=self.registry
        )
        self.leader = Gauge(f"{ns}_leader", "1 while this replica leads (and may act), else 0.", registry=self.registry)
        self._provider = _provider(config or TelemetryConfig(), span_exporter)
        self.tracer = self._provider.get_tracer("fleet-controlplane") if self._provider else trace.NoOpTracer()

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        """A trace span around a block (a no-op when tracing is off)."""
        with self.tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def shutdown(self) -> None:
        """Flush spans still buffered for export."""
        if self._provider is not None:
            self._provider.shutdown()


def _provider(config: TelemetryConfig, exporter: SpanExporter | None) -> TracerProvider | None:
    if config.tracing is Tracing.OFF and exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "fleet-controlplane"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif config.tracing is Tracing.CONSOLE:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint)))
    return provider
