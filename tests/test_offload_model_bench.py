"""tools/offload_model_bench.py's plumbing on the CPU (`--cpu-smoke`: a two-layer toy of Mixtral's
architecture saved as safetensors and loaded offloaded through Triton's interpreter): a row per
expert format and budget."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import triton

pytest.importorskip("transformers", reason="the benchmark runs transformers models (pip install .[hf])")

REPO = Path(__file__).resolve().parent.parent
_NUMPY = tuple(int(part) for part in numpy.__version__.split(".")[:2])


@pytest.mark.skipif(triton.__version__.startswith("3.6") and _NUMPY >= (2, 4),
                    reason=f"Triton 3.6's interpreter needs numpy<2.4; this machine has numpy {numpy.__version__}")
def test_cpu_smoke_offloads_every_budget_and_format(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    result = subprocess.run([sys.executable, str(REPO / "tools" / "offload_model_bench.py"), "--cpu-smoke",
                             "--layers", "2"], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.strip("| ").split(" | ") for line in (tmp_path / "offload_model_bench.md").read_text().splitlines()
            if line.startswith("| mixtral")]
    assert [(row[1], row[2].split()[0]) for row in rows] == [
        (experts, budget) for experts in ("bf16", "int4") for budget in ("100%", "50%", "25%")]
    hit_rates = [float(row[9]) for row in rows]
    assert all(0 < rate <= 1 for rate in hit_rates) and hit_rates[2] < hit_rates[0]
