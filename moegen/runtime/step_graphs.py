"""CUDA graphs of small per-layer steps, replayed with fresh inputs.

A decode step of one MoE layer is a few microseconds of GPU work behind ~20 eager launches
(alignment ops, two Triton kernels, tensor descriptors), so an eager layer-by-layer loop is bound
by the host (measured ~0.5 ms per layer step on the H200 for ~0.03-0.17 ms of GPU work). Each
(key, input shapes) is captured once: later calls copy their inputs into the captured buffers
and replay. Off the GPU, or for batches above max_tokens, the step runs eagerly.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional

import torch


def capture_graph(fn: Callable[[], object], warmups: int = 1, pool: Optional[tuple] = None):
    """(graph, output) of one call of fn captured in a CUDA graph (in ``pool``, a
    torch.cuda.graph_pool_handle(), when given), after warm-up calls on a side stream
    (compilation and allocation happen there, outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


class StepGraphs:
    """step(key, fn, *inputs) -> fn(*inputs), through a CUDA graph per (key, input shapes).

    fn must be a pure function of its tensor inputs and of tensors whose storage stays put (weights,
    slot pools, slot tables): the graph replays the launches it captured, reading those tensors
    in place. The output is a fresh tensor (a copy of the graph's), so it stays valid after the
    next replay."""

    def __init__(self, device, max_tokens: int = 16):
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        self.max_tokens = max_tokens
        self._graphs: dict = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def __call__(self, key: Hashable, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        if not self.enabled or inputs[0].shape[0] > self.max_tokens or torch.cuda.is_current_stream_capturing():
            return fn(*inputs)
        full_key = (key, tuple((t.shape, t.dtype) for t in inputs))
        entry = self._graphs.get(full_key)
        if entry is None:
            entry = self._graphs[full_key] = self._capture(fn, inputs)
        graph, static_inputs, static_out = entry
        for static, given in zip(static_inputs, inputs):
            static.copy_(given, non_blocking=True)
        graph.replay()
        return static_out.clone()

    def _capture(self, fn, inputs):
        static_inputs = [t.clone() for t in inputs]
        with torch.cuda.device(self.device):
            graph, static_out = capture_graph(lambda: fn(*static_inputs), pool=self._pool)
        return graph, static_inputs, static_out

    def __len__(self) -> int:
        return len(self._graphs)
