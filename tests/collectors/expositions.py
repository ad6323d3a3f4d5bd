"""Builders of synthetic exposition text for the source tests."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["fmt", "histogram"]


def fmt(labels: Mapping[str, str]) -> str:
    """A label set as exposition text, without the braces."""
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def histogram(name: str, labels: Mapping[str, str], bounds: tuple[str, ...], observations: tuple[float, ...]) -> str:
    """A cumulative histogram family holding `observations`."""
    out = [f"# TYPE {name} histogram"]
    for le in (*bounds, "+Inf"):
        limit = float(le)
        out.append(f"{name}_bucket{{{fmt({**labels, 'le': le})}}} {sum(1 for o in observations if o <= limit)}")
    out.append(f"{name}_sum{{{fmt(labels)}}} {sum(observations)}")
    out.append(f"{name}_count{{{fmt(labels)}}} {len(observations)}")
    return "\n".join(out) + "\n"
