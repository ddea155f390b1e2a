"""Replay a build's precompile and the runtime's first launches against a stand-in Hopper (sm_90)
driver on the CPU: Triton compiles here (its wheel carries ptxas), nothing runs. Prints one JSON
object: every launch of the runtime and whether Triton found its kernel in the package's
shipped cache. Run in a subprocess (it replaces Triton's driver): see test_build.py.

    python tests/first_launch_replay.py SPEC TOKENS[,TOKENS...]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


class _Hopper:
    """The parts of Triton's CUDA driver that compiling and looking kernels up need."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


def use_stand_in_hopper() -> None:
    """Make this process compile for sm_90 on the CPU: Triton's driver, what the build asks torch
    before compiling for the GPU, the runtime's programmatic-dependent-launch check and its
    launch path."""
    import torch
    from triton.runtime import driver

    from moegen.runtime import fused, launch

    driver.set_active(_Hopper())
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    fused.pdl_supported = lambda device: True
    # Every launch through Triton's own path, which the stand-in serves up to loading a binary
    # (moegen's direct launches only reuse what that path compiled or loaded).
    launch._launch_hooks_set = lambda: True


def main(spec: str, tokens: list[int]) -> dict:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="moegen-replay-cache-")
    os.environ["MOEGEN_PRECOMPILE"] = "1"
    import torch
    import triton
    from triton.runtime.jit import JITFunction

    use_stand_in_hopper()

    from moegen import load
    from moegen.package import build, precompile
    from moegen.reference import separated_router_logits
    from moegen.runtime import fused

    precompile._with_launcher = lambda compiled: None  # launchers load the binary: GPU only
    fused._check_inputs = lambda *args, **kwargs: None  # CPU tensors stand in for CUDA ones

    folder, _ = build(Path(spec), Path(tempfile.mkdtemp(prefix="moegen-replay-build-")))
    pkg = load(folder)  # installs the shipped kernels into the (empty) cache
    cache = Path(triton.knobs.cache.dir)
    launches = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        before = set(os.listdir(cache))
        try:
            real_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        except Exception:  # noqa: BLE001 - loading the binary fails without a GPU, after the lookup
            pass
        launches.append({"tokens": current, "kernel": self.fn.__name__,
                         "compiled": bool(set(os.listdir(cache)) - before)})

    JITFunction.run = run
    ks, m = pkg.KERNELS, pkg.SPEC.model
    dtype = ks.dtype
    w13 = torch.randn(m.num_experts, 2 * m.intermediate_size, m.hidden_size).to(dtype)
    w2 = torch.randn(m.num_experts, m.hidden_size, m.intermediate_size).to(dtype)
    bias = torch.rand(m.num_experts) if m.correction_bias else None
    # Eager decode batches whose bucket runs the three-kernel path decode while the host paces
    # the caller (fused_moe): every call replayed as host-paced and as not, and as fused_experts.
    fused._eager = lambda hidden_states: True
    fused._record_call_end = lambda device: None
    for current in tokens:
        x = torch.randn(current, m.hidden_size).to(dtype)
        logits = separated_router_logits(current, ks.routing, bias)
        for paced in (True, False):
            fused._host_paced = lambda device, paced=paced: paced
            pkg.fused_moe(x, logits, w13, w2, correction_bias=bias)
            # Callers who route themselves, with picks as routing gives them (float32 weights,
            # int32 ids): the routed decode kernel, or the routing kernels laying out their picks.
            weights = torch.rand(current, m.top_k)
            ids = torch.randint(0, m.num_experts, (current, m.top_k), dtype=torch.int32)
            pkg.fused_experts(x, weights, ids, w13, w2)
    return {"shipped": len(list((folder / precompile.CACHE_FOLDER).iterdir())), "launches": launches,
            "tail_row_buckets": [b for b, c in zip(ks.buckets, ks.configs) if c.tail_m],
            "two_stream_buckets": [b for b, c in zip(ks.buckets, ks.configs) if c.streams == 2],
            "eager_decode_bucket": None if ks.eager_decode_bucket is None else ks.buckets[ks.eager_decode_bucket]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], [int(t) for t in sys.argv[2].split(",")])))
