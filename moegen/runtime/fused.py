"""Launch the generated fused-MoE kernels: routing and alignment, GEMM1 (+activation, and zeroing
the output), GEMM2 (+router weight, top-k reduction by atomic adds); or, for a few tokens, the
one-launch decode kernel and its finish. The generated package binds a KernelSet and calls these."""
from __future__ import annotations

import bisect
import functools
import threading
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from moegen import knobs
from moegen.quant.formats import FP8_BLOCK, WeightFormat, stored_name
from moegen.runtime.align import Alignment, align_tokens, aligned_rows, expected_blocks, max_padded_slots
from moegen.runtime.launch import launch
from moegen.runtime.routing import RoutingParams

# MOEGEN_ROUTE_ALIGN_MAX_TOKENS, where set, decides which batches the single-program kernel routes
# and aligns (one launch) and which the multi-program pair (two launches after one fill, but
# parallel). Otherwise the single program takes batches of up to 8 tokens and 1024 router scores
# (tokens x experts): its serial loops grow with both. Measured on the H200 (graph replays, same
# configs): 128 experts, the pair faster from 16 tokens; 256 experts (DeepSeek-V3), level at 4
# tokens, the pair 2.6% faster at 8; 8 experts, the single program 0.9% faster at 4.
_SINGLE_ROUTE_MAX_TOKENS = 8
_SINGLE_ROUTE_MAX_SCORES = 1024
# Elements of the [rows, experts] one-hot tiles one routing program holds at a time: smaller
# tiles, more programs with shorter reduction chains. Measured on the H200 (the pair alone, graph
# replays, 64-4096 tokens over 64-256 experts): 4096 took 2-4 us less than 8192; 2048 for the
# count kernel up to 1.1 us less at 64-512 tokens but 2-3 us more at 4096; 16384 and up slower.
_ROUTE_TILE = 4096
# The decode kernel's MMA tile has 16 rows: batches up to this size can take it.
DECODE_MAX_TOKENS = 16
# Eager calls of at most this many tokens run a two-stream config on one stream (_run_experts)
# without asking whether the host paces the caller: fused_moe's eager decode rule has asked for
# these batches already, and each call asks once.
EAGER_ONE_STREAM_MAX_TOKENS = DECODE_MAX_TOKENS
# Elements one program of the decode finish (cast and re-zero the workspace) handles.
DECODE_FINISH_BLOCK = 1024


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one MoE call. block_m (rows per expert block) is shared by the
    alignment and both GEMMs; the rest is per GEMM: gate_up (GEMM1) and down (GEMM2)."""

    block_m: int
    group_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    down_block_n: int
    down_block_k: int
    down_num_warps: int
    down_num_stages: int
    split_k: int = 1
    tma: bool = False  # weight (and GEMM2 intermediate) tiles through Hopper tensor descriptors
    # Up to this many of an expert's last rows ride on its last full block instead of taking a
    # padded block of their own (0: every run padded to block_m); see the alignment.
    tail_m: int = 0
    # GEMM2's registers per thread (0: the compiler's choice). Tail rows raise its 8-warp tiles past
    # 128, which leaves room for one program per SM; capped at 128, two fit (and compile unspilled).
    down_max_registers: int = 0
    # With tail_m 32 or 64: a block whose tail rows fit in the first half multiplies only that
    # half (both GEMMs read it per block at run time), so a short remainder costs its own width.
    tail_split: bool = False
    # With tail_m: the runs with tail rows come first in the layout and carry them on their first
    # block, so the longest blocks start first instead of finishing last (the alignment).
    tails_first: bool = False
    # A row block whose rows fit in its first half (the last of its run, the rest padding)
    # multiplies only that half in both GEMMs (read per block at run time): where experts expect
    # about half a block each, half the blocks load and multiply half the rows.
    half_blocks: bool = False
    # The one-launch decode kernel, for batches of at most DECODE_MAX_TOKENS routed by fused_moe
    # (0: not used): its slice of I, step along H, width of its output chunks, warps, stages.
    decode_block_n: int = 0
    decode_block_k: int = 0
    decode_block_h: int = 0
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    # The decode kernel's GEMM1 walk along H staggered between neighbouring programs, as its
    # GEMM2 walk always is: faster at one token for some shapes, level or slower for others.
    decode_stagger_k: bool = False
    # int4_group (groups of 128) in a bf16 model: the decode kernel in Gluon (runtime/int4_mma.py),
    # its slice of I, output chunks and warps from decode_block_n, _h, _num_warps, after the
    # routing kernel where fused_moe routes (plan.configs.int4_mma_violation: where it applies).
    decode_int4_mma: bool = False
    # 2: the row blocks in two halves on two CUDA streams, each half GEMM1 then GEMM2, so that
    # one half's GEMM2 runs while the other's GEMM1 drains.
    streams: int = 1
    # With tma: every kernel's tensor-descriptor copies marked L2 evict-first (l2_hints), so that
    # the streamed weights leave L2 before the rows several programs share.
    l2_evict_first: bool = False
    # int4_group in a 16-bit model, row blocks over INT4_PTX_MAX_ROWS: the GEMMs dequantize a
    # byte's two weights at once in Triton ops instead of one at a time in float32 (faster for
    # OLMoE's prefill, slower for Mixtral's at 512 tokens: measured, docs/PERFORMANCE.md).
    int4_pair_ops: bool = False
    # int4_group in a 16-bit model, row blocks over INT4_PTX_MAX_ROWS: every block multiplied
    # swapped (weight tile @ rows^T, as tails and half blocks always are), so that the dequantized
    # tile is the MMA's register operand, where otherwise it goes through shared memory and each
    # K step waits for its MMA (PTX for sm_90).
    int4_swapped: bool = False

    def without_decode(self) -> "KernelConfig":
        """The same config on the three-kernel path (no one-launch decode kernel)."""
        return replace(self, decode_block_n=0, decode_stagger_k=False, decode_int4_mma=False)

    @property
    def key(self) -> str:
        """Compact and filename-safe, e.g. m16g1_n64k128w4s4_n64k128w4s4x1 (+ _tma, _t32, _d...)."""
        decode = (f"_d{self.decode_block_n}k{self.decode_block_k}h{self.decode_block_h}"
                  f"w{self.decode_num_warps}s{self.decode_num_stages}" + ("z" if self.decode_stagger_k else "")
                  + ("m" if self.decode_int4_mma else "")
                  if self.decode_block_n else "")
        return (f"m{self.block_m}g{self.group_m}_n{self.block_n}k{self.block_k}w{self.num_warps}"
                f"s{self.num_stages}_n{self.down_block_n}k{self.down_block_k}w{self.down_num_warps}"
                f"s{self.down_num_stages}x{self.split_k}" + ("_tma" if self.tma else "")
                + (f"_t{self.tail_m}" if self.tail_m else "") + ("s" if self.tail_split else "")
                + ("f" if self.tails_first else "") + ("_h" if self.half_blocks else "")
                + (f"_r{self.down_max_registers}" if self.down_max_registers else "")
                + ("_2s" if self.streams == 2 else "") + ("_e" if self.l2_evict_first else "")
                + ("_p" if self.int4_pair_ops else "") + ("_w" if self.int4_swapped else "") + decode)


@dataclass(frozen=True)
class KernelSet:
    """One specialization: the model shape baked into the kernels plus per-bucket configs."""

    route_align: Callable
    route_count: Callable
    route_place: Callable
    gate_up: Callable
    down_reduce: Callable
    decode: Callable
    decode_finish: Callable
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    dtype: torch.dtype
    routing: RoutingParams
    buckets: tuple[int, ...]
    configs: tuple[KernelConfig, ...]
    # Whether the kernels run in Triton's interpreter: decided when the package was imported
    # (None: read from the kernels; dataclasses.replace keeps what was read).
    interpreted: Optional[bool] = None
    # How the experts' weights are stored (the spec's quantization): the kernels were rendered for it.
    weight_format: WeightFormat = WeightFormat()
    # The decode kernel for a routing chosen by the caller (fused_experts, the offload runtime).
    decode_routed: Optional[Callable] = None
    # The pass that quantizes the GEMMs' activation rows once, where the weight format multiplies
    # quantized activations (fp8): hidden states before GEMM1, the intermediate before GEMM2.
    quantize_rows: Optional[Callable] = None
    # The gated activation the kernels were rendered with (configs are checked against it).
    activation: str = "silu"

    def __post_init__(self):
        settle_cache_keys((self.route_align, self.route_count, self.route_place, self.gate_up,
                           self.down_reduce, self.decode, self.decode_finish, self.decode_routed,
                           self.quantize_rows))
        if self.interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            object.__setattr__(self, "interpreted", isinstance(self.gate_up, InterpretedFunction))

    def bucket_index(self, num_tokens: int) -> int:
        """The smallest bucket >= num_tokens (the largest bucket beyond it)."""
        return min(bisect.bisect_left(self.buckets, num_tokens), len(self.buckets) - 1)

    def bucket_for(self, num_tokens: int) -> int:
        return self.buckets[self.bucket_index(num_tokens)]

    def config_for(self, num_tokens: int) -> KernelConfig:
        return self.configs[self.bucket_index(num_tokens)]

    @functools.cached_property
    def eager_decode_bucket(self) -> Optional[int]:
        """Index of the bucket whose decode config serves host-paced eager calls of at most
        DECODE_MAX_TOKENS tokens whose own bucket runs the three-kernel path (fused_moe): the
        largest bucket that decodes. None where no such call exists or no bucket decodes."""
        small = range(self.bucket_index(DECODE_MAX_TOKENS) + 1)
        decoding = [b for b in small if self.configs[b].decode_block_n]
        return decoding[-1] if decoding and len(decoding) < len(small) else None


def settle_cache_keys(kernels) -> None:
    """Key every jitted helper the kernels' modules hold, in name order, before the kernels.

    Triton (3.6) folds a called helper's global constants into its caller's cache key only if
    the helper was keyed first, so the key of kernels sharing a helper (the routing helper:
    routing kernels and the decode kernel) depends on which kernel a process launches first.
    Settled at import, keys match the kernels the build compiled and shipped in the package."""
    from triton.runtime.jit import JITFunction

    scopes = {id(k.__globals__): k.__globals__ for k in kernels if isinstance(k, JITFunction)}
    for scope in sorted(scopes.values(), key=lambda g: g["__name__"]):
        for name in sorted(scope):
            if isinstance(scope[name], JITFunction) and scope[name] not in kernels:
                scope[name].cache_key  # noqa: B018 - computed and stored by the property
    for kernel in kernels:
        if isinstance(kernel, JITFunction):
            kernel.cache_key  # noqa: B018


def pow2_at_least(x: float) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


@functools.cache
def _route_align_override() -> Optional[int]:
    """MOEGEN_ROUTE_ALIGN_MAX_TOKENS, read at the first call: not at import, where a bad value would
    fail every importer (the CLI too), and not at every call, which is on the host's hot path."""
    return knobs.route_align_max_tokens()


def single_route_max_tokens(num_experts: int) -> int:
    """The largest batch the single-program routing kernel takes."""
    override = _route_align_override()
    if override is not None:
        return override
    return min(_SINGLE_ROUTE_MAX_TOKENS, _SINGLE_ROUTE_MAX_SCORES // num_experts)


# Group-limited routing without a correction bias comes out wrong on sm_90 under Triton 3.6 in
# four-warp routing tiles of 2 to 8 token rows with eight groups (experts picked twice; the
# interpreter computes it right, and no rewrite of the group limit tried changed that). On the
# H200 every probed tile of 16 rows, or of at least 1024 elements (rows x padded experts), routed
# right, as one row did: such routings take the fewer of those rows (tests/test_gpu.py checks
# every tile launched).
GROUPED_UNBIASED_MIN_ROWS = 16
GROUPED_UNBIASED_MIN_ELEMENTS = 1024


def group_tile(routing: RoutingParams) -> tuple[int, int]:
    """The grouped routing's [groups, experts per group] score tile, each padded to a power of two
    (the kernels' G_PAD and S_PAD)."""
    return pow2_at_least(routing.n_group), pow2_at_least(routing.num_experts // routing.n_group)


def route_tile_rows(ks: KernelSet, rows: int) -> int:
    """The token rows of a routing tile: `rows`, raised where the routing is group-limited without
    a bias to the fewer of GROUPED_UNBIASED_MIN_ROWS and the rows that make a tile of
    GROUPED_UNBIASED_MIN_ELEMENTS (one row stays one)."""
    p = ks.routing
    if p.n_group == 1 or p.correction_bias or rows == 1:
        return rows
    groups, members = group_tile(p)
    return max(rows, min(GROUPED_UNBIASED_MIN_ROWS, _cdiv(GROUPED_UNBIASED_MIN_ELEMENTS, groups * members)))


def single_route_launch(ks: KernelSet, num_tokens: int) -> dict:
    """Launch settings of the single-program routing kernel, sized by the batch's bucket so that
    a handful of compiled variants serve all batches: a decode token is not padded to 16."""
    bucket = max(1, min(ks.bucket_for(num_tokens), single_route_max_tokens(ks.num_experts)))
    slots = pow2_at_least(bucket * ks.top_k)
    return dict(BLOCK_T=route_tile_rows(ks, min(16, pow2_at_least(bucket))), BLOCK_S=max(16, min(64, slots)),
                num_warps=4)


def decode_block_t(ks: KernelSet, num_tokens: int) -> int:
    """Token rows the decode kernel routes: sized by the batch's bucket (few compiled variants),
    or by the batch where it exceeds the largest bucket."""
    return route_tile_rows(ks, pow2_at_least(min(max(ks.bucket_for(num_tokens), num_tokens), DECODE_MAX_TOKENS)))


def decode_grid(num_tokens: int, top_k: int, num_experts: int, intermediate_size: int,
                block_n: int) -> tuple[int, int]:
    """The decode kernel's programs: one per expert the batch picks and slice of I."""
    return min(num_tokens * top_k, num_experts), _cdiv(intermediate_size, block_n)


def uses_decode(cfg: KernelConfig, num_tokens: int) -> bool:
    return cfg.decode_block_n > 0 and num_tokens <= DECODE_MAX_TOKENS


def multi_route_launch(ks: KernelSet) -> tuple[dict, dict]:
    """(count, place) launch settings: one-hot tiles of about _ROUTE_TILE elements."""
    experts = pow2_at_least(ks.num_experts)
    tokens = route_tile_rows(ks, max(1, min(64, _ROUTE_TILE // (pow2_at_least(ks.top_k) * experts))))
    return dict(BLOCK_T=tokens, num_warps=4), dict(BLOCK_S=max(16, min(256, _ROUTE_TILE // experts)), num_warps=4)


FLOATING, INTEGER = "a floating-point", "an integer"  # dtype classes for _check


def _check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")


def _check(name: str, tensor: torch.Tensor, shape: tuple, dtype, device):
    """dtype: one dtype, FLOATING (any real floating dtype) or INTEGER (any integer dtype)."""
    _check_tensor(name, tensor)
    if tuple(tensor.shape) != shape:
        expected = ", ".join(map(str, shape))  # a dimension named "T" where the batch is unknown
        raise ValueError(f"{name}: expected shape [{expected}], got {list(tensor.shape)}")
    if dtype is FLOATING:
        wrong = not tensor.dtype.is_floating_point
    elif dtype is INTEGER:
        wrong = tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool
    else:
        wrong = tensor.dtype != dtype
    if wrong:
        expected = f"dtype {dtype}" if isinstance(dtype, torch.dtype) else f"{dtype} dtype"
        raise ValueError(f"{name}: expected {expected}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")


@dataclass(frozen=True)
class WeightScales:
    """The scales (and zero points) of quantized weights, as the kernels take them after each
    projection's weight: a format's tensors and their two outer strides (empty for unquantized
    weights: the kernels then have no such parameters)."""

    w13: tuple = ()
    w2: tuple = ()


NO_SCALES = WeightScales()


def stored_dtype(ks: KernelSet, name: str) -> torch.dtype:
    """The dtype of a projection's stored tensor `name` (weight, scale, zero) in the kernels' format."""
    fmt = ks.weight_format
    if name == "weight":
        return {"none": ks.dtype, "int4_group": torch.uint8}.get(fmt.quantization, torch.float8_e4m3fn)
    if name == "zero":
        return torch.uint8
    return torch.float32 if fmt.fp8 else ks.dtype  # int4's scales: the model dtype


def stored_tensors(ks: KernelSet, experts: int) -> dict[str, tuple[tuple, torch.dtype]]:
    """Each stored tensor of `experts` experts (w13, w13_scale, w2, ...) -> (shape, dtype) in the
    kernels' format."""
    fmt, h, i = ks.weight_format, ks.hidden_size, ks.intermediate_size
    return {stored_name(projection, part): (shape, stored_dtype(ks, part))
            for projection, shapes in (("w13", fmt.w13_shapes(h, i, experts)), ("w2", fmt.shapes(h, i, experts)))
            for part, shape in shapes.items()}


def _check_projection(ks: KernelSet, name: str, tensors: dict, shapes: dict, device) -> None:
    """One projection's stored tensors checked against the format's shapes and dtypes."""
    for part, shape in shapes.items():
        label = stored_name(name, part)
        value = tensors.get(part)
        if value is None and part != "weight":
            raise ValueError(f"{label}: missing; this package's experts are {ks.weight_format.quantization} "
                             f"(moegen/quant/formats.py): pass {label}=[{', '.join(map(str, shape))}] "
                             f"{stored_dtype(ks, part)}")
        _check(label, value, shape, stored_dtype(ks, part), device)
    extra = sorted(stored_name(name, part) for part, value in tensors.items() if value is not None and part not in shapes)
    if extra:
        raise ValueError(f"{', '.join(extra)}: this package's experts are {ks.weight_format.quantization}, which has "
                         "no such tensor; leave it out")


def _projection_scales(ks: KernelSet, scale, zero) -> tuple:
    """A projection's scales and zero points as the kernels take them (templates/weights_*.jinja's
    params): the tensors, then the scales' two outer strides (zero points share their layout)."""
    if scale is None:  # unquantized
        return ()
    scale = scale.contiguous()
    strides = (scale.stride(0), scale.stride(1))
    if ks.weight_format.quantization == "int4_group":  # symmetric: the scales stand in for the unused zeros
        return (scale, scale if zero is None else zero.contiguous(), *strides)
    return (scale, *strides)


def weight_scales(ks: KernelSet, w13_scale=None, w2_scale=None, w13_zero=None, w2_zero=None) -> WeightScales:
    return WeightScales(_projection_scales(ks, w13_scale, w13_zero), _projection_scales(ks, w2_scale, w2_zero))


def _check_config(ks: KernelSet, config: Optional[KernelConfig]) -> None:
    """A caller's config must suit the weight format (the tuned and default ones do): fp8_block's
    kernels, for one, quantize activations in groups as wide as their K steps."""
    if config is None:
        return
    from moegen.ir import KernelSignature  # the plan stage imports this module
    from moegen.plan.configs import format_violation, int4_mma_violation

    fmt = ks.weight_format
    problem = format_violation(config, fmt)
    if not problem and config.decode_int4_mma:
        problem = int4_mma_violation(config, KernelSignature(
            ks.hidden_size, ks.intermediate_size, ks.num_experts, ks.top_k, ks.activation, fmt.dtype,
            fmt.quantization, fmt.group_size, fmt.zero_point))
    if problem:
        raise ValueError(f"config does not suit this package's {ks.weight_format.quantization} experts: {problem}")


def _check_inputs(ks: KernelSet, hidden_states, w13, w2, num_experts: Optional[int] = None,
                  names: tuple[str, str] = ("w13", "w2"), w13_scale=None, w2_scale=None, w13_zero=None,
                  w2_zero=None) -> None:
    _check_tensor("hidden_states", hidden_states)
    h, i = ks.hidden_size, ks.intermediate_size
    e = ks.num_experts if num_experts is None else num_experts
    device = hidden_states.device
    tokens = hidden_states.shape[0] if hidden_states.dim() == 2 else "T"
    _check("hidden_states", hidden_states, (tokens, h), ks.dtype, device)
    fmt = ks.weight_format
    _check_projection(ks, names[0], dict(weight=w13, scale=w13_scale, zero=w13_zero), fmt.w13_shapes(h, i, e), device)
    _check_projection(ks, names[1], dict(weight=w2, scale=w2_scale, zero=w2_zero), fmt.shapes(h, i, e), device)
    if device.type == "meta":
        raise ValueError("hidden_states and the weights are on the meta device (shapes without data); give the "
                         "kernels real tensors: a layer built on meta needs .to_empty(device='cuda') and its weights")
    if device.type != "cuda" and not ks.interpreted:
        late = " (it was set only after the import)" if knobs.triton_interpret() else ""
        raise RuntimeError(f"moegen kernels need CUDA tensors (got {device}); on the CPU set "
                           f"TRITON_INTERPRET=1 before importing the generated package{late} (slow: tiny shapes)")


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def tma_rows_aligned(hidden_size: int, intermediate_size: int, element_bytes: int) -> bool:
    """Whether contiguous weights of this shape can be read through tensor descriptors: every
    row (H or I elements) must span a multiple of 16 bytes."""
    return hidden_size * element_bytes % 16 == 0 and intermediate_size * element_bytes % 16 == 0


def tma_possible(ks: KernelSet) -> bool:
    return tma_rows_aligned(ks.hidden_size, ks.intermediate_size, torch.empty((), dtype=ks.dtype).element_size())


def tma_compatible(*contiguous: torch.Tensor) -> bool:
    """Whether contiguous tensors can be read through tensor descriptors, which need 16-byte
    aligned bases and strides: every stride is a multiple of the last dimension, so its bytes
    and the base decide (checked on every call: no per-stride loop)."""
    return all(t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0 for t in contiguous)


def _descriptor(tensor: torch.Tensor, block_shape: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(tensor, block_shape)


def _run_experts(ks: KernelSet, cfg: KernelConfig, hidden_states, weights, aligned: Alignment, w13, w2,
                 scales: WeightScales):
    hidden_states, w13, w2 = hidden_states.contiguous(), w13.contiguous(), w2.contiguous()
    inter = torch.empty((aligned.sorted_slots.numel(), ks.intermediate_size), dtype=ks.dtype,
                        device=hidden_states.device)
    out = torch.empty((hidden_states.shape[0], ks.hidden_size), dtype=ks.dtype, device=hidden_states.device)
    weight_args = _weight_args(ks, cfg, w13, w2, inter, scales)
    rows = _GemmRows(hidden_states, (), inter, None)
    if ks.quantize_rows is not None:
        x, x_scale = _quantized_rows_buffers(ks, hidden_states.shape[0], ks.hidden_size, hidden_states.device)
        _quantize_rows(ks, hidden_states, x, x_scale)
        rows = _GemmRows(x, (x_scale,), inter, _quantized_rows_buffers(ks, inter.shape[0], ks.intermediate_size,
                                                                         inter.device))
    run = functools.partial(_gemms, ks, cfg, rows, weights, aligned, weight_args, out)
    num_blocks = aligned.max_padded // cfg.block_m
    if cfg.streams == 1:
        run(0, num_blocks)
        return out
    if not hidden_states.is_cuda:  # the interpreter: one half after the other
        split = _halves_split(ks, cfg, weights, num_blocks)
        run(0, split)
        run(split, num_blocks)
        return out
    # An eager call runs on the caller's stream alone while the host paces the caller
    # (_host_paced). Only where the GPU is behind are the second stream's two launches and three
    # events, ~100-150 us of a MoE call's 250-650 us of host time (measured on the H200), hidden,
    # so that its GPU saving (1-4% of the call) shows; a transformers model is host-paced at
    # prefill and decode alike (same measurements). Decode batches take one stream without
    # asking: there the second stream saves the GPU at most 5-7 us, and asking costs the host
    # ~8. Calls captured in a CUDA graph, whose replays cost the host nothing, keep the tuned
    # streams.
    eager = _eager(hidden_states)
    if eager and hidden_states.shape[0] <= EAGER_ONE_STREAM_MAX_TOKENS:
        run(0, num_blocks)
        return out
    device = hidden_states.device
    if eager and _host_paced(device):
        run(0, num_blocks)
    else:
        main, events = torch.cuda.current_stream(device), _stream_events(device)
        side, split = side_stream(device), _halves_split(ks, cfg, weights, num_blocks)
        events.fork.record(main)
        side.wait_event(events.fork)
        run(0, split, main, zeroed=events.zeroed)
        run(split, num_blocks, side, wait_for=events.zeroed)
        events.join.record(side)
        main.wait_event(events.join)
    if eager:
        _record_call_end(device)
    return out


def _eager(hidden_states) -> bool:
    """A call on the GPU that is not being captured into a CUDA graph."""
    return hidden_states.is_cuda and not torch.cuda.is_current_stream_capturing()


def _host_paced(device: torch.device) -> bool:
    """Whether the GPU has finished the last-but-one eager call that asked (one event query):
    then it is within a call of the host, which paces the caller, and launches cost more than
    kernel time. The caller records its own end after its launches (_record_call_end)."""
    return _stream_events(device).call_ends[0].query()


def _record_call_end(device: torch.device) -> None:
    ends = _stream_events(device).call_ends
    ends[0].record(torch.cuda.current_stream(device))
    ends[0], ends[1] = ends[1], ends[0]  # the last call's end is asked about after the next


def _halves_split(ks: KernelSet, cfg: KernelConfig, weights, num_blocks: int) -> int:
    """Where a two-stream call's row blocks split: halves of the blocks the routing is expected
    to fill (a guess only balances the halves: the second half's blocks past the padded total
    exit at once), at a multiple of 4 blocks so that the shifted block experts stay 16-byte
    aligned, as the kernels were compiled. The second half's GEMM2 waits for the first half's
    GEMM1, which zeroes the output."""
    half = expected_blocks(weights.numel(), ks.num_experts, cfg.block_m) // 2
    return min(num_blocks, max(4, half // 4 * 4))


@dataclass(frozen=True)
class _WeightArgs:
    """The weights as the GEMMs take them: tensors, or tensor descriptors (made once per call
    and shared by both halves of a two-stream call)."""

    w13: object
    w2: object
    w13_strides: tuple[int, int]
    w2_strides: tuple[int, int]
    tma: bool
    evict_first: bool
    scales: WeightScales = NO_SCALES


def uses_tma(ks: KernelSet, cfg: KernelConfig) -> bool:
    """Descriptors where the config asks for them and the weights are unquantized: quantized
    weights are read with plain loads (their tiles are dequantized in registers)."""
    return cfg.tma and not ks.weight_format.quantized


def _weight_args(ks: KernelSet, cfg: KernelConfig, w13, w2, inter, scales: WeightScales) -> _WeightArgs:
    if uses_tma(ks, cfg) and tma_compatible(w13, w2, inter):  # inter's halves start at whole rows: aligned too
        return _WeightArgs(_descriptor(w13, [1, cfg.block_n, cfg.block_k]),
                           _descriptor(w2, [1, cfg.down_block_n, cfg.down_block_k]), w13.stride()[:2],
                           w2.stride()[:2], True, l2_evict_first(ks, cfg, True))
    return _WeightArgs(w13, w2, w13.stride()[:2], w2.stride()[:2], False, False, scales)


def l2_evict_first(ks: KernelSet, cfg: KernelConfig, use_tma: bool) -> bool:
    """Whether the kernels mark their tensor-descriptor copies L2 evict-first: a rewrite of their
    PTX (l2_hints), so never in the interpreter. The build's precompile asks the same."""
    return cfg.l2_evict_first and use_tma and not ks.interpreted


@dataclass(frozen=True)
class _GemmRows:
    """The GEMMs' activation rows: GEMM1's hidden states (quantized: and their scales), GEMM2's
    intermediate as GEMM1 writes it, and, where the format quantizes it, the buffers its
    quantized copy and scales go to (rows as the intermediate's)."""

    hidden: torch.Tensor
    hidden_scales: tuple
    inter: torch.Tensor
    inter_quantized: Optional[tuple[torch.Tensor, torch.Tensor]]


def _quantized_rows_buffers(ks: KernelSet, num_rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn rows [num_rows, width] and their float32 scales: per group of FP8_BLOCK
    inputs (fp8_block, [num_rows, groups]) or per row (fp8_channel, [num_rows, 1])."""
    groups = _cdiv(width, FP8_BLOCK) if ks.weight_format.quantization == "fp8_block" else 1
    return (torch.empty((num_rows, width), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((num_rows, groups), dtype=torch.float32, device=device))


# Rows per program of the quantizing pass.
QUANTIZE_ROWS_BLOCK = 32


def _quantize_rows(ks: KernelSet, src, dst, dst_scale, stream=None, slots=None, num_slots: int = 0) -> None:
    """One pass: src's rows [R, K] quantized into dst (float8_e4m3fn) and dst_scale; given the
    rows' slots (the intermediate's), only the rows whose slot is below num_slots."""
    num_rows, width = src.shape
    if num_rows == 0:
        return
    launch(ks.quantize_rows, (_cdiv(num_rows, QUANTIZE_ROWS_BLOCK), dst_scale.shape[1]), stream,
           src, dst, dst_scale, num_rows, src if slots is None else slots, num_slots, K_SIZE=width,
           BLOCK_R=QUANTIZE_ROWS_BLOCK, SLOT_ROWS=slots is not None, num_warps=4)


def _gemms(ks: KernelSet, cfg: KernelConfig, rows: _GemmRows, weights, aligned: Alignment, wargs: _WeightArgs,
           out, first: int, end: int, stream=None, zeroed=None, wait_for=None):
    """GEMM1 then GEMM2 over row blocks first .. end-1 on `stream` (None: the current one),
    which the kernels see as blocks 0 .. end-first-1 through shifted views. A range from block 0
    zeroes the output in GEMM1 (and records ``zeroed`` after it); another does not, and its
    GEMM2 waits for ``wait_for``."""
    if end == first:
        return
    hidden_states, inter = rows.hidden, rows.inter
    num_tokens, h, i, bm = hidden_states.shape[0], ks.hidden_size, ks.intermediate_size, cfg.block_m
    sorted_slots, block_runs = aligned.sorted_slots, aligned.block_runs
    inter_quantized = rows.inter_quantized
    if first:
        sorted_slots, block_runs, inter = sorted_slots[first * bm:], block_runs[first:], inter[first * bm:]
        if inter_quantized:
            inter_quantized = tuple(buffer[first * bm:] for buffer in inter_quantized)
    # The kernels find block b's tail rows at max_padded + b * TAIL_M of the layout they see: a
    # range not from block 0 passes the base its shifted view needs, and its first row, which
    # the kernels add to their blocks' rows before comparing them with the padded total.
    max_padded = aligned.max_padded + first * (aligned.tail_m - bm)
    dependent = dependent_launch(pdl_supported(hidden_states.device))
    inter_arg = _descriptor(inter, [bm, cfg.down_block_k]) if wargs.tma else inter
    launch(ks.gate_up, ((end - first) * _cdiv(i, cfg.block_n),), stream,
           hidden_states, *rows.hidden_scales, wargs.w13, *wargs.scales.w13, inter, out,
           sorted_slots, block_runs, aligned.num_padded,
           num_tokens * ks.top_k, max_padded, 0 if first else num_tokens, first * bm,
           hidden_states.stride(0), *wargs.w13_strides, inter.stride(0),
           BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
           TAIL_M=aligned.tail_m, TAIL_SPLIT=cfg.tail_split, HALF_BLOCKS=cfg.half_blocks, USE_TMA=wargs.tma,
           L2_EVICT_FIRST=wargs.evict_first, INT4_PAIR_OPS=cfg.int4_pair_ops, INT4_SWAPPED=cfg.int4_swapped,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dependent)
    if zeroed is not None:
        zeroed.record(stream)
    inter_scales = ()
    if inter_quantized:
        # This range's rows alone (its blocks', then their tail rows'): the other half's GEMM1
        # may still be writing its own.
        blocks, tails = (end - first) * bm, (end - first) * aligned.tail_m
        for start, count in ((0, blocks), (max_padded, tails)):
            _quantize_rows(ks, inter[start:start + count], *(buffer[start:start + count] for buffer in inter_quantized),
                           stream, sorted_slots[start:start + count], num_tokens * ks.top_k)
        inter_arg, inter, inter_scales = inter_quantized[0], inter_quantized[0], inter_quantized[1:]
    if wait_for is not None:
        stream.wait_event(wait_for)
    launch(ks.down_reduce, ((end - first) * _cdiv(h, cfg.down_block_n), cfg.split_k), stream,
           inter_arg, inter, *inter_scales, wargs.w2, *wargs.scales.w2, out, weights,
           sorted_slots, block_runs, aligned.num_padded,
           num_tokens * ks.top_k, max_padded, first * bm,
           inter.stride(0), *wargs.w2_strides, out.stride(0),
           BLOCK_M=bm, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, GROUP_M=cfg.group_m,
           SPLIT_K=cfg.split_k, TAIL_M=aligned.tail_m, TAIL_SPLIT=cfg.tail_split, HALF_BLOCKS=cfg.half_blocks,
           USE_TMA=wargs.tma, L2_EVICT_FIRST=wargs.evict_first, INT4_PAIR_OPS=cfg.int4_pair_ops,
           INT4_SWAPPED=cfg.int4_swapped, **dependent, **down_launch(cfg))


_side_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One second stream per device for the two-stream GEMMs; every call joins it back to the
    caller's stream before returning, so the caller's stream orders everything after."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


@dataclass(frozen=True)
class _StreamEvents:
    """A two-stream call's events, kept per device (creating them costs host time every call):
    the side stream waits for the caller's (fork), the second half's GEMM2 for the first half's
    GEMM1 (zeroed), the caller's stream for the side stream (join); and the ends of the last
    two eager calls that asked whether the GPU is behind, the older first (call_ends). Reused
    by every call, as the side stream is: moegen issues its MoE calls from one host thread per
    device."""

    fork: "torch.cuda.Event"
    zeroed: "torch.cuda.Event"
    join: "torch.cuda.Event"
    call_ends: list


_events: dict[torch.device, _StreamEvents] = {}


def _stream_events(device: torch.device) -> _StreamEvents:
    events = _events.get(device)
    if events is None:
        events = _events[device] = _StreamEvents(torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event(),
                                                [torch.cuda.Event(), torch.cuda.Event()])
    return events


def down_launch(cfg: KernelConfig) -> dict:
    """GEMM2's compile options (the register cap only where set: the compiler's choice stays the
    default, so that configs without one compile to the same kernels as before the cap existed)."""
    options = dict(num_warps=cfg.down_num_warps, num_stages=cfg.down_num_stages)
    if cfg.down_max_registers:
        options["maxnreg"] = cfg.down_max_registers
    return options


def fused_experts(ks: KernelSet, hidden_states, topk_weights, topk_ids, w13, w2, *, w13_scale=None, w2_scale=None,
                  w13_zero=None, w2_zero=None, config: Optional[KernelConfig] = None) -> torch.Tensor:
    """The experts for a routing chosen by the caller: [T,H]. Quantized experts take their scales
    (and zero points) as the format stores them (moegen/quant/formats.py)."""
    _check_inputs(ks, hidden_states, w13, w2, w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero,
                  w2_zero=w2_zero)
    _check_config(ks, config)
    return _experts(ks, hidden_states, topk_weights, topk_ids, w13, w2, ks.num_experts, config,
                    weight_scales(ks, w13_scale, w2_scale, w13_zero, w2_zero))


# A slot id past every pool (and past the decode kernel's padded expert ids): the pick is skipped.
SKIPPED_PICK = 2**31 - 1


def fused_experts_on_slots(ks: KernelSet, hidden_states, topk_weights, slot_ids, w13_pool, w2_pool, *,
                           w13_scale=None, w2_scale=None, w13_zero=None, w2_zero=None,
                           config: Optional[KernelConfig] = None, skipped_picks: bool = False) -> torch.Tensor:
    """The experts with weights from a slot pool ([S,2I,H], [S,H,I]; quantized: their storage
    and scales, slot first) and top-k given as slot indices: what the offload runtime runs,
    without gathering weights into a per-step tensor. With skipped_picks, in batches of two
    tokens or more, picks whose slot is SKIPPED_PICK add nothing (the runtime streams experts
    through the pool in groups: each call takes one group's picks)."""
    slots = w13_pool.shape[0]
    _check_inputs(ks, hidden_states, w13_pool, w2_pool, slots, names=("w13_pool", "w2_pool"), w13_scale=w13_scale,
                  w2_scale=w2_scale, w13_zero=w13_zero, w2_zero=w2_zero)
    _check_config(ks, config)
    return _experts(ks, hidden_states, topk_weights, slot_ids, w13_pool, w2_pool, slots, config,
                    weight_scales(ks, w13_scale, w2_scale, w13_zero, w2_zero), skips=skipped_picks)


def _experts(ks, hidden_states, topk_weights, topk_ids, w13, w2, num_experts, config, scales: WeightScales,
             skips: bool = False):
    num_tokens, device = hidden_states.shape[0], hidden_states.device
    _check("topk_weights", topk_weights, (num_tokens, ks.top_k), FLOATING, device)
    _check("topk_ids", topk_ids, (num_tokens, ks.top_k), INTEGER, device)
    if num_tokens == 0:
        return hidden_states.new_empty((0, ks.hidden_size))
    cfg = config or ks.config_for(num_tokens)
    if uses_decode(cfg, num_tokens):
        return _decode_routed(ks, cfg, hidden_states, topk_weights, topk_ids, w13, w2, num_experts, scales)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if num_experts <= ks.num_experts:  # what the routing kernels lay out (every pool of the offload runtime)
        aligned = align_picks(ks, topk_ids, weights, cfg.block_m, cfg.tail_m, cfg.tails_first)
    else:
        aligned = align_tokens(topk_ids, num_experts, cfg.block_m, cfg.tail_m, cfg.group_m, cfg.tails_first, skips)
    return _run_experts(ks, cfg, hidden_states, weights, aligned, w13, w2, scales)


def route_and_align(ks: KernelSet, router_logits, correction_bias, block_m: int, tail_m: int = 0,
                    tails_first: bool = False):
    """(flat top-k weights [T*k] float32, Alignment) for router logits [T, E]."""
    weights, _, aligned = _route(ks, router_logits, correction_bias, block_m, tail_m, tails_first)
    return weights, aligned


def _route(ks: KernelSet, router_logits, correction_bias, block_m: int, tail_m: int, tails_first: bool):
    """The routing kernels' picks, flat top-k weights (float32) and ids (int32) [T*k], and their
    Alignment."""
    num_slots, device = router_logits.shape[0] * ks.top_k, router_logits.device
    weights = torch.empty(num_slots, dtype=torch.float32, device=device)
    ids = torch.empty(num_slots, dtype=torch.int32, device=device)
    logits = router_logits.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None else weights  # unused pointer
    return weights, ids, _align(ks, logits, bias, weights, ids, block_m, tail_m, tails_first, route=True)


def align_picks(ks: KernelSet, topk_ids, weights, block_m: int, tail_m: int = 0,
                tails_first: bool = False) -> Alignment:
    """The Alignment of picks the caller chose ([T, k] ids below the spec's E; ids of E and above,
    SKIPPED_PICK, are left out), laid out by the routing kernels as routed picks are: one launch
    at decode sizes, where the tensor ops of align_tokens take ~20. weights (float32 [T*k]) only
    stand in for the pointers the kernels do not read without routing."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    return _align(ks, weights, weights, weights, ids, block_m, tail_m, tails_first, route=False)


def _align(ks: KernelSet, logits, bias, weights, ids, block_m: int, tail_m: int, tails_first: bool,
           route: bool) -> Alignment:
    """The routing kernels' launches: route (or read the picks in ids) and lay the slots out."""
    num_slots, device = ids.numel(), ids.device
    num_tokens = num_slots // ks.top_k
    # Without routing the logits' stride is the routed call's, so that both share specializations.
    stride = logits.stride(0) if route else ks.num_experts
    max_padded = max_padded_slots(num_slots, ks.num_experts, block_m)
    rows = aligned_rows(max_padded, block_m, tail_m)
    block_runs = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    dependent = dependent_launch(pdl_supported(device))
    if num_tokens <= single_route_max_tokens(ks.num_experts):
        sorted_slots = torch.empty(rows, dtype=torch.int32, device=device)
        launch(ks.route_align, (1,), None,
               logits, bias, weights, ids, sorted_slots, block_runs, num_padded,
               num_tokens, stride, max_padded,
               BLOCK_M=block_m, TAIL_M=tail_m, TAILS_FIRST=tails_first, ROUTE=route, **dependent,
               **single_route_launch(ks, num_tokens))
    else:
        count_launch, place_launch = multi_route_launch(ks)
        # Counters and rows in one buffer, filled by one launch (see the kernels' docstring).
        # The rows start 16-byte aligned, as the kernels were compiled for (any number of experts).
        rows_at = _cdiv(ks.num_experts, 4) * 4
        counts_and_slots = torch.full((rows_at + rows,), num_slots, dtype=torch.int32, device=device)
        counts, sorted_slots = counts_and_slots[:ks.num_experts], counts_and_slots[rows_at:]
        ranks = torch.empty(num_slots, dtype=torch.int32, device=device)
        launch(ks.route_count, (_cdiv(num_tokens, count_launch["BLOCK_T"]),), None,
               logits, bias, weights, ids, ranks, counts, num_tokens, stride, ROUTE=route, **dependent,
               **count_launch)
        launch(ks.route_place, (_cdiv(num_slots, place_launch["BLOCK_S"]),), None,
               ids, ranks, counts, sorted_slots, block_runs, num_padded, num_slots, max_padded,
               BLOCK_M=block_m, TAIL_M=tail_m, TAILS_FIRST=tails_first, **dependent, **place_launch)
    return Alignment(sorted_slots, block_runs, num_padded, max_padded, tail_m)


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper and later (not in the interpreter). Asked on every
    decode call: cached per device, off the launch path."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dependent_launch(pdl: bool) -> dict:
    """Launch options of a kernel run as a programmatic dependent of the kernel before it: compiled
    to wait for that kernel first (USE_PDL) and launched before it ends (launch_pdl). The build's
    precompile passes the same, so that the first launch finds the shipped kernel."""
    return dict(USE_PDL=pdl, launch_pdl=pdl)


_workspaces: dict[tuple, torch.Tensor] = {}


def decode_workspace(hidden_size: int, device: torch.device) -> torch.Tensor:
    """The decode kernel's float32 sums [DECODE_MAX_TOKENS, H]: zero between calls (the finish
    re-zeroes what it read), so one per device and width serves every call, eager or in a CUDA
    graph, without a memset. Calls on concurrent streams of one device would share it: moegen
    issues its MoE calls on one stream per device."""
    key = (device, hidden_size)
    work = _workspaces.get(key)
    if work is None:
        shape = (DECODE_MAX_TOKENS, hidden_size)
        if device.type != "cuda":
            work = torch.zeros(shape, dtype=torch.float32, device=device)
        elif torch.cuda.is_current_stream_capturing():
            # zeroed by a captured memset on every replay; not kept beyond the graph
            return torch.zeros(shape, dtype=torch.float32, device=device)
        else:
            work = _allocated_by_another_thread(shape, device)
        _workspaces[key] = work
    return work


def _allocated_by_another_thread(shape: tuple, device: torch.device) -> torch.Tensor:
    """Zeros kept across calls, allocated outside any CUDA-graph pool: torch.compile's graph
    warm-up (reduce-overhead) sends every allocation of the current thread to its pool, and
    refuses one that outlives the call ("not tracked as outputs", the e2e benchmark on the H100)."""
    made = []
    thread = threading.Thread(target=lambda: made.append(torch.zeros(shape, dtype=torch.float32, device=device)))
    thread.start()
    thread.join()
    torch.cuda.default_stream(device).synchronize()  # where the other thread zeroed it
    return made[0]


def decode_routed_block_t(ks: KernelSet, num_tokens: int) -> int:
    """Token rows of the routed decode kernel's pick tiles: the batch's bucket (or the batch) as a
    power of two, at most DECODE_MAX_TOKENS."""
    return pow2_at_least(min(max(ks.bucket_for(num_tokens), num_tokens), DECODE_MAX_TOKENS))


def _decode_routed(ks: KernelSet, cfg: KernelConfig, hidden_states, topk_weights, topk_ids, w13, w2,
                   num_experts: int, scales: WeightScales):
    """The one-launch decode kernel on the caller's picks (num_experts: the weights' first
    dimension, the slots of an offload pool)."""
    if uses_int4_mma(ks, cfg):
        return _int4_mma_launches(ks, cfg, hidden_states, topk_weights, topk_ids, w13, w2, num_experts, scales)
    return _decode_launches(ks, cfg, ks.decode_routed, (topk_weights.contiguous(), topk_ids.contiguous()), (),
                            num_experts, decode_routed_block_t(ks, hidden_states.shape[0]), hidden_states, w13, w2,
                            scales)


def _decode(ks: KernelSet, cfg: KernelConfig, hidden_states, router_logits, correction_bias, w13, w2,
            scales: WeightScales):
    if uses_int4_mma(ks, cfg):  # routed by the routing kernels first
        weights, ids, _ = _route(ks, router_logits, correction_bias, cfg.block_m, cfg.tail_m, cfg.tails_first)
        return _int4_mma_launches(ks, cfg, hidden_states, weights, ids, w13, w2, ks.num_experts, scales)
    logits = router_logits.contiguous()
    # without a bias the kernel never reads the pointer: the workspace stands in
    bias = correction_bias.contiguous() if correction_bias is not None else \
        decode_workspace(ks.hidden_size, hidden_states.device)
    return _decode_launches(ks, cfg, ks.decode, (logits, bias), (logits.stride(0),), ks.num_experts,
                            decode_block_t(ks, hidden_states.shape[0]), hidden_states, w13, w2, scales)


def _decode_launches(ks: KernelSet, cfg: KernelConfig, kernel, routing: tuple, routing_strides: tuple,
                     num_experts: int, block_t: int, hidden_states, w13, w2, scales: WeightScales):
    """A decode kernel (routing its tokens or reading the caller's picks: `routing`'s tensors
    and strides lead its arguments), then the finishing kernel that writes the output."""
    num_tokens, device = hidden_states.shape[0], hidden_states.device
    x, w13, w2 = hidden_states.contiguous(), w13.contiguous(), w2.contiguous()
    work = decode_workspace(ks.hidden_size, device)
    use_tma = uses_tma(ks, cfg) and tma_compatible(w13, w2)
    if use_tma:
        w13_arg = _descriptor(w13, [1, cfg.decode_block_n, cfg.decode_block_k])
        w2_arg = _descriptor(w2, [1, cfg.decode_block_h, cfg.decode_block_n])
    else:
        w13_arg, w2_arg = w13, w2
    pdl = pdl_supported(device)
    launch(kernel, decode_grid(num_tokens, ks.top_k, num_experts, ks.intermediate_size, cfg.decode_block_n), None,
           *routing, x, w13_arg, *scales.w13, w2_arg, *scales.w2, work,
           num_tokens, *routing_strides, x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
           BLOCK_T=block_t, BLOCK_N=cfg.decode_block_n, BLOCK_K=cfg.decode_block_k,
           BLOCK_H=cfg.decode_block_h, STAGGER_K=cfg.decode_stagger_k, USE_TMA=use_tma,
           L2_EVICT_FIRST=l2_evict_first(ks, cfg, use_tma), USE_PDL=pdl,
           num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages)
    return _decode_finish(ks, work, num_tokens, device, pdl)


def _decode_finish(ks: KernelSet, work: torch.Tensor, num_tokens: int, device, pdl: bool) -> torch.Tensor:
    """The output [T, H] cast from the decode workspace, which is zeroed again."""
    out = torch.empty((num_tokens, ks.hidden_size), dtype=ks.dtype, device=device)
    launch(ks.decode_finish, (_cdiv(out.numel(), DECODE_FINISH_BLOCK),), None,
           work, out, out.numel(), BLOCK=DECODE_FINISH_BLOCK, num_warps=4, **dependent_launch(pdl))
    return out


def uses_int4_mma(ks: KernelSet, cfg: KernelConfig) -> bool:
    """The Gluon int4 decode kernel where the config takes it and the GPU runs the kernels (Gluon
    has no interpreter: there the templates' decode kernel runs the config's slices)."""
    return cfg.decode_int4_mma and not ks.interpreted


def int4_mma_constexprs(ks: KernelSet, cfg: KernelConfig, num_tokens: int) -> dict:
    """The Gluon int4 decode kernel's constexprs and warps for a batch (the build compiles the same)."""
    return dict(H=ks.hidden_size, I=ks.intermediate_size, TOP_K=ks.top_k, K_PAD=pow2_at_least(ks.top_k),
                BLOCK_N=cfg.decode_block_n, BLOCK_H=cfg.decode_block_h, NUM_WARPS=cfg.decode_num_warps,
                ZERO_POINT=ks.weight_format.zero_point, TOKENS=8 if num_tokens <= 8 else 16,
                num_warps=cfg.decode_num_warps)


def _int4_mma_launches(ks: KernelSet, cfg: KernelConfig, hidden_states, topk_weights, topk_ids, w13, w2,
                       num_experts: int, scales: WeightScales):
    """The Gluon int4 decode kernel on picks [T, k] or flat [T*k] (its programs: every expert of the weights'
    first dimension, those no token picked end at once), then the finishing kernel."""
    from moegen.runtime.int4_mma import int4_decode_mma  # Gluon, imported where a config takes it

    num_tokens, device = hidden_states.shape[0], hidden_states.device
    work = decode_workspace(ks.hidden_size, device)
    words13, words2 = (w.contiguous().view(torch.int32) for w in (w13, w2))  # eight inputs a word
    launch(int4_decode_mma, (num_experts, ks.intermediate_size // cfg.decode_block_n), None,
           hidden_states.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), words13, *scales.w13[:2],
           words2, *scales.w2[:2], work, num_tokens, **int4_mma_constexprs(ks, cfg, num_tokens))
    return _decode_finish(ks, work, num_tokens, device, pdl_supported(device))


def fused_moe(ks: KernelSet, hidden_states, router_logits, w13, w2, *, correction_bias=None, w13_scale=None,
              w2_scale=None, w13_zero=None, w2_zero=None, config: Optional[KernelConfig] = None):
    """Route, then run the experts: [T,H]. No host synchronization. Quantized experts take their
    scales (and zero points) as the format stores them (moegen/quant/formats.py)."""
    _check_inputs(ks, hidden_states, w13, w2, w13_scale=w13_scale, w2_scale=w2_scale, w13_zero=w13_zero,
                  w2_zero=w2_zero)
    _check_config(ks, config)
    scales = weight_scales(ks, w13_scale, w2_scale, w13_zero, w2_zero)
    num_tokens = hidden_states.shape[0]
    _check("router_logits", router_logits, (num_tokens, ks.num_experts), FLOATING, hidden_states.device)
    if ks.routing.correction_bias:
        if correction_bias is None:
            raise ValueError("this spec has correction_bias: true; pass correction_bias=[num_experts] tensor")
        _check("correction_bias", correction_bias, (ks.num_experts,), FLOATING, hidden_states.device)
    elif correction_bias is not None:
        raise ValueError("correction_bias: this spec routes without one (correction_bias: false); drop the "
                         "argument, or build a spec with correction_bias: true")
    if num_tokens == 0:
        return hidden_states.new_empty((0, ks.hidden_size))
    cfg = config or ks.config_for(num_tokens)
    if uses_decode(cfg, num_tokens):
        return _decode(ks, cfg, hidden_states, router_logits, correction_bias, w13, w2, scales)
    # A host-paced eager call of a decode batch whose bucket runs the three-kernel path (routing,
    # GEMM1, GEMM2: four or five launches) takes the decode kernel of the largest bucket that
    # has one (two launches): 40-70% less host time per call on the H200's host, for up to 8%
    # more GPU time (43% at DeepSeek-V3's 12-16 tokens), which a host-paced caller does not wait
    # for. Where the GPU is behind, the tuned path. A config given by the caller runs as given.
    lean = ks.eager_decode_bucket
    if config is None and lean is not None and num_tokens <= DECODE_MAX_TOKENS and _eager(hidden_states):
        device = hidden_states.device
        if _host_paced(device):
            out = _decode(ks, ks.configs[lean], hidden_states, router_logits, correction_bias, w13, w2, scales)
        else:
            out = _route_and_run(ks, cfg, hidden_states, router_logits, correction_bias, w13, w2, scales)
        _record_call_end(device)
        return out
    return _route_and_run(ks, cfg, hidden_states, router_logits, correction_bias, w13, w2, scales)


def _route_and_run(ks: KernelSet, cfg: KernelConfig, hidden_states, router_logits, correction_bias, w13, w2,
                   scales: WeightScales):
    weights, aligned = route_and_align(ks, router_logits, correction_bias, cfg.block_m, cfg.tail_m, cfg.tails_first)
    return _run_experts(ks, cfg, hidden_states, weights, aligned, w13, w2, scales)
