"""moegen: an ahead-of-time compiler for Mixture-of-Experts inference."""
from __future__ import annotations

__version__ = "0.1.0"


def load(path):
    """Import a generated package from its directory (e.g. generated/mixtral_8x7b) and return it."""
    from moegen.package.loader import load_package

    return load_package(path)


def replace_moe_blocks(model, package) -> int:
    """Swap the MoE blocks of a transformers 5 model for `package.MoELayer` (see moegen.runtime.hf)."""
    from moegen.runtime.hf import replace_moe_blocks as replace

    return replace(model, package)


def load_plan(path):
    """An expert-offload plan (moegen.plan.offload.OffloadPlan) from a plan.json file, a package
    folder or an imported package, checked (moegen.errors.PlanError names what is wrong)."""
    from moegen.plan.offload import load_plan as load

    return load(path)


def record_trace(model, package):
    """Record which experts a transformers model's MoE layers pick per token, as a moegen-trace
    file for `moegen plan --trace` and `moegen simulate` (moegen.offload.record)."""
    from moegen.offload.record import record_trace as record

    return record(model, package)


def load_offloaded(folder, package, **options):
    """A Hugging Face model folder as a causal LM whose routed experts live in pinned host memory
    under the package's offload plan (moegen.runtime.offload_model.load_offloaded)."""
    from moegen.runtime.offload_model import load_offloaded as load

    return load(folder, package, **options)


def offload_model(model, package, **options):
    """A transformers model built in host memory, its routed experts moved to pinned host memory
    under the package's offload plan and the rest to the GPU (moegen.runtime.offload_model)."""
    from moegen.runtime.offload_model import offload_model as offload

    return offload(model, package, **options)
