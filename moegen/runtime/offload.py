"""The offloaded model-level MoE runtime: experts of L layers in pinned host memory, a
preallocated GPU slot pool per layer, and an expert -> slot table per layer that routes the
fused kernels straight into the pool (no weights gathered into a per-step tensor).

The decisions (hits, demand loads, prefetches, victims) come from the same
moegen.offload.policies.OffloadPolicyEngine that `moegen simulate` replays traces through.
Per layer and step: the routing is read back to the host (which experts to load depends on it:
offloaded decoding synchronizes once per layer by nature); demand misses are copied at once on
the compute stream, so the step's kernels, launched right behind them, wait for them on the GPU
and the host's remaining work (the slot table, the launch) overlaps the copies; the kernels run
on the pool, as a CUDA graph per layer for decode-sized batches (after the per-layer
synchronization the GPU idles until the host has launched the step, so the step's launches are
the latency); then the experts predicted for the layer `lookahead` ahead are prefetched on a
side CUDA stream, ordered with events: a prefetch into a layer's pool waits for that layer's
previous kernels and for the current step's demand copies (the link serves those first), and
the layer's next copies and kernels wait for its prefetches. A step with
more distinct experts than slots (a prompt, a large batch) streams them through the pool in
groups, each group's copies on the side stream while the group before computes. The stall
(time the kernels waited for copies) is measured on the GPU by timing events around the waits.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from moegen.offload.engine import engine_for_plan, routing_predictor
from moegen.offload.policies import OffloadPolicyEngine
from moegen.offload.predictors import Predictor
from moegen.plan.offload import OffloadPlan
from moegen.runtime import fused
from moegen.runtime.host_experts import HostExperts
from moegen.runtime.step_graphs import StepGraphs


@dataclass
class _Pool:
    parts: dict  # stored tensor name (w13, w2, w13_scale, ...) -> [slots, ...] on the GPU
    slot_table: torch.Tensor  # [E] int32 on the GPU: expert -> slot (-1: not resident)
    staging: torch.Tensor  # [E] int32, pinned: the next table, copied without a synchronization
    done: Optional[torch.cuda.Event] = None  # after this layer's kernels, for prefetch ordering
    landed: Optional[torch.cuda.Event] = None  # after this layer's prefetch copies
    staged: Optional[torch.cuda.Event] = None  # after the table's copy out of `staging`
    moved: bool = True  # experts came or went since the table was last published


class RouterPredictor(Predictor):
    """Layer l's experts predicted by applying layer l's router to the current hidden state
    (consecutive layers' hidden states differ little). The router's own top-k are taken as
    near-certain (0.95); further candidates carry their softmax score."""

    def __init__(self, routers: Sequence[torch.Tensor], top_k: int, candidates: int):
        self.routers, self.top_k, self.candidates = routers, top_k, candidates
        self._staged: Optional[tuple] = None

    def stage(self, layer: int, hidden: torch.Tensor) -> None:
        """Queue the prediction for `layer` from `hidden` on the device now, and its copy to the
        host behind it, ahead of the copies and kernels the caller launches next: predict() then
        reads it without waiting for them. (Read in predict(), a copy queued behind the layer's
        step would wait for its demand copies and kernels, the host with it, and the prefetch
        copies would not overlap them.)"""
        top = self._top(layer, hidden)
        indices, values = top.indices.to("cpu", non_blocking=True), top.values.to("cpu", non_blocking=True)
        landed = None
        if hidden.is_cuda:
            landed = torch.cuda.Event()
            landed.record()
        self._staged = (layer, indices, values, landed)

    def predict(self, layer, context):
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == layer:
            _, indices, values, landed = staged
            if landed is not None:
                landed.synchronize()  # complete already: the routing read back since was queued after it
        elif context.hidden is None:
            return []
        else:
            top = self._top(layer, context.hidden)
            indices, values = top.indices, top.values
        return [(e, 0.95 if rank < self.top_k else p)
                for rank, (e, p) in enumerate(zip(indices.tolist(), values.tolist()))]


    def _top(self, layer: int, hidden: torch.Tensor):
        router = self.routers[layer]  # in the spec's router dtype (DeepSeek's: float32), as the layer routes
        scores = torch.softmax((hidden.to(router.dtype) @ router.T).float(), dim=-1).amax(dim=0)
        return scores.topk(min(self.candidates, scores.numel()))


def runtime_predictor(mode: str, plan: OffloadPlan, routers: Optional[Sequence[torch.Tensor]] = None
                      ) -> Optional[Predictor]:
    """The predictor a spec's `offload.prefetch` asks for; `router` needs the layers' router weights."""
    if mode == "router":
        if routers is None:
            raise ValueError("prefetch: router needs the routers of the offloaded layers (routers=[E, H] per layer)")
        return RouterPredictor(routers, plan.top_k, candidates=2 * plan.top_k)
    return routing_predictor(mode, plan.num_layers, plan.num_experts)


class OffloadedMoE:
    """forward(layer, hidden_states, topk_weights, topk_ids) for each of the plan's layers."""

    def __init__(self, kernels: fused.KernelSet, plan: OffloadPlan, host: HostExperts,
                 engine: OffloadPolicyEngine, device="cuda"):
        if (plan.num_experts, plan.top_k) != (kernels.num_experts, kernels.top_k):
            raise ValueError(f"the plan routes top-{plan.top_k} of {plan.num_experts} experts, the kernels top-"
                             f"{kernels.top_k} of {kernels.num_experts}: plan the spec the package was built from")
        expert_bytes = kernels.weight_format.expert_bytes(kernels.hidden_size, kernels.intermediate_size)
        if plan.expert_bytes != expert_bytes:
            raise ValueError(f"the plan's experts take {plan.expert_bytes} bytes, the kernels' {expert_bytes}: plan "
                             "the spec the package was built from")
        engine_slots = tuple(cache.slots for cache in engine.caches)
        if (engine.num_layers, engine.num_experts, engine_slots) != (plan.num_layers, plan.num_experts,
                                                                    tuple(plan.slots_per_layer)):
            raise ValueError(f"the engine caches {engine.num_experts} experts in slots {list(engine_slots)}, the plan "
                             f"{plan.num_experts} in {list(plan.slots_per_layer)}: build the engine from this plan")
        if host.num_layers != plan.num_layers:
            raise ValueError(f"host experts have {host.num_layers} layers, the plan {plan.num_layers}")
        stored = fused.stored_tensors(kernels, kernels.num_experts)
        if sorted(host.parts) != sorted(stored):
            raise ValueError(f"host experts hold {sorted(host.parts)}, the package's {kernels.weight_format.quantization} "
                             f"experts {sorted(stored)}: HostExperts.quantized(package.KERNELS.weight_format) makes them")
        for name, (shape, dtype) in stored.items():
            for layer, tensor in enumerate(host.parts[name]):
                if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise ValueError(f"host experts' {name} of layer {layer}: expected {list(shape)} {dtype}, "
                                     f"got {list(tensor.shape)} {tensor.dtype}")
        self.kernels, self.plan, self.host, self.engine = kernels, plan, host, engine
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as the tensors on it name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.on_gpu = self.device.type == "cuda"
        self.lookahead = max(1, plan.lookahead)
        self._stall_s = 0.0  # waits for copies resolved so far
        self._stall_marks: list = []  # (start, end) timing events around a step's waits, not yet read
        self._demand_landed: Optional[torch.cuda.Event] = None  # after the latest step's demand copies
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        self.pools = [
            _Pool({name: torch.empty((slots, *shape[1:]), dtype=dtype, device=self.device)
                   for name, (shape, dtype) in stored.items()},
                  torch.full((kernels.num_experts,), -1, dtype=torch.int32, device=self.device),
                  torch.empty(kernels.num_experts, dtype=torch.int32, pin_memory=self.on_gpu))
            for slots in plan.slots_per_layer
        ]
        self.graphs = StepGraphs(self.device)
        self._first_step = True
        # Pinned experts, and every expert of a layer whose pool holds them all, copied in now
        # (stream-ordered before the first step) instead of as demand loads at their first use.
        for load in engine.preload():
            self._copy(load, None)

    @classmethod
    def from_plan(cls, kernels: fused.KernelSet, plan: OffloadPlan, host: HostExperts, *,
                  routers: Optional[Sequence[torch.Tensor]] = None, device="cuda",
                  cap_bytes_at_lru: bool = True) -> "OffloadedMoE":
        """The runtime the plan configures: its policy and pinned experts, prefetching as its
        `prefetch` mode says (`router` takes the offloaded layers' router weights, [E, H] each);
        cap_bytes_at_lru as engine_for_plan takes it."""
        predictor = runtime_predictor(plan.prefetch, plan, routers)
        return cls(kernels, plan, host, engine_for_plan(plan, predictor=predictor, cap_bytes_at_lru=cap_bytes_at_lru),
                   device)

    @property
    def stats(self):
        return self.engine.stats

    @property
    def stall_s(self) -> float:
        """Seconds the steps waited for expert copies (demand loads, prefetches not yet landed):
        on the GPU the time between events around the waits, read once they have completed."""
        self._read_stall_marks()
        return self._stall_s

    def _read_stall_marks(self) -> None:
        pending = []
        for start, end in self._stall_marks:
            if end.query():
                self._stall_s += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end))
        self._stall_marks = pending

    @property
    def pool_bytes(self) -> int:
        return sum(part.nbytes for p in self.pools for part in p.parts.values())

    def _copy(self, load, stream) -> None:
        pool = self.pools[load.layer]
        pool.moved = True
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for name, host in self.host.parts.items():
                pool.parts[name][load.slot].copy_(host[load.layer][load.expert], non_blocking=self.on_gpu)

    def _prefetch(self, layer: int, hidden_states) -> None:
        loads = self.engine.before_layer(layer, hidden_states)
        if not loads:
            return
        pool = self.pools[layer]
        if self.on_gpu and pool.done is not None:
            self.copy_stream.wait_event(pool.done)  # its previous kernels may still read these slots
        if self.on_gpu and self._demand_landed is not None:
            self.copy_stream.wait_event(self._demand_landed)  # the step's own demand copies take the link first
        for load in loads:
            self._copy(load, self.copy_stream)
        if self.on_gpu:
            pool.landed = torch.cuda.Event()
            pool.landed.record(self.copy_stream)

    def capture(self, hidden_states, topk_weights, topk_ids) -> None:
        """Capture every layer's step graph for batches shaped like these now, so that serving (or
        a benchmark) does not pay for the capture at its first token. The engine and the pools'
        contents are untouched; the captured run reads slot 0 for every expert."""
        self._routing_on_host(0, hidden_states, topk_weights, topk_ids)  # what forward() refuses is not captured
        if not self.graphs.enabled:
            return
        for layer, pool in enumerate(self.pools):
            pool.slot_table.zero_()
            self.graphs(layer, functools.partial(self._experts, pool), hidden_states, topk_weights, topk_ids)
            pool.moved = True  # the engine's table goes back at the layer's next step
        torch.cuda.synchronize(self.device)

    def begin_sequence(self) -> None:
        """A new sequence starts: predictions must not carry over the previous token."""
        self.engine.begin_token(new_sequence=True)

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """The layer's MoE output [T, H] for a routing chosen by the caller."""
        ids = self._routing_on_host(layer, hidden_states, topk_weights, topk_ids, stage=True)
        if self._first_step:  # the first layers' prefetches, before anything was routed
            self._first_step = False
            for early in range(min(self.lookahead, self.plan.num_layers)):
                self._prefetch(early, hidden_states)
        # A batch step is one access per distinct expert (a decode step: one per routed expert).
        distinct = list(dict.fromkeys(e for token in ids for e in token))
        if len(distinct) <= self.plan.slots_per_layer[layer]:
            out = self._step(layer, hidden_states, topk_weights, topk_ids, distinct)
        else:
            out = self._stream(layer, hidden_states, topk_weights, topk_ids, distinct)
        self.engine.learn(layer)  # while the kernels run
        self._prefetch((layer + self.lookahead) % self.plan.num_layers, hidden_states)
        return out

    def _routing_on_host(self, layer, hidden_states, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         stage: bool = False) -> list:
        """topk_ids as lists, after the per-layer host synchronization; the step's inputs checked
        first, before the cache policy sees anything: an id out of range would index another
        expert's slot, or fail deep in the policy. With stage, a router predictor's prediction for
        the layer this step prefetches for is queued before the synchronization."""
        try:
            in_range = 0 <= operator.index(layer) < self.plan.num_layers
        except TypeError:
            in_range = False
        if not in_range:
            raise ValueError(f"layer {layer!r}: expected an index in 0..{self.plan.num_layers - 1}")
        k, e, h = self.kernels.top_k, self.kernels.num_experts, self.kernels.hidden_size
        fused._check_tensor("hidden_states", hidden_states)
        tokens = hidden_states.shape[0] if hidden_states.dim() == 2 else "T"
        fused._check("hidden_states", hidden_states, (tokens, h), self.kernels.dtype, self.device)
        fused._check("topk_ids", topk_ids, (tokens, k), fused.INTEGER, self.device)
        fused._check("topk_weights", topk_weights, (tokens, k), fused.FLOATING, self.device)
        if stage and isinstance(self.engine.predictor, RouterPredictor):
            self.engine.predictor.stage((layer + self.lookahead) % self.plan.num_layers, hidden_states)
        ids = topk_ids.tolist()  # the per-layer host synchronization
        wrong = next(((t, j) for t, token in enumerate(ids) for j, expert in enumerate(token)
                      if not 0 <= expert < e), None)
        if wrong is not None:
            raise ValueError(f"topk_ids[{wrong[0]}, {wrong[1]}] = {ids[wrong[0]][wrong[1]]}: expected an expert "
                             f"id in 0..{e - 1} (layer {layer})")
        return ids

    def _step(self, layer, hidden_states, topk_weights, topk_ids, distinct) -> torch.Tensor:
        """A step whose experts fit the pool: demand loads, then the kernels on the pool (through
        the layer's CUDA graph for decode-sized batches)."""
        pool = self.pools[layer]
        demand = self.engine.on_route(layer, distinct, learn=False).loads
        landed, pool.landed = pool.landed, None  # its prefetches land before a demand copy may reuse a slot
        self._wait_for_copies([landed], demand)
        if pool.moved:
            self._publish_slots(layer)
        out = self.graphs(layer, functools.partial(self._experts, pool), hidden_states, topk_weights, topk_ids)
        if self.on_gpu:
            pool.done = torch.cuda.Event()
            pool.done.record()
        return out

    def _stream(self, layer, hidden_states, topk_weights, topk_ids, distinct) -> torch.Tensor:
        """A step with more distinct experts than slots (a prompt, a large batch): its experts pass
        through the pool in groups of half the slots, resident ones first, each group's picks
        computed while the next group's copies run on the side stream; a copy waits only for the
        kernels that read the slot it overwrites. The groups' sums add up in float32."""
        pool, cache = self.pools[layer], self.engine.cache(layer)
        half = max(1, self.plan.slots_per_layer[layer] // 2)
        ordered = sorted(distinct, key=lambda e: e not in cache)  # resident first, no copy to wait for
        groups = [ordered[i:i + half] for i in range(0, len(ordered), half)]
        loads, tables = [], []  # each group's copies, and its expert -> slot table (others skipped)
        for g, group in enumerate(groups):
            loads.append(self.engine.on_route(layer, group, learn=False, more_of_step=g > 0).loads)
            table = [fused.SKIPPED_PICK] * self.kernels.num_experts
            for e in group:
                table[e] = cache.slot_of[e]
            tables.append(table)
        slot_tables = torch.tensor(tables, dtype=torch.int32, pin_memory=self.on_gpu).to(self.device,
                                                                                       non_blocking=True)
        picks = topk_ids.long()
        reader: dict = {}  # slot -> the last group whose kernels read it
        done: list = []  # each group's kernels' end

        def copy_group(g):
            """Group g's copies on the side stream, after the kernels that read their slots."""
            if not loads[g]:
                return None
            for after in sorted({reader[load.slot] for load in loads[g] if load.slot in reader}):
                self.copy_stream.wait_event(done[after])
            for load in loads[g]:
                self._copy(load, self.copy_stream)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            return event

        landed = [pool.landed]  # the prefetches into the pool
        pool.landed = None
        if self.on_gpu:
            if pool.done is not None:
                self.copy_stream.wait_event(pool.done)  # the layer's previous kernels still read the slots
            landed.append(copy_group(0))
        out = None
        for g, group in enumerate(groups):
            self._wait_for_copies(landed, [] if self.on_gpu else loads[g])
            part = fused.fused_experts_on_slots(self.kernels, hidden_states, topk_weights, slot_tables[g][picks],
                                                pool.parts["w13"], pool.parts["w2"], **self._scales(pool),
                                                skipped_picks=True)
            out = part.float() if out is None else out.add_(part)
            reader.update((tables[g][e], g) for e in group)
            if self.on_gpu:
                done.append(torch.cuda.Event())
                done[-1].record()
                landed = [copy_group(g + 1)] if g + 1 < len(groups) else []
        pool.moved = True  # the table on the GPU is still the last step's
        pool.done = done[-1] if done else None
        return out.to(hidden_states.dtype)

    def _wait_for_copies(self, events: list, loads: list) -> None:
        """The compute stream waits for `events` (copies on the side stream), then copies `loads`
        itself: the kernels behind wait for both, and that wait is the stall (on the GPU the time
        between events around it, read later; on the CPU the copies' own time)."""
        events = [e for e in events if e is not None]
        if not self.on_gpu:
            started = time.perf_counter()
            for load in loads:
                self._copy(load, None)
            self._stall_s += time.perf_counter() - started
            return
        if not events and not loads:
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for event in events:
            stream.wait_event(event)
        for load in loads:  # on the compute stream: the kernels behind run after them
            self._copy(load, None)
        end.record(stream)
        if loads:
            self._demand_landed = end
        self._stall_marks.append((start, end))
        if len(self._stall_marks) >= 64:  # the per-layer synchronization completed most
            self._read_stall_marks()

    def _publish_slots(self, layer: int) -> None:
        """Copy the engine's expert -> slot table of ``layer`` to the GPU, stream-ordered."""
        pool = self.pools[layer]
        if pool.staged is not None:
            pool.staged.synchronize()  # the previous copy has read the staging buffer
        pool.staging.copy_(torch.tensor(self.engine.cache(layer).slot_of, dtype=torch.int32))
        pool.slot_table.copy_(pool.staging, non_blocking=self.on_gpu)
        if self.on_gpu:
            pool.staged = torch.cuda.Event()
            pool.staged.record()
        pool.moved = False

    def _experts(self, pool: _Pool, hidden_states, topk_weights, topk_ids) -> torch.Tensor:
        slot_ids = pool.slot_table[topk_ids.long()]
        return fused.fused_experts_on_slots(self.kernels, hidden_states, topk_weights, slot_ids, pool.parts["w13"],
                                            pool.parts["w2"], **self._scales(pool))

    @staticmethod
    def _scales(pool: _Pool) -> dict:
        return {name: value for name, value in pool.parts.items() if name not in ("w13", "w2")}
