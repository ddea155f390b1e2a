"""Analytic default kernel configs: a pure function of shape, token count and GPU.

Tuning (moegen tune) refines these; without a tuning-database entry the build uses them.
"""
from __future__ import annotations

from dataclasses import replace

from moegen.ir import KernelSignature
from moegen.plan.cost_model import bucket_cost
from moegen.runtime.fused import KernelConfig
from moegen.target import GpuTarget


def _pow2_at_least(x: float) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def gate_up_smem_bytes(c: KernelConfig, element_bytes: int) -> int:
    """Pipelined shared memory of GEMM1: an A tile and two B tiles (gate, up) per stage."""
    return c.num_stages * (c.block_m * c.block_k + 2 * c.block_k * c.block_n) * element_bytes


def down_smem_bytes(c: KernelConfig, element_bytes: int) -> int:
    return c.num_stages * (c.block_m * c.down_block_k + c.down_block_k * c.down_block_n) * element_bytes


def fits(c: KernelConfig, signature: KernelSignature, target: GpuTarget) -> bool:
    limit = target.smem_per_block_kib * 1024
    b = signature.element_bytes
    return gate_up_smem_bytes(c, b) <= limit and down_smem_bytes(c, b) <= limit


def default_config(signature: KernelSignature, target: GpuTarget, tokens: int) -> KernelConfig:
    """Row blocks just cover the expected tokens per expert; memory-bound (few tokens) shapes
    get narrow N tiles and deep K tiles so enough CTAs stream the weights, compute-bound ones
    get large square-ish tiles."""
    cost = bucket_cost(signature, target, tokens)
    tokens_per_expert = tokens * signature.top_k / max(cost.experts_touched, 1.0)
    block_m = min(max(_pow2_at_least(tokens_per_expert), 16), 128)
    if block_m <= 32:
        config = KernelConfig(block_m=block_m, block_n=64, block_k=128, group_m=1, num_warps=4,
                              num_stages=4, down_block_n=64, down_block_k=128)
    elif block_m == 64:
        config = KernelConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4,
                              num_stages=4, down_block_n=128, down_block_k=64)
    else:
        config = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8,
                              num_stages=3, down_block_n=128, down_block_k=64)
    # Tiles never wider than the (power-of-two rounded) dimension they cover.
    h, i = _pow2_at_least(signature.hidden_size), _pow2_at_least(signature.intermediate_size)
    config = replace(config, block_n=max(16, min(config.block_n, i)), block_k=max(16, min(config.block_k, h)),
                     down_block_n=max(16, min(config.down_block_n, h)),
                     down_block_k=max(16, min(config.down_block_k, i)))
    # Shrink pipelining until the stages fit shared memory (fp32 tiles are twice as large).
    while not fits(config, signature, target) and config.num_stages > 1:
        config = replace(config, num_stages=config.num_stages - 1)
    return config
