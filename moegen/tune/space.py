"""The tuning search space: per token bucket, candidate configs pruned before anything compiles
(resource limits, dimension clamps, duplicates). GEMM1 and GEMM2 are searched one after the
other (coordinate descent), so the space grows with their sum, not their product."""
from __future__ import annotations

from dataclasses import replace

from moegen.ir import KernelSignature
from moegen.plan.configs import (INT4_MMA_GROUP, TAIL_ROWS, clamp_tiles, default_config, descriptors_possible,
                                 expects_tail_rows, fit_format, int4_large_blocks, two_programs_register_cap,
                                 violation)
from moegen.runtime.fused import DECODE_MAX_TOKENS, KernelConfig
from moegen.target import GpuTarget

# (block_n, block_k, num_warps, num_stages) of GEMM1, by regime: few rows per block (weights
# streamed, memory-bound), a middle one, many rows (compute-bound). The eight-warp row-block
# tiles are for dequantizing formats at decode sizes, where programs are fewer than SMs and one
# warp a scheduler leaves the dequantization's latencies bare. The last two fit shared memory
# only where weights take fewer bytes than bf16 (int4, fp8): a stage of int4 tiles holds a
# quarter of the bytes, so the same depth keeps a quarter of the bytes in flight.
GATE_UP_MEMORY = ((32, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 6), (128, 128, 4, 3), (32, 256, 4, 3),
                  (64, 256, 4, 3), (128, 64, 4, 4), (64, 128, 8, 4), (32, 128, 8, 4), (64, 256, 4, 4),
                  (32, 256, 4, 6))
GATE_UP_MIDDLE = ((128, 64, 4, 4), (64, 128, 4, 4), (128, 64, 8, 3), (64, 64, 4, 4), (128, 128, 4, 3))
GATE_UP_COMPUTE = ((64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 3),
                   (64, 64, 8, 5), (128, 32, 4, 5))
# (down_block_n, down_block_k, num_warps, num_stages, split_k) of GEMM2, by regime. The last
# fits shared memory only for int4 weights (GATE_UP_MEMORY's deep tiles, for W2).
DOWN_MEMORY = ((64, 128, 4, 4, 1), (32, 128, 4, 4, 1), (64, 128, 4, 4, 2), (32, 256, 4, 3, 2),
               (128, 128, 4, 3, 1), (64, 64, 4, 6, 4), (32, 128, 4, 4, 4), (64, 128, 8, 4, 1), (64, 512, 4, 3, 1))
DOWN_MIDDLE = ((256, 64, 4, 3, 1), (128, 64, 4, 4, 1), (128, 128, 4, 3, 1), (256, 64, 8, 3, 1))
DOWN_COMPUTE = ((128, 64, 8, 3, 1), (128, 64, 4, 4, 1), (64, 128, 4, 3, 1), (128, 128, 8, 3, 1),
                (256, 64, 8, 3, 1), (64, 64, 4, 5, 1))
# (block_n, block_k, block_h, num_warps, num_stages) of the one-launch decode kernel: wide
# slices of I and output chunks (fewer atomics) measured best on the H200; the two narrow
# slices are for experts with few columns of I (on the four H200 shapes they won no bucket:
# more programs did not beat the per-program latencies, docs/PERFORMANCE.md).
DECODE = ((64, 128, 256, 4, 3), (128, 128, 128, 4, 3), (64, 128, 128, 4, 3), (64, 64, 128, 4, 5),
          (128, 64, 128, 8, 4), (128, 128, 256, 4, 3), (64, 128, 512, 4, 3), (64, 128, 256, 4, 4),
          (32, 128, 256, 4, 4), (16, 256, 256, 4, 4))
# (block_n, block_h, num_warps) of the Gluon int4 decode kernel (runtime/int4_mma.py): the four
# timed on the H100 at Mixtral's and Qwen3's shapes (docs/PERFORMANCE.md); its K step is a group.
INT4_MMA_DECODE = ((128, 256, 8), (128, 256, 4), (64, 128, 4), (64, 256, 4))
GROUP_ROWS = (1, 2, 4)  # smaller row-block groups than the defaults' 8
GATE_UP_VARIANTS = {16: GATE_UP_MEMORY, 32: GATE_UP_MEMORY, 64: GATE_UP_MIDDLE, 128: GATE_UP_COMPUTE}
DOWN_VARIANTS = {16: DOWN_MEMORY, 32: DOWN_MEMORY, 64: DOWN_MIDDLE, 128: DOWN_COMPUTE}


def block_m_candidates(default: KernelConfig) -> tuple[int, ...]:
    """The default row block and the one above it (fewer, fuller programs: measured best at
    T=512 for many small experts), and for large blocks the one below (less padding)."""
    bm = default.block_m
    return tuple(sorted({bm, min(128, 2 * bm)} | ({bm // 2} if bm >= 64 else set())))


def _keep(configs, signature: KernelSignature, target: GpuTarget) -> list[KernelConfig]:
    seen, kept = set(), []
    for c in configs:
        c = fit_format(clamp_tiles(c, signature), signature)
        if c not in seen and violation(c, signature, target) is None:
            seen.add(c)
            kept.append(c)
    return kept


def gate_up_candidates(base: KernelConfig, signature, target) -> list[KernelConfig]:
    return _keep([base] + [replace(base, block_n=n, block_k=k, num_warps=w, num_stages=s)
                           for n, k, w, s in GATE_UP_VARIANTS[base.block_m]], signature, target)


def down_candidates(base: KernelConfig, signature, target) -> list[KernelConfig]:
    return _keep([base] + [replace(base, down_block_n=n, down_block_k=k, down_num_warps=w,
                                   down_num_stages=s, split_k=x)
                           for n, k, w, s, x in DOWN_VARIANTS[base.block_m]], signature, target)


def tma_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """The best config so far with the other way of reading the weights, and its descriptor
    version one stage deeper (descriptors free the registers the address arithmetic held)."""
    if not descriptors_possible(signature, target):
        return []
    tma = replace(base, tma=True)
    deeper = replace(tma, num_stages=tma.num_stages + 1, down_num_stages=tma.down_num_stages + 1)
    # The mark needs descriptors; turned on later by the L2-mark step where it pays.
    other = replace(base, tma=not base.tma, l2_evict_first=False)
    return [c for c in _keep([other, deeper], signature, target) if c != base]


def evict_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """The best config with its tensor copies' L2 mark the other way (evict-first: 2-7% faster
    where experts expect at most a block of rows, 2-4% slower where several blocks re-read an
    expert's weights, measured)."""
    if not base.tma:
        return []
    return _keep([replace(base, l2_evict_first=not base.l2_evict_first)], signature, target)


def pair_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """An int4 config of large row blocks with the other dequantization: a byte's two weights at
    once in Triton ops, or one at a time in float32 (the pairs 12-15% faster at OLMoE's prefill,
    7% slower at Mixtral's 512 tokens, measured)."""
    if not int4_large_blocks(base, signature.weight_format):
        return []
    return _keep([replace(base, int4_pair_ops=not base.int4_pair_ops)], signature, target)


def swap_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """An int4 config of large row blocks with its blocks multiplied the other way round: swapped,
    the dequantized weight tile the MMA's register operand (no trip through shared memory)."""
    if not int4_large_blocks(base, signature.weight_format):
        return []
    return _keep([replace(base, int4_swapped=not base.int4_swapped)], signature, target)


def tail_candidates(base: KernelConfig, signature: KernelSignature, target, tokens: int) -> list[KernelConfig]:
    """A row block's best config with tail rows, for batches whose experts expect at least 3/4 of
    a block each (runs just over a block are what a tail saves a padded block on)."""
    if not expects_tail_rows(signature, tokens, base.block_m):
        return []
    tails = [replace(base, tail_m=t) for t in TAIL_ROWS]
    # Each also split where its half is wide enough (configs.violation): a remainder within the
    # first half takes the half-width MMA (2-4% faster at Mixtral and DeepSeek-V3 prefill, 1-3%
    # slower for many small experts, measured).
    tails += [replace(c, tail_split=True) for c in tails]
    # Each also with GEMM2 capped to two programs per SM: tails of 32 rows take its 8-warp tiles
    # past that (one program per SM; capped, 3% faster at Qwen3 and Mixtral prefill, measured).
    capped = [replace(c, down_max_registers=cap) for c in tails if (cap := two_programs_register_cap(c.down_num_warps))]
    return [c for c in _keep(tails + capped, signature, target) if c != base]


def group_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """A grouped config with smaller groups. The programs sharing a row block's token rows start
    GROUP_M * (N tiles) programs apart, and the rows must still be in L2 when the last one
    reads them: large groups share the weight tiles of experts with several row blocks, small
    ones the rows of experts with one (DeepSeek-V3 at 4096 tokens: 7% faster with groups of 1)."""
    return _keep([replace(base, group_m=g) for g in GROUP_ROWS if g < base.group_m], signature, target)


def stream_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """The best config with its row blocks in halves on two streams (one half's GEMM2 beside the
    other's GEMM1: 1.1-5.3% faster from 16 to 4096 tokens for many small experts, measured),
    and that with GEMM1 one stage deeper (Qwen3 at 512 tokens: another 1%, measured, where both
    GEMMs one stage deeper were slower)."""
    halves = replace(base, streams=2)
    deeper = replace(halves, num_stages=halves.num_stages + 1)
    return [c for c in _keep([halves, deeper], signature, target) if c != base]


def order_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """A config with tail rows, with the runs that carry them first: their blocks take longest,
    and started first they do not finish last (Mixtral at 512 tokens 2.5% faster, Qwen3 at 4096
    ~3%, OLMoE at 512 0.6% slower, measured)."""
    if not base.tail_m or base.tails_first:
        return []
    return _keep([replace(base, tails_first=True)], signature, target)


def half_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """The best config with half blocks: a block whose rows fit in its first half multiplies only
    that half, swapped (0.2-1.5% faster at 128-1024 tokens where the blocks are about twice what
    an expert expects, level for Mixtral at 64 tokens; 0.6-1.3% slower in every A/B of a config
    with tail rows, where experts expect a whole block: not tried there)."""
    if base.half_blocks or base.tail_m:
        return []
    return _keep([replace(base, half_blocks=True)], signature, target)


def decode_candidates(base: KernelConfig, signature: KernelSignature, target, tokens: int) -> list[KernelConfig]:
    """The one-launch decode kernel's variants on top of a three-kernel config (which fused_experts
    and the offload runtime still use), for buckets small enough to take it."""
    if tokens > DECODE_MAX_TOKENS:
        return []
    gluon = [replace(base, decode_block_n=n, decode_block_k=INT4_MMA_GROUP, decode_block_h=h, decode_num_warps=w,
                     decode_num_stages=1, decode_int4_mma=True) for n, h, w in INT4_MMA_DECODE]
    return _keep([replace(base, decode_block_n=n, decode_block_k=k, decode_block_h=h, decode_num_warps=w,
                          decode_num_stages=s) for n, k, h, w, s in DECODE] + gluon, signature, target)


def stagger_candidates(base: KernelConfig, signature: KernelSignature, target) -> list[KernelConfig]:
    """A decode config with GEMM1's walk staggered too (Mixtral at one token 1-2.4% faster on
    each of four routing samples, OLMoE 0.2-0.3% slower, DeepSeek-V3 level: measured)."""
    if not base.decode_block_n or base.decode_stagger_k or base.decode_int4_mma:
        return []
    return _keep([replace(base, decode_stagger_k=True)], signature, target)


def refine_starts(entry: KernelConfig, signature: KernelSignature, target: GpuTarget) -> list[KernelConfig]:
    """A refining search's starts: a tuned entry, three-kernel on one stream, and its twin
    multiplied the other way round (int4's large blocks), which wants other tiles: each is
    searched with its own (the dequantization's other form is a step of every search)."""
    base = _keep([replace(entry.without_decode(), streams=1)], signature, target)
    return base + swap_candidates(base[0], signature, target) if base else []


def starting_points(signature: KernelSignature, target: GpuTarget, tokens: int) -> list[KernelConfig]:
    """One start per block_m: the cost model's default with that row block, three-kernel path
    on one stream without tail rows only (the decode kernel, tails and two streams are searched
    after)."""
    default = replace(default_config(signature, target, tokens, tails=False).without_decode(), streams=1)
    starts = []
    for bm in block_m_candidates(default):
        start = default if bm == default.block_m else default_config(
            signature, target, max(1, int(tokens * bm / default.block_m)), tails=False)
        starts.append(replace(start.without_decode(), block_m=bm, streams=1))
    return _keep(starts, signature, target) or [default]
