"""The spec as frozen dataclasses: field names, types, defaults and allowed values.

This module is the single source of truth for the YAML schema; the loader walks these
dataclasses to check types and unknown keys, and docs/spec.md documents each field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from moegen.quant.formats import DTYPE_BYTES, INT4_GROUP_SIZES, QUANTIZATIONS, WeightFormat

ACTIVATIONS = ("silu", "gelu")
SCORINGS = ("softmax", "sigmoid")
DTYPES = tuple(DTYPE_BYTES)
OFFLOAD_POLICIES = ("lru", "lfu", "pinned_lru", "decayed_lfu", "neighbor_lfu")
PREFETCH_MODES = ("none", "router", "history", "xlayer", "neighbors")
DEFAULT_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    num_layers: int = 1
    activation: str = "silu"
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    dtype: str = "bfloat16"
    # The router matmul's dtype (weights and logits); None: the model dtype. DeepSeek's routers
    # run in float32, whose logits rounded to bf16 would pick other experts near ties.
    router_dtype: Optional[str] = None
    # How the routed experts' weights are stored (moegen/quant/formats.py); group size and zero
    # points apply to int4_group.
    quantization: str = "none"
    quantization_group_size: int = 128
    quantization_zero_point: bool = False

    @property
    def weight_format(self) -> WeightFormat:
        return WeightFormat.of(self)

    @property
    def expert_bytes(self) -> int:
        """One routed expert's weights as stored: gate, up and down projections, with their scales."""
        return self.weight_format.expert_bytes(self.hidden_size, self.intermediate_size)


@dataclass(frozen=True)
class TargetSpec:
    gpu: str = "h200"
    expert_memory_gib: Optional[float] = None  # None: 90% of the GPU's memory
    hbm_gbps: Optional[float] = None
    bf16_tflops: Optional[float] = None
    host_link_gbps: Optional[float] = None
    sm_count: Optional[int] = None


@dataclass(frozen=True)
class WorkloadSpec:
    token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS


@dataclass(frozen=True)
class OffloadSpec:
    policy: str = "lru"
    prefetch: str = "none"


@dataclass(frozen=True)
class Spec:
    name: str
    model: ModelSpec
    target: TargetSpec = field(default_factory=TargetSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    offload: OffloadSpec = field(default_factory=OffloadSpec)

    @property
    def package_name(self) -> str:
        """The Python identifier the generated package is imported as (validated by the loader)."""
        return self.name.replace("-", "_").replace(".", "_")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def spec_from_dict(data: dict) -> Spec:
    """Rebuild a Spec from Spec.to_dict() output (e.g. a generated package's manifest)."""
    return Spec(
        name=data["name"],
        model=ModelSpec(**data["model"]),
        target=TargetSpec(**data["target"]),
        workload=WorkloadSpec(token_buckets=tuple(data["workload"]["token_buckets"])),
        offload=OffloadSpec(**data["offload"]),
    )
