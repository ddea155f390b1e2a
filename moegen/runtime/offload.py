"""The offloaded model-level MoE runtime: experts of L layers in pinned host memory, a
preallocated GPU slot pool per layer, and an expert -> slot table per layer that routes the
fused kernels straight into the pool (no weights gathered into a per-step tensor).

Per layer and step: the routing is read back to the host (the experts needed decide what to
load: offloaded decoding synchronizes once per layer by nature), the policy engine answers
which are resident and which must load now (demand misses, copied synchronously and counted),
the kernels run on the pool, and the experts predicted for a later layer are prefetched on a
side CUDA stream, ordered with events: a prefetch into layer l's pool waits until layer l's
previous kernels are done; layer l's kernels wait until its prefetches have landed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from moegen.plan.offload import OffloadPlan
from moegen.runtime import fused
from moegen.runtime.host_experts import HostExperts

# predictor(layer, hidden_states, topk_ids) -> ranked expert ids expected at `layer`
Predictor = Callable[[int, torch.Tensor, torch.Tensor], Sequence[int]]


@dataclass
class OffloadStats:
    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0  # hits on experts a prefetch brought in
    prefetches: int = 0
    wasted_prefetch_bytes: int = 0  # prefetched, then evicted unused
    bytes_moved: int = 0
    stall_s: float = 0.0  # host time blocked on demand loads and late prefetches
    transfer_s: float = 0.0  # side-stream copy time (GPU events), hidden or not
    layer_steps: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


@dataclass
class _Layer:
    w13: torch.Tensor  # [slots, 2I, H] on the GPU
    w2: torch.Tensor  # [slots, H, I]
    slot_table: torch.Tensor  # [E] int32 on the GPU: expert -> slot (-1: not resident)
    done: Optional[torch.cuda.Event] = None  # after this layer's kernels, for prefetch ordering
    landed: Optional[torch.cuda.Event] = None  # after this layer's prefetches
    prefetched: set = field(default_factory=set)  # experts brought in by a prefetch, not yet used


class OffloadedMoE:
    """forward(layer, hidden_states, topk_weights, topk_ids) for each of the plan's layers."""

    def __init__(self, kernels: fused.KernelSet, plan: OffloadPlan, host: HostExperts, engine,
                 device="cuda", predictor: Optional[Predictor] = None):
        if host.num_layers != plan.num_layers:
            raise ValueError(f"host experts have {host.num_layers} layers, the plan {plan.num_layers}")
        self.kernels, self.plan, self.host, self.engine = kernels, plan, host, engine
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.predictor = predictor
        self.expert_bytes = host.expert_bytes
        self.stats = OffloadStats()
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        h, i, dtype = kernels.hidden_size, kernels.intermediate_size, kernels.dtype
        self.layers = [
            _Layer(torch.empty((slots, 2 * i, h), dtype=dtype, device=self.device),
                   torch.empty((slots, h, i), dtype=dtype, device=self.device),
                   torch.full((kernels.num_experts,), -1, dtype=torch.int32, device=self.device))
            for slots in plan.slots_per_layer
        ]
        # Pinned experts (and, with no pinning, nothing) load once up front.
        for layer, loads in enumerate(engine.initial_loads()):
            for load in loads:
                self._copy(layer, load, stream=None)
        self._synchronize()

    @property
    def expert_pool_bytes(self) -> int:
        return sum(layer.w13.numel() * layer.w13.element_size() + layer.w2.numel() * layer.w2.element_size()
                   for layer in self.layers)

    def _synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def _copy(self, layer: int, load, stream) -> None:
        pool = self.layers[layer]
        context = torch.cuda.stream(stream) if stream is not None else _null_context()
        with context:
            pool.w13[load.slot].copy_(self.host.w13[layer][load.expert], non_blocking=self.on_gpu)
            pool.w2[load.slot].copy_(self.host.w2[layer][load.expert], non_blocking=self.on_gpu)
        self.stats.bytes_moved += self.expert_bytes

    def _publish_slots(self, layer: int) -> None:
        """The GPU slot table from the engine's host-side residency (E int32, a few hundred bytes)."""
        table = [-1] * self.kernels.num_experts
        for expert, slot in self.engine.resident(layer).items():
            table[expert] = slot
        self.layers[layer].slot_table.copy_(torch.tensor(table, dtype=torch.int32))

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        pool = self.layers[layer]
        needed = sorted(set(topk_ids.reshape(-1).tolist()))  # the per-layer host synchronization
        if pool.landed is not None:  # prefetches into this layer must land before it runs
            started = time.perf_counter()
            pool.landed.synchronize()
            self.stats.stall_s += time.perf_counter() - started
            pool.landed = None
        hits, demand = self.engine.on_route(layer, needed)
        self.stats.hits += hits
        self.stats.misses += len(demand)
        self.stats.prefetch_hits += len(pool.prefetched.intersection(needed))
        pool.prefetched.difference_update(needed)
        if demand:
            started = time.perf_counter()
            for load in demand:
                self._evicted(layer, load)
                self._copy(layer, load, stream=None)
            self._synchronize()  # a demand miss is a synchronous load
            self.stats.stall_s += time.perf_counter() - started
        self._publish_slots(layer)
        slot_ids = pool.slot_table[topk_ids.long()]
        out = fused.fused_experts_on_slots(self.kernels, hidden_states, topk_weights, slot_ids, pool.w13, pool.w2)
        self.stats.layer_steps += 1
        if self.on_gpu:
            pool.done = torch.cuda.Event()
            pool.done.record()
        self._prefetch(layer, hidden_states, topk_ids)
        return out

    def _evicted(self, layer: int, load) -> None:
        pool = self.layers[layer]
        if load.evicted is not None and load.evicted in pool.prefetched:
            pool.prefetched.discard(load.evicted)
            self.stats.wasted_prefetch_bytes += self.expert_bytes

    def _prefetch(self, layer: int, hidden_states, topk_ids) -> None:
        if self.plan.lookahead == 0 or self.predictor is None:
            return
        target = (layer + self.plan.lookahead) % self.plan.num_layers
        predicted = self.predictor(target, hidden_states, topk_ids)
        loads = self.engine.before_layer(target, predicted)
        if not loads:
            return
        pool = self.layers[target]
        if self.on_gpu and pool.done is not None:
            self.copy_stream.wait_event(pool.done)  # its previous kernels may still read the slots
        for load in loads:
            self._evicted(target, load)
            self._copy(target, load, stream=self.copy_stream)
            pool.prefetched.add(load.expert)
        self.stats.prefetches += len(loads)
        if self.on_gpu:
            pool.landed = torch.cuda.Event()
            pool.landed.record(self.copy_stream)


class _null_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def router_predictor(routers: Sequence[torch.Tensor], top_k: int, extra: int = 0) -> Predictor:
    """Predict layer l's experts by applying layer l's router to the current hidden state
    (hidden states change little between consecutive layers)."""
    def predict(layer: int, hidden_states: torch.Tensor, _topk_ids) -> list[int]:
        logits = hidden_states @ routers[layer].T
        return logits.float().topk(min(top_k + extra, logits.shape[-1]), dim=-1).indices.reshape(-1).unique().tolist()

    return predict
