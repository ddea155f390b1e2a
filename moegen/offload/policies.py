"""Expert-cache policies for offloaded MoE inference: slot caches, eviction, prefetch prediction.

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

Eviction policies (one instance per layer; ``POLICIES`` by name): ``lru``, ``lfu``, ``pinned_lru``,
``decayed_lfu`` (two-timescale decayed frequency, aware of predictions), ``neighbor_lfu`` (decayed
LFU that keeps what the next token will likely need, from the nearest-tokens predictor),
``belady`` (offline: needs the future accesses). Predictors (``predict(layer, context) ->
[(expert, probability)]`` best first): ``HistoryPredictor`` (recency and frequency),
``CrossLayerPredictor`` (learned online: which experts follow the experts this token chose at the
layers before), ``NeighborPredictor`` (the earlier tokens that routed most like this one so far;
its ``later`` also tells the evictions what the next token will likely need). A router-based
predictor of the runtime plugs into the same interface; ``ScoreCalibrator`` turns its raw scores into
probabilities. Everything here is deterministic and torch-free; caches, policies and the engine
are plain Python, the predictors keep their tables in numpy.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

DEMAND = "demand"
PREFETCH = "prefetch"


class Load(NamedTuple):
    """One host-to-GPU expert copy the runtime must issue (a NamedTuple: cheap, immutable)."""

    layer: int
    expert: int
    slot: int
    evicted: Optional[int]  # the expert that held the slot, None when the slot was free
    kind: str  # DEMAND (needed now: copy, then compute) or PREFETCH (side stream, needed later)


class RouteResult(NamedTuple):
    hits: int  # experts of this step that were already resident (or prefetched)
    loads: list  # [Load(kind=DEMAND)] for the others


# ---------------------------------------------------------------------------------------------
# Slot bookkeeping


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


# ---------------------------------------------------------------------------------------------
# Prediction


@dataclass
class RouteContext:
    """What is known when a prediction for one layer of the current token is made."""

    current: list  # this token's experts per layer; None for layers not routed yet
    previous: Optional[list]  # the previous token's experts per layer; None at a sequence start
    hidden: Any = None  # the runtime may pass the hidden state here, for a router-based predictor


class Predictor:
    """predict(layer, context) -> [(expert, probability that this step needs it)], best first by the
    predictor's own score; it may list only the likely experts. observe() shows the truth
    afterwards (online learning)."""

    online = True

    def begin_token(self, context: RouteContext) -> None:
        """A new token starts (``context.previous``: the token before, None at a sequence start)."""

    def predict(self, layer: int, context: RouteContext) -> list:
        raise NotImplementedError

    def observe(self, layer: int, context: RouteContext, experts: Sequence[int]) -> None:
        pass

    def later(self, layer: int) -> Optional[Sequence[float]]:
        """Optional: per expert, the chance that the token after the current one needs it at
        ``layer`` (None: no opinion). The engine's evictions keep the likely ones."""
        return None


class ScoreCalibrator:
    """Maps raw scores (log-odds, router logits, ...) to the observed frequency with which experts
    of that score were needed, in fixed-width bins learned online. Predictors rank by their own
    scores; the engine gates prefetches on a probability, which must mean the same for every
    predictor. Unseen bins start at ``prior`` so that nothing is prefetched before evidence."""

    def __init__(self, low: float, high: float, width: float, prior: float = 0.1):
        self.low, self.width = low, width
        self.bins = int(math.ceil((high - low) / width))
        self.needed = [prior] * self.bins
        self.seen = [1.0] * self.bins

    def bin(self, scores: Sequence[float]) -> list:
        low, scale, last = self.low, 1 / self.width, self.bins - 1
        bins = [int((x - low) * scale) for x in scores]
        if bins and (min(bins) < 0 or max(bins) > last):  # rare: clamp into the outer bins
            bins = [0 if b < 0 else last if b > last else b for b in bins]
        return bins

    def probabilities(self, bins: Sequence[int]) -> list:
        needed, seen = self.needed, self.seen
        return [needed[b] / seen[b] for b in bins]

    def observe(self, bins: Sequence[int], experts: Sequence[int], chosen: Sequence[int]) -> None:
        """``experts[i]`` was predicted with score bin ``bins[i]``; ``chosen`` were needed."""
        needed, seen = self.needed, self.seen
        for e, b in zip(experts, bins):
            seen[b] += 1
            if e in chosen:
                needed[b] += 1


class _CalibratedPredictor(Predictor):
    """Shared plumbing: raw scores of the top candidates -> calibrated probabilities; the candidates
    and bins of the last prediction per layer are kept to learn from the outcome."""

    def __init__(self, num_layers: int, num_experts: int, calibrator: ScoreCalibrator, candidates: int):
        self.num_experts, self.calibrator = num_experts, calibrator
        self.candidates = min(candidates, num_experts)
        self._pending: list = [None] * num_layers  # per layer: (candidates, bins) of the last predict()

    def _ranked(self, layer: int, scores: np.ndarray) -> list:
        """scores: one raw score per expert -> [(expert, probability)] of the top candidates, in
        the order of the raw scores (the calibration is close to monotone, not exactly)."""
        top = (-scores).argsort(kind="stable")[: self.candidates]
        bins = self.calibrator.bin(scores[top].tolist())
        top = top.tolist()
        self._pending[layer] = (top, bins)
        return list(zip(top, self.calibrator.probabilities(bins)))

    def _learn_calibration(self, layer: int, experts: Sequence[int]) -> None:
        pending, self._pending[layer] = self._pending[layer], None
        if pending is not None:
            top, bins = pending
            self.calibrator.observe(bins, top, experts)


class HistoryPredictor(_CalibratedPredictor):
    """Recency and frequency at the same layer: score = decayed use rate + a bonus when the previous
    token of the sequence used the expert. Cheap, and right when consecutive tokens share experts."""

    def __init__(self, num_layers: int, num_experts: int, decay: float = 0.95, previous_bonus: float = 0.5,
                 candidates: int = 16):
        super().__init__(num_layers, num_experts, ScoreCalibrator(0.0, 1.0 + previous_bonus, 0.05), candidates)
        self.decay, self.previous_bonus = decay, previous_bonus
        self.rate = np.zeros((num_layers, num_experts))

    def predict(self, layer, context):
        scores = self.rate[layer].copy()
        previous = context.previous[layer] if context.previous is not None else None
        if previous:
            scores[list(previous)] += self.previous_bonus
        return self._ranked(layer, scores)

    def observe(self, layer, context, experts):
        self._learn_calibration(layer, experts)
        rate = self.rate[layer]
        rate *= self.decay
        rate[list(experts)] += 1 - self.decay


class _PackedRows:
    """Rows of E log-odds packed into one Python int each: lane j (32 bits) holds round(x * SCALE)
    + OFFSET, so that adding a row is one big-int addition instead of E float additions, and no
    lane carries into the next while fewer than 2**12 rows are summed (a token sums ~30). ``top``
    unpacks a sum of ``terms`` rows: the best experts and their scores."""

    SCALE = 256.0  # resolution 1/256 of a log-odds unit, far below the calibration bins
    OFFSET = 1 << 19  # keeps every lane positive: |x| stays below 2**19 / SCALE = 2048

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def pack(self, table: np.ndarray) -> list:
        lanes = (np.rint(np.clip(table, -2000, 2000) * self.SCALE) + self.OFFSET).astype("<u4")
        return [int.from_bytes(row.tobytes(), "little") for row in lanes]

    def top(self, packed: int, terms: int, count: int) -> tuple:
        lanes = np.frombuffer(packed.to_bytes(4 * self.num_experts, "little"), dtype="<u4")
        best = (~lanes).argsort(kind="stable")[:count]  # descending; ties: lower expert first
        base, scale = terms * self.OFFSET, 1 / self.SCALE
        return best.tolist(), [(v - base) * scale for v in lanes[best].tolist()]


class CrossLayerPredictor(_CalibratedPredictor):
    """Which experts will this token use at layer l, given the experts it used at the ``depth``
    layers before (and the previous token's experts at layer l)? A Bernoulli naive Bayes learned
    online from what the trace (or the live router) chose:

        log-odds(j) = log(n_j / (n - n_j)) + sum over feature groups g of
                      sum_i [x_i log(p1_ij / p0_ij) + (1 - x_i) log((1 - p1_ij) / (1 - p0_ij))]

    with p1_ij = P(source i chosen | j chosen at l), p0_ij = P(source i | j not chosen), smoothed
    toward the source's marginal. Absent sources count as evidence too, which is what makes the
    top predictions precise (about 0.9 of the top 1% are right on the DeepSeek-V2-Lite traces).
    A group whose layer is not routed yet (lookahead) is left out, which naive Bayes allows.

    Speed: a prediction must cost microseconds, since it runs for every token and layer. The
    score vectors of the token's coming layers are accumulated as its layers are routed, with the
    tables' rows packed into Python integers (``_PackedRows``: one big-int addition adds a whole
    row), so a prediction only ranks a ready vector. Observations are queued and the tables rebuilt
    in numpy after 1, 2, 4, ... and then every ``refresh`` observations of a layer: they barely move
    once a few hundred tokens are in.
    """

    def __init__(self, num_layers: int, num_experts: int, depth: int = 3, use_previous: bool = True,
                 refresh: int = 512, prior_strength: float = 1.0, candidates: int = 16):
        super().__init__(num_layers, num_experts, ScoreCalibrator(-30.0, 30.0, 0.5), candidates)
        self.num_layers, self.depth, self.use_previous = num_layers, depth, use_previous
        self.refresh, self.prior_strength = refresh, prior_strength
        L, E = num_layers, num_experts
        # Feature groups of target layer t: g = d - 1 is source layer t - d (d = 1..depth), then
        # the previous token at t. Counts per (target, group), learned from queued observations.
        self.groups = []
        for layer in range(L):
            groups = [("layer", layer - d) for d in range(1, depth + 1) if layer - d >= 0]
            self.groups.append(groups + ([("previous", layer)] if use_previous else []))
        self._pairs = [[np.zeros((E, E)) for _ in g] for g in self.groups]  # source i with target j
        self._sources = [[np.zeros(E) for _ in g] for g in self.groups]
        self._targets = [[np.zeros(E) for _ in g] for g in self.groups]
        self._count = [[0] * len(g) for g in self.groups]
        self._queue = [[[] for _ in g] for g in self.groups]  # (source ids, target ids) not yet counted
        self._observed = [0] * L
        # Scoring tables, packed. Row i < E of a group's table: log(p1/p0) - log((1-p1)/(1-p0)) of
        # source i; row E: the absent-evidence sum, added whenever the group is known. _ahead[s][b]
        # is source layer s's table for target s+1+b, _previous[t] the previous token's group of
        # target t, _prior[t] the log prior odds of target t.
        self._packer = _PackedRows(E)
        zero = self._packer.pack(np.zeros((E + 1, E)))
        self._ahead = [[zero] * min(depth, L - 1 - s) for s in range(L)]
        self._previous = [zero] * L
        self._prior = [zero[0]] * L
        self._scores = list(self._prior)  # this token's packed log-odds so far, per layer
        self._terms = [1] * L  # rows summed into each of them

    def begin_token(self, context: RouteContext) -> None:
        self._scores, self._terms = list(self._prior), [1] * self.num_layers
        previous = context.previous if self.use_previous else None
        if previous is not None:
            for layer, ids in enumerate(previous):
                if ids is not None:
                    self._add(layer, self._previous[layer], ids)

    def _add(self, layer: int, rows: list, ids: Sequence[int]) -> None:
        self._scores[layer] += sum(map(rows.__getitem__, ids)) + rows[self.num_experts]
        self._terms[layer] += len(ids) + 1

    def predict(self, layer, context):
        if self._observed[layer] == 0:
            return []
        top, scores = self._packer.top(self._scores[layer], self._terms[layer], self.candidates)
        bins = self.calibrator.bin(scores)
        self._pending[layer] = (top, bins)
        return list(zip(top, self.calibrator.probabilities(bins)))

    def observe(self, layer, context, experts):
        self._learn_calibration(layer, experts)
        for block, rows in enumerate(self._ahead[layer]):  # evidence for this token's next layers
            self._add(layer + 1 + block, rows, experts)
        targets, queues = tuple(experts), self._queue[layer]
        for g, (kind, source) in enumerate(self.groups[layer]):
            ids = context.current[source] if kind == "layer" else \
                context.previous[source] if context.previous is not None else None
            if ids is not None:
                queues[g].append((tuple(ids), targets))
        self._observed[layer] += 1
        n = self._observed[layer]
        if n % self.refresh == 0 or (n < self.refresh and n & (n - 1) == 0):
            self._rebuild(layer)

    def _count_queue(self, layer: int, g: int, queue: list) -> None:
        E = self.num_experts
        try:  # the usual case: every observation has the same number of sources and of targets
            sources = np.array([s for s, _ in queue], dtype=np.int64)
            targets = np.array([t for _, t in queue], dtype=np.int64)
            pairs = (sources[:, :, None] * E + targets[:, None, :]).ravel()
        except ValueError:  # ragged (e.g. batches of different sizes)
            sources = np.array([i for s, _ in queue for i in s], dtype=np.int64)
            targets = np.array([j for _, t in queue for j in t], dtype=np.int64)
            pairs = np.array([i * E + j for s, t in queue for i in s for j in t], dtype=np.int64)
        self._pairs[layer][g] += np.bincount(pairs, minlength=E * E).reshape(E, E)
        self._sources[layer][g] += np.bincount(sources.ravel(), minlength=E)
        self._targets[layer][g] += np.bincount(targets.ravel(), minlength=E)
        self._count[layer][g] += len(queue)
        queue.clear()

    def _rebuild(self, layer: int) -> None:
        E, a = self.num_experts, self.prior_strength
        most_seen = 0
        for g, (kind, source) in enumerate(self.groups[layer]):
            if self._queue[layer][g]:
                self._count_queue(layer, g, self._queue[layer][g])
            n = self._count[layer][g]
            pairs, f, nj = self._pairs[layer][g], self._sources[layer][g], self._targets[layer][g]
            marginal = a * (f + 1) / (n + 2)  # smoothing pulls p1, p0 toward P(source i)
            p1 = (pairs + marginal[:, None]) / (nj[None, :] + a)
            p0 = (f[:, None] - pairs + marginal[:, None]) / ((n - nj)[None, :] + a)
            p1, p0 = np.clip(p1, 1e-4, 1 - 1e-4), np.clip(p0, 1e-4, 1 - 1e-4)
            absent = np.log((1 - p1) / (1 - p0))
            table = self._packer.pack(np.vstack([np.log(p1 / p0) - absent, absent.sum(axis=0)]))
            if kind == "layer":
                self._ahead[source][layer - source - 1] = table
            else:
                self._previous[layer] = table
            if n > most_seen:  # the group seen most often gives the best prior
                most_seen = n
                self._prior[layer] = self._packer.pack(np.log((nj + 1) / (n - nj + 1))[None, :])[0]


class NeighborPredictor(_CalibratedPredictor):
    """Tokens that routed alike so far route alike at the coming layers (the same word or phrase
    again), and the tokens that followed them tend to come again too. Keeps the routing of the
    last ``window`` tokens; the current token's similarity to each of them (experts shared at the
    layers routed so far) grows as its layers are routed.

    predict(layer): the ``neighbors`` most similar earlier tokens (ties: the most recent) vote,
    weighted by similarity, for the experts they chose at that layer.
    later(layer): the tokens that followed those neighbors in their sequences vote for theirs:
    what the next token will likely need there, which the engine's evictions keep.

    On the Mixtral trace (4 of 8 slots) this lifts the hit rate from LRU's 0.601 to ~0.68 within
    LRU's bytes, where the cross-layer naive Bayes reached 0.629 (docs/PERFORMANCE.md).
    """

    def __init__(self, num_layers: int, num_experts: int, neighbors: int = 3, window: int = 2048,
                 candidates: int = 16):
        super().__init__(num_layers, num_experts, ScoreCalibrator(0.0, 1.0 + 1e-6, 0.05), candidates)
        self.neighbors, self.window = neighbors, window
        # chose[layer, expert, position]: 1.0 where the token at that ring position chose it.
        self._chose = np.zeros((num_layers, num_experts, window), dtype=np.float32)
        self._continued = np.zeros(window, dtype=bool)  # the next token is of the same sequence
        self._similarity = np.zeros(window, dtype=np.float32)
        self._tokens = 0  # tokens committed so far (the ring holds the last `window`)
        self._routed: list = [None] * num_layers  # the current token's experts per layer
        self._recency = np.zeros(0, dtype=np.float32)  # tie-breaks toward recent tokens
        self._nearest = None  # ring positions, most similar first (cached until the next layer)
        self._later = (None, None)  # (layer, later(layer)) for the current state

    def begin_token(self, context: RouteContext) -> None:
        if any(ids is not None for ids in self._routed):
            at = self._tokens % self.window
            self._chose[:, :, at] = 0.0
            for layer, ids in enumerate(self._routed):
                if ids is not None:
                    self._chose[layer, list(ids), at] = 1.0
            self._tokens += 1
            self._continued[at] = context.previous is not None
            held = min(self._tokens, self.window)
            # Age order in the ring, scaled below one shared expert.
            self._recency = ((np.arange(held) - self._tokens) % self.window * (0.5 / self.window)).astype(np.float32)
        self._routed = [None] * len(self._routed)
        self._similarity[:] = 0.0
        self._nearest, self._later = None, (None, None)

    def _ranking(self) -> np.ndarray:
        """Ring positions of the earlier tokens, the neighbors + 1 most similar first (ties: the
        most recent)."""
        if self._nearest is None:
            held = self._recency.size
            key = self._similarity[:held] + self._recency
            count = min(held, self.neighbors + 1)
            top = np.argpartition(-key, count - 1)[:count] if count < held else np.arange(held)
            self._nearest = top[np.argsort(-key[top], kind="stable")]
        return self._nearest

    def _vote(self, layer: int, positions: np.ndarray, voters: np.ndarray) -> np.ndarray:
        """Similarity-weighted share of ``voters`` (ring positions) choosing each expert at
        ``layer``; the weights are the similarities at ``positions``."""
        weight = self._similarity[positions] + 1e-3
        # Elementwise, not a matrix product: a BLAS call for a few columns costs more than it does.
        return (self._chose[layer][:, voters] * (weight / weight.sum())).sum(axis=1)

    def predict(self, layer, context):
        nearest = self._ranking()[: self.neighbors]
        if nearest.size == 0:
            return []
        return self._ranked(layer, self._vote(layer, nearest, nearest))

    def later(self, layer):
        if self._later[0] != layer:  # asked at prefetch and at demand time: computed once
            nearest = self._ranking()
            # Followers must be committed and of the same sequence (the newest one's is this token).
            newest = (self._tokens - 1) % self.window
            nearest = nearest[(nearest != newest) & self._continued[nearest]][: self.neighbors]
            votes = self._vote(layer, nearest, (nearest + 1) % self.window).tolist() if nearest.size else None
            self._later = (layer, votes)
        return self._later[1]

    def observe(self, layer, context, experts):
        self._learn_calibration(layer, experts)
        self._routed[layer] = tuple(experts)
        chose = self._chose[layer]
        for e in set(experts):
            self._similarity += chose[e]
        self._nearest, self._later = None, (None, None)
        if layer + 1 < len(self._routed):
            # Ready before the next layer's routing: a runtime learns after launching the step's
            # kernels, so this runs while they do, not between routing and the next launch.
            self.later(layer + 1)


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

    def _threshold(self, room: Optional[int]) -> float:
        """The prefetch bar: prefetch_threshold, lowered toward slack_threshold while the unspent
        byte budget (``room`` loads) is a large share of what LRU has loaded."""
        if room is None:
            return self.prefetch_threshold
        slack = min(1.0, room / (self.slack_fraction * self.budget.loads))
        return self.prefetch_threshold - slack * (self.prefetch_threshold - self.slack_threshold)

    def on_route(self, layer: int, experts: Sequence[int], learn: bool = True) -> RouteResult:
        """The router chose ``experts`` at ``layer``: count hits, load the misses (demand loads).
        With learn=False the predictor learns only at ``learn(layer)``, which must come before the
        next prediction."""
        if self._current[layer] is not None:
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
        self._current[layer] = tuple(experts)
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
