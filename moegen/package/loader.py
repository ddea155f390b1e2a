"""Import a generated package from its folder, wherever it lives."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from moegen.errors import PackageError
from moegen.render import template_hashes


def checked_manifest(folder) -> dict:
    """The package's manifest.json, once its templates are known to be this moegen's: the
    package's kernels run under this moegen's launch code, which changes with them."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        built = dict(manifest["templates"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PackageError(f"{folder}: no readable manifest.json ({error}); rebuild the package with "
                           f"`moegen build SPEC -o {folder.parent}`") from None
    current = template_hashes()
    changed = sorted(name for name in built.keys() | current.keys() if built.get(name) != current.get(name))
    if changed:
        spec_file = manifest.get("spec_file", "SPEC")
        raise PackageError(f"{folder}: built from templates other than this moegen's ({', '.join(changed)}); "
                           f"rebuild it: `moegen build {spec_file} -o {folder.parent}`")
    return manifest


def load_package(path):
    folder = Path(path).resolve()
    init = folder / "__init__.py"
    if not init.is_file():
        raise PackageError(f"{folder}: not a generated moegen package (no __init__.py); "
                           f"run `moegen build SPEC -o {folder.parent}` first")
    module_name = f"moegen_generated_{folder.name}_{abs(hash(str(folder))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
