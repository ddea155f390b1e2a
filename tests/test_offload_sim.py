"""Expert offload: trace reading, cache-policy invariants, the simulator on the real traces in
../shared/traces (reference figures and the online-policy target) and `moegen simulate`.

The real-trace replays run once per session, spread over processes (a DeepSeek-V2-Lite trace is
~8k tokens x 26 layers x 6 experts)."""
from __future__ import annotations

import functools
import gzip
import json
import os
import random
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from moegen.errors import MoegenError
from moegen.offload import eviction, predictors
from moegen.offload import policies as P
from moegen.offload.simulate import PRESETS, LinkModel, decode_layer_ms, expert_bytes, simulate
from moegen.offload.simulate_cli import parse_slots
from moegen.offload.trace import TraceError, load_trace

from conftest import TRACES_DIR, shared_trace

REPO = Path(__file__).resolve().parent.parent
TINY_SPEC = REPO / "specs" / "tiny.yaml"  # E=6, top-2, 2 layers
BEST_ONLINE = "neighbors"
# Any link figures do for hit rates and bytes; these are DeepSeek-V2-Lite's on an H200.
LINK = LinkModel(expert_bytes=3 * 2048 * 1408 * 2, layer_ms=0.0216, link_gbps=55.0)


_trace_path = shared_trace


# ---------------------------------------------------------------------------------------------
# Real traces: one session-wide batch of replays


@dataclass(frozen=True)
class Cell:
    trace: str
    slots: int
    lru: Optional[float] = None  # shared/traces/README.md reference figures (demand fetch)
    belady: Optional[float] = None


CELLS = (
    Cell("mixtral-8x7b-gsm8k", 2),
    Cell("mixtral-8x7b-gsm8k", 4, lru=0.601, belady=0.733),
    Cell("deepseek-v2-lite-intent", 16, lru=0.506, belady=0.685),
    Cell("deepseek-v2-lite-law", 16, lru=0.496, belady=0.680),
    Cell("deepseek-v2-lite-intent", 32),
    Cell("deepseek-v2-lite-law", 32),
)
DEMAND_ONLINE = ("lru", "lfu", "decayed_lfu", "neighbor_lfu")  # online policies without prefetch


def _jobs() -> list:
    jobs = []
    for cell in CELLS:
        cheap = cell.trace.startswith("mixtral")  # 244 tokens: every policy costs nothing
        names = PRESETS if cheap else ("lru", "belady", BEST_ONLINE)
        jobs += [(cell.trace, cell.slots, name) for name in names]
    return jobs


@functools.lru_cache(maxsize=None)  # per worker process
def _load(name: str):
    return load_trace(TRACES_DIR / f"{name}.jsonl.gz")  # in a worker: _trace_path checked it first


def _replay(job):
    trace, slots, name = job
    return job, simulate(_load(trace), slots, name, LINK)


@pytest.fixture(scope="session")
def results():
    """{(trace, slots, policy): SimResult} for every job, computed once."""
    for cell in CELLS:
        _trace_path(cell.trace)
    jobs = sorted(_jobs(), key=lambda job: job[2] != BEST_ONLINE)  # the slowest first
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        return dict(pool.map(_replay, jobs))


@pytest.mark.parametrize("cell", [c for c in CELLS if c.lru is not None], ids=lambda c: f"{c.trace}-{c.slots}")
def test_lru_and_belady_match_reference_figures(results, cell):
    """Demand fetch, no prefetch: the figures in shared/traces/README.md within 0.005."""
    assert results[(cell.trace, cell.slots, "lru")].hit_rate == pytest.approx(cell.lru, abs=0.005)
    assert results[(cell.trace, cell.slots, "belady")].hit_rate == pytest.approx(cell.belady, abs=0.005)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c.trace}-{c.slots}")
def test_belady_bounds_every_policy(results, cell):
    """Belady is the demand-fetch optimum: no demand-fetch policy hits more, and no policy at all,
    prefetching or not, moves fewer bytes (prefetching never saves a load, it only moves it
    earlier; a prefetching policy's hit rate may exceed Belady's)."""
    belady = results[(cell.trace, cell.slots, "belady")]
    assert not belady.online
    ran = {name: r for (trace, slots, name), r in results.items() if (trace, slots) == (cell.trace, cell.slots)}
    for name, r in ran.items():
        if name in DEMAND_ONLINE:
            assert r.online and r.prefetch_loads == 0
            assert r.hit_rate <= belady.hit_rate, name
        assert r.bytes >= belady.bytes, name
        assert r.timely_hit_rate <= r.hit_rate, name


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c.trace}-{c.slots}")
def test_best_online_policy_closes_half_the_gap_within_lru_bytes(results, cell):
    lru, belady = (results[(cell.trace, cell.slots, name)] for name in ("lru", "belady"))
    best = results[(cell.trace, cell.slots, BEST_ONLINE)]
    assert best.online
    assert best.bytes <= lru.bytes
    assert best.hit_rate >= lru.hit_rate + 0.5 * (belady.hit_rate - lru.hit_rate)


def test_nearest_tokens_guide_evictions_to_fewer_bytes():
    """neighbor_lfu: the nearest-tokens predictor's view of the next token (``later``) makes decayed
    LFU's evictions move fewer bytes than LRU's and than decayed LFU's alone (Mixtral, 4 of 8
    slots: 0.918, 1.000 and 0.966 of LRU's bytes), without prefetching."""
    trace = load_trace(_trace_path("mixtral-8x7b-gsm8k"))
    guided, lru, alone = (simulate(trace, 4, name, LINK) for name in ("neighbor_lfu", "lru", "decayed_lfu"))
    assert guided.prefetch_loads == 0 and guided.online
    assert guided.bytes < 0.95 * lru.bytes and guided.bytes < alone.bytes
    assert guided.hit_rate > alone.hit_rate > lru.hit_rate


def test_real_traces_load():
    trace = load_trace(_trace_path("deepseek-v2-lite-law"))
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (26, 64, 6)
    assert trace.experts.shape == (trace.num_tokens, 26, 6) and trace.num_tokens == 8327
    assert trace.seq.shape == (trace.num_tokens,) and not trace.experts.flags.writeable
    assert trace.accesses == trace.num_tokens * 26 * 6 and "DeepSeek-V2-Lite" in trace.model


# ---------------------------------------------------------------------------------------------
# Trace files: every way one can be wrong names the file, the line and the fix


def _write_trace(path: Path, tokens, header: Optional[dict] = None, raw: Optional[bytes] = None) -> Path:
    if raw is not None:
        path.write_bytes(raw)
        return path
    head = {"format": "moegen-trace", "version": 1, "model": "synthetic", "num_layers": 2, "num_experts": 6,
            "top_k": 2, "source": "test", "note": ""}
    head.update(header or {})
    lines = [json.dumps(head)] + [t if isinstance(t, str) else json.dumps(t) for t in tokens]
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


GOOD_TOKEN = {"seq": 0, "experts": [[0, 1], [2, 3]]}


@dataclass(frozen=True)
class BadTrace:
    name: str
    tokens: tuple = (GOOD_TOKEN,)
    header: Optional[dict] = None
    raw: Optional[bytes] = None
    line: int = 0  # the line the message must name (0: none)
    words: tuple = ()  # what the message must say


BAD_TRACES = (
    BadTrace("not-gzip", raw=b'{"format": "moegen-trace"}\n', words=("gzip",)),
    BadTrace("truncated-gzip", raw=gzip.compress(b'{"format": "moegen-trace"}\n' * 50)[:40], words=("gzip",)),
    BadTrace("empty", raw=gzip.compress(b""), line=1, words=("empty", "header")),
    BadTrace("bad-json-header", raw=gzip.compress(b"{format: moegen-trace}\n"), line=1, words=("JSON",)),
    BadTrace("bad-json-token", tokens=(GOOD_TOKEN, '{"seq": 0, "experts": [[0, 1], [2, 3]]'), line=3,
             words=("JSON",)),
    BadTrace("wrong-format", header={"format": "vllm-trace"}, line=1, words=("format", "moegen-trace")),
    BadTrace("wrong-version", header={"version": 2}, line=1, words=("version", "1")),
    BadTrace("bad-header-count", header={"num_experts": "six"}, line=1, words=("num_experts",)),
    BadTrace("too-few-layers", tokens=(GOOD_TOKEN, {"seq": 0, "experts": [[0, 1]]}), line=3,
             words=("1 layers", "num_layers 2")),
    BadTrace("too-many-experts", tokens=({"seq": 0, "experts": [[0, 1, 2], [2, 3]]},), line=2,
             words=("3 expert ids", "top_k 2")),
    BadTrace("id-out-of-range", tokens=(GOOD_TOKEN, GOOD_TOKEN, {"seq": 1, "experts": [[0, 1], [2, 6]]}), line=4,
             words=("layer 1", "6 out of range", "0..5")),
    BadTrace("negative-id", tokens=({"seq": 0, "experts": [[-1, 1], [2, 3]]},), line=2, words=("out of range",)),
    BadTrace("repeated-id", tokens=({"seq": 0, "experts": [[4, 4], [2, 3]]},), line=2, words=("repeat",)),
    BadTrace("no-seq", tokens=({"experts": [[0, 1], [2, 3]]},), line=2, words=("seq",)),
    BadTrace("no-tokens", tokens=(), line=2, words=("no tokens",)),
    # beyond what numpy and Python's JSON parser take
    BadTrace("seq-beyond-int64", tokens=({"seq": 1 << 63, "experts": [[0, 1], [2, 3]]},), line=2, words=("seq",)),
    BadTrace("id-beyond-int64", tokens=({"seq": 0, "experts": [[0, 1 << 64], [2, 3]]},), line=2,
             words=("layer 0", "out of range")),
    BadTrace("nested-too-deep", tokens=(GOOD_TOKEN, "[" * 100_000 + "]" * 100_000), line=3, words=("too deeply",)),
    BadTrace("number-too-long", tokens=('{"seq": 1' + "0" * 5000 + ', "experts": [[0, 1], [2, 3]]}',), line=2,
             words=("JSON",)),
    BadTrace("version-true", header={"version": True}, line=1, words=("version",)),
)


@pytest.mark.parametrize("case", BAD_TRACES, ids=lambda c: c.name)
def test_bad_trace_is_reported_with_file_line_and_fix(tmp_path, case):
    path = _write_trace(tmp_path / "t.jsonl.gz", case.tokens, case.header, case.raw)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert info.value.exit_code == 2 and isinstance(info.value, MoegenError)
    assert message.startswith(f"{path}:{case.line}: " if case.line else f"{path}: "), message
    assert "; " in message  # what is wrong; how to fix it
    for word in case.words:
        assert word in message, (word, message)


@pytest.mark.parametrize("name, problem", [("absent.jsonl.gz", "no such file"), (".", "a folder, not a file"),
                                           ("pipe.jsonl.gz", "not a regular file"),
                                           ("a" * 300 + ".jsonl.gz", "cannot read it (File name too long)")])
def test_trace_path_that_is_no_file(tmp_path, name, problem):
    if name.startswith("pipe"):
        os.mkfifo(tmp_path / name)  # reading would block
    with pytest.raises(TraceError, match=re.escape(problem)):
        load_trace(tmp_path / name)


# ---------------------------------------------------------------------------------------------
# Cache invariants, on synthetic traces (property tests)


def _synthetic(seed: int, tokens: int, layers: int, experts: int, top_k: int) -> list:
    """Routing with some structure (popular experts, layer-to-layer and token-to-token carry-over),
    so that every policy and predictor has something to learn and prefetches happen."""
    rng = random.Random(seed)
    weights = [rng.random() ** 3 for _ in range(experts)]
    routes, previous = [], None
    for t in range(tokens):
        token, last = [], None
        for layer in range(layers):
            pool = set()
            while len(pool) < top_k:
                r = rng.random()
                if last and r < 0.3:
                    pool.add((last[0] + layer) % experts)  # follows the layer before
                elif previous and r < 0.5:
                    pool.add(rng.choice(previous[layer]))  # repeats the token before
                else:
                    pool.add(rng.choices(range(experts), weights)[0])
            last = sorted(pool, key=lambda e: rng.random())
            token.append(last)
        routes.append(token)
        previous = token
    return routes


class EagerPredictor(predictors.Predictor):
    """Adversarial: confidently predicts random experts, so that prefetches happen all the time."""

    def __init__(self, experts: int, seed: int):
        self.experts, self.rng = experts, random.Random(seed)

    def predict(self, layer, context):
        picks = self.rng.sample(range(self.experts), min(self.experts, 3))
        return [(e, 0.7 + 0.3 * self.rng.random()) for e in picks]


@dataclass(frozen=True)
class EngineCase:
    experts: int
    top_k: int
    slots: tuple  # per layer
    policy: str
    predictor: Optional[str] = None  # None, "history", "xlayer", "neighbors", "eager"
    pinned: int = 0  # experts pinned per layer
    budget: bool = False
    seed: int = 0

    @property
    def id(self) -> str:
        return (f"E{self.experts}k{self.top_k}s{'-'.join(map(str, self.slots))}-{self.policy}-{self.predictor}"
                f"-pin{self.pinned}{'-budget' if self.budget else ''}")


ENGINE_CASES = (
    EngineCase(4, 1, (1, 2, 4), "lru"),  # one slot: every miss evicts; all slots: never evicts
    EngineCase(8, 2, (2, 2, 2), "lru", "eager"),  # slots == top_k: prefetch may not evict the last step's
    EngineCase(8, 2, (4, 3, 5), "lfu", "eager", pinned=1),
    EngineCase(8, 2, (4, 4, 4), "pinned_lru", "history", pinned=1),
    EngineCase(8, 3, (5, 4, 6), "decayed_lfu", "xlayer", budget=True),
    EngineCase(16, 3, (6, 8, 7), "decayed_lfu", "eager", pinned=2, seed=1),
    EngineCase(16, 4, (8, 6, 10), "decayed_lfu", "xlayer", pinned=2, seed=2),
    EngineCase(16, 4, (8, 8, 8), "belady", None, pinned=2, seed=3),
    EngineCase(16, 2, (4, 5, 6), "lru", "xlayer", budget=True, seed=4),
    EngineCase(8, 2, (3, 4, 5), "decayed_lfu", "neighbors", budget=True, seed=5),
    EngineCase(16, 4, (6, 8, 10), "decayed_lfu", "neighbors", pinned=2, seed=6),
    EngineCase(16, 3, (3, 5, 7), "lru", "neighbors", seed=7),
    EngineCase(16, 3, (4, 6, 8), "neighbor_lfu", None, pinned=1, seed=8),
    EngineCase(16, 3, (4, 6, 8), "neighbor_lfu", "xlayer", budget=True, seed=9),
)


def _engine(case: EngineCase, routes: list) -> P.OffloadPolicyEngine:
    layers = len(case.slots)
    policy = (eviction.belady_factory(case.experts, [[t[l] for t in routes] for l in range(layers)])
              if case.policy == "belady" else case.policy)
    predictor = {None: None, "eager": EagerPredictor(case.experts, case.seed),
                 "history": predictors.HistoryPredictor(layers, case.experts),
                 "xlayer": predictors.CrossLayerPredictor(layers, case.experts, refresh=8),
                 "neighbors": predictors.NeighborPredictor(layers, case.experts, window=32)}[case.predictor]
    rng = random.Random(case.seed)
    pinned = [frozenset(rng.sample(range(case.experts), case.pinned)) for _ in range(layers)]
    return P.OffloadPolicyEngine(layers, case.experts, list(case.slots), policy=policy, predictor=predictor,
                                 pinned=pinned, byte_budget="lru" if case.budget else None,
                                 prefetch_threshold=0.5, slack_threshold=0.3)


def _residents(cache: eviction.LayerCache) -> dict:
    table = {e: s for e, s in enumerate(cache.slot_of) if s >= 0}
    assert table == {e: s for s, e in enumerate(cache.expert_at) if e >= 0}  # the two tables agree
    assert len(table) <= cache.slots
    return table


def _check_loads(loads, layer, cache, before, kind, forbidden):
    after = _residents(cache)
    for load in loads:
        assert load.kind == kind and load.layer == layer and 0 <= load.slot < cache.slots
        assert load.evicted not in cache.pinned, "a pinned expert was evicted"
        assert load.evicted is None or load.evicted not in forbidden, f"{kind} evicted {load.evicted}"
        assert load.evicted is None or before.get(load.evicted) == load.slot
    # Slot stability: whatever was resident before and still is keeps its slot.
    assert all(after[e] == s for e, s in before.items() if e in after)
    moved_in = {load.expert for load in loads}
    assert set(after) == (set(before) - {load.evicted for load in loads}) | moved_in
    return after


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: c.id)
def test_cache_invariants_hold_step_by_step(case):
    routes = _synthetic(case.seed, tokens=150, layers=len(case.slots), experts=case.experts, top_k=case.top_k)
    engine = _engine(case, routes)
    latest = [set() for _ in case.slots]
    hits = prefetches = 0
    for token in routes:
        engine.begin_token()
        for layer, experts in enumerate(token):
            cache = engine.cache(layer)
            before = _residents(cache)
            prefetched = engine.before_layer(layer)
            # A prefetch never evicts what the layer's latest step used (it may still be computing).
            before = _check_loads(prefetched, layer, cache, before, P.PREFETCH, latest[layer])
            prefetches += len(prefetched)
            resident = [e for e in experts if e in before]
            result = engine.on_route(layer, experts)
            after = _check_loads(result.loads, layer, cache, before, P.DEMAND, set(experts))
            assert result.hits == len(resident) and len(result.loads) == len(experts) - len(resident)
            assert {load.expert for load in result.loads} == set(experts) - set(resident)
            assert set(experts) <= set(after)
            assert set(after) >= {e for e in cache.pinned if e in before}  # pinned stay once loaded
            hits += result.hits
            latest[layer] = set(experts)
    stats = engine.stats
    assert stats.hits == hits and stats.accesses == 150 * len(case.slots) * case.top_k
    assert stats.prefetch_loads == prefetches and stats.prefetch_hits <= prefetches
    assert stats.wasted_prefetches + stats.prefetch_hits == prefetches
    if case.predictor == "eager":
        assert prefetches > 0
    if case.predictor is None:
        assert prefetches == 0
    if case.budget:  # prefetching within LRU's byte budget: never more loads than demand LRU
        lru = P.OffloadPolicyEngine(len(case.slots), case.experts, list(case.slots), policy="lru")
        for token in routes:
            for layer, experts in enumerate(token):
                lru.on_route(layer, experts)
        assert stats.loads <= lru.stats.loads + case.top_k * len(case.slots)


@pytest.mark.parametrize("predictor", ["xlayer", "neighbors"])
def test_engine_is_deterministic_and_learning_may_come_after_the_launch(predictor):
    """The same loads on every run, and the same when the runtime lets the predictor learn after
    launching the step's kernels (on_route(learn=False), then learn) instead of inside on_route."""
    routes = _synthetic(7, tokens=80, layers=3, experts=16, top_k=3)
    case = EngineCase(16, 3, (6, 7, 8), "decayed_lfu", predictor, pinned=1)

    def run(split: bool):
        engine, trail = _engine(case, routes), []
        for token in routes:
            for layer, experts in enumerate(token):
                trail += engine.before_layer(layer) + engine.on_route(layer, experts, learn=not split).loads
                if split:
                    engine.learn(layer)
        return trail, engine.stats.hits

    trail, hits = run(split=False)
    assert run(split=False) == (trail, hits) == run(split=True)
    assert any(load.kind == P.PREFETCH for load in trail)


def _word_experts(word: int, layer: int, experts: int = 16, top_k: int = 2) -> tuple:
    """A 'word' routes the same way at each occurrence; different words share no expert."""
    return tuple((word * top_k + j + 5 * layer) % experts for j in range(top_k))


@pytest.mark.parametrize("window", [64, 5], ids=["window-64", "window-5-wraps"])
def test_neighbor_predictor_recalls_repeated_tokens_and_what_followed_them(window):
    """Once a word came before, its experts at the next layers are predicted from its first layer
    on, and ``later`` names the experts of the word that followed it."""
    layers, cycle = 4, [0, 1, 2]
    predictor = predictors.NeighborPredictor(layers, 16, neighbors=1, window=window)
    words = cycle * 4
    for t, word in enumerate(words):
        context = predictors.RouteContext([None] * layers, None if t == 0 else [None] * layers)
        predictor.begin_token(context)
        for layer in range(layers):
            if t >= len(cycle) and layer >= 1:
                ranked = predictor.predict(layer, context)
                assert {e for e, _ in ranked[:2]} == set(_word_experts(word, layer))
                later = predictor.later(layer)
                following = cycle[(cycle.index(word) + 1) % len(cycle)]
                assert set(sorted(range(16), key=lambda e: -later[e])[:2]) == set(_word_experts(following, layer))
            context.current[layer] = _word_experts(word, layer)
            predictor.observe(layer, context, context.current[layer])


def test_neighbor_predictor_does_not_follow_into_another_sequence():
    """The token after a sequence's last one belongs to another sequence: it is no follower."""
    layers = 3
    predictor = predictors.NeighborPredictor(layers, 16, neighbors=1)
    for t, (word, starts) in enumerate([(2, True), (0, False), (1, True), (0, False)]):
        context = predictors.RouteContext([None] * layers, None if starts else [None] * layers)
        predictor.begin_token(context)
        for layer in range(layers):
            context.current[layer] = _word_experts(word, layer)
            predictor.observe(layer, context, context.current[layer])
    # Word 0 came last in the first sequence; the only other candidate is the newest token.
    assert predictor.later(1) is None
    assert {e for e, _ in predictor.predict(2, context)[:2]} == set(_word_experts(0, 2))


@pytest.mark.parametrize("bad", [
    dict(slots=0), dict(slots=9), dict(slots=2, pinned={0, 1}), dict(slots=4, pinned={8}),
], ids=["no-slots", "more-slots-than-experts", "pins-fill-the-pool", "pin-out-of-range"])
def test_layer_cache_rejects_impossible_layouts(bad):
    with pytest.raises(ValueError):
        eviction.LayerCache(8, **bad)


def test_more_experts_than_slots_is_refused():
    engine = P.OffloadPolicyEngine(1, 8, 2)
    with pytest.raises(ValueError, match="3 distinct experts"):
        engine.on_route(0, [0, 1, 2])


def test_slot_table_reuses_the_victims_slot():
    engine = P.OffloadPolicyEngine(1, 8, 2, policy="lru")
    assert [load.slot for load in engine.on_route(0, [5, 3]).loads] == [0, 1]
    (load,) = engine.on_route(0, [3, 7]).loads  # 5 is the least recent and leaves slot 0
    assert (load.expert, load.slot, load.evicted, load.kind) == (7, 0, 5, P.DEMAND)
    assert engine.cache(0).slot_of[3] == 1 and engine.cache(0).slot_of[5] == -1


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="known: lru"):
        P.OffloadPolicyEngine(1, 8, 2, policy="fifo")


# ---------------------------------------------------------------------------------------------
# Cost figures and `moegen simulate`


def test_decode_floor_is_the_cost_models_one_token_memory_floor():
    from moegen.ir import KernelSignature
    from moegen.plan.cost_model import bucket_cost
    from moegen.spec import load_spec
    from moegen.target import resolve_target

    spec = load_spec(REPO / "specs" / "deepseek-v2-lite.yaml")
    m, target = spec.model, resolve_target(spec.target)
    signature = KernelSignature(m.hidden_size, m.intermediate_size, m.num_experts, m.top_k, m.activation, m.dtype)
    assert decode_layer_ms(spec, target.hbm_gbps) * 1e3 == pytest.approx(bucket_cost(signature, target, 1).memory_us)
    assert expert_bytes(spec) == 3 * 2048 * 1408 * 2


@pytest.mark.parametrize("text, experts, top_k, slots", [
    ("4", 8, 2, 4), ("0.25", 8, 2, 2), ("0.5", 64, 6, 32), ("0.3", 8, 2, 2), ("0.3125", 8, 2, 3),
    ("0.05", 8, 2, 2), ("1.0", 8, 2, 8),
], ids=["count", "quarter", "half", "rounds-down", "rounds-half-up", "at-least-top-k", "all"])
def test_slots_count_or_fraction(text, experts, top_k, slots):
    assert parse_slots(text, experts, top_k) == slots


def _cli(argv) -> int:
    from moegen import cli

    return cli.main(argv)


@pytest.fixture
def tiny_trace(tmp_path):
    routes = _synthetic(3, tokens=60, layers=2, experts=6, top_k=2)
    tokens = [{"seq": t // 20, "experts": token} for t, token in enumerate(routes)]
    return _write_trace(tmp_path / "tiny.jsonl.gz", tokens)


def test_simulate_json_shape(tiny_trace, capsys):
    assert _cli(["simulate", str(TINY_SPEC), "--trace", str(tiny_trace), "--slots", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert set(out) == {"trace", "slots_per_layer", "policies"}
    assert out["trace"] == str(tiny_trace) and out["slots_per_layer"] == 4
    assert list(out["policies"]) == sorted(PRESETS)
    for name, figures in out["policies"].items():
        assert set(figures) == {"hit_rate", "bytes", "stall_ms", "online"}
        assert 0 <= figures["hit_rate"] <= 1 and figures["bytes"] > 0 and figures["stall_ms"] >= 0
        assert figures["online"] is (name not in ("belady", "pinned_lru"))  # pins from the trace itself


def test_simulate_one_policy_keeps_the_references(tiny_trace, capsys):
    assert _cli(["simulate", str(TINY_SPEC), "--trace", str(tiny_trace), "--slots", "4", "--policy", "lfu",
                 "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["policies"]) == ["belady", "lfu", "lru"]


def test_simulate_table(tiny_trace, capsys):
    assert _cli(["simulate", str(TINY_SPEC), "--trace", str(tiny_trace), "--slots", "3"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    for column in ("online", "hit rate", "gap closed", "GB moved", "stall ms/token"):
        assert column in header
    assert all(any(line.startswith(name) for line in out.splitlines()) for name in PRESETS)


def test_simulate_notes_a_layer_count_difference(tmp_path, capsys):
    routes = _synthetic(5, tokens=10, layers=3, experts=6, top_k=2)
    trace = _write_trace(tmp_path / "t.jsonl.gz", [{"seq": 0, "experts": t} for t in routes], {"num_layers": 3})
    assert _cli(["simulate", str(TINY_SPEC), "--trace", str(trace), "--slots", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert "3 MoE layers" in captured.err and "simulating the trace's 3" in captured.err
    json.loads(captured.out)


@pytest.mark.parametrize("argv, words", [
    (["--slots", "1"], ("--slots", "2 experts one token needs")),  # a whole number is a count
    (["--slots", "7"], ("--slots", "6 experts")),
    (["--slots", "1.5"], ("--slots", "fraction")),
    (["--slots", "many"], ("--slots", "not a number")),
    (["--slots", "2", "--policy", "fifo"], ("--policy", "lru")),
    (["--slots", "2", "--lookahead", "0"], ("--lookahead",)),
], ids=["too-few-slots", "too-many-slots", "bad-fraction", "not-a-number", "unknown-policy", "no-lookahead"])
def test_simulate_bad_arguments_exit_2(tiny_trace, capsys, argv, words):
    assert _cli(["simulate", str(TINY_SPEC), "--trace", str(tiny_trace)] + argv) == 2
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


@pytest.mark.parametrize("header, field", [({"num_experts": 8}, "num_experts"), ({"top_k": 3}, "top_k")])
def test_simulate_spec_trace_mismatch_exit_2(tmp_path, capsys, header, field):
    k = header.get("top_k", 2)
    trace = _write_trace(tmp_path / "t.jsonl.gz", [{"seq": 0, "experts": [list(range(k)), list(range(k))]}], header)
    assert _cli(["simulate", str(TINY_SPEC), "--trace", str(trace), "--slots", "4"]) == 2
    err = capsys.readouterr().err
    assert str(trace) in err and field in err and str(TINY_SPEC) in err


def test_simulate_bad_trace_exit_2(tmp_path, capsys):
    trace = _write_trace(tmp_path / "t.jsonl.gz", (), raw=b"not gzip")
    assert _cli(["simulate", str(TINY_SPEC), "--trace", str(trace), "--slots", "2"]) == 2
    assert f"{trace}: not a complete gzip file" in capsys.readouterr().err


def test_simulate_real_mixtral_trace(capsys):
    path = _trace_path("mixtral-8x7b-gsm8k")
    spec = REPO / "specs" / "mixtral-8x7b.yaml"
    assert _cli(["simulate", str(spec), "--trace", str(path), "--slots", "0.5", "--policy", BEST_ONLINE,
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slots_per_layer"] == 4
    assert out["policies"]["lru"]["hit_rate"] == pytest.approx(0.601, abs=0.005)
    # The link is the bottleneck: a 336 MiB expert takes 6.4 ms to copy, a layer computes in 0.15 ms.
    assert out["policies"]["lru"]["stall_ms"] > 100


# ---------------------------------------------------------------------------------------------
# The stall model, by hand


class OraclePredictor(predictors.Predictor):
    """Knows the route of every token (a single-layer trace): predicts the next one for sure."""

    def __init__(self, routes):
        self.routes, self.seen = routes, 0

    def predict(self, layer, context):
        upcoming = self.seen if context.current[layer] is None else self.seen + 1
        return [(e, 1.0) for e in self.routes[upcoming][0]] if upcoming < len(self.routes) else []

    def observe(self, layer, context, experts):
        self.seen += 1


def _one_layer_trace(tmp_path, routes):
    tokens = [{"seq": 0, "experts": token} for token in routes]
    return load_trace(_write_trace(tmp_path / "t.jsonl.gz", tokens, {"num_layers": 1, "num_experts": 3, "top_k": 1}))


def test_stall_model_demand_misses_wait_for_their_copy(tmp_path):
    """Copy 1 ms, compute 0.5 ms, one slot: every token misses and waits the whole copy."""
    from moegen.offload.simulate import replay

    trace = _one_layer_trace(tmp_path, [[[0]], [[1]], [[0]]])
    link = LinkModel(expert_bytes=10**6, layer_ms=0.5, link_gbps=1.0)  # 1e6 B at 1 GB/s: 1 ms
    engine = P.OffloadPolicyEngine(1, 3, 1, policy="lru")
    stall, timely = replay(trace, engine, link)
    assert (stall, timely, engine.stats.hits, engine.stats.loads) == (3.0, 0, 0, 3)


def test_stall_model_prefetch_hides_behind_compute(tmp_path):
    """Sure prefetches, issued one layer ahead, make every access a hit; the first copy starts with
    the trace (1 ms stall), each later one hides behind the 0.5 ms compute of the step before."""
    from moegen.offload.simulate import replay

    routes = [[[0]], [[1]], [[2]], [[0]]]
    trace = _one_layer_trace(tmp_path, routes)
    link = LinkModel(expert_bytes=10**6, layer_ms=0.5, link_gbps=1.0)
    engine = P.OffloadPolicyEngine(1, 3, 2, policy="lru", predictor=OraclePredictor(routes))
    stall, timely = replay(trace, engine, link)
    stats = engine.stats
    assert (stats.hits, stats.prefetch_hits, stats.demand_loads, stats.prefetch_loads) == (4, 4, 0, 4)
    assert timely == 0 and stall == pytest.approx(1.0 + 3 * 0.5)


def test_lookahead_changes_only_prefetch_timing(tmp_path):
    routes = _synthetic(11, tokens=60, layers=4, experts=8, top_k=2)
    trace = load_trace(_write_trace(tmp_path / "t.jsonl.gz", [{"seq": 0, "experts": t} for t in routes],
                                    {"num_layers": 4, "num_experts": 8}))
    near, far = (simulate(trace, 4, "lru", LINK, lookahead=d) for d in (1, 3))
    assert (near.hit_rate, near.bytes, near.stall_ms) == (far.hit_rate, far.bytes, far.stall_ms)
    assert simulate(trace, 4, BEST_ONLINE, LINK, lookahead=3).bytes > 0
