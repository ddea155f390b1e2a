"""Fused-MoE kernels against the float64 reference: a case matrix of shapes, dtypes, token
counts and routing options. On the CPU the kernels run in Triton's interpreter (fp32, fp16;
the interpreter computes bf16 dots wrongly), so shapes are tiny but deliberately awkward:
H and I not multiples of the block, E not a power of two, empty and crowded experts."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import zlib

import pytest
import torch

from moegen import reference as ref
from moegen.runtime.align import EXPERT_MASK, LEFT_SHIFT, RANK_SHIFT, RUN_WRAP, align_tokens, run_rows

TOLERANCE = ref.TOLERANCE
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    model: dict = field(default_factory=dict)
    routing: str = "random"  # random | one_expert | half_experts | ties


BASE = dict(hidden_size=40, intermediate_size=24, num_experts=6, top_k=2, dtype="float32")
GROUPED = dict(BASE, num_experts=8, top_k=3, scoring="sigmoid", correction_bias=True, n_group=4,
               topk_group=2, routed_scaling_factor=2.5)

CASES = [
    Case("empty", 0, BASE),
    Case("one_token", 1, BASE),
    Case("odd_tokens", 7, BASE),
    Case("several_blocks_per_expert", 70, BASE),
    Case("beyond_single_program_routing", 300, BASE),  # multi-program routing and alignment
    Case("all_on_one_expert", 37, BASE, routing="one_expert"),
    Case("half_experts_idle", 23, BASE, routing="half_experts"),
    Case("fp16_gelu_even_k", 19, dict(BASE, hidden_size=64, intermediate_size=48, num_experts=5,
                                      activation="gelu", dtype="float16")),
    Case("fp16_one_token", 1, dict(BASE, dtype="float16", num_experts=7, top_k=3)),
    Case("no_renormalize", 9, dict(BASE, renormalize=False)),
    Case("sigmoid_top1", 11, dict(BASE, scoring="sigmoid", top_k=1)),
    Case("grouped_correction_bias", 13, GROUPED),
    Case("grouped_softmax", 13, dict(BASE, num_experts=8, n_group=2, topk_group=1, top_k=2)),
    Case("top_k_equals_experts", 5, dict(BASE, num_experts=3, top_k=3)),
]


def _inputs(case: Case, pkg, generator):
    m = pkg.SPEC.model
    dtype = TORCH_DTYPE[m.dtype]
    h, i, e = m.hidden_size, m.intermediate_size, m.num_experts

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)

    x = rand(case.tokens, h)
    w13 = rand(e, 2 * i, h, scale=h ** -0.5)
    w2 = rand(e, h, i, scale=i ** -0.5)
    bias = (torch.rand(e, generator=generator) * 0.1).to(DEVICE) if m.correction_bias else None
    logits = ref.separated_router_logits(case.tokens, pkg.KERNELS.routing, bias, generator=generator,
                                         device=DEVICE)
    if case.routing == "one_expert":
        logits[:, 2] += 100.0  # expert 2 wins every token's first pick
    elif case.routing == "half_experts":
        logits[:, 1::2] -= 100.0  # odd experts never chosen
    elif case.routing == "ties":
        logits = logits.round()  # equal scores: the lower expert id wins, as in the reference
    return x, logits, w13, w2, bias


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_moe_matches_float64_reference(case, package_factory):
    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x, logits, w13, w2, bias = _inputs(case, pkg, generator)
    out = pkg.fused_moe(x, logits, w13, w2, correction_bias=bias)
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = ref.moe_reference(x, logits, w13, w2, pkg.KERNELS.routing, pkg.SPEC.model.activation, bias)
    if case.routing == "one_expert":
        assert bool((ref.route_reference(logits, pkg.KERNELS.routing, bias)[1][:, 0] == 2).all())
    if case.tokens == 0:
        assert out.numel() == 0
        return
    assert ref.relative_error(out, expected) <= TOLERANCE[pkg.SPEC.model.dtype]


TMA_CASES = [c for c in CASES if c.name in ("one_token", "odd_tokens", "several_blocks_per_expert",
                                             "all_on_one_expert", "half_experts_idle", "fp16_gelu_even_k")]


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.name)
def test_tensor_descriptor_path(case, split_k, package_factory):
    """Weights (and GEMM2's intermediate) through tensor descriptors: edges zero-filled, rows of
    padding never stored, split-K chunks ending inside a tile."""
    from dataclasses import replace

    from moegen.runtime.fused import fused_moe, tma_possible

    pkg = package_factory(**case.model)
    assert tma_possible(pkg.KERNELS)
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + split_k)
    x, logits, w13, w2, bias = _inputs(case, pkg, generator)
    config = replace(pkg.KERNELS.config_for(case.tokens), tma=True, split_k=split_k, block_n=16, block_k=32,
                     down_block_n=32, down_block_k=16)
    out = fused_moe(pkg.KERNELS, x, logits, w13, w2, correction_bias=bias, config=config)
    expected = ref.moe_reference(x, logits, w13, w2, pkg.KERNELS.routing, pkg.SPEC.model.activation, bias)
    assert ref.relative_error(out, expected) <= TOLERANCE[pkg.SPEC.model.dtype]


STREAM_CASES = [c for c in CASES if c.name in ("one_token", "odd_tokens", "several_blocks_per_expert",
                                                "beyond_single_program_routing", "all_on_one_expert",
                                                "half_experts_idle", "fp16_gelu_even_k")]


def _check_both_routings(pkg, x, logits, w13, w2, bias, config):
    """config's call against the float64 reference, routed by the kernels and by the caller."""
    from moegen.runtime.fused import fused_experts, fused_moe

    expected = ref.moe_reference(x, logits, w13, w2, pkg.KERNELS.routing, pkg.SPEC.model.activation, bias)
    out = fused_moe(pkg.KERNELS, x, logits, w13, w2, correction_bias=bias, config=config)
    assert ref.relative_error(out, expected) <= TOLERANCE[pkg.SPEC.model.dtype]
    weights, ids, _ = ref.route_reference(logits, pkg.KERNELS.routing, bias)
    out = fused_experts(pkg.KERNELS, x, weights.to(x.dtype), ids, w13, w2, config=config)
    assert ref.relative_error(out, expected) <= TOLERANCE[pkg.SPEC.model.dtype]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda c: c.name)
def test_two_stream_halves(case, tma, package_factory):
    """Row blocks in two halves (GEMM1 then GEMM2 each; on the CPU one after the other): shifted
    views, only the first half zeroing the output, a second half that the routing may leave
    empty (all tokens on one expert: fewer blocks than the uniform estimate) or overfull
    (several blocks per expert); with tail rows in groups of 4 beyond 70 tokens (the second
    half's shifted tail base, groups cut by the halves; on the descriptor path the runs with
    tails first); routed by the kernels and by the caller."""
    from dataclasses import replace

    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + tma)
    x, logits, w13, w2, bias = _inputs(case, pkg, generator)
    config = replace(pkg.KERNELS.config_for(case.tokens), streams=2, tail_m=0, decode_block_n=0, tma=tma)
    if case.tokens >= 70:
        config = replace(config, block_m=16, tail_m=8, group_m=4, block_n=16, down_block_n=16, tails_first=tma)
    _check_both_routings(pkg, x, logits, w13, w2, bias, config)


GROUP_CASES = [Case("runs_of_several_blocks", 200, BASE),
               Case("runs_beyond_rank_wrap", 300, dict(BASE, top_k=1), routing="one_expert")]


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("group_m", [2, 4, 16])
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c.name)
def test_row_block_groups_within_runs(case, group_m, streams, package_factory):
    """Row blocks grouped from each run's first block (16-row blocks: runs of 4-6 blocks, and of
    19, beyond the words' rank wrap), on one stream and in two-stream halves (whose views cut
    runs), routed by the kernels and by the caller."""
    from dataclasses import replace

    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + group_m)
    x, logits, w13, w2, bias = _inputs(case, pkg, generator)
    # Narrow tiles: several N tiles per block (2 in GEMM1, 3 in GEMM2), so that the order matters.
    config = replace(pkg.KERNELS.config_for(case.tokens), block_m=16, tail_m=0, group_m=group_m, streams=streams,
                     block_n=16, down_block_n=16, split_k=1, decode_block_n=0)
    _check_both_routings(pkg, x, logits, w13, w2, bias, config)


DECODE_CASES = [c for c in CASES if 0 < c.tokens <= 16] + [
    Case("decode_all_on_one_expert", 9, BASE, routing="one_expert"),
    Case("decode_sixteen_tokens", 16, dict(BASE, num_experts=9, top_k=4)),
    # One token: program d takes the token's d-th pick, two per top-k step (grouped, biased; a
    # single pick; an odd k with the softmax's share of the whole row; groups by logits; ties; a
    # logit of 100, whose exponential overflows unless taken relative to the max; a biased softmax).
    Case("decode_one_token_grouped", 1, GROUPED),
    Case("decode_one_token_top1", 1, dict(BASE, scoring="sigmoid", top_k=1, renormalize=False)),
    Case("decode_one_token_no_renormalize", 1, dict(BASE, num_experts=9, top_k=5, renormalize=False)),
    Case("decode_one_token_grouped_softmax", 1, dict(BASE, num_experts=8, n_group=4, topk_group=2, top_k=3)),
    Case("decode_one_token_sigmoid", 1, dict(BASE, num_experts=9, scoring="sigmoid", top_k=4)),
    Case("decode_one_token_ties", 1, dict(BASE, num_experts=9, top_k=4), routing="ties"),
    Case("decode_one_token_one_expert", 1, dict(BASE, num_experts=9, top_k=4), routing="one_expert"),
    Case("decode_one_token_softmax_bias", 1, dict(BASE, num_experts=9, top_k=3, correction_bias=True)),
    # 33-128 positions: the row routed in one copy per warp (plain and grouped with a bias).
    Case("decode_one_token_copies", 1, dict(BASE, num_experts=40, top_k=5, renormalize=False)),
    Case("decode_one_token_copies_grouped", 1, dict(GROUPED, num_experts=64, top_k=6)),
    Case("decode_one_token_grouped_unbiased", 1, dict(BASE, num_experts=64, top_k=6, n_group=8, topk_group=3)),
    # Group-limited without a bias, 64 experts: token tiles of 16 rows where 2-8 would be sized (GPU
    # workaround).
    Case("decode_grouped_unbiased", 3, dict(BASE, num_experts=64, top_k=6, n_group=8, topk_group=3)),
    # ~100 programs: groups of neighbours start GEMM2 at each of the three chunks of H (one partial).
    Case("decode_staggered_chunks", 9, dict(BASE, hidden_size=72, intermediate_size=136, num_experts=12, top_k=4)),
]
# (case, GEMM1's walk staggered): the staggered walk where groups start at each of three steps
# along H, the last one partial (H = 72) and not (H = 96).
DECODE_MATRIX = [(case, False) for case in DECODE_CASES] + [
    (DECODE_CASES[-1], True),
    (Case("decode_staggered_steps", 9, dict(BASE, hidden_size=96, intermediate_size=136, num_experts=12, top_k=4)),
     True),
]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("case,stagger_k", DECODE_MATRIX,
                         ids=lambda v: v.name if isinstance(v, Case) else ("k_staggered" if v else ""))
def test_decode_kernel(case, stagger_k, tma, package_factory):
    """The one-launch decode path: routing in every program, distinct experts found per batch,
    slices of I not dividing I, output chunks not dividing H; then a second call, which must
    find the workspace zeroed again."""
    from dataclasses import replace

    from moegen.runtime.fused import fused_moe

    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + tma)
    config = replace(pkg.KERNELS.config_for(case.tokens), tma=tma, decode_block_n=16, decode_block_k=32,
                     decode_block_h=32, decode_num_warps=4, decode_num_stages=2, decode_stagger_k=stagger_k)
    for _ in range(2):
        x, logits, w13, w2, bias = _inputs(case, pkg, generator)
        out = fused_moe(pkg.KERNELS, x, logits, w13, w2, correction_bias=bias, config=config)
        expected = ref.moe_reference(x, logits, w13, w2, pkg.KERNELS.routing, pkg.SPEC.model.activation, bias)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert ref.relative_error(out, expected) <= TOLERANCE[pkg.SPEC.model.dtype]


@pytest.mark.parametrize("largest_bucket,tokens", [(1, 3), (4, 6), (4, 16), (4, 17)])
def test_batches_beyond_the_largest_bucket(largest_bucket, tokens, package_factory):
    """A batch larger than every bucket runs the largest bucket's config (the one-launch decode
    kernel, where that bucket is a decode size), which must still route every token."""
    pkg = package_factory(buckets=(largest_bucket,), **BASE)
    assert pkg.KERNELS.config_for(tokens).decode_block_n > 0
    case = Case(f"beyond_bucket_{largest_bucket}", tokens, BASE)
    x, logits, w13, w2, bias = _inputs(case, pkg, torch.Generator().manual_seed(tokens))
    out = pkg.fused_moe(x, logits, w13, w2)
    expected = ref.moe_reference(x, logits, w13, w2, pkg.KERNELS.routing, pkg.SPEC.model.activation, bias)
    assert ref.relative_error(out, expected) <= TOLERANCE[pkg.SPEC.model.dtype]


FINISH_COMPILE = """
import tempfile
from pathlib import Path
import torch
import moegen
from moegen.package import build
from moegen.runtime.fused import DECODE_FINISH_BLOCK, DECODE_MAX_TOKENS
folder, _ = build(Path({spec!r}), Path(tempfile.mkdtemp()))
ks = moegen.load(folder).KERNELS
work = torch.zeros(DECODE_MAX_TOKENS * ks.hidden_size)
out = torch.zeros(ks.hidden_size, dtype=ks.dtype)
for pdl in (False, True):
    ks.decode_finish.warmup(work, out, out.numel(), BLOCK=DECODE_FINISH_BLOCK, USE_PDL=pdl, num_warps=4,
                            grid=(1,))
"""


def test_decode_finish_reads_every_sum_before_zeroing(compile_sm90):
    """The finish reads the workspace and zeroes it: compiled for sm_90, a barrier separates the
    last load from the first zeroing store, so no thread zeroes a sum that another thread (with
    another share of the elements) has yet to read. A race the interpreter cannot show."""
    import re
    from pathlib import Path

    spec = Path(__file__).resolve().parent.parent / "specs" / "olmoe-1b-7b.yaml"
    kernels = [ptx for name, ptx in compile_sm90(FINISH_COMPILE.format(spec=str(spec))).items() if "finish" in name]
    assert len(kernels) == 2  # with and without the programmatic dependent wait
    for ptx in kernels:
        lines = ptx.splitlines()
        zero = set(re.findall(r"mov\.b32\s+(%r\d+), 0;", ptx))
        loads = [i for i, line in enumerate(lines) if "ld.global" in line]
        barriers = [i for i, line in enumerate(lines) if re.search(r"\bbar(rier)?\.sync\b", line)]
        stored = [(i, set(re.findall(r"%rs?\d+", line.split("{")[-1]))) for i, line in enumerate(lines)
                  if "st.global" in line]
        zeroing = [i for i, registers in stored if registers and registers <= zero]
        assert loads and zeroing
        assert any(max(loads) < b < min(zeroing) for b in barriers), "a zeroing store may overtake a load"


@pytest.mark.parametrize("case", [c for c in CASES if c.tokens > 0][:6], ids=lambda c: c.name)
def test_fused_experts_with_caller_routing(case, package_factory):
    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(7)
    x, logits, w13, w2, _ = _inputs(case, pkg, generator)
    k, e = pkg.SPEC.model.top_k, pkg.SPEC.model.num_experts
    ids = torch.stack([torch.randperm(e, generator=generator)[:k] for _ in range(case.tokens)]).to(DEVICE)
    weights = torch.rand(case.tokens, k, generator=generator).to(DEVICE)
    out = pkg.fused_experts(x, weights, ids, w13, w2)
    expected = ref.experts_reference(x, weights, ids, w13, w2, pkg.SPEC.model.activation)
    assert ref.relative_error(out, expected) <= TOLERANCE[pkg.SPEC.model.dtype]


@pytest.mark.parametrize("case", [c for c in CASES if c.tokens > 0], ids=lambda c: c.name)
def test_routing_matches_reference(case, package_factory):
    from moegen.runtime.routing import route

    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(11)
    _, logits, _, _, bias = _inputs(case, pkg, generator)
    weights, ids = route(logits, pkg.KERNELS.routing, bias)
    ref_weights, ref_ids, _ = ref.route_reference(logits, pkg.KERNELS.routing, bias)
    order, ref_order = ids.long().sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values.cpu(), ref_order.values.cpu())
    assert torch.allclose(weights.gather(1, order.indices).double(), ref_weights.gather(1, ref_order.indices), rtol=1e-5)


ROUTING_CASES = [c for c in CASES if c.tokens > 0 and c.model.get("dtype") != "float16"] + [
    Case("many_experts_top8", 21, dict(BASE, num_experts=20, top_k=8)),
    Case("grouped_wide", 40, dict(GROUPED, num_experts=32, top_k=6, n_group=8, topk_group=3)),
    Case("deepseek_v3_routing", 37, dict(GROUPED, num_experts=256, top_k=8, n_group=8, topk_group=4)),
    Case("groups_of_six", 29, dict(GROUPED, num_experts=24, top_k=4, n_group=4, topk_group=2)),
    # DeepSeek-V2's group-limited softmax (no bias): count tiles of 4 rows (1024 elements) where 2
    # would be sized.
    Case("grouped_unbiased_deepseek_v2", 21, dict(BASE, num_experts=160, top_k=6, n_group=8, topk_group=3,
                                                  renormalize=False, routed_scaling_factor=16.0)),
    Case("tied_scores", 17, dict(BASE, num_experts=12, top_k=4), routing="ties"),
    Case("run_beyond_rank_wrap", 150, dict(BASE, top_k=1), routing="one_expert"),  # 19 blocks of 8 on expert 2
]


def _check_layout(a, expert_of_slot: torch.Tensor, num_experts: int, block_m: int, tail_m: int,
                  run_words: bool = True, tails_first: bool = False) -> torch.Tensor:
    """Every slot exactly once, in a row block (or the tail rows of the last block, with
    tails_first the first) of its expert's run; the runs in expert order (with tails_first those
    with tail rows first, each kind in expert order), padded exactly as run_rows says; the other
    rows of the blocks in use the sentinel (rows beyond them are never read); each block's word:
    its expert and (run_words) its rank in the run modulo RUN_WRAP and the blocks left in it,
    capped; slots of expert -1 (skipped) nowhere. Returns the expert of each slot as the layout says."""
    num_slots = expert_of_slot.numel()
    used, blocks = int(a.num_padded), int(a.num_padded) // block_m
    slots = a.sorted_slots.long().cpu()
    words = a.block_runs.long().cpu()[:blocks]
    experts = words & EXPERT_MASK
    counts = torch.bincount(expert_of_slot[expert_of_slot >= 0], minlength=num_experts)
    padded = run_rows(counts, block_m, tail_m)
    assert used == int(padded.sum())
    assert slots.numel() == a.max_padded + a.max_padded // block_m * tail_m
    run_blocks = padded // block_m
    layout = torch.argsort((padded >= counts).long(), stable=True) if tails_first else torch.arange(num_experts)
    assert torch.equal(experts, torch.repeat_interleave(layout, run_blocks[layout]))
    run_first = torch.empty_like(run_blocks)
    run_first[layout] = run_blocks[layout].cumsum(0) - run_blocks[layout]
    if run_words:
        index = torch.arange(blocks)
        rank, left = index - run_first[experts], run_first[experts] + run_blocks[experts] - index
        assert torch.equal(words >> RANK_SHIFT & (RUN_WRAP - 1), rank % RUN_WRAP)
        assert torch.equal((words >> LEFT_SHIFT & (RUN_WRAP - 1)) + 1, left.clamp(max=RUN_WRAP))
    else:
        assert bool((words == experts).all())
    ids = torch.full((num_slots,), -1, dtype=torch.long)
    for b in range(blocks):
        block = slots[b * block_m:(b + 1) * block_m]
        tail = slots[a.max_padded + b * tail_m:a.max_padded + (b + 1) * tail_m]
        block, tail = block[block < num_slots], tail[tail < num_slots]
        assert block.numel() > 0
        if tail.numel():  # only a full last (tails_first: first) block of its run carries tail rows
            assert block.numel() == block_m
            neighbour = b - 1 if tails_first else b + 1
            assert neighbour in (-1, blocks) or int(experts[neighbour]) != int(experts[b])
        for s in (block, tail):
            assert bool((ids[s] == -1).all())
            ids[s] = int(experts[b])
    assert bool((ids == expert_of_slot).all())
    return ids


@pytest.mark.parametrize("block_m,tail_m,tails_first", [(16, 0, False), (8, 4, False), (8, 4, True)],
                         ids=["padded", "tail_rows", "tails_first"])
@pytest.mark.parametrize("path", ["single_program", "multi_program"])
@pytest.mark.parametrize("case", ROUTING_CASES, ids=lambda c: c.name)
def test_route_and_align_kernels(case, path, block_m, tail_m, tails_first, package_factory, monkeypatch):
    """Both routing kernels: the reference's top-k and weights, every slot placed exactly once
    in a row block (or tail rows) of its own expert, the runs in order, padding rows marked, the
    padded total exact."""
    from moegen.runtime import fused

    monkeypatch.setattr(fused, "_route_align_override", lambda: 1 << 20 if path == "single_program" else 0)
    pkg = package_factory(**case.model)
    ks = pkg.KERNELS
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + 1)
    _, logits, _, _, bias = _inputs(case, pkg, generator)
    weights, a = fused.route_and_align(ks, logits, bias, block_m, tail_m, tails_first)
    ref_weights, ref_ids, _ = ref.route_reference(logits, ks.routing, bias)
    k, t = ks.top_k, case.tokens
    # The kernels' ids, recovered from the layout (slot s sits in a block of its expert).
    ids = _check_layout(a, ref_ids.reshape(-1).cpu(), ks.num_experts, block_m, tail_m,
                        tails_first=tails_first).view(t, k)
    order, ref_order = ids.sort(dim=1), ref_ids.cpu().sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    flat_weights = weights.view(t, k).cpu().double()
    assert torch.allclose(flat_weights.gather(1, order.indices), ref_weights.cpu().gather(1, ref_order.indices), rtol=1e-5)


@pytest.mark.parametrize("skips,pool", [(False, "all"), (True, "all"), (True, "fewer_slots")])
@pytest.mark.parametrize("block_m,tail_m,tails_first", [(16, 0, False), (8, 4, True)], ids=["padded", "tails_first"])
@pytest.mark.parametrize("path", ["single_program", "multi_program"])
@pytest.mark.parametrize("case", ROUTING_CASES[:3] + ROUTING_CASES[-3:], ids=lambda c: c.name)
def test_align_picks_kernels(case, path, block_m, tail_m, tails_first, skips, pool, package_factory, monkeypatch):
    """The routing kernels lay out picks the caller chose (fused_experts, the offload runtime's
    slots) as routed ones: int64 ids, about a third skipped (SKIPPED_PICK, placed nowhere) and
    a pool of fewer slots than the spec's experts."""
    from moegen.runtime import fused

    monkeypatch.setattr(fused, "_route_align_override", lambda: 1 << 20 if path == "single_program" else 0)
    ks = package_factory(**case.model).KERNELS
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + 2)
    slots = ks.num_experts if pool == "all" else max(ks.top_k, ks.num_experts // 2)
    ids = torch.stack([torch.randperm(slots, generator=generator)[:ks.top_k] for _ in range(case.tokens)])
    expected = ids.reshape(-1).clone()
    if skips:
        skipped = torch.rand(ids.shape, generator=generator) < 1 / 3
        ids = ids.masked_fill(skipped, fused.SKIPPED_PICK)
        expected = expected.masked_fill(skipped.reshape(-1), -1)
    weights = torch.rand(ids.numel(), generator=generator).to(DEVICE)
    aligned = fused.align_picks(ks, ids.to(DEVICE), weights, block_m, tail_m, tails_first)
    _check_layout(aligned, expected, ks.num_experts, block_m, tail_m, tails_first=tails_first)


TILE_ROWS = (1, 2, 4, 8, 16)  # the routing tiles' token rows the runtime sizes


@pytest.mark.parametrize("model,expected", [
    (dict(num_experts=160, top_k=6, n_group=8, topk_group=3), (1, 4, 4, 8, 16)),
    (dict(num_experts=64, top_k=8, n_group=8, topk_group=3), (1, 16, 16, 16, 16)),
    (dict(num_experts=32, top_k=4, n_group=8, topk_group=2), (1, 16, 16, 16, 16)),
    (dict(num_experts=256, top_k=8, n_group=8, topk_group=4, scoring="sigmoid", correction_bias=True), TILE_ROWS),
    (dict(num_experts=160, top_k=6), TILE_ROWS),
], ids=["grouped_unbiased_160", "grouped_unbiased_64", "grouped_unbiased_32", "grouped_biased",
        "ungrouped"])
def test_routing_tiles_avoid_rows_triton_computes_wrongly(model, expected, package_factory):
    """Group-limited routing without a bias gets token tiles of one row, 16 rows, or at least 1024
    elements (Triton 3.6 picks experts twice in some smaller ones on sm_90): in the count kernel,
    the single program and the decode kernel; other routings keep the sizes picked."""
    from moegen.runtime import fused

    ks = package_factory(**dict(BASE, **model)).KERNELS
    assert tuple(fused.route_tile_rows(ks, r) for r in TILE_ROWS) == expected
    tiles = {fused.multi_route_launch(ks)[0]["BLOCK_T"]}
    tiles |= {fused.single_route_launch(ks, t)["BLOCK_T"] for t in range(1, 9)}
    tiles |= {fused.decode_block_t(ks, t) for t in range(1, fused.DECODE_MAX_TOKENS + 1)}
    assert all(fused.route_tile_rows(ks, rows) == rows for rows in tiles)  # every tile launched is one it allows


@pytest.mark.parametrize("experts,knob,expected", [(8, None, 8), (128, None, 8), (256, None, 4), (2048, None, 0),
                                                    (256, 16, 16), (8, 0, 0)])
def test_single_program_routing_threshold(experts, knob, expected, monkeypatch):
    """The single routing program takes up to 8 tokens and 1024 router scores; the knob overrides."""
    from moegen import knobs
    from moegen.runtime import fused

    with knobs.scope(MOEGEN_ROUTE_ALIGN_MAX_TOKENS=None if knob is None else str(knob)):
        override = knobs.route_align_max_tokens()
    monkeypatch.setattr(fused, "_route_align_override", lambda: override)
    assert fused.single_route_max_tokens(experts) == expected


@pytest.mark.parametrize("skips", [False, True], ids=["all", "skips"])
@pytest.mark.parametrize("group_m", [1, 4])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tail_m,tails_first", [(0, False), (16, False), (16, True)],
                         ids=["padded", "tail_rows", "tails_first"])
@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 6, 2, 16), (33, 5, 3, 16), (64, 8, 2, 32), (5, 128, 8, 16),
                                                          (150, 4, 1, 32), (700, 3, 1, 16)])
def test_alignment_groups_and_pads(tokens, experts, top_k, block_m, tail_m, tails_first, ids_dtype, group_m, skips):
    """The caller-routing layout; runs of up to ~15 and of more than RUN_WRAP blocks (700 tokens
    on 3 experts); groups of 1 carry only the expert in the blocks' words. With skips, about a
    third of the picks are SKIPPED_PICK (the offload runtime's groups): left out, and counted by
    no run."""
    from moegen.runtime.fused import SKIPPED_PICK

    generator = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(ids_dtype)
    expected = ids.reshape(-1).long()
    if skips:
        skipped = torch.rand(ids.shape, generator=generator) < 1 / 3
        ids = ids.masked_fill(skipped, SKIPPED_PICK)
        expected = expected.masked_fill(skipped.reshape(-1), -1)
    _check_layout(align_tokens(ids, experts, block_m, tail_m, group_m, tails_first, skips), expected, experts,
                  block_m, tail_m, run_words=group_m > 1, tails_first=tails_first)


# Each has experts with just over one 32-row block (a remainder of at most 16: tail rows).
TAIL_CASES = [c for c in CASES if c.name in ("beyond_single_program_routing", "all_on_one_expert")] + [
    Case("tail_rows_most_experts", 90, BASE),
    Case("tail_rows_fp16_gelu", 100, dict(BASE, hidden_size=64, intermediate_size=48, num_experts=5,
                                          activation="gelu", dtype="float16")),
    Case("tail_rows_grouped", 120, GROUPED),
]
TAILS_OF_BOTH_WIDTHS = ("tail_rows_grouped",)


@pytest.mark.parametrize("split,tails_first", [(False, False), (True, False), (False, True)],
                         ids=["whole_tail", "tail_split", "tails_first"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda c: c.name)
def test_tail_rows(case, tma, split, tails_first, package_factory):
    """Blocks carrying their expert's last rows as tail rows (swapped MMAs in both GEMMs), routed
    by the kernels and by the caller; split-K on the descriptor path; with tail_split, remainders
    that fit half the tail take the half-width MMA; with tails_first, the runs with tails lead."""
    from dataclasses import replace

    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + tma)
    x, logits, w13, w2, bias = _inputs(case, pkg, generator)
    config = replace(pkg.KERNELS.config_for(case.tokens), block_m=32, tail_m=16, tma=tma, split_k=1 + tma,
                     block_n=16, block_k=32, down_block_n=32, down_block_k=16, decode_block_n=0, tail_split=split,
                     tails_first=tails_first)
    _, ids, _ = ref.route_reference(logits, pkg.KERNELS.routing, bias)
    counts = torch.bincount(ids.reshape(-1), minlength=pkg.SPEC.model.num_experts)
    remainder = torch.where(counts > 32, counts % 32, 0)
    assert bool(((remainder > 0) & (remainder <= 16)).any())  # some expert takes tail rows
    if case.name in TAILS_OF_BOTH_WIDTHS:  # split: some fit the half tail, some take it whole
        assert bool(((remainder > 0) & (remainder <= 8)).any()) and bool(((remainder > 8) & (remainder <= 16)).any())
    _check_both_routings(pkg, x, logits, w13, w2, bias, config)


HALF_BLOCK_CASES = [c for c in CASES if c.name in ("beyond_single_program_routing", "all_on_one_expert")] + [
    Case("half_blocks_mixed", 50, BASE),
    Case("half_blocks_fp16_gelu", 40, dict(BASE, hidden_size=64, intermediate_size=48, num_experts=5,
                                           activation="gelu", dtype="float16")),
]


@pytest.mark.parametrize("tail_m,streams", [(0, 1), (8, 1), (0, 2)], ids=["padded", "tail_rows", "two_streams"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("case", HALF_BLOCK_CASES, ids=lambda c: c.name)
def test_half_blocks(case, tma, tail_m, streams, package_factory):
    """Blocks whose rows fit in their first half multiply only that half (32-row blocks: runs of
    1-16 rows, and the last blocks of longer runs), beside full blocks and blocks with tail rows,
    in two-stream halves; routed by the kernels and by the caller."""
    from dataclasses import replace

    pkg = package_factory(**case.model)
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + 3 * tma + tail_m + streams)
    x, logits, w13, w2, bias = _inputs(case, pkg, generator)
    config = replace(pkg.KERNELS.config_for(case.tokens), block_m=32, tail_m=tail_m, half_blocks=True, tma=tma,
                     streams=streams, split_k=1 + tma, block_n=16, block_k=32, down_block_n=32, down_block_k=16,
                     decode_block_n=0, tail_split=False, tails_first=False)
    _, ids, _ = ref.route_reference(logits, pkg.KERNELS.routing, bias)
    counts = torch.bincount(ids.reshape(-1), minlength=pkg.SPEC.model.num_experts)
    last_block_rows = (counts - 1) % 32 + 1
    assert bool(((counts > 0) & (last_block_rows <= 16)).any()) and bool((counts > 16).any())  # half and full
    _check_both_routings(pkg, x, logits, w13, w2, bias, config)


def test_layer_loads_mixtral_and_deepseek_checkpoints(package_factory):
    for names, model in ((("w1", "w3", "w2"), BASE),
                         (("gate_proj", "up_proj", "down_proj"),
                          dict(GROUPED, num_shared_experts=2, shared_intermediate_size=8))):
        pkg = package_factory(**model)
        m = pkg.SPEC.model
        g = torch.Generator().manual_seed(3)
        h, i = m.hidden_size, m.intermediate_size
        sd = {"mlp.gate.weight": torch.randn(m.num_experts, h, generator=g)}
        for e in range(m.num_experts):
            sd[f"mlp.experts.{e}.{names[0]}.weight"] = torch.randn(i, h, generator=g) * h ** -0.5
            sd[f"mlp.experts.{e}.{names[1]}.weight"] = torch.randn(i, h, generator=g) * h ** -0.5
            sd[f"mlp.experts.{e}.{names[2]}.weight"] = torch.randn(h, i, generator=g) * i ** -0.5
        shared = m.num_shared_experts * m.shared_intermediate_size
        if m.correction_bias:
            sd["mlp.gate.e_score_correction_bias"] = torch.rand(m.num_experts, generator=g) * 0.1
        if shared:
            sd["mlp.shared_experts.gate_proj.weight"] = torch.randn(shared, h, generator=g) * h ** -0.5
            sd["mlp.shared_experts.up_proj.weight"] = torch.randn(shared, h, generator=g) * h ** -0.5
            sd["mlp.shared_experts.down_proj.weight"] = torch.randn(h, shared, generator=g) * shared ** -0.5
        layer = pkg.MoELayer(device=DEVICE)
        layer.load_hf_state_dict(sd, prefix="mlp.")
        x = torch.randn(2, 3, h, generator=g).to(DEVICE)
        with torch.no_grad():
            out = layer(x)
        flat = x.reshape(-1, h).cpu()  # the reference runs where the checkpoint is
        w13 = torch.stack([torch.cat([sd[f"mlp.experts.{e}.{names[0]}.weight"], sd[f"mlp.experts.{e}.{names[1]}.weight"]])
                           for e in range(m.num_experts)])
        w2 = torch.stack([sd[f"mlp.experts.{e}.{names[2]}.weight"] for e in range(m.num_experts)])
        bias = sd.get("mlp.gate.e_score_correction_bias")
        expected = ref.moe_reference(flat, flat @ sd["mlp.gate.weight"].T, w13, w2, pkg.KERNELS.routing,
                                     m.activation, bias)
        if shared:
            expected = expected + ref.gated_mlp_reference(
                flat, torch.cat([sd["mlp.shared_experts.gate_proj.weight"], sd["mlp.shared_experts.up_proj.weight"]]),
                sd["mlp.shared_experts.down_proj.weight"], m.activation)
        assert out.shape == x.shape
        assert ref.relative_error(out.reshape(-1, h).cpu(), expected) <= 1e-4


def _mixtral_checkpoint(model: dict) -> dict:
    e, h, i = model["num_experts"], model["hidden_size"], model["intermediate_size"]
    sd = {"gate.weight": torch.randn(e, h)}
    for x in range(e):
        sd |= {f"experts.{x}.w1.weight": torch.randn(i, h), f"experts.{x}.w3.weight": torch.randn(i, h),
               f"experts.{x}.w2.weight": torch.randn(h, i)}
    return sd


def _stacked(sd: dict, down: bool = True) -> dict:
    """The checkpoint's experts stacked as a transformers 5 module holds them."""
    e = sum(k.endswith(".w1.weight") for k in sd)
    stacked = {"gate.weight": sd["gate.weight"],
               "experts.gate_up_proj": torch.stack([torch.cat([sd[f"experts.{x}.w1.weight"], sd[f"experts.{x}.w3.weight"]])
                                                    for x in range(e)])}
    if down:
        stacked["experts.down_proj"] = torch.stack([sd[f"experts.{x}.w2.weight"] for x in range(e)])
    return stacked


BAD_CHECKPOINTS = [  # (case, how BASE's checkpoint is spoiled, the error expected)
    ("no_experts", lambda sd: {"gate.weight": sd["gate.weight"]},
     (KeyError, "experts.0.w1.weight, experts.0.gate_proj.weight nor experts.gate_up_proj")),
    ("one_expert_missing", lambda sd: {k: v for k, v in sd.items() if not k.startswith("experts.5.")},
     (KeyError, r"no 'experts.5.w1.weight' \(prefix ''\) and 2 more")),
    ("down_transposed", lambda sd: sd | {"experts.3.w2.weight": sd["experts.3.w2.weight"].T},
     (ValueError, r"experts.3.w2.weight: expected shape \[40, 24\], got \[24, 40\]")),
    ("gate_broadcastable", lambda sd: sd | {"gate.weight": sd["gate.weight"][:1]},
     (ValueError, r"gate.weight: expected shape \[6, 40\], got \[1, 40\]")),
    ("extra_key", lambda sd: sd | {"experts.6.w1.weight": sd["experts.0.w1.weight"]},
     (KeyError, r"does not use: \['experts.6.w1.weight'\]")),
    ("stacked_without_down", lambda sd: _stacked(sd, down=False), (KeyError, r"no 'experts.down_proj'")),
    ("stacked_down_transposed", lambda sd: _stacked(sd) | {"experts.down_proj": _stacked(sd)["experts.down_proj"].mT},
     (ValueError, r"experts.down_proj: expected shape \[6, 40, 24\], got \[6, 24, 40\]")),
    ("stacked_and_per_expert", lambda sd: sd | _stacked(sd), (KeyError, r"does not use: \['experts.0.w1.weight'")),
    ("not_a_mapping", lambda sd: list(sd.items()), (TypeError, r"state_dict: expected a mapping of names to tensors")),
    # right shapes, but nothing to copy from: checked before any tensor is copied
    ("meta_tensor", lambda sd: sd | {"experts.5.w2.weight": torch.empty(40, 24, device="meta")},
     (TypeError, r"experts.5.w2.weight: a tensor without data \(device meta\)")),
    ("numpy_array", lambda sd: sd | {"experts.5.w2.weight": sd["experts.5.w2.weight"].numpy()},
     (TypeError, r"experts.5.w2.weight: expected a torch.Tensor, got ndarray")),
    ("complex", lambda sd: sd | {"experts.5.w2.weight": sd["experts.5.w2.weight"].to(torch.complex64)},
     (TypeError, r"experts.5.w2.weight: expected real floating-point weights, got torch.complex64")),
]


@pytest.mark.parametrize("case,spoil,error", BAD_CHECKPOINTS, ids=[c[0] for c in BAD_CHECKPOINTS])
def test_layer_rejects_a_checkpoint_that_does_not_fit_and_keeps_its_weights(case, spoil, error, package_factory):
    layer = package_factory(**BASE).MoELayer(device=DEVICE)
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    with pytest.raises(error[0], match=error[1]):
        layer.load_hf_state_dict(spoil(_mixtral_checkpoint(BASE)))
    assert all(torch.equal(p, before[name]) for name, p in layer.named_parameters())
    layer.load_hf_state_dict(_mixtral_checkpoint(BASE))  # the unspoiled checkpoint loads


BAD_INPUTS = [  # (case, the argument changed, how, the message expected); BASE's shapes, 3 tokens
    ("hidden_states_1d", "x", lambda t: t[0], r"hidden_states: expected shape \[T, 40\], got \[40\]"),
    ("hidden_size", "x", lambda t: t[:, :-1], r"hidden_states: expected shape \[3, 40\], got \[3, 39\]"),
    ("hidden_dtype", "x", lambda t: t.half(), r"hidden_states: expected dtype torch.float32, got torch.float16"),
    ("w13_one_half", "w13", lambda t: t[:, :24], r"w13: expected shape \[6, 48, 40\], got \[6, 24, 40\]"),
    ("w2_transposed", "w2", lambda t: t.transpose(1, 2), r"w2: expected shape \[6, 40, 24\], got \[6, 24, 40\]"),
    ("logits_experts", "logits", lambda t: t[:, :-1], r"router_logits: expected shape \[3, 6\], got \[3, 5\]"),
    ("ids_top_k", "ids", lambda t: t[:, :1], r"topk_ids: expected shape \[3, 2\], got \[3, 1\]"),
    ("weights_tokens", "weights", lambda t: t[:2], r"topk_weights: expected shape \[3, 2\], got \[2, 2\]"),
    ("logits_complex", "logits", lambda t: t.to(torch.complex64),
     r"router_logits: expected a floating-point dtype, got torch.complex64"),
    ("ids_bool", "ids", lambda t: t > 2, r"topk_ids: expected an integer dtype, got torch.bool"),
    ("ids_float", "ids", lambda t: t.float(), r"topk_ids: expected an integer dtype, got torch.float32"),
    ("weights_int", "weights", lambda t: t.long(), r"topk_weights: expected a floating-point dtype, got torch.int64"),
    ("bias_without_one", "bias", lambda t: t, r"correction_bias: this spec routes without one"),
]
NOT_TENSORS = [("hidden_states", "x"), ("router_logits", "logits"), ("w13", "w13"), ("topk_ids", "ids")]


@pytest.mark.parametrize("name,argument", NOT_TENSORS)
def test_arguments_that_are_no_tensors_are_named(name, argument, package_factory):
    pkg = package_factory(**BASE)
    e, h, i, k = BASE["num_experts"], BASE["hidden_size"], BASE["intermediate_size"], BASE["top_k"]
    args = dict(x=torch.randn(3, h), logits=torch.randn(3, e), weights=torch.rand(3, k),
                ids=torch.randint(0, e, (3, k)), w13=torch.randn(e, 2 * i, h), w2=torch.randn(e, h, i))
    args = {n: t.to(DEVICE) for n, t in args.items()}
    args[argument] = args[argument].cpu().numpy()
    with pytest.raises(TypeError, match=f"{name}: expected a torch.Tensor, got ndarray"):
        if argument == "ids":
            pkg.fused_experts(args["x"], args["weights"], args["ids"], args["w13"], args["w2"])
        else:
            pkg.fused_moe(args["x"], args["logits"], args["w13"], args["w2"])


@pytest.mark.parametrize("case,argument,change,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_are_named_before_any_launch(case, argument, change, message, package_factory):
    """A wrong shape or dtype names the argument, what it should be and what it is."""
    pkg = package_factory(**BASE)
    e, h, i, k = BASE["num_experts"], BASE["hidden_size"], BASE["intermediate_size"], BASE["top_k"]
    args = dict(x=torch.randn(3, h), logits=torch.randn(3, e), weights=torch.rand(3, k),
                ids=torch.randint(0, e, (3, k)), w13=torch.randn(e, 2 * i, h), w2=torch.randn(e, h, i),
                bias=torch.zeros(e))
    args = {name: change(t) if name == argument else t for name, t in args.items()}
    args = {name: t.to(DEVICE) for name, t in args.items()}
    with pytest.raises(ValueError, match=message):
        if argument in ("ids", "weights"):
            pkg.fused_experts(args["x"], args["weights"], args["ids"], args["w13"], args["w2"])
        else:
            bias = args["bias"] if argument == "bias" else None
            pkg.fused_moe(args["x"], args["logits"], args["w13"], args["w2"], correction_bias=bias)


LAYER_BAD_INPUTS = [  # (case, MoELayer keyword arguments, hidden_states shape and dtype, message); BASE: H=40, fp32
    ("layer_dtype", dict(dtype=torch.float16), None, r"dtype torch.float16: this package's kernels are compiled for "
                                                     r"torch.float32"),
    ("input_dtype", {}, ((3, 40), torch.float16), r"hidden_states: expected \[\.\.\., 40\] torch.float32, got \[3, 40\] "
                                                   r"torch.float16"),
    ("input_width", {}, ((3, 41), torch.float32), r"hidden_states: expected \[\.\.\., 40\] torch.float32, got \[3, 41\]"),
    ("input_scalar", {}, ((), torch.float32), r"hidden_states: expected \[\.\.\., 40\] torch.float32, got \[\]"),
    ("layer_converted", dict(convert=torch.float64), ((3, 40), torch.float32),
     r"w13 is torch.float64: this package's kernels take torch.float32; do not convert the layer"),
]


@pytest.mark.parametrize("case,kwargs,x,message", LAYER_BAD_INPUTS, ids=[c[0] for c in LAYER_BAD_INPUTS])
def test_layer_names_what_it_cannot_run(case, kwargs, x, message, package_factory):
    """Before the router's matmul would fail with torch's words, or the kernels with theirs."""
    pkg = package_factory(**BASE)
    convert = kwargs.pop("convert", None)
    with pytest.raises(ValueError, match=message):
        layer = pkg.MoELayer(device=DEVICE, **kwargs)
        layer = layer.to(convert) if convert is not None else layer
        layer(torch.randn(x[0]).to(x[1]).to(DEVICE))


def test_layer_built_on_meta_runs_once_materialized(package_factory):
    """Deferred initialization: a layer built on the meta device names what it lacks, then runs
    once moved to real memory and loaded."""
    pkg = package_factory(**BASE)
    layer = pkg.MoELayer(device="meta")
    with pytest.raises(ValueError, match=r"on the meta device \(shapes without data\).*to_empty"):
        layer(torch.randn(3, 40, device="meta"))
    layer.to_empty(device=DEVICE)
    checkpoint = _mixtral_checkpoint(BASE)
    layer.load_hf_state_dict(checkpoint)
    x = torch.randn(3, 40)
    with torch.no_grad():
        out = layer(x.to(DEVICE)).cpu()
    w13 = torch.stack([torch.cat([checkpoint[f"experts.{e}.w1.weight"], checkpoint[f"experts.{e}.w3.weight"]])
                       for e in range(6)])
    w2 = torch.stack([checkpoint[f"experts.{e}.w2.weight"] for e in range(6)])
    expected = ref.moe_reference(x, x @ checkpoint["gate.weight"].T, w13, w2, pkg.KERNELS.routing, "silu")
    assert ref.relative_error(out, expected) <= TOLERANCE["float32"]


@pytest.mark.parametrize("router_dtype", [None, "float32"])
def test_layer_routes_from_logits_in_the_router_dtype(router_dtype, package_factory, monkeypatch):
    """DeepSeek's routers run in float32 beside float16/bf16 experts: the logits the kernels get
    are the float32 matmul's, also after a whole-layer .to() has converted the gate."""
    from moegen.runtime import fused

    pkg = package_factory(**dict(BASE, dtype="float16"), **({"router_dtype": router_dtype} if router_dtype else {}))
    layer = pkg.MoELayer(device=DEVICE)
    want = torch.float32 if router_dtype else torch.float16
    assert layer.gate.weight.dtype == want
    seen = []
    real = fused.fused_moe
    monkeypatch.setattr(fused, "fused_moe", lambda ks, x, logits, *a, **k: seen.append(logits) or real(ks, x, logits, *a, **k))
    x = torch.randn(5, 40).to(DEVICE, torch.float16)
    for converted in (layer, layer.to(torch.float16)):
        with torch.no_grad():
            converted(x)
        logits = seen.pop()
        assert logits.dtype == want
        assert torch.equal(logits, torch.nn.functional.linear(x.to(want), layer.gate.weight.to(want)))


def test_layer_is_for_inference(package_factory):
    """The kernels have no backward: the layer's parameters ask for none, rather than being
    handed a gradient that silently leaves the experts out."""
    layer = package_factory(**BASE).MoELayer(device=DEVICE)
    assert [name for name, p in layer.named_parameters() if p.requires_grad] == []


NON_FINITE = {"nan_row": lambda row: row.fill_(float("nan")), "nan_one": lambda row: row[1:2].fill_(float("nan")),
              "inf_one": lambda row: row[2:3].fill_(float("inf")), "minus_inf_row": lambda row: row.fill_(float("-inf"))}


@pytest.mark.parametrize("tokens", [1, 20, 300], ids=["decode_kernel", "single_program", "multi_program"])
@pytest.mark.parametrize("kind", sorted(NON_FINITE))
@pytest.mark.parametrize("model", [BASE, GROUPED], ids=["softmax", "grouped_correction_bias"])
def test_non_finite_logits_spoil_only_their_token(model, kind, tokens, package_factory):
    """An upstream NaN or infinity in one token's logits (routing it is undefined) must not make
    the routing pick an expert out of range, nor touch the other tokens' outputs."""
    from moegen.runtime import fused

    pkg = package_factory(**model)
    case = Case(kind, tokens, model)
    x, logits, w13, w2, bias = _inputs(case, pkg, torch.Generator().manual_seed(zlib.crc32(kind.encode()) + tokens))
    NON_FINITE[kind](logits[0])
    cfg = pkg.KERNELS.config_for(tokens)
    _, aligned = fused.route_and_align(pkg.KERNELS, logits, bias, cfg.block_m, cfg.tail_m, cfg.tails_first)
    used = aligned.block_runs[:int(aligned.num_padded) // cfg.block_m] & EXPERT_MASK
    assert bool((used >= 0).all()) and bool((used < pkg.KERNELS.num_experts).all())
    out = pkg.fused_moe(x, logits, w13, w2, correction_bias=bias)
    if tokens > 1:
        expected = ref.moe_reference(x[1:], logits[1:], w13, w2, pkg.KERNELS.routing, pkg.SPEC.model.activation,
                                     bias)
        assert ref.relative_error(out[1:], expected) <= TOLERANCE[pkg.SPEC.model.dtype]


@pytest.mark.parametrize("tokens, ids_dtype, repeated", [(1, torch.int32, False), (3, torch.int64, False),
                                                         (8, torch.int32, False), (2, torch.int32, True)])
def test_fused_experts_takes_the_decode_kernel_for_decode_batches(tokens, ids_dtype, repeated, package_factory,
                                                                   monkeypatch):
    """Callers who route themselves (fused_experts, the offload runtime) run a decode batch in one
    launch, as fused_moe does: the decode kernel reads their picks (any integer dtype; a pick
    repeated within a token counts twice) instead of routing."""
    from moegen.runtime import fused, launch

    pkg = package_factory(hidden_size=40, intermediate_size=24, num_experts=6, top_k=2, dtype="float32",
                          buckets=(1, 4, 8, 64))
    config = replace(pkg.KERNELS.config_for(1), decode_block_n=32, decode_block_k=64, decode_block_h=64)
    assert fused.uses_decode(config, tokens)
    launched = []
    real = launch.launch
    monkeypatch.setattr(fused, "launch", lambda kernel, *a, **k: (launched.append(kernel), real(kernel, *a, **k))[1])
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 40, generator=generator).to(DEVICE)
    w13 = (torch.randn(6, 48, 40, generator=generator) * 40 ** -0.5).to(DEVICE)
    w2 = (torch.randn(6, 40, 24, generator=generator) * 24 ** -0.5).to(DEVICE)
    ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(tokens)])
    if repeated:
        ids[:, 1] = ids[:, 0]
    ids = ids.to(ids_dtype).to(DEVICE)
    weights = torch.rand(tokens, 2, generator=generator).to(DEVICE)
    out = fused.fused_experts(pkg.KERNELS, x, weights, ids, w13, w2, config=config)
    assert launched == [pkg.KERNELS.decode_routed, pkg.KERNELS.decode_finish]
    expected = ref.experts_reference(x, weights, ids, w13, w2, "silu")
    assert ref.relative_error(out, expected) <= TOLERANCE["float32"]
