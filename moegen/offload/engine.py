"""The policy engine an offload plan asks for, shared by the runtime and the plan's trace replay."""
from __future__ import annotations

from typing import Optional

from moegen.offload.policies import OffloadPolicyEngine
from moegen.offload.predictors import CrossLayerPredictor, HistoryPredictor, NeighborPredictor, Predictor

# The predictor of each spec `offload.prefetch` mode that needs nothing but the routing seen so
# far. The runtime's router predictor needs hidden states, which a trace lacks: in a trace
# replay the cross-layer predictor (learned from the routing alone) stands in for it.
ROUTING_PREDICTORS = {"none": None, "history": HistoryPredictor, "router": CrossLayerPredictor,
                    "xlayer": CrossLayerPredictor, "neighbors": NeighborPredictor}


def engine_for_plan(plan, policy: Optional[str] = None, predictor: Optional[Predictor] = None,
                    cap_bytes_at_lru: bool = True) -> OffloadPolicyEngine:
    """An engine with the plan's slots and pinned experts. With cap_bytes_at_lru, prefetches
    only spend what the eviction policy saved against demand LRU (never more bytes than LRU);
    without, every confident prediction is fetched (more bytes, more transfer hidden)."""
    return OffloadPolicyEngine(
        plan.num_layers, plan.num_experts, list(plan.slots_per_layer), policy=policy or plan.policy,
        predictor=predictor, pinned=[frozenset(p) for p in plan.pinned],
        byte_budget="lru" if predictor is not None and cap_bytes_at_lru else None, expert_bytes=plan.expert_bytes)


def routing_predictor(mode: str, num_layers: int, num_experts: int) -> Optional[Predictor]:
    make = ROUTING_PREDICTORS[mode]
    return None if make is None else make(num_layers, num_experts)
