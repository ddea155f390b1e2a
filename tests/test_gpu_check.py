"""tools/gpu_check.py's whole pipeline on the CPU (`--cpu-smoke`: specs/tiny.yaml through Triton's
interpreter): the peers table, the stacked layers (each layer checked against the float64
reference after its timed calls) and the cold-start table, then a clean exit."""
from __future__ import annotations

from pathlib import Path

from conftest import needs_interpreter_numpy, tool_smoke_report

REPO = Path(__file__).resolve().parent.parent

SMOKE_TOKENS = (1, 5, 17)  # gpu_check's own smoke token counts, all within its stacked cells


@needs_interpreter_numpy
def test_cpu_smoke_run_reports_every_table(tmp_path):
    # tiny, and tiny with int4 experts: the quantized spec's rows against the bf16 spec's
    quantized = tmp_path / "tiny-int4.yaml"
    quantized.write_text((REPO / "specs" / "tiny.yaml").read_text().replace("name: tiny", "name: tiny-int4").replace(
        "quantization: none\n  quantization_group_size: 128", "quantization: int4_group\n  quantization_group_size: 32"))
    report = tool_smoke_report("gpu_check.py", "gpu_check.md", tmp_path, "--skip-tests", "--skip-offload", "--specs",
                               f"tiny,{quantized}")
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
    configs = next(line for line in lines if line.startswith("- configs ("))
    assert f"tiny 0 of 4 buckets tuned for the NVIDIA H200; {quantized} 0 of 4 buckets" in configs
    quantized_at = lines.index("## Quantized experts against moegen's bf16")
    section_end = next(i for i in range(quantized_at + 1, len(lines)) if lines[i].startswith("## "))
    compared = [line.split(" | ") for line in lines[quantized_at:section_end] if line.startswith("| tiny-int4 |")]
    assert [int(row[1]) for row in compared] == list(SMOKE_TOKENS)
