"""Round-to-nearest quantization of expert weights into moegen's formats (moegen/quant/formats.py),
their dequantization, and the activation quantization of the fp8 formats: what `moegen quantize`
writes, what the loaders repack checkpoints into, and what the float64 reference multiplies.

Calibration (AWQ's or GPTQ's search for scales) is out of scope: scales come from each block's,
channel's or group's absolute maximum (int4 with zero points: its minimum and maximum)."""
from __future__ import annotations

import torch

from moegen.quant.formats import FP8_BLOCK, FP8_MAX, INT4_SYMMETRIC_ZERO, WeightFormat, cdiv


QUANTIZE_CHUNK_ELEMENTS = 1 << 27  # float32 elements quantized at once (512 MiB)


def _blocks(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """w [E, N, K] zero-padded to whole blocks and viewed as [E, N/rows, rows, K/cols, cols]."""
    e, n, k = w.shape
    padded = torch.zeros(e, cdiv(n, rows) * rows, cdiv(k, cols) * cols, dtype=w.dtype, device=w.device)
    padded[:, :n, :k] = w
    return padded.view(e, padded.shape[1] // rows, rows, padded.shape[2] // cols, cols)


def _fp8(values: torch.Tensor) -> torch.Tensor:
    """float32 values within +-448 to float8_e4m3fn, rounded to nearest even."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _scale_of(amax: torch.Tensor, top: float) -> torch.Tensor:
    """amax / top in float32, 1 where a block is all zeros (any scale represents it)."""
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def quantize(w: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """One projection's weights w [E, N, K] (any float dtype) in the format's storage."""
    if w.dim() != 3:
        raise ValueError(f"expected weights [experts, outputs, inputs], got shape {list(w.shape)}")
    if fmt.quantization == "none":
        return {"weight": w.detach().to(getattr(torch, fmt.dtype))}
    # A few experts at a time: the float32 intermediates of a whole DeepSeek-V3 projection
    # (256 x 2048 x 7168) would need several times its bytes on the GPU.
    e, n, k = w.shape
    step = _experts_per_chunk(n, k)
    parts = [_quantize_experts(w[first:first + step], fmt) for first in range(0, e, step)]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def _experts_per_chunk(n: int, k: int) -> int:
    """Experts of [N, K] weights whose float32 intermediates fit QUANTIZE_CHUNK_ELEMENTS (at least one)."""
    return max(1, QUANTIZE_CHUNK_ELEMENTS // max(1, n * k))


def _quantize_experts(w: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    w = w.detach().to(torch.float32)
    e, n, k = w.shape
    if fmt.quantization == "fp8_block":
        blocks = _blocks(w, FP8_BLOCK, FP8_BLOCK)
        scale = _scale_of(blocks.abs().amax(dim=(2, 4)), FP8_MAX)  # [E, N/128, K/128]
        q = _fp8(blocks / scale[:, :, None, :, None]).view(e, blocks.shape[1] * FP8_BLOCK, -1)[:, :n, :k]
        return {"weight": q.contiguous(), "scale": scale.contiguous()}
    if fmt.quantization == "fp8_channel":
        scale = _scale_of(w.abs().amax(dim=2), FP8_MAX)  # [E, N]
        return {"weight": _fp8(w / scale[:, :, None]), "scale": scale}
    groups = _blocks(w, 1, fmt.group_size).view(e, n, -1, fmt.group_size)  # [E, N, K/G, G]
    scale_dtype = getattr(torch, fmt.dtype)
    if fmt.zero_point:
        low, high = groups.amin(dim=3).clamp(max=0), groups.amax(dim=3).clamp(min=0)
        scale = _scale_of(high - low, 15.0).to(scale_dtype)
        zero = torch.round(-low / scale.float()).clamp(0, 15)
        q = torch.round(groups / scale.float()[..., None] + zero[..., None]).clamp(0, 15)
        stored = {"scale": scale, "zero": zero.to(torch.uint8)}
    else:
        scale = _scale_of(groups.abs().amax(dim=3), 7.0).to(scale_dtype)
        q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7) + INT4_SYMMETRIC_ZERO
        stored = {"scale": scale}
    return {"weight": pack_int4(q.view(e, n, -1)[:, :, :k].to(torch.uint8)), **stored}


def quantize_w13(w13: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """w13 [E, 2I, H] (gate rows, then up rows): fp8_block's gate and up are blocked apart, each
    from its own first row, as checkpoints store the two projections."""
    if fmt.quantization != "fp8_block":
        return quantize(w13, fmt)
    inter = w13.shape[1] // 2
    gate, up = quantize(w13[:, :inter], fmt), quantize(w13[:, inter:], fmt)
    return {name: torch.cat((gate[name], up[name]), dim=1) for name in gate}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K] of values 0..15 -> [E, N, ceil(K/2)]: input k in the low nibble where k is
    even, in the high nibble where odd."""
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [..., K] of values 0..15."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[..., :k]


def dequantize(stored: dict[str, torch.Tensor], fmt: WeightFormat, n: int, k: int,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The weights [E, N, K] a projection's storage stands for, in `dtype`."""
    w = stored["weight"]
    if fmt.quantization == "none":
        return w.to(dtype)
    # A few experts at a time, as quantize: int4's unpacked nibbles, zero points and scales of a
    # whole DeepSeek-V3 projection are each as large as the result (OOM on the H100).
    e = w.shape[0]
    step = _experts_per_chunk(n, k)
    if e <= step:
        return _dequantize_experts(stored, fmt, n, k, dtype)
    out = torch.empty((e, n, k), dtype=dtype, device=w.device)
    for first in range(0, e, step):
        out[first:first + step] = _dequantize_experts({name: t[first:first + step] for name, t in stored.items()},
                                                      fmt, n, k, dtype)
    return out


def _dequantize_experts(stored: dict[str, torch.Tensor], fmt: WeightFormat, n: int, k: int,
                        dtype: torch.dtype) -> torch.Tensor:
    w = stored["weight"]
    if fmt.quantization == "fp8_block":
        rows = torch.arange(n, device=w.device) // FP8_BLOCK
        cols = torch.arange(k, device=w.device) // FP8_BLOCK
        scale = stored["scale"].to(dtype)[:, rows][:, :, cols]
        return w.to(dtype) * scale
    if fmt.quantization == "fp8_channel":
        return w.to(dtype) * stored["scale"].to(dtype)[:, :, None]
    group = torch.arange(k, device=w.device) // fmt.group_size
    q = unpack_int4(w, k).to(dtype)
    zero = stored["zero"].to(dtype)[:, :, group] if fmt.zero_point else INT4_SYMMETRIC_ZERO
    return (q - zero) * stored["scale"].to(dtype)[:, :, group]


def dequantize_w13(stored: dict[str, torch.Tensor], fmt: WeightFormat, hidden: int, inter: int,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """w13 [E, 2I, H] from its storage (fp8_block: gate and up blocks apart)."""
    if fmt.quantization != "fp8_block":
        return dequantize(stored, fmt, 2 * inter, hidden, dtype)
    half = stored["scale"].shape[1] // 2
    parts = [dequantize({"weight": stored["weight"][:, rows], "scale": stored["scale"][:, scales]}, fmt, inter,
                        hidden, dtype)
             for rows, scales in ((slice(0, inter), slice(0, half)), (slice(inter, None), slice(half, None)))]
    return torch.cat(parts, dim=1)


def quantize_activations(x: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """What the fp8 kernels multiply in place of activations x [T, K]: per token (fp8_channel) or
    per token and group of 128 inputs (fp8_block), scale = amax / 448 and x * (448 / amax) rounded
    to float8_e4m3fn, all in float32 as the kernels compute it; returned dequantized, in float64.
    Other formats multiply x as it is."""
    if not fmt.fp8:
        return x.to(torch.float64)
    t, k = x.shape
    group = FP8_BLOCK if fmt.quantization == "fp8_block" else max(k, 1)
    blocks = _blocks(x.to(torch.float32)[None], 1, group)[0, :, 0]  # [T, K/G, G]
    amax = blocks.abs().amax(dim=2, keepdim=True)
    # Tensor by tensor: torch divides a Python number by a tensor through the reciprocal, which
    # rounds differently from the kernels' correctly rounded division, and with bf16 or fp16
    # activations many products land on a rounding tie of the fp8 grid.
    top = torch.full_like(amax, FP8_MAX)
    inverse = torch.where(amax > 0, top / amax.clamp(min=1e-30), torch.zeros_like(amax))
    scale = amax / top
    q = _fp8(blocks * inverse).to(torch.float64) * scale.to(torch.float64)
    return q.reshape(t, -1)[:, :k]
