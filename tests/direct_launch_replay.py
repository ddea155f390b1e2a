"""The runtime's launches against a stand-in Hopper (sm_90) driver on the CPU, in two rounds of
the same calls: the first compiles every kernel through Triton's own path (JITFunction.run),
the second should launch every one directly (moegen.runtime.launch). The stand-in's launcher
records what each launch passes it, so the two rounds can be compared argument by argument:
the direct launches must hand the launcher what Triton's path did. Prints one JSON object.
Run in a subprocess (it replaces Triton's driver): see test_build.py.

    python tests/direct_launch_replay.py SPEC TOKENS[,TOKENS...]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from first_launch_replay import _Hopper, use_stand_in_hopper

# CompiledKernel's launcher takes the grid, the stream, the function and its packed metadata,
# then launch metadata and the two hooks (Triton's path passes its empty hook chains, a direct
# launch nothing: not compared), then the kernel's arguments.
_HOOK_POSITIONS = (6, 7, 8)


def _signature(value):
    """What a launcher argument means to the kernel, comparable across calls."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), list(value.stride()), value.data_ptr() % 16]
    if isinstance(value, TensorDescriptor):
        return ["descriptor", _signature(value.base), list(value.shape), list(value.strides), list(value.block_shape)]
    return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)


class _Launching(_Hopper):
    """The stand-in, able to "load" a compiled kernel and to launch it into a record."""

    def __init__(self, launched: list):
        self._launched = launched
        self.utils = SimpleNamespace(get_device_properties=lambda device: {"max_shared_mem": 232448},
                                     load_binary=lambda name, kernel, shared, device: (name, name, 0, 0, 1024))

    def launcher_cls(self, src, metadata):
        return lambda *args: self._launched.append((metadata.name, args))


def main(spec: str, tokens: list[int]) -> dict:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="moegen-direct-cache-")
    os.environ["MOEGEN_PRECOMPILE"] = "0"
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from moegen.runtime import launch

    hooks_set = launch._launch_hooks_set
    use_stand_in_hopper()
    launch._launch_hooks_set = hooks_set  # the real check: this replay is about direct launches
    launched: list = []
    driver.set_active(_Launching(launched))

    from moegen import load
    from moegen.package import build
    from moegen.reference import separated_router_logits
    from moegen.runtime import fused

    fused._check_inputs = lambda *args, **kwargs: None  # CPU tensors stand in for CUDA ones
    pkg = load(build(Path(spec), Path(tempfile.mkdtemp(prefix="moegen-direct-build-")))[0])
    through_triton = []
    real_run = JITFunction.run

    def run(self, *args, **kwargs):
        through_triton.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    JITFunction.run = run
    ks, m = pkg.KERNELS, pkg.SPEC.model
    generator = torch.Generator().manual_seed(0)
    w13 = torch.randn(m.num_experts, 2 * m.intermediate_size, m.hidden_size, generator=generator).to(ks.dtype)
    w2 = torch.randn(m.num_experts, m.hidden_size, m.intermediate_size, generator=generator).to(ks.dtype)
    bias = torch.rand(m.num_experts, generator=generator) if m.correction_bias else None
    scales = {}
    if ks.weight_format.quantized:  # the experts as their format stores them, with their scales
        from moegen.quant.formats import scale_arguments
        from moegen.quant.quantize import quantize, quantize_w13

        stored13, stored2 = quantize_w13(w13, ks.weight_format), quantize(w2, ks.weight_format)
        w13, w2, scales = stored13["weight"], stored2["weight"], scale_arguments(stored13, stored2)
    inputs = [(torch.randn(t, m.hidden_size, generator=generator).to(ks.dtype),
               separated_router_logits(t, ks.routing, bias, generator=generator)) for t in tokens]
    rounds = []
    for _ in range(2):
        start, triton_start = len(launched), len(through_triton)
        for x, logits in inputs:
            pkg.fused_moe(x, logits, w13, w2, correction_bias=bias, **scales)
        rounds.append({"through_triton": through_triton[triton_start:],
                       "launches": [[name] + [_signature(a) for i, a in enumerate(args) if i not in _HOOK_POSITIONS]
                                    for name, args in launched[start:]]})
    return {"rounds": rounds}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], [int(t) for t in sys.argv[2].split(",")])))
