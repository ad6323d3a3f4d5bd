"""A policy evaluated tick after tick as the loop does: open findings carry the newest report's evidence, and
resolved ones close."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.types import FindingKey, OpenFinding, PolicyInput, PolicyResult, PoolState
from policies.windows import SignalWindows


class Ticking:
    """One policy over one set of windows; `log` holds (time, "open" | "resolve", subject, text)."""

    def __init__(self, policy: Any, windows: SignalWindows, pools: Mapping[str, PoolState] | None = None) -> None:
        self.policy, self.windows, self.pools = policy, windows, dict(pools or {})
        self.open: dict[FindingKey, OpenFinding] = {}
        self.log: list[tuple[float, str, str, str]] = []

    def tick(self, now: float) -> PolicyResult:
        result: PolicyResult = self.policy.evaluate(PolicyInput(now, self.windows, self.pools, dict(self.open)))
        for key, why in result.resolved:
            if self.open.pop(key, None) is not None:
                self.log.append((now, "resolve", key.subject, why))
        for f in result.findings:
            opened = self.open[f.key].opened_at if f.key in self.open else now
            if f.key not in self.open:
                self.log.append((now, "open", f.key.subject, f.summary))
            self.open[f.key] = OpenFinding(f.key, opened, f.evidence)
        return result

    def events(self, kind: str) -> list[float]:
        """When findings opened ("open") or resolved ("resolve")."""
        return [t for t, k, _, _ in self.log if k == kind]
