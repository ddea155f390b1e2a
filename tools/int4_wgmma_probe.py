"""Probe: an int4 (w4a16, bf16) prefill GEMM whose dequantized weights feed wgmma from registers.

Nsight Compute has the templates' int4 prefill GEMM1 latency-bound at two warps a scheduler
(docs/PERFORMANCE.md, "int4 prefill on the shipped entries"). This probe asks how far a kernel
gets whose K loop keeps the MMAs asynchronous: each K step's weight words and token rows arrive
by cp.async into a ring of STAGES slots, the words are unpacked (the decode kernel's UNPACK) and
scaled into bf16 in the layout of wgmma's register A operand (the weights are A: out^T = W x^T,
16 rows a warp), and the step's wgmma runs while the next step's operands are unpacked.

Dense: out [M, N] = x [M, K] @ dequant(W [N, K])^T with groups of 128 inputs a scale (and
zero point), the weights repacked at load time so that the unpacked nibbles come out in the
MMA's input order (`natural_words`); against cuBLAS's bf16 GEMM on the dequantized weights.
Routed (`int4_wgmma_gate_up`): the layer's GEMM1 on moegen's own int4 layout and alignment
(sorted slots, one expert a row block), a tile's rows half gate and half up so that the
activation is fused; the activations permuted once per 128-group instead of the weights
(`permuted_activations`); against torch.bmm on the same FLOPs in bf16.

    python tools/int4_wgmma_probe.py --compile     # CPU: compile for sm_90, registers and SASS
    PYTHONPATH=. python tools/int4_wgmma_probe.py  # GPU: each tile checked against float64, then
                                                   # timed against cuBLAS / torch.bmm
Status (docs/PERFORMANCE.md, ideas table): dense, H100 2026-12-07 19:53, every tile right
(1.7e-3) except 256 x 128 with 4 stages on 8 warps; 0.62x cuBLAS at best (128 x 128, 4 stages)
on Mixtral's W13 shape, its programs walking the weight tiles fastest. The grouped rows
(GROUP_M), the 16-warp tiles and the routed GEMMs are compiled and packing-checked on the CPU
(tests/test_int4_wgmma_probe.py), not yet run on a GPU.
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

from moegen.runtime import align  # noqa: E402
from moegen.runtime.int4_mma import GROUP, GROUP_SIZE, _a_operand, _swapped_words, swapped_words_layout  # noqa: E402

EXPERT_MASK = gl.constexpr(align.EXPERT_MASK)  # a row block's word: its expert in the low bits
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
def _k_loop(words, x_ptrs, x_mask, s_rows, z_rows, rows, STEPS: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, ZERO_POINT: gl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (float32) = dequant(words' rows) @ x rows^T over STEPS groups of 128
    inputs, and the token ring (free for the epilogue: every copy has landed and been read)."""
    KB: gl.constexpr = GROUP // 32
    acc_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = swapped_words_layout(KB, NUM_WARPS)
    words_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1, 2, 3, 4])
    x_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, KB, 4, BLOCK_N // 16, 2, 8], words_smem)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, GROUP], x_smem_layout)
    # Copies run STAGES - 2 steps ahead: a slot is refilled two steps after its MMAs were issued,
    # when every warpgroup has waited for them (wgmma_wait is a warpgroup's own).
    for s in gl.static_range(STAGES - 2):
        cp.async_copy_global_to_shared(w_ring.index(s), words + s * (GROUP // 8))
        cp.async_copy_global_to_shared(x_ring.index(s), x_ptrs + s * GROUP, mask=x_mask)
        cp.commit_group()

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=acc_layout)
    scale, shift = _row_values(s_rows, z_rows, rows, 0, STEPS, ZERO_POINT)
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
            scale, shift = _row_values(s_rows, z_rows, rows, step + 1, STEPS, ZERO_POINT)
        acc = warpgroup_mma(a, x_ring.index(slot).permute([1, 0]), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        ahead = step + STAGES - 2
        if ahead < STEPS:
            cp.async_copy_global_to_shared(w_ring.index(ahead % STAGES), words + ahead * (GROUP // 8))
            cp.async_copy_global_to_shared(x_ring.index(ahead % STAGES), x_ptrs + ahead * GROUP, mask=x_mask)
        cp.commit_group()
    acc = warpgroup_mma_wait(0, deps=[acc])
    cp.wait_group(0)
    gl.thread_barrier()
    return acc, x_ring


@gluon.constexpr_function
def tokens_layout(num_warps):
    """Token rows [rows, 128] as cp.async copies them: eight inputs (16 bytes) a thread."""
    return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])


@gluon.jit
def _tile(num_n: gl.constexpr, num_m, GROUP_M: gl.constexpr):
    """(weight tile, row tile) of this program: GROUP_M row tiles at a time walk the weight tiles,
    so that DRAM gives each weight tile once a group and L2 the rest (GROUP_M 1: weight tiles
    fastest, each read again for every row tile)."""
    pid = gl.program_id(0)
    per_group: gl.constexpr = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    rows = gl.minimum(num_m - first_m, GROUP_M)
    return pid % per_group // rows, first_m + pid % per_group % rows


@gluon.jit
def _tile_rows(n0, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, BLOCK_M: gl.constexpr):
    """Weight rows n0.. in the layout of the A operand's rows (for their scales)."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(NUM_WARPS, BLOCK_M), k_width=2)
    return n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))


@gluon.jit
def int4_wgmma_gemm(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N: gl.constexpr, K: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                    GROUP_M: gl.constexpr, ZERO_POINT: gl.constexpr):
    """out [M, N] (bf16) = x [M, K] @ dequant(w)^T; w as int32 words [N, K / 8] of natural_words'
    layout, scales [N, K / 128] (bf16), zero points [N, K / 128] (uint8). One program a tile."""
    KB: gl.constexpr = GROUP // 32
    x_layout: gl.constexpr = tokens_layout(NUM_WARPS)
    n_tile, m_tile = _tile(N // BLOCK_N, gl.cdiv(M, BLOCK_M), GROUP_M)
    n0 = n_tile * BLOCK_N
    m0 = m_tile * BLOCK_M
    words = _swapped_words(w_ptr, n0, K // 8, BLOCK_N, KB, swapped_words_layout(KB, NUM_WARPS))
    xm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = x_ptr + xm.to(gl.int64)[:, None] * K + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :]
    rows = _tile_rows(n0, BLOCK_N, NUM_WARPS, BLOCK_M)
    acc, _ = _k_loop(words, x_ptrs, (xm < M)[:, None], s_ptr, z_ptr, rows, K // GROUP, BLOCK_N, BLOCK_M, STAGES,
                     NUM_WARPS, ZERO_POINT)
    acc_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_M)
    on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + om.to(gl.int64)[None, :] * N + on[:, None], acc.to(gl.bfloat16), mask=(om < M)[None, :])


@gluon.jit
def _gate_up_words(ptr, n0, row_words, I: gl.constexpr, BLOCK_N: gl.constexpr, KB: gl.constexpr,
                   layout: gl.constexpr):
    """_swapped_words' pointers for a tile whose first half is gate rows n0.. and second half up
    rows I + n0.. (moegen's w13: gate then up along N), so that one tile's MMA gives both."""
    HALF: gl.constexpr = BLOCK_N // 2
    offsets = _swapped_words(0, n0, row_words, BLOCK_N, KB, layout)  # a row's words lie within its row
    return ptr + gl.where(offsets < (n0 + HALF) * row_words, offsets, offsets + (I - HALF) * row_words)


@gluon.jit
def _gate_up_row(n0, r, I: gl.constexpr, BLOCK_N: gl.constexpr):
    HALF: gl.constexpr = BLOCK_N // 2
    return gl.where(r < HALF, n0 + r, I - HALF + n0 + r)


@gluon.jit
def int4_wgmma_gate_up(x_ptr, w_ptr, s_ptr, z_ptr, inter_ptr, slots_ptr, experts_ptr, padded_ptr, num_slots,
                       num_blocks, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                       GROUP_M: gl.constexpr, ZERO_POINT: gl.constexpr):
    """GEMM1 of the routed layer: inter [rows, I] (bf16) = silu(x W_gate^T) * (x W_up^T) for the
    row block's tokens (sorted slots of one expert, moegen's alignment with group_m 1), BLOCK_N / 2
    columns of I a program. x is [T, H] with each group of 128 inputs permuted to the order the
    stored words' nibbles come in (permuted_activations); w13 words [E, 2 I, H / 8] in moegen's
    layout. inter is written in the same permuted order, as GEMM2 reads it."""
    KB: gl.constexpr = GROUP // 32
    HALF: gl.constexpr = BLOCK_N // 2
    gl.static_assert(STAGES * GROUP * 2 >= BLOCK_N * 4, "the token ring stages the float32 tile at the end")
    x_layout: gl.constexpr = tokens_layout(NUM_WARPS)
    n_tile, block = _tile(2 * I // BLOCK_N, num_blocks, GROUP_M)
    n0 = n_tile * HALF
    m0 = block * BLOCK_M
    if m0 >= gl.load(padded_ptr):
        return
    expert = (gl.load(experts_ptr + block) & EXPERT_MASK).to(gl.int64)
    words = _gate_up_words(w_ptr + expert * (2 * I * (H // 8)), n0, H // 8, I, BLOCK_N, KB,
                           swapped_words_layout(KB, NUM_WARPS))
    xm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    slot = gl.load(slots_ptr + xm)
    x_ptrs = (x_ptr + (slot // TOP_K).to(gl.int64)[:, None] * H
              + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :])
    rows = _gate_up_row(n0, _tile_rows(0, BLOCK_N, NUM_WARPS, BLOCK_M), I, BLOCK_N)
    acc, x_ring = _k_loop(words, x_ptrs, (slot < num_slots)[:, None], s_ptr + expert * (2 * I * (H // GROUP)),
                          z_ptr + expert * (2 * I * (H // GROUP)), rows, H // GROUP, BLOCK_N, BLOCK_M, STAGES,
                          NUM_WARPS, ZERO_POINT)

    # Gate and up meet in one thread through shared memory (the token ring, no longer read).
    epi_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NUM_WARPS, 1], [1, 0])
    staged = x_ring._reinterpret(gl.float32, [BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    staged.store(acc)
    gl.thread_barrier()
    gate = staged.slice(0, HALF).load(epi_layout)
    up = staged.slice(HALF, HALF).load(epi_layout)
    h = (gate / (1.0 + gl.exp(-gate)) * up).to(gl.bfloat16)
    column = _stored_position(n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, epi_layout)))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, epi_layout))
    gl.store(inter_ptr + om.to(gl.int64)[None, :] * I + column[:, None], h)


@gluon.jit
def _stored_position(j):
    """Where input j of a 128-group goes in permuted_activations' order: the inverse of
    activation_positions (input 32 t + 8 (2 i + d) + 4 e + 2 a + c to 64 i + 32 d + 16 a + 8 c + 2 t + e)."""
    g = j - j % GROUP
    j = j % GROUP
    t, i, d, e, a, c = j // 32, (j // 16) % 2, (j // 8) % 2, (j // 4) % 2, (j // 2) % 2, j % 2
    return g + 64 * i + 32 * d + 16 * a + 8 * c + 2 * t + e


@gluon.jit
def int4_wgmma_down(inter_ptr, w_ptr, s_ptr, z_ptr, out_ptr, weights_ptr, slots_ptr, experts_ptr, padded_ptr,
                    num_slots, num_blocks, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                    GROUP_M: gl.constexpr, ZERO_POINT: gl.constexpr):
    """GEMM2 of the routed layer: out [T, H] (float32) += router weight * inter rows @ W_down^T for
    the row block's slots, BLOCK_N rows of H a program; inter [rows, I] as int4_wgmma_gate_up writes
    it (permuted within groups), w2 words [E, H, I / 8] in moegen's layout."""
    KB: gl.constexpr = GROUP // 32
    x_layout: gl.constexpr = tokens_layout(NUM_WARPS)
    acc_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_M)
    n_tile, block = _tile(H // BLOCK_N, num_blocks, GROUP_M)
    n0 = n_tile * BLOCK_N
    m0 = block * BLOCK_M
    if m0 >= gl.load(padded_ptr):
        return
    expert = (gl.load(experts_ptr + block) & EXPERT_MASK).to(gl.int64)
    words = _swapped_words(w_ptr + expert * (H * (I // 8)), n0, I // 8, BLOCK_N, KB,
                           swapped_words_layout(KB, NUM_WARPS))
    xm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = inter_ptr + xm.to(gl.int64)[:, None] * I + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :]
    rows = _tile_rows(n0, BLOCK_N, NUM_WARPS, BLOCK_M)
    acc, _ = _k_loop(words, x_ptrs, (xm >= 0)[:, None], s_ptr + expert * (H * (I // GROUP)),
                     z_ptr + expert * (H * (I // GROUP)), rows, I // GROUP, BLOCK_N, BLOCK_M, STAGES, NUM_WARPS,
                     ZERO_POINT)
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    slot = gl.load(slots_ptr + om)
    kept = slot < num_slots
    weight = gl.load(weights_ptr + slot, mask=kept, other=0.0)
    on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    gl.atomic_add(out_ptr + (slot // TOP_K).to(gl.int64)[None, :] * H + on[:, None], acc * weight[None, :],
                  mask=kept[None, :], sem="relaxed")


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


# (BLOCK_N weight rows, BLOCK_M tokens, STAGES, warps, GROUP_M): each K step reads BLOCK_M token
# rows (256 bytes each) and BLOCK_N weight rows (64 bytes) for 2 * BLOCK_N * BLOCK_M * 128 FLOP, so
# the token tile sets the L2 traffic: 128 x 128 needs ~7.7 TB/s of L2 at cuBLAS's 790 TFLOP/s (H100),
# 256 x 128 on 16 warps (four warpgroups of 64 weight rows share each token tile) ~4.6. GROUP_M
# row tiles walk the weight tiles together (_tile): 1 reads every weight tile again a row tile.
CONFIGS = ((128, 128, 4, 8, 1), (128, 128, 4, 8, 8), (128, 128, 5, 8, 8), (256, 128, 4, 16, 8),
           (256, 128, 3, 16, 8), (256, 64, 6, 16, 8), (128, 64, 6, 4, 8), (64, 128, 6, 4, 8))
SHAPES = (("Mixtral W13", 4096, 28672, 4096), ("Qwen3 W13", 4096, 1536, 2048))


def _constexprs(config) -> dict:
    block_n, block_m, stages, warps, group_m = config
    return dict(BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, NUM_WARPS=warps, GROUP_M=group_m)


def _compile(kernel_fn, signature: dict, constexprs: dict, warps: int):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(kernel_fn, {**signature, **{key: "constexpr" for key in constexprs}},
                         constexprs=constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compiled_kernels():
    """(name, config, compiled kernel or the error) of every dense and routed tile, for sm_90."""
    dense = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*bf16", "M": "i32"}
    routed = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "inter_ptr": "*bf16",
              "slots_ptr": "*i32", "experts_ptr": "*i32", "padded_ptr": "*i32", "num_slots": "i32", "num_blocks": "i32"}
    cases = [("dense", config, int4_wgmma_gemm, dense, {"N": 28672, "K": 4096}) for config in CONFIGS]
    down = {"inter_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*fp32",
            "weights_ptr": "*fp32", "slots_ptr": "*i32", "experts_ptr": "*i32", "padded_ptr": "*i32",
            "num_slots": "i32", "num_blocks": "i32"}
    mixtral = {"H": 4096, "I": 14336, "TOP_K": 2}
    cases += [("gate_up", config, int4_wgmma_gate_up, routed, mixtral) for config in ROUTED_CONFIGS]
    cases += [("down", config, int4_wgmma_down, down, mixtral) for config in ROUTED_CONFIGS]
    for name, config, kernel_fn, signature, shape in cases:
        try:
            kernel = _compile(kernel_fn, signature, {**shape, **_constexprs(config), "ZERO_POINT": True}, config[3])
        except Exception as error:  # e.g. a layout the A operand cannot take without moves
            kernel = error
        yield name, config, kernel


def compile_report() -> None:
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from int4_gluon_probe import loop_counts, registers

    for name, config, kernel in compiled_kernels():
        if isinstance(kernel, Exception):
            print(f"{name} {config}: {type(kernel).__name__}: {str(kernel).splitlines()[0][:200]}", flush=True)
            continue
        loop = max(loop_counts(kernel.asm["cubin"]), key=lambda ops: ops.total())
        print(f"{name} BLOCK_N, BLOCK_M, STAGES, warps, GROUP_M {config}: {registers(kernel.asm['cubin'])} registers, "
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
    grid = (n // c["BLOCK_N"] * triton.cdiv(m, c["BLOCK_M"]),)
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
    routed_report(timer)


def activation_positions() -> torch.Tensor:
    """pos[L]: the input of a 128-wide step whose weight MMA input L multiplies when the words are
    stored in moegen's order (the inverse of natural_order)."""
    return torch.argsort(natural_order())


def permuted_activations(x: torch.Tensor) -> torch.Tensor:
    t, h = x.shape
    return x.view(t, h // GROUP_SIZE, GROUP_SIZE)[:, :, activation_positions().to(x.device)].reshape(t, h)


# Routed tiles: (BLOCK_N weight rows (GEMM1: half gate, half up), BLOCK_M slots, STAGES, warps,
# GROUP_M row blocks).
ROUTED_CONFIGS = ((128, 128, 4, 8, 8), (256, 128, 4, 16, 8), (128, 64, 6, 4, 8))
ROUTED_SHAPES = (("Mixtral", 8, 4096, 14336, 2, 4096), ("Qwen3", 128, 2048, 768, 8, 4096))


def _int4_weights(e: int, n: int, k: int) -> dict:
    """Random int4 weights with zero points in moegen's layout, and what they stand for in bf16."""
    from moegen.quant.quantize import pack_int4

    q = torch.randint(0, 16, (e, n, k), device="cuda", dtype=torch.uint8)
    scale = (torch.rand(e, n, k // GROUP_SIZE, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
    zero = torch.randint(0, 16, (e, n, k // GROUP_SIZE), device="cuda", dtype=torch.uint8)
    return dict(words=pack_int4(q).view(torch.int32), scale=scale, zero=zero, q=q)


def _dequantized(w: dict) -> torch.Tensor:
    groups = lambda t: t.double().repeat_interleave(GROUP_SIZE, 2)  # noqa: E731
    return ((w["q"].double() - groups(w["zero"])) * groups(w["scale"])).to(torch.bfloat16).double()


def _routed_problem(e: int, h: int, i: int, k: int, t: int, block_m: int) -> dict:
    from moegen.runtime.align import align_tokens

    ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices
    return dict(w13=_int4_weights(e, 2 * i, h), w2=_int4_weights(e, h, i), h=h, i=i, top_k=k, num_slots=t * k,
                x=torch.randn(t, h, device="cuda", dtype=torch.bfloat16),
                weights=torch.rand(t * k, device="cuda", dtype=torch.float32) + 0.1,
                aligned=align_tokens(ids, e, block_m))


def _routed_launchers(config, p):
    """GEMM1 and GEMM2 as two callables on the problem's buffers, and the intermediate and output."""
    a, h, i = p["aligned"], p["h"], p["i"]
    c = _constexprs(config)
    inter = torch.empty(a.max_padded, i, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(p["x"].shape[0], h, device="cuda", dtype=torch.float32)
    x = permuted_activations(p["x"])
    tiles = dict(H=h, I=i, TOP_K=p["top_k"], ZERO_POINT=True, num_warps=c["NUM_WARPS"], **c)
    w13, w2, blocks = p["w13"], p["w2"], a.max_padded // c["BLOCK_M"]
    gate_up = lambda: int4_wgmma_gate_up[(2 * i // c["BLOCK_N"] * blocks,)](  # noqa: E731
        x, w13["words"], w13["scale"], w13["zero"], inter, a.sorted_slots, a.block_runs, a.num_padded,
        p["num_slots"], blocks, **tiles)
    down = lambda: int4_wgmma_down[(h // c["BLOCK_N"] * blocks,)](  # noqa: E731
        inter, w2["words"], w2["scale"], w2["zero"], out, p["weights"], a.sorted_slots, a.block_runs, a.num_padded,
        p["num_slots"], blocks, **tiles)
    return gate_up, down, inter, out


def _routed_errors(config) -> tuple[float, float]:
    """GEMM1's rows and the layer's output against float64, at a small shape off the tiles."""
    e, h, i, k, t = 4, 512, 256, 2, 300
    p = _routed_problem(e, h, i, k, t, config[1])
    gate_up, down, inter, out = _routed_launchers(config, p)
    gate_up()
    down()
    a = p["aligned"]
    slots = a.sorted_slots[:a.max_padded].long()
    kept = slots < p["num_slots"]
    experts = a.block_runs.long().repeat_interleave(config[1])[kept]
    slots = slots[kept]
    gu = torch.einsum("rh,rnh->rn", p["x"].double()[slots // k], _dequantized(p["w13"])[experts])
    ref_inter = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    # Input j of a group sits at natural_order()[j] of the permuted order GEMM1 writes.
    stored = (natural_order().repeat(i // GROUP_SIZE) + torch.arange(i) // GROUP_SIZE * GROUP_SIZE).cuda()
    got_inter = inter[kept].double()[:, stored]
    down_rows = torch.einsum("ri,rhi->rh", ref_inter, _dequantized(p["w2"])[experts]) * p["weights"][slots, None]
    ref_out = torch.zeros(t, h, dtype=torch.float64, device="cuda").index_add_(0, slots // k, down_rows)
    rel = lambda got, ref: ((got - ref).norm() / ref.norm()).item()  # noqa: E731
    return rel(got_inter, ref_inter), rel(out.double(), ref_out)


def routed_report(timer) -> None:
    for config in ROUTED_CONFIGS:
        try:
            inter_err, out_err = _routed_errors(config)
        except Exception as error:
            print(f"  routed {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        print(f"  routed check {config}: GEMM1 error {inter_err:.1e}, layer error {out_err:.1e}", flush=True)
        if max(inter_err, out_err) > 1e-2:
            continue
        for name, e, h, i, k, t in ROUTED_SHAPES:
            p = _routed_problem(e, h, i, k, t, config[1])
            gate_up, down, _, out = _routed_launchers(config, p)
            gate_up_us, down_us = timer.median_us(gate_up), timer.median_us(down)
            rows = t * k // e  # the same FLOPs as uniform batched GEMMs on bf16 weights
            xs = torch.randn(e, rows, h, device="cuda", dtype=torch.bfloat16)
            w13 = torch.randn(e, h, 2 * i, device="cuda", dtype=torch.bfloat16)
            w2 = torch.randn(e, i, h, device="cuda", dtype=torch.bfloat16)
            inter = torch.randn(e, rows, i, device="cuda", dtype=torch.bfloat16)
            bmm13, bmm2 = timer.median_us(lambda: torch.bmm(xs, w13)), timer.median_us(lambda: torch.bmm(inter, w2))
            flops13, flops2 = 2 * t * k * 2 * i * h, 2 * t * k * h * i
            print(f"  {name} T {t} {config}: GEMM1 {gate_up_us:.1f} us ({flops13 / gate_up_us / 1e6:.0f} TFLOP/s, "
                  f"{bmm13 / gate_up_us:.2f}x torch.bmm bf16 {bmm13:.1f}), GEMM2 {down_us:.1f} us "
                  f"({flops2 / down_us / 1e6:.0f} TFLOP/s, {bmm2 / down_us:.2f}x torch.bmm {bmm2:.1f}); both "
                  f"{(bmm13 + bmm2) / (gate_up_us + down_us):.2f}x", flush=True)
            del p, xs, w13, w2, inter, out


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
