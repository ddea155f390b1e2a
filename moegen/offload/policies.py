"""The expert-cache policy engine of offloaded MoE inference: slot caches, eviction and prefetch, per token.

Experts live in pinned host memory; each MoE layer owns a GPU pool of ``slots`` expert slots. For
every token the runtime (or the trace simulator) drives one ``OffloadPolicyEngine``:

    engine.begin_token(new_sequence=...)    # optional: routing a layer twice starts the next token
    for layer in range(num_layers):
        engine.before_layer(layer)          # -> [Load(kind="prefetch")]: copy these on the side stream
        experts = router(hidden)            #    (call it as early as you like: one layer ahead, more)
        hits, loads = engine.on_route(layer, experts)   # -> [Load(kind="demand")]: copy, then compute
        # the kernel reads engine.cache(layer).slot_of: expert -> slot (-1: not resident)

A runtime may split on_route: ``on_route(layer, experts, learn=False)`` decides, and
``learn(layer)`` (after the kernels are launched, off the critical path) lets the predictor learn
from the routing; the decisions are the same as with one call.

A Load names the slot to copy into and the expert it evicts; engine.stats counts hits, misses,
prefetch hits, wasted prefetches and bytes moved.

Rules shared by every policy: an expert the current step needs is never evicted; pinned experts
are never evicted; a demand miss loads at once; a prefetch loads early and evicts by the same
policy, never a pinned expert, one predicted or prefetched for the same step, nor one the layer's
latest step used (it may still be computing when the runtime prefetches far ahead). A slot keeps
its expert until that expert is evicted, so slot indices are stable for resident experts.

The eviction policies and slot caches are in ``moegen.offload.eviction``, the predictors in
``moegen.offload.predictors``; this module's engine drives them. Plain Python, deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence, Union

from moegen.offload.eviction import EvictionPolicy, LayerCache, NeighborLfu, policy_factory
from moegen.offload.predictors import NeighborPredictor, Predictor, RouteContext

DEMAND = "demand"
PREFETCH = "prefetch"
PRELOAD = "preload"


class Load(NamedTuple):
    """One host-to-GPU expert copy the runtime must issue (a NamedTuple: cheap, immutable)."""

    layer: int
    expert: int
    slot: int
    evicted: Optional[int]  # the expert that held the slot, None when the slot was free
    kind: str  # DEMAND (needed now: copy, then compute), PREFETCH (side stream, needed later), PRELOAD


class RouteResult(NamedTuple):
    hits: int  # experts of this step that were already resident (or prefetched)
    loads: list  # [Load(kind=DEMAND)] for the others


# ---------------------------------------------------------------------------------------------
# The engine


class LruByteBudget:
    """What demand-fetch LRU would have moved: shadow LRU caches that only count their loads. The
    engine prefetches only while its own loads stay below this count, so prefetching never moves
    more bytes than LRU would; it spends exactly what the better eviction saved."""

    def __init__(self, slots_per_layer: Sequence[int], reserve: int = 0):
        self._caches = [{} for _ in slots_per_layer]  # insertion order = recency (oldest first)
        self._slots = list(slots_per_layer)
        self.reserve = reserve
        self.loads = 0

    def record(self, layer: int, experts: Sequence[int]) -> None:
        cache = self._caches[layer]
        for e in experts:
            if e in cache:
                del cache[e]  # re-inserting moves it to the recent end
            else:
                self.loads += 1
                if len(cache) >= self._slots[layer]:
                    for victim in cache:
                        if victim not in experts:
                            break
                    del cache[victim]
            cache[e] = True

    def room(self, loads_so_far: int) -> int:
        """How many more loads fit in the budget now."""
        return max(0, self.loads - self.reserve - loads_so_far)


@dataclass
class EngineStats:
    accesses: int = 0
    hits: int = 0  # accesses whose expert was resident (prefetched ones included) when routed
    demand_loads: int = 0
    prefetch_loads: int = 0
    prefetch_hits: int = 0  # accesses served by an expert a prefetch brought in (first use only)
    evicted_unused: int = 0  # prefetched experts that left again without being used
    expert_bytes: int = 1
    unused_prefetched: list = field(default_factory=list, repr=False)  # per layer, set of experts

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def loads(self) -> int:
        return self.demand_loads + self.prefetch_loads

    @property
    def wasted_prefetches(self) -> int:
        """Prefetch loads never used: evicted unused, or still resident and unused."""
        return self.evicted_unused + sum(len(s) for s in self.unused_prefetched)

    @property
    def bytes_moved(self) -> int:
        return self.loads * self.expert_bytes

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


class OffloadPolicyEngine:
    """Per-layer slot caches driven by one eviction policy and an optional prefetch predictor.

    slots_per_layer: slots of each layer's GPU pool (an int means the same for every layer).
    policy: a name in POLICIES, or layer -> EvictionPolicy (e.g. belady_factory(...)).
    predictor: None (demand fetch only) or a Predictor.
    pinned: experts never evicted, one collection per layer (or one for all layers).
    prefetch_threshold: prefetch an expert only when its predicted probability reaches this.
    slack_threshold: the lower bar used, with a byte budget, while the unspent budget is large
        (``slack_fraction`` of LRU's loads and more; linear in between): bytes the eviction saved
        buy speculative prefetches, a tight budget only the surest ones.
    byte_budget: None, or "lru": prefetch only while the total loads stay within demand LRU's.
    The evictions weigh the ``later`` (what the next token will likely need) of the predictor, or
    for policy ``neighbor_lfu`` of a NeighborPredictor of its own when the predictor is not one.
    """

    def __init__(self, num_layers: int, num_experts: int, slots_per_layer: Union[int, Sequence[int]],
                 policy: Union[str, Callable[[int], EvictionPolicy]] = "lru",
                 predictor: Optional[Predictor] = None, pinned=None, prefetch_threshold: float = 0.75,
                 slack_threshold: float = 0.6, slack_fraction: float = 0.05,
                 byte_budget: Optional[str] = None, expert_bytes: int = 1):
        if isinstance(slots_per_layer, int):
            slots_per_layer = [slots_per_layer] * num_layers
        if len(slots_per_layer) != num_layers:
            raise ValueError(f"slots_per_layer lists {len(slots_per_layer)} layers, expected {num_layers}")
        if pinned is None:
            pinned = [frozenset()] * num_layers
        elif not (len(pinned) == num_layers and all(isinstance(p, (set, frozenset, list, tuple)) for p in pinned)):
            pinned = [frozenset(pinned)] * num_layers  # one collection of experts for every layer
        self.num_layers, self.num_experts = num_layers, num_experts
        self.caches = [LayerCache(num_experts, s, p) for s, p in zip(slots_per_layer, pinned)]
        make = policy_factory(policy, num_experts) if isinstance(policy, str) else policy
        self.policies = [make(layer) for layer in range(num_layers)]
        self.predictor = predictor
        self.advisor = predictor  # whose `later` the evictions weigh
        if policy == NeighborLfu.name and not isinstance(predictor, NeighborPredictor):
            self.advisor = NeighborPredictor(num_layers, num_experts)
        self._learners = [p for p in dict.fromkeys((predictor, self.advisor)) if p is not None]
        self.prefetch_threshold, self.slack_threshold = prefetch_threshold, slack_threshold
        self.slack_fraction = slack_fraction
        if byte_budget not in (None, "lru"):
            raise ValueError(f"byte_budget must be None or 'lru', got {byte_budget!r}")
        self.budget = LruByteBudget(slots_per_layer) if byte_budget == "lru" else None
        self.stats = EngineStats(expert_bytes=expert_bytes,
                                 unused_prefetched=[set() for _ in range(num_layers)])
        self._steps = [0] * num_layers  # tokens that have been routed at each layer
        self._current: list = [None] * num_layers
        self._previous: Optional[list] = None
        self._protected: list = [set() for _ in range(num_layers)]  # no prefetch may evict these
        self.begin_token(new_sequence=True)

    @property
    def online(self) -> bool:
        return all(p.online for p in self.policies) and all(p.online for p in self._learners)

    def cache(self, layer: int) -> LayerCache:
        return self.caches[layer]

    def begin_token(self, new_sequence: bool = False) -> None:
        """Start the next token: its predictions may use this token's choices, unless a new
        sequence starts."""
        if any(c is not None for c in self._current):
            self._previous = None if new_sequence else self._current
        elif new_sequence:
            self._previous = None
        self._current = [None] * self.num_layers
        self._context = RouteContext(self._current, self._previous)
        for learner in self._learners:
            learner.begin_token(self._context)

    def context(self, hidden=None) -> RouteContext:
        """What is known about the current token (one object per token, updated as it is routed)."""
        self._context.hidden = hidden
        return self._context

    def before_layer(self, layer: int, hidden=None) -> list:
        """Prefetch for ``layer``'s coming step: [Load(kind=PREFETCH)], best first."""
        if self.predictor is None:
            return []
        if self._current[layer] is not None:
            self.begin_token()  # this layer was routed already: the prediction is for the next token
        room = self.budget.room(self.stats.loads) if self.budget is not None else None
        if room == 0:
            return []  # nothing could be fetched: skip the prediction too
        ranked = self.predictor.predict(layer, self.context(hidden))
        threshold, cache = self._threshold(room), self.caches[layer]
        slot_of, protected = cache.slot_of, self._protected[layer]
        wanted = []
        for e, p in ranked:
            if p >= threshold:
                if slot_of[e] >= 0:
                    protected.add(e)  # predicted and already here: no prefetch may evict it
                else:
                    wanted.append(e)
        if room is not None:
            del wanted[room:]
        if not wanted:
            return []
        policy, step = self.policies[layer], self._steps[layer]
        chance = list(self._later(layer) or [0.0] * self.num_experts)
        for e, p in ranked:
            chance[e] += p
        evict = len(wanted) - (cache.slots - len(cache))
        victims = policy.victims(cache.evictable(protected), evict, step, chance) if evict > 0 else []
        victims.reverse()  # pop() from the end takes them most evictable first
        loads = []
        for e in wanted:
            victim = None
            if cache.full:
                if not victims:
                    break
                if policy.keep_score(e, step, chance) <= policy.keep_score(victims[-1], step, chance):
                    continue  # what it would displace is worth more
                victim = victims.pop()
            loads.append(self._load(layer, e, victim, PREFETCH))
            protected.add(e)
        return loads

    def preload(self) -> list:
        """[Load(kind=PRELOAD)] placing, before the first step, each layer's pinned experts and, in a
        layer whose slots hold all its experts, every expert: experts no policy would ever evict,
        which would otherwise come in as demand loads at their first use. Not counted in stats."""
        loads = []
        for layer, cache in enumerate(self.caches):
            wanted = range(self.num_experts) if cache.slots >= self.num_experts else sorted(cache.pinned)
            for expert in wanted:
                if expert not in cache:
                    slot, _ = cache.place(expert)
                    loads.append(Load(layer, expert, slot, None, PRELOAD))
        return loads

    def _threshold(self, room: Optional[int]) -> float:
        """The prefetch bar: prefetch_threshold, lowered toward slack_threshold while the unspent
        byte budget (``room`` loads) is a large share of what LRU has loaded."""
        if room is None:
            return self.prefetch_threshold
        slack = min(1.0, room / (self.slack_fraction * self.budget.loads))
        return self.prefetch_threshold - slack * (self.prefetch_threshold - self.slack_threshold)

    def on_route(self, layer: int, experts: Sequence[int], learn: bool = True, more_of_step: bool = False
                 ) -> RouteResult:
        """The router chose ``experts`` at ``layer``: count hits, load the misses (demand loads).
        With learn=False the predictor learns only at ``learn(layer)``, which must come before the
        next prediction. With more_of_step, ``experts`` are a further group of the layer's current
        step (a step with more distinct experts than slots is run in groups that fit)."""
        if self._current[layer] is not None and not more_of_step:
            self.begin_token()
        cache, policy, step, stats = self.caches[layer], self.policies[layer], self._steps[layer], self.stats
        needed = set(experts)
        if len(needed) < len(experts):  # a batch may repeat experts: each is loaded once
            experts = list(dict.fromkeys(experts))
        if len(needed) > cache.slots:
            raise ValueError(f"layer {layer}: {len(needed)} distinct experts needed but only {cache.slots} slots")
        unused, slot_of = stats.unused_prefetched[layer], cache.slot_of
        hits, loads = 0, []
        for e in experts:
            if slot_of[e] >= 0:
                hits += 1
                if e in unused:
                    unused.discard(e)
                    stats.prefetch_hits += 1
        if hits < len(experts):
            misses = [e for e in experts if slot_of[e] < 0]
            evict = len(misses) - (cache.slots - len(cache))
            victims = policy.victims(cache.evictable(needed), evict, step, self._later(layer)) if evict > 0 else []
            if len(victims) < evict:
                raise ValueError(f"layer {layer}: cannot make room for {misses}: pinned experts fill the pool")
            victims.reverse()  # pop() from the end takes them most evictable first
            for e in misses:
                loads.append(self._load(layer, e, victims.pop() if cache.full else None, DEMAND))
        stats.accesses += len(experts)
        stats.hits += hits
        policy.record(experts, step)
        if self.budget is not None:
            self.budget.record(layer, experts)
        self._current[layer] = (self._current[layer] or ()) + tuple(experts) if more_of_step else tuple(experts)
        if learn:
            self.learn(layer)
        # Prefetches for the next step must not evict this step's experts: with lookahead the
        # runtime may issue them while this step is still computing.
        self._protected[layer] = needed
        self._steps[layer] = step + 1
        return RouteResult(hits, loads)

    def _later(self, layer: int) -> Optional[Sequence[float]]:
        """The predictor's chances that the next token needs each expert at ``layer``, if any."""
        return self.advisor.later(layer) if self.advisor is not None else None

    def learn(self, layer: int) -> None:
        """The predictor learns from ``layer``'s latest routing (see on_route)."""
        for learner in self._learners:
            learner.observe(layer, self.context(), self._current[layer])

    def _load(self, layer: int, expert: int, victim: Optional[int], kind: str) -> Load:
        slot, evicted = self.caches[layer].place(expert, victim)
        unused = self.stats.unused_prefetched[layer]
        if evicted is not None and evicted in unused:
            unused.discard(evicted)
            self.stats.evicted_unused += 1
        if kind == PREFETCH:
            self.stats.prefetch_loads += 1
            unused.add(expert)
        else:
            self.stats.demand_loads += 1
        return Load(layer, expert, slot, evicted, kind)
