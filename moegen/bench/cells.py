"""One cell of a benchmark: one spec at one token count, every implementation first checked against
the float64 reference, then timed (moegen and grouped_mm as CUDA-graph replays, as serving
engines run them; the naive loop synchronizes with the host, so eagerly)."""
from __future__ import annotations

import functools
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from moegen import reference as ref
from moegen.bench.peers import EAGER_ONLY
from moegen.bench.roofline import Ceilings, Floor, Timer, floor_of, read_only_us
from moegen.quant.formats import scale_arguments
from moegen.quant.quantize import dequantize, dequantize_w13, quantize, quantize_w13
from moegen.runtime.routing import route

REFERENCE_MAX_TOKENS = 4096  # larger T are timed but not checked: the reference would cost more than the bench


@dataclass
class Measured:
    us: Optional[float] = None
    err: Optional[float] = None
    wrong: bool = False
    graph: bool = False
    note: str = ""  # why n/a, or "eager: ..." when graph capture failed


@dataclass
class Row:
    spec: str
    tokens: int
    floor_us: float
    bound: str
    touched: int
    nbytes: int = 0  # the memory floor's bytes
    results: dict = field(default_factory=dict)  # implementation -> Measured
    read_us: Optional[float] = None  # one streaming-read launch over the floor's bytes


class Workload:
    """One package's random experts and fresh inputs per call, drawn as every benchmark draws them:
    normal weights scaled by 1/sqrt(fan-in), normal hidden states, router logits with every
    selection clear-cut (moegen.reference.separated_router_logits) and, where the spec has one,
    the correction bias that keeps uniform routing uniform. Quantized experts: the random weights
    quantized (moegen.quant.quantize) for moegen, and what they stand for, dequantized to the model
    dtype, for the peers (w13, w2)."""

    def __init__(self, pkg, device: torch.device, seed: int, w13=None, w2=None):
        m = pkg.SPEC.model
        self.pkg, self.device, self.dtype = pkg, device, pkg.KERNELS.dtype
        self.fmt = pkg.KERNELS.weight_format
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.cpu_gen = torch.Generator().manual_seed(seed)
        h, inter, e = m.hidden_size, m.intermediate_size, m.num_experts
        self.w13 = torch.empty(e, 2 * inter, h, device=device, dtype=self.dtype) if w13 is None else w13
        self.w2 = torch.empty(e, h, inter, device=device, dtype=self.dtype) if w2 is None else w2
        torch.randn(self.w13.shape, generator=self.gen, out=self.w13).mul_(h ** -0.5)
        torch.randn(self.w2.shape, generator=self.gen, out=self.w2).mul_(inter ** -0.5)
        self.bias = ref.balanced_correction_bias(e, device) if m.correction_bias else None
        # (w13's and w2's addresses) -> (w13, w2, their storage): keyed by memory, not by the view
        # objects, which gpu_check makes anew per cell over the same buffers; holding the views
        # keeps an address from being reused by other weights while its entry stands.
        self._stored: dict[tuple[int, int], tuple] = {}
        if self.fmt.quantized:
            stored = self.stored(self.w13, self.w2)
            self.w13.copy_(dequantize_w13(stored[0], self.fmt, h, inter, self.dtype))
            self.w2.copy_(dequantize(stored[1], self.fmt, h, inter, self.dtype))

    def stored(self, w13, w2) -> tuple[dict, dict]:
        """w13's and w2's storage in the package's format (quantized once per pair of buffers)."""
        key = (w13.data_ptr(), w2.data_ptr())
        if key not in self._stored:
            self._stored[key] = (w13, w2, quantize_w13(w13, self.fmt), quantize(w2, self.fmt))
        return self._stored[key][2:]

    def kernel_call(self, x, logits, w13, w2):
        """moegen's fused_moe on weights w13, w2 (or, quantized, on their storage and scales)."""
        if not self.fmt.quantized:
            return self.pkg.fused_moe(x, logits, w13, w2, correction_bias=self.bias)
        stored13, stored2 = self.stored(w13, w2)
        return self.pkg.fused_moe(x, logits, stored13["weight"], stored2["weight"], correction_bias=self.bias,
                                  **scale_arguments(stored13, stored2))

    def experts_call(self, x, weights, ids, w13, w2):
        """moegen's fused_experts (the caller's picks) on the same weights as kernel_call."""
        if not self.fmt.quantized:
            return self.pkg.fused_experts(x, weights, ids, w13, w2)
        stored13, stored2 = self.stored(w13, w2)
        return self.pkg.fused_experts(x, weights, ids, stored13["weight"], stored2["weight"],
                                      **scale_arguments(stored13, stored2))

    def inputs(self, tokens: int):
        """(hidden states [T, H], router logits [T, E]), fresh."""
        x = torch.randn(tokens, self.pkg.SPEC.model.hidden_size, generator=self.gen, device=self.device,
                        dtype=self.dtype)
        logits = ref.separated_router_logits(tokens, self.pkg.KERNELS.routing, self.bias, generator=self.cpu_gen,
                                             device=self.device)
        return x, logits

    def reference(self, x, logits, w13, w2, quantized: bool = True):
        """The float64 reference of moegen's call (quantized experts: their storage, and for fp8
        the activations quantized too), or with quantized=False of the peers' (the dequantized
        weights w13, w2 as they are)."""
        routing, activation = self.pkg.KERNELS.routing, self.pkg.SPEC.model.activation
        if self.fmt.quantized and quantized:
            return ref.quantized_moe_reference(x, logits, *self.stored(w13, w2), self.fmt, routing, activation,
                                               self.bias)
        return ref.moe_reference(x, logits, w13, w2, routing, activation, self.bias)

    def floor(self, logits, ceilings: Ceilings) -> Floor:
        _, ids = route(logits, self.pkg.KERNELS.routing, self.bias)
        m = self.pkg.SPEC.model
        return floor_of(ids, m.hidden_size, m.intermediate_size, self.w13.element_size(), ceilings,
                        m.expert_bytes, self.fmt.fp8)


def measure_row(work: Workload, spec_name: str, tokens: int, impls: dict, ceilings: Ceilings,
                timer: Timer) -> tuple[Row, list[str]]:
    """The cell's row and its problems (moegen wrong, failing or not capturable; a peer that cannot
    run is only noted in its cell)."""
    from moegen.runtime.step_graphs import capture_graph

    problems: list[str] = []
    tolerance = ref.TOLERANCE[work.pkg.SPEC.model.dtype]
    x, logits = work.inputs(tokens)
    floor = work.floor(logits, ceilings)
    row = Row(spec_name, tokens, floor.us, floor.bound, floor.touched, floor.nbytes)
    if timer.cuda and row.bound == "memory":
        row.read_us = read_only_us(timer, floor.nbytes)
    checked = tokens <= REFERENCE_MAX_TOKENS
    expected = work.reference(x, logits, work.w13, work.w2) if checked else None
    # The peers multiply the dequantized weights and unquantized activations.
    peers_expected = (work.reference(x, logits, work.w13, work.w2, quantized=False)
                      if checked and work.fmt.quantized else expected)
    for name, impl in impls.items():
        fn: Callable = functools.partial(impl, x, logits, work.w13, work.w2)
        res = row.results[name] = Measured()
        try:
            out = fn()
            timer.sync()
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            res.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if name == "moegen":
                problems.append(f"{spec_name} T={tokens}: moegen raised {res.note}")
                traceback.print_exc()
            continue
        if expected is not None:
            res.err = ref.relative_error(out, expected if name == "moegen" else peers_expected)
        res.wrong = not bool(torch.isfinite(out).all()) or (res.err is not None and res.err > tolerance)
        if res.wrong and name == "moegen":
            problems.append(f"{spec_name} T={tokens}: moegen relative error {res.err} > {tolerance}")
        del out
        timed, graph = fn, None
        if timer.cuda and name not in EAGER_ONLY:
            try:
                graph, _ = capture_graph(fn, warmups=2)
                timed, res.graph = graph.replay, True
            except Exception as exc:  # noqa: BLE001
                res.note = "eager: graph capture failed"
                print(f"[{spec_name} T={tokens} {name}] graph capture failed: {exc}", file=sys.stderr)
                if name == "moegen":
                    problems.append(f"{spec_name} T={tokens}: moegen graph capture failed: {exc}")
                torch.cuda.synchronize()
        try:
            res.us = timer.median_us(timed)
        except Exception as exc:  # noqa: BLE001
            res.note = f"timing failed: {type(exc).__name__}"
            if name == "moegen":
                problems.append(f"{spec_name} T={tokens}: moegen timing failed: {exc}")
        del graph, timed
    return row, problems
