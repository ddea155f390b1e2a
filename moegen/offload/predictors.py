"""Prefetch predictors of offloaded experts: ``predict(layer, context) -> [(expert, probability)]``
best first, ``observe`` shows them the truth.

``HistoryPredictor`` (recency and frequency), ``CrossLayerPredictor`` (learned online: which
experts follow the experts this token chose at the layers before), ``NeighborPredictor`` (the
earlier tokens that routed most like this one so far; its ``later`` also tells the evictions what
the next token will likely need). A router-based predictor of the runtime plugs into the same
interface; ``ScoreCalibrator`` turns its raw scores into probabilities. Deterministic and
torch-free; the tables are numpy arrays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np


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
        a = self.prior_strength
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
