"""MoELayer: router, routed experts and shared experts, backed by a generated KernelSet.

The generated package subclasses MoELayerBase and sets `kernels` and `spec`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
import torch.nn.functional as F

from moegen.runtime import compile_op, fused
from moegen.runtime.host_experts import PROJECTION_NAMES


def _activation(name: str):
    return F.silu if name == "silu" else F.gelu


class Router(torch.nn.Linear):
    """The router matmul in the spec's router_dtype (DeepSeek's runs in float32 beside bf16
    experts), also after a whole-model .to(dtype) has converted its weight."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype, device=None):
        super().__init__(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        self.compute_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self.weight.to(self.compute_dtype))


class MoELayerBase(torch.nn.Module):
    """For inference: the kernels have no backward, so no parameter asks for a gradient."""

    kernels: fused.KernelSet
    spec = None

    def __init__(self, device=None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        m = self.spec.model
        dtype = dtype or self.kernels.dtype
        if dtype != self.kernels.dtype:
            raise ValueError(f"dtype {dtype}: this package's kernels are compiled for {self.kernels.dtype} "
                             f"(the spec's model.dtype); leave dtype unset, or build a spec for {dtype}")
        factory = dict(device=device, dtype=dtype)
        self.gate = Router(m.hidden_size, m.num_experts, getattr(torch, m.router_dtype) if m.router_dtype else dtype,
                           device)
        self.w13 = torch.nn.Parameter(torch.empty(m.num_experts, 2 * m.intermediate_size, m.hidden_size, **factory))
        self.w2 = torch.nn.Parameter(torch.empty(m.num_experts, m.hidden_size, m.intermediate_size, **factory))
        # DeepSeek-V3 keeps its selection bias in float32.
        self.correction_bias = (
            torch.nn.Parameter(torch.zeros(m.num_experts, device=device, dtype=torch.float32),
                               requires_grad=False)
            if m.correction_bias else None
        )
        shared = m.num_shared_experts * m.shared_intermediate_size
        # Several shared experts act as one dense MLP whose intermediate is their concatenation.
        self.shared_w13 = torch.nn.Parameter(torch.empty(2 * shared, m.hidden_size, **factory)) if shared else None
        self.shared_w2 = torch.nn.Parameter(torch.empty(m.hidden_size, shared, **factory)) if shared else None
        self.requires_grad_(False)
        self.kernels_key = compile_op.kernel_set_key(self.kernels)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        m = self.spec.model
        for weight, fan_in in ((self.gate.weight, m.hidden_size), (self.w13, m.hidden_size),
                               (self.w2, m.intermediate_size), (self.shared_w13, m.hidden_size),
                               (self.shared_w2, max(m.shared_intermediate_size, 1))):
            if weight is not None:
                weight.normal_(0.0, fan_in ** -0.5)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.shared_w13)
        gate, up = h.chunk(2, dim=-1)
        return F.linear(_activation(self.spec.model.activation)(gate) * up, self.shared_w2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        fused._check_tensor("hidden_states", hidden_states)
        shape, h = hidden_states.shape, self.spec.model.hidden_size
        if hidden_states.dim() == 0 or shape[-1] != h or hidden_states.dtype != self.kernels.dtype:
            raise ValueError(f"hidden_states: expected [..., {h}] {self.kernels.dtype}, got {list(shape)} "
                             f"{hidden_states.dtype}")
        if self.w13.dtype != self.kernels.dtype:
            raise ValueError(f"w13 is {self.w13.dtype}: this package's kernels run {self.kernels.dtype}; do not "
                             "convert the layer (.to(dtype), .double(), ...)")
        x = hidden_states.reshape(-1, h)
        router_logits = self.gate(x)
        if torch.compiler.is_compiling():  # one opaque operator in the traced graph
            out = compile_op.fused_moe_op(self.kernels_key, x, router_logits, self.w13, self.w2, self.correction_bias)
        else:  # eager: no dispatcher on the host's path
            out = fused.fused_moe(self.kernels, x, router_logits, self.w13, self.w2,
                                  correction_bias=self.correction_bias)
        if self.shared_w13 is not None:
            out = out + self.shared_output(x)
        return out.view(shape)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        """Load a Hugging Face MoE block: `gate.weight`; the experts per expert as checkpoints
        store them, `experts.{e}.w1/w3/w2.weight` (Mixtral) or
        `experts.{e}.gate_proj/up_proj/down_proj.weight`, or stacked as a transformers 5 module
        holds them, `experts.gate_up_proj` [E, 2I, H] (gate first) and `experts.down_proj`
        [E, H, I]; optional `gate.e_score_correction_bias` and
        `shared_experts.gate_proj/up_proj/down_proj.weight`.
        Every tensor is checked (present, exact shape: no broadcasting) before any is copied, so a
        checkpoint that does not fit leaves the layer as it was."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
        targets = {prefix + name: dest for name, dest in self._hf_targets(state_dict, prefix)}
        missing = [key for key in targets if key not in state_dict]
        if missing:
            raise KeyError(f"state dict has no {missing[0]!r} (prefix {prefix!r})"
                           f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
        m = self.spec.model
        for key, dest in targets.items():
            value = state_dict[key]
            fused._check_tensor(key, value)
            if value.is_meta:
                raise TypeError(f"{key}: a tensor without data (device meta); load the checkpoint's weights")
            if not value.dtype.is_floating_point:
                raise TypeError(f"{key}: expected real floating-point weights, got {value.dtype}")
            if tuple(value.shape) != tuple(dest.shape):
                raise ValueError(f"{key}: expected shape {list(dest.shape)}, got {list(state_dict[key].shape)}; "
                                 f"the checkpoint does not fit {self.spec.name} (hidden_size {m.hidden_size}, "
                                 f"intermediate_size {m.intermediate_size}, num_experts {m.num_experts})")
        unused = sorted(k for k in state_dict if k.startswith(prefix) and k not in targets)
        if unused:
            raise KeyError(f"state dict keys this layer does not use: {unused[:5]}"
                           f"{' ...' if len(unused) > 5 else ''}")
        for key, dest in targets.items():
            dest.copy_(state_dict[key])

    def _hf_targets(self, state_dict: dict, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name without the prefix, the part of a parameter it fills), in load order."""
        targets = [("gate.weight", self.gate.weight)]
        if prefix + "experts.gate_up_proj" in state_dict:
            targets += [("experts.gate_up_proj", self.w13), ("experts.down_proj", self.w2)]
        else:
            names = next((n for n in PROJECTION_NAMES.values() if prefix + f"experts.0.{n[0]}.weight" in state_dict),
                         None)
            if names is None:
                raise KeyError(f"state dict has no {prefix}experts.0.w1.weight, {prefix}experts.0.gate_proj.weight "
                               f"nor {prefix}experts.gate_up_proj")
            gate_name, up_name, down_name = names
            inter = self.spec.model.intermediate_size
            for e in range(self.spec.model.num_experts):
                targets += [(f"experts.{e}.{gate_name}.weight", self.w13[e, :inter]),
                            (f"experts.{e}.{up_name}.weight", self.w13[e, inter:]),
                            (f"experts.{e}.{down_name}.weight", self.w2[e])]
        if self.correction_bias is not None:
            targets.append(("gate.e_score_correction_bias", self.correction_bias))
        if self.shared_w13 is not None:
            shared = self.shared_w2.shape[1]
            targets += [("shared_experts.gate_proj.weight", self.shared_w13[:shared]),
                        ("shared_experts.up_proj.weight", self.shared_w13[shared:]),
                        ("shared_experts.down_proj.weight", self.shared_w2)]
        return targets
