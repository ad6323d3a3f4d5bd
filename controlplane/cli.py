"""`fleetctl`: one entry point, subcommands grouped by noun.

Exit codes: 0 success; 1 a negative result the command exists to report; 2 inconclusive;
3 and above errors (3 bad input or configuration, 4 store unavailable, 5 actuation failed, 6 the real
lab could not start); 130 interrupted (Ctrl-C).
Commands that report take `--json`: one JSON object on stdout; logs go to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from catalog.redaction import without_credentials
from controlplane.errors import FleetError
from controlplane.store.records import MAX_ID

__all__ = ["main"]

DEFAULT_DB = "sqlite:///fleet.db"
# Tables keep their columns when piped (a CI log is not an 80-column terminal).
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def _goals(result: dict[str, Any], as_json: bool, *, gate: bool = True) -> None:
    """Print a report's goals under its table; with `gate`, exit 1 unless every goal holds."""
    from controlplane.goals import all_hold, goals_table

    goals = result.get("goals", [])
    if not as_json and goals:
        out.print(goals_table(goals))
    if gate and not all_hold(goals):
        sys.exit(1)


def _db_option(f: Any) -> Any:
    return click.option(
        "--db", "db", envvar="FLEETCTL_STORE_URL", default=DEFAULT_DB, show_default=True,
        help="Store URL (sqlite:///PATH or postgresql://...); env FLEETCTL_STORE_URL.",
    )(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """Observability and autotuning control plane for LLM inference fleets."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# config -------------------------------------------------------------------------------------

@cli.group()
def config() -> None:
    """Validate fleet files."""


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def config_check(file: Path, as_json: bool) -> None:
    """Validate FILE; exit 0 when valid, 1 when not."""
    from controlplane.config import load_config
    from controlplane.errors import ConfigError

    try:
        cfg = load_config(file)
    except ConfigError as exc:
        if as_json:
            _emit_json({"file": str(file), "valid": False, "problems": exc.problems})
        else:
            err.print(f"[red]{exc}[/]", highlight=False)
        sys.exit(1)
    if as_json:
        _emit_json({"file": str(file), "valid": True, "mode": str(cfg.mode), "pools": [p.name for p in cfg.pools],
                    "targets": len(cfg.targets)})
    else:
        out.print(f"{file}: valid ({len(cfg.pools)} pools, {len(cfg.targets)} targets, mode {cfg.mode})")


# db -----------------------------------------------------------------------------------------

@cli.group()
def db() -> None:
    """Schema migrations of the store."""


@db.command("upgrade")
@_db_option
@click.option("--revision", default="head", show_default=True)
def db_upgrade(db: str, revision: str) -> None:
    """Apply migrations up to REVISION."""
    from controlplane.store import migrate
    from controlplane.store.db import redact

    with _revision_named(revision):
        migrate.upgrade(db, revision)
    err.print(f"{redact(db)}: at revision {migrate.current(db)}")


@db.command("downgrade")
@_db_option
@click.option("--revision", required=True, help="Target revision; 'base' removes every table.")
def db_downgrade(db: str, revision: str) -> None:
    """Revert migrations down to REVISION."""
    from controlplane.store import migrate
    from controlplane.store.db import redact

    with _revision_named(revision):
        migrate.downgrade(db, revision)
    err.print(f"{redact(db)}: at revision {migrate.current(db) or 'base'}")


@contextlib.contextmanager
def _revision_named(revision: str) -> Iterator[None]:
    """A revision the migrations do not know is a usage error naming it, not a traceback."""
    from alembic.util import CommandError

    try:
        yield
    except CommandError as exc:
        raise click.BadParameter(f"{revision!r}: {exc}", param_hint="--revision") from None


@db.command("current")
@_db_option
@click.option("--json", "as_json", is_flag=True)
def db_current(db: str, as_json: bool) -> None:
    """Print the store's revision; exit 1 when it is not the shipped head."""
    from controlplane.store import migrate
    from controlplane.store.db import make_engine

    engine = make_engine(db, existing=True)  # a mistyped SQLite path is said, not made
    try:
        rev, head = migrate.current(engine), migrate.head()
    finally:
        engine.dispose()
    if as_json:
        _emit_json({"current": rev, "head": head, "up_to_date": rev == head})
    else:
        out.print(f"current {rev or 'none'} (head {head})")
    sys.exit(0 if rev == head else 1)


# run and demo -------------------------------------------------------------------------------

@cli.command()
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--db", envvar="FLEETCTL_STORE_URL", default=None,
              help="Override the fleet file's store URL; env FLEETCTL_STORE_URL (a Secret in the cluster).")
@click.option("--once", is_flag=True, help="Run one tick and exit (for checks).")
def run(config_file: Path, db: str | None, once: bool) -> None:
    """Run the control plane: the loop plus /metrics, /healthz and /readyz."""
    from controlplane.autoscaling import build_sizer
    from controlplane.config import load_config
    from controlplane.runtime import run_forever
    from controlplane.store.writer import SqlStore

    cfg = load_config(config_file)
    store = SqlStore.open(db or cfg.store.url)
    try:
        asyncio.run(run_forever(cfg, store, once=once, sizer=build_sizer(cfg)))
    finally:
        store.close()


@cli.command()
@click.option("--minutes", default=1.0, show_default=True, type=click.FloatRange(min=0.05),
              help="Wall-clock minutes; each shows an hour of fleet time.")
@click.option("--db", default="sqlite:///demo.db", show_default=True)
@click.option("--no-pace", is_flag=True, help="Run as fast as possible instead of pacing to --minutes.")
@click.option("--json", "as_json", is_flag=True)
def demo(minutes: float, db: str, no_pace: bool, as_json: bool) -> None:
    """Simulated fleet, injected prefix-cache fault, the loop finding it and acting."""
    from controlplane.demo import run_demo
    from controlplane.store.db import redact

    summary = asyncio.run(run_demo(minutes, db, err, pace=not no_pace))
    if as_json:
        _emit_json({"ok": summary.ok, "db": redact(db), "ticks": summary.ticks, "sim_seconds": summary.sim_seconds,
                    "wall_seconds": round(summary.wall_seconds, 1), "findings": summary.findings,
                    "actions": summary.actions})
    else:
        t = Table(title=f"Findings ({summary.ticks} ticks, {summary.sim_seconds / 60:.0f} fleet minutes, "
                        f"fault at {summary.fault_at / 60:.0f} min, repaired at {summary.repaired_at / 60:.0f} min)")
        for col in ("id", "kind", "subject", "severity", "state", "opened (min)", "resolved (min)", "cause"):
            t.add_column(col)
        for f in summary.findings:
            t.add_row(str(f["id"]), f["kind"], f["subject"], f["severity"], f["state"], f"{f['opened_at_s'] / 60:.1f}",
                      "-" if f["resolved_at_s"] is None else f"{f['resolved_at_s'] / 60:.1f}", str(f["cause"]))
        out.print(t)
        a = Table(title="Actions (audit log)")
        for col in ("id", "finding", "kind", "pool", "change", "state", "at (min)", "outcome"):
            a.add_column(col)
        for x in summary.actions:
            a.add_row(str(x["id"]), str(x["finding_id"]), x["kind"], x["pool"], x["change"], x["state"],
                      f"{x['at_s'] / 60:.1f}", str(x["outcome"] or "pending"))
        out.print(a)
        # As it was run: `make demo` runs .venv/bin/fleetctl, which is not on the PATH.
        exe = sys.argv[0] if Path(sys.argv[0]).name == "fleetctl" else "fleetctl"
        out.print(f"Open the dashboard: [bold]{exe} dashboard --db {redact(db)}[/]")
    sys.exit(0 if summary.ok else 1)


# findings, actions, runbooks ----------------------------------------------------------------

@cli.command()
@_db_option
@click.option("--all", "show_all", is_flag=True, help="Include resolved findings.")
@click.option("--json", "as_json", is_flag=True)
def findings(db: str, show_all: bool, as_json: bool) -> None:
    """List open (or all) findings with their evidence."""
    from controlplane.store.queries import ReadStore

    rows = ReadStore.open(db).findings(include_resolved=show_all)
    if as_json:
        _emit_json({"findings": rows})
        return
    t = Table(title="Findings")
    for col in ("id", "kind", "subject", "severity", "state", "summary"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["id"]), r["kind"], r["subject"], r["severity"], r["state"], r["summary"])
    out.print(t)


@cli.group(invoke_without_command=True)
@_db_option
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def actions(ctx: click.Context, db: str, as_json: bool) -> None:
    """List the audit log; `approve` or `reject` proposals."""
    ctx.obj = db
    if ctx.invoked_subcommand is not None:
        return
    from controlplane.store.queries import ReadStore

    rows = ReadStore.open(db).actions()
    if as_json:
        _emit_json({"actions": rows})
        return
    t = Table(title="Actions")
    for col in ("id", "finding", "kind", "pool", "state", "reason", "outcome"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["id"]), str(r["finding_id"]), r["kind"], r["pool"], r["state"], r["reason"], str(r["outcome"]))
    out.print(t)


def _decide(db: str, action_id: int, approve: bool, by: str, config: str | None) -> None:
    import time

    from controlplane.errors import ActionConflict
    from controlplane.store.records import MAX_NAME
    from controlplane.store.writer import SqlStore

    if not by.strip() or len(by) > MAX_NAME or not by.isprintable():
        raise click.BadParameter(f"who decides goes into the audit log as one line: 1 to {MAX_NAME} printable "
                                 "characters", param_hint="--by")
    # With the fleet file, a proposal past its time to live is refused here as the API refuses it; without, the loop
    # expires it at its next tick.
    if config:
        from controlplane.config import load_config

        ttl: float | None = load_config(Path(config)).rails.proposal_ttl
    else:
        ttl = None

    store = SqlStore.open(db)
    try:
        action = store.decide(action_id, approve=approve, by=by, now=time.time(), via="cli", ttl=ttl)
    except ActionConflict as exc:
        raise click.UsageError(f"action {action_id} is not awaiting approval (it is {exc.current})") from None
    finally:
        store.close()
    out.print(f"action {action_id} {action.state} by {by}")


@cli.command()
@_db_option
@click.option("--by", default=lambda: os.environ.get("USER", "operator"), help="Who pauses (audit).")
@click.option("--reason", required=True, help="Why; shown wherever acting is held back.")
def pause(db: str, by: str, reason: str) -> None:
    """The kill switch: stop all acting at once (every replica, before its next action); detection goes on."""
    import time

    from controlplane.store.records import Pause
    from controlplane.store.writer import SqlStore

    store = SqlStore.open(db)
    try:
        store.set_pause(Pause(by, reason, time.time()))
    finally:
        store.close()
    out.print(f"acting paused by {by}: {reason} (fleetctl resume to lift it)")


@cli.command()
@_db_option
def resume(db: str) -> None:
    """Lift the kill switch: approved and proposed actions may run again."""
    from controlplane.store.writer import SqlStore

    store = SqlStore.open(db)
    try:
        was = store.pause_state()
        store.set_pause(None)
    finally:
        store.close()
    out.print("acting resumed" + (f" (was paused by {was.by}: {was.reason})" if was else " (it was not paused)"))


ACTION_ID = click.IntRange(1, MAX_ID)  # as the store holds them


# Also after the subcommand, as the dashboard and the runbooks write it (`fleetctl actions approve 7 --db URL`).
_DECISION_DB = click.option("--db", "own_db", default=None, help="Store URL (default: the actions group's --db).")
_DECISION_CONFIG = click.option("--config", envvar="FLEETCTL_CONFIG", default=None, type=click.Path(dir_okay=False),
                                help="The fleet file: a proposal past its rails.proposal_ttl is refused as expired.")


@actions.command("approve")
@click.argument("action_id", type=ACTION_ID)
@click.option("--by", default=lambda: os.environ.get("USER", "operator"), help="Who approves (audit log).")
@_DECISION_DB
@_DECISION_CONFIG
@click.pass_obj
def actions_approve(db: str, action_id: int, by: str, own_db: str | None, config: str | None) -> None:
    """Approve a proposed action; the loop runs it on its next tick."""
    _decide(own_db or db, action_id, True, by, config)


@actions.command("reject")
@click.argument("action_id", type=ACTION_ID)
@click.option("--by", default=lambda: os.environ.get("USER", "operator"))
@_DECISION_DB
@_DECISION_CONFIG
@click.pass_obj
def actions_reject(db: str, action_id: int, by: str, own_db: str | None, config: str | None) -> None:
    """Reject a proposed action."""
    _decide(own_db or db, action_id, False, by, config)


@cli.command()
@click.argument("kind", required=False)
def runbook(kind: str | None) -> None:
    """Print the runbook for a finding KIND (without KIND: list them)."""
    from controlplane import runbooks

    if kind is None:
        for k in runbooks.available():
            click.echo(k)
        return
    try:
        click.echo(runbooks.load(kind))
    except KeyError:
        raise click.UsageError(f"no runbook for {kind!r}; known: {', '.join(runbooks.available())}") from None


# rules --------------------------------------------------------------------------------------

@cli.group()
def rules() -> None:
    """Static alert rules (the baseline the policies are measured against)."""


@rules.command("export")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the manifest to FILE instead of standard output.")
@click.option("--namespace", default=None, help="metadata.namespace of the PrometheusRule.")
@click.option("--runbook-base-url", default=None,
              help="Runbook links are URL/<kind>, or URL with {kind} filled in.  [default: a placeholder]")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Fleet file: SLO rules take each pool's configured objective as threshold, and runbook links "
                   "its alerting.runbook_base_url unless --runbook-base-url is given.")
def rules_export(out: Path | None, namespace: str | None, runbook_base_url: str | None, config_file: Path | None) -> None:
    """Write the static alert rules as a PrometheusRule manifest (monitoring.coreos.com/v1)."""
    from controlplane.config import load_config
    from controlplane.rules_export import build_manifest, dump_manifest

    cfg = load_config(config_file) if config_file is not None else None
    if runbook_base_url is None and cfg is not None and cfg.alerting is not None:
        runbook_base_url = cfg.alerting.runbook_base_url  # the links the control plane's own alerts carry
    text = dump_manifest(build_manifest(namespace=namespace, runbook_base_url=runbook_base_url, config=cfg))
    _manifests_to(out, text, f"PrometheusRule with {text.count('- alert: ')} rules")


def _manifests_to(out: Path | None, text: str, what: str) -> None:
    """Manifests to standard output, or to `out` with a line saying `what` was written."""
    if out is None:
        click.echo(text, nl=False)
        return
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"{out}: cannot write the manifests: {exc.strerror or exc}") from None
    err.print(f"{out}: {what}")


# rbac ---------------------------------------------------------------------------------------

@cli.group()
def rbac() -> None:
    """The Kubernetes RBAC the control plane needs."""


@rbac.command("export")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The fleet file whose workloads, router, Lease and kill switch are named.")
@click.option("--namespace", default="fleet-system", show_default=True,
              help="The control plane's own namespace (its service account's).")
@click.option("--service-account", default="fleet-controlplane", show_default=True)
@click.option("--follows", multiple=True, metavar="NAMESPACE/NAME",
              help="A Deployment a pool's Argo Rollout follows (spec.workloadRef); repeatable.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the manifests to FILE instead of standard output.")
def rbac_export(config_file: Path, namespace: str, service_account: str, follows: tuple[str, ...],
                out: Path | None) -> None:
    """Write Roles and bindings that name every object the fleet file lets the control plane change (a tighter
    replacement for the deploy base's per-resource rbac.yaml)."""
    import yaml

    from controlplane.config import load_config
    from controlplane.rbac import rbac_manifests

    try:
        docs = rbac_manifests(load_config(config_file), namespace=namespace, service_account=service_account,
                              follows=follows)
    except ValueError as exc:
        raise click.ClickException(f"{config_file}: {exc}") from None
    _manifests_to(out, yaml.safe_dump_all(docs, sort_keys=False),
                  f"{sum(d['kind'].endswith('Role') for d in docs)} roles and their bindings")


# simulator ----------------------------------------------------------------------------------

@cli.group()
def sim() -> None:
    """The trace-driven simulator."""


@sim.command("validate")
@click.option("--json", "as_json", is_flag=True)
def sim_validate(as_json: bool) -> None:
    """Check the performance model against its profiles and the Mooncake prefix-cache hit ratios; exit 1 on a miss."""
    from controlplane.sim.validate import render, validate

    result = validate(progress=lambda msg: err.print(msg, highlight=False))
    if as_json:
        _emit_json(result)
    else:
        click.echo(render(result))
    _goals(result, as_json)


# probes -------------------------------------------------------------------------------------

@sim.command("list")
def sim_list() -> None:
    """The shipped scenarios."""
    from controlplane.sim.scenario import builtin_scenarios, load_scenario

    t = Table(title="Scenarios (fleetctl sim run NAME)")
    for col in ("name", "trace", "duration", "faults", "description"):
        t.add_column(col)
    for name in builtin_scenarios():
        sc = load_scenario(name)
        faults = ", ".join(f"{f.kind}@{f.at / 60:g}m" for f in sc.faults) or "none (fault-free replay)"
        t.add_row(name, sc.trace.label, f"{sc.duration / 60:g} min", faults, " ".join(sc.description.split()))
    out.print(t)


@sim.command("run")
@click.argument("scenario")
@click.option("--speed", type=click.FloatRange(min=0.01), default=None,
              help="Simulated seconds per wall second (default: as fast as possible).")
@click.option("--db", default="sqlite:///sim.db", show_default=True)
@click.option("--mode", type=click.Choice(["observe", "propose", "act"]), default="observe", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def sim_run(scenario: str, speed: float | None, db: str, mode: str, as_json: bool) -> None:
    """Serve a scenario's simulated fleet over loopback and run the control loop against it."""
    from controlplane.sim.run import Timeline, run_scenario
    from controlplane.sim.scenario import load_scenario
    from controlplane.store.db import redact

    sc = load_scenario(scenario)
    sc.check()
    timeline = Timeline()

    def show(run: Any, report: Any) -> None:
        for line in timeline.lines(run, report):
            err.print(line, highlight=False)

    run = asyncio.run(run_scenario(sc, db, mode=mode, speed=speed, on_tick=show))
    summary = {"scenario": sc.name, "ticks": run.ticks, "simulated_s": run.elapsed, "wall_s": round(run.wall_s, 2),
               "engines": len(run.fleet.serving()), "requests": run.fleet.arrived, "events": run.events, "db": redact(db)}
    if as_json:
        _emit_json(summary)
    else:
        out.print(f"{sc.name}: {run.ticks} ticks, {run.elapsed / 60:.0f} fleet minutes in {run.wall_s:.1f} s; "
                  f"findings in {redact(db)} (fleetctl findings --all --db {redact(db)})")


@cli.command("eval")
@click.option("--scenario", "scenarios", multiple=True, help="A shipped scenario or a scenario file; repeatable. Default: all.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".eval"), show_default=True,
              help="Where each scenario's database goes.")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="Scenarios run at once, each in its own process.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="Runs per scenario: variants with other seeds and trace windows 5 min apart.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw delays and false alarms per kind into this .png, .svg or .html file.")
@click.option("--mode", type=click.Choice(["observe", "act"]), default="observe", show_default=True,
              help="observe: detection against static rules; act: SLO-breach minutes acting against observing.")
@click.option("--json", "as_json", is_flag=True)
def eval_(scenarios: tuple[str, ...], workdir: Path, jobs: int, repeats: int, plot: Path | None, mode: str,
          as_json: bool) -> None:
    """Detection delay, precision, recall and false alarms of the policies against static alert rules;
    with --mode act, what acting achieves against observing on the same replays."""
    from controlplane.evaluation import evaluate
    from controlplane.sim.run import mmss

    workdir.mkdir(parents=True, exist_ok=True)
    if mode == "act":
        if plot is not None:
            raise click.BadParameter("--plot draws detection figures; it does not apply to --mode act",
                                     param_hint="--plot")
        _eval_act(scenarios, workdir, jobs, repeats, as_json)
        return

    def progress(name: str, result: Any) -> None:
        if result is None:
            err.print(f"[bold]{name}[/] ...")
        else:
            found = ", ".join(f"{f.detector}: {f.kind} {f.subject} at {mmss(f.opened_s)}" for f in result.findings)
            err.print(f"  {name}: {result.engine_hours:.1f} engine-hours in {result.wall_s:.0f} s; "
                      f"{found or 'no findings'}")

    if plot is not None:
        from controlplane.evaluation_chart import CHART_FORMATS, CHART_SUFFIXES, save_eval_chart

        if plot.suffix.lower() not in CHART_SUFFIXES:  # before the run, not after it
            raise click.BadParameter(f"{plot}: write the chart as {CHART_FORMATS}", param_hint="--plot")
    report = evaluate(list(scenarios) or None, workdir, progress, jobs, repeats)
    data = report.as_dict()
    if plot is not None:
        err.print(f"chart: {save_eval_chart(data, plot)}")
    if as_json:
        _emit_json(data)
        return
    t = Table(title=f"Detection over {len(report.scenarios)} scenario(s), {report.engine_hours:.0f} engine-hours "
                    f"({report.fault_free_hours:.0f} fault-free)")
    for col in ("kind", "detector", "detected", "recall", "precision", "delay p50 (s / intervals)",
                "delay p90 (s / intervals)", "false alarms", "per 1000 engine-h"):
        t.add_column(col)

    def fmt(v: float | None, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    for k in data["scores"]:
        t.add_row(k["kind"], k["detector"], f"{k['detected']}/{k['truths']}", fmt(k["recall"]), fmt(k["precision"]),
                  f"{fmt(k['delay_median_s'], '.0f')} / {fmt(k['delay_median_intervals'], '.1f')}",
                  f"{fmt(k['delay_p90_s'], '.0f')} / {fmt(k['delay_p90_intervals'], '.1f')}", str(k["false_alarms"]),
                  fmt(k["false_alarms_per_1000_engine_hours"], ".1f"))
    out.print(t)
    summary = data["summary"]
    for detector in ("policies", "static rules"):
        s = summary[detector]
        out.print(f"{detector}: {s['detected']}/{s['truths']} faults found, median delay "
                  f"{fmt(s['delay_median_s'], '.0f')} s ({fmt(s['delay_median_intervals'], '.1f')} intervals), "
                  f"{s['false_alarms']} false alarms ({fmt(s['false_alarms_per_1000_engine_hours'], '.1f')} per 1000 "
                  f"engine-hours; fault-free replays: {s['false_alarms_fault_free']})")
    out.print(f"median speed-up over the static rules: {fmt(summary['speedup_median'], '.1f')}x")
    # An evaluation reports; its goals are judged over many scenarios, so it does not gate by itself.
    _goals(data, as_json, gate=False)


def _eval_act(scenarios: tuple[str, ...], workdir: Path, jobs: int, repeats: int, as_json: bool) -> None:
    from controlplane.evaluation_act import evaluate_acting

    def progress(name: str, result: Any) -> None:
        if result is None:
            err.print(f"[bold]{name}[/] ...")
        else:
            err.print(f"  {name}: {result.breach_s / 60:.1f} min of SLO breach, {len(result.actions)} action(s) "
                      f"in {result.wall_s:.0f} s")

    data = evaluate_acting(list(scenarios) or None, workdir, progress, jobs, repeats).as_dict()
    if as_json:
        _emit_json(data)
        return
    t = Table(title="SLO-breach minutes during each fault: acting against observing, same replays")
    for col in ("fault", "scenarios", "fault min", "breach min observing", "breach min acting", "ratio", "actions"):
        t.add_column(col)
    for row in data["faults"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        t.add_row(row["fault"], ", ".join(row["scenarios"]), f"{row['fault_min']:.0f}",
                  f"{row['observe_breach_min']:.1f}", f"{row['act_breach_min']:.1f}", ratio,
                  "\n".join(row["actions"]) or "none")
    out.print(t)
    for row in data["fault_free"]:
        out.print(f"fault-free {row['scenario']}: {row['remedial_actions']} remedial action(s)"
                  + (f" ({'; '.join(row['actions'])})" if row["actions"] else ""))
    _goals(data, as_json, gate=False)


@cli.group()
def autoscale() -> None:
    """The SLO-driven autoscaler: what it would set now, and how it compares."""


@autoscale.command("plan")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False, path_type=Path))
@_db_option
@click.option("--pool", "pools", multiple=True, help="Only this pool; repeatable. Default: every pool.")
@click.option("--json", "as_json", is_flag=True)
def autoscale_plan(config_file: Path, db: str, pools: tuple[str, ...], as_json: bool) -> None:
    """What the autoscaler would set each pool to now, and why: the forecast, the curves, the SLO margins."""
    import time

    from controlplane.autoscaling import plan_from_store
    from controlplane.config import load_config
    from controlplane.store.threaded import ThreadedStore

    cfg = load_config(config_file)
    unknown = sorted(set(pools) - {p.name for p in cfg.pools})
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)} is not a pool of {config_file}", param_hint="--pool")
    store = ThreadedStore.open(db)
    try:
        sizing = asyncio.run(plan_from_store(cfg, store, time.time()))
    finally:
        store.close()
    plans = [p for p in sizing.plans if not pools or p.pool in pools]
    unplanned = {pool: why for pool, why in sizing.unplanned.items() if not pools or pool in pools}
    failed = {pool: error for pool, error in sizing.errors().items() if not pools or pool in pools}
    if as_json:
        _emit_json({"plans": [{"pool": p.pool, "desired": p.desired, "ready": p.ready, "target": p.target,
                               "recommended": p.recommended, "reason": p.reason, "evidence": p.evidence} for p in plans],
                    "unplanned": unplanned, "failed": failed})
    else:
        if plans:
            t = Table(title="Autoscaler plan")
            for col in ("pool", "now", "ready", "target", "why", "curves"):
                t.add_column(col)
            for p in plans:
                curves = "; ".join(f"{k.split('_')[0].upper()}: {v['source']} ({v['points']} points)"
                                   for k, v in p.evidence.items() if k.endswith("_curve"))
                t.add_row(p.pool, str(p.desired), str(p.ready), str(p.target), p.reason, curves)
            out.print(t)
        for pool, why in sorted(unplanned.items()):
            out.print(f"{pool} keeps its size, not planned now: {why}")
    for pool, error in sorted(failed.items()):
        err.print(f"the sizer failed on {pool}, which keeps its size: {error}")
    if failed:
        raise SystemExit(1)


@autoscale.command("eval")
@click.option("--trace", "traces", multiple=True,
              help="azure-conv, azure-code, mooncake-conversation, servegen-day, or a scenario; repeatable. Default: all.")
@click.option("--minutes", type=click.FloatRange(min=1), default=None, help="Replay only this much of each trace.")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1), help="Replays run at once.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw load, replicas and SLO attainment over time into this .png, .svg or .html file.")
@click.option("--peers", type=click.Choice(["dynamo"]), multiple=True,
              help="Also run a peer's autoscaler on the same replays, in every configuration tried (dynamo: NVIDIA "
                   "Dynamo's planner, from `make bench-dynamo-venv`).")
@click.option("--dynamo-python", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The Dynamo environment's python (default $FLEET_DYNAMO_PYTHON, else the one the make target builds).")
@click.option("--dynamo-config", "dynamo_configs", multiple=True,
              help="Only these of Dynamo's configurations (repeatable; default all).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Judge this fleet file's `autoscaling` settings (its scale-down hold, headroom, margins) as ours, "
                   "not the defaults.")
@click.option("--json", "as_json", is_flag=True)
def autoscale_eval(traces: tuple[str, ...], minutes: float | None, jobs: int, plot: Path | None, peers: tuple[str, ...],
                   dynamo_python: Path | None, dynamo_configs: tuple[str, ...], config_path: Path | None,
                   as_json: bool) -> None:
    """Static peak, HPA-style, this autoscaler, the best causal rule in hindsight and the oracle (and any peers) on the
    same replays: GPU-hours and SLO attainment."""
    from controlplane.evaluation_autoscale import TRACES, Peer, evaluate_autoscaling, peer_goal
    from controlplane.evaluation_chart import CHART_FORMATS, CHART_SUFFIXES, save_autoscale_chart

    if plot is not None and plot.suffix.lower() not in CHART_SUFFIXES:
        raise click.BadParameter(f"{plot}: write the chart as {CHART_FORMATS}", param_hint="--plot")
    peer_list: list[Peer] = []
    if "dynamo" in peers:
        from bench.dynamo_shootout import CONFIGURATIONS, DynamoError, DynamoPeer, check_environment, default_python

        unknown = sorted(set(dynamo_configs) - set(CONFIGURATIONS))
        if unknown:
            raise click.BadParameter(f"{', '.join(unknown)}: not one of {', '.join(CONFIGURATIONS)}",
                                     param_hint="--dynamo-config")
        python = dynamo_python or default_python()
        try:
            err.print(f"Dynamo's planner: ai-dynamo {check_environment(python)} at {python}")
        except DynamoError as exc:
            raise click.ClickException(str(exc)) from None
        peer_list.append(DynamoPeer(python, dynamo_configs or tuple(CONFIGURATIONS)))

    def progress(name: str, result: Any) -> None:
        if result is not None:
            err.print(f"  {name}: done")

    settings = None
    if config_path is not None:
        from controlplane.config import load_config
        from controlplane.errors import ConfigError

        try:
            settings = load_config(config_path).autoscaling.model_copy(update={"enabled": True})
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--config") from None
    reports = []
    for trace in traces or tuple(TRACES):
        err.print(f"[bold]{trace}[/] ...")
        try:
            reports.append(evaluate_autoscaling(trace, minutes=minutes, jobs=jobs, settings=settings, peers=peer_list,
                                                progress=progress))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--config") from None
    data = {"goals": [g for r in reports for g in r.as_json()["goals"]], "traces": [r.as_json() for r in reports]}
    data["goals"] += [peer_goal(reports, p.name).as_dict() for p in peer_list]
    if plot is not None:
        err.print(f"chart: {save_autoscale_chart(data, plot)}")
    if as_json:
        _emit_json(data)
        return
    for r in reports:
        t = Table(title=f"{r.trace}: the same replay under each strategy")
        for col in ("strategy", "GPU-hours", "minutes within both SLOs", "scale events", "GPU-hours / oracle's"):
            t.add_column(col)
        for row in r.rows():
            ratio = "-" if row["vs_oracle"] is None else f"{row['vs_oracle']:.2f}"
            name = f"{row['strategy']} ({row['configuration']})" if row["configuration"] else row["strategy"]
            t.add_row(name, f"{row['gpu_hours']:.2f}",
                      f"{row['attainment']:.1%} ({row['minutes_within']}/{row['minutes']})", str(row["scale_events"]),
                      ratio)
        out.print(t)
        if r.peers:
            t = Table(title=f"{r.trace}: every peer configuration tried")
            for col in ("peer", "configuration", "GPU-hours", "minutes within both SLOs", "scale events"):
                t.add_column(col)
            for row in r.peer_rows():
                t.add_row(row["strategy"], row["configuration"], f"{row['gpu_hours']:.2f}",
                          f"{row['attainment']:.1%} ({row['minutes_within']}/{row['minutes']})", str(row["scale_events"]))
            out.print(t)
    _goals(data, as_json, gate=False)


@cli.group(invoke_without_command=True)
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@_db_option
@click.option("--pool", "pools", multiple=True, help="Only this pool; repeatable. Default: every pool.")
@click.option("--since", default="24h", show_default=True, help="How much history to read (e.g. 30m, 24h, 7d).")
@click.option("--record/--no-record", default=True, show_default=True,
              help="Keep the advice with its predicted effect, and score earlier advice the fleet has followed since.")
@click.option("--prefix-trace", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The prompts' prefix-block hashes in arrival order (Mooncake JSONL: hash_ids of 512-token blocks, "
                   "e.g. exported from llm-d KV events): the KV-tier question is then answered by an LRU replay.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def advise(ctx: click.Context, config_file: Path | None, db: str, pools: tuple[str, ...], since: str, record: bool,
           prefix_trace: Path | None, as_json: bool) -> None:
    """The deployment advisor: disaggregation, pool ratio, KV tier, FP8 KV, speculation and parallel layout,
    each with its evidence, estimated effect and confidence; and how right its earlier advice turned out."""
    if ctx.invoked_subcommand is not None:
        return
    import time

    from catalog.settings import duration
    from controlplane.advice import accuracy, advise_and_score
    from controlplane.config import load_config
    from controlplane.store.threaded import ThreadedStore

    if config_file is None:
        raise click.UsageError("give the fleet file with --config")
    try:
        window = float(duration(since))
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(f"{since!r}: {exc}", param_hint="--since") from None
    cfg = load_config(config_file)
    unknown = sorted(set(pools) - {p.name for p in cfg.pools})
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)} is not a pool of {config_file}", param_hint="--pool")
    blocks: dict[str, list[tuple[int, ...]]] = {}
    block_tokens = 16
    if prefix_trace is not None:
        from controlplane.sim.traces import MOONCAKE_BLOCK_TOKENS, load_mooncake

        hashes = [tuple(r.hash_ids) for r in load_mooncake(prefix_trace) if r.hash_ids]
        blocks = {p.name: hashes for p in cfg.pools if str(p.role) != "decode" and (not pools or p.name in pools)}
        block_tokens = MOONCAKE_BLOCK_TOKENS
    now = time.time()
    store = ThreadedStore.open(db)

    async def run() -> tuple[Any, Any]:
        done = await advise_and_score(cfg, store, now, now - window, pools=pools, record=record, prefix_blocks=blocks,
                                      prefix_block_tokens=block_tokens)
        return done, accuracy(await store.advice(states=("applied",)))

    try:
        result, scores = asyncio.run(run())
    finally:
        store.close()
    recs = result.recommendations
    rows: list[dict[str, Any]] = [
        {"kind": r.kind.value, "pool": r.pool, "act": r.act, "advice": r.advice, "change": dict(r.change),
         "effect": {"metric": r.effect.metric, "before": r.effect.before, "after": r.effect.after,
                    "saving_per_day": r.effect.saving_per_day, "gpu_hours_per_day": r.effect.gpu_hours_per_day},
             "confidence": r.confidence, "evidence": dict(r.evidence), "runbook": r.runbook} for r in recs]
    scored = [{"id": r.id, "kind": r.kind, "pool": r.pool, "metric": r.metric, "predicted": r.predicted,
               "measured": r.measured, "error": r.error} for r in result.scored]
    if as_json:
        _emit_json({"recommendations": rows, "scored_now": scored, "accuracy": scores})
        return
    for r in scored:
        out.print(f"advice #{r['id']} ({r['kind']} on {r['pool']}) was followed: {r['metric']} predicted "
                  f"{r['predicted']:.4g}, measured {r['measured']:.4g} ({r['error']:+.0%})")
    if scores:
        out.print("advisor accuracy so far: " + "; ".join(
            f"{k}: {v['scored']} scored, median error {v['median_abs_error']:.0%}" for k, v in scores.items()))
    if not rows:
        out.print(f"no pool reported load in the last {since}: nothing to advise on")
        return
    t = Table(title=f"Advice from the last {since}")
    for col in ("pool", "question", "advice", "$/day", "confidence", "runbook"):
        t.add_column(col)
    for r in rows:
        saving = r["effect"]["saving_per_day"]
        t.add_row(r["pool"], r["kind"], ("" if r["act"] else "[dim]") + r["advice"],
                  "-" if saving is None else f"{saving:+,.0f}", f"{r['confidence']:.2f}", r["runbook"])
    out.print(t)


@advise.command("eval")
@click.option("--case", "cases", multiple=True, help="Only this case; repeatable. Default: all five.")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1), help="Replays run at once.")
@click.option("--seeds", default=None, type=click.IntRange(min=1),
              help="Seeds whose minutes the simulator's truth is taken over. Default: 5.")
@click.option("--json", "as_json", is_flag=True)
def advise_eval(cases: tuple[str, ...], jobs: int, seeds: int | None, as_json: bool) -> None:
    """The advisor on scenarios whose answer is known: right answers, and estimated savings against what the
    simulator measures with the advice applied."""
    from controlplane.evaluation_advise import CASES, SEEDS, evaluate_advice

    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not one of {', '.join(CASES)}", param_hint="--case")

    def progress(name: str, result: Any) -> None:
        if result is not None:
            err.print(f"  {name}: done")

    data = evaluate_advice(list(cases) or None, jobs, progress, seeds or SEEDS)
    if as_json:
        _emit_json(data)
        return
    t = Table(title="The advisor on known-answer scenarios")
    for col in ("case", "advice", "right", "estimated $/day", "measured $/day", "per seed", "error",
                "engines as is -> advised"):
        t.add_column(col)
    for c in data["cases"]:
        err_ = "-" if c["error"] is None else f"{c['error']:.0%}"
        est = "-" if c["estimated_saving_per_day"] is None else f"{c['estimated_saving_per_day']:+,.0f}"
        seeds_ = c["measured_by_seed"]
        spread = f"{min(seeds_):+,.0f} to {max(seeds_):+,.0f}" if seeds_ else "-"
        t.add_row(c["case"], c["advice"], "yes" if c["right_answer"] else "NO", est,
                  f"{c['measured_saving_per_day']:+,.0f}", spread, err_, f"{c['engines_before']} -> {c['engines_after']}")
    out.print(t)
    _goals(data, as_json, gate=False)


@cli.group(invoke_without_command=True)
@click.option("--pool", help="The pool whose rollout is judged.")
@click.option("--baseline", help="Selector of the baseline pods: a label selector over pool, pod, role (and a "
                                 "source's own labels), plus key=~regex.")
@click.option("--canary", help="Selector of the canary pods, the same way.")
@click.option("--config", "gate_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Gate settings (YAML): metrics with their allowed shift, alpha, step, max_window "
                   "(default: the --fleet file's policies.canary_regression.gate).")
@click.option("--max-window", default=None, help="Answer by then (default 30m, or the settings').")
@click.option("--step", default=None, help="How often the gate reads and judges (default 30s, or the settings').")
@click.option("--start", "start", default=None, type=float, help="When the canary started (epoch seconds); default now. "
              "A past start judges the recorded history at once.")
@click.option("--source", "source_kind", type=click.Choice(["store", "prometheus", "targets"]), default="store",
              show_default=True, help="Where the numbers come from: the control plane's store, a Prometheus that "
              "scrapes the engines, or the engines' /metrics directly (the fleet file's targets or discovery).")
@click.option("--fleet", "fleet_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The fleet file: its prometheus section or its targets (for --source prometheus or targets).")
@click.option("--prometheus-url", default=None,
              help="Prometheus to read (instead of the fleet file's url; its selector and label names still apply).")
@_db_option
@click.option("--record/--no-record", default=None, help="Keep the verdict in the store (default: with --source store).")
@click.option("--report", "report_fmt", type=click.Choice(["junit", "json", "markdown"]), default=None,
              help="Write a report in this format (to --out, else standard output).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--name", "gate_name", default="canary", show_default=True, help="The gate's name in reports and the store.")
@click.pass_context
def gate(ctx: click.Context, pool: str | None, baseline: str | None, canary: str | None, gate_file: Path | None,
         max_window: str | None, step: str | None, start: float | None, source_kind: str, fleet_file: Path | None,
         prometheus_url: str | None, db: str, record: bool | None, report_fmt: str | None, out_file: Path | None,
         gate_name: str) -> None:
    """Judge a canary against its baseline until a verdict: exit 0 pass, 1 fail, 2 inconclusive or marginal.

    Anytime-valid: the gate reads and judges every step and stops at the first decision, with its
    false-fail rate bounded however often it looks. `fleetctl gate eval` measures it.
    """
    if ctx.invoked_subcommand is not None:
        return
    missing = [f"--{n}" for n, v in (("pool", pool), ("baseline", baseline), ("canary", canary)) if not v]
    if missing:
        raise click.UsageError(f"{', '.join(missing)} required (or a subcommand: eval)")
    assert pool is not None and baseline is not None and canary is not None
    if start is not None and not (math.isfinite(start) and start <= time.time() + 60.0):
        # A start ahead made the gate wait for it in silence (epoch milliseconds: for decades); NaN judged forever.
        raise click.BadParameter(f"{start:g} is not a time up to now in epoch seconds", param_hint="--start")
    if out_file is not None and not os.access(out_file.parent, os.W_OK):
        # Checked before the gate runs (up to its window): a verdict whose report cannot be written loses its exit code.
        raise click.BadParameter(f"{out_file}: its folder does not exist or cannot be written", param_hint="--out")
    verdict = asyncio.run(_gate(pool, baseline, canary, gate_file, max_window, step, start, source_kind,
                                          fleet_file, prometheus_url, db, record, gate_name))
    from controlplane.gate import EXIT_CODES, report

    if report_fmt is not None:
        text = report(verdict, report_fmt, gate=gate_name, pool=pool, baseline=baseline, canary=canary)
        if out_file is not None:
            try:
                out_file.write_text(text)
                err.print(f"report: {out_file}")
            except OSError as exc:  # the verdict's exit code stands; the report is said to be missing
                err.print(f"report not written to {out_file}: {exc.strerror or exc}")
        else:
            click.echo(text)
    if report_fmt is None or out_file is not None:
        t = Table(title=f"Canary gate on {pool}: {verdict.outcome.value}")
        for col in ("metric", "result", "baseline", "canary", "shift", "interval", "allowed", "blocks"):
            t.add_column(col)
        for m in verdict.metrics:
            t.add_row(m.name + (" *" if m.critical else ""), m.outcome.value, _g(m.baseline), _g(m.canary),
                      _g(m.estimate), f"{_g(m.lower)} to {_g(m.upper)}", _g(m.threshold), str(m.blocks))
        err.print(t)
        err.print(verdict.reason)
    sys.exit(EXIT_CODES[verdict.outcome])


def _http_url(url: str) -> bool:
    """Whether `url` is an http(s) URL with a host, and a port that is a number if it has one."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a port that is no number
    except ValueError:  # an unclosed IPv6 bracket, too
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


async def _gate(pool: str, baseline: str, canary: str, gate_file: Path | None, max_window: str | None,
                step: str | None, start: float | None, source_kind: str, fleet_file: Path | None,
                prometheus_url: str | None, db: str, record: bool | None, gate_name: str) -> Any:
    import contextlib

    from pydantic import ValidationError

    from collectors.prometheus_api import PrometheusSource
    from collectors.scraper import Scraper
    from controlplane.actuators.base import StaticTargets
    from controlplane.clock import WallClock
    from controlplane.config import Scrape, load_config, parse_yaml
    from controlplane.errors import GateInputError
    from controlplane.gate import ArmSelector, PromGateSource, StoreGateSource, TargetsGateSource, run_gate
    from controlplane.runtime import discovered_targets, prometheus_source, scrape_client, static_targets
    from controlplane.store.records import NewVerdict
    from controlplane.store.threaded import ThreadedStore
    from policies.canary import GateSettings, step_problem

    cfg = load_config(fleet_file) if fleet_file else None
    if cfg is not None and pool not in {p.name for p in cfg.pools}:
        # Read as no data, a mistyped pool held the gate its whole window and then said inconclusive.
        raise click.BadParameter(f"{pool!r} is not a pool of {fleet_file} (its pools: "
                                 f"{', '.join(p.name for p in cfg.pools)})", param_hint="--pool")
    if prometheus_url is not None and not _http_url(prometheus_url):
        raise click.BadParameter(f"{without_credentials(prometheus_url)!r} is not an http(s) URL with a host",
                                 param_hint="--prometheus-url")
    text = gate_file.read_text() if gate_file else None  # noqa: ASYNC240 (read once, before the gate starts)
    if text is not None:
        settings = parse_yaml(text, GateSettings, str(gate_file))
    else:  # the fleet file's rules, as its control plane's loop and API judge
        settings = cfg.policies.canary_regression.gate if cfg is not None else GateSettings()
    overrides = {k: v for k, v in (("max_window", max_window), ("step", step)) if v is not None}
    if overrides:
        try:
            settings = GateSettings.model_validate({**settings.model_dump(), **overrides})
        except ValidationError as exc:
            problems = "; ".join(("--" + "-".join(map(str, e["loc"])).replace("_", "-") + ": " if e["loc"] else "")
                                 + e["msg"].removeprefix("Value error, ") for e in exc.errors(include_url=False))
            raise GateInputError(problems) from None
    # The store holds the loop's scrapes; the other sources' scrape intervals are not known here.
    if source_kind == "store" and cfg is not None and (why := step_problem(settings.step, cfg.scrape.interval)):
        raise GateInputError(f"{'--step' if step is not None else 'step'} {why}")
    base_sel, can_sel, pool_sel = (ArmSelector.parse(s) for s in (baseline, canary, f"pool={pool}"))
    record = source_kind == "store" if record is None else record
    store = ThreadedStore.open(db) if record or source_kind == "store" else None
    clock = WallClock()
    with contextlib.ExitStack() as stack:
        if store is not None:
            stack.callback(store.close)
        client = None
        if source_kind == "store":
            assert store is not None
            role = next((str(p.role) for p in cfg.pools if p.name == pool), None) if cfg is not None else None
            # Without the fleet file its scrape interval is not known: the default's.
            interval = cfg.scrape.interval if cfg is not None else Scrape().interval
            source: Any = StoreGateSource(store, pool, base_sel, can_sel, settings.metrics, role=role,
                                          scrape_interval=interval)
        elif source_kind == "prometheus":
            if cfg is not None and cfg.prometheus is not None:  # its selector and label names, at --prometheus-url
                prom = prometheus_source(cfg, url=prometheus_url)
            elif prometheus_url:
                prom = PrometheusSource(prometheus_url)
            else:
                raise click.UsageError("--source prometheus needs --prometheus-url or a fleet file with a prometheus section")
            stack.callback(prom.close)
            source = PromGateSource(prom, pool_sel.narrowed(base_sel), pool_sel.narrowed(can_sel), settings.metrics)
        else:
            if cfg is None:
                raise click.UsageError("--source targets needs --fleet with the targets (a static list or discovery)")
            if start is not None and start < clock.now() - settings.step:
                # Each step is the pods' counters now less a step ago: past steps would all read the last moments.
                raise click.UsageError("--source targets reads the pods live and keeps no history: a past --start "
                                       "needs --source store or prometheus")
            discovered = discovered_targets(cfg, stack)
            found = discovered if discovered is not None else StaticTargets(static_targets(cfg))
            client = scrape_client(cfg)
            # No backoff: one scrape a step is no load, and a canary pod that answers again counts at once.
            scraper = Scraper(client, concurrency=cfg.scrape.concurrency, timeout_s=cfg.scrape.timeout,
                              backoff_max_s=0.0)
            source = TargetsGateSource(scraper, found, pool_sel.narrowed(base_sel), pool_sel.narrowed(can_sel),
                                       settings.metrics)

        def progress(v: Any) -> None:
            err.print(f"{(v.ended_at - v.started_at) / 60:5.1f} min  {v.outcome.value:12s} {v.reason[:160]}")

        try:
            if isinstance(source, TargetsGateSource):
                await source.arms()  # a selector that matches no pod is told now, not a step later
            verdict = await run_gate(source, settings, clock, start=start, on_step=progress)
        finally:
            if client is not None:
                await client.aclose()
        if record and store is not None:
            try:
                vid = await store.record_verdict(NewVerdict(gate_name, pool, baseline, canary, verdict.started_at,
                                                            verdict.ended_at, verdict.outcome.value, verdict.score,
                                                            verdict.as_dict()))
                err.print(f"verdict #{vid} recorded")
            except FleetError as exc:  # the verdict and its exit code stand: a pipeline rolls back on them
                err.print(f"verdict not recorded: {exc}")
    return verdict


@gate.command("eval")
@click.option("--seeds", default=10, show_default=True, type=click.IntRange(min=1),
              help="Runs of each regression case (TPOT and TTFT at +5, +10, +20 %, 5 and 20 % shares).")
@click.option("--aa-runs", default=10, show_default=True, type=click.IntRange(min=1),
              help="A/A runs; each gives fifty A/A gates (every engine and every block of four as the canary).")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1), help="Runs at once.")
@click.option("--json", "as_json", is_flag=True)
def gate_eval(seeds: int, aa_runs: int, jobs: int, as_json: bool) -> None:
    """This judge, a Kayenta-style Mann-Whitney judge and an Argo-style threshold on the same simulated rollouts."""
    from controlplane.evaluation_gate import JUDGES, evaluate_gate

    done = [0]

    def progress(name: str, result: Any) -> None:
        if result is not None:
            done[0] += 1
            err.print(f"  [{done[0]}] {name}: done")

    report = evaluate_gate(seeds=seeds, aa_runs=aa_runs, jobs=jobs, progress=progress)
    data = report.as_json()
    if as_json:
        _emit_json(data)
    else:
        t = Table(title=f"Canary judges on simulated rollouts ({seeds} seeds per case, {aa_runs} A/A runs; "
                        f"consulted every 30 s for up to 20 min)")
        t.add_column("case")
        t.add_column("share")
        for j in JUDGES:
            t.add_column(f"{j}: failed in 10 min / at all (median min); passed")
        t.add_column("gates")
        for row in report.rows():
            cells = []
            for j in JUDGES:
                a, b, m, p = row[f"{j}_fail_10m"], row[f"{j}_fail"], row[f"{j}_minutes"], row[f"{j}_pass"]
                cells.append("-" if b is None else f"{a:.0%} / {b:.0%}" + ("" if m is None else f" ({m:g})")
                             + f"; {p:.0%}")
            t.add_row(row["case"], f"{row['share']:.0%}", *cells, str(row["runs"]))
        out.print(t)
    _goals(data, as_json, gate=False)


@cli.group()
def probe() -> None:
    """Synthetic probes of the fleet's data paths."""


@probe.command("kv")
@click.option("--duration", default=10.0, show_default=True, type=click.FloatRange(min=0.5), help="Seconds to probe.")
@click.option("--block-size", "block_sizes", multiple=True, default=("256KiB", "1MiB", "4MiB"), show_default=True,
              help="KV block size to write (repeatable; bytes or a KiB/MiB suffix).")
@click.option("--interval", default=0.25, show_default=True, type=click.FloatRange(min=0.01),
              help="Seconds between probe rounds.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def probe_kv(duration: float, block_sizes: tuple[str, ...], interval: float, as_json: bool) -> None:
    """WRITE KV-block-sized buffers over real NIXL into a decode-side agent process; exit 1 when any failed."""
    from controlplane.kvprobe.cli import run_probe
    from controlplane.kvprobe.stats import parse_block_size

    try:
        sizes = [parse_block_size(s) for s in block_sizes]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--block-size") from None
    report = run_probe(duration, sizes, interval, as_json)
    if as_json:
        _emit_json(report)
    sys.exit(0 if report["ok"] else 1)


# bench and dashboard ------------------------------------------------------------------------

@cli.group()
def bench() -> None:
    """Benchmarks (printed tables; --json for machines)."""


@bench.command("ingest")
@click.option("--rows", default=200_000, show_default=True, type=click.IntRange(min=1000))
@click.option("--batch", default=5_000, show_default=True, type=click.IntRange(min=1))
@click.option("--postgres", default="postgresql://127.0.0.1:5432/test", show_default=True,
              help="PostgreSQL to measure ('' to skip); env FLEETCTL_BENCH_PG.", envvar="FLEETCTL_BENCH_PG")
@click.option("--json", "as_json", is_flag=True)
def bench_ingest(rows: int, batch: int, postgres: str, as_json: bool) -> None:
    """Signal ingest into the store, rows per second, SQLite and PostgreSQL."""
    from bench.ingest import run_ingest_bench

    result = run_ingest_bench(rows=rows, batch=batch, postgres_url=postgres or None, progress=err)
    if as_json:
        _emit_json(result)
    else:
        t = Table(title=f"Signal ingest ({rows:,} rows, batches of {batch:,})")
        for col in ("store", "rows/s", "seconds", "bytes/row"):
            t.add_column(col, justify="right")
        for r in result["results"]:
            t.add_row(r["store"], f"{r['rows_per_s']:,.0f}", f"{r['seconds']:.2f}",
                      "-" if r.get("bytes_per_row") is None else f"{r['bytes_per_row']:.0f}")
        out.print(t)
    _goals(result, as_json)


@bench.command("parse")
@click.option("--seconds", default=0.5, show_default=True, type=click.FloatRange(min=0.05),
              help="Minimum time per timed batch (three batches per figure).")
@click.option("--json", "as_json", is_flag=True)
def bench_parse(seconds: float, as_json: bool) -> None:
    """Exposition parsing: ours (cold and warm) against prometheus_client, same input, same run."""
    from bench.parse import run_parse_bench

    result = run_parse_bench(seconds)
    if as_json:
        _emit_json(result)
    else:
        t = Table(title="Exposition parsing (real vLLM CPU exposition), samples per second")
        for col in ("input", "samples", "prometheus_client", "ours cold", "ours warm", "warm ratio", "cold ratio",
                    "identical"):
            t.add_column(col, justify="right")
        for r in result["inputs"]:
            t.add_row(r["input"], str(r["samples"]), f"{r['reference_samples_per_s']:,.0f}",
                      f"{r['cold_samples_per_s']:,.0f}", f"{r['samples_per_s']:,.0f}", f"{r['ratio']:.1f}x",
                      f"{r['cold_ratio']:.1f}x", str(r["identical"]))
        out.print(t)
    _goals(result, as_json)


@bench.command("dashboard")
@click.option("--engines", default=200, show_default=True, type=click.IntRange(min=8))
@click.option("--days", default=7.0, show_default=True, type=click.FloatRange(min=1))
@click.option("--minute-hours", type=click.FloatRange(min=0), default=None,
              help="1-minute rollups for the last N hours only (default: all days; 24 seeds in ~90 s).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True)
def bench_dashboard(engines: int, days: float, minute_hours: float | None, repeats: int, as_json: bool) -> None:
    """Per-page dashboard query time on a seeded store (a week of 200 engines by default)."""
    from bench.dashboard import run_dashboard_bench

    result = run_dashboard_bench(engines=engines, days=days, minute_hours=minute_hours, repeats=repeats, progress=err)
    if as_json:
        _emit_json(result)
    else:
        t = Table(title=f"Dashboard queries, {result['engines']} engines over {days:g} days (goal {result['goal_ms']:.0f} ms)")
        for col in ("page", "worst ms", *next(iter(result["pages"].values()))["by_range_ms"]):
            t.add_column(col, justify="right")
        for page, r in result["pages"].items():
            t.add_row(page, f"{r['ms']:.0f}", *(f"{v:.0f}" for v in r["by_range_ms"].values()))
        out.print(t)
    _goals(result, as_json)


@bench.command("sim")
@click.option("--trace", default="mooncake/conversation", show_default=True)
@click.option("--capacity", default=20_000, show_default=True, type=click.IntRange(min=1), help="Cache blocks in all.")
@click.option("--json", "as_json", is_flag=True)
def bench_sim(trace: str, capacity: int, as_json: bool) -> None:
    """Trace replay: one global prefix cache alone, then the engine-level fleet (8 prefill + 24 decode engines)."""
    from bench.sim import run_fleet_bench, run_sim_bench

    result = run_sim_bench(trace, capacity)
    result["fleet"] = run_fleet_bench(trace)
    result["goals"] = result["fleet"].pop("goals")
    if as_json:
        _emit_json(result)
    else:
        t = Table(title=f"Replay of {trace} ({capacity:,} blocks of global cache)")
        rows = {**{k: v for k, v in result.items() if k != "fleet"}, **{f"fleet.{k}": v for k, v in result["fleet"].items()}}
        for key, value in rows.items():
            if not isinstance(value, dict | list):
                t.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
        out.print(t)
    _goals(result, as_json)


@bench.command("scrape")
@click.option("--pods", default=1000, show_default=True, type=click.IntRange(min=1))
@click.option("--ticks", default=3, show_default=True, type=click.IntRange(min=1), help="Measured intervals.")
@click.option("--json", "as_json", is_flag=True)
def bench_scrape(pods: int, ticks: int, as_json: bool) -> None:
    """The whole path (scrape, parse, derive, store) for N simulated pods: CPU per 15 s interval, peak memory."""
    from bench.scrape import run_scrape_bench

    result = run_scrape_bench(pods=pods, ticks=ticks, progress=err)
    if as_json:
        _emit_json(result)
    else:
        t = Table(title=f"Scrape path, {pods:,} single-engine pods, one process")
        for col in ("CPU s / 15 s", "scrape", "derive", "store", "wall s", "signals", "core share", "peak RSS"):
            t.add_column(col, justify="right")
        t.add_row(f"{result['cpu_s_per_interval']:.2f}", f"{result['scrape_cpu_s']:.2f}", f"{result['derive_cpu_s']:.2f}",
                  f"{result['store_cpu_s']:.2f}", f"{result['wall_s_per_interval']:.2f}",
                  f"{result['signals_per_interval']:,.0f}", f"{result['core_share']:.0%}",
                  f"{result['peak_rss_bytes'] / 2**20:,.0f} MiB")
        out.print(t)
    _goals(result, as_json)


@cli.command()
@_db_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address; localhost unless told otherwise.")
@click.option("--port", default=8501, show_default=True, type=int)
def dashboard(db: str, host: str, port: int) -> None:
    """Open the Streamlit operations dashboard on the store."""
    from importlib import resources

    app = resources.files("dashboard").joinpath("app.py")
    env = {**os.environ, "FLEETCTL_STORE_URL": db}
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", host, "--server.port", str(port),
           "--server.headless", "true", "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"]
    from controlplane.store.db import redact

    err.print(f"dashboard on http://{host}:{port} (store {redact(db)})")
    sys.exit(subprocess.call(cmd, env=env))


from controlplane.lab.cli import lab as _lab_command  # noqa: E402  (its heavy imports are lazy)

cli.add_command(_lab_command)


INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE


def main() -> NoReturn:
    """Console entry point with the project's exit codes."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.UsageError as exc:
        exc.show()
        sys.exit(3)
    except click.ClickException as exc:
        exc.show()
        sys.exit(3)
    except FleetError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    except Exception:  # a defect of ours; Python's own exit status, 1, would read as a failed canary or a goal missed
        err.print_exception()
        sys.exit(INTERNAL_ERROR)
    sys.exit(0)


if __name__ == "__main__":
    main()
