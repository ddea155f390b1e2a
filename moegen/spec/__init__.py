"""Spec: YAML schema, loading with line numbers, and validation."""
from moegen.spec.schema import ModelSpec, OffloadSpec, Spec, TargetSpec, WorkloadSpec

__all__ = ["ModelSpec", "OffloadSpec", "Spec", "TargetSpec", "WorkloadSpec", "load_spec"]


def load_spec(path):
    """Load and validate a spec file; raises SpecError naming file, line, field and fix."""
    from moegen.spec.loader import load_spec as _load

    return _load(path)
