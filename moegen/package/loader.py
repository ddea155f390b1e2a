"""Import a generated package from its folder, wherever it lives."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from moegen.errors import MoegenError


def load_package(path):
    folder = Path(path).resolve()
    init = folder / "__init__.py"
    if not init.is_file():
        raise MoegenError(f"{folder}: not a generated moegen package (no __init__.py); "
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
