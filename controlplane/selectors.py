"""Kubernetes label selectors: parsing and matching, with the API server's semantics (pure).

Shared by discovery (which pods are targets), the fleet file's checks and the actuators (which
pods belong to a workload), so it imports nothing that talks to a cluster.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["LabelSelector", "Requirement", "split_clauses"]


class Requirement(NamedTuple):
    """One clause of a label selector: `key op values` (op: =, !=, in, notin, exists, !exists)."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a label set satisfies this clause, with Kubernetes' semantics for absent keys."""
        present = self.key in labels
        match self.op:
            case "exists":
                return present
            case "!exists":
                return not present
            case "=" | "in":
                return present and labels[self.key] in self.values
            case _:  # "!=" and "notin" also match when the key is absent
                return not present or labels[self.key] not in self.values

    def __str__(self) -> str:
        values = sorted(self.values)
        match self.op:
            case "exists":
                return self.key
            case "!exists":
                return f"!{self.key}"
            case "=" | "!=":
                return f"{self.key}{self.op}{values[0]}"
            case _:
                return f"{self.key} {self.op} ({','.join(values)})"


_KEY = r"(?:[A-Za-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET_CLAUSE = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_EQ_CLAUSE = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>{_VALUE})$")
_EXISTS_CLAUSE = re.compile(rf"^(?P<neg>!?)\s*(?P<key>{_KEY})$")
_VALUE_ONLY = re.compile(rf"^{_VALUE}$")
_API_OPS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!exists"}


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A parsed Kubernetes label selector; every requirement must hold (an empty one matches all)."""

    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """Parse `a=b,c!=d,e,!f,g in (x,y),h notin (z)`; ValueError names the clause it cannot read."""
        return cls(tuple(_parse_clause(c) for c in split_clauses(text)))

    @classmethod
    def from_api(cls, selector: Mapping[str, Any]) -> LabelSelector:
        """A workload's `spec.selector` (matchLabels and matchExpressions); ValueError names an operator it cannot
        read."""
        out = [Requirement(str(k), "=", frozenset({str(v)})) for k, v in sorted((selector.get("matchLabels") or {}).items())]
        for expr in selector.get("matchExpressions") or []:
            op = _API_OPS.get(str(expr.get("operator")))
            if op is None or not expr.get("key"):
                raise ValueError(f"matchExpressions entry {dict(expr)!r}: expected a key and In, NotIn, Exists or "
                                 "DoesNotExist")
            out.append(Requirement(str(expr["key"]), op, frozenset(str(v) for v in expr.get("values") or [])))
        return cls(tuple(out))

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        """Whether a pod with these labels is selected."""
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    def __str__(self) -> str:
        return ",".join(str(r) for r in self.requirements)


def split_clauses(text: str) -> list[str]:
    """The comma-separated clauses of a selector, commas inside parentheses kept; ValueError when unbalanced."""
    clauses, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"label selector {text!r}: unbalanced ')'")
        elif ch == "," and depth == 0:
            clauses.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"label selector {text!r}: unbalanced '('")
    clauses.append(text[start:])
    clauses = [c.strip() for c in clauses]
    if clauses == [""]:
        return []
    if "" in clauses:
        raise ValueError(f"label selector {text!r}: empty clause")
    return clauses


def _parse_clause(clause: str) -> Requirement:
    if m := _SET_CLAUSE.match(clause):
        values = [v.strip() for v in m["values"].split(",")]
        if not all(values) or not all(_VALUE_ONLY.match(v) for v in values):
            raise ValueError(f"label selector clause {clause!r}: expected values such as (a,b)")
        return Requirement(m["key"], m["op"], frozenset(values))
    if m := _EQ_CLAUSE.match(clause):
        return Requirement(m["key"], "!=" if m["op"] == "!=" else "=", frozenset({m["value"]}))
    if m := _EXISTS_CLAUSE.match(clause):
        return Requirement(m["key"], "!exists" if m["neg"] else "exists")
    raise ValueError(f"label selector clause {clause!r} is not key=value, key!=value, key, !key, key in (..) or key notin (..)")
