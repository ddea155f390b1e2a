"""Plan: per token bucket, the analytic cost and the kernel config the build will use: from the
tuning database where it has an entry, else the cost model's default."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moegen.ir import ModelIR
from moegen.plan.configs import default_config
from moegen.plan.cost_model import BucketCost, bucket_cost
from moegen.plan.offload import OffloadPlan, plan_offload
from moegen.render import kernel_templates
from moegen.runtime.fused import KernelConfig

COST_MODEL = "cost-model"


@dataclass(frozen=True)
class BucketPlan:
    tokens: int
    cost: BucketCost
    config: KernelConfig
    source: str  # where the config came from: "cost-model" or "tuned:<database file>"


@dataclass(frozen=True)
class BuildPlan:
    ir: ModelIR
    buckets: tuple[BucketPlan, ...]
    offload: OffloadPlan


def plan(ir: ModelIR, db=None, spec_path: Optional[str] = None, strict: Optional[bool] = None) -> BuildPlan:
    """db: a moegen.tune.db.TuningDb (None: the default search path). A miss falls back to the
    cost model, or raises MissingTunedConfigError where strict (None: under MOEGEN_REQUIRE_TUNED=1)."""
    from moegen.tune.db import TuningDb, resolve

    db = TuningDb() if db is None else db
    sig, target = ir.signature, ir.target
    buckets = []
    for tokens in ir.spec.workload.token_buckets:
        entry = resolve(db, target, sig, tokens, kernel_templates(sig), spec_path or ir.spec_file, strict)
        config, source = ((entry.config, f"tuned:{entry.path.name}") if entry is not None
                          else (default_config(sig, target, tokens), COST_MODEL))
        buckets.append(BucketPlan(tokens, bucket_cost(sig, target, tokens), config, source))
    return BuildPlan(ir, tuple(buckets), plan_offload(ir))
