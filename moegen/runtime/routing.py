"""Router: scores -> (optionally grouped) top-k -> weights, exactly as the spec defines it.

Pure tensor code with static shapes and no host synchronization, so a decode step that calls
it can be captured in a CUDA graph. The float64 twin used by tests lives in moegen.reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RoutingParams:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False

    @classmethod
    def from_model(cls, model) -> "RoutingParams":
        return cls(
            num_experts=model.num_experts,
            top_k=model.top_k,
            scoring=model.scoring,
            renormalize=model.renormalize,
            n_group=model.n_group,
            topk_group=model.topk_group,
            routed_scaling_factor=model.routed_scaling_factor,
            correction_bias=model.correction_bias,
        )


def scores_of(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown scoring {scoring!r}")


def group_mask(choice: torch.Tensor, p: RoutingParams) -> torch.Tensor:
    """[T, E] bool: experts in the topk_group best groups. A group's score is the sum of its two
    best selection scores when a correction bias is used (DeepSeek-V3), else its best score."""
    t = choice.shape[0]
    grouped = choice.view(t, p.n_group, p.num_experts // p.n_group)
    if p.correction_bias:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best_groups = group_scores.topk(p.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return keep.unsqueeze(-1).expand_as(grouped).reshape(t, p.num_experts)


def route(
    router_logits: torch.Tensor, p: RoutingParams, correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_weights [T,k] float32, topk_ids [T,k] int32)."""
    work_dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    scores = scores_of(router_logits.to(work_dtype), p.scoring)
    if p.correction_bias:
        if correction_bias is None:
            raise ValueError("this spec has correction_bias: true; pass correction_bias=[num_experts] tensor")
        choice = scores + correction_bias.to(work_dtype)
    else:
        choice = scores
    if p.n_group > 1:
        choice = choice.masked_fill(~group_mask(choice, p), float("-inf"))
    topk_ids = choice.topk(p.top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if p.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if p.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * p.routed_scaling_factor
    return topk_weights.to(torch.float32), topk_ids.to(torch.int32)
