"""The shared memory moegen/plan/configs.py counts for a config against what Triton allocates for
its kernels (compiled for sm_90 on the CPU): the count must never fall short, or the tuner would
offer configs that cannot launch. Weight tiles count at their stored bytes (int4 half a byte, fp8
one), so deeper pipelines fit where weights are quantized and stay refused for bf16."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

COMPILE = """
import dataclasses, json
from pathlib import Path
from moegen.package import build, precompile
from moegen.package.loader import load_package
from moegen.runtime.fused import KernelConfig
folder, _ = build({spec!r}, Path(tempfile.mkdtemp()))
ks = load_package(folder).KERNELS
precompile.compile_buckets(dataclasses.replace(ks, configs=(KernelConfig(**{config!r}),), buckets=({tokens},)))
shared = {{}}
for meta in Path(os.environ["TRITON_CACHE_DIR"]).rglob("moe_*.json"):
    name = "gate_up" if "gate_up" in meta.stem else "down" if "down_reduce" in meta.stem else None
    if name:
        shared[name] = max(shared.get(name, 0), json.loads(meta.read_text())["shared"])
Path({out!r}).write_text(json.dumps(shared))
"""

# (spec, tokens, fields replaced in the cost model's config): the deepest tiles each format's
# count allows among the tuner's candidates, and a default.
CASES = [
    ("qwen3-30b-a3b-int4", 1, dict(block_m=16, block_n=64, block_k=256, num_stages=4, down_block_k=512,
                                   down_num_stages=3)),
    ("mixtral-8x7b-int4", 64, dict(block_m=32, block_n=32, block_k=256, num_stages=6, down_block_k=512,
                                   down_num_stages=3)),
    ("qwen3-30b-a3b-int4", 512, dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                                     int4_pair_ops=True, tail_m=0, tail_split=False, tails_first=False,
                                     down_max_registers=0)),
    ("qwen3-30b-a3b-fp8", 4096, dict(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=5, tail_m=0,
                                     tail_split=False, tails_first=False, down_max_registers=0)),
    ("qwen3-30b-a3b", 1, dict()),
]


def _config(spec: str, tokens: int, fields: dict):
    from moegen.ir import lower
    from moegen.plan.configs import default_config
    from moegen.spec import load_spec

    path = REPO_ROOT / "specs" / f"{spec}.yaml"
    ir = lower(load_spec(str(path)), str(path))
    config = dataclasses.replace(default_config(ir.signature, ir.target, tokens), decode_block_n=0, **fields)
    return path, ir, config


@pytest.mark.parametrize("spec,tokens,fields", CASES, ids=[f"{s}-T{t}" for s, t, _ in CASES])
def test_counted_shared_memory_covers_what_triton_allocates(spec, tokens, fields, compile_sm90, tmp_path):
    from moegen.plan.configs import SMEM_BESIDE_TILES, down_smem_bytes, gate_up_smem_bytes, violation

    path, ir, config = _config(spec, tokens, fields)
    assert violation(config, ir.signature, ir.target) is None
    out = tmp_path / "shared.json"
    compile_sm90(COMPILE.format(spec=str(path), config=dataclasses.asdict(config), tokens=tokens, out=str(out)))
    shared = json.loads(out.read_text())
    fmt = ir.signature.weight_format
    assert shared["gate_up"] <= gate_up_smem_bytes(config, fmt) + SMEM_BESIDE_TILES
    assert shared["down"] <= down_smem_bytes(config, fmt) + SMEM_BESIDE_TILES


def test_deep_int4_tiles_fit_where_the_same_bf16_tiles_do_not():
    from moegen.plan.configs import violation

    fields = CASES[0][2]
    _, int4_ir, int4_config = _config("qwen3-30b-a3b-int4", 1, fields)
    _, bf16_ir, bf16_config = _config("qwen3-30b-a3b", 1, fields)
    assert violation(int4_config, int4_ir.signature, int4_ir.target) is None
    assert "GEMM1 shared memory" in violation(bf16_config, bf16_ir.signature, bf16_ir.target)
