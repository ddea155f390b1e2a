"""Launch a Triton kernel with less host work than `kernel[grid](...)`.

An eager MoE call launches two to seven small kernels, and in eager use (a transformers model
without CUDA graphs) the host's time per call exceeds the GPU's. Triton's generic launch binds
the arguments, keys its cache, checks the globals the kernel read, builds launch metadata for
hooks and asks for the current device and stream; measured on the H200 host, 27 us per GEMM
launch, of which 17 us are the binding, the cache key and the launcher itself. Here a launch
binds the arguments and keys the cache as Triton does (so it finds exactly the kernel Triton
would) and calls the compiled kernel's launcher on the stream given, without the rest:
- the global-value check: the kernels' globals are constants of generated modules;
- launch hooks and pre-run hooks: where any is set, the launch goes through Triton instead;
- a kernel not compiled yet (first call of a specialization) goes through Triton, which
  compiles it, loads it and launches it.
Triton 3.6's internals (JITFunction.device_caches, compute_cache_key, CompiledKernel.run); with
another Triton, in the interpreter and for any other kernel object, Triton's own path.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.runtime import driver
from triton.runtime.jit import JITFunction

try:  # the internals this was written against and checked on (moegen allows older Tritons)
    from triton import knobs as triton_knobs
    from triton.knobs import HookChain
    from triton.runtime.jit import compute_cache_key

    DIRECT = triton.__version__.split(".")[:2] == ["3", "6"]
except ImportError:
    DIRECT = False


def launch(kernel, grid: tuple, stream: Optional["torch.cuda.Stream"], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) on `stream` (None: the current stream)."""
    if not DIRECT or not isinstance(kernel, JITFunction) or kernel.pre_run_hooks or _launch_hooks_set():
        _triton_launch(kernel, grid, stream, args, kwargs)
        return
    device = driver.active.get_current_device()
    # What JITFunction.run adds before binding: part of the options, hence of the cache key.
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or triton_knobs.runtime.debug
    kwargs["instrumentation_mode"] = triton_knobs.compilation.instrumentation_mode
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
    bound, specialization, options = binder(*args, **kwargs)
    compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    if compiled is None or hasattr(compiled, "result"):  # not compiled yet, or compiling
        _triton_launch(kernel, grid, stream, args, kwargs)
        return
    launcher = compiled.run  # loads the module on first use, which sets compiled.function
    raw_stream = stream.cuda_stream if stream is not None else driver.active.get_current_stream(device)
    launcher(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, raw_stream,
             compiled.function, compiled.packed_metadata, None, None, None, *bound.values())


def _launch_hooks_set() -> bool:
    """Whether a profiler (or anything) hooks Triton's launches: then they go through Triton."""
    hooks = (triton_knobs.runtime.launch_enter_hook, triton_knobs.runtime.launch_exit_hook)
    return any(bool(h.calls) if isinstance(h, HookChain) else h is not None for h in hooks)


def _triton_launch(kernel, grid, stream, args, kwargs) -> None:
    if stream is None:
        kernel[grid](*args, **kwargs)
        return
    with torch.cuda.stream(stream):
        kernel[grid](*args, **kwargs)
