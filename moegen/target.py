"""GPU targets: the figures the planner and cost model need, per known device.

The table holds datasheet figures; they are leads, not measurements. tools/gpu_check.py measures
the real device, and a spec can override hbm_gbps, bf16_tflops, host_link_gbps and sm_count.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # schema imports nothing from here; keep the import one-way at runtime too
    from moegen.spec.schema import Spec, TargetSpec


INTERPRETER = "Triton interpreter"


@dataclass(frozen=True)
class GpuTarget:
    name: str  # as torch.cuda.get_device_name prints it
    alias: str  # short name used in specs
    arch: int  # compute capability, e.g. 90 for sm_90
    sm_count: int
    hbm_gbps: float  # device memory bandwidth, GB/s
    bf16_tflops: float  # dense tensor-core bf16, no sparsity
    host_link_gbps: float  # realistic pinned host-to-device copy, GB/s
    memory_gib: float  # usable, as torch.cuda.get_device_properties reports total_memory
    smem_per_block_kib: int  # max opt-in shared memory per block
    registers_per_sm: int = 65536


# Datasheet leads (vendor specs; host link = realistic PCIe throughput, Gen4 ~25, Gen5 ~55 GB/s).
# memory_gib is what torch reports, a little under the marketed GB.
_GPUS: tuple[GpuTarget, ...] = (
    GpuTarget("NVIDIA H100 80GB HBM3", "h100", 90, 132, 3350, 989, 55, 79.1, 227),
    GpuTarget("NVIDIA H100 PCIe", "h100-pcie", 90, 114, 2000, 756, 55, 79.1, 227),
    GpuTarget("NVIDIA H200", "h200", 90, 132, 4800, 989, 55, 139.8, 227),
    GpuTarget("NVIDIA H20", "h20", 90, 78, 4000, 148, 55, 95.0, 227),
    GpuTarget("NVIDIA A100-SXM4-80GB", "a100", 80, 108, 2039, 312, 25, 79.2, 163),
    GpuTarget("NVIDIA A100-SXM4-40GB", "a100-40gb", 80, 108, 1555, 312, 25, 39.4, 163),
    GpuTarget("NVIDIA A10G", "a10g", 86, 80, 600, 70, 25, 22.2, 99),
    GpuTarget("NVIDIA L4", "l4", 89, 58, 300, 121, 25, 22.0, 99),
    GpuTarget("NVIDIA L40S", "l40s", 89, 142, 864, 362, 25, 44.4, 99),
    GpuTarget("NVIDIA GeForce RTX 4090", "rtx4090", 89, 128, 1008, 165, 25, 23.6, 99),
    GpuTarget("NVIDIA GeForce RTX 3090", "rtx3090", 86, 82, 936, 71, 25, 23.6, 99),
    GpuTarget("NVIDIA B200", "b200", 100, 148, 8000, 2250, 55, 178.4, 227),
    # Triton's CPU interpreter (TRITON_INTERPRET=1): a target for tests, so that the tuner and
    # its database can be exercised without a GPU. Its figures are nominal.
    GpuTarget(INTERPRETER, "interpreter", 0, 1, 10, 0.01, 10, 8.0, 227),
)


def _normalize(name: str) -> str:
    """'NVIDIA GeForce RTX 4090', 'nvidia-rtx4090' and 'RTX 4090' all become 'rtx4090'."""
    key = re.sub(r"[\s\-_]+", "", name.strip().lower())
    for prefix in ("nvidia", "geforce"):
        key = key.removeprefix(prefix)
    return key


# Other names people write for the same devices (the form factor is often spelled out).
_EXTRA_ALIASES = {"h100-sxm": "h100", "h100-80gb": "h100", "a100-80gb": "a100", "a100-sxm": "a100"}

_BY_KEY: dict[str, GpuTarget] = {}
for _gpu in _GPUS:
    _BY_KEY[_normalize(_gpu.alias)] = _gpu
    _BY_KEY[_normalize(_gpu.name)] = _gpu
for _extra, _alias in _EXTRA_ALIASES.items():
    _BY_KEY[_normalize(_extra)] = _BY_KEY[_alias]


def lookup_gpu(name: str) -> Optional[GpuTarget]:
    """The table entry for an alias or full device name (case, spaces and dashes ignored), else None."""
    if not isinstance(name, str):
        return None
    return _BY_KEY.get(_normalize(name))


def known_gpu_names() -> list[str]:
    """The aliases a spec may use for target.gpu, in table order."""
    return [gpu.alias for gpu in _GPUS]


def suggest_gpu(name: str) -> list[str]:
    """Aliases close to a misspelled GPU name, best first (may be empty)."""
    key = _normalize(str(name))
    by_key = {_normalize(gpu.alias): gpu.alias for gpu in _GPUS}
    return [by_key[k] for k in difflib.get_close_matches(key, list(by_key), n=3, cutoff=0.6)]


def resolve_target(target: "TargetSpec") -> GpuTarget:
    """The GPU a spec targets, with the spec's measured overrides applied."""
    gpu = lookup_gpu(target.gpu)
    if gpu is None:  # the loader rejects this already; reached only with hand-built specs
        from moegen.errors import SpecError

        raise SpecError("<spec>", "target.gpu", f"unknown gpu {target.gpu!r}",
                        f"use one of: {', '.join(known_gpu_names())}")
    overrides = {
        key: getattr(target, key)
        for key in ("hbm_gbps", "bf16_tflops", "host_link_gbps", "sm_count")
        if getattr(target, key) is not None
    }
    return dataclasses.replace(gpu, **overrides)


def current_gpu() -> Optional[GpuTarget]:
    """The CUDA device this process sees (device 0); the interpreter target when Triton runs on
    the CPU (TRITON_INTERPRET=1); else None.

    An unknown device keeps its own name, SM count, memory and shared memory, and borrows the
    throughput figures of the table entry with the closest compute capability.
    """
    import torch  # lazy: the spec loader and CLI help must not pay for importing torch

    if not torch.cuda.is_available():
        from moegen import knobs

        return lookup_gpu(INTERPRETER) if knobs.triton_interpret() else None
    known = lookup_gpu(torch.cuda.get_device_name(0))
    if known is not None:
        return known
    props = torch.cuda.get_device_properties(0)
    arch = props.major * 10 + props.minor
    closest = min(_GPUS, key=lambda gpu: abs(gpu.arch - arch))
    smem = getattr(props, "shared_memory_per_block_optin", 0) // 1024 or closest.smem_per_block_kib
    return dataclasses.replace(
        closest,
        name=props.name,
        alias=_normalize(props.name),
        arch=arch,
        sm_count=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        smem_per_block_kib=smem,
        registers_per_sm=getattr(props, "regs_per_multiprocessor", 0) or closest.registers_per_sm,
    )


def expert_memory_gib(spec: "Spec") -> float:
    """GPU memory budget for expert weights: the spec's value, else 90% of the GPU's memory."""
    if spec.target.expert_memory_gib is not None:
        return float(spec.target.expert_memory_gib)
    return 0.9 * resolve_target(spec.target).memory_gib
