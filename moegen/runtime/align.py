"""Token-to-expert alignment on the device: group the T*k (token, slot) pairs by expert and pad
each expert's run to a multiple of BLOCK_M, so that every row block of the grouped GEMMs belongs
to exactly one expert.

All shapes are static functions of (T, k, E, BLOCK_M) and nothing is read back to the host,
so the step is capturable in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded length: every non-empty expert (at most min(E, slots)) adds < BLOCK_M."""
    padded = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return (padded + block_m - 1) // block_m * block_m


@dataclass(frozen=True)
class Alignment:
    sorted_slots: torch.Tensor  # [max_padded] int32: flat slot t*k+j, or num_slots for padding
    block_expert: torch.Tensor  # [max_padded // BLOCK_M] int32: the expert of each row block
    num_padded: torch.Tensor  # [1] int32: padded rows actually used
    max_padded: int


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    max_padded = max_padded_slots(num_slots, num_experts, block_m)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = padded_counts.cumsum(0)
    padded_start = padded_end - padded_counts
    count_start = counts.cumsum(0) - counts

    order = torch.sort(flat, stable=True).indices
    sorted_expert = flat[order]
    rank_in_expert = torch.arange(num_slots, device=device) - count_start[sorted_expert]
    destination = padded_start[sorted_expert] + rank_in_expert

    sorted_slots = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, destination, order.to(torch.int32))
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return Alignment(sorted_slots, block_expert, padded_end[-1:].to(torch.int32), max_padded)
