"""`fleetctl lab`: real vLLM engines behind a router, trace-driven traffic with faults, the control loop watching."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

__all__ = ["lab"]

_err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, highlight=False)
_out = Console(width=None if sys.stdout.isatty() else 160)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _phases(_ctx: click.Context, _param: click.Parameter, value: str) -> Any:
    from controlplane.lab.lab import parse_phases

    try:
        return parse_phases(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("lab")
@click.option("--engines", default=2, show_default=True, type=click.IntRange(1, 16), help="vLLM engines to start.")
@click.option("--router", "router", default="prefix", show_default=True, type=click.Choice(["prefix", "round_robin"]),
              help="Routing policy (phases may flip it).")
@click.option("--trace", default="mooncake", show_default=True,
              type=click.Choice(["mooncake", "mooncake-synthetic", "azure-conv", "azure-code"]),
              help="Workload trace the prompts and arrivals follow.")
@click.option("--phases", "phases", default="normal:60,unique:60,normal:60", show_default=True, callback=_phases,
              help="Timeline MODE:SECONDS,...; modes: normal, unique, random, json, burst, round_robin "
                   "(MODE@round_robin or MODE@prefix sets the router for one phase).")
@click.option("--rate", default=3.0, show_default=True, type=click.FloatRange(min=0.05),
              help="Requests per second of normal traffic (two CPU engines take about 4-5).")
@click.option("--interval", default=5.0, show_default=True, type=click.FloatRange(min=1.0),
              help="Scrape interval of the control loop, seconds.")
@click.option("--max-output-tokens", default=24, show_default=True, type=click.IntRange(1, 256),
              help="Cap on the trace's output lengths.")
@click.option("--db", default="sqlite:///lab.db", show_default=True, envvar="FLEETCTL_STORE_URL",
              help="Store URL for the control loop; env FLEETCTL_STORE_URL.")
@click.option("--fleet-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the lab's fleet file here (for `fleetctl run --config` against the running lab).")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the engine logs go (default: a new temporary folder).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def lab(engines: int, router: str, trace: str, phases: list[Any], rate: float, interval: float, max_output_tokens: int,
        db: str, fleet_file: Path | None, log_dir: Path | None, as_json: bool) -> None:
    """Start real vLLM engines (CPU build) behind a router, drive them with a trace in phases that inject
    faults, and run the control loop against them; exit 0 when the phases are done, 130 when interrupted,
    6 when the lab could not start."""
    from controlplane.lab.lab import LabSettings
    from controlplane.lab.loadgen import LoadSettings
    from controlplane.lab.router import RoutePolicy

    settings = LabSettings(engines=engines, router=RoutePolicy(router), trace=trace, db_url=db, scrape_interval=interval,
                           load=LoadSettings(rate=rate, max_output_tokens=max_output_tokens), log_dir=log_dir)
    total = sum(p.seconds for p in phases)
    _err.print(f"lab: starting {engines} vLLM engine(s) (about a minute on CPU); then {len(phases)} phase(s), "
               f"{total:.0f} s: {', '.join(f'{p.name} {p.seconds:g}s' for p in phases)}")
    report = asyncio.run(_run(settings, phases, fleet_file))
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        _summary(report)
    sys.exit(130 if report.interrupted else 0)


async def _run(settings: Any, phases: list[Any], fleet_file: Path | None) -> Any:
    from controlplane.lab.lab import run_lab

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def ready(lab: Any) -> None:
        ports = ", ".join(f"{pod} {e.base_url} ({e.startup_s:.0f} s)" for pod, e in zip(lab.pods, lab.engines, strict=True))
        _err.print(f"lab: engines ready: {ports}; router {lab.router.url} ({lab.router.policy}); logs {lab.log_dir}")
        if fleet_file is not None:
            fleet_file.write_text(lab.fleet_yaml(), encoding="utf-8")
            _err.print(f"lab: fleet file written to {fleet_file}")

    try:
        return await run_lab(settings, phases, stop=stop, on_tick=_print_tick, on_phase=_print_phase, on_ready=ready)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if stop.is_set():
            _err.print("lab: interrupted; every engine stopped")


def _print_tick(view: Any) -> None:
    s = view.signals
    drafts = s.get("spec_draft_rate")
    gen = s.get("generation_tokens_rate")
    per_token = drafts / gen if drafts is not None and gen else None
    line = (f"+{view.elapsed_s:5.0f}s {view.phase:<12} targets {view.targets_up}/{view.targets}  "
            f"req/s {_fmt(s.get('request_rate'), '.1f')}  hit {_fmt(s.get('prefix_cache_hit_rate'))}  "
            f"spec yield {_fmt(s.get('spec_yield'))}  drafts/token {_fmt(per_token)}  "
            f"findings {len(view.open_findings)}")
    for f in view.opened:
        line += f"  [red]opened {f}[/]"
    for f in view.resolved:
        line += f"  [green]resolved {f}[/]"
    _err.print(line)
    for key, error in view.errors.items():
        _err.print(f"  [yellow]{key}: {error}[/]")


def _print_phase(result: Any) -> None:
    p = result.pool
    t = result.traffic_stats
    _err.print(f"[bold]phase {result.name}[/] ({result.ended_at - result.started_at:.0f} s, router {result.router}): "
               f"{t.ok} ok, {t.errors} errors; hit rate {_fmt(p.get('prefix_cache_hit_rate'))}, "
               f"spec yield {_fmt(p.get('spec_yield'))}, routed {result.routed}")


def _summary(report: Any) -> None:
    t = Table(title="Lab phases (pool signals over each phase)")
    for col in ("phase", "router", "s", "ok", "errors", "hit rate", "spec yield", "drafts/token", "acceptance",
                "e2e mean s", "routed"):
        t.add_column(col)
    for r in report.phases:
        p = r.pool
        drafts, gen = p.get("spec_draft_rate"), p.get("generation_tokens_rate")
        t.add_row(r.name, r.router, f"{r.ended_at - r.started_at:.0f}", str(r.traffic_stats.ok),
                  str(r.traffic_stats.errors), _fmt(p.get("prefix_cache_hit_rate")), _fmt(p.get("spec_yield")),
                  _fmt(drafts / gen if drafts is not None and gen else None), _fmt(p.get("spec_acceptance_rate")),
                  _fmt(p.get("e2e_mean")), " ".join(f"{k}:{v}" for k, v in r.routed.items()))
    _out.print(t)
    f = Table(title="Findings of the control loop")
    for col in ("id", "kind", "subject", "state", "severity", "summary"):
        f.add_column(col)
    for x in report.findings:
        f.add_row(str(x["id"]), x["kind"], x["subject"], x["state"], x["severity"], x["summary"])
    _out.print(f)
