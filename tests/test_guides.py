"""The guides in docs/guides/ and docs/offload.md run as written: one test per guide, its fenced
blocks in order.

Convention (each guide says so in its first lines):
- ```bash and ```python blocks run;
- ```bash gpu and ```python gpu blocks run only where torch.cuda.is_available(); elsewhere the
  test runs the other blocks, then skips, naming the guide and saying a CUDA GPU is needed;
- every other block (text, console, yaml, json, ...) is output or a file listing and does not run.

A guide runs in a fresh folder laid out like a checkout: tmp/main/ (the working folder) with
`specs` linked to this repository's specs/, and tmp/shared linked to ../shared where it exists
(a guide that reads ../shared/traces skips without it). Its python blocks share one namespace
and run in this process, with tmp/main first on sys.path so that `import generated.<name>`
finds what the guide built; its bash blocks run with `bash -euo pipefail`, one process each.
`moegen` is the one beside this Python; builds go to tmp/main/generated/, tuning results to
tmp/tuning (MOEGEN_TUNED_CONFIG_DIR), never into the repository. Other MOEGEN_* variables are
unset, but MOEGEN_PRECOMPILE=0: on the target GPU a build would compile every bucket's kernels.
Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py also sets in-process).
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
GUIDES = sorted((REPO / "docs" / "guides").glob("*.md")) + [REPO / "docs" / "offload.md"]
SHARED = REPO.parent / "shared"
HAS_GPU = torch.cuda.is_available()
FENCE = re.compile(r"^```(.*)$")


def code_blocks(path: Path) -> list[tuple[int, str, bool, str]]:
    """(line of the opening fence, "bash" or "python", gpu only, code) of each block that runs."""
    blocks, opened = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence and opened is None:
            opened, lines = (number, fence.group(1).split()), []
        elif fence and not fence.group(1).strip():
            start, info = opened
            if info and info[0] in ("bash", "python"):
                assert info[1:] in ([], ["gpu"]), f"{path.name}:{start}: unknown block kind {' '.join(info)!r}"
                blocks.append((start, info[0], info[1:] == ["gpu"], "\n".join(lines) + "\n"))
            opened = None
        elif opened is not None:
            lines.append(line)
    assert opened is None, f"{path.name}: the block opened on line {opened[0]} is never closed"
    return blocks


def _forget_generated_modules() -> None:
    for name in [n for n in sys.modules if n == "generated" or n.startswith(("generated.", "moegen_generated_"))]:
        del sys.modules[name]


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_guide_runs(guide, tmp_path, monkeypatch):
    relative = guide.relative_to(REPO)
    blocks = code_blocks(guide)
    assert blocks, f"{relative} has no bash or python block"
    if any("../shared/traces" in code for *_, code in blocks) and not (SHARED / "traces").is_dir():
        pytest.skip(f"{relative} reads ../shared/traces, which is absent here")
    main = tmp_path / "main"
    main.mkdir()
    (main / "specs").symlink_to(REPO / "specs")
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED)
    for name in [n for n in os.environ if n.startswith("MOEGEN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOEGEN_TUNED_CONFIG_DIR", str(tmp_path / "tuning"))
    monkeypatch.setenv("MOEGEN_PRECOMPILE", "0")  # on the target GPU, kernels compile at first use instead
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if not HAS_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.chdir(main)
    monkeypatch.syspath_prepend(str(main))
    namespace = {"__name__": "__guide__"}
    skipped = []
    _forget_generated_modules()  # a `generated` package of another guide or test
    try:
        for line, language, gpu_only, code in blocks:
            if gpu_only and not HAS_GPU:
                skipped.append(line)
                continue
            if language == "bash":
                run = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=main, capture_output=True,
                                     text=True)
                assert run.returncode == 0, (f"{relative}:{line}: bash block exited with {run.returncode}\n"
                                             f"--- stdout\n{run.stdout[-3000:]}--- stderr\n{run.stderr[-3000:]}")
                importlib.invalidate_caches()  # the block may have built a package
            else:  # padded so that tracebacks give the guide's own line numbers
                exec(compile("\n" * line + code, str(guide), "exec"), namespace)
    finally:
        _forget_generated_modules()
    if skipped:
        pytest.skip(f"{relative}: the other blocks ran; the blocks on lines {skipped} need a CUDA GPU")
