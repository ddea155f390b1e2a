"""Package: the build pipeline's last stages (render sources, write the package atomically)."""
from __future__ import annotations

from pathlib import Path

from moegen import knobs

from moegen.ir import lower
from moegen.package.precompile import precompiled_sources
from moegen.package.sources import render_sources, tool_versions
from moegen.package.writer import check_destination, write_package
from moegen.plan import plan
from moegen.spec import load_spec
from moegen.target import current_gpu


def _should_precompile(target_name: str) -> bool:
    forced = knobs.precompile()
    if forced is not None:
        return forced
    here = current_gpu()
    return here is not None and here.name == target_name and not knobs.triton_interpret()


def build(spec_path, out_dir="generated") -> tuple[Path, bool]:
    """spec -> IR -> plan -> render -> package. Returns (package folder, whether it changed).
    On the target GPU the kernels are also compiled into the package (no compile at first call)."""
    spec = load_spec(spec_path)
    ir = lower(spec, spec_path)
    build_plan = plan(ir, spec_path=str(spec_path))
    files: dict = render_sources(build_plan, tool_versions())
    folder = Path(out_dir) / spec.package_name
    check_destination(folder)  # before precompiling, which takes a while
    if _should_precompile(ir.target.name):
        files.update(precompiled_sources(spec.package_name, files))
    return folder, write_package(folder, files)
