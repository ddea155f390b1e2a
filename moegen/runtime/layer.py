"""MoELayer: router, routed experts and shared experts, backed by a generated KernelSet.

The generated package subclasses MoELayerBase and sets `kernels` and `spec`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
import torch.nn.functional as F

from moegen.quant.checkpoint import METHODS, CheckpointError, infer_method, repack_expert
from moegen.quant.formats import named_storage
from moegen.quant.quantize import quantize, quantize_w13
from moegen.runtime import compile_op, fused
from moegen.runtime.host_experts import PROJECTION_NAMES


def _activation(name: str):
    return F.silu if name == "silu" else F.gelu


def shared_experts_output(x: torch.Tensor, shared_w13: torch.Tensor, shared_w2: torch.Tensor,
                          activation: str) -> torch.Tensor:
    """The shared experts, every token through all of them: [T, H]."""
    gate, up = F.linear(x, shared_w13).chunk(2, dim=-1)
    return F.linear(_activation(activation)(gate) * up, shared_w2)


class Router(torch.nn.Linear):
    """The router matmul in the spec's router_dtype (DeepSeek's runs in float32 beside bf16
    experts), also after a whole-model .to(dtype) has converted its weight."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype, device=None):
        super().__init__(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        self.compute_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.compute_dtype), self.weight.to(self.compute_dtype))


class MoELayerBase(torch.nn.Module):
    """For inference: the kernels have no backward, so no parameter asks for a gradient.

    Quantized experts (the spec's quantization) hold each projection as its format stores it
    (moegen/quant/formats.py): `w13`/`w2` the quantized weights, `w13_scale`/`w2_scale` their
    scales and, with zero points, `w13_zero`/`w2_zero`. Unquantized checkpoints are quantized as
    they load (round to nearest, moegen.quant.quantize)."""

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
        for name, (shape, stored) in fused.stored_tensors(self.kernels, m.num_experts).items():
            setattr(self, name, torch.nn.Parameter(torch.empty(shape, device=device, dtype=stored), requires_grad=False))
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
        w13, w2 = self._unquantized_experts()  # quantized experts: drawn unquantized, then quantized
        for weight, fan_in in ((self.gate.weight, m.hidden_size), (w13, m.hidden_size), (w2, m.intermediate_size),
                               (self.shared_w13, m.hidden_size), (self.shared_w2, max(m.shared_intermediate_size, 1))):
            if weight is not None:
                weight.normal_(0.0, fan_in ** -0.5)
        if self.kernels.weight_format.quantized:
            self.set_experts(w13, w2)

    def _unquantized_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where unquantized expert weights go: the parameters, or for quantized experts staging
        tensors in the model dtype, which set_experts quantizes."""
        if not self.kernels.weight_format.quantized:
            return self.w13, self.w2
        m = self.spec.model
        staging = dict(device=self.gate.weight.device, dtype=self.kernels.dtype)
        return (torch.empty(m.num_experts, 2 * m.intermediate_size, m.hidden_size, **staging),
                torch.empty(m.num_experts, m.hidden_size, m.intermediate_size, **staging))

    @torch.no_grad()
    def set_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Every expert from unquantized weights w13 [E, 2I, H] (gate rows, then up) and w2
        [E, H, I], quantized as the spec's format stores them."""
        fmt = self.kernels.weight_format
        for name, value in named_storage(quantize_w13(w13, fmt), quantize(w2, fmt)).items():
            getattr(self, name).copy_(value)

    def expert_scales(self) -> dict:
        """The quantized experts' scales (and zero points) as fused_moe takes them (empty: unquantized)."""
        return {name: getattr(self, name) for name in ("w13_scale", "w2_scale", "w13_zero", "w2_zero")
                if hasattr(self, name)}

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        return shared_experts_output(x, self.shared_w13, self.shared_w2, self.spec.model.activation)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        fused._check_tensor("hidden_states", hidden_states)
        shape, h = hidden_states.shape, self.spec.model.hidden_size
        if hidden_states.dim() == 0 or shape[-1] != h or hidden_states.dtype != self.kernels.dtype:
            raise ValueError(f"hidden_states: expected [..., {h}] {self.kernels.dtype}, got {list(shape)} "
                             f"{hidden_states.dtype}")
        if self.w13.dtype != fused.stored_dtype(self.kernels, "weight"):
            raise ValueError(f"w13 is {self.w13.dtype}: this package's kernels take "
                             f"{fused.stored_dtype(self.kernels, 'weight')}; do not convert the layer (.to(dtype), "
                             ".double(), ...)")
        x = hidden_states.reshape(-1, h)
        router_logits = self.gate(x)
        scales = self.expert_scales()
        if torch.compiler.is_compiling():  # one opaque operator in the traced graph
            out = compile_op.fused_moe_op(self.kernels_key, x, router_logits, self.w13, self.w2, self.correction_bias,
                                          **scales)
        else:  # eager: no dispatcher on the host's path
            out = fused.fused_moe(self.kernels, x, router_logits, self.w13, self.w2,
                                  correction_bias=self.correction_bias, **scales)
        if self.shared_w13 is not None:
            out = out + self.shared_output(x)
        return out.view(shape)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict, prefix: str = "", quant_method: Optional[str] = None) -> None:
        """Load a Hugging Face MoE block: `gate.weight`; the experts per expert as checkpoints
        store them, `experts.{e}.w1/w3/w2.weight` (Mixtral) or
        `experts.{e}.gate_proj/up_proj/down_proj.weight`, or stacked as a transformers 5 module
        holds them, `experts.gate_up_proj` [E, 2I, H] (gate first) and `experts.down_proj`
        [E, H, I]; optional `gate.e_score_correction_bias` and
        `shared_experts.gate_proj/up_proj/down_proj.weight`.
        Quantized experts (the package's spec has a quantization) also load from quantized
        checkpoints' per-expert tensors, repacked into the spec's format (moegen/quant/checkpoint.py):
        quant_method "fp8", "awq", "gptq" or "compressed-tensors" as the checkpoint's
        `quantization_config.quant_method` names it, or None to tell it from the tensors present.
        Unquantized expert weights are quantized as they load (round to nearest).
        Every tensor is checked (present, exact shape: no broadcasting) before any is copied, so a
        checkpoint that does not fit leaves the layer as it was."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
        # Quantized experts load into unquantized staging tensors, quantized once every one is in,
        # or, from a quantized checkpoint, into staging copies of their storage.
        quantized = self.kernels.weight_format.quantized
        m = self.spec.model
        method = self._checkpoint_method(state_dict, prefix, quant_method) if quantized else None
        w13, w2 = (None, None) if method is not None else self._unquantized_experts()
        targets = {prefix + name: dest for name, dest in self._hf_targets(state_dict, prefix, w13, w2)}
        stored, used = self._repacked_experts(state_dict, prefix, method) if method else ({}, set())
        missing = [key for key in targets if key not in state_dict]
        if missing:
            raise KeyError(f"state dict has no {missing[0]!r} (prefix {prefix!r})"
                           f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
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
        unused = sorted(k for k in state_dict if k.startswith(prefix) and k not in targets and k not in used)
        if unused:
            raise KeyError(f"state dict keys this layer does not use: {unused[:5]}"
                           f"{' ...' if len(unused) > 5 else ''}")
        for key, dest in targets.items():
            dest.copy_(state_dict[key])
        for name, value in stored.items():
            getattr(self, name).copy_(value)
        if quantized and method is None:
            self.set_experts(w13, w2)

    def _expert_names(self, state_dict: dict, prefix: str) -> tuple[str, str, str]:
        """The checkpoint's names of gate, up and down (Mixtral's w1/w3/w2 or gate/up/down_proj)."""
        for names in PROJECTION_NAMES.values():
            if any(key.startswith(f"{prefix}experts.0.{names[0]}.") for key in state_dict):
                return names
        raise KeyError(f"state dict has no {prefix}experts.0.w1.weight, {prefix}experts.0.gate_proj.weight "
                       f"nor {prefix}experts.gate_up_proj")

    def _checkpoint_method(self, state_dict: dict, prefix: str, quant_method: Optional[str]) -> Optional[str]:
        """The layout of a quantized checkpoint's experts (None: unquantized weights, to quantize)."""
        if quant_method is not None and quant_method not in METHODS:
            raise CheckpointError(f"quant_method {quant_method!r}: moegen reads {', '.join(METHODS)}, or None to tell "
                                  "it from the tensors")
        if prefix + "experts.gate_up_proj" in state_dict:  # a transformers module's unquantized experts
            return None
        first = f"{prefix}experts.0.{self._expert_names(state_dict, prefix)[0]}."
        found = infer_method(key[len(first):] for key in state_dict if key.startswith(first))
        if quant_method is not None and found is not None and found != quant_method:
            raise CheckpointError(f"{first}*: the tensors are {found}'s layout, not {quant_method}'s")
        return quant_method or found

    def _repacked_experts(self, state_dict: dict, prefix: str, method: str) -> tuple[dict, set]:
        """({parameter name: staged value}, the checkpoint keys read) of every expert's quantized
        projections, repacked (nothing is written to the layer yet)."""
        m, fmt = self.spec.model, self.kernels.weight_format
        stored = {name: torch.empty_like(param) for name, param in self.named_parameters()
                  if name.split("_")[0] in ("w13", "w2")}
        used = set()
        names = self._expert_names(state_dict, prefix)
        for e in range(m.num_experts):
            def tensors_of(name):
                base = f"{prefix}experts.{e}.{name}."
                tensors = {key[len(base):]: state_dict[key] for key in state_dict if key.startswith(base)}
                used.update(base + suffix for suffix in tensors)
                return tensors, base[:-1]

            for target, value in repack_expert(tensors_of, names, method, fmt, m.hidden_size,
                                               m.intermediate_size).items():
                stored[target][e] = value.to(stored[target].device)
        return stored, used

    def _hf_targets(self, state_dict: dict, prefix: str, w13: torch.Tensor,
                    w2: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name without the prefix, the part of a tensor it fills), in load order; the
        experts' go into w13 and w2 (the parameters, or staging tensors of quantized experts)."""
        targets = [("gate.weight", self.gate.weight)]
        if w13 is None:  # a quantized checkpoint's experts, which _repacked_experts reads
            pass
        elif prefix + "experts.gate_up_proj" in state_dict:
            targets += [("experts.gate_up_proj", w13), ("experts.down_proj", w2)]
        else:
            gate_name, up_name, down_name = self._expert_names(state_dict, prefix)
            inter = self.spec.model.intermediate_size
            for e in range(self.spec.model.num_experts):
                targets += [(f"experts.{e}.{gate_name}.weight", w13[e, :inter]),
                            (f"experts.{e}.{up_name}.weight", w13[e, inter:]),
                            (f"experts.{e}.{down_name}.weight", w2[e])]
        if self.correction_bias is not None:
            targets.append(("gate.e_score_correction_bias", self.correction_bias))
        if self.shared_w13 is not None:
            shared = self.shared_w2.shape[1]
            targets += [("shared_experts.gate_proj.weight", self.shared_w13[:shared]),
                        ("shared_experts.up_proj.weight", self.shared_w13[shared:]),
                        ("shared_experts.down_proj.weight", self.shared_w2)]
        return targets
