"""Goals of benchmarks and evaluations, reported the same way everywhere.

Every benchmark and evaluation puts a top-level `goals` list in its JSON, one object per goal:
`{"name", "value" (measured), "goal" (the target, e.g. ">= 10"), "holds"}`, and prints the same as a
table, so a CI job can gate on `holds` and a person can read what was measured against what.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table

__all__ = ["Goal", "all_hold", "at_least", "at_most", "equal", "goals_json", "goals_table"]


@dataclass(frozen=True, slots=True)
class Goal:
    """One goal: what was measured, what it should be, and whether it is."""

    name: str
    value: float | int | bool | str | None
    goal: str
    holds: bool

    def as_dict(self) -> dict[str, Any]:
        """The goal as its JSON object."""
        return {"name": self.name, "value": self.value, "goal": self.goal, "holds": self.holds}


def _num(x: float) -> str:
    return f"{x:,.4g}" if isinstance(x, float) else f"{x:,}"


def at_least(name: str, value: float | None, target: float) -> Goal:
    """Holds when `value` is at least `target` (never when nothing was measured)."""
    return Goal(name, value, f">= {_num(target)}", value is not None and value >= target)


def at_most(name: str, value: float | None, target: float) -> Goal:
    """Holds when `value` is at most `target` (never when nothing was measured)."""
    return Goal(name, value, f"<= {_num(target)}", value is not None and value <= target)


def equal(name: str, value: object, target: object) -> Goal:
    """Holds when `value` equals `target`."""
    shown = value if isinstance(value, bool | int | float | str) or value is None else str(value)
    return Goal(name, shown, f"== {target}", value == target)


def goals_json(goals: Iterable[Goal]) -> list[dict[str, Any]]:
    """The `goals` list of a report."""
    return [g.as_dict() for g in goals]


def all_hold(goals: Sequence[dict[str, Any]] | Sequence[Goal]) -> bool:
    """Whether every goal holds (objects or their JSON)."""
    return all(g.holds if isinstance(g, Goal) else bool(g["holds"]) for g in goals)


def goals_table(goals: Sequence[dict[str, Any]], title: str = "Goals") -> Table:
    """The goals as a table: name, measured value, goal, and whether it holds."""
    t = Table(title=title)
    for col, justify in (("goal", "left"), ("measured", "right"), ("target", "right"), ("holds", "center")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for g in goals:
        value = g["value"]
        shown = "-" if value is None else _num(value) if isinstance(value, int | float) and not isinstance(value, bool) \
            else str(value)
        t.add_row(g["name"], shown, g["goal"], "[green]yes[/]" if g["holds"] else "[red]no[/]")
    return t
