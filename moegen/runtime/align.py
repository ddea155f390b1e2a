"""Token-to-expert alignment on the device: group the T*k (token, slot) pairs by expert and pad
each expert's run to a multiple of BLOCK_M, so that every row block of the grouped GEMMs belongs
to exactly one expert. With tail_m > 0, a run longer than one block whose remainder is at most
tail_m rows is not padded: the remainder goes to the tail rows of the run's last block b, rows
max_padded + b * tail_m + j (the layout the routing kernels write too). With tails_first, the
runs with tail rows come before the others (each kind in expert order) and carry them on their
first block instead, so that the GEMMs start the blocks that take longest first.

Every row block gets a word for the grouped GEMMs: its expert, its rank in the expert's run of
blocks modulo RUN_WRAP and the blocks left in the run from it (itself included, capped at
RUN_WRAP), so that they group row blocks within one run (groups of a size dividing RUN_WRAP)
without searching for the run's start.

All shapes are static functions of (T, k, E, BLOCK_M) and nothing is read back to the host,
so the step is capturable in a CUDA graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The layout of a row block's word (the routing kernels write the same).
RUN_WRAP = 16
RANK_SHIFT = 16
LEFT_SHIFT = 20
EXPERT_MASK = (1 << RANK_SHIFT) - 1


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded length: every non-empty expert (at most min(E, slots)) adds < BLOCK_M."""
    padded = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return (padded + block_m - 1) // block_m * block_m


def expected_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Row blocks a uniform routing of num_slots slots fills: about E * (1 - (1 - 1/E)^slots)
    experts are touched, each padded to whole blocks (an estimate: no count is read back)."""
    touched = max(1, round(num_experts * (1 - (1 - 1 / num_experts) ** num_slots)))
    return touched * math.ceil(num_slots / touched / block_m)


def aligned_rows(max_padded: int, block_m: int, tail_m: int) -> int:
    """Rows of the sorted layout: every block's rows, then every block's tail rows."""
    return max_padded + max_padded // block_m * tail_m


@dataclass(frozen=True)
class Alignment:
    sorted_slots: torch.Tensor  # [max_padded + blocks * tail_m] int32: flat slot t*k+j, or num_slots
    block_runs: torch.Tensor  # [max_padded // BLOCK_M] int32: each row block's word (expert and run)
    num_padded: torch.Tensor  # [1] int32: padded rows actually used (tail rows not counted)
    max_padded: int
    tail_m: int = 0


def run_rows(counts: torch.Tensor, block_m: int, tail_m: int) -> torch.Tensor:
    """Rows each expert's run takes in the row blocks (the routing kernels' _run_rows)."""
    padded = (counts + (block_m - 1)) // block_m * block_m
    if tail_m:
        remainder = counts % block_m
        padded = torch.where((counts > block_m) & (remainder <= tail_m), counts - remainder, padded)
    return padded


def block_words(block_expert: torch.Tensor, padded_end: torch.Tensor, padded_rows: torch.Tensor,
                block_m: int) -> torch.Tensor:
    """The row blocks' words from their experts and the runs' padded ends and rows."""
    index = torch.arange(block_expert.numel(), dtype=torch.int32, device=block_expert.device)
    run_end = (padded_end // block_m).to(torch.int32)[block_expert]
    rank = index - run_end + (padded_rows // block_m).to(torch.int32)[block_expert]
    left = (run_end - index).clamp_(1, RUN_WRAP)
    return block_expert | (rank % RUN_WRAP) << RANK_SHIFT | (left - 1) << LEFT_SHIFT


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int, tail_m: int = 0,
                 group_m: int = 1, tails_first: bool = False, skips: bool = False) -> Alignment:
    """The layout for a routing chosen by the caller, in ~20 tensor ops (each a launch, in a CUDA
    graph too: few ops matter at decode sizes). Experts' runs come from one stable sort: where
    each expert's slots start is a binary search of the sorted ids. With skips, picks of ids
    num_experts and above are left out (three ops more)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    max_padded = max_padded_slots(num_slots, num_experts, block_m)

    sorted_expert, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_expert, torch.arange(num_experts + 1, device=device), out_int32=True)
    skipped = None
    if skips:  # skipped picks sort last, past every count: placed as the last expert's, then dropped
        skipped = sorted_expert >= num_experts
        sorted_expert = sorted_expert.clamp(max=num_experts - 1)
    count_start = bounds[:-1]
    counts = bounds[1:] - count_start
    padded_counts = run_rows(counts, block_m, tail_m)
    if tails_first:  # the experts in layout order: those whose runs have tail rows first
        layout = torch.argsort((padded_counts >= counts).to(torch.int8), stable=True)
        layout_end = padded_counts[layout].cumsum(0, dtype=torch.int32)
        padded_end = torch.empty_like(layout_end).scatter_(0, layout, layout_end)
    else:
        padded_end = layout_end = padded_counts.cumsum(0, dtype=torch.int32)
    padded_start = padded_end - padded_counts
    rank = torch.arange(num_slots, device=device) - count_start[sorted_expert]
    destination = padded_start[sorted_expert] + rank
    if tail_m:  # ranks past the run's padded rows go to the tail rows of its last (first) block
        rows = padded_counts[sorted_expert]
        tail_block = padded_start // block_m if tails_first else padded_end // block_m - 1
        tail_row = max_padded + tail_block[sorted_expert] * tail_m + rank - rows
        destination = torch.where(rank < rows, destination, tail_row)

    layout_rows = aligned_rows(max_padded, block_m, tail_m)
    sorted_slots = torch.full((layout_rows + (skipped is not None),), num_slots, dtype=torch.int32, device=device)
    if skipped is not None:
        destination = destination.masked_fill(skipped, layout_rows)  # the one row past the layout, cut off below
    sorted_slots = sorted_slots.scatter_(0, destination, order.to(torch.int32))[:layout_rows]
    block_start = torch.arange(0, max_padded, block_m, dtype=torch.int32, device=device)
    block_expert = torch.searchsorted(layout_end, block_start, right=True, out_int32=True).clamp_(max=num_experts - 1)
    if tails_first:
        block_expert = layout.to(torch.int32)[block_expert]
    # Groups of one need only the expert (its rank and what is left read as a run of one): a
    # dozen tensor ops fewer at the decode sizes.
    block_runs = block_words(block_expert, padded_end, padded_counts, block_m) if group_m > 1 else block_expert
    return Alignment(sorted_slots, block_runs, layout_end[-1:], max_padded, tail_m)
