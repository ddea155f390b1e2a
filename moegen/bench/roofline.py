"""The roofline: ceilings measured on this device, a call's floor, the read-only bound, the timer.

Floor = max((bytes of the distinct experts the routing touches + activations in and out) / HBM
bandwidth, 6*T*k*H*I FLOPs / GEMM rate), both rates measured in the same process. The read-only
bound is one launch of the fastest streaming read over exactly the floor's bytes, timed as the
kernels are: what a kernel that does nothing but read them takes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch


class Timer:
    """Median wall time of fn() in microseconds: on the GPU moegen.tune.bench.time_evicted (CUDA
    events, L2 evicted by a clean 256 MiB read before each timed call, outside the timed region),
    which the tuner's confirmation also times with; perf_counter on the CPU (a smoke run)."""

    def __init__(self, device: torch.device, quick: bool = False):
        self.device, self.quick = device, quick
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_us(self, fn: Callable, warmup: int = 2, target_s: Optional[float] = None,
                  min_reps: Optional[int] = None, max_reps: Optional[int] = None) -> float:
        from moegen.tune.bench import JUDGED_TIMING_S, time_cpu, time_evicted

        target_s = target_s if target_s is not None else (0.08 if self.quick else JUDGED_TIMING_S)
        min_reps = min_reps if min_reps is not None else (3 if self.quick else 5)
        max_reps = max_reps if max_reps is not None else (25 if self.quick else 200)
        if self.cuda:
            return time_evicted(fn, warmup, target_s, min_reps, max_reps)
        return time_cpu(fn, repeats=min_reps)


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float
    read_gbps: float
    gemm_tflops: float  # timed like the kernels: the floor's rate
    gemm_dtype: str
    fp8_tflops: float = 0.0  # an fp8 matmul's rate (fp8 experts' floor), where measured
    # The same matmul with fp8_block's scales (activations per row and 128 inputs, weights per
    # 128 x 128 block): the best library GEMM on that format's data, where torch has one.
    fp8_block_tflops: float = 0.0

    @property
    def hbm_gbps(self) -> float:
        return max(self.copy_gbps, self.read_gbps)


def measure_ceilings(timer: Timer) -> Ceilings:
    """On the GPU the tuner's figures (moegen.tune.bench.measure_ceilings: its GEMM rate timed as
    the kernels are); on the CPU small problems, figures that only exercise the tables."""
    if timer.cuda:
        from moegen.tune.bench import measure_ceilings as measure

        copy_gbps, read_gbps, _, tflops = measure()
        torch.cuda.empty_cache()
        return Ceilings(copy_gbps, read_gbps, tflops, "bfloat16", measure_fp8_tflops(), measure_fp8_tflops(blocked=True))
    src = torch.ones(64 << 20, dtype=torch.uint8)
    t = timer.median_us(lambda: src.clone(), warmup=1, target_s=0.05)
    n = 256
    a = torch.randn(n, n)
    t_mm = timer.median_us(lambda: a @ a, warmup=1, target_s=0.05)
    rate = 2 * n ** 3 / (t_mm * 1e6)
    return Ceilings(2 * src.numel() / (t * 1e3), src.numel() / (t * 1e3), rate, "float32", rate)


@dataclass(frozen=True)
class Floor:
    us: float
    bound: str  # "memory" or "compute"
    touched: int  # distinct experts the routing chose
    nbytes: int  # the memory floor's bytes


def floor_of(topk_ids: torch.Tensor, hidden_size: int, intermediate_size: int, element_size: int,
             ceilings: Ceilings, expert_bytes: Optional[int] = None, fp8: bool = False) -> Floor:
    """The floor of one call whose routing chose topk_ids [T, k]: the distinct experts' bytes as
    stored (expert_bytes; unquantized 3*H*I*element_size) and the activations in and out; the
    products at the bf16 rate, or the fp8 rate for fp8 experts."""
    t, k = topk_ids.shape
    touched = int(torch.unique(topk_ids).numel())
    expert_bytes = expert_bytes or 3 * hidden_size * intermediate_size * element_size
    nbytes = touched * expert_bytes + 2 * t * hidden_size * element_size
    mem_s = nbytes / (ceilings.hbm_gbps * 1e9)
    rate = ceilings.fp8_tflops if fp8 else ceilings.gemm_tflops
    flop_s = 6 * t * k * hidden_size * intermediate_size / (rate * 1e12)
    return Floor(max(mem_s, flop_s) * 1e6, "memory" if mem_s >= flop_s else "compute", touched, nbytes)


def measure_fp8_tflops(blocked: bool = False) -> float:
    """TFLOP/s of an 8192^3 fp8 (e4m3) matmul with float32 scales (torch._scaled_mm, cuBLAS) on
    random data, timed as the kernels are: one scale per operand, or (blocked) fp8_block's, A's
    per row and 128 inputs and B's per 128 x 128 block. 0 where this GPU or torch has none."""
    from moegen.tune.bench import time_call_evicted

    n, groups = 8192, 8192 // 128
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS asks
    one = torch.ones((), device="cuda")
    # Blocked: the scales in either layout (cuBLAS asks for one; torch's checks name neither).
    scales = [(torch.rand(groups, n, device="cuda").t(), torch.rand(groups, groups, device="cuda").t()),
              (torch.rand(n, groups, device="cuda"), torch.rand(groups, groups, device="cuda"))] if blocked \
        else [(one, one)]
    for scale_a, scale_b in scales:
        try:
            us = time_call_evicted(lambda: torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16),
                                   on_gpu=True)
            return 2 * n ** 3 / (us * 1e6)
        except (RuntimeError, TypeError, ValueError):  # no fp8 tensor cores, or another _scaled_mm signature
            continue
    return 0.0


def whole_rows_numel(nbytes: int, element_size: int) -> int:
    """Elements of the whole 128-byte rows that cover nbytes (at most 126 bytes more): the TMA
    reader reads whole rows."""
    return -(-nbytes // 128) * 128 // element_size


def fastest_read_us(timer: Timer, spans: list) -> float:
    """Microseconds per span of one graph that reads every span in turn, one launch each, with
    the fastest of moegen.tune.bench.streaming_reads."""
    from moegen.runtime.step_graphs import capture_graph
    from moegen.tune.bench import streaming_reads

    readers = [streaming_reads(span) for span in spans]
    best = math.inf
    for kind in range(min(map(len, readers))):
        def read_all(kind=kind):
            for per_span in readers:
                per_span[kind]()

        graph, _ = capture_graph(read_all)
        best = min(best, timer.median_us(graph.replay))
        del graph
    return best / len(spans)


def read_only_us(timer: Timer, nbytes: int) -> float:
    """The fastest streaming read of nbytes in one launch, as a CUDA-graph replay with L2 evicted
    first: the launch, ramp-up and drain that any single kernel reading those bytes pays."""
    src = torch.empty(whole_rows_numel(nbytes, 2), dtype=torch.bfloat16, device=timer.device)  # contents unread
    best = fastest_read_us(timer, [src])
    del src
    torch.cuda.empty_cache()
    return best
