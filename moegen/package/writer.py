"""Write a generated package atomically: render into a temporary sibling directory, then swap
it into place, so a failed build leaves the previous output untouched. Identical content is
not rewritten at all."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _as_bytes(content: str | bytes) -> bytes:
    return content if isinstance(content, bytes) else content.encode()


def _same_content(folder: Path, files: dict[str, str | bytes]) -> bool:
    if not folder.is_dir():
        return False
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    if present != set(files):
        return False
    return all((folder / name).read_bytes() == _as_bytes(content) for name, content in files.items())


def write_package(folder: Path, files: dict[str, str | bytes]) -> bool:
    """Returns True if anything was written."""
    folder = Path(folder)
    if _same_content(folder, files):
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.new-", dir=folder.parent))
    retired = None
    try:
        for name, content in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_as_bytes(content))
        os.chmod(staging, 0o755)
        if folder.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            os.rmdir(retired)
            os.rename(folder, retired)
        os.rename(staging, folder)
    except BaseException:
        if retired is not None and not folder.exists():
            os.rename(retired, folder)  # put the previous build back
            retired = None
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    return True
