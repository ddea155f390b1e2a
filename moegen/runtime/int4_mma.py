"""The int4 decode kernel in Gluon: a whole layer's experts for up to 16 tokens whose picks are
given, int4_group weights (groups of 128, with or without zero points) in a bf16 model.

Triton 3.6 multiplies a dequantized int4 tile with both MMA operands in kWidth 8, and assembles
every HMMA's operand with register moves (~4.4 instructions a weight in the templates' decode
kernel). Gluon lets the kernel state its layouts: each thread loads exactly the nibbles of its
mma.sync A fragments (the weights are the MMA's A operand, 16 rows a fragment; the tokens its N,
8 or 16), a shift and a LOP3 make each bf16x2 register of 128 + nibble, and the activations
reach the MMA through shared memory permuted to the order the nibbles come in. Each group's
product is finished in float32 as (product - (128 + zero) * sum of the activations) * scale.
The weights stay in moegen's int4 layout (moegen/quant/formats.py). Measured against the
templates' decode kernel and the read-only bound in docs/PERFORMANCE.md; the tuner chooses it
per bucket (KernelConfig.decode_int4_mma) where plan.configs.int4_mma_violation allows.

Grid: (expert, BLOCK_N slice of I); programs of experts no token picked end at once. Each
program computes its slice of act(gate) * up for the batch, weights it by the router weights,
rounds it to bf16 as the three-kernel path stores the intermediate, and adds its product with
the matching columns of W2 into the float32 workspace [T, H] (fused.decode_workspace).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

GROUP_SIZE = 128  # inputs per scale: one K step
GROUP = gl.constexpr(GROUP_SIZE)


# Two words w0, w1 of a thread (consecutive registers: pack=2), eight nibbles each. Output p is
# the bf16x2 (128 + nibble at bit 4 (p % 4), 128 + nibble at bit 16 + 4 (p % 4)) of word p // 4:
# its low lane is the element of w0, its high lane that of w1.
UNPACK = gl.constexpr(
    "{\n.reg .b32 a1, a2, a3, b1, b2, b3;\n"
    "shr.u32 a1, $8, 4;\nshr.u32 a2, $8, 8;\nshr.u32 a3, $8, 12;\n"
    "shr.u32 b1, $9, 4;\nshr.u32 b2, $9, 8;\nshr.u32 b3, $9, 12;\n"
    "lop3.b32 $0, $8, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $1, a1, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 $2, a2, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $3, a3, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 $4, $9, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $5, b1, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 $6, b2, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $7, b3, 0x000F000F, 0x43004300, 0xEA;\n}")


# The activations' inputs [rows, t, b, e, a, c] of a step permuted to (m, b, a, c, t, e): the order in
# which the unpacked nibbles meet them in the MMA (_nibble_order).
ACTIVATION_ORDER = gl.constexpr((0, 2, 4, 5, 1, 3))


@gluon.constexpr_function
def mma_layout(num_warps, swapped=False):
    """mma.sync m16n8k16's accumulators, the warps along N (or along M, swapped)."""
    warps = [num_warps, 1] if swapped else [1, num_warps]
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=warps, instr_shape=[16, 8])


@gluon.constexpr_function
def operand_layout(index, mma):
    """The MMA's A (0) or B (1) operand, two bf16 a register (kWidth 2)."""
    return gl.DotOperandLayout(operand_index=index, parent=mma, k_width=2)


@gluon.constexpr_function
def swapped_words_layout(kb, num_warps):
    """A step's words [KB, 4, rows / 16, 2, 8] (b, t, q, h, g) for row 16 q + 8 h + g: lanes hold t
    and g, registers b and h (rows g and g + 8 of the A fragment), warps q."""
    return gl.BlockedLayout([kb, 1, 1, 2, 1], [1, 4, 1, 1, 8], [1, 1, num_warps, 1, 1], [0, 3, 1, 4, 2])


@gluon.constexpr_function
def activations_layout(num_warps):
    """Activation rows [rows, 128]: eight consecutive inputs a thread."""
    return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def picks_layout(k_pad, num_warps):
    """Picks [tokens, K_PAD]: one token's picks a thread."""
    return gl.BlockedLayout([1, k_pad], [32, 1], [num_warps, 1], [1, 0])


# Activation tiles staged for LDSM.
STAGING = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))


@gluon.jit
def _nibble_order(x, KB: gl.constexpr):
    """Activations [rows, 32 KB] permuted into the order the unpacked nibbles come in (_a_operand):
    input 8 KB t + 8 b + 4 e + 2 a + c to MMA input L = 32 b + 16 a + 8 c + 2 t + e."""
    rows: gl.constexpr = x.shape[0]
    return gl.reshape(gl.permute(gl.reshape(x, [rows, 4, KB, 2, 2, 2]), ACTIVATION_ORDER.value), [rows, 32 * KB])


@gluon.jit
def _group_offset(s_ptr, z_ptr, rows, group, groups: gl.constexpr, ZERO_POINT: gl.constexpr):
    """Scales (float32) and 128 + zero points of `rows` for one group."""
    scale, zero = _group_raw(s_ptr, z_ptr, rows, group, groups, ZERO_POINT)
    scale = scale.to(gl.float32)
    if ZERO_POINT:
        offset = zero.to(gl.float32) + 128.0
    else:
        offset = gl.full(scale.shape, 136.0, gl.float32, layout=scale.type.layout)
    return scale, offset


@gluon.jit
def _expert_picks(ids_ptr, weights_ptr, T, expert, TOP_K: gl.constexpr, K_PAD: gl.constexpr,
                  pick_layout: gl.constexpr, rows_layout: gl.constexpr, TOKENS: gl.constexpr = 16):
    """How many of the T (<= TOKENS) tokens' picks (ids, weights [T, TOP_K]) name `expert`, and
    each token's router weight for it (0 where it did not pick it)."""
    pm = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, pick_layout))
    pk = gl.arange(0, K_PAD, layout=gl.SliceLayout(0, pick_layout))
    pick_ok = (pm < T)[:, None] & (pk < TOP_K)[None, :]
    chose = gl.load(ids_ptr + pm[:, None] * TOP_K + pk[None, :], mask=pick_ok, other=-1) == expert
    row_weight = gl.sum(gl.where(chose, gl.load(weights_ptr + pm[:, None] * TOP_K + pk[None, :], mask=pick_ok,
                                                other=0.0).to(gl.float32), 0.0), axis=1)
    return gl.sum(gl.sum(chose.to(gl.int32), axis=1), axis=0), gl.convert_layout(row_weight, rows_layout)


@gluon.jit
def _group_raw(s_ptr, z_ptr, rows, group, groups: gl.constexpr, ZERO_POINT: gl.constexpr):
    """The scales and zero points of `rows` for one group as loaded (converted only where used,
    so that a load ahead does not wait)."""
    scale = gl.load(s_ptr + rows * groups + group)
    if ZERO_POINT:
        zero = gl.load(z_ptr + rows * groups + group)
    else:
        zero = scale
    return scale, zero


# A step's words [KB, 4, BLOCK_N / 16, 2, 8] (b, t, q, h, g) for row n = 16 q + 8 h + g, unpacked
# (UNPACK's eight outputs joined: p = 4 d + 2 a + c), split by lane e (which word of a pair) and
# permuted to (q, h, g, i, d, a, c, t, e): rows, then MMA input.
SWAPPED_ORDER = gl.constexpr((3, 4, 5, 0, 8, 7, 6, 2, 1))


@gluon.jit
def _swapped_words(ptr, row0, row_words, BLOCK_N: gl.constexpr, KB: gl.constexpr, layout: gl.constexpr):
    """Pointers to a step's words of rows row0.. [KB, 4, BLOCK_N / 16, 2, 8] in `layout`
    (swapped_words_layout): a thread's KB words of a row are contiguous (word KB t + b of the
    row's step; one 16-byte load at KB 4)."""
    l4: gl.constexpr = gl.SliceLayout(4, layout)
    l3: gl.constexpr = gl.SliceLayout(3, l4)
    l2: gl.constexpr = gl.SliceLayout(2, l3)
    ob = gl.arange(0, KB, layout=gl.SliceLayout(1, l2))[:, None, None, None, None]
    ot = gl.arange(0, 4, layout=gl.SliceLayout(0, l2))[None, :, None, None, None]
    oq = gl.arange(0, BLOCK_N // 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))[None, None, :, None, None]
    oh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, l4))))
    og = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))))
    rows = row0 + 16 * oq + 8 * oh[None, None, None, :, None] + og[None, None, None, None, :]
    return ptr + rows * row_words + ot * KB + ob


@gluon.jit
def _a_operand(words, KB: gl.constexpr, BLOCK_N: gl.constexpr, a_layout: gl.constexpr):
    """The MMA's A operand [BLOCK_N, 32 KB] (128 + nibble, bf16) of a step's words laid out by
    _swapped_words: output p = 4 d + 2 a + c of the pair of words (2 i, 2 i + 1), lane e, is MMA
    input L = 64 i + 32 d + 16 a + 8 c + 2 t + e and holds the step's input
    8 KB t + 8 (2 i + d) + 4 e + 2 a + c (assert_trivial: the tile is the operand in the registers
    the PTX wrote)."""
    o = gl.inline_asm_elementwise(UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                  dtype=[gl.bfloat16] * 8, is_pure=True, pack=2)
    w = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])),
                gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))  # [KB, 4, Q, 2, 8, c, a, d]
    w = gl.permute(gl.reshape(w, [KB // 2, 2, 4, BLOCK_N // 16, 2, 8, 2, 2, 2]), SWAPPED_ORDER.value)
    return gl.convert_layout(gl.reshape(w, [BLOCK_N, 32 * KB]), a_layout, assert_trivial=True)


@gluon.jit(do_not_specialize=["T"])  # one compiled kernel for every batch of up to TOKENS
def int4_decode_mma(x_ptr, ids_ptr, weights_ptr, w13_ptr, s13_ptr, z13_ptr, w2_ptr, s2_ptr, z2_ptr, work_ptr,
                    T, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr, K_PAD: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr,
                    ZERO_POINT: gl.constexpr, TOKENS: gl.constexpr):
    """work[:T] += the experts' outputs of x [T, H] (T <= TOKENS, 8 or 16) for the picks ids,
    weights [T, TOP_K]; weights as int32 words of moegen's int4 layout, scales and zero points
    [E, N, groups]. The accumulators are [rows, tokens]; one step of words is loaded ahead."""
    KB: gl.constexpr = GROUP // 32
    KB2: gl.constexpr = BLOCK_N // 32
    mma: gl.constexpr = mma_layout(NUM_WARPS, swapped=True)
    a_layout: gl.constexpr = operand_layout(0, mma)
    b_layout: gl.constexpr = operand_layout(1, mma)
    w_layout: gl.constexpr = swapped_words_layout(KB, NUM_WARPS)
    w2_layout: gl.constexpr = swapped_words_layout(KB2, NUM_WARPS)
    x_layout: gl.constexpr = activations_layout(NUM_WARPS)
    pick_layout: gl.constexpr = picks_layout(K_PAD, NUM_WARPS)
    rows_mma: gl.constexpr = gl.SliceLayout(1, mma)
    tokens_mma: gl.constexpr = gl.SliceLayout(0, mma)

    expert = gl.program_id(0)
    n0 = gl.program_id(1) * BLOCK_N
    picks, token_weight = _expert_picks(ids_ptr, weights_ptr, T, expert, TOP_K, K_PAD, pick_layout, tokens_mma,
                                        TOKENS)
    if picks == 0:  # programs of unpicked experts end here
        return

    e64 = expert.to(gl.int64)
    gate_words = _swapped_words(w13_ptr + e64 * (2 * I * (H // 8)), n0, H // 8, BLOCK_N, KB, w_layout)
    up_words = gate_words + I * (H // 8)
    sn = n0 + gl.arange(0, BLOCK_N, layout=rows_mma)
    groups1: gl.constexpr = H // GROUP
    s13 = s13_ptr + e64 * (2 * I * groups1)
    z13 = z13_ptr + e64 * (2 * I * groups1)
    xm = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = x_ptr + xm[:, None] * H + gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_layout))[None, :]
    x_mask = (xm < T)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [TOKENS, GROUP], STAGING)
    gate = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout=mma)
    up = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout=mma)
    gate_next = gl.load(gate_words)
    up_next = gl.load(up_words)
    for k in range(0, H, GROUP):
        gate_now, up_now = gate_next, up_next
        if k + GROUP < H:
            gate_next = gl.load(gate_words + (k + GROUP) // 8)
            up_next = gl.load(up_words + (k + GROUP) // 8)
        g_scale, g_offset = _group_offset(s13, z13, sn, k // GROUP, groups1, ZERO_POINT)
        u_scale, u_offset = _group_offset(s13, z13, I + sn, k // GROUP, groups1, ZERO_POINT)
        x = gl.load(x_ptrs + k, mask=x_mask, other=0.0)
        x_sum = gl.convert_layout(gl.sum(x.to(gl.float32), axis=1), tokens_mma)
        gl.thread_barrier()
        x_smem.store(_nibble_order(x, KB))
        gl.thread_barrier()
        b = x_smem.permute([1, 0]).load(b_layout)
        zero = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout=mma)
        part = mma_v2(_a_operand(gate_now, KB, BLOCK_N, a_layout), b, zero)
        gate += (part - g_offset[:, None] * x_sum[None, :]) * g_scale[:, None]
        part = mma_v2(_a_operand(up_now, KB, BLOCK_N, a_layout), b, zero)
        up += (part - u_offset[:, None] * x_sum[None, :]) * u_scale[:, None]

    # The slice of the intermediate [tokens, BLOCK_N], weighted and rounded as the three-kernel
    # path stores it, staged once as GEMM2's B operand.
    h = (gate / (1.0 + gl.exp(-gate)) * up * token_weight[None, :]).to(gl.bfloat16)
    h_sum = gl.sum(h.to(gl.float32), axis=0)
    h_smem = gl.allocate_shared_memory(gl.bfloat16, [TOKENS, BLOCK_N], STAGING)
    h_smem.store(_nibble_order(gl.convert_layout(gl.permute(h, [1, 0]), x_layout), KB2))
    gl.thread_barrier()
    h_b = h_smem.permute([1, 0]).load(b_layout)

    # GEMM2: rows h0.. of W2[expert], inputs n0.. (one group), added into the work rows.
    w2_words = _swapped_words(w2_ptr + e64 * (H * (I // 8)) + n0 // 8, 0, I // 8, BLOCK_H, KB2, w2_layout)
    groups2: gl.constexpr = I // GROUP
    s2 = s2_ptr + e64 * (H * groups2)
    z2 = z2_ptr + e64 * (H * groups2)
    ot = gl.arange(0, TOKENS, layout=tokens_mma)
    sh = gl.arange(0, BLOCK_H, layout=rows_mma)
    w2_next = gl.load(w2_words)
    for h0 in range(0, H, BLOCK_H):
        w2_now = w2_next
        if h0 + BLOCK_H < H:
            w2_next = gl.load(w2_words + (h0 + BLOCK_H) * (I // 8))
        scale, offset = _group_offset(s2, z2, h0 + sh, n0 // GROUP, groups2, ZERO_POINT)
        part = mma_v2(_a_operand(w2_now, KB2, BLOCK_H, a_layout), h_b,
                      gl.zeros([BLOCK_H, TOKENS], gl.float32, layout=mma))
        y = (part - offset[:, None] * h_sum[None, :]) * scale[:, None]
        gl.atomic_add(work_ptr + ot[None, :] * H + (h0 + sh)[:, None], y, mask=(ot < T)[None, :], sem="relaxed")
