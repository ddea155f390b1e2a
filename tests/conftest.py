"""Shared fixtures: building generated packages from in-memory specs for the kernel tests."""
from __future__ import annotations

import os
from pathlib import Path

# Kernels run on the CPU through Triton's interpreter unless a GPU is present; the variable
# must be set before triton.jit decorates the generated kernels.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DIR = REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def no_interpreter_env():
    """The environment for a subprocess that runs Triton without the interpreter."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="session")
def sm90_compile_env(no_interpreter_env):
    """The environment for a subprocess that compiles for sm_90 on the CPU against the stand-in
    driver of tests/first_launch_replay.py (no interpreter); skips without a runnable ptxas."""
    import subprocess

    ptxas = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file() or subprocess.run([str(ptxas), "--version"], capture_output=True).returncode != 0:
        pytest.skip("no runnable ptxas in this Triton install")
    return no_interpreter_env


@pytest.fixture(scope="session")
def package_factory(tmp_path_factory):
    """build(**model_fields) -> imported generated package, cached per distinct model."""
    from moegen import load
    from moegen.ir import lower
    from moegen.package.sources import render_sources, tool_versions
    from moegen.package.writer import write_package
    from moegen.plan import plan
    from moegen.spec.schema import ModelSpec, Spec, WorkloadSpec

    root = tmp_path_factory.mktemp("generated")
    built = {}

    def build(buckets=(1, 8, 64), **model_fields):
        key = (tuple(buckets), tuple(sorted(model_fields.items())))
        if key not in built:
            name = f"case{len(built)}"
            spec = Spec(name=name, model=ModelSpec(**model_fields), workload=WorkloadSpec(tuple(buckets)))
            files = render_sources(plan(lower(spec, f"{name}.yaml")), tool_versions())
            write_package(root / name, files)
            built[key] = load(root / name)
        return built[key]

    return build
