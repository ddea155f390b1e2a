"""Plan: per token bucket, the analytic cost and the kernel config the build will use."""
from __future__ import annotations

from dataclasses import dataclass

from moegen.ir import ModelIR
from moegen.plan.configs import default_config
from moegen.plan.cost_model import BucketCost, bucket_cost
from moegen.runtime.fused import KernelConfig

COST_MODEL = "cost-model"


@dataclass(frozen=True)
class BucketPlan:
    tokens: int
    cost: BucketCost
    config: KernelConfig
    source: str  # where the config came from: "cost-model" or a tuning-database file


@dataclass(frozen=True)
class BuildPlan:
    ir: ModelIR
    buckets: tuple[BucketPlan, ...]


def plan(ir: ModelIR) -> BuildPlan:
    sig, target = ir.signature, ir.target
    return BuildPlan(ir, tuple(
        BucketPlan(t, bucket_cost(sig, target, t), default_config(sig, target, t), COST_MODEL)
        for t in ir.spec.workload.token_buckets
    ))
