"""Timing: CUDA-graph replay timed with events (median of repeats) on a GPU; wall clock under
Triton's interpreter, so the whole tuner runs (slowly, on tiny shapes) in CPU tests."""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

from moegen.runtime.step_graphs import capture_graph


def time_cpu(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall time in microseconds."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def time_cuda_graph(fn: Callable[[], object], target_ms: float = 25.0, repeats: int = 5) -> float:
    """Median microseconds per call of fn, captured once in a CUDA graph and replayed."""
    graph, _ = capture_graph(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    once_ms = max(start.elapsed_time(end), 1e-3)
    replays = max(1, min(1000, int(target_ms / repeats / once_ms)))
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / replays)
    del graph
    return statistics.median(samples)


def time_call(fn: Callable[[], object], on_gpu: bool) -> float:
    return time_cuda_graph(fn) if on_gpu else time_cpu(fn)


@functools.cache
def _l2_flush_buffer(device: int) -> torch.Tensor:
    # 256 MiB, several times any GPU's L2; only ever read, so evicting leaves no dirty lines.
    return torch.ones(128 << 20, dtype=torch.float16, device=torch.device("cuda", device))


def _evict_l2() -> None:
    """Replace L2's contents with lines of a buffer nothing else reads (on the current stream)."""
    _l2_flush_buffer(torch.cuda.current_device()).sum()


def _evicted_samples(fn: Callable[[], object], reps: int) -> list[float]:
    """Microseconds of each of reps calls of fn, L2 evicted before each outside the timed region."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        _evict_l2()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


JUDGED_TIMING_S = 0.4


# A GPU left idle for a moment (a graph capture, host work) runs its next milliseconds of calls
# slower: on the H100 a Mixtral int4 decode graph timed straight after its capture took
# 120.4 us (median of 25 calls), timed again at once 105.5 (2026-12-07). Samples start after
# this long of calls.
WARM_UP_S = 0.03


def _keep_busy(fn: Callable[[], object], seconds: float) -> None:
    """Calls of fn as they are sampled (_evicted_samples), for at least `seconds` of wall time."""
    start = time.perf_counter()
    _evicted_samples(fn, 1)
    while time.perf_counter() - start < seconds:
        _evicted_samples(fn, 1)


def time_evicted(fn: Callable[[], object], warmup: int = 2, target_s: float = JUDGED_TIMING_S, min_reps: int = 5,
                 max_reps: int = 200) -> float:
    """Median microseconds of single calls of fn, each from an evicted L2, over about target_s:
    how gpu_check times every cell (one call at a time, as a model's layers meet it, and over
    long enough that compute-heavy calls run at the clocks the power cap settles them at)."""
    for _ in range(max(warmup - 1, 0)):
        fn()
    _keep_busy(fn, WARM_UP_S)
    estimate = _evicted_samples(fn, 1)[0]
    reps = int(min(max(target_s * 1e6 / max(estimate, 1.0), min_reps), max_reps))
    return statistics.median(_evicted_samples(fn, reps))


def time_call_evicted(fn: Callable[[], object], on_gpu: bool, target_s: float = JUDGED_TIMING_S) -> float:
    """time_evicted of fn captured in a CUDA graph (wall clock on the CPU)."""
    if not on_gpu:
        return time_cpu(fn)
    graph, _ = capture_graph(fn)
    us = time_evicted(graph.replay, target_s=target_s)
    del graph
    return us


def time_in_rounds(fns: list[Callable[[], object]], on_gpu: bool, rounds: int) -> list[list[float]]:
    """Each fn's microseconds in every round, the order reversed every other round (so drifting
    clocks meet them alike): a paired A/B. On the GPU each fn is captured once and timed as
    time_evicted times a call; on the CPU, wall clock."""
    if on_gpu:
        fns = [capture_graph(fn)[0].replay for fn in fns]
    times = [[] for _ in fns]
    for round_ in range(rounds):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            times[i].append(time_evicted(fns[i]) if on_gpu else time_cpu(fns[i]))
    return times


@functools.cache  # one jitted kernel per process: gpu_check asks for it once per memory-bound cell
def streaming_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def streaming_read(src_ptr, partial_ptr, numel, BLOCK: tl.constexpr):
        # A persistent grid-stride loop of wide loads; the sum keeps the loads alive.
        pid, programs = tl.program_id(0), tl.num_programs(0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(pid * BLOCK, numel, programs * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(src_ptr + offs, mask=offs < numel, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(partial_ptr + pid, tl.sum(acc, axis=0))

    return streaming_read


def streaming_reads(src: torch.Tensor) -> list[Callable[[], object]]:
    """Launches that each read bf16 src once and do nothing else: the load-instruction kernel
    (16 programs per SM of 4096-element loads, the fastest of 1-16 per SM, 2048-8192 elements
    and 4 or 8 warps at 75 MB, 100 MB and 4 GiB on the H200) and, on Hopper and newer, the TMA
    reader (moegen.tune.tma_read), 2-4% faster there. A bound takes the fastest of them."""
    from moegen.tune import tma_read

    kernel = streaming_read_kernel()
    flat = src.view(-1)
    programs = torch.cuda.get_device_properties(src.device).multi_processor_count * 16
    partial = torch.empty(programs, dtype=torch.float32, device=src.device)
    reads = [lambda: kernel[(programs,)](flat, partial, flat.numel(), BLOCK=4096, num_warps=8)]
    if tma_read.available(src.device) and flat.numel() % tma_read.BOX_COLUMNS == 0:
        reads.append(tma_read.TmaRead(flat))
    return reads


def measure_ceilings(device: str = "cuda") -> tuple[float, float, float, float]:
    """(copy GB/s, streaming-read GB/s, HBM GB/s, bf16 TFLOP/s) measured here. HBM bandwidth is
    the higher of a device copy (bytes read + written) and the fastest streaming read; the rate
    is a large bf16 matmul on random data (zeros run faster than real data), timed as the calls
    whose floor it sets (time_evicted: at the clocks the power cap settles sustained matrix work
    at, ~11% below those of short bursts on the H200)."""
    numel = 2 << 30  # 4 GiB of bf16, far beyond L2
    src = torch.randn(numel // 1024, 1024, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_us = time_cuda_graph(lambda: dst.copy_(src), target_ms=60)
    del dst
    read_us = min(time_cuda_graph(read, target_ms=60) for read in streaming_reads(src))
    copy_gbps = 2 * numel * 2 / (copy_us * 1e3)
    read_gbps = numel * 2 / (read_us * 1e3)
    del src
    return copy_gbps, read_gbps, max(copy_gbps, read_gbps), measure_gemm_tflops(device)


def measure_gemm_tflops(device: str = "cuda") -> float:
    """bf16 TFLOP/s of an 8192^3 matmul on random data, timed as the calls whose floor it sets."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (time_call_evicted(lambda: a @ b, on_gpu=True) * 1e6)
