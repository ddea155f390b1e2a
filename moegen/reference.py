"""Float64 reference MoE, written for clarity, independent of the kernels and of runtime.routing.

Used by the tests, by tools/gpu_check.py and by the tuner to verify outputs.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from moegen.runtime.routing import RoutingParams

# Relative Frobenius error a kernel may show against this reference, by dtype (fp32 products
# are exact IEEE, not tf32).
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.5e-2}


def activation_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return x / (1.0 + torch.exp(-x))
    if activation == "gelu":  # exact (erf) GELU, as HF's "gelu"
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    raise ValueError(f"unknown activation {activation!r}")


def _selection(router_logits: torch.Tensor, p: RoutingParams, correction_bias):
    """Returns (scores, masked selection scores, group margin) in float64."""
    logits = router_logits.to(torch.float64)
    if p.scoring == "softmax":
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        scores = shifted.exp() / shifted.exp().sum(dim=-1, keepdim=True)
    else:
        scores = 1.0 / (1.0 + torch.exp(-logits))
    choice = scores + correction_bias.to(scores) if p.correction_bias else scores.clone()
    t = logits.shape[0]
    group_margin = torch.full((t,), math.inf, dtype=torch.float64, device=logits.device)
    if p.n_group > 1:
        per_group = choice.reshape(t, p.n_group, p.num_experts // p.n_group)
        ranked = per_group.sort(dim=-1, descending=True).values
        group_score = ranked[..., :2].sum(-1) if p.correction_bias else ranked[..., 0]
        order = group_score.sort(dim=-1, descending=True)
        if p.topk_group < p.n_group:
            group_margin = order.values[:, p.topk_group - 1] - order.values[:, p.topk_group]
        dropped = order.indices[:, p.topk_group:]
        eligible = torch.ones(t, p.n_group, dtype=torch.bool, device=logits.device)
        eligible[torch.arange(t, device=logits.device).unsqueeze(1), dropped] = False
        choice = per_group.masked_fill(~eligible.unsqueeze(-1), -math.inf).reshape(t, p.num_experts)
    return scores, choice, group_margin


def route_reference(router_logits, p: RoutingParams, correction_bias: Optional[torch.Tensor] = None):
    """Returns (weights [T,k] float64, ids [T,k] int64, margin [T] float64).

    margin is the smallest gap between a chosen and an unchosen candidate (expert or group):
    where it is tiny, another precision may legitimately pick differently."""
    scores, choice, group_margin = _selection(router_logits, p, correction_bias)
    ranked = choice.sort(dim=-1, descending=True, stable=True)
    ids = ranked.indices[:, : p.top_k]
    if p.top_k < p.num_experts:
        expert_margin = ranked.values[:, p.top_k - 1] - ranked.values[:, p.top_k]
    else:
        expert_margin = torch.full_like(group_margin, math.inf)
    weights = scores.gather(1, ids)
    if p.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * p.routed_scaling_factor
    return weights, ids, torch.minimum(expert_margin.nan_to_num(0.0), group_margin)


def balanced_correction_bias(num_experts: int, device="cpu") -> torch.Tensor:
    """The correction bias that benchmarks and the tuner time with: one value for every expert,
    so the bias path runs while the routing stays uniform, as a trained bias keeps it (balancing
    the experts' load is what it is for). A random one would skew the load: N(0, 0.02^2) gives
    DeepSeek-V3 23-296 rows per expert at 4096 tokens where uniform routing gives 93-166."""
    return torch.full((num_experts,), 0.05, dtype=torch.float32, device=device)


def separated_router_logits(
    num_tokens: int, p: RoutingParams, correction_bias=None, *, generator=None, device="cpu",
    dtype=torch.float32, min_margin: float = 1e-3,
) -> torch.Tensor:
    """Random normal router logits, with rows redrawn until every selection is clear-cut
    (margin >= min_margin), so that kernels in lower precision must route exactly like the
    reference and any output difference is the kernels' own error."""
    logits = torch.randn(num_tokens, p.num_experts, generator=generator, dtype=torch.float64)
    for _ in range(100):
        rounded = logits.to(dtype)
        bias = None if correction_bias is None else correction_bias.cpu()
        margin = route_reference(rounded.cpu(), p, bias)[2]
        bad = margin < min_margin
        if not bool(bad.any()):
            return rounded.to(device)
        logits[bad] = torch.randn(int(bad.sum()), p.num_experts, generator=generator, dtype=torch.float64)
    raise RuntimeError("could not draw well-separated router logits; lower min_margin")


def experts_reference(hidden_states, topk_weights, topk_ids, w13, w2, activation: str = "silu"):
    """sum_j weight[t,j] * W2[e] (act(W_gate[e] x) * (W_up[e] x)), accumulated in float64."""
    x = hidden_states.to(torch.float64)
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    ids = topk_ids.to(torch.int64)
    for expert in torch.unique(ids).tolist():
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        w_gate_up = w13[expert].to(torch.float64)
        h = x[rows] @ w_gate_up.T
        h = activation_ref(h[:, :inter], activation) * h[:, inter:]
        y = h @ w2[expert].to(torch.float64).T
        out.index_add_(0, rows, y * topk_weights[rows, slots].to(torch.float64).unsqueeze(1))
    return out


def moe_reference(hidden_states, router_logits, w13, w2, p: RoutingParams, activation="silu",
                  correction_bias=None):
    weights, ids, _ = route_reference(router_logits, p, correction_bias)
    return experts_reference(hidden_states, weights, ids, w13, w2, activation)


def quantized_experts_reference(hidden_states, topk_weights, topk_ids, w13: dict, w2: dict, fmt,
                                activation: str = "silu"):
    """experts_reference for quantized experts: w13 and w2 as their format stores them
    (moegen.quant.quantize), dequantized one expert at a time; for fp8 formats the activations
    quantized as the kernels quantize them (the hidden states, and the intermediate after its
    rounding to the model dtype). Accumulated in float64."""
    from moegen.quant.quantize import dequantize, dequantize_w13, quantize_activations

    hidden, inter = hidden_states.shape[1], w13["weight"].shape[1] // 2
    x = quantize_activations(hidden_states, fmt)
    out = torch.zeros_like(x)
    ids = topk_ids.to(torch.int64)
    model_dtype = hidden_states.dtype
    for expert in torch.unique(ids).tolist():
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        one13 = {part: value[expert:expert + 1] for part, value in w13.items()}
        one2 = {part: value[expert:expert + 1] for part, value in w2.items()}
        g = x[rows] @ dequantize_w13(one13, fmt, hidden, inter)[0].T
        mid = (activation_ref(g[:, :inter], activation) * g[:, inter:]).to(model_dtype)
        y = quantize_activations(mid, fmt) @ dequantize(one2, fmt, hidden, inter)[0].T
        out.index_add_(0, rows, y * topk_weights[rows, slots].to(torch.float64).unsqueeze(1))
    return out


def quantized_moe_reference(hidden_states, router_logits, w13: dict, w2: dict, fmt, p: RoutingParams,
                            activation="silu", correction_bias=None):
    weights, ids, _ = route_reference(router_logits, p, correction_bias)
    return quantized_experts_reference(hidden_states, weights, ids, w13, w2, fmt, activation)


def gated_mlp_reference(x, w_gate_up, w_down, activation="silu"):
    """A dense gated MLP (shared experts) in float64."""
    h = x.to(torch.float64) @ w_gate_up.to(torch.float64).T
    inter = w_down.shape[-1]
    return (activation_ref(h[:, :inter], activation) * h[:, inter:]) @ w_down.to(torch.float64).T


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error; NaN anywhere gives inf."""
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    denom = float(torch.linalg.vector_norm(ref64))
    num = float(torch.linalg.vector_norm(out64 - ref64))
    return num / denom if denom > 0 else num
