"""Quantized checkpoints' expert tensors, repacked into moegen's formats (moegen/quant/formats.py).

One projection (gate, up or down) of one expert at a time, from the tensors a checkpoint stores
under its name (`...experts.{e}.gate_proj.<suffix>`), by layout:
- "fp8" (DeepSeek-V3, Qwen3-FP8, fbgemm): `weight` float8_e4m3fn [N, K] with `weight_scale_inv`
  (per 128 x 128 block, float32) or `weight_scale` (per output channel: [N] or [N, 1]);
  W = weight * scale, whatever the name says.
- "awq" (AutoAWQ's GEMM layout): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], eight
  4-bit values a word along N in the order 0, 2, 4, 6, 1, 3, 5, 7 of the eight outputs; `scales`
  [K/G, N]; W[n, k] = (q - zero) * scale.
- "gptq" (AutoGPTQ's format): `qweight` int32 [K/8, N], eight values a word along K, the first
  in the lowest bits; `qzeros` int32 [K/G, N/8] along N, each stored one less than the zero
  point; `scales` [K/G, N]; `g_idx` [K], each input's group (inputs in order only: act-order
  with another `g_idx` is refused).
- "compressed-tensors" (pack-quantized): `weight_packed` int32 [N, K/8], eight values a word along
  K, stored plus 8; `weight_scale` [N, K/G]; `weight_shape` [N, K]; asymmetric schemes add
  `weight_zero_point` packed eight a word along N (plus 8, as the values), or unpacked [N, K/G] signed.
A layout that does not match the spec's format (group size, scales, bits) is refused with a
CheckpointError naming the tensor and what was expected."""
from __future__ import annotations

import torch

from moegen.errors import MoegenError
from moegen.quant.formats import FP8_BLOCK, WeightFormat, cdiv, named_storage
from moegen.quant.quantize import dequantize, pack_int4

METHODS = ("fp8", "awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output of each nibble of an AWQ word, lowest nibble first


class CheckpointError(MoegenError):
    """A checkpoint's expert tensors that do not fit the spec's weight format: bad input."""

    exit_code = 2


def infer_method(suffixes) -> str | None:
    """The layout a projection's stored suffixes name (None: unquantized `weight`)."""
    suffixes = set(suffixes)
    if "qweight" in suffixes:
        return "gptq" if "g_idx" in suffixes else "awq"
    if "weight_packed" in suffixes:
        return "compressed-tensors"
    if "weight_scale_inv" in suffixes or ("weight" in suffixes and "weight_scale" in suffixes):
        return "fp8"
    return None


def unpack_int32(packed: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 word along `dim`, value order[i] in nibble i (lowest first):
    int64 values 0..15, `dim` eight times as long."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the word's bits, whatever the sign
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [..., words, 8] by nibble
    by_value = torch.empty_like(nibbles)
    by_value[..., list(order)] = nibbles  # position order[i] takes nibble i
    moved = by_value.movedim(dim if dim >= 0 else dim - 1, -2)
    return moved.flatten(-2).movedim(-1, dim)


def _expect(name: str, tensor, shape: tuple, dtypes: tuple, what: str) -> torch.Tensor:
    if tensor is None:
        raise CheckpointError(f"{name}: missing; {what}")
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{name}: shape {list(tensor.shape)}, expected {list(shape)} ({what})")
    if dtypes and tensor.dtype not in dtypes:
        raise CheckpointError(f"{name}: dtype {tensor.dtype}, expected {' or '.join(map(str, dtypes))} ({what})")
    return tensor


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INT32 = (torch.int32,)


def repack(tensors: dict, method: str, fmt: WeightFormat, n: int, k: int, name: str) -> dict[str, torch.Tensor]:
    """One projection [N outputs, K inputs] of one expert from its checkpoint tensors (by suffix)
    in moegen's storage for the format, without the expert dimension. `name` (the projection's
    checkpoint name) prefixes the tensor names in errors."""
    if method not in METHODS:
        raise CheckpointError(f"{name}: quant_method {method!r} is not one moegen reads; use one of {', '.join(METHODS)}")
    wants = {"fp8": ("fp8_block", "fp8_channel"), "awq": ("int4_group",), "gptq": ("int4_group",),
             "compressed-tensors": ("int4_group", "fp8_channel", "fp8_block")}[method]
    if fmt.quantization not in wants:
        raise CheckpointError(f"{name}: a {method} checkpoint, but the spec's quantization is {fmt.quantization}; "
                              f"build a spec with quantization {' or '.join(wants)} (moegen spec reads the checkpoint's "
                              "config.json)")
    if fmt.fp8:
        return _fp8(tensors, fmt, n, k, name)
    group = fmt.group_size
    if method == "awq":
        return _awq(tensors, fmt, n, k, group, name)
    if method == "gptq":
        return _gptq(tensors, fmt, n, k, group, name)
    return _compressed_int4(tensors, fmt, n, k, group, name)


def repack_expert(tensors_of, names: tuple[str, str, str], method: str, fmt: WeightFormat, hidden: int,
                  inter: int) -> dict[str, torch.Tensor]:
    """One expert's storage by stored name (w13, w2 and their scales and zero points, without the
    expert dimension) from its gate, up and down projections; tensors_of(projection name) ->
    ({suffix: tensor}, the projection's checkpoint name). Gate's rows (and scale blocks) come
    before up's in w13."""
    gate, up, down = (repack(tensors, method, fmt, n, k, where)
                      for (tensors, where), n, k in ((tensors_of(names[0]), inter, hidden),
                                                     (tensors_of(names[1]), inter, hidden),
                                                     (tensors_of(names[2]), hidden, inter)))
    return named_storage({part: torch.cat((gate[part], up[part])) for part in gate}, down)


def dequantize_linear(tensors: dict, fmt: WeightFormat, n: int, k: int, name: str) -> torch.Tensor:
    """A quantized checkpoint's linear layer other than an expert (attention, shared experts) as
    float32 weights [N, K], from its tensors by suffix: the model runs it unquantized."""
    method = infer_method(tensors)
    stored = {part: value[None] for part, value in repack(tensors, method, fmt, n, k, name).items()}
    return dequantize(stored, fmt, n, k, torch.float32)[0]


def _fp8(tensors: dict, fmt: WeightFormat, n: int, k: int, name: str) -> dict:
    weight = _expect(f"{name}.weight", tensors.get("weight"), (n, k), (torch.float8_e4m3fn,), "float8_e4m3fn weights")
    if fmt.quantization == "fp8_block":
        blocks = (cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))
        scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        label = "weight_scale_inv" if "weight_scale_inv" in tensors else "weight_scale"
        scale = _expect(f"{name}.{label}", scale, blocks, _FLOATS, f"one scale per {FP8_BLOCK} x {FP8_BLOCK} block")
        return {"weight": weight, "scale": scale.to(torch.float32)}
    scale = tensors.get("weight_scale")
    if scale is not None and scale.dim() == 2 and scale.shape[1] == 1:
        scale = scale[:, 0]
    scale = _expect(f"{name}.weight_scale", scale, (n,), _FLOATS, "one scale per output channel")
    return {"weight": weight, "scale": scale.to(torch.float32)}


def _int4(q_nk: torch.Tensor, scale_nk: torch.Tensor, zero_nk, fmt: WeightFormat, name: str) -> dict:
    """moegen's int4 storage of values q [N, K] (0..15), scales and zero points [N, K/G]."""
    stored = {"weight": pack_int4(q_nk.to(torch.uint8)[None])[0], "scale": scale_nk.to(getattr(torch, fmt.dtype))}
    if fmt.zero_point:
        stored["zero"] = zero_nk.to(torch.uint8)
    elif not bool((zero_nk == 8).all()):
        raise CheckpointError(f"{name}: zero points other than 8, but the spec's quantization_zero_point is false; "
                              "set it to true")
    return stored


def _awq(tensors: dict, fmt: WeightFormat, n: int, k: int, group: int, name: str) -> dict:
    groups = cdiv(k, group)
    what = f"AWQ's GEMM layout, groups of {group} (the spec's quantization_group_size)"
    qweight = _expect(f"{name}.qweight", tensors.get("qweight"), (k, cdiv(n, 8)), _INT32, what)
    qzeros = _expect(f"{name}.qzeros", tensors.get("qzeros"), (groups, cdiv(n, 8)), _INT32, what)
    scales = _expect(f"{name}.scales", tensors.get("scales"), (groups, n), _FLOATS, what)
    q = unpack_int32(qweight, 1, AWQ_ORDER)[:, :n]  # [K, N]
    zero = unpack_int32(qzeros, 1, AWQ_ORDER)[:, :n]  # [K/G, N]
    return _int4(q.T, scales.T, zero.T, fmt, name)


def _gptq(tensors: dict, fmt: WeightFormat, n: int, k: int, group: int, name: str) -> dict:
    groups = cdiv(k, group)
    what = f"GPTQ's layout, groups of {group} (the spec's quantization_group_size)"
    qweight = _expect(f"{name}.qweight", tensors.get("qweight"), (cdiv(k, 8), n), _INT32, what)
    qzeros = _expect(f"{name}.qzeros", tensors.get("qzeros"), (groups, cdiv(n, 8)), _INT32, what)
    scales = _expect(f"{name}.scales", tensors.get("scales"), (groups, n), _FLOATS, what)
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        _expect(f"{name}.g_idx", g_idx, (k,), (torch.int32, torch.int64), what)
        if not torch.equal(g_idx.to(torch.int64), torch.arange(k, device=g_idx.device) // group):
            raise CheckpointError(f"{name}.g_idx: inputs out of order (act-order, desc_act: true); moegen reads GPTQ "
                                  "checkpoints whose groups follow the inputs: re-quantize with desc_act: false")
    q = unpack_int32(qweight, 0)[:k]  # [K, N]
    zero = (unpack_int32(qzeros, 1)[:, :n] + 1) & 0xF  # stored one less than the zero point
    return _int4(q.T, scales.T, zero.T, fmt, name)


def _compressed_int4(tensors: dict, fmt: WeightFormat, n: int, k: int, group: int, name: str) -> dict:
    groups = cdiv(k, group)
    what = f"compressed-tensors pack-quantized, 4 bits in groups of {group}"
    shape = tensors.get("weight_shape")
    if shape is not None and [int(v) for v in shape.reshape(-1).tolist()] != [n, k]:
        raise CheckpointError(f"{name}.weight_shape: {[int(v) for v in shape.reshape(-1).tolist()]}, expected {[n, k]}")
    packed = _expect(f"{name}.weight_packed", tensors.get("weight_packed"), (n, cdiv(k, 8)), _INT32, what)
    scale = _expect(f"{name}.weight_scale", tensors.get("weight_scale"), (n, groups), _FLOATS, what)
    q = unpack_int32(packed, 1)[:, :k]  # [N, K], each stored plus 8
    zero_point = tensors.get("weight_zero_point")
    if zero_point is None:
        zero = torch.full((n, groups), 8, dtype=torch.int64, device=q.device)
    elif tuple(zero_point.shape) == (cdiv(n, 8), groups) and zero_point.dtype == torch.int32 and n % 8 == 0:
        zero = unpack_int32(zero_point, 0)[:n]  # packed along N, plus 8 like the values
    else:
        zero = _expect(f"{name}.weight_zero_point", zero_point, (n, groups), (torch.int8, torch.int32, torch.int64),
                       what).to(torch.int64) + 8
    return _int4(q, scale, zero, fmt, name)
