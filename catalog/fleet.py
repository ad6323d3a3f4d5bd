"""The fleet's vocabulary: what an engine pool does, and the kinds of scrape endpoint there are."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Role", "Source"]


class Role(StrEnum):
    """What an engine pool does in a disaggregated fleet."""

    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"


class Source(StrEnum):
    """A kind of scrape endpoint; each has a collector (`collectors.sources.SOURCES`)."""

    VLLM = "vllm"  # a vLLM engine's /metrics
    DCGM = "dcgm"  # dcgm-exporter
    NIXL = "nixl"  # NIXL's own Prometheus exporter
    LLMD = "llmd"  # llm-d's endpoint picker
    LMCACHE = "lmcache"  # an LMCache worker
    KVPROBE = "kvprobe"  # the control plane's KV-transfer probe
