"""tools/int4_gluon_probe.py runs only on a GPU; here its arithmetic is modelled on the CPU: the
unpacking PTX (the PTX model of test_int4_ptx) on random words, the outputs joined, split and
permuted as the kernels do with their own orders, the activations permuted with theirs (not for
the repacked words), and the product must be the float64 product of the weights in moegen's int4
layout. The kernels themselves are compiled for sm_90 (no GPU needed): each layout conversion to
the MMA operand must be trivial."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moegen.quant.quantize import pack_int4
from conftest import load_tool
from test_int4_ptx import run_ptx

TOOL = Path(__file__).resolve().parents[1] / "tools" / "int4_gluon_probe.py"


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("triton.experimental.gluon")
    return load_tool("int4_gluon_probe")


def _unpacked(probe, words: torch.Tensor) -> torch.Tensor:
    """The eight outputs of the PTX per element of words [KB, 4, N] (int32, pack=2: elements 2 i
    and 2 i + 1 along KB go in together), joined on a last axis as the kernel joins them:
    [KB, 4, N, c, a, d], each the value 128 + nibble."""
    kb, lanes, n = words.shape
    out = torch.empty(kb, lanes, n, 8, dtype=torch.float64)
    for i in range(0, kb, 2):
        for t in range(lanes):
            for col in range(n):
                regs = run_ptx(probe.UNPACK.value, {"$8": int(words[i, t, col]) & 0xFFFFFFFF,
                                                    "$9": int(words[i + 1, t, col]) & 0xFFFFFFFF}, torch.bfloat16)
                for p in range(8):
                    bits = regs[f"${p}"]
                    for e in range(2):  # the low lane is element 2 i's, the high one element 2 i + 1's
                        value = torch.tensor([(bits >> 16 * e) & 0xFFFF], dtype=torch.int32).to(torch.int16)
                        out[i + e, t, col, p] = float(value.view(torch.bfloat16))
    # join(join(join(o0, o1), join(o2, o3)), join(join(o4, o5), join(o6, o7))): p = 4 d + 2 a + c
    return out.reshape(kb, lanes, n, 2, 2, 2).permute(0, 1, 2, 5, 4, 3)


@pytest.mark.parametrize("repack, block_k", [(False, 128), (True, 128), (False, 64)])
def test_probe_arithmetic_is_the_int4_product(probe, repack, block_k):
    """block_k 64: the decode kernel's GEMM2 steps over slices of 64 intermediate columns."""
    g = torch.Generator().manual_seed(80)
    n, k = 8, 256
    kb = block_k // 32
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    x = torch.randn(3, k, generator=g, dtype=torch.float64)
    words = pack_int4(q[None])[0].view(torch.int32)  # [N, K / 8]
    if repack:
        words = probe.repacked(words)
    total = torch.zeros(3, n, dtype=torch.float64)
    for k0 in range(0, k, block_k):
        step = words[:, k0 // 8:(k0 + block_k) // 8].reshape(n, 4, kb).permute(2, 1, 0)  # (b, t, n): word KB t + b
        w = _unpacked(probe, step).reshape(kb // 2, 2, 4, n, 2, 2, 2).permute(*probe.WEIGHT_ORDER.value)
        xs = x[:, k0:k0 + block_k]
        if not repack:  # the kernel's permutation of the activations into the nibbles' order
            xs = xs.reshape(3, 4, kb, 2, 2, 2).permute(*probe.ACTIVATION_ORDER.value)
        part = xs.reshape(3, block_k) @ w.reshape(block_k, n)
        total += part - 136.0 * x[:, k0:k0 + block_k].sum(dim=1, keepdim=True)
    torch.testing.assert_close(total, x @ (q.double() - 8).T, rtol=1e-12, atol=1e-9)


def test_swapped_operand_is_the_b_operand_transposed(probe):
    """int4_decode_mma's A operand [N, 32 KB] (the swapped kind's) holds, for weight row n, the MMA inputs the B
    operand [32 KB, N] of _b_operand holds in column n (rows split n = 16 q + 8 h + g)."""
    g = torch.Generator().manual_seed(81)
    n, kb = 32, 4
    words = pack_int4(torch.randint(0, 16, (n, 32 * kb), generator=g, dtype=torch.uint8)[None])[0].view(torch.int32)
    step = words.reshape(n, 4, kb).permute(2, 1, 0)  # (b, t, n): word KB t + b
    unpacked = _unpacked(probe, step)  # [KB, 4, N, c, a, d]
    b = unpacked.reshape(kb // 2, 2, 4, n, 2, 2, 2).permute(*probe.WEIGHT_ORDER.value).reshape(32 * kb, n)
    a = unpacked.reshape(kb // 2, 2, 4, n // 16, 2, 8, 2, 2, 2).permute(*probe.SWAPPED_ORDER.value).reshape(n, 32 * kb)
    torch.testing.assert_close(a, b.T, rtol=0, atol=0)


def test_probe_compiles_for_hopper_with_its_operand_in_place(probe, tmp_path, no_interpreter_env):
    # Its own process: this one's Triton interprets (the conftest), and Gluon compiles only. A
    # fresh cache, so that it compiles: assert_trivial fails the build if the dequantized tile
    # needs a conversion to be the MMA operand.
    env = dict(no_interpreter_env, TRITON_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(TOOL), "--sass"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    tiles = [line for line in lines if " layout, " in line]  # moegen's layout and the repacked one
    decodes = [line for line in lines if line.startswith("decode ")]
    assert len(tiles) == 2 * len(probe.CONFIGS) and len(decodes) == 4 * len(probe.DECODE_SHAPES), lines
    for line in tiles + decodes:
        assert "'HMMA'" in line, line
