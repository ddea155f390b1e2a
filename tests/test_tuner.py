"""The autotuner end to end on the CPU: Triton's interpreter is a tuning target of its own, so
search, verification, the database round trip and the strict mode all run without a GPU."""
from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest

from moegen import cli, knobs
from moegen.tune import db as tuning_db
from moegen.tune.runner import tune

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def interpreter_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    text = (REPO / "specs" / "tiny.yaml").read_text()
    text = text.replace("gpu: h200", "gpu: interpreter").replace("token_buckets: [1, 4, 16, 64]", "token_buckets: [1, 16]")
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    return path


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-interpreter tuning test")
def test_tune_warm_rebuild_and_forced_retune(interpreter_spec, tmp_path, capsys, monkeypatch):
    db_dir = tmp_path / "db"
    # Strict mode, as a CI that exports it everywhere: tuning fills the database it requires.
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(db_dir), MOEGEN_REQUIRE_TUNED="1"):
        report = tune(interpreter_spec, out=io.StringIO(), err=io.StringIO())
        assert [r.tokens for r in report.results] == [1, 16]
        assert report.benchmarked >= 2 and report.saved_to.parent == db_dir
        for r in report.results:
            assert r.time_us > 0 and r.candidates >= 2 and r.time_us <= r.default_time_us * 1.0001

        content = json.loads(report.saved_to.read_text())
        assert content["metadata"]["device"] == "Triton interpreter"
        assert set(content["buckets"]) == {"1", "16"}

        # Warm database: `build --tune` benchmarks nothing and the build uses the tuned configs.
        out_dir = tmp_path / "out"
        assert cli.main(["build", str(interpreter_spec), "--tune", "-o", str(out_dir)]) == 0
        assert "nothing to benchmark" in capsys.readouterr().err
        manifest = json.loads((out_dir / "tiny" / "manifest.json").read_text())
        assert all(b["source"] == f"tuned:{report.saved_to.name}" for b in manifest["buckets"])
        assert [b["config"] for b in manifest["buckets"]] == [content["buckets"][t]["config"] for t in ("1", "16")]

        again = tune(interpreter_spec, out=io.StringIO(), err=io.StringIO())
        assert again.benchmarked == 0 and again.skipped == (1, 16)

        # A forced re-tune times the entry it would replace and keeps it where it is faster.
        from moegen.runtime.fused import KernelConfig
        from moegen.tune import runner

        incumbent = replace(KernelConfig(**content["buckets"]["16"]["config"]), group_m=16)
        content["buckets"]["16"]["config"] = incumbent.__dict__
        report.saved_to.write_text(json.dumps(content))
        measure = runner._Search.measure

        def incumbent_fastest(search, config):
            time_us = measure(search, config)
            return 1e-3 if config == incumbent and time_us < float("inf") else time_us

        monkeypatch.setattr(runner._Search, "measure", incumbent_fastest)
        forced = tune(interpreter_spec, buckets=[16], force=True, out=io.StringIO(), err=io.StringIO())
        assert forced.results[0].config == incumbent
        assert json.loads(report.saved_to.read_text())["buckets"]["16"]["config"] == incumbent.__dict__

        # A refining re-tune starts from the entry: after the default, the entry (three-kernel, one
        # stream) is the first config it times; a bucket without one (20) starts from bucket 16's.
        timed = []

        def recorded(search, config):
            timed.append(config)
            return measure(search, config)

        monkeypatch.setattr(runner._Search, "measure", recorded)
        refined = tune(interpreter_spec, buckets=[16, 20], refine=True, out=io.StringIO(), err=io.StringIO())
        start = replace(incumbent, decode_block_n=0, streams=1)
        assert [r.tokens for r in refined.results] == [16, 20]
        assert timed[1] == start


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-interpreter tuning test")
def test_stale_file_stops_the_tuner_early_and_seeds_a_tune_elsewhere(interpreter_spec, tmp_path, capsys,
                                                                      monkeypatch):
    """After a template (or Triton) change: the stale file is never overwritten, the tuner says so
    before it benchmarks anything, and tuning into another directory times the stale entry."""
    from moegen.ir import lower
    from moegen.plan.configs import default_config
    from moegen.render import kernel_templates
    from moegen.spec import load_spec
    from moegen.target import current_gpu
    from moegen.tune import runner

    gpu, ir = current_gpu(), lower(load_spec(interpreter_spec), interpreter_spec)
    previous = replace(default_config(ir.signature, gpu, 1), group_m=16)  # outside the search space
    stale_meta = replace(tuning_db.current_metadata(gpu.name, ir.signature, kernel_templates(ir.signature)), template_hash="0" * 64)
    stale_dir = tmp_path / "stale"
    stale_file = tuning_db.save(stale_dir, stale_meta, {1: {"config": previous, "time_us": 5.0}}, {})
    before = stale_file.read_bytes()

    measure = runner._Search.measure
    timed = []

    def previous_fastest(search, config):
        timed.append(config)
        time_us = measure(search, config)
        return 1e-3 if config == previous and time_us < float("inf") else time_us

    monkeypatch.setattr(runner._Search, "measure", previous_fastest)
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(stale_dir)):
        assert cli.main(["tune", str(interpreter_spec), "--buckets", "1"]) == 2
    message = capsys.readouterr().err
    assert str(stale_file) in message and "template_hash" in message and "MOEGEN_TUNED_CONFIG_DIR" in message
    assert timed == [] and stale_file.read_bytes() == before

    fresh_dir = tmp_path / "fresh"
    monkeypatch.setattr(tuning_db, "shipped_dir", lambda: stale_dir)
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(fresh_dir)):
        report = tune(interpreter_spec, buckets=[1], out=io.StringIO(), err=io.StringIO())
    assert previous in timed and report.results[0].config == previous
    assert report.saved_to.parent == fresh_dir and stale_file.read_bytes() == before


def test_strict_mode_names_missing_key_and_command(interpreter_spec, tmp_path, capsys):
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(tmp_path / "empty"), MOEGEN_REQUIRE_TUNED="1"):
        assert cli.main(["build", str(interpreter_spec), "-o", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert "h40_i24_e6_k2_silu_float32" in message and "Triton interpreter" in message
    assert f"moegen tune {interpreter_spec}" in message
    assert not (tmp_path / "out" / "tiny").exists()


@pytest.mark.parametrize("spec", sorted((REPO / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_database_covers_shipped_specs(spec, tmp_path):
    """What CI proves with MOEGEN_REQUIRE_TUNED=1: every shipped spec builds from tuned configs."""
    if spec.stem == "tiny":
        pytest.skip("tiny targets the H200 only nominally: it is built for CPU tests, not tuned")
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=None, MOEGEN_REQUIRE_TUNED="1"):
        assert cli.main(["build", str(spec), "-o", str(tmp_path)]) == 0


def test_tuning_on_another_gpu_than_the_target_is_refused(tmp_path, monkeypatch, capsys):
    from moegen.target import current_gpu

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # without a GPU, the interpreter is "this GPU"
    other = "a10g" if current_gpu().alias == "l4" else "l4"
    spec = tmp_path / "tiny.yaml"
    spec.write_text((REPO / "specs" / "tiny.yaml").read_text().replace("gpu: h200", f"gpu: {other}"))
    assert cli.main(["build", str(spec), "--tune", "-o", str(tmp_path)]) == 2
    assert f"targets {_target(other).name}" in capsys.readouterr().err


def _target(alias: str):
    from moegen.target import lookup_gpu

    return lookup_gpu(alias)


def _signature(spec: str):
    """The kernel signature of a shipped spec (specs/<spec>.yaml)."""
    from moegen.ir import lower
    from moegen.spec import load_spec

    path = REPO / "specs" / f"{spec}.yaml"
    return lower(load_spec(path), path).signature


SPACE_CASES = [  # (spec, tokens): decode, middle and prefill row blocks of the shipped shapes
    ("mixtral-8x7b", 1), ("mixtral-8x7b", 512), ("qwen3-30b-a3b", 512), ("olmoe-1b-7b", 4096),
    ("deepseek-v3", 64), ("deepseek-v3", 16384),
]


@pytest.mark.parametrize("spec,tokens", SPACE_CASES)
def test_search_space_is_pruned_and_has_descriptor_twins(spec, tokens):
    """Every candidate fits the GPU's limits and is distinct; the row blocks include the
    default's; both ways of reading the weights are tried on Hopper, descriptors never before it;
    tail rows are tried from 512 tokens on (these shapes expect a row block per expert there);
    configs that group row blocks also try the smaller groups; configs with tail rows also try
    the runs that carry them first; decode sizes also try the decode kernel, and each of its
    configs its staggered GEMM1 walk."""
    from moegen.plan.configs import default_config, violation
    from moegen.tune import space

    sig = _signature(spec)
    tails_tried = set()
    for gpu_name, has_tma in (("h200", True), ("a100", False)):
        gpu = _target(gpu_name)
        starts = space.starting_points(sig, gpu, tokens)
        assert default_config(sig, gpu, tokens).block_m in {s.block_m for s in starts}
        for start in starts:
            gate_up = space.gate_up_candidates(start, sig, gpu)
            down = space.down_candidates(gate_up[-1], sig, gpu)
            tma = space.tma_candidates(down[-1], sig, gpu)
            for group in (gate_up, down, tma):
                assert len(set(group)) == len(group)
                assert all(violation(c, sig, gpu) is None for c in group)
            assert bool(tma) == has_tma and down[-1] not in tma
            tried = {c.tma for c in gate_up + down + tma}
            assert tried == ({False, True} if has_tma else {False})
            tail = space.tail_candidates((tma or down)[-1], sig, gpu, tokens)
            assert len(set(tail)) == len(tail) and all(violation(c, sig, gpu) is None for c in tail)
            assert all(0 < c.tail_m < c.block_m for c in tail)
            # 8-warp GEMM2 tiles also try the register cap that fits two programs per SM, as twins.
            capped = [c for c in tail if c.down_max_registers]
            assert all(c.down_num_warps == 8 and c.down_max_registers == 128 for c in capped)
            assert {replace(c, down_max_registers=0) for c in capped} <= set(tail)
            assert not capped or (tma or down)[-1].down_num_warps == 8
            # Wide tails also split, as twins; a 16-row tail has no half to split off.
            split = [c for c in tail if c.tail_split]
            assert all(c.tail_m >= 32 for c in split) and {replace(c, tail_split=False) for c in split} <= set(tail)
            assert bool(split) == any(c.tail_m >= 32 for c in tail)
            tails_tried |= {c.tail_m for c in tail}
            base = (tail or tma or down)[-1]
            group = space.group_candidates(base, sig, gpu)
            assert all(violation(c, sig, gpu) is None and c.group_m < base.group_m for c in group)
            assert len({c.group_m for c in group}) == len(group) == (0 if base.group_m == 1 else 3)
            # Two-stream halves, with the config's tail rows and groups.
            for config in {base, replace(base, tail_m=0, tail_split=False), replace(base, group_m=1)}:
                halves = replace(config, streams=2)
                deeper = replace(halves, num_stages=halves.num_stages + 1)
                streams = space.stream_candidates(config, sig, gpu)
                assert streams in ([halves], [halves, deeper])
                assert all(violation(c, sig, gpu) is None for c in streams)
                assert (deeper in streams) == (violation(deeper, sig, gpu) is None)
                # The runs with tail rows first: only where there are tail rows, once.
                order = space.order_candidates(config, sig, gpu)
                assert order == ([replace(config, tails_first=True)] if config.tail_m else [])
                assert space.order_candidates(replace(config, tails_first=True), sig, gpu) == []
                # Half blocks: once, without tail rows, where half a block is an MMA's 16 rows or more.
                half = space.half_candidates(config, sig, gpu)
                assert half == ([replace(config, half_blocks=True)] if config.block_m >= 32 and not config.tail_m
                                else [])
                assert space.half_candidates(replace(config, half_blocks=True), sig, gpu) == []
            # The decode kernel at decode sizes, each variant with GEMM1's walk staggered as a twin.
            decode = space.decode_candidates(base, sig, gpu, tokens)
            assert bool(decode) == (tokens <= 16) and space.stagger_candidates(base, sig, gpu) == []
            assert "needs decode_block_n" in violation(replace(base, decode_stagger_k=True), sig, gpu)
            assert "half_blocks needs" in violation(replace(base, block_m=16, tail_m=0, tail_split=False,
                                                            tails_first=False, half_blocks=True), sig, gpu)
            for config in decode:
                staggered = replace(config, decode_stagger_k=True)
                assert space.stagger_candidates(config, sig, gpu) == [staggered]
                assert violation(staggered, sig, gpu) is None and space.stagger_candidates(staggered, sig, gpu) == []
    # Tail rows where experts expect about a block or more, never at decode sizes.
    assert bool(tails_tried) == (tokens >= 512)


@pytest.mark.parametrize("spec,dtype,tokens,offered", [
    ("olmoe-1b-7b-int4", "bfloat16", 4096, True),    # 128-row blocks of int4 weights
    ("mixtral-8x7b-int4", "float16", 512, True),     # zero points, fp16
    ("olmoe-1b-7b-int4", "bfloat16", 1, False),      # 16-row blocks: the PTX pairs always
    ("olmoe-1b-7b-int4", "float32", 4096, False),    # no 16-bit lanes to pair in
    ("olmoe-1b-7b", "bfloat16", 4096, False),
    ("qwen3-30b-a3b-fp8", "bfloat16", 4096, False),
])
@pytest.mark.parametrize("field,candidates,suffix", [("int4_pair_ops", "pair_candidates", "_p"),
                                                     ("int4_swapped", "swap_candidates", "_w")])
def test_large_int4_row_blocks_try_each_int4_option(spec, dtype, tokens, offered, field, candidates, suffix):
    """int4 configs of row blocks over the PTX pairs' rows also try the pairs in Triton ops and
    every block multiplied swapped (and back); every other config refuses both by name, and
    fit_format turns them off."""
    from moegen.plan.configs import default_config, fit_format, violation
    from moegen.tune import space

    sig, gpu = replace(_signature(spec), dtype=dtype), _target("h200")
    base = replace(default_config(sig, gpu, tokens), **{field: False})
    other = replace(base, **{field: True})
    if offered:
        assert getattr(space, candidates)(base, sig, gpu) == [other] and violation(other, sig, gpu) is None
        assert getattr(space, candidates)(other, sig, gpu) == [base] and other.key == base.key + suffix
    else:
        assert getattr(space, candidates)(base, sig, gpu) == []
        assert f"{field} chooses" in violation(other, sig, gpu) and fit_format(other, sig) == base


@pytest.mark.parametrize("down_block_n,down_num_warps,capped_tails", [(128, 8, {16, 32}), (256, 8, set()),
                                                                      (128, 4, set())])
def test_tails_try_gemm2_capped_to_two_programs_per_sm(down_block_n, down_num_warps, capped_tails):
    """8-warp GEMM2 tiles with tail rows are also tried capped at 128 registers (two programs per
    SM), where the accumulators leave room: not with 64 tail rows or 256-wide tiles (spills or
    no compile), not with 4 warps (two programs fit already)."""
    from moegen.plan.configs import default_config
    from moegen.tune import space

    sig, gpu = _signature("deepseek-v3"), _target("h200")
    base = replace(default_config(sig, gpu, 4096, tails=False), down_block_n=down_block_n,
                   down_num_warps=down_num_warps)
    tail = space.tail_candidates(base, sig, gpu, 4096)
    assert {c.tail_m for c in tail if not c.down_max_registers} == {16, 32, 64}
    assert {c.tail_m for c in tail if c.down_max_registers == 128} == capped_tails
    assert all(c.down_max_registers in (0, 128) for c in tail)


def _confirming(search_times: dict, per_sample: dict, paired: Optional[dict] = None):
    """A GPU search whose candidates took search_times, timing per_sample[config][sample] in the
    confirmation and, in a duel, paired[config][sample] (default per_sample) in every round; also
    returns the list of what it timed in the confirmation."""
    from moegen.tune import runner

    search = runner._Search(None, None, True, {}, lambda line: None)
    search.times = dict(search_times)
    timed = []

    def time_on(config, sample, target_s):
        timed.append((config, sample))
        return per_sample[config][sample]

    search._time_as_judged = time_on
    paired = paired or per_sample
    search._time_in_rounds = lambda configs, sample: [[paired[c][sample]] * runner.DUEL_ROUNDS for c in configs]
    return search, timed


def _qwen3_configs(*groups: int):
    """The cost model's Qwen3 config at 512 tokens, then its variants with these row-block groups."""
    from moegen.plan.configs import default_config

    default = default_config(_signature("qwen3-30b-a3b"), _target("h200"), 512)
    return (default, *(replace(default, group_m=g) for g in groups))


def test_confirmation_keeps_the_fastest_on_average():
    """The search's CONFIRM_FINALISTS fastest and the default are timed again on every routing
    sample, in turns; the best mean wins, not the best single time; nothing else is timed again."""
    from moegen.tune.runner import CONFIRM_FINALISTS

    default, *ranked = _qwen3_configs(*range(1, CONFIRM_FINALISTS + 2))
    finalists = ranked[:CONFIRM_FINALISTS]
    lucky, steady = finalists[:2]
    per_sample = {c: (12.0 + i,) * 3 for i, c in enumerate(finalists)}
    per_sample.update({lucky: (10.0, 14.0, 15.0), steady: (11.0, 11.0, 11.5), default: (20.0, 19.0, 21.0)})
    search, timed = _confirming({**{c: 10.0 + i for i, c in enumerate(ranked)}, default: 20.0}, per_sample)
    best, best_us, default_us = search.confirm(default, [0, 1, 2])
    assert (best, best_us, default_us) == (steady, pytest.approx(33.5 / 3), pytest.approx(20.0))
    assert sorted(set(timed), key=str) == sorted({(c, s) for c in per_sample for s in range(3)}, key=str)
    assert [s for _, s in timed] == sorted(s for _, s in timed)  # sample by sample, every finalist in turn


@pytest.mark.parametrize("incumbent_mean,kept", [(34 / 3, True), (35.2 / 3, True), (35.4 / 3, False)],
                         ids=["fastest", "within_margin", "beyond_margin"])
def test_confirmation_times_the_incumbent(incumbent_mean, kept):
    """A forced re-tune's incumbent (the entry it would replace) is a finalist even where the
    search timed it outside the fastest CONFIRM_FINALISTS, and is kept unless the best finalist
    (here a mean of 35/3) is more than INCUMBENT_MARGIN faster."""
    from moegen.tune.runner import CONFIRM_FINALISTS

    default, *ranked, incumbent = _qwen3_configs(*range(1, CONFIRM_FINALISTS + 2))
    first, second = ranked[:2]
    per_sample = {c: (12.0 + i,) * 3 for i, c in enumerate(ranked)}
    per_sample.update({first: (10.0, 13.0, 13.0), second: (11.0, 12.0, 12.0), default: (20.0, 20.0, 20.0),
                       incumbent: (14.0, 10.0, 3 * incumbent_mean - 24.0)})
    search_times = {**{c: 10.0 + i for i, c in enumerate(ranked)}, incumbent: 30.0, default: 20.0}
    search, timed = _confirming(search_times, per_sample)
    assert search.confirm(default, [0, 1, 2], incumbent)[0] == (incumbent if kept else second)
    assert {c for c, _ in timed} == set(per_sample)
    assert search.confirm(default, [0, 1, 2])[0] == second


@pytest.mark.parametrize("paired_second,kept", [((11.0, 12.0, 12.0), False), ((11.0, 12.0, 12.2), True),
                                                ((12.0, 12.0, 12.0), True)],
                         ids=["paired_win", "paired_within_margin", "paired_loss"])
def test_replacing_the_incumbent_needs_a_paired_win(paired_second, kept):
    """A best finalist more than INCUMBENT_MARGIN faster than the incumbent in the confirmation
    replaces it only if it is that much faster again in the duel, a paired A/B on every sample
    (incumbent here 35.4 in both; the challenger 35.0, 35.2 or 36.0 in the duel)."""
    from moegen.tune.runner import CONFIRM_FINALISTS

    default, *ranked, incumbent = _qwen3_configs(*range(1, CONFIRM_FINALISTS + 2))
    first, second = ranked[:2]
    per_sample = {c: (12.0 + i,) * 3 for i, c in enumerate(ranked)}
    per_sample.update({first: (10.0, 13.0, 13.0), second: (11.0, 11.0, 11.0), default: (20.0, 20.0, 20.0),
                       incumbent: (14.0, 10.0, 11.4)})
    search_times = {**{c: 10.0 + i for i, c in enumerate(ranked)}, incumbent: 30.0, default: 20.0}
    search, _ = _confirming(search_times, per_sample, {**per_sample, second: paired_second})
    best, best_us, _ = search.confirm(default, [0, 1, 2], incumbent)
    assert (best, best_us) == ((incumbent, pytest.approx(35.4 / 3)) if kept else (second, pytest.approx(11.0)))


def test_rounds_alternate_their_order():
    """time_in_rounds times every call in each round, the order reversed every other round."""
    from moegen.tune import bench

    calls = []
    times = bench.time_in_rounds([lambda: calls.append("a"), lambda: calls.append("b")], False, 3)
    assert [len(t) for t in times] == [3, 3]
    firsts = calls[::len(calls) // 6]  # the first call of each of the six timings (each calls alike)
    assert firsts == ["a", "b", "b", "a", "a", "b"]


def test_tail_step_ranks_as_judged_on_every_sample():
    """The tail-row step verifies and times its candidates as every step does, then keeps the
    one of them or the step's config with the best mean as judged over all samples (not the
    best burst), at its burst time; a candidate that failed is not timed again."""
    import math

    base, bursty, steady, broken = _qwen3_configs(1, 2, 4)
    bursts = {base: 12.0, bursty: 10.0, steady: 11.0}
    per_sample = {base: (12.0,) * 3, bursty: (13.0, 9.0, 14.0), steady: (11.0, 11.0, 11.5)}
    search, timed = _confirming({base: 12.0}, per_sample)
    search.measure = lambda c: search.times.setdefault(c, bursts[c]) if c in bursts else math.inf
    assert search.improve_as_judged(base, [bursty, steady, broken], [0, 1, 2]) == (steady, 11.0)
    assert sorted(timed, key=str) == sorted(((c, s) for c in per_sample for s in range(3)), key=str)
    timed.clear()
    assert search.improve_as_judged(base, [], [0, 1, 2]) == (base, 12.0) and not timed


def test_descriptor_variants_need_aligned_rows():
    from moegen.ir import KernelSignature
    from moegen.plan.configs import default_config
    from moegen.tune import space

    gpu = _target("h200")
    odd = KernelSignature(hidden_size=100, intermediate_size=36, num_experts=8, top_k=2, activation="silu",
                          dtype="bfloat16")  # 200-byte rows, 72-byte rows: not 16-byte aligned
    assert space.tma_candidates(default_config(odd, gpu, 1), odd, gpu) == []


@pytest.mark.parametrize("spec,tokens,gpu_name,streams", [
    ("qwen3-30b-a3b", 1, "h200", 1),         # the decode kernel's buckets: one stream
    ("qwen3-30b-a3b", 8, "h200", 2),
    ("qwen3-30b-a3b", 4096, "h200", 2),      # matrix work ~0.31 ms at the H200's rate
    ("mixtral-8x7b", 512, "h200", 2),        # ~0.37 ms
    ("mixtral-8x7b", 1024, "h200", 1),       # ~0.73 ms: measured slower on two streams
    ("deepseek-v3", 2048, "h200", 1),
    ("qwen3-30b-a3b", 512, "a100", 1),       # measured on Hopper only
])
def test_defaults_take_two_streams_for_little_matrix_work(spec, tokens, gpu_name, streams):
    """Beyond decode sizes the cost model's default runs two streams on Hopper where the call's
    matrix work is short. Every start of the search is a three-kernel config on one stream: one
    with the decode kernel's fields had its GEMM candidates timed on the decode kernel, and on
    one stream each step's candidates stay valid (tail rows take two streams only in groups of
    1) until the stream step decides; tail rows too are searched after the starts."""
    from moegen.plan.configs import default_config, violation
    from moegen.tune import space

    sig, gpu = _signature(spec), _target(gpu_name)
    default = default_config(sig, gpu, tokens)
    assert default.streams == streams and violation(default, sig, gpu) is None
    starts = space.starting_points(sig, gpu, tokens)
    assert {(s.streams, s.decode_block_n, s.tail_m, s.down_max_registers) for s in starts} == {(1, 0, 0, 0)}


@pytest.mark.parametrize("spec,tokens,gpu_name,tail", [
    ("mixtral-8x7b", 512, "h200", (128, 32, 128)),   # 128 rows per expert, 8-warp GEMM2: capped
    ("qwen3-30b-a3b", 2048, "h200", (128, 32, 128)),
    ("mixtral-8x7b", 256, "h200", (64, 32, 0)),      # 64 rows, 4-warp GEMM2: two programs fit uncapped
    ("mixtral-8x7b", 320, "h200", (128, 0, 0)),      # 80 rows: under 3/4 of the 128-row block
    ("qwen3-30b-a3b", 512, "h200", (64, 0, 0)),      # 32 rows: under 3/4 of the 64-row block
    ("mixtral-8x7b", 2, "h200", (16, 0, 0)),         # the decode kernel
    ("mixtral-8x7b", 512, "a100", (128, 0, 0)),      # measured on Hopper only
])
def test_defaults_take_tail_rows_where_experts_expect_a_block(spec, tokens, gpu_name, tail):
    """The cost model's default carries 32 tail rows, split, with GEMM2 capped to two programs
    per SM, on Hopper where the experts expect at least 3/4 of a row block of 64 or 128 rows:
    (block_m, tail_m, down_max_registers)."""
    from moegen.plan.configs import default_config, violation

    sig, gpu = _signature(spec), _target(gpu_name)
    default = default_config(sig, gpu, tokens)
    assert (default.block_m, default.tail_m, default.down_max_registers) == tail
    assert default.tail_split == bool(default.tail_m) and violation(default, sig, gpu) is None
    assert default_config(sig, gpu, tokens, tails=False) == replace(default, tail_m=0, tail_split=False,
                                                                    down_max_registers=0)


@pytest.mark.parametrize("spec,tokens,columns", [
    ("olmoe-1b-7b", 1, 64),             # 8 experts x 1024/64 = 128 programs: one wave on 132 SMs
    ("deepseek-v2-lite", 1, 64),        # 6 x 1408/64 = 132
    ("qwen3-30b-a3b", 1, 64),           # 8 x 768/64 = 96
    ("mixtral-8x7b", 1, 128),           # 2 x 14336/64 = 448
    ("deepseek-v3", 1, 128),            # 8 x 2048/64 = 256
    ("untuned/deepseek-v2", 1, 128),    # 6 x 1536/64 = 144
    ("qwen3-30b-a3b", 2, 128),          # 16 x 768/64 = 192
])
def test_default_decode_slices_widen_past_one_wave(spec, tokens, columns):
    """The default decode tile takes 64 columns of I where the batch's experts then make at most
    one program per SM, 128 beyond (the tuned one-token choice of every shipped shape)."""
    from moegen.plan.configs import default_config, violation

    sig, gpu = _signature(spec), _target("h200")
    default = default_config(sig, gpu, tokens)
    assert default.decode_block_n == columns and violation(default, sig, gpu) is None


@pytest.mark.parametrize("spec,tokens,gpu_name,marked", [
    ("qwen3-30b-a3b", 2048, "h200", True),    # 128 rows per expert: one 128-row block reads its weights
    ("qwen3-30b-a3b", 4096, "h200", False),   # 256: later blocks re-read them (measured 2-4% slower)
    ("olmoe-1b-7b", 1024, "h200", True),
    ("olmoe-1b-7b", 2048, "h200", False),
    ("mixtral-8x7b", 512, "h200", True),
    ("mixtral-8x7b", 1024, "h200", False),
    ("deepseek-v3", 1, "h200", True),         # the decode kernel's copies too
    ("mixtral-8x7b", 8, "h200", False),       # no tensor descriptors by default: nothing to mark
    ("qwen3-30b-a3b", 512, "a100", False),    # no tensor descriptors before Hopper
])
def test_defaults_mark_tensor_copies_evict_first_where_experts_expect_a_block(spec, tokens, gpu_name, marked):
    """The cost model's default marks its tensor copies L2 evict-first where the experts expect at
    most 128 rows each; the search tries the other setting on its best config, and a config
    without descriptors carries no mark (turning them off clears it)."""
    from moegen.plan.configs import default_config, violation
    from moegen.tune import space

    sig, gpu = _signature(spec), _target(gpu_name)
    default = default_config(sig, gpu, tokens)
    assert default.l2_evict_first == marked and violation(default, sig, gpu) is None
    assert space.evict_candidates(default, sig, gpu) == (
        [replace(default, l2_evict_first=not marked)] if default.tma else [])
    assert all(c.tma or not c.l2_evict_first for c in space.tma_candidates(default, sig, gpu))
    assert violation(replace(default, tma=False, l2_evict_first=True), sig, gpu) == \
        "l2_evict_first marks the tensor-descriptor copies: it needs tma"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-interpreter tuning test")
@pytest.mark.parametrize("quantization, key", [
    ("quantization: int4_group\n  quantization_group_size: 32\n  quantization_zero_point: true", "int4g32z"),
    ("quantization: fp8_block", "fp8b"),
])
def test_quantized_experts_tune_with_the_same_tuner(quantization, key, tmp_path, monkeypatch):
    """Every candidate runs the format's kernels on quantized weights and is verified against the
    quantized reference; the results land in a file of their own, which a strict build takes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    text = (REPO / "specs" / "tiny.yaml").read_text().replace("gpu: h200", "gpu: interpreter")
    text = text.replace("token_buckets: [1, 4, 16, 64]", "token_buckets: [1, 16]")
    text = text.replace("hidden_size: 40", "hidden_size: 64").replace("intermediate_size: 24", "intermediate_size: 96")
    text = text.replace("quantization: none\n  quantization_group_size: 128\n  quantization_zero_point: false", quantization)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(text)
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(tmp_path / "db"), MOEGEN_REQUIRE_TUNED="1"):
        report = tune(spec, out=io.StringIO(), err=io.StringIO())
        assert report.saved_to.name == f"h64_i96_e6_k2_silu_float32_{key}__triton_interpreter.json"
        assert [r.tokens for r in report.results] == [1, 16] and all(r.candidates >= 2 for r in report.results)
        assert all(not r.config.tma for r in report.results)  # quantized weights: plain loads
        if key == "fp8b":
            assert {r.config.block_k for r in report.results} == {128}
        assert cli.main(["build", str(spec), "-o", str(tmp_path / "out")]) == 0
    manifest = json.loads((tmp_path / "out" / "tiny" / "manifest.json").read_text())
    assert {b["source"] for b in manifest["buckets"]} == {f"tuned:{report.saved_to.name}"}


SPEC_FILES = sorted(Path(__file__).resolve().parent.parent.glob("specs/**/*.yaml"))


@pytest.mark.parametrize("spec_file", SPEC_FILES, ids=lambda p: p.stem)
def test_default_configs_keep_their_accumulators_in_registers(spec_file):
    """Every bucket's default config of every spec: fp8's per-step product tiles counted (an fp8
    default whose tiles spilled ran Qwen3-30B-A3B's T=4096 at 7959 us on the H100)."""
    from moegen.ir import lower
    from moegen.plan.configs import accumulator_violation, default_config
    from moegen.spec import load_spec

    ir = lower(load_spec(spec_file), spec_file)
    for tokens in ir.spec.workload.token_buckets:
        assert accumulator_violation(default_config(ir.signature, ir.target, tokens), ir.signature) is None, tokens
