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
TRACES_DIR = SHARED_DIR / "traces"


def _needs_interpreter_numpy():
    import numpy
    import triton

    version = tuple(int(part) for part in numpy.__version__.split(".")[:2])
    return pytest.mark.skipif(triton.__version__.startswith("3.6") and version >= (2, 4),
                              reason=f"Triton 3.6's interpreter needs numpy<2.4; this machine has numpy "
                                     f"{numpy.__version__}")


# Triton 3.6's interpreter fails on numpy 2.4 and later (CI pins numpy<2.4; a GPU machine may not).
needs_interpreter_numpy = _needs_interpreter_numpy()


def tool_smoke_report(tool: str, report: str, tmp_path: Path, *args: str) -> str:
    """Run tools/<tool> with --cpu-smoke in Triton's interpreter, $OUT at tmp_path; the report
    it wrote there (after checking that it exited 0)."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / tool), "--cpu-smoke", *args], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return (tmp_path / report).read_text()


def load_tool(name: str):
    """tools/<name>.py imported as module `name` (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shared_trace(name: str) -> Path:
    """The path of ../shared/traces/<name>.jsonl.gz, or a skip that says what the folder is."""
    path = TRACES_DIR / f"{name}.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"needs {path}: real routing traces of Mixtral-8x7B and DeepSeek-V2-Lite (moegen-trace "
                    "format), kept in ../shared/traces beside the checkout, not in the repo (README, 'Routing "
                    "traces')")
    return path


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


_SM90_PREAMBLE = """
import os, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="moegen-sm90-")
os.environ["MOEGEN_PRECOMPILE"] = "0"
sys.path[:0] = [{repo!r}, {tests!r}]
from first_launch_replay import use_stand_in_hopper
use_stand_in_hopper()
"""
_SM90_EPILOGUE = """
import json
from pathlib import Path
cache = Path(os.environ["TRITON_CACHE_DIR"])
print(json.dumps({str(p.relative_to(cache)): p.read_text() for p in cache.rglob("*.ptx")}))
"""


@pytest.fixture(scope="session")
def compile_sm90(sm90_compile_env):
    """compile_sm90(code) -> {cache path: PTX} of every kernel the code compiles, run in a
    subprocess on the CPU for sm_90 against the stand-in driver: what the GPU machine's Triton
    will build, checkable in CI (Gluon kernels cannot run in the interpreter at all)."""
    import json
    import subprocess
    import sys

    def compile_code(code: str) -> dict[str, str]:
        script = _SM90_PREAMBLE.format(repo=str(REPO_ROOT), tests=str(REPO_ROOT / "tests")) + code + _SM90_EPILOGUE
        result = subprocess.run([sys.executable, "-c", script], env=sm90_compile_env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    return compile_code


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
