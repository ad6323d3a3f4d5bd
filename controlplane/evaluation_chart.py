"""Evaluations as pictures: detection delay and false alarms per finding kind (policies beside static rules), and
engines held and SLO minutes missed per autoscaling strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import altair as alt

__all__ = ["CHART_FORMATS", "CHART_SUFFIXES", "autoscale_chart", "eval_chart", "save_autoscale_chart", "save_eval_chart"]

CHART_SUFFIXES = (".png", ".svg", ".html")
CHART_FORMATS = f"{', '.join(CHART_SUFFIXES[:-1])} or {CHART_SUFFIXES[-1]}"  # for messages

_COLORS = alt.Scale(domain=["policies", "static rules"], range=["#1f77b4", "#bbbbbb"])


def eval_chart(report: dict[str, Any]) -> alt.VConcatChart:
    """Two panels from `EvalReport.as_dict()`: median delay in intervals (to p90), false alarms per 1,000 engine-hours."""
    rows = []
    for k in report["scores"]:
        if not k["truths"] and not k["findings"]:
            continue
        rows.append({
            "kind": k["kind"], "detector": k["detector"],
            "median": k["delay_median_intervals"], "p90": k["delay_p90_intervals"],
            "found": f"{k['detected']}/{k['truths']}",
            "missed": f"not detected ({k['detected']}/{k['truths']})",
            "false alarms per 1000 engine-h": k["false_alarms_per_1000_engine_hours"] or 0.0,
        })
    data = alt.Data(values=rows)  # type: ignore[no-untyped-call]
    kinds = sorted({r["kind"] for r in rows})
    y = alt.Y("kind:N", sort=kinds, title=None)
    y_offset = alt.YOffset("detector:N", sort=["policies", "static rules"])
    color = alt.Color("detector:N", scale=_COLORS, title=None)
    delay = alt.Chart(data).mark_bar().encode(
        x=alt.X("median:Q", title="detection delay, median (scrape intervals; whisker to p90)"), y=y, yOffset=y_offset,
        color=color, tooltip=["kind:N", "detector:N", "found:N", "median:Q", "p90:Q"],
    ).transform_filter("datum.median != null")
    whisker = alt.Chart(data).mark_rule().encode(x="median:Q", x2="p90:Q", y=y, yOffset=y_offset).transform_filter(
        "datum.median != null")
    found = alt.Chart(data).mark_text(align="left", dx=4).encode(
        x=alt.value(0), y=y, yOffset=y_offset, text="missed:N").transform_filter("datum.median == null")
    alarms = alt.Chart(data).mark_bar().encode(
        x=alt.X("false alarms per 1000 engine-h:Q", title="false alarms per 1,000 engine-hours"), y=y, yOffset=y_offset,
        color=color, tooltip=["kind:N", "detector:N", "false alarms per 1000 engine-h:Q"],
    )
    summary = report["summary"]
    title = (f"{len(report['scenarios'])} run(s), {report['engine_hours']:.0f} engine-hours; median delay "
             f"{_fmt(summary['policies']['delay_median_intervals'])} vs {_fmt(summary['static rules']['delay_median_intervals'])}"
             " intervals (policies vs static rules)")
    return alt.vconcat((delay + whisker + found).properties(width=520, height=260),
                       alarms.properties(width=520, height=260), title=title)


def save_eval_chart(report: dict[str, Any], path: Path) -> Path:
    """Write the chart as PNG, SVG or HTML, by the file's suffix."""
    return _save(eval_chart(report), path)


def _save(chart: alt.TopLevelMixin, path: Path) -> Path:
    if path.suffix.lower() not in CHART_SUFFIXES:
        raise ValueError(f"{path}: the chart is written as {CHART_FORMATS}, not {path.suffix or 'no suffix'}")
    if path.suffix.lower() == ".png":
        chart.save(str(path), scale_factor=2)
    else:
        chart.save(str(path))
    return path


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


_STRATEGY_COLORS = alt.Scale(domain=["static", "hpa", "dynamo", "ours", "causal", "oracle"],
                             range=["#bbbbbb", "#ff7f0e", "#9467bd", "#1f77b4", "#8c564b", "#2ca02c"])


def autoscale_chart(report: dict[str, Any]) -> alt.VConcatChart:
    """Per trace, from `fleetctl autoscale eval --json`: the load (requests per minute), the engines each
    strategy held per pool (dashed: the second pool), and the minutes each strategy missed an SLO; a peer by
    its best configuration."""
    panels = []
    for trace in report["traces"]:
        held, missed = [], []
        shown = {f"{r['strategy']}:{r['configuration']}" if r.get("configuration") else r["strategy"]: r["strategy"]
                 for r in trace["strategies"]}
        for run in trace["runs"]:
            name = shown.get(run["strategy"])
            if name is None:
                continue
            for t, pools in run["replicas"]:
                held += [{"minute": t / 60.0, "engines": n, "strategy": name, "pool": pool} for pool, n in pools.items()]
            missed += [{"minute": m + 0.5, "strategy": name} for m, ok in enumerate(run["within"]) if not ok]
        load = [{"minute": m + 0.5, "requests": n} for m, n in enumerate(trace["runs"][0]["arrivals"])]
        color = alt.Color("strategy:N", scale=_STRATEGY_COLORS, title=None)
        x = alt.X("minute:Q", title="minute of the replay")
        arrivals = alt.Chart(alt.Data(values=load)).mark_area(opacity=0.4).encode(  # type: ignore[no-untyped-call]
            x=x, y=alt.Y("requests:Q", title="requests per minute"))
        lines = alt.Chart(alt.Data(values=held)).mark_line(interpolate="step-after").encode(  # type: ignore[no-untyped-call]
            x=x, y=alt.Y("engines:Q", title="engines held"), color=color, strokeDash=alt.StrokeDash("pool:N"))
        ticks = alt.Chart(alt.Data(values=missed)).mark_tick(thickness=2).encode(  # type: ignore[no-untyped-call]
            x=x, y=alt.Y("strategy:N", title="minutes out of SLO"), color=color)
        rows = {r["strategy"]: r for r in trace["strategies"]}
        title = ", ".join(f"{k} {rows[k]['gpu_hours']:.1f} GPU-h / {rows[k]['attainment']:.0%}" for k in rows)
        panels.append(alt.vconcat(arrivals.properties(width=560, height=90), lines.properties(width=560, height=180),
                                  ticks.properties(width=560, height=80), title=f"{trace['trace']}: {title}"))
    return alt.vconcat(*panels)


def save_autoscale_chart(report: dict[str, Any], path: Path) -> Path:
    """Write the autoscaling chart as PNG, SVG or HTML, by the file's suffix."""
    return _save(autoscale_chart(report), path)
