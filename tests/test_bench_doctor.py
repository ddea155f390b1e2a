"""`moegen bench` (its CPU smoke run under Triton's interpreter, and its refusals) and `moegen doctor`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moegen import cli, knobs
from moegen.bench.report import pct_of_floor
from moegen.tune.db import installed_version

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "specs" / "tiny.yaml"
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run and the CPU refusals")


@on_cpu
def test_bench_smoke_run_checks_and_times_every_implementation(capsys):
    assert cli.main(["bench", str(TINY), "--tokens", "1,5", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["spec"] == "tiny" and report["problems"] == []
    assert report["ceilings"]["hbm_gbps"] > 0 and report["ceilings"]["gemm_tflops"] > 0
    assert [row["tokens"] for row in report["rows"]] == [1, 5]
    for row in report["rows"]:
        assert row["bound"] in ("memory", "compute") and 1 <= row["experts_touched"] <= 6 and row["floor_us"] > 0
        assert row["floor_bytes"] == row["experts_touched"] * 3 * 40 * 24 * 4 + 2 * row["tokens"] * 40 * 4
        assert set(row["implementations"]) == {"moegen", "naive", "grouped_mm"}
        moegen = row["implementations"]["moegen"]
        assert moegen["err"] < 1e-4 and not moegen["wrong"] and moegen["us"] > 0
        assert moegen["pct_floor"] == pct_of_floor(row["floor_us"], moegen["us"])


@on_cpu
def test_bench_table_names_the_columns(capsys):
    assert cli.main(["bench", str(TINY), "--tokens", "3", "--peers", "moegen", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# moegen bench: tiny on CPU, Triton interpreter")
    row = next(line for line in out.splitlines() if line.startswith("| tiny | 3 |")).split(" | ")
    assert row[4:8] == ["n/a", "", "n/a", ""]  # the peers left out
    assert "%floor: floor / time" in out


@on_cpu
@pytest.mark.parametrize("argv, needle", [
    (["bench", str(REPO / "specs" / "mixtral-8x7b.yaml")], "interpreter computes bf16 dots wrongly"),
    (["bench", str(TINY), "--peers", "naive"], "--peers 'naive': expected moegen"),
    (["bench", str(TINY), "--tokens", "0"], "--tokens '0'"),
    (["bench", "no/such.yaml"], "no/such.yaml: file not found"),
])
def test_bench_refuses_what_it_cannot_measure(argv, needle, capsys):
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


@on_cpu
def test_bench_without_a_gpu_or_the_interpreter_says_what_to_do(capsys):
    with knobs.scope(TRITON_INTERPRET=None):
        assert cli.main(["bench", str(TINY)]) == 2
    assert "this machine has none" in capsys.readouterr().err


def _doctor(capsys, *flags) -> tuple[int, dict]:
    code = cli.main(["doctor", "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def test_doctor_reports_versions_settings_locations_and_entries(capsys):
    code, report = _doctor(capsys)
    assert code == 0
    assert report["versions"]["torch"] == installed_version("torch") and report["versions"]["triton"]
    assert [row["name"] for row in report["variables"]][:len(knobs.VARIABLES)] == [v.name for v in knobs.VARIABLES]
    shipped = sorted(p.name for p in (REPO / "tuned").glob("*.json"))
    assert sorted(Path(e["path"]).name for e in report["tuning_entries"]) == shipped
    if not torch.cuda.is_available():  # the interpreter (tests/conftest.py) is this machine's tuning target
        assert report["gpu"]["device"] is None and report["gpu"]["tuning_device"] == "Triton interpreter"
        assert {e["status"] for e in report["tuning_entries"]} == {"current, for another GPU"}
        with knobs.scope(TRITON_INTERPRET=None):
            _, plain = _doctor(capsys)
        assert {e["status"] for e in plain["tuning_entries"]} == {"current (no GPU here to match)"}
    assert report["locations"]["tuning_search_path"][-1]["path"] == str(REPO / "tuned")


def test_doctor_names_stale_entries_and_bad_settings(tmp_path, capsys):
    stale = tmp_path / "db" / "h40_i24_e6_k2_silu_float32__nvidia_h200.json"
    stale.parent.mkdir()
    shutil.copy(next((REPO / "tuned").glob("*.json")), stale)
    content = json.loads(stale.read_text())
    content["metadata"]["triton"] = "3.0.0"
    stale.write_text(json.dumps(content))
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(stale.parent), MOEGEN_PRECOMPILE="sometimes"):
        code, report = _doctor(capsys)
    assert code == 2
    entry = next(e for e in report["tuning_entries"] if e["path"] == str(stale))
    assert entry["status"].startswith("stale: triton 3.0.0 != ")
    precompile = next(row for row in report["variables"] if row["name"] == "MOEGEN_PRECOMPILE")
    assert precompile["value"] == "sometimes" and "not an on/off value" in precompile["problem"]
    assert report["locations"]["tune_saves_to"] == str(stale.parent)


def test_readme_documents_every_variable():
    readme = (REPO / "README.md").read_text()
    for variable in knobs.VARIABLES:
        assert f"| `{variable.name}" in readme, variable.name


@on_cpu
def test_bench_of_quantized_experts_checks_moegen_against_the_quantized_reference(tmp_path, capsys):
    """moegen runs the int4 storage, checked against the float64 reference of the dequantized
    weights; the peers run those dequantized weights; the floor counts the quantized bytes."""
    spec = tmp_path / "tiny_int4.yaml"
    spec.write_text(TINY.read_text().replace("hidden_size: 40", "hidden_size: 64").replace(
        "quantization: none\n  quantization_group_size: 128", "quantization: int4_group\n  quantization_group_size: 32"))
    assert cli.main(["bench", str(spec), "--tokens", "1", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weights"] == "int4_group" and report["problems"] == []
    (row,) = report["rows"]
    assert all(cell["err"] < 1e-4 and not cell["wrong"] for cell in row["implementations"].values())
    stored = 2 * (3 * 64 * 24 // 2 + (2 * 24 * 2 + 64 * 1) * 4)  # two experts' int4 weights and float32 scales
    assert row["floor_bytes"] == stored + 2 * 64 * 4  # and the activations in and out
