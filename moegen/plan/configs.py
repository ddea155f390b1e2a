"""Analytic default kernel configs (a pure function of shape, token count and GPU) and the
resource limits every config, default or tuning candidate, must respect."""
from __future__ import annotations

from dataclasses import replace

from moegen.ir import KernelSignature
from moegen.quant.formats import DTYPE_BYTES, FP8_BLOCK, WeightFormat

# The narrowest int4 decode slice that computes right: every 16-column tile the tuner tried
# (any BLOCK_K/BLOCK_H/warps/stages) was wrong on the H100 with Triton 3.6, relative error ~1.6,
# while the interpreter computes it right (PERFORMANCE.md).
INT4_DECODE_MIN_N = 32
# int4 kernels of row blocks of at most this many rows dequantize in pairs through PTX
# (templates/weights_int4_group.jinja's INT4_PTX_MAX_ROWS); int4_pair_ops and int4_swapped choose
# for larger ones.
INT4_PTX_MAX_ROWS = 32
# The Gluon int4 decode kernel (runtime/int4_mma.py): its K step is one group of 128 inputs, GEMM2's
# slice of I lies within one group, and each warp holds 16 rows of a slice and of an output chunk.
INT4_MMA_GROUP = 128
INT4_MMA_SLICES = (64, 128)
from moegen.plan.cost_model import bucket_cost
from moegen.runtime.align import RUN_WRAP
from moegen.runtime.fused import DECODE_MAX_TOKENS, KernelConfig, decode_grid, pow2_at_least, tma_rows_aligned
from moegen.target import GpuTarget

# fp32 accumulator values one thread may hold before the compiler spills (of 255 registers),
# and with a block's tail rows (their loop's few other registers leave room for more).
MAX_ACCUMULATORS_PER_THREAD = 128
MAX_ACCUMULATORS_WITH_TAIL = 192
# The register file of an SM and a thread's share of it at most (every NVIDIA GPU since Kepler).
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
# Warps per program Triton launches (a power of two; 32 warps is a whole SM's thread limit).
WARP_COUNTS = (1, 2, 4, 8, 16, 32)
# Registers a capped GEMM2 needs beside its accumulators (ptxas, 8-warp 128-wide tiles capped at
# 128: 80 accumulators per thread compile in 126 without spills, 96 spill).
CAPPED_OTHER_REGISTERS = 48
# Bounds well beyond what the tuner tries (tiles up to 512, up to 7 stages, split-K up to 4): a
# larger value in a tuning file is junk, not a config.
MAX_TILE = 1024
MAX_STAGES = 16
MAX_SPLIT_K = 64
# Tail row counts a block may carry (the swapped MMA's narrow side: a power of two, >= 16).
TAIL_ROWS = (16, 32, 64)
# Row blocks per group: the divisors of RUN_WRAP, which a block's word keeps its rank in the
# expert's run modulo (the GEMMs group from that rank).
ROW_GROUPS = tuple(1 << i for i in range(RUN_WRAP.bit_length()))
# Batches this small default to the one-launch decode kernel, with the tile that was best or
# within 3% of it at one token for all four H200-tuned shapes (docs/PERFORMANCE.md).
DECODE_DEFAULT_MAX_TOKENS = 4
DECODE_DEFAULT = dict(decode_block_n=64, decode_block_k=128, decode_block_h=256, decode_num_warps=4,
                      decode_num_stages=3)
# Its slices of I widen to 128 columns where 64-column ones would make more programs than SMs
# (one program fits an SM): the H200 tuning chose so at one token for all five tuned shapes and
# in five of the six two- and four-token buckets that took the decode kernel; on three untuned
# shapes with 144-192 programs at 64 columns, 128 ran 0.7-2.0% faster at one token.
DECODE_WIDE_BLOCK_N = 128
# Tail rows for Hopper batches whose experts expect most of a row block of 64+ rows: 32 tail rows,
# split, GEMM2's 8-warp tiles capped to two programs per SM. They won all 22 such H200-tuned
# buckets of up to 8192 tokens (mostly 32 tail rows), and on seven untuned shapes this default
# ran 6-23% faster than the untailed one (docs/PERFORMANCE.md).
DEFAULT_TAIL_ROWS = 32
# Two-stream halves hide about one GEMM boundary, and two heavy GEMMs sharing the SMs cost a share
# of the call: on the H200 the defaults of eight shapes (8 to 4096 tokens) ran 0.1-4.6% faster on
# two streams where the call's matrix work takes under this long at the target's rate, and up to
# 6.3% slower where it takes longer (docs/PERFORMANCE.md).
TWO_STREAMS_MAX_COMPUTE_US = 600.0
# Tensor copies marked L2 evict-first (l2_hints) where the experts expect at most this many rows
# each: an expert's weights are then read by one row block, or two running side by side, and the
# weights leaving L2 first keeps what programs share (on the H200 2-7% faster from 64 to 2048
# tokens for many small experts, level for few large ones); beyond it an expert's later row
# blocks re-read its weights from L2, and the mark cost 2-4% (docs/PERFORMANCE.md).
EVICT_FIRST_MAX_ROWS = 128


# Shared memory Triton places beside a GEMM's pipelined tiles (barriers, the epilogue's scratch):
# 512 bytes in DeepSeek-V3 fp8's GEMM2 (compiled for sm_90, Triton 3.6), where the tiles' count
# is exact; counted twice over.
SMEM_BESIDE_TILES = 1024


def _weight_tiles_bytes(fmt: WeightFormat, elements: int) -> int:
    """Shared memory of weight tiles of `elements` weights per stage, as stored: bf16/fp16 and fp8
    tiles feed the MMA from shared memory as they are; int4 tiles take half a byte a weight."""
    return elements // 2 if fmt.quantization == "int4_group" else elements * fmt.element_bytes("weight")


def _dequantized_tiles_bytes(fmt: WeightFormat, elements: int) -> int:
    """int4 only: one dequantized copy of the step's weight tiles, in the model dtype, where the
    compiler stages the MMA's operand in shared memory (row blocks not multiplied swapped): counted
    for every int4 config, so the bound never undercounts."""
    return elements * DTYPE_BYTES[fmt.dtype] if fmt.quantization == "int4_group" else 0


def _rows_bytes(fmt: WeightFormat) -> int:
    """Bytes of one activation element in a GEMM's shared memory: fp8 formats multiply fp8 rows
    (quantized by the rows pass), the others the model dtype."""
    return 1 if fmt.fp8 else DTYPE_BYTES[fmt.dtype]


def gate_up_smem_bytes(c: KernelConfig, fmt: WeightFormat) -> int:
    """Pipelined shared memory of GEMM1: A tiles (block and tail rows) and two B tiles (gate, up)
    per stage, each at its bytes in the format."""
    weights = 2 * c.block_k * c.block_n
    return c.num_stages * ((c.block_m + c.tail_m) * c.block_k * _rows_bytes(fmt) + _weight_tiles_bytes(fmt, weights)) \
        + _dequantized_tiles_bytes(fmt, weights)


def down_smem_bytes(c: KernelConfig, fmt: WeightFormat) -> int:
    weights = c.down_block_k * c.down_block_n
    return c.down_num_stages * ((c.block_m + c.tail_m) * c.down_block_k * _rows_bytes(fmt)
                                + _weight_tiles_bytes(fmt, weights)) + _dequantized_tiles_bytes(fmt, weights)


def decode_smem_bytes(c: KernelConfig, fmt: WeightFormat) -> int:
    """The decode kernel pipelines GEMM1 (16 rows, loaded in the model dtype, and two B tiles) and
    then GEMM2's W2 tiles; the second loop reuses the first one's buffers."""
    rows = 16 * c.decode_block_k * DTYPE_BYTES[fmt.dtype]
    gate_up, down = 2 * c.decode_block_k * c.decode_block_n, c.decode_block_h * c.decode_block_n
    return c.decode_num_stages * max(rows + _weight_tiles_bytes(fmt, gate_up), _weight_tiles_bytes(fmt, down)) \
        + _dequantized_tiles_bytes(fmt, max(gate_up, down))


def malformed(c: KernelConfig) -> str | None:
    """Why a config cannot launch on any shape or GPU (None if it can): what a hand-edited or
    foreign tuning file may hold that the tuner never writes."""
    tiles = ("block_m", "block_n", "block_k", "down_block_n", "down_block_k")
    tiles += ("decode_block_n", "decode_block_k", "decode_block_h") if c.decode_block_n else ()
    for name in tiles:
        value = getattr(c, name)
        if not 16 <= value <= MAX_TILE or value & (value - 1):
            return f"{name} {value} is not a power of two from 16 to {MAX_TILE}"
    for name in ("num_warps", "down_num_warps", "decode_num_warps"):
        if getattr(c, name) not in WARP_COUNTS:
            return f"{name} {getattr(c, name)} is not one of {WARP_COUNTS}"
    for name in ("num_stages", "down_num_stages", "decode_num_stages"):
        if not 1 <= getattr(c, name) <= MAX_STAGES:
            return f"{name} {getattr(c, name)} is not 1 to {MAX_STAGES}"
    if not 1 <= c.split_k <= MAX_SPLIT_K:
        return f"split_k {c.split_k} is not 1 to {MAX_SPLIT_K}"
    if not 0 <= c.down_max_registers <= MAX_REGISTERS_PER_THREAD:
        return f"down_max_registers {c.down_max_registers} is not 0 (no cap) to {MAX_REGISTERS_PER_THREAD}"
    if c.tail_m and (c.tail_m not in TAIL_ROWS or c.tail_m >= c.block_m):
        return f"tail_m {c.tail_m} not one of {TAIL_ROWS} below block_m"
    if c.tail_split and c.tail_m // 2 < min(TAIL_ROWS):
        return f"tail_split needs a half tail of at least {min(TAIL_ROWS)} rows (tail_m {c.tail_m})"
    if c.half_blocks and c.block_m // 2 < 16:
        return f"half_blocks needs a half block of at least 16 rows, an MMA's least (block_m {c.block_m})"
    if c.tails_first and not c.tail_m:
        return "tails_first orders the runs with tail rows: it needs tail_m"
    if c.decode_stagger_k and not c.decode_block_n:
        return "decode_stagger_k staggers the decode kernel's walk: it needs decode_block_n"
    if c.decode_int4_mma and (not c.decode_block_n or c.decode_stagger_k):
        return "decode_int4_mma is a decode kernel of its own: it needs decode_block_n, without decode_stagger_k"
    if c.l2_evict_first and not c.tma:
        return "l2_evict_first marks the tensor-descriptor copies: it needs tma"
    if c.group_m not in ROW_GROUPS:
        return f"group_m {c.group_m} not one of {ROW_GROUPS} (groups divide the runs' rank wrap)"
    if c.streams not in (1, 2):
        return f"streams {c.streams}: 1 or 2"
    return None


def accumulator_violation(c: KernelConfig, signature: KernelSignature) -> str | None:
    """Why the GEMMs' fp32 tiles would not fit the registers (None if they do)."""
    # fp8 products are scaled before they are added: each K step's product is a tile of its own.
    product = 1 if signature.weight_format.fp8 else 0
    if (2 + product) * c.block_m * c.block_n > MAX_ACCUMULATORS_PER_THREAD * 32 * c.num_warps \
            or (2 + product) * (c.block_m + c.tail_m) * c.block_n > MAX_ACCUMULATORS_WITH_TAIL * 32 * c.num_warps:
        return "GEMM1 accumulators exceed the register file"
    if (1 + product) * c.block_m * c.down_block_n > MAX_ACCUMULATORS_PER_THREAD * 32 * c.down_num_warps \
            or (1 + product) * (c.block_m + c.tail_m) * c.down_block_n \
            > MAX_ACCUMULATORS_WITH_TAIL * 32 * c.down_num_warps:
        return "GEMM2 accumulators exceed the register file"
    if c.down_max_registers and (1 + product) * (c.block_m + c.tail_m) * c.down_block_n \
            > (c.down_max_registers - CAPPED_OTHER_REGISTERS) * 32 * c.down_num_warps:
        return f"GEMM2 accumulators leave too few of its {c.down_max_registers} registers"
    return None


def violation(c: KernelConfig, signature: KernelSignature, target: GpuTarget) -> str | None:
    """Why a config cannot run well on the target (None if it can): shared memory, registers,
    tiles wider than the dimension they cover, split-K finer than the K loop."""
    problem = malformed(c) or format_violation(c, signature.weight_format)
    if problem:
        return problem
    limit, fmt = target.smem_per_block_kib * 1024 - SMEM_BESIDE_TILES, signature.weight_format
    if gate_up_smem_bytes(c, fmt) > limit:
        return f"GEMM1 shared memory {gate_up_smem_bytes(c, fmt)} > {limit}"
    if down_smem_bytes(c, fmt) > limit:
        return f"GEMM2 shared memory {down_smem_bytes(c, fmt)} > {limit}"
    problem = accumulator_violation(c, signature)
    if problem:
        return problem
    h, i = pow2_at_least(signature.hidden_size), pow2_at_least(signature.intermediate_size)
    if signature.quantization == "fp8_block":  # its K steps are whole groups, however narrow the dimension
        h, i = max(h, FP8_BLOCK), max(i, FP8_BLOCK)
    if c.block_n > max(16, i) or c.block_k > max(16, h) or c.down_block_n > max(16, h) or c.down_block_k > max(16, i):
        return "tile wider than the dimension it covers"
    if c.split_k > 1 and (signature.intermediate_size + c.down_block_k - 1) // c.down_block_k < 2 * c.split_k:
        return "split-K finer than two K steps per split"
    if c.decode_int4_mma:
        return int4_mma_violation(c, signature)
    if c.decode_block_n:
        if decode_smem_bytes(c, fmt) > limit:
            return f"decode shared memory {decode_smem_bytes(c, fmt)} > {limit}"
        if 16 * (2 * c.decode_block_n + c.decode_block_h) > MAX_ACCUMULATORS_PER_THREAD * 32 * c.decode_num_warps:
            return "decode accumulators exceed the register file"
        if c.decode_block_n > max(16, i) or c.decode_block_k > max(16, h) or c.decode_block_h > max(16, h):
            return "decode tile wider than the dimension it covers"
    return None


def int4_mma_violation(c: KernelConfig, signature: KernelSignature) -> str | None:
    """Why the Gluon int4 decode kernel cannot run a config's decode tiles on the shape (None if
    it can); the format is format_violation's."""
    h, i, n, warp_rows = signature.hidden_size, signature.intermediate_size, c.decode_block_n, 16 * c.decode_num_warps
    if signature.activation != "silu":
        return f"decode_int4_mma computes silu(gate) * up: off for activation {signature.activation}"
    if h % INT4_MMA_GROUP or i % INT4_MMA_GROUP:
        return f"decode_int4_mma needs hidden and intermediate sizes that are multiples of {INT4_MMA_GROUP}"
    if n not in INT4_MMA_SLICES or c.decode_block_k != INT4_MMA_GROUP or h % c.decode_block_h:
        return (f"decode_int4_mma: decode_block_n one of {INT4_MMA_SLICES}, decode_block_k {INT4_MMA_GROUP}, "
                f"decode_block_h a divisor of {h}")
    if n % warp_rows or c.decode_block_h % warp_rows:
        return f"decode_int4_mma: decode_block_n and decode_block_h multiples of 16 rows a warp ({warp_rows})"
    return None


def format_violation(c: KernelConfig, fmt: WeightFormat) -> str | None:
    """Why a config cannot run the weight format (None if it can): quantized weights are read
    with plain loads; fp8_block's K steps are its 128-wide groups (and the decode kernel's slices
    of I too, whose intermediate it quantizes per group)."""
    if fmt.quantized and (c.tma or c.l2_evict_first):
        return f"{fmt.quantization} weights are read with plain loads: tma and l2_evict_first off"
    if fmt.quantization == "fp8_channel" and c.decode_block_n:
        return "fp8_channel quantizes whole activation rows, which the decode kernel's programs do not hold: " \
               "decode_block_n 0"
    if fmt.quantization == "fp8_block":
        steps = {"block_k": c.block_k, "down_block_k": c.down_block_k}
        if c.decode_block_n:
            steps.update(decode_block_k=c.decode_block_k, decode_block_n=c.decode_block_n)
        wrong = [f"{name} {value}" for name, value in steps.items() if value != FP8_BLOCK]
        if wrong:
            return f"fp8_block multiplies {FP8_BLOCK}-wide groups: {', '.join(wrong)} must be {FP8_BLOCK}"
    for name in ("int4_pair_ops", "int4_swapped"):
        if getattr(c, name) and not int4_large_blocks(c, fmt):
            return (f"{name} chooses how int4_group weights in a 16-bit model are multiplied in row blocks over "
                    f"{INT4_PTX_MAX_ROWS} rows: off for {fmt.quantization} in {fmt.dtype} with block_m {c.block_m}")
    if c.decode_int4_mma and (fmt.quantization, fmt.group_size, fmt.dtype) != ("int4_group", INT4_MMA_GROUP,
                                                                               "bfloat16"):
        return (f"decode_int4_mma multiplies int4_group weights in groups of {INT4_MMA_GROUP} in a bfloat16 model: "
                f"off for {fmt.quantization} (group {fmt.group_size}) in {fmt.dtype}")
    if fmt.quantization == "int4_group" and 0 < c.decode_block_n < INT4_DECODE_MIN_N:
        return (f"int4_group decode slices of {c.decode_block_n} columns compute wrongly on the GPU (Triton 3.6): "
                f"decode_block_n {INT4_DECODE_MIN_N} or more")
    return None


def fit_format(c: KernelConfig, signature: KernelSignature) -> KernelConfig:
    """The config made to run the signature's weight format (format_violation), else as it is."""
    fmt = signature.weight_format
    if fmt.quantized:
        c = replace(c, tma=False, l2_evict_first=False)
    if fmt.quantization == "fp8_channel":
        c = c.without_decode()
    if fmt.quantization == "int4_group" and 0 < c.decode_block_n < INT4_DECODE_MIN_N:
        c = replace(c, decode_block_n=INT4_DECODE_MIN_N)
    if not int4_large_blocks(c, fmt):
        c = replace(c, int4_pair_ops=False, int4_swapped=False)
    if fmt.quantization == "fp8_block":
        c = replace(c, block_k=FP8_BLOCK, down_block_k=FP8_BLOCK)
        if c.decode_block_n:
            c = replace(c, decode_block_k=FP8_BLOCK, decode_block_n=FP8_BLOCK)
    return c


def int4_large_blocks(c: KernelConfig, fmt: WeightFormat) -> bool:
    """Whether int4_pair_ops and int4_swapped decide anything for the config: int4 weights of a
    16-bit model in row blocks too large for the PTX pairs."""
    return fmt.quantization == "int4_group" and fmt.dtype in ("bfloat16", "float16") and c.block_m > INT4_PTX_MAX_ROWS


def descriptors_possible(signature: KernelSignature, target: GpuTarget) -> bool:
    """Tensor descriptors need 16-byte aligned weight rows and Hopper's copy engine (or the
    interpreter, which emulates them)."""
    aligned = tma_rows_aligned(signature.hidden_size, signature.intermediate_size, signature.element_bytes)
    return aligned and (target.arch >= 90 or target.arch == 0)


def descriptors_pay_off(signature: KernelSignature, target: GpuTarget) -> bool:
    """Default to descriptors where they were measured to pay (Hopper), not in the interpreter."""
    return descriptors_possible(signature, target) and target.arch >= 90


def clamp_tiles(c: KernelConfig, signature: KernelSignature) -> KernelConfig:
    """Tiles never wider than the (power-of-two rounded) dimension they cover, nor below 16."""
    h, i = pow2_at_least(signature.hidden_size), pow2_at_least(signature.intermediate_size)

    def fit(tile: int, dim: int) -> int:
        return max(16, min(tile, dim))

    c = replace(c, block_n=fit(c.block_n, i), block_k=fit(c.block_k, h),
                down_block_n=fit(c.down_block_n, h), down_block_k=fit(c.down_block_k, i))
    if not c.decode_block_n:
        return c
    return replace(c, decode_block_n=fit(c.decode_block_n, i), decode_block_k=fit(c.decode_block_k, h),
                   decode_block_h=fit(c.decode_block_h, h))


def expects_tail_rows(signature: KernelSignature, tokens: int, block_m: int) -> bool:
    """Whether a batch's experts expect at least 3/4 of a row block each: runs just over a block
    are what tail rows save a padded block on."""
    return 4 * tokens * signature.top_k >= 3 * block_m * signature.num_experts


def two_programs_register_cap(num_warps: int) -> int:
    """The per-thread register cap that lets two programs of num_warps share an SM (0: they do
    without one)."""
    cap = REGISTERS_PER_SM // (2 * 32 * num_warps)
    return cap if cap < MAX_REGISTERS_PER_THREAD else 0


def decode_slice_columns(signature: KernelSignature, target: GpuTarget, tokens: int) -> int:
    """The default decode tile's columns of I: DECODE_WIDE_BLOCK_N where the default's slices
    would take more than one wave of programs."""
    narrow = DECODE_DEFAULT["decode_block_n"]
    experts, slices = decode_grid(tokens, signature.top_k, signature.num_experts, signature.intermediate_size, narrow)
    return narrow if experts * slices <= target.sm_count else DECODE_WIDE_BLOCK_N


def evict_first_pays_off(signature: KernelSignature, tokens: int) -> bool:
    """Whether the experts expect at most EVICT_FIRST_MAX_ROWS rows each."""
    return tokens * signature.top_k <= EVICT_FIRST_MAX_ROWS * signature.num_experts


def default_config(signature: KernelSignature, target: GpuTarget, tokens: int, tails: bool = True) -> KernelConfig:
    """Row blocks just cover the expected tokens per expert; memory-bound (few tokens) shapes
    get narrow N tiles and deep K tiles so enough CTAs stream the weights, compute-bound ones
    get large tiles. The 64- and 128-row configs, read through tensor descriptors on Hopper, are
    the ones the H200 tuning runs chose most often for those row blocks (docs/PERFORMANCE.md).
    Beyond decode sizes, calls of little matrix work run their row blocks in halves on two
    streams on Hopper, and (with `tails`) blocks of 64+ rows carry tail rows where the experts
    expect most of a block."""
    cost = bucket_cost(signature, target, tokens)
    tokens_per_expert = tokens * signature.top_k / max(cost.experts_touched, 1.0)
    block_m = min(max(pow2_at_least(tokens_per_expert), 16), 128)
    if block_m <= 32:
        config = KernelConfig(block_m=block_m, group_m=1, block_n=64, block_k=128, num_warps=4,
                              num_stages=4, down_block_n=64, down_block_k=128, down_num_warps=4,
                              down_num_stages=4)
    elif block_m == 64:
        config = KernelConfig(block_m=64, group_m=8, block_n=128, block_k=64, num_warps=4,
                              num_stages=4, down_block_n=128, down_block_k=64, down_num_warps=4,
                              down_num_stages=4, tma=descriptors_pay_off(signature, target))
    else:
        config = KernelConfig(block_m=128, group_m=8, block_n=128, block_k=64, num_warps=8,
                              num_stages=4, down_block_n=128, down_block_k=64, down_num_warps=8,
                              down_num_stages=3, tma=descriptors_pay_off(signature, target))
    if tokens <= min(DECODE_DEFAULT_MAX_TOKENS, DECODE_MAX_TOKENS):
        # int4 decodes on the three-kernel path: its GEMMs dequantize about twice as fast as the
        # one-launch kernel (Qwen3-30B-A3B on the H100: 30.5 against 57.8 us at one token, 72.9
        # against 199.8 at four; the kernel's best of 32 tiles and splits 49.1 and 131.4).
        if signature.quantization != "int4_group":
            config = replace(config, tma=descriptors_pay_off(signature, target),
                             **dict(DECODE_DEFAULT, decode_block_n=decode_slice_columns(signature, target, tokens)))
    elif target.arch >= 90 and cost.compute_us < TWO_STREAMS_MAX_COMPUTE_US:
        config = replace(config, streams=2)
    config = fit_format(clamp_tiles(config, signature), signature)
    # Narrower N tiles where the accumulators would spill (fp8's per-step product tiles).
    while (spill := accumulator_violation(config, signature)) and min(config.block_n, config.down_block_n) > 16:
        gemm1 = spill.startswith("GEMM1")
        config = replace(config, block_n=config.block_n // 2 if gemm1 else config.block_n,
                         down_block_n=config.down_block_n if gemm1 else config.down_block_n // 2)
    # Shrink pipelining until the stages fit shared memory (fp32 tiles are twice as large).
    while violation(config, signature, target) and min(config.num_stages, config.down_num_stages,
                                                        config.decode_num_stages) > 1:
        config = replace(config, num_stages=max(1, config.num_stages - 1),
                         down_num_stages=max(1, config.down_num_stages - 1),
                         decode_num_stages=max(1, config.decode_num_stages - 1))
    if tails and target.arch >= 90 and not config.decode_block_n and config.block_m > DEFAULT_TAIL_ROWS \
            and expects_tail_rows(signature, tokens, config.block_m):
        tailed = replace(config, tail_m=DEFAULT_TAIL_ROWS, tail_split=True,
                         down_max_registers=two_programs_register_cap(config.down_num_warps))
        if violation(tailed, signature, target) is None:
            config = tailed
    if config.tma and evict_first_pays_off(signature, tokens):
        config = replace(config, l2_evict_first=True)
    return config
