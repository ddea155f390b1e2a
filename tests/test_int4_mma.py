"""The Gluon int4 decode kernel (moegen/runtime/int4_mma.py) as a choice of the pipeline: where a
config may take it, what the tuner offers, what a caller's config is refused for, and that the
shipped entries that take it compile for sm_90 with their operands in place. Its numerics run on
the GPU only (Gluon has no interpreter): tests/test_quantized.py's decode-tile test checks every
tile the tuner tries there, and tests/test_build.py replays its first and direct launches."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moegen.ir import KernelSignature
from moegen.plan.configs import violation
from moegen.quant.formats import scale_arguments
from moegen.quant.quantize import quantize, quantize_w13
from moegen.runtime.fused import DECODE_MAX_TOKENS, KernelConfig, fused_moe
from moegen.target import lookup_gpu
from moegen.tune.space import decode_candidates, stagger_candidates

H100 = lookup_gpu("h100")
TUNED = Path(__file__).resolve().parents[1] / "tuned"
QWEN3_INT4 = KernelSignature(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8, activation="silu",
                             dtype="bfloat16", quantization="int4_group", group_size=128)
THREE_KERNELS = KernelConfig(block_m=16, group_m=1, block_n=64, block_k=128, num_warps=4, num_stages=4,
                             down_block_n=64, down_block_k=128, down_num_warps=4, down_num_stages=4)
GLUON = replace(THREE_KERNELS, decode_block_n=128, decode_block_k=128, decode_block_h=256, decode_num_warps=8,
                decode_num_stages=1, decode_int4_mma=True)


@pytest.mark.parametrize("signature, config, problem", [
    (QWEN3_INT4, GLUON, None),
    (replace(QWEN3_INT4, zero_point=True), GLUON, None),
    (replace(QWEN3_INT4, hidden_size=640, intermediate_size=1280, num_experts=8, top_k=2), GLUON,
     "decode_block_h a divisor of 640"),
    (replace(QWEN3_INT4, dtype="float16"), GLUON, "in a bfloat16 model: off for int4_group (group 128) in float16"),
    (replace(QWEN3_INT4, group_size=64), GLUON, "groups of 128 in a bfloat16 model: off for int4_group (group 64)"),
    (replace(QWEN3_INT4, quantization="fp8_block", group_size=0), GLUON, "off for fp8_block"),
    (replace(QWEN3_INT4, activation="gelu"), GLUON, "computes silu(gate) * up: off for activation gelu"),
    (replace(QWEN3_INT4, intermediate_size=800), GLUON, "multiples of 128"),
    (QWEN3_INT4, replace(GLUON, decode_block_n=32), "decode_block_n one of (64, 128)"),
    (QWEN3_INT4, replace(GLUON, decode_block_k=64), "decode_block_k 128"),
    (QWEN3_INT4, replace(GLUON, decode_block_n=64), "multiples of 16 rows a warp (128)"),
    (QWEN3_INT4, replace(GLUON, decode_block_n=0), "needs decode_block_n"),
    (QWEN3_INT4, replace(GLUON, decode_stagger_k=True), "without decode_stagger_k"),
], ids=["qwen3", "zero_points", "chunks_off_h", "float16", "group_64", "fp8", "gelu", "i_off_group", "narrow",
        "k_step", "rows_per_warp", "no_decode", "staggered"])
def test_the_gluon_kernel_applies_only_where_it_runs(signature, config, problem):
    found = violation(config, signature, H100)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found


@pytest.mark.parametrize("signature, offered", [(QWEN3_INT4, 4), (replace(QWEN3_INT4, zero_point=True), 4),
                                                (replace(QWEN3_INT4, dtype="float16"), 0),
                                                (replace(QWEN3_INT4, group_size=32), 0),
                                                (replace(QWEN3_INT4, quantization="none", group_size=0), 0)])
def test_the_tuner_offers_the_gluon_kernel_where_it_applies(signature, offered):
    candidates = decode_candidates(THREE_KERNELS, signature, H100, 1)
    gluon = [c for c in candidates if c.decode_int4_mma]
    assert len(gluon) == offered and len(candidates) > offered
    assert all(c.decode_block_k == 128 and c.decode_num_stages == 1 and c.key.endswith("s1m") for c in gluon)
    assert all(stagger_candidates(c, signature, H100) == [] for c in gluon)
    assert decode_candidates(THREE_KERNELS, signature, H100, DECODE_MAX_TOKENS + 1) == []
    assert GLUON.without_decode().key == THREE_KERNELS.key and not GLUON.without_decode().decode_int4_mma


@pytest.mark.parametrize("model, problem", [
    (dict(dtype="float16", router_dtype="float32"), "in a bfloat16 model: off for int4_group (group 128) in float16"),
    (dict(dtype="bfloat16", activation="gelu"), "computes silu(gate) * up: off for activation gelu")])
def test_a_callers_gluon_config_is_refused_where_it_would_compute_wrongly(model, problem, package_factory):
    pkg = package_factory(buckets=(1,), hidden_size=256, intermediate_size=128, num_experts=4, top_k=2,
                          quantization="int4_group", quantization_group_size=128, **model)
    ks = pkg.KERNELS
    fmt = ks.weight_format
    s13, s2 = quantize_w13(torch.randn(4, 256, 256), fmt), quantize(torch.randn(4, 256, 128), fmt)
    config = replace(ks.configs[0], decode_block_n=64, decode_block_k=128, decode_block_h=128, decode_num_warps=4,
                     decode_num_stages=1, decode_stagger_k=False, decode_int4_mma=True)
    x, logits = torch.randn(1, 256, dtype=ks.dtype), torch.randn(1, 4)
    with pytest.raises(ValueError, match=r"config does not suit this package's int4_group experts: .*" + re.escape(problem)):
        fused_moe(ks, x, logits, s13["weight"], s2["weight"], config=config, **scale_arguments(s13, s2))


_COMPILE_SHIPPED = """
from types import SimpleNamespace
import torch
from moegen.quant.formats import WeightFormat
from moegen.runtime.fused import KernelConfig, int4_mma_constexprs
from moegen.runtime.int4_mma import int4_decode_mma
for signature, config in {entries!r}:
    ks = SimpleNamespace(hidden_size=signature["hidden_size"], intermediate_size=signature["intermediate_size"],
                         top_k=signature["top_k"], weight_format=WeightFormat("int4_group", 128,
                                                                              signature["zero_point"]))
    zero = torch.uint8 if signature["zero_point"] else torch.bfloat16
    for tokens in (8, 16):
        int4_decode_mma.warmup(torch.bfloat16, torch.int32, torch.float32, torch.int32, torch.bfloat16, zero,
                               torch.int32, torch.bfloat16, zero, torch.float32, 1 << 20,
                               **int4_mma_constexprs(ks, KernelConfig(**config), tokens), grid=(1, 1))
"""


def test_the_shipped_gluon_entries_compile_for_hopper_with_their_operands_in_place(compile_sm90):
    """Each tuning file's entries that take the Gluon kernel, compiled for sm_90 with both token
    tiles: the dequantized tile must be the MMA's operand as loaded (the kernel's assert_trivial
    conversions fail the compile otherwise)."""
    entries = set()
    for path in sorted(TUNED.glob("*.json")):
        data = json.loads(path.read_text())
        for bucket in data["buckets"].values():
            if bucket["config"].get("decode_int4_mma"):
                entries.add((json.dumps(data["metadata"]["signature"], sort_keys=True),
                             json.dumps(bucket["config"], sort_keys=True)))
    if not entries:
        pytest.skip("no shipped entry takes the Gluon kernel")
    code = _COMPILE_SHIPPED.format(entries=[(json.loads(s), json.loads(c)) for s, c in sorted(entries)])
    ptx = compile_sm90(code)
    kernels = [name for name in ptx if name.endswith("int4_decode_mma.ptx")]
    # one kernel per shape, tile and token tile (entries may share them)
    variants = {(json.loads(s)["hidden_size"], json.loads(s)["intermediate_size"], json.loads(s)["top_k"],
                 json.loads(s)["zero_point"], json.loads(c)["decode_block_n"], json.loads(c)["decode_block_h"],
                 json.loads(c)["decode_num_warps"]) for s, c in entries}
    assert len(kernels) == 2 * len(variants), sorted(ptx)
    for name in kernels:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx[name], name
