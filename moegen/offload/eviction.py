"""Slot caches and eviction policies of offloaded experts: which expert sits in which GPU slot
of a layer's pool, and which resident expert leaves when a newcomer needs a slot.

Eviction policies (one instance per layer; ``POLICIES`` by name): ``lru``, ``lfu``, ``pinned_lru``,
``decayed_lfu`` (two-timescale decayed frequency, aware of predictions), ``neighbor_lfu`` (decayed
LFU that keeps what the next token will likely need, from the nearest-tokens predictor),
``belady`` (offline: needs the future accesses). Plain Python, deterministic, torch-free.
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable, Optional, Sequence


class LayerCache:
    """Which experts of one layer are resident, and in which GPU slot.

    ``slot_of[expert]`` is the table the kernel reads (-1: only in host memory). An expert keeps its
    slot until it is evicted; a newcomer takes the lowest free slot or the evicted expert's slot.
    """

    def __init__(self, num_experts: int, slots: int, pinned: Iterable[int] = frozenset()):
        pinned = frozenset(pinned)
        if not 0 < slots <= num_experts:
            raise ValueError(f"slots must be in 1..{num_experts} (num_experts), got {slots}")
        if any(not 0 <= e < num_experts for e in pinned):
            raise ValueError(f"pinned experts {sorted(pinned)} must lie in 0..{num_experts - 1}")
        if len(pinned) >= slots:
            raise ValueError(f"{len(pinned)} pinned experts leave none of the {slots} slots for the others")
        self.num_experts, self.slots, self.pinned = num_experts, slots, pinned
        self.slot_of = [-1] * num_experts
        self.expert_at = [-1] * slots
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest free slot

    def __contains__(self, expert: int) -> bool:
        return self.slot_of[expert] >= 0

    def __len__(self) -> int:
        return self.slots - len(self._free)

    @property
    def full(self) -> bool:
        return not self._free

    def resident(self) -> list:
        """Resident experts in slot order."""
        return [e for e in self.expert_at if e >= 0]

    def evictable(self, protected) -> list:
        """Resident experts that may leave: neither pinned nor in ``protected``."""
        pinned = self.pinned
        return [e for e in self.expert_at if e >= 0 and e not in pinned and e not in protected]

    def place(self, expert: int, victim: Optional[int] = None) -> tuple:
        """Make ``expert`` resident in a free slot, else in ``victim``'s slot. Returns (slot, evicted)."""
        if self.slot_of[expert] >= 0:
            raise ValueError(f"expert {expert} is already resident in slot {self.slot_of[expert]}")
        if self._free:
            slot, victim = self._free.pop(), None
        else:
            if victim is None or self.slot_of[victim] < 0:
                raise ValueError(f"the cache is full: evicting needs a resident victim, got {victim}")
            if victim in self.pinned:
                raise ValueError(f"expert {victim} is pinned and cannot be evicted")
            slot = self.slot_of[victim]
            self.slot_of[victim] = -1
        self.slot_of[expert] = slot
        self.expert_at[slot] = expert
        return slot, victim


# ---------------------------------------------------------------------------------------------
# Eviction policies: one instance per layer. ``step`` counts the tokens that reached the layer.


class EvictionPolicy:
    """Chooses which resident experts leave. Subclasses define ``keys``: lower leaves first.
    ``chance[e]`` (prefetch time only) is the predicted probability that the coming step needs
    expert e; demand-time evictions pass None."""

    name = "?"
    online = True

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def record(self, experts: Sequence[int], step: int) -> None:
        """The step used these experts (in router order)."""

    def keys(self, candidates: Sequence[int], step: int, chance: Optional[Sequence[float]]) -> list:
        raise NotImplementedError

    def victims(self, candidates: Sequence[int], count: int, step: int,
                chance: Optional[Sequence[float]] = None) -> list:
        """The ``count`` candidates to evict, most evictable first (ties: candidate order)."""
        if not candidates or count <= 0:
            return []
        keys = self.keys(candidates, step, chance)
        if count == 1:
            return [candidates[keys.index(min(keys))]]
        order = sorted(range(len(candidates)), key=keys.__getitem__)
        return [candidates[i] for i in order[:count]]

    def victim(self, candidates: Sequence[int], step: int, chance: Optional[Sequence[float]] = None) -> int:
        return self.victims(candidates, 1, step, chance)[0]

    def keep_score(self, expert: int, step: int, chance: Sequence[float]) -> float:
        """How much keeping ``expert`` is worth at prefetch time: a prefetch replaces the victim only
        when the newcomer scores higher. Default: the predicted chance alone."""
        return chance[expert]


class Lru(EvictionPolicy):
    """Least recently used. Experts of one step are touched in router order, so the earlier-listed
    one counts as older (this reproduces the reference figures in shared/traces/README.md)."""

    name = "lru"

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.last_use = [-1] * num_experts
        self.clock = 0

    def record(self, experts, step):
        for e in experts:
            self.clock += 1
            self.last_use[e] = self.clock

    def keys(self, candidates, step, chance):
        last = self.last_use
        return [last[e] for e in candidates]


class PinnedLru(Lru):
    """LRU among the experts the plan did not pin (pins are enforced by LayerCache for every policy;
    this name exists for specs that say ``policy: pinned_lru``)."""

    name = "pinned_lru"


class Lfu(EvictionPolicy):
    """Least frequently used since the start; ties go to the least recently used."""

    name = "lfu"

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.uses = [0] * num_experts
        self.lru = Lru(num_experts)

    def record(self, experts, step):
        for e in experts:
            self.uses[e] += 1
        self.lru.record(experts, step)

    def keys(self, candidates, step, chance):
        uses, last = self.uses, self.lru.last_use
        return [(uses[e], last[e]) for e in candidates]


class DecayedLfu(EvictionPolicy):
    """Frequency with two exponential memories: a fast one (recent tokens) and a slow one
    (long-run popularity). The fast memory follows topic shifts, which plain LFU misses (law trace);
    the slow one keeps popular experts through short lulls, which LRU misses (intent trace).

    value(e) = fast(e) + slow_weight * slow(e), each an estimate of "uses per token". At prefetch
    time the victim is the expert with the lowest chance + value: an expert the predictor expects
    for the coming step is kept even when its history is weak.
    """

    name = "decayed_lfu"
    _RESCALE_EVERY = 256  # tokens; keeps the growing sums below float overflow

    def __init__(self, num_experts: int, fast_decay: float = 0.9, slow_decay: float = 0.999,
                 slow_weight: float = 2.0):
        super().__init__(num_experts)
        self.fast_decay, self.slow_decay, self.slow_weight = fast_decay, slow_decay, slow_weight
        # Sums of decay^-(use step - base): comparing them at one step needs no per-expert power.
        self.fast = [0.0] * num_experts
        self.slow = [0.0] * num_experts
        self.base = 0
        self._factors_at = (None, None)  # ((step, base), factors): two powers per step, not per expert

    def _rescale(self, step: int) -> None:
        shift = step - self.base
        if shift >= self._RESCALE_EVERY:
            f, s = self.fast_decay ** shift, self.slow_decay ** shift
            self.fast = [x * f for x in self.fast]
            self.slow = [x * s for x in self.slow]
            self.base = step

    def _factors(self, step: int) -> tuple:
        """(fast weight, slow weight, fast inflation, slow inflation) at ``step``, once per step:
        a sum times its weight is the decayed rate; a use adds the inflation to the sum."""
        if self._factors_at[0] != (step, self.base):
            age = step - self.base
            fast, slow = self.fast_decay ** age, self.slow_decay ** age
            self._factors_at = ((step, self.base), (fast * (1 - self.fast_decay),
                                                     self.slow_weight * slow * (1 - self.slow_decay),
                                                     1 / fast, 1 / slow))
        return self._factors_at[1]

    def record(self, experts, step):
        self._rescale(step)
        _, _, f, s = self._factors(step)
        for e in experts:
            self.fast[e] += f
            self.slow[e] += s

    def value(self, expert: int, step: int) -> float:
        wf, ws, _, _ = self._factors(step)
        return self.fast[expert] * wf + self.slow[expert] * ws

    def keys(self, candidates, step, chance):
        wf, ws, _, _ = self._factors(step)
        fast, slow = self.fast, self.slow
        if chance is None:
            return [fast[e] * wf + slow[e] * ws for e in candidates]
        return [chance[e] + fast[e] * wf + slow[e] * ws for e in candidates]

    def keep_score(self, expert, step, chance):
        return chance[expert] + self.value(expert, step)


class NeighborLfu(DecayedLfu):
    """Decayed LFU whose evictions also keep what the next token will likely need at the layer,
    as the engine's NeighborPredictor (the ``advisor``) expects from the tokens that followed the
    nearest earlier ones: no prefetch, fewest bytes. The engine passes that expectation as the
    ``chance`` that DecayedLfu adds to an expert's value."""

    name = "neighbor_lfu"


class Belady(EvictionPolicy):
    """Offline optimum for demand fetching: evict the expert whose next use is farthest away.
    Needs this layer's whole access sequence, ``accesses[step]`` = the experts of that step."""

    name = "belady"
    online = False

    def __init__(self, num_experts: int, accesses: Sequence[Sequence[int]]):
        super().__init__(num_experts)
        self.uses = [[] for _ in range(num_experts)]  # steps that use each expert, ascending
        for step, experts in enumerate(accesses):
            for e in experts:
                self.uses[e].append(step)

    def next_use(self, expert: int, step: int) -> int:
        """The first step >= ``step`` that uses ``expert`` (a large number when none does)."""
        uses = self.uses[expert]
        at = bisect.bisect_left(uses, step)
        return uses[at] if at < len(uses) else 1 << 62

    def keys(self, candidates, step, chance):
        return [-self.next_use(e, step) for e in candidates]


POLICIES: dict = {cls.name: cls for cls in (Lru, Lfu, PinnedLru, DecayedLfu, NeighborLfu)}
ONLINE_POLICIES = tuple(POLICIES)


def policy_factory(name: str, num_experts: int) -> Callable[[int], EvictionPolicy]:
    """layer -> a fresh policy of this name. Belady needs its future: build it with belady_factory."""
    if name not in POLICIES:
        known = ", ".join(list(POLICIES) + ["belady"])
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}")
    return lambda layer: POLICIES[name](num_experts)


def belady_factory(num_experts: int, accesses_by_layer: Sequence) -> Callable[[int], EvictionPolicy]:
    """``accesses_by_layer[layer][step]``: the experts each step uses at each layer."""
    return lambda layer: Belady(num_experts, accesses_by_layer[layer])
