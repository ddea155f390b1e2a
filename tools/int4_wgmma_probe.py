"""Probe: an int4 (w4a16, bf16) prefill GEMM whose dequantized weights feed wgmma from registers.

Nsight Compute has the templates' int4 prefill GEMM1 latency-bound at two warps a scheduler
(docs/PERFORMANCE.md, "int4 prefill on the shipped entries"). This probe asks how far a kernel
gets whose K loop keeps the MMAs asynchronous: each K step's weight words and token rows arrive
by cp.async into a ring of STAGES slots, the words are unpacked (the decode kernel's UNPACK) and
scaled into bf16 in the layout of wgmma's register A operand (the weights are A: out^T = W x^T,
16 rows a warp), and the step's wgmma runs while the next step's operands are unpacked.

Dense first (no expert routing): out [M, N] = x [M, K] @ dequant(W [N, K])^T with groups of 128
inputs a scale (and zero point), the weights repacked at load time so that the unpacked nibbles
come out in the MMA's input order (`natural_words`). Against cuBLAS's bf16 GEMM on the
dequantized weights, the rate int4 prefill is measured against (0.9x its target).

    python tools/int4_wgmma_probe.py --compile     # CPU: compile for sm_90, registers and SASS
    PYTHONPATH=. python tools/int4_wgmma_probe.py  # GPU: each tile checked against float64, then
                                                   # timed against cuBLAS
Status (docs/PERFORMANCE.md, ideas table): one H100 run of an earlier version, 0.63-0.68x cuBLAS
with wrong sums; two faults fixed since (the dequantization's shift rounded before the FMA; a
ring slot refilled while the other warpgroup's wgmma could still read it), not yet run on a GPU.
The packing is checked on the CPU (tests/test_int4_wgmma_probe.py).
"""
import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from moegen.runtime.int4_mma import GROUP, GROUP_SIZE, _a_operand, _swapped_words, swapped_words_layout  # noqa: E402

# (128 + q) - (128 + zero), exact in bf16, then times the scale: one rounding, as the reference.
DEQUANT_BF16X2 = gl.constexpr("{\n.reg .b32 t;\nadd.rn.bf16x2 t, $1, $3;\nmul.rn.bf16x2 $0, t, $2;\n}")


@gluon.constexpr_function
def wgmma_layout(num_warps, block_m):
    """wgmma's accumulators [weight rows, tokens]: 16 rows a warp, 64 a warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])


@gluon.jit
def _row_values(s_ptr, z_ptr, rows, group, groups: gl.constexpr, ZERO_POINT: gl.constexpr):
    """A step's scales and -(128 + zero) of `rows` (bf16, the latter exact)."""
    scale = gl.load(s_ptr + rows * groups + group).to(gl.float32)
    if ZERO_POINT:
        zero = gl.load(z_ptr + rows * groups + group).to(gl.float32)
    else:
        zero = gl.full(scale.shape, 8.0, gl.float32, layout=scale.type.layout)
    return scale.to(gl.bfloat16), (-(128.0 + zero)).to(gl.bfloat16)


@gluon.jit
def int4_wgmma_gemm(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N: gl.constexpr, K: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                    ZERO_POINT: gl.constexpr):
    """out [M, N] (bf16) = x [M, K] @ dequant(w)^T; w as int32 words [N, K / 8] of natural_words'
    layout, scales [N, K / 128] (bf16), zero points [N, K / 128] (uint8). Program (n, m) tile."""
    KB: gl.constexpr = GROUP // 32
    STEPS: gl.constexpr = K // GROUP  # one group of scales a step
    acc_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = swapped_words_layout(KB, NUM_WARPS)
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    words_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1, 2, 3, 4])
    x_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    rows_a: gl.constexpr = gl.SliceLayout(1, a_layout)

    n0 = gl.program_id(0) * BLOCK_N
    m0 = gl.program_id(1) * BLOCK_M
    words = _swapped_words(w_ptr, n0, K // 8, BLOCK_N, KB, w_layout)
    xm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = x_ptr + xm.to(gl.int64)[:, None] * K + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :]
    x_mask = (xm < M)[:, None]
    rows = n0 + gl.arange(0, BLOCK_N, layout=rows_a)

    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, KB, 4, BLOCK_N // 16, 2, 8], words_smem)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, GROUP], x_smem_layout)
    # Copies run STAGES - 2 steps ahead: a slot is refilled two steps after its MMAs were issued,
    # when every warpgroup has waited for them (wgmma_wait is a warpgroup's own).
    for s in gl.static_range(STAGES - 2):
        cp.async_copy_global_to_shared(w_ring.index(s), words + s * (GROUP // 8))
        cp.async_copy_global_to_shared(x_ring.index(s), x_ptrs + s * GROUP, mask=x_mask)
        cp.commit_group()

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    scale, shift = _row_values(s_ptr, z_ptr, rows, 0, STEPS, ZERO_POINT)
    for step in range(STEPS):
        cp.wait_group(STAGES - 3)
        gl.thread_barrier()  # every thread's copies of this step have landed
        fence_async_shared()  # and are visible to wgmma's reads
        slot = step % STAGES
        q = _a_operand(w_ring.index(slot).load(w_layout), KB, BLOCK_N, a_layout)  # 128 + nibble
        a = gl.inline_asm_elementwise(DEQUANT_BF16X2, "=r,r,r,r",
                                      [q, gl.broadcast(scale[:, None], q)[0], gl.broadcast(shift[:, None], q)[0]],
                                      dtype=gl.bfloat16, is_pure=True, pack=2)
        if step + 1 < STEPS:
            scale, shift = _row_values(s_ptr, z_ptr, rows, step + 1, STEPS, ZERO_POINT)
        acc = warpgroup_mma(a, x_ring.index(slot).permute([1, 0]), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        ahead = step + STAGES - 2
        if ahead < STEPS:
            cp.async_copy_global_to_shared(w_ring.index(ahead % STAGES), words + ahead * (GROUP // 8))
            cp.async_copy_global_to_shared(x_ring.index(ahead % STAGES), x_ptrs + ahead * GROUP, mask=x_mask)
        cp.commit_group()
    acc = warpgroup_mma_wait(0, deps=[acc])

    on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + om.to(gl.int64)[None, :] * N + on[:, None], acc.to(gl.bfloat16), mask=(om < M)[None, :])


def natural_order() -> torch.Tensor:
    """source[s]: the input of a 128-wide step that storage nibble s must hold so that _a_operand
    (which gives MMA input L the nibble at 32 t + 8 (2 i + d) + 4 e + 2 a + c, for
    L = 64 i + 32 d + 16 a + 8 c + 2 t + e) hands MMA input L the weight of input L."""
    source = torch.empty(GROUP_SIZE, dtype=torch.int64)
    for L in range(GROUP_SIZE):
        i, d, a, c, t, e = L >> 6, (L >> 5) & 1, (L >> 4) & 1, (L >> 3) & 1, (L >> 1) & 3, L & 1
        source[32 * t + 8 * (2 * i + d) + 4 * e + 2 * a + c] = L
    return source


def natural_words(q: torch.Tensor) -> torch.Tensor:
    """Nibbles q [N, K] (uint8, 0..15) packed as int32 words [N, K / 8] in the probe's order."""
    from moegen.quant.quantize import pack_int4

    n, k = q.shape
    source = natural_order().to(q.device)
    stored = q.reshape(n, k // GROUP_SIZE, GROUP_SIZE)[:, :, source].reshape(n, k)
    return pack_int4(stored[None])[0].view(torch.int32)


# (BLOCK_N weight rows, BLOCK_M tokens, STAGES, warps): each K step reads BLOCK_M token rows
# (256 bytes each) and BLOCK_N weight rows (64 bytes) for 2 * BLOCK_N * BLOCK_M * 128 FLOP, so the
# token tile sets the L2 traffic: 128 x 128 needs ~6.7 TB/s of L2 at cuBLAS's rate, 256 x 128 ~4.
CONFIGS = ((128, 128, 4, 8), (128, 128, 3, 8), (256, 128, 3, 8), (256, 128, 4, 8), (128, 256, 3, 8),
           (256, 64, 4, 8), (128, 64, 4, 4))
SHAPES = (("Mixtral W13", 4096, 28672, 4096), ("Qwen3 W13", 4096, 1536, 2048))


def _constexprs(config) -> dict:
    block_n, block_m, stages, warps = config
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, NUM_WARPS=warps)


def compile_report() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from int4_gluon_probe import loop_counts, registers

    signature = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16", "M": "i32"}
    for config in CONFIGS:
        constexprs = {"N": 28672, "K": 4096, **_constexprs(config), "ZERO_POINT": True}
        src = GluonASTSource(int4_wgmma_gemm, {**signature, **{key: "constexpr" for key in constexprs}},
                             constexprs=constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": config[3]})
        except Exception as error:  # e.g. a layout the A operand cannot take without moves
            print(f"{config}: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
            continue
        loop = max(loop_counts(kernel.asm["cubin"]), key=lambda ops: ops.total())
        print(f"BLOCK_N, BLOCK_M, STAGES, warps {config}: {registers(kernel.asm['cubin'])} registers, "
              f"{kernel.metadata.shared} bytes of shared memory; K loop {loop.total()} instructions "
              f"({loop['HGMMA']} HGMMA)", flush=True)


def _problem(m: int, n: int, k: int):
    """Random int4 weights with zero points, their dequantized bf16 values and activations."""
    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    scale = (torch.rand(n, k // GROUP_SIZE, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
    zero = torch.randint(0, 16, (n, k // GROUP_SIZE), device="cuda", dtype=torch.uint8)
    w = (q.float() - zero.float().repeat_interleave(GROUP_SIZE, 1)) * scale.float().repeat_interleave(GROUP_SIZE, 1)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return x, natural_words(q), scale, zero, w.to(torch.bfloat16)


def _launcher(config, x, words, scale, zero, out):
    m, k = x.shape
    n = out.shape[1]
    c = _constexprs(config)
    grid = (n // c["BLOCK_N"], triton.cdiv(m, c["BLOCK_M"]))
    return lambda: int4_wgmma_gemm[grid](x, words, scale, zero, out, m, N=n, K=k, ZERO_POINT=True, **c,
                                         num_warps=c["NUM_WARPS"])


def gpu_report() -> None:
    from moegen.bench.roofline import Timer

    timer = Timer(torch.device("cuda"), quick=True)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    x, words, scale, zero, w = _problem(200, 512, 1024)  # rows off the tile, two groups of tiles
    ref = x.double() @ w.double().T
    right = []
    for config in CONFIGS:
        out = torch.full((200, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        try:
            _launcher(config, x, words, scale, zero, out)()
        except Exception as error:
            print(f"  {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"  check {config}: error {err:.1e}", flush=True)
        if err < 1e-2:
            right.append(config)
    for name, m, n, k in SHAPES:
        x, words, scale, zero, w = _problem(m, n, k)
        flops = 2 * m * n * k
        peer = timer.median_us(lambda: x @ w.T)
        print(f"{name} M {m} N {n} K {k}: cuBLAS bf16 on the dequantized weights {peer:.1f} us "
              f"({flops / peer / 1e6:.0f} TFLOP/s)", flush=True)
        for config in right:
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            us = timer.median_us(_launcher(config, x, words, scale, zero, out))
            print(f"  {config}: {us:.1f} us ({flops / us / 1e6:.0f} TFLOP/s, {peer / us:.2f}x cuBLAS)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 on the CPU")
    args = parser.parse_args()
    if args.compile:
        compile_report()
    elif torch.cuda.is_available():
        gpu_report()
    else:
        print("no GPU: run with --compile", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
