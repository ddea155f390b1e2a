"""tools/e2e_bench.py's plumbing on the CPU (`--cpu-smoke`: a two-layer toy of Mixtral's
architecture through Triton's interpreter, its decode step compiled by generate as on the GPU,
fullgraph, without CUDA graphs): every variant generates, and moegen's unquantized blocks produce
transformers' greedy tokens exactly."""
from __future__ import annotations

import pytest

from conftest import needs_interpreter_numpy, tool_smoke_report

pytest.importorskip("transformers", reason="the end-to-end benchmark runs a transformers model (pip install .[hf])")


@needs_interpreter_numpy
def test_cpu_smoke_generates_with_every_variant(tmp_path):
    report = tool_smoke_report("e2e_bench.py", "e2e_bench.md", tmp_path)
    rows = [line.strip("| ").split(" | ") for line in report.splitlines()
            if line.startswith("| ") and not line.startswith("| experts")]
    assert [(row[0], int(row[1])) for row in rows] == [
        (variant, batch) for variant in ("transformers", "moegen bf16", "moegen fp8", "moegen int4") for batch in (1, 2)]
    assert all(float(row[2]) > 0 for row in rows)
    assert [row[4] for row in rows if row[0] == "moegen bf16"] == ["4 of 4", "4 of 4"]
