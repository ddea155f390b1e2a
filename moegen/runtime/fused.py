"""Launch the generated fused-MoE kernels: routing, alignment, GEMM1 (+activation), GEMM2
(+weighted top-k reduction). The generated package binds a KernelSet and calls these."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moegen import knobs
from moegen.runtime.align import align_tokens
from moegen.runtime.routing import RoutingParams, route


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # GEMM2 tile shape (shares block_m, which the alignment fixes)
    down_block_n: int
    down_block_k: int


@dataclass(frozen=True)
class KernelSet:
    """One specialization: the model shape baked into two kernels plus per-bucket configs."""

    gate_up: Callable
    down_reduce: Callable
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    dtype: torch.dtype
    routing: RoutingParams
    buckets: tuple[int, ...]
    configs: tuple[KernelConfig, ...]

    def config_for(self, num_tokens: int) -> KernelConfig:
        """The config of the smallest bucket >= num_tokens (the largest bucket beyond it)."""
        index = min(bisect.bisect_left(self.buckets, num_tokens), len(self.buckets) - 1)
        return self.configs[index]


def _check(name: str, tensor: torch.Tensor, shape: tuple, dtype: Optional[torch.dtype], device):
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")


def fused_experts(ks: KernelSet, hidden_states, topk_weights, topk_ids, w13, w2,
                  config: Optional[KernelConfig] = None) -> torch.Tensor:
    num_tokens = hidden_states.shape[0]
    h, i, e, k = ks.hidden_size, ks.intermediate_size, ks.num_experts, ks.top_k
    device = hidden_states.device
    _check("hidden_states", hidden_states, (num_tokens, h), ks.dtype, device)
    _check("topk_weights", topk_weights, (num_tokens, k), None, device)
    _check("topk_ids", topk_ids, (num_tokens, k), None, device)
    _check("w13", w13, (e, 2 * i, h), ks.dtype, device)
    _check("w2", w2, (e, h, i), ks.dtype, device)
    if device.type != "cuda" and not knobs.triton_interpret():
        raise RuntimeError(f"moegen kernels need CUDA tensors (got {device}); on the CPU set "
                           "TRITON_INTERPRET=1 before importing the generated package (slow: tiny shapes)")
    if num_tokens == 0:
        return hidden_states.new_empty((0, h))
    cfg = config or ks.config_for(num_tokens)
    hidden_states = hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    num_slots = num_tokens * k

    aligned = align_tokens(topk_ids, e, cfg.block_m)
    inter = torch.empty((aligned.max_padded, i), dtype=ks.dtype, device=device)
    num_m_blocks = aligned.max_padded // cfg.block_m
    grid1 = (num_m_blocks * triton_cdiv(i, cfg.block_n),)
    ks.gate_up[grid1](
        hidden_states, w13, inter,
        aligned.sorted_slots, aligned.block_expert, aligned.num_padded,
        num_slots, aligned.max_padded,
        hidden_states.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fp32 accumulator for the top-k reduction; float32 models accumulate in the output itself.
    out = torch.zeros((num_tokens, h), dtype=torch.float32, device=device)
    grid2 = (num_m_blocks * triton_cdiv(h, cfg.down_block_n),)
    ks.down_reduce[grid2](
        inter, w2, out, weights,
        aligned.sorted_slots, aligned.block_expert, aligned.num_padded,
        num_slots, aligned.max_padded,
        inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out if ks.dtype == torch.float32 else out.to(ks.dtype)


def fused_moe(ks: KernelSet, hidden_states, router_logits, w13, w2, *, correction_bias=None):
    num_tokens = hidden_states.shape[0]
    _check("router_logits", router_logits, (num_tokens, ks.num_experts), None, hidden_states.device)
    topk_weights, topk_ids = route(router_logits, ks.routing, correction_bias)
    return fused_experts(ks, hidden_states, topk_weights, topk_ids, w13, w2)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
