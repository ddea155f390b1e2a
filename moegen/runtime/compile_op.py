"""fused_moe as one opaque torch operator, so that torch.compile traces a model around moegen's
MoE calls (and "reduce-overhead" CUDA graphs capture them) instead of into their launch code,
which Dynamo cannot follow."""
from __future__ import annotations

from typing import Optional

import torch

from moegen.runtime import fused

# Kernel sets by key: an operator takes tensors and plain values, not a KernelSet. Held for the
# process's life, as their packages are, so a key is never reused.
_KERNEL_SETS: dict[int, fused.KernelSet] = {}


def kernel_set_key(ks: fused.KernelSet) -> int:
    _KERNEL_SETS.setdefault(id(ks), ks)
    return id(ks)


@torch.library.custom_op("moegen::fused_moe", mutates_args=())
def fused_moe_op(kernels: int, hidden_states: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, correction_bias: Optional[torch.Tensor] = None,
                 w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                 w13_zero: Optional[torch.Tensor] = None, w2_zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    return fused.fused_moe(_KERNEL_SETS[kernels], hidden_states, router_logits, w13, w2,
                           correction_bias=correction_bias, w13_scale=w13_scale, w2_scale=w2_scale,
                           w13_zero=w13_zero, w2_zero=w2_zero)


@fused_moe_op.register_fake
def _fused_moe_shape(kernels, hidden_states, router_logits, w13, w2, correction_bias=None, w13_scale=None,
                     w2_scale=None, w13_zero=None, w2_zero=None):
    return hidden_states.new_empty((hidden_states.shape[0], _KERNEL_SETS[kernels].hidden_size))
