"""The registry of source modules, keyed by `Target.source`.

Each module (vLLM, dcgm-exporter, NIXL, llm-d, LMCache, the KV probe) exposes a `SOURCE`: a
`FamilySource` saying how it reads entities from samples, names their subjects and derives signals.
"""

from __future__ import annotations

from collectors import dcgm, kvprobe, llmd, lmcache, nixl, vllm
from collectors.families import FamilySource

__all__ = ["SOURCES", "UnknownSource", "get"]

SOURCES: dict[str, FamilySource] = {
    s.name: s for s in (vllm.SOURCE, dcgm.SOURCE, nixl.SOURCE, llmd.SOURCE, lmcache.SOURCE, kvprobe.SOURCE)
}


class UnknownSource(KeyError):
    """A target names a source no module handles."""


def get(name: str) -> FamilySource:
    """The source module called `name`."""
    try:
        return SOURCES[name]
    except KeyError:
        raise UnknownSource(f"no collector for source {name!r}; known: {', '.join(sorted(SOURCES))}") from None
