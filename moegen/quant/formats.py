"""The expert weight formats: how each stores a weight matrix W [N, K] (N outputs, K inputs) per
expert, and what that costs in bytes. One place for these facts: the spec's checks, the cost
model, the offload plan, the quantizer, the loaders and the kernels' launch code read them here.

Storage of one projection, stacked over the E experts (w13 is gate then up along N; w2 is down):
- none: ``weight`` [E, N, K] in the model dtype.
- fp8_block: ``weight`` float8_e4m3fn [E, N, K]; ``scale`` float32 [E, ceil(N/128), ceil(K/128)],
  one per 128 x 128 block (w13: the gate's blocks, then the up projection's, each from its own
  first row, as checkpoints store them); W = weight * scale. Activations are quantized per token
  and per group of 128 inputs, on the fly.
- fp8_channel: ``weight`` float8_e4m3fn [E, N, K]; ``scale`` float32 [E, N]. Activations are
  quantized per token.
- int4_group: ``weight`` uint8 [E, N, ceil(K/2)], input k in the low nibble of byte k // 2 where k
  is even, the high nibble where odd; ``scale`` in the model dtype [E, N, ceil(K/G)], one per group
  of G inputs; with zero points ``zero`` uint8 [E, N, ceil(K/G)] (0..15): W = (q - zero) * scale,
  else W = (q - 8) * scale. Activations stay in the model dtype (w4a16).
"""
from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("none", "fp8_block", "fp8_channel", "int4_group")
INT4_GROUP_SIZES = (32, 64, 128)
FP8_BLOCK = 128  # fp8_block's weight blocks and activation groups, as DeepSeek-V3 and Qwen3-FP8 ship them
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT4_SYMMETRIC_ZERO = 8
FP8_MIN_ARCH = 89  # fp8 tensor cores: Ada (sm_89) and Hopper (sm_90) on
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stored_name(projection: str, part: str) -> str:
    """The name layers, slot pools and calls give a projection's stored tensor: w13, w13_scale,
    w2_zero, ..."""
    return projection if part == "weight" else f"{projection}_{part}"


def named_storage(stored13: dict, stored2: dict) -> dict:
    """w13's and w2's storage (by part: weight, scale, zero) under their stored names."""
    return {stored_name(projection, part): value for projection, stored in (("w13", stored13), ("w2", stored2))
            for part, value in stored.items()}


def scale_arguments(stored13: dict, stored2: dict) -> dict:
    """The scales and zero points of w13's and w2's storage as fused_moe's keyword arguments."""
    return {name: value for name, value in named_storage(stored13, stored2).items() if name not in ("w13", "w2")}


@dataclass(frozen=True)
class WeightFormat:
    """One spec's expert weight format: its quantization and the sizes that shape its storage."""

    quantization: str = "none"
    group_size: int = 0  # int4_group's inputs per scale (0 for the other formats)
    zero_point: bool = False  # int4_group with a zero point per group
    dtype: str = "bfloat16"  # the model dtype: activations, int4 scales, outputs

    @classmethod
    def of(cls, model) -> "WeightFormat":
        """The format of a ModelSpec."""
        int4 = model.quantization == "int4_group"
        return cls(model.quantization, model.quantization_group_size if int4 else 0,
                   bool(model.quantization_zero_point) and int4, model.dtype)

    @property
    def quantized(self) -> bool:
        return self.quantization != "none"

    @property
    def fp8(self) -> bool:
        return self.quantization in ("fp8_block", "fp8_channel")

    @property
    def key(self) -> str:
        """'' for unquantized weights, else a filename-safe suffix: fp8b, fp8c, int4g128 (z: zero points)."""
        if self.quantization == "int4_group":
            return f"int4g{self.group_size}" + ("z" if self.zero_point else "")
        return {"none": "", "fp8_block": "fp8b", "fp8_channel": "fp8c"}[self.quantization]

    def shapes(self, n: int, k: int, experts: int = 1) -> dict[str, tuple[int, ...]]:
        """The stored tensors of a weight [N, K] per expert, stacked over `experts`."""
        e = experts
        if self.quantization == "none":
            return {"weight": (e, n, k)}
        if self.quantization == "fp8_block":
            return {"weight": (e, n, k), "scale": (e, cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))}
        if self.quantization == "fp8_channel":
            return {"weight": (e, n, k), "scale": (e, n)}
        groups = cdiv(k, self.group_size)
        shapes = {"weight": (e, n, cdiv(k, 2)), "scale": (e, n, groups)}
        if self.zero_point:
            shapes["zero"] = (e, n, groups)
        return shapes

    def w13_shapes(self, hidden: int, inter: int, experts: int = 1) -> dict[str, tuple[int, ...]]:
        """w13 [E, 2I, H]: fp8_block's gate and up blocks are counted apart (I need not be a
        multiple of the block)."""
        shapes = self.shapes(2 * inter, hidden, experts)
        if self.quantization == "fp8_block":
            shapes["scale"] = (experts, 2 * cdiv(inter, FP8_BLOCK), cdiv(hidden, FP8_BLOCK))
        return shapes

    def element_bytes(self, name: str) -> int:
        """Bytes of one element of the stored tensor `name`."""
        if name == "weight":
            return DTYPE_BYTES[self.dtype] if self.quantization == "none" else 1
        if name == "zero":
            return 1
        return DTYPE_BYTES[self.dtype] if self.quantization == "int4_group" else 4  # scale

    def nbytes(self, shapes: dict[str, tuple[int, ...]]) -> int:
        total = 0
        for name, shape in shapes.items():
            count = 1
            for size in shape:
                count *= size
            total += count * self.element_bytes(name)
        return total

    def expert_bytes(self, hidden: int, inter: int) -> int:
        """One expert's gate, up and down projections as stored: weights, scales, zero points."""
        return self.nbytes(self.w13_shapes(hidden, inter)) + self.nbytes(self.shapes(hidden, inter))
