"""Package: the build pipeline's last stages (render sources, write the package atomically)."""
from __future__ import annotations

import os
from pathlib import Path

from moegen import knobs
from moegen.errors import SettingError

from moegen.ir import lower
from moegen.package.precompile import precompiled_sources
from moegen.package.sources import render_sources, tool_versions
from moegen.package.writer import check_destination, write_package
from moegen.plan import plan
from moegen.spec import load_spec
from moegen.target import GpuTarget, current_gpu


def _should_precompile(target: GpuTarget) -> bool:
    forced = knobs.precompile()
    if forced is None:
        here = current_gpu()
        return here is not None and here.name == target.name and not knobs.triton_interpret()
    if forced:
        _check_compiles_for(target)
    return forced


def _check_compiles_for(target: GpuTarget) -> None:
    """MOEGEN_PRECOMPILE=1 compiles for the GPU Triton sees here: refuse where there is none, or
    where its kernels could not run on the spec's target."""
    if knobs.triton_interpret():
        raise SettingError("MOEGEN_PRECOMPILE", "1", "Triton's interpreter (TRITON_INTERPRET=1) compiles nothing",
                           "unset one of the two")
    import triton

    try:
        here = triton.runtime.driver.active.get_current_target()
    except RuntimeError:  # Triton finds no GPU driver
        raise SettingError("MOEGEN_PRECOMPILE", "1", "this machine has no GPU for Triton to compile for",
                           "build on the target GPU, or unset it") from None
    if here.arch != target.arch:
        raise SettingError("MOEGEN_PRECOMPILE", "1",
                           f"this GPU is sm_{here.arch}, the spec's target {target.alias} sm_{target.arch}",
                           "build on the target GPU, or unset it")


def build(spec_path, out_dir="generated") -> tuple[Path, bool]:
    """spec -> IR -> plan -> render -> package. Returns (package folder, whether it changed).
    On the target GPU the kernels are also compiled into the package (no compile at first call)."""
    spec = load_spec(spec_path)
    ir = lower(spec, spec_path)
    build_plan = plan(ir, spec_path=str(spec_path))
    folder = Path(out_dir) / spec.package_name
    # Relative to the package: the rebuild command a stale package prints finds the spec from
    # wherever it is imported, and the bytes do not depend on the folder the build ran in.
    spec_from_package = Path(os.path.relpath(Path(spec_path).resolve(), folder.resolve())).as_posix()
    files: dict = render_sources(build_plan, tool_versions(), spec_from_package)
    check_destination(folder)  # before precompiling, which takes a while
    if _should_precompile(ir.target):
        files.update(precompiled_sources(spec.package_name, files))
    return folder, write_package(folder, files)
