"""Analytic cost of one fused-MoE call, as sympy expressions of the shape and token count.

The floor on a GPU is max(bytes / HBM bandwidth, FLOPs / matrix rate): no kernel runs faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from moegen.ir import KernelSignature
from moegen.target import GpuTarget

T, H, I, E, K, B = sympy.symbols("T H I E k b", positive=True)
# One expert's weights as stored (gate, up and down with their scales): 3*H*I*b unquantized,
# about a half (fp8) or a quarter (int4) of that quantized (moegen/quant/formats.py).
W = sympy.symbols("W", positive=True)

# Two GEMMs per (token, expert) pair: [H -> 2I] and [I -> H], 2 FLOPs per multiply-add.
FLOPS = 2 * T * K * H * (2 * I) + 2 * T * K * I * H
# Expected distinct experts hit by T tokens routed uniformly, k distinct experts each.
EXPERTS_TOUCHED = E * (1 - (1 - K / E) ** T)
WEIGHT_BYTES = EXPERTS_TOUCHED * W
# Activations: read hidden states once, write the output once.
ACTIVATION_BYTES = 2 * T * H * B
BYTES = WEIGHT_BYTES + ACTIVATION_BYTES
FORMULAS = {"FLOPs": FLOPS, "experts touched": EXPERTS_TOUCHED, "bytes": BYTES}

_evaluate = sympy.lambdify((T, H, I, E, K, B, W), (FLOPS, EXPERTS_TOUCHED, BYTES), "math")

# Plain fp32 FMA (no tensor cores) runs at about 1/15 of the dense bf16 rate on datacenter GPUs.
_FP32_RATE_FRACTION = 1 / 15


@dataclass(frozen=True)
class BucketCost:
    tokens: int
    flops: float
    bytes: float
    experts_touched: float
    memory_us: float
    compute_us: float

    @property
    def floor_us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def bound(self) -> str:
        return "memory" if self.memory_us >= self.compute_us else "compute"


# fp8 tensor cores (Ada, Hopper) run twice the dense bf16 rate; int4 weights multiply after
# dequantization at the activations' rate.
_FP8_RATE_FACTOR = 2


def matrix_tflops(signature: KernelSignature, target: GpuTarget) -> float:
    """The matrix rate the kernels' products run at: the fp8 tensor cores' for fp8 weights (their
    activations are fp8 too), else the model dtype's."""
    rate = target.bf16_tflops
    if signature.weight_format.fp8:
        return rate * _FP8_RATE_FACTOR
    return rate * _FP32_RATE_FRACTION if signature.dtype == "float32" else rate


def expert_bytes(signature: KernelSignature) -> int:
    """W: one expert's weights as the signature's format stores them."""
    return signature.weight_format.expert_bytes(signature.hidden_size, signature.intermediate_size)


def bucket_cost(signature: KernelSignature, target: GpuTarget, tokens: int) -> BucketCost:
    s = signature
    flops, touched, nbytes = _evaluate(tokens, s.hidden_size, s.intermediate_size, s.num_experts,
                                       s.top_k, s.element_bytes, expert_bytes(s))
    return BucketCost(
        tokens=tokens,
        flops=float(flops),
        bytes=float(nbytes),
        experts_touched=float(touched),
        memory_us=float(nbytes) / (target.hbm_gbps * 1e3),
        compute_us=float(flops) / (matrix_tflops(s, target) * 1e6),
    )
