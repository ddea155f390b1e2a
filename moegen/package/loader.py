"""Import a generated package from its folder, wherever it lives."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
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
                           f"`moegen build SPEC -o {_shown(folder.parent)}`") from None
    current = template_hashes()
    changed = sorted(name for name in built.keys() | current.keys() if built.get(name) != current.get(name))
    rebuild = "rebuild it: " + rebuild_command(folder, manifest)
    if changed:
        raise PackageError(f"{folder}: built from templates other than this moegen's ({', '.join(changed)}); "
                           + rebuild)
    _check_contents(folder, manifest, rebuild)
    return manifest


def _shown(path: Path) -> str:
    """A path as a command run here takes it: relative below the current folder, else absolute."""
    path = Path(os.path.abspath(path))
    try:
        return path.relative_to(Path.cwd()).as_posix() or "."
    except ValueError:
        return str(path)


def rebuild_command(folder: Path, manifest: dict) -> str:
    """The `moegen build` command that renews the package in `folder`, runnable from here; the spec
    as the manifest records it (relative to the package), or SPEC where it is no longer there."""
    recorded = manifest.get("spec_path")
    spec = Path(os.path.normpath(folder / recorded)) if isinstance(recorded, str) else None
    spec_arg = _shown(spec) if spec is not None and spec.is_file() else "SPEC"
    command = f"`moegen build {spec_arg} -o {_shown(folder.parent)}`"
    if spec_arg == "SPEC":
        command += f" with the spec it was built from ({manifest.get('spec_file', 'not recorded')})"
    return command


def content_hash(content: dict) -> str:
    """sha256 of a manifest's content (its canonical JSON), recorded in the manifest itself."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_contents(folder: Path, manifest: dict, rebuild: str) -> None:
    """The manifest and every file it lists are as the build wrote them (an edited, emptied or
    deleted file otherwise fails later, in Python's or Triton's words, or runs wrongly)."""
    recorded = manifest.get("content_sha256")
    if recorded is None:  # a package from before the manifest recorded its files
        return
    if content_hash({k: v for k, v in manifest.items() if k != "content_sha256"}) != recorded:
        raise PackageError(f"{folder}: manifest.json was changed after the build; " + rebuild)
    for name, digest in manifest.get("files", {}).items():
        try:
            data = (folder / name).read_bytes()
        except OSError as error:
            raise PackageError(f"{folder}: {name} cannot be read ({error.strerror}); " + rebuild) from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise PackageError(f"{folder}: {name} was changed after the build; " + rebuild)


def load_package(path):
    folder = Path(path).resolve()
    init = folder / "__init__.py"
    if not init.is_file():
        raise PackageError(f"{folder}: not a generated moegen package (no __init__.py); "
                           f"run `moegen build SPEC -o {folder.parent}` first")
    # Keyed by the folder and the build: the same build loads once, a rebuilt package anew.
    try:
        build_id = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()[:16]
    except OSError:
        build_id = "none"  # the package's own import then names what is missing
    module_name = f"moegen_generated_{folder.name}_{abs(hash(str(folder))):x}_{build_id}"
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
