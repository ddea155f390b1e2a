"""The offload plan: budget arithmetic, per-layer slot allocation, pinning, errors."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from moegen.errors import PlanError, SpecError
from moegen.ir import lower
from moegen.plan.offload import load_plan, plan_offload
from moegen.spec import load_spec

from conftest import shared_trace

REPO = Path(__file__).resolve().parent.parent


def _ir(tmp_path, spec="deepseek-v3", **replacements):
    text = (REPO / "specs" / f"{spec}.yaml").read_text()
    for old, new in replacements.items():
        text = text.replace(old, new)
    path = tmp_path / f"{spec}.yaml"
    path.write_text(text)
    return lower(load_spec(path), path)


def test_all_resident_when_the_experts_fit(tmp_path):
    p = plan_offload(_ir(tmp_path, "mixtral-8x7b"))  # 32 x 8 x 336 MiB = 84 GiB < 100 GiB
    assert not p.offloaded and p.slots_per_layer == (8,) * 32 and p.expected_hit_rate == 1.0
    assert p.stall_ms_per_token == 0.0


def test_budget_is_split_into_slots_never_exceeding_it(tmp_path):
    p = plan_offload(_ir(tmp_path))
    assert p.offloaded
    assert p.expert_bytes == 3 * 7168 * 2048 * 2
    assert sum(p.slots_per_layer) * p.expert_bytes <= p.budget_bytes
    assert sum(p.slots_per_layer) == p.budget_bytes // p.expert_bytes
    assert min(p.slots_per_layer) >= 8 and max(p.slots_per_layer) - min(p.slots_per_layer) <= 1
    # Uniform routing: hit rate = resident share; every miss moves one expert over the link.
    assert p.expected_hit_rate == pytest.approx(sum(p.slots_per_layer) / (58 * 256))
    assert p.bytes_per_token == pytest.approx(58 * 8 * (1 - p.expected_hit_rate) * p.expert_bytes)


def test_a_profile_moves_slots_to_layers_with_skewed_routing(tmp_path):
    ir = _ir(tmp_path, "mixtral-8x7b", **{"expert_memory_gib: 100": "expert_memory_gib: 50",
                                          "policy: lru": "policy: pinned_lru"})
    uniform = [1.0] * 8
    skewed = [100.0, 90.0, 80.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    popularity = [skewed if layer % 2 else uniform for layer in range(32)]
    p = plan_offload(ir, popularity)
    assert sum(p.slots_per_layer) == p.budget_bytes // p.expert_bytes
    # Uniform layers gain 1/8 per slot; a skewed layer's third expert is worth more than that.
    assert all(p.slots_per_layer[l] >= 3 for l in range(1, 32, 2))
    assert all(p.pinned[l][: p.slots_per_layer[l] - 2] == tuple(range(p.slots_per_layer[l] - 2))
               for l in range(1, 32, 2))
    assert all(len(p.pinned[l]) == p.slots_per_layer[l] - 2 for l in range(32))


def test_prefetch_lookahead_hides_a_transfer_behind_compute(tmp_path):
    p = plan_offload(_ir(tmp_path, **{"prefetch: none": "prefetch: router"}))
    assert p.lookahead >= 1 and p.lookahead * p.layer_compute_us >= min(p.transfer_us, 57 * p.layer_compute_us)


def test_too_small_a_budget_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="expert_memory_gib") as error:
        _ir(tmp_path, **{"expert_memory_gib: 100": "expert_memory_gib: 10"})
    assert str(error.value).startswith(str(tmp_path / "deepseek-v3.yaml:"))
    assert "raise target.expert_memory_gib to at least" in str(error.value)


def test_a_trace_deeper_than_the_budget_holds_names_the_spec_file(tmp_path):
    ir = _ir(tmp_path)  # 100 GiB: 1218 slots of 84 MiB
    deeper = replace(ir, spec=replace(ir.spec, model=replace(ir.spec.model, num_layers=400)))
    with pytest.raises(SpecError, match="400 layers x top-8 need 3200") as error:
        plan_offload(deeper)
    assert str(error.value).startswith("deepseek-v3.yaml: target.expert_memory_gib:")


def test_a_trace_deeper_than_the_budget_holds_says_the_layers_came_from_it(tmp_path):
    import gzip

    from moegen.offload.trace import TraceError
    from moegen.plan.offload import plan_for_trace

    ir = _ir(tmp_path)  # 58 layers; 100 GiB holds 1218 experts, 400 layers x top-8 need 3200
    header = {"format": "moegen-trace", "version": 1, "model": "deep", "num_layers": 400, "num_experts": 256,
              "top_k": 8, "source": "test", "note": ""}
    token = {"seq": 0, "experts": [list(range(8))] * 400}
    trace = tmp_path / "deep.jsonl.gz"
    trace.write_bytes(gzip.compress(f"{json.dumps(header)}\n{json.dumps(token)}\n".encode()))
    with pytest.raises(TraceError) as error:
        plan_for_trace(ir, trace)
    message = str(error.value)
    assert message.startswith(f"{trace}:1: the trace covers 400 layers")
    assert "400 layers x top-8 need 3200" in message and "or use a trace of the spec's 58 layers" in message


def test_plan_cli_prints_json(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moegen", "plan", str(REPO / "specs" / "deepseek-v3.yaml"), "--json"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["offloaded"] is True and len(plan["slots_per_layer"]) == 58


def test_a_reader_that_leaves_early_is_no_failure():
    """`moegen plan ... | head`: the output's reader has gone before moegen writes (the pipe's
    read end is closed), and moegen ends quietly with 0, not with an error about the pipe."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "moegen", "plan", str(REPO / "specs" / "deepseek-v3.yaml"),
                                 "--json"], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (0, "")


def test_plan_from_a_trace_profiles_pins_and_simulates(tmp_path):
    from moegen.plan.offload import plan_for_trace, trace_popularity
    from moegen.offload.trace import load_trace

    trace_path = shared_trace("deepseek-v2-lite-intent")
    ir = _ir(tmp_path, "deepseek-v2-lite", **{"expert_memory_gib: 100": "expert_memory_gib: 8",
                                              "policy: lru": "policy: pinned_lru"})
    p = plan_for_trace(ir, trace_path)
    assert p.offloaded and p.estimate_from == "trace deepseek-v2-lite-intent.jsonl.gz"
    assert sum(p.slots_per_layer) == p.budget_bytes // p.expert_bytes and min(p.slots_per_layer) >= 6
    popularity = trace_popularity(load_trace(trace_path))
    for layer, pinned in enumerate(p.pinned):  # the trace's most used experts of each layer
        assert len(pinned) == p.slots_per_layer[layer] - 6
        least_pinned = min(popularity[layer][e] for e in pinned)
        assert all(popularity[layer][e] <= least_pinned for e in range(64) if e not in pinned)
    # The hit rate comes from replaying the trace (16-23 of 64 slots: well above the resident share).
    assert 0.5 < p.expected_hit_rate < 1.0
    assert p.bytes_per_token == pytest.approx(26 * 6 * (1 - p.expected_hit_rate) * p.expert_bytes)


def test_plan_rejects_a_trace_of_another_model(tmp_path):
    from moegen.offload.trace import TraceError
    from moegen.plan.offload import plan_for_trace

    trace_path = shared_trace("mixtral-8x7b-gsm8k")
    with pytest.raises(TraceError, match="top-2 of 8 experts"):
        plan_for_trace(_ir(tmp_path, "deepseek-v2-lite"), trace_path)


def _plan_json(capsys, *argv) -> dict:
    from moegen.cli import main

    assert main(["plan", str(REPO / "specs" / "deepseek-v2-lite.yaml"), "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_arguments_override_the_spec_budget_and_policy(capsys):
    resident = _plan_json(capsys)
    assert resident["offloaded"] is False
    offloaded = _plan_json(capsys, "--expert-memory-gib", "8", "--policy", "lfu", "--prefetch", "router")
    assert offloaded["offloaded"] is True and offloaded["budget_bytes"] == 8 * 2**30
    assert (offloaded["policy"], offloaded["prefetch"], offloaded["estimate_from"]) == ("lfu", "router", "uniform routing")
    assert sum(offloaded["slots_per_layer"]) == 8 * 2**30 // offloaded["expert_bytes"]


def test_a_trace_changes_the_plan_under_a_budget_that_offloads(capsys):
    uniform = _plan_json(capsys, "--expert-memory-gib", "8")
    traced = _plan_json(capsys, "--expert-memory-gib", "8", "--trace", str(shared_trace("deepseek-v2-lite-intent")))
    assert traced["estimate_from"] == "trace deepseek-v2-lite-intent.jsonl.gz"
    assert traced["slots_per_layer"] != uniform["slots_per_layer"]  # the trace's profile places the slots
    assert traced["expected_hit_rate"] > uniform["expected_hit_rate"] + 0.1


@pytest.mark.parametrize("budget, needle", [
    ("0.5", "--expert-memory-gib 0.5: 0.5 GiB holds 31 experts of 16.5 MiB, but 26 layers x top-6 need 156; raise "
            "--expert-memory-gib to at least 2.52"),
    ("0", "--expert-memory-gib 0: use a budget in GiB above 0 and at most the h200's 139.8"),
    ("500", "--expert-memory-gib 500: use a budget"),
])
def test_plan_budget_argument_errors_name_the_argument(budget, needle, capsys):
    from moegen.cli import main

    assert main(["plan", str(REPO / "specs" / "deepseek-v2-lite.yaml"), "--expert-memory-gib", budget]) == 2
    assert needle in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# plan.json round trip


def _plans(tmp_path):
    """All resident; uniform routing; pinned_lru from a profile with router prefetch."""
    profile = [[100.0, 90.0, 80.0] + [1.0] * 5 for _ in range(32)]
    return [plan_offload(_ir(tmp_path, "mixtral-8x7b")), plan_offload(_ir(tmp_path)),
            plan_offload(_ir(tmp_path, "mixtral-8x7b", **{"expert_memory_gib: 100": "expert_memory_gib: 50",
                                                          "policy: lru": "policy: pinned_lru",
                                                          "prefetch: none": "prefetch: router"}), profile)]


def test_plan_json_loads_back_into_the_same_plan(tmp_path):
    for number, plan in enumerate(_plans(tmp_path)):
        path = tmp_path / f"plan{number}.json"
        path.write_text(json.dumps(plan.to_json(), indent=2, sort_keys=True))
        assert load_plan(path) == plan
    assert any(p.pinned != ((),) * p.num_layers for p in _plans(tmp_path))  # pinning round-trips too


def test_a_built_package_plan_loads_from_its_folder(tmp_path):
    from moegen.package import build

    folder, _ = build(REPO / "specs" / "tiny.yaml", tmp_path)
    plan = load_plan(folder)
    assert plan == plan_offload(lower(load_spec(REPO / "specs" / "tiny.yaml"), "tiny.yaml"))


PLAN_ERRORS = [  # (change to an offloaded DeepSeek-V3 plan, the field named, words of the message)
    (lambda d: d.pop("policy"), "policy", "missing"),
    (lambda d: d.update(colour="red"), "colour", "not a field"),
    (lambda d: d.update(top_k="8"), "top_k", "is not a whole number"),
    (lambda d: d.update(offloaded=1), "offloaded", "is not true or false"),
    (lambda d: d.update(slots_per_layer=d["slots_per_layer"][:-1]), "slots_per_layer", "for 58 layers"),
    (lambda d: d["slots_per_layer"].__setitem__(3, 7), "slots_per_layer[3]", "cannot hold one token's 8 experts"),
    (lambda d: d["slots_per_layer"].__setitem__(0, 300), "slots_per_layer[0]", "300 slots for 256 experts"),
    (lambda d: d["pinned"].__setitem__(2, [1, 1]), "pinned[2]", "not distinct expert ids"),
    (lambda d: d["pinned"].__setitem__(2, [256]), "pinned[2]", "not distinct expert ids"),
    (lambda d: d["pinned"].__setitem__(2, list(range(20))), "pinned[2]", "leave fewer than the 8 slots"),
    (lambda d: d.update(policy="fifo"), "policy", "unknown policy 'fifo'"),
    (lambda d: d.update(prefetch="psychic"), "prefetch", "unknown prefetch mode"),
    (lambda d: d.update(budget_bytes=d["budget_bytes"] // 2), "slots_per_layer", "more than budget_bytes"),
    (lambda d: d.update(offloaded=False), "offloaded", "false, but not every layer"),
    (lambda d: d.update(expected_hit_rate=1.5), "expected_hit_rate", "not a rate"),
]


@pytest.mark.parametrize("change, field, words", PLAN_ERRORS, ids=[e[1] + "-" + e[2][:12] for e in PLAN_ERRORS])
def test_a_broken_plan_names_its_file_and_field(tmp_path, change, field, words):
    data = json.loads(json.dumps(plan_offload(_ir(tmp_path)).to_json()))  # as plan.json holds it
    change(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as raised:
        load_plan(path)
    assert raised.value.file == str(path) and raised.value.field == field and words in str(raised.value)
    assert raised.value.exit_code == 2


@pytest.mark.parametrize("text, words", [("{", "is not JSON"), ("[1, 2]", "not a JSON object")])
def test_a_plan_file_that_is_not_a_plan_says_so(tmp_path, text, words):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=words):
        load_plan(path)
    with pytest.raises(PlanError, match="cannot be read"):
        load_plan(tmp_path / "missing.json")
