"""tools/offload_model_bench.py's plumbing on the CPU (`--cpu-smoke`: a two-layer toy of Mixtral's
architecture saved as safetensors and loaded offloaded through Triton's interpreter): a row per
expert format and budget."""
from __future__ import annotations

import pytest

from conftest import needs_interpreter_numpy, tool_smoke_report

pytest.importorskip("transformers", reason="the benchmark runs transformers models (pip install .[hf])")


@needs_interpreter_numpy
def test_cpu_smoke_offloads_every_budget_and_format(tmp_path):
    report = tool_smoke_report("offload_model_bench.py", "offload_model_bench.md", tmp_path, "--layers", "2",
                               "--profile")
    rows = [line.strip("| ").split(" | ") for line in report.splitlines()
            if line.startswith("| mixtral")]
    budgets = [(experts, budget) for experts in ("bf16", "int4") for budget in ("100%", "50%", "25%")]
    assert [(row[1], row[2].split()[0]) for row in rows] == budgets
    hit_rates = [float(row[10]) for row in rows]
    assert all(0 < rate <= 1 for rate in hit_rates) and hit_rates[2] < hit_rates[0]
    # Offloaded under every budget, the model computes as it does all-resident (float32 here).
    assert all(float(row[14]) <= 1e-4 and row[15] == "True" for row in rows)
    assert sorted(path.name for path in tmp_path.glob("profile-*.txt")) == sorted(
        f"profile-mixtral-8x7b-{experts}-{budget.replace('%', 'pct')}.txt" for experts, budget in budgets)
