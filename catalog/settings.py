"""What every settings type is built from: a strict, frozen base and durations written as `15s`, `5m`, `48h`.

The fleet file's sections are these types, the policies' own settings among them, so a setting is
defined once: where it is used, with its default, bounds and name in the file.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = ["NonNegativeSeconds", "Problem", "Seconds", "Settings", "SwitchSettings", "duration", "least_window"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def duration(value: Any) -> Any:
    """Seconds from `15s`, `500ms`, `5m`, `48h`, `7d` or a number; anything else is left to validation."""
    if isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise ValueError(f"expected a duration such as 15s, 5m, 48h or 7d, got {value!r}")
        return float(m.group(1)) * _UNITS[m.group(2)]
    return value


Seconds = Annotated[float, BeforeValidator(duration), Field(gt=0)]
NonNegativeSeconds = Annotated[float, BeforeValidator(duration), Field(ge=0)]


class Settings(BaseModel):
    """Strict (unknown keys are errors), frozen, and built by field name or by the name the file uses."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


Problem = tuple[str, str]  # (the field's name in the fleet file, what is wrong)


class SwitchSettings(Settings):
    """A policy's section with nothing to set but whether it runs (its thresholds are the rails')."""

    enabled: bool = True

    def problems(self, interval: float) -> list[Problem]:
        return []


def least_window(field: str, value: float, points: int, interval: float, why: str) -> list[Problem]:
    """A problem when a window of `value` seconds cannot hold `points` scrapes at `interval`."""
    need = points * interval
    if value >= need:
        return []
    return [(field, f"{value:g}s is shorter than the {need:g}s the detector needs at a {interval:g}s scrape interval "
                    f"({why}), so it would never judge; make it at least {need:g}s")]
