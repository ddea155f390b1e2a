"""tools/e2e_bench.py's plumbing on the CPU (`--cpu-smoke`: a two-layer toy of Mixtral's
architecture through Triton's interpreter, eager): every variant generates, and moegen's
unquantized blocks produce transformers' greedy tokens exactly."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import triton

pytest.importorskip("transformers", reason="the end-to-end benchmark runs a transformers model (pip install .[hf])")

REPO = Path(__file__).resolve().parent.parent
_NUMPY = tuple(int(part) for part in numpy.__version__.split(".")[:2])


@pytest.mark.skipif(triton.__version__.startswith("3.6") and _NUMPY >= (2, 4),
                    reason=f"Triton 3.6's interpreter needs numpy<2.4; this machine has numpy {numpy.__version__}")
def test_cpu_smoke_generates_with_every_variant(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    result = subprocess.run([sys.executable, str(REPO / "tools" / "e2e_bench.py"), "--cpu-smoke"], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.strip("| ").split(" | ") for line in (tmp_path / "e2e_bench.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| experts")]
    assert [(row[0], int(row[1])) for row in rows] == [
        (variant, batch) for variant in ("transformers", "moegen bf16", "moegen fp8", "moegen int4") for batch in (1, 2)]
    assert all(float(row[2]) > 0 for row in rows)
    assert [row[4] for row in rows if row[0] == "moegen bf16"] == ["4 of 4", "4 of 4"]
