"""The offload plan: given the expert-memory budget, how many expert slots each MoE layer gets,
which experts stay pinned, how far ahead to prefetch, and what that should cost per token.

Everything the offload runtime needs to start comes from here. Costs are sympy expressions of
the spec (per-expert bytes, per-layer decode compute time on the target) so REPORT.md shows them.
"""
from __future__ import annotations

import heapq
import json
import math
from pathlib import Path
from dataclasses import asdict, dataclass, fields
from typing import Optional, Sequence

import sympy

from moegen.errors import PlanError, SpecError
from moegen.ir import ModelIR
from moegen.plan.cost_model import B, E, H, I, K, W, expert_bytes, matrix_tflops
from moegen.spec.loader import expert_memory_shortfall
from moegen.spec.schema import OFFLOAD_POLICIES, PREFETCH_MODES
from moegen.target import expert_memory_gib

HBM, LINK, RATE = sympy.symbols("HBM_GBps LINK_GBps RATE_TFLOPs", positive=True)
EXPERT_BYTES = W  # as stored: 3*H*I*b unquantized (moegen/plan/cost_model.py)
# One decode token through one MoE layer: k experts streamed from HBM (or k GEMV FLOPs).
LAYER_COMPUTE_US = sympy.Max(K * EXPERT_BYTES / (HBM * 1e3), 6 * K * H * I / (RATE * 1e6))
TRANSFER_US = EXPERT_BYTES / (LINK * 1e3)
OFFLOAD_FORMULAS = {"expert bytes": EXPERT_BYTES, "layer compute (us)": LAYER_COMPUTE_US,
                    "expert transfer (us)": TRANSFER_US}


@dataclass(frozen=True)
class OffloadPlan:
    offloaded: bool  # False: every expert fits the budget and stays resident
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    budget_bytes: int
    slots_per_layer: tuple[int, ...]
    pinned: tuple[tuple[int, ...], ...]  # per layer, never evicted
    policy: str
    prefetch: str
    lookahead: int  # layers ahead that prefetches are issued
    layer_compute_us: float
    transfer_us: float  # one expert over the host link
    expected_hit_rate: float
    bytes_per_token: float
    stall_ms_per_token: float
    estimate_from: str  # "all resident", "uniform routing", "profile", "trace <name>"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data, source="plan.json") -> "OffloadPlan":
        """The plan to_json wrote (a package's plan.json, `moegen plan --json`), checked: a field
        missing, of another type or out of range, or slots that do not fit the budget raise
        PlanError naming `source` and the field."""
        if not isinstance(data, dict):
            raise PlanError(source, "", f"not a JSON object (a {type(data).__name__})",
                            "give the plan.json a build wrote, or `moegen plan SPEC --json`'s output")
        names = [f.name for f in fields(cls)]
        for name in data.keys() - set(names):
            raise PlanError(source, name, "not a field of an offload plan", f"remove it; the fields: {', '.join(names)}")
        for name in names:
            if name not in data:
                raise PlanError(source, name, "missing", "write the plan again with `moegen plan SPEC --json`")
        for name, kind in _FIELD_KINDS.items():
            check, wanted = _KINDS[kind]
            if not check(data[name]):
                raise PlanError(source, name, f"{json.dumps(data[name])[:80]} is not {wanted}",
                                "write the plan again with `moegen plan SPEC --json`")
        plan = cls(**dict(data, slots_per_layer=tuple(data["slots_per_layer"]),
                          pinned=tuple(map(tuple, data["pinned"]))))
        problem = plan_problem(plan)
        if problem:
            raise PlanError(source, *problem)
        return plan


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Each field's kind, and per kind how a JSON value is checked and what it must be.
_FIELD_KINDS = {"offloaded": "bool", "num_layers": "int", "num_experts": "int", "top_k": "int",
                "expert_bytes": "int", "budget_bytes": "int", "slots_per_layer": "slots", "pinned": "pinned",
                "policy": "str", "prefetch": "str", "lookahead": "int", "layer_compute_us": "number",
                "transfer_us": "number", "expected_hit_rate": "number", "bytes_per_token": "number",
                "stall_ms_per_token": "number", "estimate_from": "str"}
_KINDS = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: _whole(v) and v >= 0, "a whole number >= 0"),
    "number": (lambda v: (_whole(v) or isinstance(v, float)) and v >= 0, "a number >= 0"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "slots": (lambda v: isinstance(v, list) and all(map(_whole, v)), "a list of whole numbers, one per layer"),
    "pinned": (lambda v: isinstance(v, list) and all(isinstance(row, list) and all(map(_whole, row)) for row in v),
               "a list (one per layer) of lists of expert ids"),
}


def plan_problem(plan: OffloadPlan) -> Optional[tuple[str, str, str]]:
    """(field, problem, fix) of the first thing that keeps the runtime from taking the plan."""
    layers, experts, k = plan.num_layers, plan.num_experts, plan.top_k
    if layers < 1 or experts < 1 or not 1 <= k <= experts:
        return "top_k", f"top-{k} of {experts} experts in {layers} layers", "plan a spec with 1 <= top_k <= num_experts"
    if plan.policy not in OFFLOAD_POLICIES:
        return "policy", f"unknown policy {plan.policy!r}", f"use one of {', '.join(OFFLOAD_POLICIES)}"
    if plan.prefetch not in PREFETCH_MODES:
        return "prefetch", f"unknown prefetch mode {plan.prefetch!r}", f"use one of {', '.join(PREFETCH_MODES)}"
    if not 0 <= plan.expected_hit_rate <= 1:
        return "expected_hit_rate", f"{plan.expected_hit_rate} is not a rate in [0, 1]", "write a rate in [0, 1]"
    if len(plan.slots_per_layer) != layers or len(plan.pinned) != layers:
        return ("slots_per_layer" if len(plan.slots_per_layer) != layers else "pinned",
                f"{len(plan.slots_per_layer)} slot counts and {len(plan.pinned)} pinned lists for {layers} layers",
                "give one entry per layer")
    for layer, (slots, pinned) in enumerate(zip(plan.slots_per_layer, plan.pinned)):
        if not k <= slots <= experts:
            return (f"slots_per_layer[{layer}]", f"{slots} slots cannot hold one token's {k} experts" if slots < k
                    else f"{slots} slots for {experts} experts", f"give each layer {k} to {experts} slots")
        if len(set(pinned)) != len(pinned) or any(not 0 <= e < experts for e in pinned):
            return (f"pinned[{layer}]", f"{list(pinned)} are not distinct expert ids in [0, {experts})",
                    "list each pinned expert once")
        if slots < experts and len(pinned) > slots - k:
            return (f"pinned[{layer}]", f"{len(pinned)} pinned experts leave fewer than the {k} slots a token needs "
                    f"of the layer's {slots}", f"pin at most {slots - k}")
    resident = sum(plan.slots_per_layer) * plan.expert_bytes
    if resident > plan.budget_bytes:
        return ("slots_per_layer", f"{sum(plan.slots_per_layer)} slots of {plan.expert_bytes} bytes take "
                f"{resident / 2**30:.3f} GiB, more than budget_bytes ({plan.budget_bytes / 2**30:.3f} GiB)",
                "give fewer slots or a larger budget (`moegen plan SPEC --expert-memory-gib G --json`)")
    every_resident = all(s == experts for s in plan.slots_per_layer)
    if plan.offloaded == every_resident:
        return ("offloaded", f"{str(plan.offloaded).lower()}, but {'every' if every_resident else 'not every'} layer "
                f"holds all {experts} experts", "offloaded is true exactly when some layer has fewer slots than experts")
    return None


def load_plan(path) -> OffloadPlan:
    """An offload plan from a JSON file (a package's plan.json, `moegen plan SPEC --json`'s output),
    or a package's (its folder, or the imported package)."""
    path = Path(path.__file__).parent if hasattr(path, "__file__") else Path(path)
    if path.is_dir():
        path = path / "plan.json"
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise PlanError(path, "", f"cannot be read ({error.strerror})",
                        "give a plan.json (a package's, or `moegen plan SPEC --json > plan.json`)") from None
    except ValueError as error:
        raise PlanError(path, "", f"is not JSON ({error})", "write it again with `moegen plan SPEC --json`") from None
    return OffloadPlan.from_json(data, path)


def _sizes(ir: ModelIR) -> dict:
    m, sig, t = ir.spec.model, ir.signature, ir.target
    return {H: m.hidden_size, I: m.intermediate_size, E: m.num_experts, K: m.top_k, B: sig.element_bytes,
            W: expert_bytes(sig), HBM: t.hbm_gbps, LINK: t.host_link_gbps, RATE: matrix_tflops(sig, t)}


def _allocate(total: int, layers: int, top_k: int, experts: int,
              popularity: Optional[Sequence[Sequence[float]]]) -> list[int]:
    """Slots per layer. Every layer gets top_k (one step's experts must fit); the rest go, slot by
    slot, where the profile says the next slot catches the most accesses (uniform without one)."""
    slots = [top_k] * layers
    spare = total - top_k * layers
    if popularity is None:
        for layer in range(layers):
            extra = min(experts - top_k, spare // layers + (1 if layer < spare % layers else 0))
            slots[layer] += extra
        return slots
    shares = []
    for row in popularity:
        total_row = max(sum(row), 1e-12)
        shares.append(sorted((p / total_row for p in row), reverse=True))
    # Each layer's next slot, best gain first (ties to the lower layer).
    next_gain = [(-shares[l][slots[l]], l) for l in range(layers) if slots[l] < experts]
    heapq.heapify(next_gain)
    for _ in range(max(spare, 0)):
        if not next_gain:
            break
        _, best = heapq.heappop(next_gain)
        slots[best] += 1
        if slots[best] < experts:
            heapq.heappush(next_gain, (-shares[best][slots[best]], best))
    return slots


def plan_offload(ir: ModelIR, popularity: Optional[Sequence[Sequence[float]]] = None,
                 simulated_hit_rate: Optional[float] = None, estimate_from: Optional[str] = None) -> OffloadPlan:
    """popularity: per layer, per expert activation counts (a profile or a trace's counts).
    simulated_hit_rate: the trace simulator's result for this plan, when a trace was given."""
    m, spec = ir.spec.model, ir.spec
    sizes = _sizes(ir)
    expert_bytes = int(EXPERT_BYTES.subs(sizes))
    compute_us = float(LAYER_COMPUTE_US.subs(sizes))
    transfer_us = float(TRANSFER_US.subs(sizes))
    budget = int(expert_memory_gib(spec) * 2**30)
    layers, experts, k = m.num_layers, m.num_experts, m.top_k
    total_slots = budget // expert_bytes
    if total_slots >= layers * experts:
        return OffloadPlan(False, layers, experts, k, expert_bytes, budget, (experts,) * layers,
                           ((),) * layers, spec.offload.policy, spec.offload.prefetch, 0, compute_us,
                           transfer_us, 1.0, 0.0, 0.0, "all resident")
    shortfall = expert_memory_shortfall(spec)  # the loader's rule, again for a trace's layer count
    if shortfall is not None:
        raise SpecError(ir.spec_file, *shortfall)
    if popularity is not None and (len(popularity) != layers or any(len(row) != experts for row in popularity)):
        raise ValueError(f"popularity must be {layers} layers x {experts} experts")
    slots = _allocate(total_slots, layers, k, experts, popularity)
    pinned = ((),) * layers
    if spec.offload.policy == "pinned_lru" and popularity is not None:
        # Pin the most popular experts, keeping top_k dynamic slots for everything else.
        pinned = tuple(tuple(sorted(sorted(range(experts), key=lambda e: (-row[e], e))[:max(0, s - k)]))
                       for row, s in zip(popularity, slots))
    lookahead = 0 if spec.offload.prefetch == "none" else min(layers - 1, max(1, math.ceil(transfer_us / compute_us)))
    if simulated_hit_rate is not None:
        hit_rate, source = simulated_hit_rate, estimate_from or "trace"
    elif popularity is not None:
        # Lower bound: accesses that land on the slots' worth of most popular experts.
        hit_rate = sum(sum(sorted(row, reverse=True)[:s]) / max(sum(row), 1e-12)
                       for row, s in zip(popularity, slots)) / layers
        source = estimate_from or "profile"
    else:
        hit_rate, source = sum(s / experts for s in slots) / layers, "uniform routing"
    misses_per_token = layers * k * (1.0 - hit_rate)
    return OffloadPlan(True, layers, experts, k, expert_bytes, budget, tuple(slots), pinned,
                       spec.offload.policy, spec.offload.prefetch, lookahead, compute_us, transfer_us,
                       hit_rate, misses_per_token * expert_bytes, misses_per_token * transfer_us / 1e3, source)


def simulated_hit_rate(ir: ModelIR, trace, plan: OffloadPlan) -> float:
    """Replay the trace through the engine this plan configures (its slots, pinning, policy and
    prefetch mode): the same code the runtime runs."""
    from moegen.offload.engine import engine_for_plan, routing_predictor
    from moegen.offload.simulate import link_model, replay

    engine = engine_for_plan(plan, predictor=routing_predictor(plan.prefetch, plan.num_layers, plan.num_experts))
    replay(trace, engine, link_model(ir.spec), max(1, plan.lookahead))
    return engine.stats.hit_rate


def with_trace_layers(ir: ModelIR, trace) -> ModelIR:
    """The IR for replaying `trace`: experts and top-k must agree with the spec; the layer count
    is the trace's (a trace may cover a model variant with another depth)."""
    from dataclasses import replace

    from moegen.offload.trace import TraceError

    m = ir.spec.model
    if (trace.num_experts, trace.top_k) != (m.num_experts, m.top_k):
        raise TraceError(trace.path, 1, f"the trace routes top-{trace.top_k} of {trace.num_experts} experts but "
                         f"{ir.spec_file} has top-{m.top_k} of {m.num_experts}",
                         "use a spec of the model the trace was recorded from")
    if trace.num_layers == m.num_layers:
        return ir
    spec = replace(ir.spec, model=replace(m, num_layers=trace.num_layers))
    shortfall = expert_memory_shortfall(spec)
    if shortfall is not None:
        field, problem, fix = shortfall
        raise TraceError(trace.path, 1, f"the trace covers {trace.num_layers} layers ({ir.spec_file} {m.num_layers}), "
                         f"too many for {ir.spec_file}'s {field}: {problem}",
                         f"{fix}, or use a trace of the spec's {m.num_layers} layers")
    return replace(ir, spec=spec)


def trace_popularity(trace) -> list[list[int]]:
    """Per layer, how often the trace routed to each expert."""
    import numpy as np

    return [np.bincount(trace.experts[:, layer, :].ravel(), minlength=trace.num_experts).tolist()
            for layer in range(trace.num_layers)]


def plan_for_trace(ir: ModelIR, trace_path) -> OffloadPlan:
    """The plan with the trace as activation profile (slot allocation, pinning) and its hit rate
    from replaying the trace through the policy the spec names."""
    from moegen.offload.trace import load_trace

    trace = load_trace(trace_path)
    ir = with_trace_layers(ir, trace)
    popularity = trace_popularity(trace)
    first = plan_offload(ir, popularity)
    if not first.offloaded:
        return first
    hit_rate = simulated_hit_rate(ir, trace, first)
    return plan_offload(ir, popularity, hit_rate, f"trace {Path(str(trace_path)).name}")
