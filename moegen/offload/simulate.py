"""Replay a routing trace through the offload engine: hit rate, bytes moved, stall time.

Each named policy (``PRESETS``) is an engine configuration; ``simulate`` drives the engine token by
token and layer by layer exactly as the runtime would, and measures:

- ``hit_rate``: accesses whose expert is resident when the token reaches the layer, out of all
  accesses (tokens x layers x top_k). An expert whose prefetch was issued before the layer was
  reached counts as resident; whether its copy had finished in time is what ``stall_ms`` charges
  (and ``timely_hit_rate`` counts only copies that had finished).
- ``bytes``: every byte moved host-to-GPU, demand loads and prefetches alike; one expert is
  ``expert_bytes``: gate, up and down projections as stored (3 * H * I * element bytes unquantized).
- ``stall_ms``: mean time per token that compute waits for expert copies, in this model:

  * Steps run in order, one per (token, layer). A step's compute takes ``layer_ms`` (the caller
    passes the cost model's decode floor for one token: (k*3*H*I*b + 2*H*b) / HBM bandwidth) and
    starts once the previous step's compute has ended and every expert it needs has arrived.
  * One host-to-device link, first in first out, at ``link_gbps`` GB/s: a copy takes
    expert_bytes / link bandwidth and starts when the link is free.
  * When a step's routing is known its demand misses are queued at once, then the prefetches for
    the step ``lookahead`` layers ahead (for the next token's first layers: at the end of this
    token). A prefetch therefore hides behind the compute that runs before its step; what does not
    fit is stall. Copies for different steps share the link, so wasted prefetches delay demand.

  Nothing else (kernel launches, router, attention) is modelled: stall is time the expert copies
  add on top of the MoE compute floor. With H200 figures one DeepSeek-V2-Lite expert copies in
  0.31 ms over PCIe while a layer computes a token in 22 us: the link is the bottleneck, stall
  follows bytes, and a prefetch one layer ahead hides only a small part of its copy
  (``timely_hit_rate`` stays near the hit rate without prefetch).

Presets: ``lru``, ``lfu``, ``pinned_lru`` (pins each layer's most used experts of the trace, an
offline activation profile, so online=False when any are pinned), ``belady`` (offline optimum for
demand fetch; prefetching policies can exceed its hit rate, never its byte count), and
``decayed_lfu`` (two-timescale frequency, demand fetch), ``neighbor_lfu`` (decayed_lfu keeping
what the nearest-tokens predictor expects the next token to need, demand fetch: fewest bytes),
``history``, ``xlayer`` and ``neighbors`` (decayed_lfu plus prefetch from the history, the
cross-layer or the nearest-tokens predictor, within LRU's byte budget; the nearest-tokens one
also tells the evictions what the next token will likely need).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from moegen.offload.engine import ROUTING_PREDICTORS
from moegen.offload.eviction import POLICIES, belady_factory
from moegen.offload.policies import OffloadPolicyEngine
from moegen.offload.trace import Trace

@dataclass(frozen=True)
class LinkModel:
    """The time figures of the stall model."""

    expert_bytes: int
    layer_ms: float  # one layer's MoE compute for one token
    link_gbps: float  # host-to-device GB/s (1e9 bytes per second)

    @property
    def transfer_ms(self) -> float:
        return self.expert_bytes / (self.link_gbps * 1e6)


def expert_bytes(spec) -> int:
    """One expert's gate, up and down projections in bytes, as the spec's format stores them."""
    return spec.model.expert_bytes


def decode_layer_ms(spec, hbm_gbps: float) -> float:
    """The cost model's memory floor for one token through one MoE layer (k experts' weights plus
    the activations in and out: moegen.plan.cost_model at T=1), in ms. At one token the compute
    floor is far below it."""
    from dataclasses import replace

    from moegen.ir import lower
    from moegen.plan.cost_model import bucket_cost

    ir = lower(spec, spec.name)
    return bucket_cost(ir.signature, replace(ir.target, hbm_gbps=hbm_gbps), 1).memory_us / 1e3


def link_model(spec) -> LinkModel:
    from moegen.target import resolve_target

    target = resolve_target(spec.target)
    return LinkModel(expert_bytes(spec), decode_layer_ms(spec, target.hbm_gbps), target.host_link_gbps)


@dataclass(frozen=True)
class SimResult:
    policy: str
    online: bool
    hit_rate: float
    bytes: int
    stall_ms: float  # mean per token
    timely_hit_rate: float  # hits whose copy had completed when the step started
    tokens: int
    prefetch_loads: int
    wasted_prefetches: int

    def to_json(self) -> dict:
        return {"hit_rate": self.hit_rate, "bytes": self.bytes, "stall_ms": self.stall_ms, "online": self.online}


def popular_experts(trace: Trace, per_layer: int) -> list:
    """Each layer's ``per_layer`` most used experts over the whole trace (ties: lower id)."""
    pinned = []
    for layer in range(trace.num_layers):
        counts = [0] * trace.num_experts
        for e in trace.experts[:, layer, :].ravel().tolist():
            counts[e] += 1
        pinned.append(frozenset(sorted(range(trace.num_experts), key=lambda e: -counts[e])[:per_layer]))
    return pinned


def _engine_args(name: str, trace: Trace) -> dict:
    L, E = trace.num_layers, trace.num_experts
    if name == "pinned_lru":
        return {"policy": "pinned_lru", "pinned": "popular"}
    if name in POLICIES:  # the other eviction policies, demand fetch
        return {"policy": name}
    if name == "belady":
        accesses = [trace.experts[:, layer, :].tolist() for layer in range(L)]
        return {"policy": belady_factory(E, accesses)}
    if name in PREFETCHING:
        return {"policy": "decayed_lfu", "predictor": ROUTING_PREDICTORS[name](L, E), "byte_budget": "lru"}
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(PRESETS)}")


PREFETCHING = ("history", "xlayer", "neighbors")  # decayed_lfu + that predictor, within LRU's bytes
PRESETS = ("lru", "lfu", "pinned_lru", "belady", "decayed_lfu", "neighbor_lfu") + PREFETCHING
REQUIRED = ("lru", "belady")  # the reference points every report includes


def simulate(trace: Trace, slots: int, policy: str, link: LinkModel, lookahead: int = 1,
             **engine_options) -> SimResult:
    """Replay ``trace`` with ``slots`` expert slots per layer under the named preset;
    ``engine_options`` override the preset's OffloadPolicyEngine arguments (for experiments)."""
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1 layer, got {lookahead}")
    args = _engine_args(policy, trace)
    pinned_from_trace = False  # pins chosen from the trace itself make a policy offline
    if args.get("pinned") == "popular":
        # Pin half the slots beyond top_k: a step still finds top_k slots it may evict.
        count = max(0, (slots - trace.top_k) // 2)
        args["pinned"] = popular_experts(trace, count) if count else None
        pinned_from_trace = count > 0
    args.update(engine_options)
    engine = OffloadPolicyEngine(trace.num_layers, trace.num_experts, slots, expert_bytes=link.expert_bytes, **args)
    stall_ms, timely = replay(trace, engine, link, lookahead)
    stats = engine.stats
    return SimResult(
        policy=policy,
        online=engine.online and not pinned_from_trace,
        hit_rate=stats.hit_rate,
        bytes=stats.bytes_moved,
        stall_ms=stall_ms / trace.num_tokens,
        timely_hit_rate=timely / stats.accesses,
        tokens=trace.num_tokens,
        prefetch_loads=stats.prefetch_loads,
        wasted_prefetches=stats.wasted_prefetches,
    )


def replay(trace: Trace, engine: OffloadPolicyEngine, link: LinkModel, lookahead: int = 1) -> tuple:
    """Drive ``engine`` through the trace under the stall model. Returns (total stall ms, timely hits)."""
    L = trace.num_layers
    tokens, seq = trace.experts.tolist(), trace.seq.tolist()
    transfer, compute = link.transfer_ms, link.layer_ms
    arrival = [dict() for _ in range(L)]  # per layer: expert -> when its latest copy completes
    link_free = 0.0  # when the link finishes the copies queued so far
    compute_end = 0.0  # when the previous step's compute ends
    stall, timely = 0.0, 0

    def queue(loads, now):
        nonlocal link_free
        for load in loads:
            link_free = (link_free if link_free > now else now) + transfer
            arrival[load.layer][load.expert] = link_free

    engine.begin_token(new_sequence=True)
    for layer in range(min(lookahead, L)):
        queue(engine.before_layer(layer), 0.0)
    last = len(tokens) - 1
    for t, token in enumerate(tokens):
        for layer, chosen in enumerate(token):
            now, cache, arrived = compute_end, engine.caches[layer], arrival[layer]
            for e in chosen:
                if e in cache and arrived[e] <= now:
                    timely += 1
            queue(engine.on_route(layer, chosen).loads, now)
            ahead = layer + lookahead
            if ahead < L:
                queue(engine.before_layer(ahead), now)
            elif layer == L - 1 and t < last:
                engine.begin_token(new_sequence=seq[t + 1] != seq[t])
                for early in range(min(lookahead, L)):
                    queue(engine.before_layer(early), now)
            start = max(now, max(arrived[e] for e in chosen))
            stall += start - now
            compute_end = start + compute
    return stall, timely


def simulate_all(trace: Trace, slots: int, link: LinkModel, policies: Sequence[str] = PRESETS,
                 lookahead: int = 1, progress: Optional[Callable[[str], None]] = None) -> dict:
    """{name: SimResult} for each preset, in the given order."""
    results = {}
    for name in policies:
        if progress is not None:
            progress(name)
        results[name] = simulate(trace, slots, name, link, lookahead)
    return results
