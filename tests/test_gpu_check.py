"""tools/gpu_check.py's whole pipeline on the CPU (`--cpu-smoke`: specs/tiny.yaml through Triton's
interpreter): the peers table, the stacked layers (each layer checked against the float64
reference after its timed calls) and the cold-start table, then a clean exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import triton

REPO = Path(__file__).resolve().parent.parent

SMOKE_TOKENS = (1, 5, 17)  # gpu_check's own smoke token counts, all within its stacked cells


# Triton 3.6's interpreter fails on numpy 2.4 and later (CI pins numpy<2.4; a GPU machine may not).
_NUMPY = tuple(int(part) for part in numpy.__version__.split(".")[:2])


@pytest.mark.skipif(triton.__version__.startswith("3.6") and _NUMPY >= (2, 4),
                    reason=f"Triton 3.6's interpreter needs numpy<2.4; this machine has numpy {numpy.__version__}")
def test_cpu_smoke_run_reports_every_table(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    # tiny, and tiny with int4 experts: the quantized spec's rows against the bf16 spec's
    quantized = tmp_path / "tiny-int4.yaml"
    quantized.write_text((REPO / "specs" / "tiny.yaml").read_text().replace("name: tiny", "name: tiny-int4").replace(
        "quantization: none\n  quantization_group_size: 128", "quantization: int4_group\n  quantization_group_size: 32"))
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--cpu-smoke", "--skip-tests",
                             "--skip-offload", "--specs", f"tiny,{quantized}"], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "gpu_check.md").read_text()
    lines = report.splitlines()
    assert lines[-1].endswith("OK")
    caller_at = lines.index("## Callers who route themselves: fused_experts against fused_moe")
    stack_at = lines.index("## In a stack of layers (T <= 512)")
    cold_at = lines.index("## Cold start (first call after import)")
    peers = [line.split(" | ") for line in lines[:caller_at] if line.startswith("| tiny |")]
    callers = [line.split(" | ") for line in lines[caller_at:stack_at] if line.startswith("| tiny")]
    assert [(row[0], int(row[1])) for row in callers] == [(f"| {spec}", t) for spec in ("tiny", "tiny-int4")
                                                          for t in SMOKE_TOKENS]
    stacked = [line.split(" | ") for line in lines[stack_at:cold_at] if line.startswith("| tiny |")]
    assert [int(row[1]) for row in peers] == list(SMOKE_TOKENS)
    assert [(int(row[1]), int(row[2])) for row in stacked] == [(t, 2) for t in SMOKE_TOKENS]  # 2 layers on the CPU
    assert all("WRONG" not in cell for row in peers + stacked for cell in row)
    quantized_at = lines.index("## Quantized experts against moegen's bf16")
    section_end = next(i for i in range(quantized_at + 1, len(lines)) if lines[i].startswith("## "))
    compared = [line.split(" | ") for line in lines[quantized_at:section_end] if line.startswith("| tiny-int4 |")]
    assert [int(row[1]) for row in compared] == list(SMOKE_TOKENS)
