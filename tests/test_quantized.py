"""Quantized experts (moegen/quant): the quantizer's round trip, and the fused kernels of every
weight format against the float64 reference applied to the dequantized weights (and, for fp8,
to the activations quantized as the kernels quantize them).

On the CPU the kernels run in Triton's interpreter at tiny shapes in float32 and float16 (the
interpreter computes bf16 dots wrongly); on a GPU (`-m gpu`) the shipped shapes in bf16. Inputs
are random, never zero; cases cover T=0, one token, the decode kernel and the three-kernel path,
all tokens on one expert, idle experts, and sizes off the block and off the group."""
from __future__ import annotations

import importlib
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from moegen import reference as ref
from moegen.quant.formats import WeightFormat, scale_arguments
from moegen.runtime.fused import fused_moe
from moegen.tune.space import decode_candidates
from moegen.ir import lower
import moegen.quant.quantize as quantize_module
from moegen.quant.quantize import dequantize, dequantize_w13, pack_int4, quantize, quantize_w13, unpack_int4

HAS_GPU = torch.cuda.is_available()
FORMATS = {  # name -> the spec's quantization fields
    "int4_g32": dict(quantization="int4_group", quantization_group_size=32),
    "int4_g64_zero": dict(quantization="int4_group", quantization_group_size=64, quantization_zero_point=True),
    "int4_g128": dict(quantization="int4_group", quantization_group_size=128),
    "int4_g128_zero": dict(quantization="int4_group", quantization_group_size=128, quantization_zero_point=True),
    "fp8_block": dict(quantization="fp8_block"),
    "fp8_channel": dict(quantization="fp8_channel"),
}


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _format(fields: dict, dtype: str) -> WeightFormat:
    int4 = fields["quantization"] == "int4_group"
    return WeightFormat(fields["quantization"], fields.get("quantization_group_size", 128) if int4 else 0,
                        fields.get("quantization_zero_point", False), dtype)


# ---------------------------------------------------------------------------------------------
# The quantizer and the storage layout


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_round_trip_is_within_the_format_step(name):
    fmt = _format(FORMATS[name], "float32")
    g = torch.Generator().manual_seed(_seed("round trip", name))
    w = torch.randn(3, 300, 200, generator=g)  # off every block and group
    stored = quantize(w, fmt)
    assert {k: tuple(v.shape) for k, v in stored.items()} == fmt.shapes(300, 200, 3)
    error = (dequantize(stored, fmt, 300, 200) - w.double()).abs()
    # Each weight within half a step of its block's, channel's or group's scale (int4: of 15 or 7 steps).
    if fmt.quantization == "int4_group":
        groups = torch.arange(200) // fmt.group_size
        step = stored["scale"].double()[:, :, groups]
        assert bool((error <= 0.5 * step * (1 + 1e-3) + 1e-7).all())
    else:
        assert ref.relative_error(dequantize(stored, fmt, 300, 200), w) < 0.04  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("name", FORMATS)
def test_a_few_experts_at_a_time_store_and_dequantize_as_all_at_once(name, monkeypatch):
    fmt = _format(FORMATS[name], "float32")
    w = torch.randn(5, 300, 200, generator=torch.Generator().manual_seed(_seed("chunks", name)))
    whole = quantize(w, fmt)
    monkeypatch.setattr(quantize_module, "QUANTIZE_CHUNK_ELEMENTS", 2 * 300 * 200)  # 2, 2, then 1
    chunked = quantize(w, fmt)
    assert chunked.keys() == whole.keys()
    assert all(torch.equal(chunked[k], whole[k]) for k in whole)
    # and dequantized the same way, into one tensor
    monkeypatch.undo()
    whole_w = dequantize(whole, fmt, 300, 200, torch.float32)
    monkeypatch.setattr(quantize_module, "QUANTIZE_CHUNK_ELEMENTS", 2 * 300 * 200)
    assert torch.equal(dequantize(whole, fmt, 300, 200, torch.float32), whole_w)


def test_int4_packing_puts_even_inputs_in_the_low_nibble():
    q = torch.tensor([[[1, 2, 3, 4, 5]]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[[0x21, 0x43, 0x05]]]
    assert unpack_int4(packed, 5).tolist() == q.tolist()


def test_fp8_block_w13_blocks_gate_and_up_apart():
    """I = 200 is not a multiple of 128: the up projection's blocks start at its own first row."""
    fmt = WeightFormat("fp8_block", dtype="float32")
    w13 = torch.randn(2, 400, 130)
    w13[:, 200:] *= 100  # the up rows' scales would spill into a shared block
    stored = quantize_w13(w13, fmt)
    assert tuple(stored["scale"].shape) == fmt.w13_shapes(130, 200, 2)["scale"] == (2, 4, 2)
    assert ref.relative_error(dequantize_w13(stored, fmt, 130, 200), w13) < 0.04


# ---------------------------------------------------------------------------------------------
# Kernels


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    routing: str = "random"  # random | one_expert (every token's first pick is expert 0)


CPU_CASES = [Case("empty", 0), Case("one_token", 1), Case("decode_batch", 5), Case("three_kernels", 20),
             Case("one_expert", 12, "one_expert")]
CPU_SHAPES = {"int4": dict(hidden_size=96, intermediate_size=80, num_experts=6, top_k=2),
              "fp8": dict(hidden_size=200, intermediate_size=160, num_experts=5, top_k=2)}  # off the 128 block
GPU_SHAPES = {"qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8),
              "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_experts=8, top_k=2),
              "olmoe-1b-7b": dict(hidden_size=2048, intermediate_size=1024, num_experts=64, top_k=8),
              "deepseek-v3": dict(hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8, scoring="sigmoid",
                                  n_group=8, topk_group=4, correction_bias=True, routed_scaling_factor=2.5)}


def _logits(case: Case, routing, tokens: int, generator, device, bias=None):
    logits = ref.separated_router_logits(tokens, routing, bias, generator=generator, device=device)
    if case.routing == "one_expert":
        logits[:, 0] = logits.max(dim=1).values + 4.0  # expert 0 first for all; the rest stay clear-cut
    return logits


def _stored_experts(pkg, seed: str, device: str, chunk: int = 16):
    """Random experts (normal, scaled by 1/sqrt(fan-in)) in the package's format, drawn and
    quantized `chunk` experts at a time (DeepSeek-V3's would not fit the GPU in float32 at once);
    and a function that gives expert e's unquantized weights again, drawn anew the same way."""
    m, fmt = pkg.SPEC.model, pkg.KERNELS.weight_format
    e, h, i = m.num_experts, m.hidden_size, m.intermediate_size

    def draw(first: int):
        g = torch.Generator(device=device).manual_seed(_seed(seed, first))
        count = min(chunk, e - first)
        return (torch.randn(count, 2 * i, h, generator=g, device=device) * h ** -0.5,
                torch.randn(count, h, i, generator=g, device=device) * i ** -0.5)

    parts13, parts2 = [], []
    for first in range(0, e, chunk):
        w13, w2 = draw(first)
        parts13.append(quantize_w13(w13, fmt))
        parts2.append(quantize(w2, fmt))
    s13 = {name: torch.cat([p[name] for p in parts13]) for name in parts13[0]}
    s2 = {name: torch.cat([p[name] for p in parts2]) for name in parts2[0]}
    return s13, s2, lambda expert: tuple(w[expert % chunk] for w in draw(expert // chunk * chunk))


def _check_format(pkg, fields: dict, case: Case, device: str, tolerance: float):
    """The case through fused_moe and fused_experts against the quantized reference; returns the
    relative error of the quantized layer against the unquantized one (the weights before
    quantization)."""
    m, ks = pkg.SPEC.model, pkg.KERNELS
    fmt = ks.weight_format
    g = torch.Generator().manual_seed(_seed(pkg.SPEC.name, case.name))
    s13, s2, unquantized = _stored_experts(pkg, f"{pkg.SPEC.name}/{case.name}", device)
    scales = scale_arguments(s13, s2)
    bias = ref.balanced_correction_bias(m.num_experts, device) if m.correction_bias else None
    x = torch.randn(case.tokens, m.hidden_size, generator=g).to(device=device, dtype=ks.dtype)
    logits = _logits(case, ks.routing, case.tokens, g, device, bias)
    out = pkg.fused_moe(x, logits, s13["weight"], s2["weight"], correction_bias=bias, **scales)
    assert out.shape == (case.tokens, m.hidden_size) and out.dtype == ks.dtype
    if case.tokens == 0:
        return None
    weights, ids, _ = ref.route_reference(logits, ks.routing, bias)
    expected = ref.quantized_experts_reference(x, weights, ids, s13, s2, fmt, m.activation)
    error = ref.relative_error(out, expected)
    assert error < tolerance, f"{fields}: relative error {error:.2e} > {tolerance}"
    # The same routing through fused_experts (the caller's top-k, as the offload runtime passes it).
    again = pkg.fused_experts(x, weights.to(torch.float32), ids.to(torch.int32), s13["weight"], s2["weight"], **scales)
    assert ref.relative_error(again, expected) < tolerance
    plain = torch.zeros_like(expected)
    for expert in torch.unique(ids).tolist():  # the unquantized layer, one expert at a time
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        w13, w2 = unquantized(expert)
        y = ref.gated_mlp_reference(x[rows], w13, w2, m.activation)
        plain.index_add_(0, rows, y * weights[rows, slots].unsqueeze(1))
    return ref.relative_error(out, plain)


@pytest.mark.skipif(HAS_GPU, reason="the interpreter cases: on a GPU the -m gpu cases run")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_quantized_kernels_match_the_reference_in_the_interpreter(fmt_name, dtype, case, package_factory):
    fields = FORMATS[fmt_name]
    shape = CPU_SHAPES["fp8" if fields["quantization"].startswith("fp8") else "int4"]
    pkg = package_factory(buckets=(1, 8, 64), dtype=dtype, router_dtype="float32", **shape, **fields)
    # Products of exact dequantized values: fp32 and fp16 arithmetic only (fp8 activations are exact).
    _check_format(pkg, fields, case, "cpu", 1e-5 if dtype == "float32" else 3e-3)


@pytest.mark.parametrize("fmt_name", ["int4_g32", "int4_g64_zero", "int4_g128"])
def test_int4_dequantizations_of_every_row_block_match_the_reference(fmt_name, package_factory):
    """int4 kernels dequantize a byte's two weights in one register through PTX in small row
    blocks, and in larger ones either the same steps in Triton ops (int4_pair_ops) or one weight
    at a time in float32 (weights_int4_group.jinja; the interpreter runs the ops for the PTX),
    each with its blocks multiplied as they are or swapped (int4_swapped): the same batch
    through each, against the reference (16-bit models: the choices exist for them only)."""
    from moegen.plan.configs import INT4_PTX_MAX_ROWS

    device, dtype = ("cuda", "bfloat16") if HAS_GPU else ("cpu", "float16")
    fields = FORMATS[fmt_name]
    pkg = package_factory(buckets=(1, 8, 64), dtype=dtype, router_dtype="float32", **CPU_SHAPES["int4"], **fields)
    ks, m = pkg.KERNELS, pkg.SPEC.model
    gate_up = importlib.import_module(ks.gate_up.fn.__module__)
    assert gate_up.INT4_PTX_MAX_ROWS.value == INT4_PTX_MAX_ROWS and 16 <= INT4_PTX_MAX_ROWS < 64
    s13, s2, _ = _stored_experts(pkg, f"both dequantizations/{fmt_name}", device)
    g = torch.Generator().manual_seed(_seed("both dequantizations", fmt_name))
    x = torch.randn(40, m.hidden_size, generator=g).to(device=device, dtype=ks.dtype)
    logits = _logits(Case("random", 40, "random"), ks.routing, 40, g, device)
    weights, ids, _ = ref.route_reference(logits, ks.routing, None)
    expected = ref.quantized_experts_reference(x, weights, ids, s13, s2, ks.weight_format, m.activation)
    plain = replace(ks.config_for(40), tail_m=0, tail_split=False, tails_first=False, half_blocks=False,
                    decode_block_n=0, streams=1)
    # Small blocks' half blocks and tail rows multiply swapped, the weight tile the left operand.
    for block_m, pair_ops, swapped, half, tail in ((16, False, False, False, 0), (32, False, False, True, 0),
                                                   (16, False, False, False, 16), (64, False, False, False, 0),
                                                   (64, True, False, False, 0), (64, False, True, False, 0),
                                                   (64, True, True, False, 0)):
        config = replace(plain, block_m=block_m, int4_pair_ops=pair_ops, int4_swapped=swapped, half_blocks=half,
                         tail_m=tail)
        out = fused_moe(ks, x, logits, s13["weight"], s2["weight"], config=config, **scale_arguments(s13, s2))
        assert ref.relative_error(out, expected) < (1.5e-2 if HAS_GPU else 3e-3), config.key


def test_a_quantized_package_names_missing_or_foreign_scales(package_factory):
    pkg = package_factory(buckets=(1,), dtype="float32", router_dtype="float32", **CPU_SHAPES["int4"],
                          **FORMATS["int4_g64_zero"])
    fmt, m = pkg.KERNELS.weight_format, pkg.SPEC.model
    s13 = quantize_w13(torch.randn(m.num_experts, 2 * m.intermediate_size, m.hidden_size), fmt)
    s2 = quantize(torch.randn(m.num_experts, m.hidden_size, m.intermediate_size), fmt)
    x, logits = torch.randn(1, m.hidden_size), torch.randn(1, m.num_experts)
    with pytest.raises(ValueError, match=r"w13_zero: missing; this package's experts are int4_group .*pass "
                                         r"w13_zero=\[6, 160, 2\] torch.uint8"):
        pkg.fused_moe(x, logits, s13["weight"], s2["weight"], w13_scale=s13["scale"], w2_scale=s2["scale"])
    with pytest.raises(ValueError, match=r"w2_scale: expected shape \[6, 96, 2\], got \[6, 96, 3\]"):
        pkg.fused_moe(x, logits, s13["weight"], s2["weight"], w13_scale=s13["scale"], w13_zero=s13["zero"],
                      w2_scale=torch.ones(6, 96, 3), w2_zero=s2["zero"])
    plain = package_factory(buckets=(1,), dtype="float32", router_dtype="float32", **CPU_SHAPES["int4"])
    with pytest.raises(ValueError, match="w13_scale: this package's experts are none, which has no such tensor"):
        plain.fused_moe(x, logits, torch.randn(6, 160, 96), torch.randn(6, 96, 80), w13_scale=s13["scale"])


def test_a_config_that_does_not_suit_the_format_is_refused(package_factory):
    pkg = package_factory(buckets=(1,), dtype="float16", router_dtype="float32", **CPU_SHAPES["fp8"],
                          **FORMATS["fp8_block"])
    ks = pkg.KERNELS
    s13, s2 = quantize_w13(torch.randn(5, 320, 200), ks.weight_format), quantize(torch.randn(5, 200, 160), ks.weight_format)
    x, logits = torch.randn(1, 200, dtype=torch.float16), torch.randn(1, 5)
    narrow = replace(ks.configs[0], decode_block_n=64, decode_block_k=128, decode_block_h=128)
    with pytest.raises(ValueError, match="decode_block_n 64 must be 128"):
        fused_moe(ks, x, logits, s13["weight"], s2["weight"], config=narrow, **scale_arguments(s13, s2))
    int4 = package_factory(buckets=(1,), dtype="float16", router_dtype="float32", **CPU_SHAPES["int4"],
                           **FORMATS["int4_g32"]).KERNELS
    s13, s2 = quantize_w13(torch.randn(6, 160, 96), int4.weight_format), quantize(torch.randn(6, 96, 80), int4.weight_format)
    x, logits = torch.randn(1, 96, dtype=torch.float16), torch.randn(1, 6)
    narrow = replace(int4.configs[0], decode_block_n=16, decode_block_k=32, decode_block_h=32)
    with pytest.raises(ValueError, match="decode_block_n 32 or more"):
        fused_moe(int4, x, logits, s13["weight"], s2["weight"], config=narrow, **scale_arguments(s13, s2))


GPU_T = (1, 2, 4, 7, 64, 1000, 4096)  # 2 and 4: the decode kernel's batch tiles (1 takes its own path)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
@pytest.mark.parametrize("shape,fmt_name,dtype", [
    *((shape, fmt_name, "bfloat16") for shape in GPU_SHAPES
      for fmt_name in ("int4_g128", "int4_g64_zero", "fp8_block", "fp8_channel")),
    # int4 dequantizes in f16x2 lanes for float16 models, bf16x2 for bfloat16 ones
    *(("qwen3-30b-a3b", fmt_name, "float16") for fmt_name in ("int4_g128", "int4_g64_zero"))])
def test_quantized_kernels_match_the_reference_on_the_gpu(shape, fmt_name, dtype, package_factory):
    fields = FORMATS[fmt_name]
    pkg = package_factory(buckets=(1, 8, 64, 1024, 4096), dtype=dtype, **GPU_SHAPES[shape], **fields)
    for tokens in GPU_T:
        for routing in ("random", "one_expert"):
            against_plain = _check_format(pkg, fields, Case(f"gpu{tokens}{routing}", tokens, routing), "cuda", 1.5e-2)
            print(f"{shape} {fmt_name} {dtype} T={tokens} {routing}: error against the unquantized layer "
                  f"{against_plain:.3f}")


@pytest.mark.parametrize("fmt_name", ["int4_g128", "int4_g128_zero", "int4_g64_zero", "fp8_block"])
def test_every_decode_tile_the_tuner_tries_matches_the_reference(fmt_name, package_factory):
    """The decode kernels at each tile the tuner tries for the format (a wrong candidate is only
    dropped by the tuner, and a tuning run on the H100 met one), routed by fused_moe, by the
    caller (fused_experts) and on an offload pool's slots with skipped picks: on a GPU at
    Qwen3-30B-A3B's shape in bf16 (int4 in groups of 128: the Gluon kernel's tiles too), with
    both of its token tiles; in the interpreter at a small shape in float16."""
    from moegen.runtime.fused import SKIPPED_PICK, fused_experts, fused_experts_on_slots

    fields = FORMATS[fmt_name]
    shape = GPU_SHAPES["qwen3-30b-a3b"] if HAS_GPU else dict(hidden_size=512, intermediate_size=256, num_experts=8,
                                                             top_k=2)
    # float16 in the interpreter: float32 tiles overflow the decode kernel's shared memory for fp8_block.
    dtype = dict(dtype="bfloat16") if HAS_GPU else dict(dtype="float16", router_dtype="float32")
    pkg = package_factory(buckets=(1, 8), **dtype, **shape, **fields)
    ks, ir = pkg.KERNELS, lower(pkg.SPEC, "decode-tiles.yaml")
    candidates = decode_candidates(ks.configs[0], ir.signature, ir.target, 1)
    assert len(candidates) > 1
    gluon = [c for c in candidates if c.decode_int4_mma]
    assert bool(gluon) == (HAS_GPU and fields.get("quantization_group_size") == 128), [c.key for c in gluon]
    device = "cuda" if HAS_GPU else "cpu"
    s13, s2, _ = _stored_experts(pkg, f"decode tiles {fmt_name}", device)
    scales = scale_arguments(s13, s2)
    g = torch.Generator().manual_seed(_seed("decode tiles", fmt_name))
    wrong = []
    for tokens in (1, 5, 9, 16) if HAS_GPU else (1, 5):
        x = torch.randn(tokens, shape["hidden_size"], generator=g).to(device=device, dtype=ks.dtype)
        logits = _logits(Case("decode", tokens), ks.routing, tokens, g, device)
        weights, ids, _ = ref.route_reference(logits, ks.routing, None)
        expected = ref.quantized_experts_reference(x, weights, ids, s13, s2, ks.weight_format, "silu")
        # A pool holding every expert in reverse order, and every third pick skipped.
        slots = shape["num_experts"] - 1 - ids
        skipped = torch.arange(ids.numel(), device=device).reshape(ids.shape) % 3 == 1
        slots = torch.where(skipped, SKIPPED_PICK, slots).to(torch.int32)
        kept = torch.where(skipped, 0.0, weights)
        expected_kept = ref.quantized_experts_reference(x, kept, ids, s13, s2, ks.weight_format, "silu")
        pools = {name: value.flip(0) for name, value in s13.items()}, {name: value.flip(0) for name, value in s2.items()}
        for config in candidates:
            outs = {"fused_moe": (fused_moe(ks, x, logits, s13["weight"], s2["weight"], config=config, **scales),
                                  expected),
                    "fused_experts": (fused_experts(ks, x, weights.float(), ids.to(torch.int32), s13["weight"],
                                                    s2["weight"], config=config, **scales), expected)}
            if tokens > 1:  # picks are skipped in batches of two tokens or more (fused_experts_on_slots)
                outs["slots"] = (fused_experts_on_slots(ks, x, weights.float(), slots, pools[0]["weight"],
                                                        pools[1]["weight"], config=config, skipped_picks=True,
                                                        **scale_arguments(*pools)), expected_kept)
            for path, (out, want) in outs.items():
                error = ref.relative_error(out, want)
                if not error < ref.TOLERANCE[pkg.SPEC.model.dtype]:
                    wrong.append(f"T={tokens} {path} {config.key}: relative error {error:.2e}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.skipif(HAS_GPU, reason="an interpreter case")
@pytest.mark.parametrize("fmt_name", ["int4_g64_zero", "fp8_block"])
def test_moe_layer_quantizes_an_unquantized_checkpoint_as_it_loads(fmt_name, package_factory):
    """MoELayer of a quantized package: a checkpoint's per-expert tensors go through the
    quantizer, and the layer runs on the stored tensors and their scales."""
    fields = FORMATS[fmt_name]
    shape = CPU_SHAPES["fp8" if fields["quantization"] == "fp8_block" else "int4"]
    pkg = package_factory(buckets=(1, 8), dtype="float32", router_dtype="float32", **shape, **fields)
    m, fmt = pkg.SPEC.model, pkg.KERNELS.weight_format
    e, h, i = m.num_experts, m.hidden_size, m.intermediate_size
    layer = pkg.MoELayer()
    assert layer.w13.dtype == (torch.uint8 if fmt.quantization == "int4_group" else torch.float8_e4m3fn)
    assert sorted(layer.expert_scales()) == sorted(["w13_scale", "w2_scale"] + (["w13_zero", "w2_zero"]
                                                                                  if fmt.zero_point else []))
    g = torch.Generator().manual_seed(_seed("layer", fmt_name))
    checkpoint = {"gate.weight": torch.randn(e, h, generator=g)}
    for expert in range(e):
        checkpoint |= {f"experts.{expert}.w1.weight": torch.randn(i, h, generator=g) * h ** -0.5,
                       f"experts.{expert}.w3.weight": torch.randn(i, h, generator=g) * h ** -0.5,
                       f"experts.{expert}.w2.weight": torch.randn(h, i, generator=g) * i ** -0.5}
    layer.load_hf_state_dict(checkpoint)
    w13 = torch.stack([torch.cat((checkpoint[f"experts.{x}.w1.weight"], checkpoint[f"experts.{x}.w3.weight"]))
                       for x in range(e)])
    w2 = torch.stack([checkpoint[f"experts.{x}.w2.weight"] for x in range(e)])
    s13, s2 = quantize_w13(w13, fmt), quantize(w2, fmt)
    assert torch.equal(layer.w13, s13["weight"]) and torch.equal(layer.w2_scale, s2["scale"])
    x = torch.randn(9, h, generator=g)
    out = layer(x)
    logits = x @ checkpoint["gate.weight"].T
    expected = ref.quantized_moe_reference(x, logits, s13, s2, fmt, pkg.KERNELS.routing, m.activation)
    assert ref.relative_error(out, expected) < 1e-5


def test_the_benchmark_workload_quantizes_each_buffer_once(package_factory):
    # gpu_check views the same layer buffers anew for every cell: the storage must follow the
    # buffers (no second copy of a layer's storage per cell), and other buffers get their own.
    from moegen.bench.cells import Workload

    pkg = package_factory(buckets=(1,), dtype="float32", router_dtype="float32", **CPU_SHAPES["int4"],
                          **FORMATS["int4_g32"])
    work = Workload(pkg, torch.device("cpu"), seed=_seed("workload"))
    first = work.stored(work.w13, work.w2)
    again = work.stored(work.w13.view(work.w13.shape), work.w2.view(work.w2.shape))
    assert all(a is b for a, b in zip(first, again))
    other = work.stored(work.w13.clone(), work.w2.clone())
    assert other[0] is not first[0] and torch.equal(other[0]["weight"], first[0]["weight"])
    assert len(work._stored) == 2
