"""The deployment advisor: the field's decision rules computed from the fleet's own telemetry.

Pure functions of `AdvisorInput` (pools as configured, what they did since `since`, the time) to
recommendations with their evidence, predicted effect and confidence: disaggregate or not, the
prefill:decode ratio, a KV tier, FP8 KV cache, the speculative-decoding method, the parallel layout.
"""

from __future__ import annotations

from policies.advice.disaggregation import disaggregation
from policies.advice.kv import kv_precision, kv_tiering, lru_hit_rates
from policies.advice.layout import parallel_layout
from policies.advice.speculation import speculation
from policies.advice.types import (
    AdviceKind,
    AdviceSettings,
    AdvisorInput,
    BusyTtftMinute,
    Effect,
    GpuType,
    PoolFacts,
    PoolObserved,
    Recommendation,
    SpecFacts,
)

__all__ = ["AdviceKind", "AdviceSettings", "AdvisorInput", "BusyTtftMinute", "Effect", "GpuType", "PoolFacts",
           "PoolObserved", "Recommendation", "SpecFacts", "advise", "lru_hit_rates"]


def advise(inp: AdvisorInput, settings: AdviceSettings, *, prefix_block_tokens: int = 16) -> list[Recommendation]:
    """Every recommendation for the fleet, those that call for a change first, by the money they save."""
    recs = [*disaggregation(inp, settings), *kv_tiering(inp, settings, prefix_block_tokens),
            *kv_precision(inp, settings), *speculation(inp, settings), *parallel_layout(inp, settings)]
    return sorted(recs, key=lambda r: (not r.act, -(r.effect.saving_per_day or 0.0), r.kind.value, r.pool))
