"""Record a model's routing as a moegen-trace v1 file, for `moegen plan --trace` and `moegen simulate`.

    with moegen.record_trace(model, package) as recorder:
        model.generate(**inputs, max_new_tokens=64)
    recorder.save("my-model.jsonl.gz")

The recorder hooks every MoE block of a transformers 5 model, its own blocks or moegen's layers in
their place (`replace_moe_blocks`, `load_offloaded`), and takes each token's picks from the block's router weights
with the package's routing (moegen.runtime.routing): what moegen's kernels pick for it. Each row of
a batch is a sequence. A forward with more than one token per row (a prompt) starts new
sequences; a forward of one token per row (a decoding step) continues them. Rows should be
unpadded: a padding token is routed like any other.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moegen.offload.trace import save_trace
from moegen.runtime.routing import route


def _moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE blocks in order: transformers' own, or moegen's layers (resident or
    offloaded) in their place."""
    from moegen.runtime.hf import BLOCK_CLASSES
    from moegen.runtime.layer import MoELayerBase
    from moegen.runtime.offload_model import OffloadedMoELayer

    return [module for module in model.modules()
            if type(module).__name__ in BLOCK_CLASSES or isinstance(module, (MoELayerBase, OffloadedMoELayer))]


class RoutingRecorder:
    """Collects every token's picks per MoE layer while the model runs; save() writes the trace."""

    def __init__(self, model: torch.nn.Module, package):
        self.blocks = _moe_blocks(model)
        if not self.blocks:
            raise ValueError(f"{type(model).__name__} has no MoE block to record (transformers 5's MoE blocks, or "
                             "moegen's layers in their place)")
        m = package.SPEC.model
        self.routing, self.top_k, self.num_experts = package.KERNELS.routing, m.top_k, m.num_experts
        self.router_dtype = getattr(torch, m.router_dtype) if m.router_dtype else package.KERNELS.dtype
        self.model_name = getattr(getattr(model, "config", None), "_name_or_path", "") or package.SPEC.name
        self.sequences: list[list[np.ndarray]] = []  # per sequence, per token: [layers, top_k]
        self._open: list[int] = []  # the sequences the batch rows continue
        self._step: list = [None] * len(self.blocks)  # this forward's picks per layer: [rows, tokens, top_k]
        self._handles = [block.register_forward_pre_hook(self._hook(layer)) for layer, block in enumerate(self.blocks)]

    def _hook(self, layer: int):
        def record(block, args):
            self._record(layer, block, args[0])
        return record

    def _picks(self, block, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(x.to(self.router_dtype), block.gate.weight.to(self.router_dtype))
        bias = getattr(block, "correction_bias", None)
        if bias is None:
            bias = getattr(block.gate, "e_score_correction_bias", None)
        _, ids = route(logits, self.routing, bias)
        rows = hidden_states.shape[0] if hidden_states.dim() == 3 else 1
        return ids.reshape(rows, -1, self.top_k)

    @torch.no_grad()
    def _record(self, layer: int, block, hidden_states: torch.Tensor) -> None:
        self._step[layer] = self._picks(block, hidden_states).cpu().numpy()
        if layer != len(self.blocks) - 1:
            return
        step = np.stack(self._step, axis=2)  # [rows, tokens, layers, top_k]
        self._step = [None] * len(self.blocks)
        rows, tokens = step.shape[:2]
        if tokens > 1 or len(self._open) != rows:  # a prompt: new sequences
            self._open = list(range(len(self.sequences), len(self.sequences) + rows))
            self.sequences.extend([] for _ in range(rows))
        for row, sequence in enumerate(self._open):
            self.sequences[sequence].extend(step[row])

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.sequences))

    def save(self, path, source: str = "moegen.record_trace", note: str = "") -> Path:
        """Write the recorded tokens as a moegen-trace v1 file (load_trace reads it back)."""
        if not self.num_tokens:
            raise ValueError("no tokens recorded: run the model inside `with record_trace(model, package):`")
        experts = np.concatenate([np.stack(tokens) for tokens in self.sequences if tokens])
        seq = np.concatenate([np.full(len(tokens), number) for number, tokens in enumerate(self.sequences) if tokens])
        return save_trace(path, experts, seq, model=self.model_name, num_experts=self.num_experts, source=source,
                          note=note)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "RoutingRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def record_trace(model: torch.nn.Module, package) -> RoutingRecorder:
    """A RoutingRecorder over the model's MoE blocks; use it as a context manager."""
    return RoutingRecorder(model, package)
