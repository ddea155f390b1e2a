"""How predictable is a trace's expert choice from what an online policy can see?

Prints, per trace: the leave-one-out precision of the best top-k guess for a layer's experts
given (a) the same token's experts at the layer before, (b) the previous token's experts at
the same layer, (c) nothing (layer popularity), all fitted on the whole trace (an upper bound
for predictors of that feature); then the simulator's hit rate and bytes when the engine
prefetches with (a) fitted offline, next to LRU, Belady, the cross-layer preset (xlayer, which
learns (a) online) and the best online preset (neighbors: the nearest earlier tokens over all
layers routed so far, and what followed them).

    PYTHONPATH=. python3 tools/trace_predictability.py ../shared/traces/mixtral-8x7b-gsm8k.jsonl.gz \
        specs/mixtral-8x7b.yaml 4
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from moegen.offload import simulate as sim
from moegen.offload.predictors import Predictor
from moegen.offload.trace import load_trace
from moegen.spec import load_spec


def loo_precision(experts: np.ndarray, feature) -> float:
    """Leave-one-out precision of the top-k experts by count among tokens with the same feature."""
    tokens, layers, k = experts.shape
    num_experts = int(experts.max()) + 1
    right = total = 0
    for layer in range(1, layers):
        counts = defaultdict(lambda: np.zeros(num_experts))
        keys = [feature(t, layer) for t in range(tokens)]
        for t, key in enumerate(keys):
            counts[key][experts[t, layer]] += 1
        for t, key in enumerate(keys):
            c = counts[key].copy()
            c[experts[t, layer]] -= 1
            guess = np.argsort(-c, kind="stable")[:k]
            right += len(set(guess.tolist()) & set(experts[t, layer].tolist()))
            total += k
    return right / total


class FittedPreviousLayer(Predictor):
    """P(expert at layer l | this token's experts at l-1), counted over the whole trace minus the
    token itself: what a perfectly learned predictor of this feature would say (offline)."""

    online = False

    def __init__(self, experts: np.ndarray):
        self.experts, self.token = experts, -1
        tokens, layers, _ = experts.shape
        self.num_experts = int(experts.max()) + 1
        self.counts = [defaultdict(lambda: np.zeros(self.num_experts)) for _ in range(layers)]
        for t in range(tokens):
            for layer in range(1, layers):
                self.counts[layer][tuple(sorted(experts[t, layer - 1]))][experts[t, layer]] += 1

    def begin_token(self, context) -> None:
        self.token += 1

    def predict(self, layer, context):
        t = self.token
        if layer == 0 or context.current[layer - 1] is None or t >= len(self.experts):
            return []
        c = self.counts[layer][tuple(sorted(self.experts[t, layer - 1]))].copy()
        c[self.experts[t, layer]] -= 1
        n = c.sum() / self.experts.shape[2]
        if n <= 0:
            return []
        p = c / n
        return [(int(e), float(p[e])) for e in np.argsort(-p, kind="stable")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("spec")
    ap.add_argument("slots", type=int)
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    x = trace.experts
    print(f"{args.trace}: {trace.num_tokens} tokens, {trace.num_layers} layers, top-{trace.top_k} of {trace.num_experts}")
    print(f"  top-k precision, leave-one-out: previous layer {loo_precision(x, lambda t, l: tuple(sorted(x[t, l - 1]))):.3f}, "
          f"previous token {loo_precision(x, lambda t, l: tuple(sorted(x[t - 1, l])) if t else ()):.3f}, "
          f"popularity {loo_precision(x, lambda t, l: 0):.3f}")
    link = sim.link_model(load_spec(args.spec))
    results = {name: sim.simulate(trace, args.slots, name, link) for name in ("lru", "belady", "xlayer", "neighbors")}
    results["fitted previous layer (offline)"] = sim.simulate(
        trace, args.slots, "xlayer", link, predictor=FittedPreviousLayer(x))
    lru, belady = results["lru"].hit_rate, results["belady"].hit_rate
    for name, r in results.items():
        print(f"  {name:32s} hit rate {r.hit_rate:.4f}  gap closed {(r.hit_rate - lru) / (belady - lru):6.1%}  "
              f"bytes/LRU {r.bytes / results['lru'].bytes:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
