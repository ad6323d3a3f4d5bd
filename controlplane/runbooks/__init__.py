"""Runbooks shipped with the package, one Markdown file per finding kind."""

from __future__ import annotations

from importlib import resources

__all__ = ["available", "load"]


def available() -> list[str]:
    """Finding kinds that have a runbook."""
    return sorted(p.name.removesuffix(".md") for p in resources.files(__package__).iterdir() if p.name.endswith(".md"))


def load(kind: str) -> str:
    """The runbook text for a finding kind; KeyError if none ships."""
    if kind not in available():
        raise KeyError(kind)
    return resources.files(__package__).joinpath(f"{kind}.md").read_text(encoding="utf-8")
