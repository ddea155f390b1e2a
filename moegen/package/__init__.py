"""Package: the build pipeline's last stages (render sources, write the package atomically)."""
from __future__ import annotations

from pathlib import Path

from moegen.ir import lower
from moegen.package.sources import render_sources, tool_versions
from moegen.package.writer import write_package
from moegen.plan import plan
from moegen.spec import load_spec


def build(spec_path, out_dir="generated") -> tuple[Path, bool]:
    """spec -> IR -> plan -> render -> package. Returns (package folder, whether it changed)."""
    spec = load_spec(spec_path)
    build_plan = plan(lower(spec, spec_path), spec_path=str(spec_path))
    files = render_sources(build_plan, tool_versions())
    folder = Path(out_dir) / spec.package_name
    return folder, write_package(folder, files)
