"""The source interface and the registry of source modules, keyed by `Target.source`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from collectors import dcgm, kvprobe, llmd, lmcache, nixl, vllm
from collectors.families import Delta, FamilyMap, Reading
from collectors.types import Sample, Signal, Target

__all__ = ["SOURCES", "Source", "UnknownSource", "get"]


class Source(Protocol):
    """Maps one kind of exposition (vLLM, dcgm-exporter, NIXL, ...) to entity signals."""

    name: str
    families: FamilyMap
    aggregate: bool  # True when pool-level signals are the merge of entity deltas

    def read(self, samples: Iterable[Sample]) -> dict[str, Reading]:
        """Readings per entity (engine, GPU, agent, ...)."""
        ...

    def subject(self, target: Target, entity: str, reading: Reading) -> str:
        """The signal subject of one entity of one target."""
        ...

    def signals(self, d: Delta, ts: float, subject: str) -> list[Signal]:
        """Signals from the change of one entity (or of a pool aggregate)."""
        ...


SOURCES: dict[str, Source] = {
    s.name: s for s in (vllm.SOURCE, dcgm.SOURCE, nixl.SOURCE, llmd.SOURCE, lmcache.SOURCE, kvprobe.SOURCE)
}


class UnknownSource(KeyError):
    """A target names a source no module handles."""


def get(name: str) -> Source:
    """The source module called `name`."""
    try:
        return SOURCES[name]
    except KeyError:
        raise UnknownSource(f"no collector for source {name!r}; known: {', '.join(sorted(SOURCES))}") from None
