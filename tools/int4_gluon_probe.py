"""Probe: how far an int4 (w4a16, bf16) GEMM gets when its layouts are chosen by hand (Gluon).

The int4 GEMMs of the templates spend ~4.4 instructions a weight (docs/PERFORMANCE.md): Triton 3.6
gives both dot operands kWidth 8 when one is dequantized, and every HMMA's activation quad is then
assembled with register moves. Gluon (triton.experimental.gluon) lets the kernel say the layouts:
here the weight words are loaded so that each thread holds exactly the nibbles of its mma.sync
B fragments (kWidth 2), a shift and a LOP3 make each bf16x2 register of the fragment, and the
activations reach the MMA through shared memory and LDSM, permuted to the order the nibbles come
in. The weights stay in moegen's int4 layout (moegen.quant.quantize.pack_int4); the MMA takes
128 + nibble exactly, and each group's 128-input tile is finished in float32 as
(product - (128 + zero) * sum of the activations) * scale.

int4_tile_gemm is one weight matrix times up to 16 rows (a decode GEMM's inner loop);
int4_decode_routed a whole layer's experts for up to 16 tokens whose picks are given (what
fused_experts computes), with two variants that keep more bytes in flight: int4_decode_staged
(cp.async into a ring of shared-memory slots) and int4_decode_lean (every operand loaded two
steps ahead); the kind "swapped" is the pipeline's int4 decode kernel (moegen/runtime/int4_mma.py:
the weights as the MMA's A operand, the tokens as its N), whose pieces the others share. What
they measured (fewer instructions a weight; one token bound by how few warps an SM holds, not by
the bytes in flight) is in docs/PERFORMANCE.md's ideas table.

    python tools/int4_gluon_probe.py --sass        # CPU: compile for sm_90, count the K loops' SASS
    PYTHONPATH=. python tools/int4_gluon_probe.py  # GPU: float64 checks; one token's weights of each
                                                   # spec against moegen's int4 layer and the
                                                   # read-only bound of the same bytes; the decode
                                                   # kernels against fused_experts at 1, 8, 16 tokens
        --decode-only   only the decode kernels
        --profile       one launch of each kind's fastest config (run under Nsight Compute)
        --read-pattern  the GEMMs' read pattern alone against one streaming read of the same bytes
"""
import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from moegen.runtime.int4_mma import (ACTIVATION_ORDER, GROUP, GROUP_SIZE, STAGING, SWAPPED_ORDER, UNPACK,
                                     _expert_picks, _group_offset, _group_raw, _nibble_order, activations_layout,
                                     int4_decode_mma, mma_layout, operand_layout, picks_layout)

# The unpacked words [KB, 4, BLOCK_N, c, a, d] (the eight outputs joined, p = 4 d + 2 a + c),
# split as [KB // 2, e, 4, BLOCK_N, c, a, d] (e: the lane, which word of a pair the element
# stands for) and permuted to (i, d, a, c, t, e, n): the MMA's input order, that of
# ACTIVATION_ORDER (the weights as the B operand; the pipeline's kernel takes them as A).
WEIGHT_ORDER = gl.constexpr((0, 6, 5, 4, 2, 1, 3))


@gluon.constexpr_function
def words_layout(kb, num_warps):
    """A step's words [KB, 4, rows] (b, t, n): lanes hold t and the low bits of n, as the B
    fragment's do; a thread's KB words of a row are contiguous (one 16-byte load at KB 4)."""
    return gl.BlockedLayout([kb, 1, 1], [1, 4, 8], [1, 1, num_warps], [0, 1, 2])


@gluon.jit
def int4_tile_gemm(w_ptr, x_ptr, scale_ptr, out_ptr, rows, K: gl.constexpr, N: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, PREFETCH: gl.constexpr,
                   REPACKED: gl.constexpr):
    """out[:rows, n0:n0 + BLOCK_N] = x[:rows] @ ((q - 8) * scale)^T for q in moegen's int4 bytes
    [N, K / 2] (or, REPACKED, those bytes in the MMA's order: repacked()), scales [N, K / GROUP];
    x and out have 16 rows."""
    BLOCK_K: gl.constexpr = GROUP
    KB: gl.constexpr = BLOCK_K // 32  # words a thread loads per column and step
    mma: gl.constexpr = mma_layout(NUM_WARPS)
    a_layout: gl.constexpr = operand_layout(0, mma)
    b_layout: gl.constexpr = operand_layout(1, mma)
    w_layout: gl.constexpr = words_layout(KB, NUM_WARPS)
    x_layout: gl.constexpr = activations_layout(NUM_WARPS)

    n0 = gl.program_id(0) * BLOCK_N
    on, step_words = _word_offsets(BLOCK_N, KB, w_layout)
    w_ptrs = w_ptr + (n0 + on)[None, None, :] * (K // 8) + step_words
    scale_ptrs = scale_ptr + (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))) * (K // GROUP)
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = x_ptr + xm[:, None] * K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))[None, :]
    x_mask = (xm < rows)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BLOCK_K], STAGING)
    acc = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    words_next = gl.load(w_ptrs)
    scale_next = gl.load(scale_ptrs)
    for k in range(0, K, BLOCK_K):
        if PREFETCH:  # the next step's words in flight during this one's MMAs (no pipeliner here)
            words = words_next
            scale = scale_next.to(gl.float32)
            if k + BLOCK_K < K:
                words_next = gl.load(w_ptrs + (k + BLOCK_K) // 8)
                scale_next = gl.load(scale_ptrs + (k + BLOCK_K) // GROUP)
        else:
            words = gl.load(w_ptrs + k // 8)
            scale = gl.load(scale_ptrs + k // GROUP).to(gl.float32)
        w = _b_operand(words, KB, BLOCK_N, b_layout)
        x = gl.load(x_ptrs + k, mask=x_mask, other=0.0)
        x_sum = gl.convert_layout(gl.sum(x.to(gl.float32), axis=1), gl.SliceLayout(1, mma))
        if not REPACKED:  # (repacked, the MMA's input order is the inputs' own)
            x = _nibble_order(x, KB)
        gl.thread_barrier()  # the previous step's LDSMs are done with the buffer
        x_smem.store(x)
        gl.thread_barrier()
        part = mma_v2(x_smem.load(a_layout), w, gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        acc += (part - 136.0 * x_sum[:, None]) * scale[None, :]  # 136 = 128 + the zero point 8
    om = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    on_out = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + om[:, None] * N + on_out[None, :], acc)


@gluon.jit
def _word_offsets(BLOCK_N: gl.constexpr, KB: gl.constexpr, w_layout: gl.constexpr):
    """The rows n of a step's words [KB, 4, BLOCK_N], and each word's offset within its row's step
    (word KB t + b)."""
    ob = gl.arange(0, KB, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_layout)))
    ot = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_layout)))
    on = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    return on, ot[None, :, None] * KB + ob[:, None, None]


@gluon.jit
def _b_operand(words, KB: gl.constexpr, BLOCK_N: gl.constexpr, b_layout: gl.constexpr):
    """The MMA's B operand [32 KB, BLOCK_N] (128 + nibble, bf16) of a step's words [KB, 4, BLOCK_N]:
    output p = 4 d + 2 a + c of the pair of words (2 i, 2 i + 1), lane e, is MMA input
    L = 64 i + 32 d + 16 a + 8 c + 2 t + e and holds the step's input 8 KB t + 8 (2 i + d) + 4 e + 2 a + c
    (assert_trivial: the tile is the operand in the registers the PTX wrote)."""
    o = gl.inline_asm_elementwise(UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                  dtype=[gl.bfloat16] * 8, is_pure=True, pack=2)
    w = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])),
                gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))  # [KB, 4, BLOCK_N, c, a, d]
    w = gl.permute(gl.reshape(w, [KB // 2, 2, 4, BLOCK_N, 2, 2, 2]), WEIGHT_ORDER.value)
    return gl.convert_layout(gl.reshape(w, [32 * KB, BLOCK_N]), b_layout, assert_trivial=True)


@gluon.jit
def int4_decode_routed(x_ptr, ids_ptr, weights_ptr, w13_ptr, s13_ptr, z13_ptr, w2_ptr, s2_ptr, z2_ptr, work_ptr,
                       T, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr, K_PAD: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr,
                       ZERO_POINT: gl.constexpr, PREFETCH: gl.constexpr):
    """A MoE layer's experts for up to 16 tokens whose picks are given (ids, weights [T, TOP_K]):
    program (e, s) takes expert e's slice s of BLOCK_N (<= GROUP) intermediate columns for the
    tokens that picked e, GEMM1 (gate and up, one staging of the activations), the SiLU, the
    router weights, then GEMM2 of the slice over H in chunks of BLOCK_H, added into the float32
    work [T, H] (zeroed before). Weights in moegen's int4 layout: w13 [E, 2I, H / 2] bytes,
    w2 [E, H, I / 2], scales and zero points [E, rows, inputs / GROUP]."""
    KB: gl.constexpr = GROUP // 32
    KB2: gl.constexpr = BLOCK_N // 32
    mma: gl.constexpr = mma_layout(NUM_WARPS)
    a_layout: gl.constexpr = operand_layout(0, mma)
    b_layout: gl.constexpr = operand_layout(1, mma)
    w_layout: gl.constexpr = words_layout(KB, NUM_WARPS)
    w2_layout: gl.constexpr = words_layout(KB2, NUM_WARPS)
    x_layout: gl.constexpr = activations_layout(NUM_WARPS)
    pick_layout: gl.constexpr = picks_layout(K_PAD, NUM_WARPS)
    rows_mma: gl.constexpr = gl.SliceLayout(1, mma)
    cols_mma: gl.constexpr = gl.SliceLayout(0, mma)

    expert = gl.program_id(0)
    n0 = gl.program_id(1) * BLOCK_N
    picks, row_weight = _expert_picks(ids_ptr, weights_ptr, T, expert, TOP_K, K_PAD, pick_layout, rows_mma)
    if picks == 0:  # programs of unpicked experts end here
        return

    # GEMM1: the gate and up rows n0.. and I + n0.. of W13[expert], over H in groups.
    e64 = expert.to(gl.int64)
    on, step_words = _word_offsets(BLOCK_N, KB, w_layout)
    gate_words = w13_ptr + e64 * (2 * I * (H // 8)) + (n0 + on)[None, None, :] * (H // 8) + step_words
    up_words = gate_words + I * (H // 8)
    sn = n0 + gl.arange(0, BLOCK_N, layout=cols_mma)
    groups1: gl.constexpr = H // GROUP
    s13 = s13_ptr + e64 * (2 * I * groups1)
    z13 = z13_ptr + e64 * (2 * I * groups1)
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = x_ptr + xm[:, None] * H + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :]
    x_mask = (xm < T)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [16, GROUP], STAGING)
    gate = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    up = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    gate_next = gl.load(gate_words)
    up_next = gl.load(up_words)
    for k in range(0, H, GROUP):
        if PREFETCH:  # the next step's words in flight during this one's work
            gate_now, up_now = gate_next, up_next
            if k + GROUP < H:
                gate_next = gl.load(gate_words + (k + GROUP) // 8)
                up_next = gl.load(up_words + (k + GROUP) // 8)
        else:
            gate_now, up_now = gl.load(gate_words + k // 8), gl.load(up_words + k // 8)
        w_gate = _b_operand(gate_now, KB, BLOCK_N, b_layout)
        w_up = _b_operand(up_now, KB, BLOCK_N, b_layout)
        g_scale, g_offset = _group_offset(s13, z13, sn, k // GROUP, groups1, ZERO_POINT)
        u_scale, u_offset = _group_offset(s13, z13, I + sn, k // GROUP, groups1, ZERO_POINT)
        x = gl.load(x_ptrs + k, mask=x_mask, other=0.0)
        x_sum = gl.convert_layout(gl.sum(x.to(gl.float32), axis=1), rows_mma)
        gl.thread_barrier()
        x_smem.store(_nibble_order(x, KB))
        gl.thread_barrier()
        a = x_smem.load(a_layout)
        part = mma_v2(a, w_gate, gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        gate += (part - x_sum[:, None] * g_offset[None, :]) * g_scale[None, :]
        part = mma_v2(a, w_up, gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        up += (part - x_sum[:, None] * u_offset[None, :]) * u_scale[None, :]

    # The slice of the intermediate, router-weighted and rounded to bf16 as the three-kernel path
    # stores it, staged once as GEMM2's A operand.
    h = (gate / (1.0 + gl.exp(-gate)) * up * row_weight[:, None]).to(gl.bfloat16)
    h_sum = gl.sum(h.to(gl.float32), axis=1)
    h_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BLOCK_N], STAGING)
    h_smem.store(_nibble_order(gl.convert_layout(h, x_layout), KB2))
    gl.thread_barrier()
    h_a = h_smem.load(a_layout)

    # GEMM2: rows h0.. of W2[expert], inputs n0.. (one group), added into the work rows.
    oh, step_words2 = _word_offsets(BLOCK_H, KB2, w2_layout)
    w2_words = w2_ptr + e64 * (H * (I // 8)) + oh[None, None, :] * (I // 8) + n0 // 8 + step_words2
    groups2: gl.constexpr = I // GROUP
    s2 = s2_ptr + e64 * (H * groups2)
    z2 = z2_ptr + e64 * (H * groups2)
    om = gl.arange(0, 16, layout=rows_mma)
    sh = gl.arange(0, BLOCK_H, layout=cols_mma)
    w2_next = gl.load(w2_words)
    for h0 in range(0, H, BLOCK_H):
        if PREFETCH:
            w2_now = w2_next
            if h0 + BLOCK_H < H:
                w2_next = gl.load(w2_words + (h0 + BLOCK_H) * (I // 8))
        else:
            w2_now = gl.load(w2_words + h0 * (I // 8))
        w = _b_operand(w2_now, KB2, BLOCK_H, b_layout)
        scale, offset = _group_offset(s2, z2, h0 + sh, n0 // GROUP, groups2, ZERO_POINT)
        part = mma_v2(h_a, w, gl.zeros([16, BLOCK_H], gl.float32, layout=mma))
        y = (part - h_sum[:, None] * offset[None, :]) * scale[None, :]
        gl.atomic_add(work_ptr + om[:, None] * H + (h0 + sh)[None, :], y, mask=(om < T)[:, None], sem="relaxed")


@gluon.jit
def _stage_columns(smem, ptr, row0, rows_step, cols: gl.constexpr, COLS_PAD: gl.constexpr, ROWS: gl.constexpr,
                   layout: gl.constexpr):
    """smem[c, r] = ptr[(row0 + r) * rows_step + c] for c < cols (the scale or zero point of rows
    row0.. for every group c): a program's scales read once, then by group from shared memory."""
    oc = gl.arange(0, COLS_PAD, layout=gl.SliceLayout(1, layout))
    orow = gl.arange(0, ROWS, layout=gl.SliceLayout(0, layout))
    tile = gl.load(ptr + (row0 + orow)[None, :] * rows_step + oc[:, None], mask=(oc < cols)[:, None])
    smem._reinterpret(tile.dtype, [COLS_PAD, ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])).store(tile)


@gluon.jit
def int4_decode_staged(x_ptr, ids_ptr, weights_ptr, w13_ptr, s13_ptr, z13_ptr, w2_ptr, s2_ptr, z2_ptr, work_ptr,
                       T, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr, K_PAD: gl.constexpr,
                       G1_PAD: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr,
                       NUM_WARPS: gl.constexpr, ZERO_POINT: gl.constexpr, STAGES: gl.constexpr):
    """int4_decode_routed with its loads STAGES - 1 steps ahead through shared memory: each step's
    weight words and activation rows arrive by cp.async into a ring of STAGES slots (GEMM2's ring
    reuses GEMM1's), and the program's scales and zero points are staged once per GEMM, so no
    load of a step waits on memory in the step itself. BLOCK_H <= 256."""
    KB: gl.constexpr = GROUP // 32
    KB2: gl.constexpr = BLOCK_N // 32
    mma: gl.constexpr = mma_layout(NUM_WARPS)
    a_layout: gl.constexpr = operand_layout(0, mma)
    b_layout: gl.constexpr = operand_layout(1, mma)
    w_layout: gl.constexpr = words_layout(KB, NUM_WARPS)
    w2_layout: gl.constexpr = words_layout(KB2, NUM_WARPS)
    x_layout: gl.constexpr = activations_layout(NUM_WARPS)
    pick_layout: gl.constexpr = picks_layout(K_PAD, NUM_WARPS)
    groups_layout: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, NUM_WARPS], [0, 1])  # [groups, rows]
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NUM_WARPS], [1, 0])  # [1, rows]
    plain1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # tables read a row at a time
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    # A step's words of row n as in memory (word KB t + b at b + KB t): one cp.async of 16 bytes
    # per thread and row, read back by LDS.128 without bank conflicts.
    words_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1, 2])
    rows_mma: gl.constexpr = gl.SliceLayout(1, mma)
    cols_mma: gl.constexpr = gl.SliceLayout(0, mma)

    expert = gl.program_id(0)
    n0 = gl.program_id(1) * BLOCK_N
    picks, row_weight = _expert_picks(ids_ptr, weights_ptr, T, expert, TOP_K, K_PAD, pick_layout, rows_mma)
    if picks == 0:  # programs of unpicked experts end here
        return

    e64 = expert.to(gl.int64)
    # A step's words of the gate rows n0.. then the up rows I + n0.. of W13[expert]: one copy.
    on, step_words = _word_offsets(2 * BLOCK_N, KB, w_layout)
    w13_rows = n0 + on + gl.where(on < BLOCK_N, 0, I - BLOCK_N)
    w13_words = w13_ptr + e64 * (2 * I * (H // 8)) + w13_rows[None, None, :] * (H // 8) + step_words
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = x_ptr + xm[:, None] * H + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :]
    x_mask = (xm < T)[:, None]
    # The ring: slot s holds a step's gate and up words (GEMM1), then W2's words (GEMM2).
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, KB, 4, 2 * BLOCK_N], words_smem)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16, GROUP], plain2)
    steps1: gl.constexpr = H // GROUP
    for s in gl.static_range(STAGES - 1):
        cp.async_copy_global_to_shared(ring.index(s), w13_words + s * (GROUP // 8))
        cp.async_copy_global_to_shared(x_ring.index(s), x_ptrs + s * GROUP, mask=x_mask)
        cp.commit_group()

    # Both GEMMs' scales and zero points, once (their loads in flight with the ring's first steps).
    groups1: gl.constexpr = H // GROUP
    groups2: gl.constexpr = I // GROUP
    s13 = s13_ptr + e64 * (2 * I * groups1)
    z13 = z13_ptr + e64 * (2 * I * groups1)
    s2 = s2_ptr + e64 * (H * groups2) + n0 // GROUP
    z2 = z2_ptr + e64 * (H * groups2) + n0 // GROUP
    gate_scale = gl.allocate_shared_memory(s13_ptr.dtype.element_ty, [G1_PAD, BLOCK_N], plain1)
    up_scale = gl.allocate_shared_memory(s13_ptr.dtype.element_ty, [G1_PAD, BLOCK_N], plain1)
    down_scale = gl.allocate_shared_memory(s2_ptr.dtype.element_ty, [H // BLOCK_H, BLOCK_H], plain1)
    _stage_columns(gate_scale, s13, n0, groups1, groups1, G1_PAD, BLOCK_N, groups_layout)
    _stage_columns(up_scale, s13, I + n0, groups1, groups1, G1_PAD, BLOCK_N, groups_layout)
    _stage_columns(down_scale, s2, 0, groups2, 1, 1, H, rows_layout)
    if ZERO_POINT:
        gate_zero = gl.allocate_shared_memory(z13_ptr.dtype.element_ty, [G1_PAD, BLOCK_N], plain1)
        up_zero = gl.allocate_shared_memory(z13_ptr.dtype.element_ty, [G1_PAD, BLOCK_N], plain1)
        down_zero = gl.allocate_shared_memory(z2_ptr.dtype.element_ty, [H // BLOCK_H, BLOCK_H], plain1)
        _stage_columns(gate_zero, z13, n0, groups1, groups1, G1_PAD, BLOCK_N, groups_layout)
        _stage_columns(up_zero, z13, I + n0, groups1, groups1, G1_PAD, BLOCK_N, groups_layout)
        _stage_columns(down_zero, z2, 0, groups2, 1, 1, H, rows_layout)

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [16, GROUP], STAGING)
    gate = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    up = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    for step in range(steps1):
        cp.wait_group(STAGES - 2)
        gl.thread_barrier()  # every thread's copies of this step landed; last step's slot is read
        ahead = step + STAGES - 1
        if ahead < steps1:
            slot = ahead % STAGES
            cp.async_copy_global_to_shared(ring.index(slot), w13_words + ahead * (GROUP // 8))
            cp.async_copy_global_to_shared(x_ring.index(slot), x_ptrs + ahead * GROUP, mask=x_mask)
        cp.commit_group()
        slot = step % STAGES
        w_gate = _b_operand(ring.index(slot).slice(0, BLOCK_N, dim=2).load(w_layout), KB, BLOCK_N, b_layout)
        w_up = _b_operand(ring.index(slot).slice(BLOCK_N, BLOCK_N, dim=2).load(w_layout), KB, BLOCK_N, b_layout)
        x = x_ring.index(slot).load(x_layout)
        x_sum = gl.convert_layout(gl.sum(x.to(gl.float32), axis=1), rows_mma)
        x_smem.store(_nibble_order(x, KB))
        gl.thread_barrier()
        a = x_smem.load(a_layout)
        g_scale = gate_scale.index(step).load(cols_mma).to(gl.float32)
        u_scale = up_scale.index(step).load(cols_mma).to(gl.float32)
        if ZERO_POINT:
            g_offset = gate_zero.index(step).load(cols_mma).to(gl.float32) + 128.0
            u_offset = up_zero.index(step).load(cols_mma).to(gl.float32) + 128.0
        else:
            g_offset = gl.full([BLOCK_N], 136.0, gl.float32, layout=cols_mma)
            u_offset = g_offset
        part = mma_v2(a, w_gate, gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        gate += (part - x_sum[:, None] * g_offset[None, :]) * g_scale[None, :]
        part = mma_v2(a, w_up, gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        up += (part - x_sum[:, None] * u_offset[None, :]) * u_scale[None, :]

    # GEMM2's ring: the same slots, filled once every thread is done with GEMM1's.
    cp.wait_group(0)
    gl.thread_barrier()
    ring2 = ring._reinterpret(gl.int32, [STAGES, KB2, 4, BLOCK_H], words_smem)
    oh, step_words2 = _word_offsets(BLOCK_H, KB2, w2_layout)
    w2_words = w2_ptr + e64 * (H * (I // 8)) + oh[None, None, :] * (I // 8) + n0 // 8 + step_words2
    steps2: gl.constexpr = H // BLOCK_H
    for s in gl.static_range(STAGES - 1):
        if s < steps2:
            cp.async_copy_global_to_shared(ring2.index(s), w2_words + s * BLOCK_H * (I // 8))
        cp.commit_group()

    h = (gate / (1.0 + gl.exp(-gate)) * up * row_weight[:, None]).to(gl.bfloat16)
    h_sum = gl.sum(h.to(gl.float32), axis=1)
    h_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BLOCK_N], STAGING)
    h_smem.store(_nibble_order(gl.convert_layout(h, x_layout), KB2))
    gl.thread_barrier()
    h_a = h_smem.load(a_layout)
    om = gl.arange(0, 16, layout=rows_mma)
    sh = gl.arange(0, BLOCK_H, layout=cols_mma)
    for step in range(steps2):
        cp.wait_group(STAGES - 2)
        gl.thread_barrier()
        ahead = step + STAGES - 1
        if ahead < steps2:
            cp.async_copy_global_to_shared(ring2.index(ahead % STAGES), w2_words + ahead * BLOCK_H * (I // 8))
        cp.commit_group()
        w = _b_operand(ring2.index(step % STAGES).load(w2_layout), KB2, BLOCK_H, b_layout)
        scale = down_scale.index(step).load(cols_mma).to(gl.float32)
        if ZERO_POINT:
            offset = down_zero.index(step).load(cols_mma).to(gl.float32) + 128.0
        else:
            offset = gl.full([BLOCK_H], 136.0, gl.float32, layout=cols_mma)
        part = mma_v2(h_a, w, gl.zeros([16, BLOCK_H], gl.float32, layout=mma))
        y = (part - h_sum[:, None] * offset[None, :]) * scale[None, :]
        gl.atomic_add(work_ptr + om[:, None] * H + (step * BLOCK_H + sh)[None, :], y, mask=(om < T)[:, None],
                      sem="relaxed")


@gluon.jit
def _finish_group(part, x_sum, scale, zero, ZERO_POINT: gl.constexpr):
    """A group's float32 contribution (part - (128 + zero) * sum(x)) * scale."""
    if ZERO_POINT:
        offset = zero.to(gl.float32) + 128.0
        return (part - x_sum[:, None] * offset[None, :]) * scale.to(gl.float32)[None, :]
    else:
        return (part - x_sum[:, None] * 136.0) * scale.to(gl.float32)[None, :]


@gluon.jit
def _lean_gemm1_loads(w13_words, s13, z13, rows, k, I: gl.constexpr, H: gl.constexpr, ZERO_POINT: gl.constexpr):
    """A GEMM1 step's gate and up words, scales and zero points, as loaded."""
    groups: gl.constexpr = H // GROUP
    g_scale, g_zero = _group_raw(s13, z13, rows, k // GROUP, groups, ZERO_POINT)
    u_scale, u_zero = _group_raw(s13, z13, I + rows, k // GROUP, groups, ZERO_POINT)
    return gl.load(w13_words + k // 8), gl.load(w13_words + I * (H // 8) + k // 8), g_scale, g_zero, u_scale, u_zero


@gluon.jit
def int4_decode_lean(xp_ptr, xs_ptr, ids_ptr, weights_ptr, w13_ptr, s13_ptr, z13_ptr, w2_ptr, s2_ptr, z2_ptr,
                     work_ptr, T, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr, K_PAD: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr,
                     ZERO_POINT: gl.constexpr):
    """int4_decode_routed with every operand of a step loaded ahead, converted only where used:
    words, scales and zero points two steps ahead, the activations one (they come already in the
    nibbles' order with their group sums: lean_activations), staged in two buffers so that a step
    has one barrier."""
    KB: gl.constexpr = GROUP // 32
    KB2: gl.constexpr = BLOCK_N // 32
    mma: gl.constexpr = mma_layout(NUM_WARPS)
    a_layout: gl.constexpr = operand_layout(0, mma)
    b_layout: gl.constexpr = operand_layout(1, mma)
    w_layout: gl.constexpr = words_layout(KB, NUM_WARPS)
    w2_layout: gl.constexpr = words_layout(KB2, NUM_WARPS)
    x_layout: gl.constexpr = activations_layout(NUM_WARPS)
    pick_layout: gl.constexpr = picks_layout(K_PAD, NUM_WARPS)
    rows_mma: gl.constexpr = gl.SliceLayout(1, mma)
    cols_mma: gl.constexpr = gl.SliceLayout(0, mma)

    expert = gl.program_id(0)
    n0 = gl.program_id(1) * BLOCK_N
    picks, row_weight = _expert_picks(ids_ptr, weights_ptr, T, expert, TOP_K, K_PAD, pick_layout, rows_mma)
    if picks == 0:  # programs of unpicked experts end here
        return

    e64 = expert.to(gl.int64)
    on, step_words = _word_offsets(BLOCK_N, KB, w_layout)
    w13_words = w13_ptr + e64 * (2 * I * (H // 8)) + (n0 + on)[None, None, :] * (H // 8) + step_words
    groups1: gl.constexpr = H // GROUP
    s13 = s13_ptr + e64 * (2 * I * groups1)
    z13 = z13_ptr + e64 * (2 * I * groups1)
    sn = n0 + gl.arange(0, BLOCK_N, layout=cols_mma)
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = xp_ptr + xm[:, None] * H + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :]
    x_mask = (xm < T)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 16, GROUP], STAGING)  # two: one barrier a step
    xs_ptrs = xs_ptr + gl.arange(0, 16, layout=rows_mma) * groups1
    gate = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    up = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    ahead1 = _lean_gemm1_loads(w13_words, s13, z13, sn, 0, I, H, ZERO_POINT)
    ahead2 = _lean_gemm1_loads(w13_words, s13, z13, sn, GROUP, I, H, ZERO_POINT)
    x_next = gl.load(x_ptrs, mask=x_mask, other=0.0)  # (from L2: one step ahead is enough)
    x_sum_next = gl.load(xs_ptrs)
    for k in range(0, H, GROUP):
        now = ahead1
        ahead1 = ahead2
        if k + 2 * GROUP < H:
            ahead2 = _lean_gemm1_loads(w13_words, s13, z13, sn, k + 2 * GROUP, I, H, ZERO_POINT)
        x, x_sum = x_next, x_sum_next
        if k + GROUP < H:
            x_next = gl.load(x_ptrs + k + GROUP, mask=x_mask, other=0.0)
            x_sum_next = gl.load(xs_ptrs + k // GROUP + 1)
        x_buffer = x_smem.index((k // GROUP) % 2)
        x_buffer.store(x)
        gl.thread_barrier()
        a = x_buffer.load(a_layout)
        gate_now, up_now, g_scale, g_zero, u_scale, u_zero = now
        part = mma_v2(a, _b_operand(gate_now, KB, BLOCK_N, b_layout), gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        gate += _finish_group(part, x_sum, g_scale, g_zero, ZERO_POINT)
        part = mma_v2(a, _b_operand(up_now, KB, BLOCK_N, b_layout), gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        up += _finish_group(part, x_sum, u_scale, u_zero, ZERO_POINT)

    # GEMM2's first loads go out before the activation's math.
    oh, step_words2 = _word_offsets(BLOCK_H, KB2, w2_layout)
    w2_words = w2_ptr + e64 * (H * (I // 8)) + oh[None, None, :] * (I // 8) + n0 // 8 + step_words2
    groups2: gl.constexpr = I // GROUP
    s2 = s2_ptr + e64 * (H * groups2)
    z2 = z2_ptr + e64 * (H * groups2)
    sh = gl.arange(0, BLOCK_H, layout=cols_mma)
    scale1, zero1 = _group_raw(s2, z2, sh, n0 // GROUP, groups2, ZERO_POINT)
    ahead1 = (gl.load(w2_words), scale1, zero1)
    scale2, zero2 = _group_raw(s2, z2, BLOCK_H + sh, n0 // GROUP, groups2, ZERO_POINT)
    ahead2 = (gl.load(w2_words + BLOCK_H * (I // 8)), scale2, zero2)

    h = (gate / (1.0 + gl.exp(-gate)) * up * row_weight[:, None]).to(gl.bfloat16)
    h_sum = gl.sum(h.to(gl.float32), axis=1)
    h_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BLOCK_N], STAGING)
    h_smem.store(_nibble_order(gl.convert_layout(h, x_layout), KB2))
    gl.thread_barrier()
    h_a = h_smem.load(a_layout)
    om = gl.arange(0, 16, layout=rows_mma)
    for h0 in range(0, H, BLOCK_H):
        now = ahead1
        ahead1 = ahead2
        if h0 + 2 * BLOCK_H < H:
            scale_next, zero_next = _group_raw(s2, z2, h0 + 2 * BLOCK_H + sh, n0 // GROUP, groups2, ZERO_POINT)
            ahead2 = (gl.load(w2_words + (h0 + 2 * BLOCK_H) * (I // 8)), scale_next, zero_next)
        words, scale, zero = now
        part = mma_v2(h_a, _b_operand(words, KB2, BLOCK_H, b_layout), gl.zeros([16, BLOCK_H], gl.float32, layout=mma))
        y = _finish_group(part, h_sum, scale, zero, ZERO_POINT)
        gl.atomic_add(work_ptr + om[:, None] * H + (h0 + sh)[None, :], y, mask=(om < T)[:, None], sem="relaxed")


def lean_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4_decode_lean's activations: x [T <= 16, H] in the nibbles' order of each group (rows
    padded to 16 with zeros) and their group sums in float32 [16, H / GROUP]."""
    t, h = x.shape
    padded = torch.zeros(16, h, device=x.device, dtype=x.dtype)
    padded[:t] = x
    kb = GROUP_SIZE // 32
    perm = padded.reshape(16, h // GROUP_SIZE, 4, kb, 2, 2, 2).permute(
        0, 1, *(1 + d for d in ACTIVATION_ORDER.value[1:])).reshape(16, h)
    return perm.contiguous(), padded.float().reshape(16, h // GROUP_SIZE, GROUP_SIZE).sum(-1)


CONFIGS = ((64, 4, False), (64, 4, True), (128, 4, False), (128, 4, True), (128, 8, True), (256, 8, True))


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """Words [N, K / 8] of moegen's int4 layout as their nibbles [N, K] (uint8), input order."""
    from moegen.quant.quantize import unpack_int4

    return unpack_int4(words.view(torch.uint8), 8 * words.shape[1])


def repacked(words: torch.Tensor) -> torch.Tensor:
    """Words [N, K / 8] of moegen's int4 layout with each group's nibbles moved to where the probe
    reads MMA input L: word 4 t + b of a group, nibble 4 q + 16 e holds input
    32 b + 16 (q >> 1) + 8 (q & 1) + 2 t + e (the layout a repack at load time would store)."""
    n, k = words.shape[0], words.shape[1] * 8
    q = _nibbles(words).reshape(n, k // GROUP_SIZE, -1)
    t, b, j, e = torch.meshgrid(*(torch.arange(s) for s in (4, GROUP_SIZE // 32, 4, 2)), indexing="ij")
    source = (32 * b + 16 * (j >> 1) + 8 * (j & 1) + 2 * t + e).reshape(-1).to(words.device)
    nibbles = q[:, :, source].reshape(n, k // GROUP_SIZE, 4 * GROUP_SIZE // 32, 4, 2).to(torch.int64)
    shifts = (4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]).to(words.device)
    packed = (nibbles << shifts).sum(dim=(-2, -1))
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32).reshape(n, k // 8)


def _cuobjdump(cubin: bytes, *args: str) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path("/tmp/int4_gluon_probe.cubin")
    path.write_bytes(cubin)
    return subprocess.run([str(cuobjdump), *args, str(path)], capture_output=True, text=True, check=True).stdout


def registers(cubin: bytes) -> int:
    """Registers a thread of the cubin's kernel (what bounds the warps an SM holds)."""
    return int(re.search(r"REG:(\d+)", _cuobjdump(cubin, "--dump-resource-usage")).group(1))


def loop_counts(cubin: bytes) -> list[Counter]:
    """The opcodes of each backward-branch loop of a cubin's SASS, in code order."""
    sass = _cuobjdump(cubin, "-sass")
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in
            re.finditer(r"/\*([0-9a-f]{4,6})\*/\s*(.*?);", sass)]
    loops = sorted((int(b.group(1), 16), at) for at, text in code if (b := re.search(r"BRA (0x[0-9a-f]+)", text))
                   and int(b.group(1), 16) < at)
    return [Counter(text.split()[1 if text.startswith("@") else 0].split(".")[0]
                    for at, text in code if start <= at <= end) for start, end in loops]


def sass_report() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {"w_ptr": "*i32", "x_ptr": "*bf16", "scale_ptr": "*bf16", "out_ptr": "*fp32", "rows": "i32",
                 "K": "constexpr", "N": "constexpr", "BLOCK_N": "constexpr", "NUM_WARPS": "constexpr",
                 "PREFETCH": "constexpr", "REPACKED": "constexpr"}
    for repack in (False, True):
        for block_n, warps, prefetch in CONFIGS:
            src = GluonASTSource(int4_tile_gemm, signature,
                                 attrs={(i,): [["tt.divisibility", 16]] for i in range(4)},
                                 constexprs={"K": 4096, "N": 28672, "BLOCK_N": block_n, "NUM_WARPS": warps,
                                             "PREFETCH": prefetch, "REPACKED": repack})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            ops = max(loop_counts(kernel.asm["cubin"]), key=lambda loop: loop.total())
            total = ops.total()
            weights = GROUP_SIZE * block_n // (32 * warps)
            print(f"{'repacked' if repack else 'moegen'} layout, BLOCK_N {block_n:3d}, {warps} warps, prefetch "
                  f"{int(prefetch)}: {total} instructions a K step, {weights} weights a thread: "
                  f"{total / weights:.2f} a weight; {dict(ops.most_common(8))}")
    decode_signature = {"x_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*fp32", "w13_ptr": "*i32",
                        "s13_ptr": "*bf16", "z13_ptr": "*u8", "w2_ptr": "*i32", "s2_ptr": "*bf16", "z2_ptr": "*u8",
                        "work_ptr": "*fp32", "T": "i32"}
    for name, shape in DECODE_SHAPES:
        lean = without_prefetch(shape)
        for kernel_fn, constexprs in ((int4_decode_routed, shape), (int4_decode_staged, staged_shape(shape, 4)),
                                      (int4_decode_lean, lean), (int4_decode_mma, {**lean, "TOKENS": 8})):
            signature = {**decode_signature, **{key: "constexpr" for key in constexprs}}
            if kernel_fn is int4_decode_lean:
                signature = {"xp_ptr": "*bf16", "xs_ptr": "*fp32", **signature}
                del signature["x_ptr"]
            pointers = len(signature) - len(constexprs) - 1  # all but T
            src = GluonASTSource(kernel_fn, signature, constexprs=constexprs,
                                 attrs={(i,): [["tt.divisibility", 16]] for i in range(pointers)})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": shape["NUM_WARPS"]})
            gemm1, gemm2 = loop_counts(kernel.asm["cubin"])
            weights = 2 * GROUP_SIZE * shape["BLOCK_N"] // (32 * shape["NUM_WARPS"])
            weights2 = shape["BLOCK_H"] * shape["BLOCK_N"] // (32 * shape["NUM_WARPS"])
            print(f"decode {name} {kernel_fn.__name__}: GEMM1 {gemm1.total()} instructions a K step (gate and up) "
                  f"for {weights} weights a thread, {gemm1.total() / weights:.2f} a weight; GEMM2 {gemm2.total()} "
                  f"for {weights2}, {gemm2.total() / weights2:.2f}; {registers(kernel.asm['cubin'])} registers, "
                  f"{kernel.metadata.shared} bytes of shared memory; GEMM1 {dict(gemm1.most_common(8))}")


def _graph_us(timer, fn) -> float:
    """Microseconds of one replay of fn captured in a CUDA graph: the GPU's time, not the host's
    (an eager MoE call at one token is paced by its host code)."""
    from moegen.runtime.step_graphs import capture_graph

    graph, _ = capture_graph(fn, warmups=2)
    return timer.median_us(graph.replay)


def _probe_us(timer, words, scale, x, rows: int) -> float:
    """The fastest of CONFIGS on words [N, K / 8] of moegen's layout and on them repacked
    (microseconds), each checked against float64 (a wrong one is not counted)."""
    n, k = words.shape[0], words.shape[1] * 8
    ref = x[:rows].double() @ ((_nibbles(words).double() - 8) * scale.double().repeat_interleave(GROUP_SIZE, dim=1)).T
    best = float("inf")
    for repack, stored in ((False, words), (True, repacked(words))):
        for block_n, warps, prefetch in CONFIGS:
            out = torch.empty(16, n, device="cuda", dtype=torch.float32)

            def call():
                int4_tile_gemm[(n // block_n,)](stored, x, scale, out, rows, K=k, N=n, BLOCK_N=block_n,
                                                NUM_WARPS=warps, PREFETCH=prefetch, REPACKED=repack,
                                                num_warps=warps)

            call()
            torch.cuda.synchronize()
            err = ((out[:rows].double() - ref).norm() / ref.norm()).item()
            us = _graph_us(timer, call)
            wrong = not err < 1e-4  # float32 sums of exact products: ~1e-6
            print(f"    {'repacked' if repack else 'moegen'} layout, BLOCK_N {block_n:3d}, {warps} warps, prefetch "
                  f"{int(prefetch)}: {us:7.1f} us, err {err:.1e}" + (" WRONG" if wrong else ""), flush=True)
            if not wrong:
                best = min(best, us)
    return best


def _random_words(n: int, k: int):
    from moegen.quant.quantize import pack_int4

    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    scale = (torch.rand(n, k // GROUP_SIZE, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
    return pack_int4(q[None])[0].view(torch.int32), scale  # moegen's int4 layout as the words the probe loads


def gpu_report(specs: list[str], decode_only: bool = False, profile: bool = False, kinds: tuple = (),
               one_expert: bool = False) -> None:
    """Per spec, one token: moegen's int4 layer (routing, both GEMMs, the reduction) against the
    probe on the same weight bytes (the top-k experts' W13 and W2 stacked along N), both against
    the read-only bound of those bytes; then the Gluon decode kernel against fused_experts."""
    import tempfile

    from moegen import load
    from moegen.bench.cells import Workload
    from moegen.bench.roofline import Timer, read_only_us
    from moegen.package import build

    torch.manual_seed(0)
    timer = Timer(torch.device("cuda"), quick=True)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for spec in specs:
        pkg = load(build(Path(spec), Path(tempfile.mkdtemp(prefix="int4-probe-")))[0])
        m = pkg.SPEC.model
        if decode_only or profile:
            decode_report(timer, pkg, spec, profile, kinds, one_expert)
            continue
        work = Workload(pkg, torch.device("cuda"), 79)
        x1, logits = work.inputs(1)
        layer_us = _graph_us(timer, lambda: work.kernel_call(x1, logits, work.w13, work.w2))
        stored = work.stored(work.w13, work.w2)
        layer_bytes = sum(t.nbytes for part in stored for t in part.values()) * m.top_k // m.num_experts
        del work
        shapes = (("W13", m.top_k * 2 * m.intermediate_size, m.hidden_size),
                  ("W2", m.top_k * m.hidden_size, m.intermediate_size))
        probe_us, probe_bytes = 0.0, 0
        x = torch.zeros(16, max(k for _, _, k in shapes), device="cuda", dtype=torch.bfloat16)
        x.normal_()
        for name, n, k in shapes:
            words, scale = _random_words(n, k)
            print(f"  {spec} {name} of the top {m.top_k} experts (N {n}, K {k}), one row:", flush=True)
            probe_us += _probe_us(timer, words, scale, x[:, :k].contiguous(), 1)
            probe_bytes += words.nbytes + scale.nbytes
        read_only = read_only_us(timer, layer_bytes)
        print(f"{spec}, one token: moegen int4 layer {layer_us:.1f} us ({layer_us / read_only:.2f}x read-only of "
              f"its {layer_bytes / 1e6:.1f} MB); probe W13 + W2 {probe_us:.1f} us ({probe_us / read_only:.2f}x, "
              f"{probe_bytes / 1e6:.1f} MB, no routing, activation or reduction); read-only {read_only:.1f} us",
              flush=True)
        decode_report(timer, pkg, spec, kinds=kinds)


DECODE_SHAPES = (("Mixtral-8x7B", dict(H=4096, I=14336, TOP_K=2, K_PAD=2, BLOCK_N=128, BLOCK_H=256, NUM_WARPS=4,
                                        ZERO_POINT=True, PREFETCH=True)),
                 ("Qwen3-30B-A3B", dict(H=2048, I=768, TOP_K=8, K_PAD=8, BLOCK_N=64, BLOCK_H=128, NUM_WARPS=4,
                                         ZERO_POINT=False, PREFETCH=True)))


def without_prefetch(shape: dict) -> dict:
    """int4_decode_routed's constexprs less PREFETCH: those of the kernels that load ahead their own way."""
    return {key: value for key, value in shape.items() if key != "PREFETCH"}


def staged_shape(shape: dict, stages: int) -> dict:
    """int4_decode_routed's constexprs as int4_decode_staged's, with `stages` slots."""
    return {**without_prefetch(shape), "G1_PAD": triton.next_power_of_2(shape["H"] // GROUP_SIZE), "STAGES": stages}


# (kind, BLOCK_N, BLOCK_H, warps, loads ahead or stages, register cap or None)
DECODE_CONFIGS = (("routed", 128, 256, 8, 1, None), ("routed", 64, 128, 4, 1, None), ("routed", 128, 256, 8, 1, 96),
                  ("staged", 128, 256, 4, 3, None), ("staged", 128, 256, 4, 4, None), ("staged", 64, 128, 4, 6, None),
                  ("lean", 128, 256, 8, 2, None), ("lean", 64, 128, 4, 2, None), ("lean", 128, 256, 8, 2, 128),
                  ("swapped", 128, 256, 8, 1, None), ("swapped", 128, 256, 4, 1, None),
                  ("swapped", 64, 128, 4, 1, None), ("swapped", 64, 256, 4, 1, None),
                  ("swapped", 128, 256, 8, 1, 80), ("swapped", 64, 128, 4, 1, 80))


def _decode_kernel(kind: str, x, m, k_pad: int, block_n: int, block_h: int, warps: int, depth: int,
                   zero_point: bool):
    """The decode kernel of a config, its activation arguments and its constexprs."""
    shape = dict(H=m.hidden_size, I=m.intermediate_size, TOP_K=m.top_k, K_PAD=k_pad, BLOCK_N=block_n,
                 BLOCK_H=block_h, NUM_WARPS=warps, ZERO_POINT=zero_point, PREFETCH=depth)
    if kind == "routed":
        return int4_decode_routed, (x,), shape
    if kind == "staged":
        return int4_decode_staged, (x,), staged_shape(shape, depth)
    if kind == "swapped":
        return int4_decode_mma, (x,), {**without_prefetch(shape), "TOKENS": 8 if x.shape[0] <= 8 else 16}
    # the activations' layout made once a step, outside the timed kernel
    return int4_decode_lean, lean_activations(x), without_prefetch(shape)


PROFILE_CONFIGS = (("routed", 128, 256, 8, 1), ("staged", 128, 256, 4, 3), ("lean", 128, 256, 8, 2),
                   ("swapped", 128, 256, 8, 1))


def decode_report(timer, pkg, spec: str, profile: bool = False, kinds: tuple = (), one_expert: bool = False) -> None:
    """int4_decode_routed against moegen's fused_experts (int4, the same picks and stored
    weights) at 1, 8 and 16 tokens, both checked against the float64 reference of the layer,
    with the read-only bound of the picked experts' bytes. one_expert: every pick moved to each
    token's first expert (fewer programs for the same work a program: does the SMs' throughput or
    each program's own chain bound the kernel?), checked against fused_experts on those picks."""
    from moegen.bench.cells import Workload
    from moegen.bench.roofline import read_only_us
    from moegen.reference import relative_error
    from moegen.runtime.routing import route

    m = pkg.SPEC.model
    work = Workload(pkg, torch.device("cuda"), 80)
    stored13, stored2 = work.stored(work.w13, work.w2)
    zero_point = "zero" in stored13
    tensors = (stored13["weight"].view(torch.int32), stored13["scale"], stored13.get("zero", stored13["scale"]),
               stored2["weight"].view(torch.int32), stored2["scale"], stored2.get("zero", stored2["scale"]))
    expert_bytes = sum(t.nbytes for part in (stored13, stored2) for t in part.values()) // m.num_experts
    k_pad = triton.next_power_of_2(m.top_k)
    for tokens in (1,) if profile else (1, 8, 16):
        x, logits = work.inputs(tokens)
        weights, ids = route(logits, pkg.KERNELS.routing, work.bias)
        if one_expert:
            ids = ids[:, :1].expand(-1, ids.shape[1]).contiguous()
            ref = work.experts_call(x, weights, ids, work.w13, work.w2).double()
        else:
            ref = work.reference(x, logits, work.w13, work.w2)
        pick_weights, pick_ids = weights.float().contiguous(), ids.to(torch.int32).contiguous()
        if profile:  # one launch of each of the fastest configs per kind, for Nsight Compute
            for kind, block_n, block_h, warps, depth in PROFILE_CONFIGS:
                out = torch.zeros(tokens, m.hidden_size, device="cuda", dtype=torch.float32)
                kernel, activations, constexprs = _decode_kernel(kind, x, m, k_pad, block_n, block_h, warps, depth,
                                                                 zero_point)
                for _ in range(2):
                    compiled = kernel[(m.num_experts, m.intermediate_size // block_n)](
                        *activations, pick_ids, pick_weights, *tensors, out, tokens, **constexprs, num_warps=warps)
                print(f"  {kind} {block_n}/{block_h}/{warps}/{depth}: {compiled.n_regs} registers, "
                      f"{compiled.n_spills} spilled, {compiled.metadata.shared} bytes of shared memory", flush=True)
            torch.cuda.synchronize()
            return
        peer = lambda: work.experts_call(x, weights, ids, work.w13, work.w2)  # noqa: E731
        peer_err = relative_error(peer(), ref)
        peer_us = _graph_us(timer, peer)
        read_only = read_only_us(timer, ids.unique().numel() * expert_bytes)
        print(f"{spec}, {tokens} tokens: moegen fused_experts int4 {peer_us:.1f} us "
              f"({peer_us / read_only:.2f}x read-only {read_only:.1f} us), err {peer_err:.1e}", flush=True)
        for kind, block_n, block_h, warps, depth, maxnreg in DECODE_CONFIGS:
            if m.intermediate_size % block_n or m.hidden_size % block_h or (kinds and kind not in kinds):
                continue
            out = torch.zeros(tokens, m.hidden_size, device="cuda", dtype=torch.float32)
            kernel, activations, constexprs = _decode_kernel(kind, x, m, k_pad, block_n, block_h, warps, depth,
                                                             zero_point)

            def call():
                out.zero_()
                kernel[(m.num_experts, m.intermediate_size // block_n)](
                    *activations, pick_ids, pick_weights, *tensors, out, tokens, **constexprs, num_warps=warps,
                    maxnreg=maxnreg)

            try:
                call()
            except Exception as error:  # e.g. more shared memory than the card has
                print(f"  Gluon {kind} {block_n}/{block_h}/{warps}/{depth}/{maxnreg}: {type(error).__name__}: "
                      f"{str(error)[:200]}", flush=True)
                continue
            err = relative_error(out.to(x.dtype), ref)
            us = _graph_us(timer, call)
            print(f"  Gluon decode {kind}, BLOCK_N {block_n}, BLOCK_H {block_h}, {warps} warps, "
                  f"{'' if maxnreg is None else f'at most {maxnreg} registers, '}"
                  f"{'stages' if kind == 'staged' else 'ahead'} {int(depth)}: {us:.1f} us "
                  f"({us / read_only:.2f}x read-only, {peer_us / us:.2f}x fused_experts), err {err:.1e}", flush=True)


@triton.jit
def _read_steps(w_ptr, out_ptr, ROW_WORDS: tl.constexpr, STEP_WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
                TILED: tl.constexpr):
    """Reads rows [BLOCK_N] of int32 words in steps of STEP_WORDS along the row, as the int4 GEMMs
    walk K (TILED: each step's tile is contiguous in memory instead)."""
    pid = tl.program_id(0)
    on = tl.arange(0, BLOCK_N)[:, None]
    ok = tl.arange(0, STEP_WORDS)[None, :]
    acc = tl.zeros([BLOCK_N, STEP_WORDS], tl.int32)
    for k in range(0, ROW_WORDS, STEP_WORDS):
        if TILED:
            acc ^= tl.load(w_ptr + pid * BLOCK_N * ROW_WORDS + k * BLOCK_N + on * STEP_WORDS + ok)
        else:
            acc ^= tl.load(w_ptr + (pid * BLOCK_N + on) * ROW_WORDS + k + ok)
    tl.store(out_ptr + pid * BLOCK_N * STEP_WORDS + on * STEP_WORDS + ok, acc)


def read_pattern_report() -> None:
    """Mixtral-8x7B's top-2 W13 bytes at one token (57344 rows of 2048 bytes) read as the int4
    GEMMs walk them, step by step along K, against one streaming read of the same bytes."""
    from moegen.bench.roofline import Timer, read_only_us

    timer = Timer(torch.device("cuda"), quick=True)
    rows, row_words = 2 * 2 * 14336, 4096 // 8
    w = torch.randint(-2**31, 2**31 - 1, (rows, row_words), device="cuda", dtype=torch.int32)
    read_only = read_only_us(timer, w.nbytes)
    print(f"{torch.cuda.get_device_name()}: {w.nbytes / 1e6:.1f} MB, read-only {read_only:.1f} us", flush=True)
    for tiled in (False, True):
        for block_n in (64, 128, 256):
            for step_words in (16, 32, 64, 128):
                for warps, stages in ((4, 3), (8, 4)):
                    out = torch.empty(rows, step_words, device="cuda", dtype=torch.int32)

                    def call():
                        _read_steps[(rows // block_n,)](w, out, ROW_WORDS=row_words, STEP_WORDS=step_words,
                                                        BLOCK_N=block_n, TILED=tiled, num_warps=warps,
                                                        num_stages=stages)

                    us = _graph_us(timer, call)
                    print(f"  {'tiled' if tiled else 'rows'}, BLOCK_N {block_n:3d}, {4 * step_words:3d} bytes a row "
                          f"and step, {warps} warps, {stages} stages: {us:6.1f} us ({us / read_only:.2f}x)",
                          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="compile for sm_90 (no GPU needed) and count the K loop")
    parser.add_argument("--specs", default="specs/mixtral-8x7b-int4.yaml,specs/qwen3-30b-a3b-int4.yaml",
                        help="int4 specs whose one-token layer is compared (comma-separated)")
    parser.add_argument("--read-pattern", action="store_true", help="on a GPU: the GEMMs' read pattern alone")
    parser.add_argument("--profile", action="store_true",
                        help="on a GPU: one launch of the fastest decode configs, for Nsight Compute")
    parser.add_argument("--kinds", default="", help="decode kernels to run (comma-separated: routed, staged, "
                        "lean, swapped; default all)")
    parser.add_argument("--decode-only", action="store_true", help="on a GPU: only the decode kernels' report")
    parser.add_argument("--one-expert", action="store_true",
                        help="with --decode-only: every token's picks on its first expert (fewer programs)")
    args = parser.parse_args()
    if args.sass:
        sass_report()
    elif torch.cuda.is_available() and args.read_pattern:
        read_pattern_report()
    elif torch.cuda.is_available():
        gpu_report(args.specs.split(","), args.decode_only, args.profile,
                   tuple(kind for kind in args.kinds.split(",") if kind), args.one_expert)
    else:
        print("no GPU: run with --sass to count instructions, or on a GPU to check and time", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
