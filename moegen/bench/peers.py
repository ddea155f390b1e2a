"""The implementations moegen is timed against, each routing as moegen does (moegen.runtime.routing)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moegen.runtime.routing import RoutingParams, route


def _activation(name: str):
    return F.silu if name == "silu" else F.gelu


def naive_moe(x, logits, w13, w2, p: RoutingParams, bias, activation: str):
    """Route, then per expert: gather its tokens, two matmuls, weighted index_add. One host
    synchronization (the per-expert counts) decides which experts run."""
    weights, ids = route(logits, p, bias)
    t, k = ids.shape
    inter = w2.shape[-1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=p.num_experts).tolist()
    token = order // k
    slot_weight = weights.reshape(-1)[order].unsqueeze(1)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token[start:start + n]
        h = x[rows] @ w13[expert].T
        y = (_activation(activation)(h[:, :inter]) * h[:, inter:]) @ w2[expert].T
        out.index_add_(0, rows, y.float() * slot_weight[start:start + n])
        start += n
    return out.to(x.dtype)


def grouped_mm_moe(x, logits, w13, w2, p: RoutingParams, bias, activation: str):
    """Route, sort slots by expert, torch._grouped_mm twice, weighted scatter-add back. No host
    synchronization (counts by scatter_add, offsets as an int32 cumsum)."""
    weights, ids = route(logits, p, bias)
    t, k = ids.shape
    inter = w2.shape[-1]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(p.num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    token = order // k
    h = torch._grouped_mm(x[token], w13.transpose(-2, -1), offs=offs)
    a = _activation(activation)(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float() * weights.reshape(-1)[order].unsqueeze(1))
    return out.to(x.dtype)


# Implementations in table order; "naive" synchronizes with the host, so it is never captured.
IMPLS = ("moegen", "naive", "grouped_mm")
EAGER_ONLY = ("naive",)


def implementations(work) -> dict:
    """name -> fn(x, logits, w13, w2) of one layer of a Workload's package (w13, w2: the
    unquantized weights; moegen runs quantized experts on their storage, Workload.kernel_call)."""
    pkg, bias = work.pkg, work.bias
    m, p = pkg.SPEC.model, pkg.KERNELS.routing
    return {
        "moegen": work.kernel_call,
        "naive": lambda x, logits, w13, w2: naive_moe(x, logits, w13, w2, p, bias, m.activation),
        "grouped_mm": lambda x, logits, w13, w2: grouped_mm_moe(x, logits, w13, w2, p, bias, m.activation),
    }
