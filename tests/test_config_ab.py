"""tools/config_ab.py on the CPU (`--cpu-smoke`: Triton's interpreter, specs/tiny.yaml, which has
no tuned entry there, so the cost model's config stands in for one)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO_ROOT, needs_interpreter_numpy


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "config_ab.py"), "--cpu-smoke", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)


@needs_interpreter_numpy
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run")
def test_times_the_config_and_each_variant_or_says_why_not():
    result = _run("specs/tiny.yaml", "--tokens", "5", "--variant", "num_stages=2", "--variant", "block_m=48")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| 5 |")]
    timed = {cells[2].strip(): float(cells[4]) for cells in rows if cells[3].strip()}
    assert len(rows) == 3 and len(timed) == 2, result.stdout
    assert [ratio for key, ratio in timed.items() if "(cost model)" in key] == [1.0]
    assert any("_n32k64w4s2_" in key for key in timed)
    assert any("refused: block_m 48" in cells[2] for cells in rows)


def test_a_field_that_is_not_a_config_field_is_named():
    result = _run("specs/tiny.yaml", "--tokens", "5", "--variant", "blok_m=64")
    assert result.returncode != 0 and "'blok_m=64' is not FIELD=VALUE" in result.stderr


@needs_interpreter_numpy
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke run")
def test_an_entry_runs_on_the_edited_templates_too_and_is_checked_there(tmp_path):
    """--templates: the entry runs on the kernels an edited copy of templates/ renders, beside the
    repository's; an edit that doubles GEMM1's output fails its check there and only there."""
    import shutil

    edited = tmp_path / "templates"
    shutil.copytree(REPO_ROOT / "templates", edited)
    gate_up = edited / "moe_gate_up.py.jinja"
    text = gate_up.read_text()
    assert text.count("    h = {{ activation_fn }}(acc_gate) * acc_up\n") == 1
    gate_up.write_text(text.replace("    h = {{ activation_fn }}(acc_gate) * acc_up\n",
                                    "    h = {{ activation_fn }}(acc_gate) * acc_up * 2\n"))
    result = _run("specs/tiny.yaml", "--tokens", "5", "--templates", str(edited))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 5 |")]
    assert len(rows) == 2, result.stdout
    assert "(cost model)" in rows[0] and rows[0].split("|")[4].strip() == "1.000"
    assert f"{edited} templates) failed: MoegenError: wrong result" in rows[1]
