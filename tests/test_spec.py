"""Spec loading and validation, and the GPU table. CPU only, no Triton: runs in well under a second."""
from __future__ import annotations

import dataclasses
import keyword
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from moegen.errors import SpecError
from moegen.spec import load_spec
from moegen.spec.loader import load_spec_text
from moegen.spec.schema import DEFAULT_TOKEN_BUCKETS, ModelSpec, Spec, TargetSpec
from moegen.target import (
    GpuTarget,
    expert_memory_gib,
    known_gpu_names,
    lookup_gpu,
    resolve_target,
)

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
SHIPPED = sorted(SPECS_DIR.glob("*.yaml"))

# Minimal valid spec; cases append to it or replace a line. Line numbers: name=1, model=2,
# hidden_size=3, intermediate_size=4, num_experts=5, top_k=6, appended lines from 7.
BASE = """\
name: t
model:
  hidden_size: 64
  intermediate_size: 32
  num_experts: 8
  top_k: 2
"""


def with_model(*lines: str) -> str:
    return BASE + "".join(f"  {line}\n" for line in lines)


def replace(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new)


@dataclass(frozen=True)
class Case:
    name: str
    yaml_text: str
    expected_field: str
    expected_substring: str
    line: Optional[int] = None  # checked when given


CASES = [
    # YAML and document shape
    Case("invalid_yaml", "name: [\n", "", "invalid YAML", 2),
    Case("tab_indent", "name: t\nmodel:\n\thidden_size: 3\n", "", "spaces, not tabs", 3),
    Case("empty_file", "", "", "empty"),
    Case("control_character", "name: t\nmodel: \x07\n", "", "#x0007", 2),
    Case("top_level_list", "- a\n- b\n", "", "top level must be a mapping", 1),
    Case("two_documents", BASE + "---\nname: u\n", "", "one YAML document", 7),
    Case("duplicate_key", with_model("top_k: 3"), "model.top_k", "duplicate key 'top_k'", 7),
    Case("duplicate_section", BASE + "model:\n  top_k: 1\n", "model", "duplicate key", 7),
    Case("yaml_tag", BASE + "offload: !!python/object/apply:os.system ['ls']\n", "offload", "expected a mapping", 7),
    # missing keys
    Case("missing_name", BASE.replace("name: t\n", ""), "name", "missing required key 'name'", 1),
    Case("missing_model", "name: t\n", "model", "missing required key 'model'", 1),
    Case("missing_top_k", replace("  top_k: 2\n", ""), "model.top_k", "missing required key 'top_k'", 2),
    Case("missing_hidden", replace("  hidden_size: 64\n", ""), "model.hidden_size", "missing", 2),
    Case("missing_intermediate", replace("  intermediate_size: 32\n", ""), "model.intermediate_size", "missing"),
    Case("missing_experts", replace("  num_experts: 8\n", ""), "model.num_experts", "missing"),
    # unknown keys
    Case("unknown_model_key", replace("hidden_size", "hiden_size"), "model.hiden_size", "did you mean 'hidden_size'", 3),
    Case("unknown_top_key", BASE + "extra: 1\n", "extra", "unknown key 'extra'", 7),
    Case("unknown_target_key", BASE + "target:\n  gpus: h100\n", "target.gpus", "did you mean 'gpu'", 8),
    Case("key_in_wrong_section", BASE + "token_buckets: [1]\n", "token_buckets", "under `workload:`", 7),
    # types
    Case("bool_for_int", replace("top_k: 2", "top_k: true"), "model.top_k", "got a boolean", 6),
    Case("float_for_int", replace("top_k: 2", "top_k: 2.0"), "model.top_k", "expected an integer", 6),
    Case("string_for_int", replace("top_k: 2", "top_k: '2'"), "model.top_k", "got a string", 6),
    Case("null_for_int", with_model("num_layers: null"), "model.num_layers", "default (1)", 7),
    Case("string_for_bool", with_model("renormalize: maybe"), "model.renormalize", "true or false"),
    Case("int_for_string", BASE + "target:\n  gpu: 4090\n", "target.gpu", 'quote it: "4090"', 8),
    Case("string_for_float", with_model("routed_scaling_factor: 2.5x"), "model.routed_scaling_factor", "expected a number"),
    Case("nan_float", with_model("routed_scaling_factor: .nan"), "model.routed_scaling_factor", "finite"),
    Case("buckets_not_list", BASE + "workload:\n  token_buckets: 4\n", "workload.token_buckets", "a list of integers", 8),
    Case("bucket_not_int", BASE + "workload:\n  token_buckets: [1, 2.5]\n", "workload.token_buckets[1]", "expected an integer", 8),
    Case("bucket_bool", BASE + "workload:\n  token_buckets: [1, yes]\n", "workload.token_buckets[1]", "boolean"),
    Case("section_not_mapping", BASE + "target: h200\n", "target", "expected a mapping", 7),
    Case("name_not_string", replace("name: t", "name: 3"), "name", "expected a string", 1),
    # enums
    Case("bad_activation", with_model("activation: relu"), "model.activation", "use one of: silu, gelu", 7),
    Case("activation_case", with_model("activation: SiLU"), "model.activation", "did you mean 'silu'"),
    Case("bad_scoring", with_model("scoring: softmx"), "model.scoring", "did you mean 'softmax'"),
    Case("bad_dtype", with_model("dtype: fp8"), "model.dtype", "bfloat16, float16, float32"),
    Case("bad_router_dtype", with_model("router_dtype: float"), "model.router_dtype", "did you mean 'float32'"),
    Case("bad_policy", BASE + "offload:\n  policy: lr\n", "offload.policy", "did you mean 'lru'", 8),
    Case("bad_prefetch", BASE + "offload:\n  prefetch: always\n", "offload.prefetch", "none, router, history"),
    # sizes
    Case("zero_hidden", replace("hidden_size: 64", "hidden_size: 0"), "model.hidden_size", "at least 1", 3),
    Case("negative_experts", replace("num_experts: 8", "num_experts: -8"), "model.num_experts", "at least 1"),
    Case("huge_hidden", replace("hidden_size: 64", "hidden_size: 40960000"), "model.hidden_size", "MAX_DIM"),
    Case("huge_intermediate", replace("intermediate_size: 32", "intermediate_size: 2000000"), "model.intermediate_size", "MAX_DIM"),
    Case("huge_experts", replace("num_experts: 8", "num_experts: 100000"), "model.num_experts", "MAX_EXPERTS"),
    Case("huge_top_k", replace("top_k: 2", "top_k: 65"), "model.top_k", "MAX_TOP_K"),
    Case("huge_layers", with_model("num_layers: 5000"), "model.num_layers", "MAX_LAYERS"),
    Case("huge_bucket", BASE + "workload:\n  token_buckets: [1, 2000000]\n", "workload.token_buckets[1]", "MAX_TOKENS"),
    Case("zero_bucket", BASE + "workload:\n  token_buckets: [0, 1]\n", "workload.token_buckets[0]", "at least 1"),
    Case("zero_scaling", with_model("routed_scaling_factor: 0"), "model.routed_scaling_factor", "greater than 0", 7),
    Case("zero_expert_memory", BASE + "target:\n  expert_memory_gib: 0\n", "target.expert_memory_gib", "greater than 0", 8),
    Case("expert_memory_below_top_k", BASE + "target:\n  expert_memory_gib: 0.00001\n", "target.expert_memory_gib", "holds 0 experts", 8),
    Case("expert_memory_over_gpu", BASE + "target:\n  gpu: l4\n  expert_memory_gib: 40\n", "target.expert_memory_gib", "more than the l4's"),
    Case("expert_memory_short_of_any_gpu", BASE.replace("hidden_size: 64", "hidden_size: 1048576").replace(
        "intermediate_size: 32", "intermediate_size: 1048576") + "target:\n  gpu: b200\n  expert_memory_gib: 170\n",
        "target.expert_memory_gib", "more than the b200's 178.4 GiB: target a GPU with more memory"),
    Case("negative_override", BASE + "target:\n  hbm_gbps: -1\n", "target.hbm_gbps", "at least 0.01"),
    Case("override_too_slow", BASE + "target:\n  host_link_gbps: 1.0e-310\n", "target.host_link_gbps", "at least 0.01"),
    Case("override_too_fast", BASE + "target:\n  bf16_tflops: 1.0e+300\n", "target.bf16_tflops", "larger than"),
    Case("float_of_many_digits", BASE + "  routed_scaling_factor: 1" + "0" * 400 + "\n", "model.routed_scaling_factor",
         "expected a finite number"),
    Case("integer_of_many_digits", BASE.replace("hidden_size: 64", "hidden_size: 1" + "0" * 5000),
         "model.hidden_size", "is too large"),
    Case("nested_too_deep", "name: t\nmodel: " + "[" * 2000 + "]" * 2000 + "\n", "", "nested too deeply"),
    Case("tagged_mapping", "name: t\nmodel: !!omap [a: 1]\n", "model", "a list tagged 'omap'"),
    Case("key_with_escape", BASE + "  \"a\\x1bb\": 1\n", "model.a\\x1bb", "unknown key 'a\\x1bb'"),
    # token buckets
    Case("empty_buckets", BASE + "workload:\n  token_buckets: []\n", "workload.token_buckets", "empty", 8),
    Case("unsorted_buckets", BASE + "workload:\n  token_buckets: [1, 8, 4]\n", "workload.token_buckets[2]", "sort them ascending"),
    Case("duplicate_buckets", BASE + "workload:\n  token_buckets: [1, 4, 4]\n", "workload.token_buckets[2]", "sort them"),
    # cross-field rules
    Case("top_k_over_experts", replace("top_k: 2", "top_k: 9"), "model.top_k", "larger than num_experts", 6),
    Case("group_not_divisor", with_model("n_group: 3"), "model.n_group", "not divisible by n_group 3", 7),
    Case("topk_group_over_n_group", with_model("n_group: 4", "topk_group: 5"), "model.topk_group", "larger than n_group", 8),
    Case("too_few_eligible", with_model("n_group: 8", "topk_group: 1"), "model.topk_group", "fewer than top_k 2", 8),
    Case("bias_groups_of_one", with_model("correction_bias: true", "n_group: 8", "topk_group: 2"), "model.n_group", "top-2"),
    Case("shared_without_size", with_model("num_shared_experts: 1"), "model.shared_intermediate_size", "shared_intermediate_size is 0", 2),
    Case("shared_negative_size", with_model("num_shared_experts: 2", "shared_intermediate_size: -1"), "model.shared_intermediate_size", "at least 0"),
    # gpu
    Case("unknown_gpu", BASE + "target:\n  gpu: h2000\n", "target.gpu", "did you mean 'h200'", 8),
    Case("unknown_gpu_far", BASE + "target:\n  gpu: tpu-v5\n", "target.gpu", "known: h100"),
    # name
    Case("name_keyword", replace("name: t", "name: class"), "name", "keyword", 1),
    Case("name_none_keyword", replace("name: t", "name: None"), "name", "keyword"),
    Case("name_digit_first", replace("name: t", "name: 8x7b"), "name", "start with an ASCII letter"),
    Case("name_non_ascii_first", replace("name: t", "name: ünïcode"), "name", "start with an ASCII letter"),
    Case("name_space", replace("name: t", "name: my model"), "name", "contains ' '"),
    Case("name_slash", replace("name: t", "name: a/../b"), "name", "contains '/'"),
    Case("name_code", replace("name: t", "name: \"x; import os\""), "name", "contains ';'"),
    Case("name_too_long", replace("name: t", "name: " + "m" * 65), "name", "at most 64"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_spec_errors(case: Case):
    with pytest.raises(SpecError) as info:
        load_spec_text(case.yaml_text, "case.yaml")
    err = info.value
    assert err.field == case.expected_field, str(err)
    assert case.expected_substring in str(err), str(err)
    assert err.file == "case.yaml"
    if case.line is not None:
        assert err.line == case.line, str(err)
        assert f"case.yaml:{case.line}:" in str(err)


def test_case_names_unique():
    assert len({c.name for c in CASES}) == len(CASES)


def test_message_format():
    with pytest.raises(SpecError) as info:
        load_spec_text(replace("hidden_size", "hiden_size"), "m.yaml")
    assert str(info.value) == "m.yaml:3:3: model.hiden_size: unknown key 'hiden_size'; did you mean 'hidden_size'?"


def test_every_problem_in_document_order():
    """One pass reports every readable field's problem, then the cross-field rules; the error's own
    fields are the first problem's."""
    text = (replace("hidden_size: 64", "hiden_size: 64").replace("top_k: 2", "top_k: 1.5")
            + "target:\n  gpu: nope\nworkload:\n  token_buckets: [0, 1, true]\noffload:\n  policy: nope\n")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "o.yaml")
    problems = [(p.field, p.line) for p in info.value.problems]
    assert problems == [("model.hiden_size", 3), ("model.top_k", 6), ("target.gpu", 8),
                        ("workload.token_buckets[0]", 10), ("workload.token_buckets[2]", 10),
                        ("offload.policy", 12)]
    assert (info.value.field, info.value.line) == ("model.hiden_size", 3)
    assert str(info.value).splitlines() == [p.render() for p in info.value.problems]
    assert "missing required key 'hidden_size'" not in str(info.value)  # the misspelt key's fix names it


def test_cross_field_rules_report_each_independent_problem():
    text = with_model("n_group: 3", "num_shared_experts: 1") + "target:\n  gpu: l4\n  expert_memory_gib: 40\n"
    with pytest.raises(SpecError) as info:
        load_spec_text(text.replace("top_k: 2", "top_k: 9"), "x.yaml")
    assert [p.field for p in info.value.problems] == ["model.top_k", "model.n_group", "model.shared_intermediate_size",
                                                      "target.expert_memory_gib"]


def test_validate_prints_every_problem(tmp_path, capsys):
    from moegen.cli import main

    path = tmp_path / "two.yaml"
    path.write_text(replace("top_k: 2", "top_k: 0") + "offload:\n  policy: nope\n")
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[1] for line in lines] == ["model.top_k", "offload.policy"]
    assert all(line.startswith(f"{path}:") for line in lines)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    assert info.value.line == 0
    assert str(info.value) == f"{missing}: file not found; check the path (relative paths start at the current directory)"


def test_directory_is_unreadable(tmp_path):
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


def test_pipes_and_devices_are_not_read(tmp_path):
    """A pipe would block the loader and a device never end: both refused before reading."""
    pipe = tmp_path / "spec.yaml"
    os.mkfifo(pipe)
    for path in (pipe, Path("/dev/zero")):
        with pytest.raises(SpecError, match="not a regular file"):
            load_spec(path)


def test_not_utf8(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(SpecError, match="UTF-8"):
        load_spec(path)


def test_load_from_file_reports_path_and_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(replace("top_k: 2", "top_k: true"))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}:6:10: model.top_k: ")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_specs_load(path: Path):
    spec = load_spec(path)
    assert spec.name == path.stem
    assert spec.package_name.isidentifier() and not keyword.iskeyword(spec.package_name)
    assert lookup_gpu(spec.target.gpu) is not None


def test_shipped_specs_present():
    names = {p.stem for p in SHIPPED}
    assert {"mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3", "tiny"} <= names


def test_shipped_specs_show_every_key():
    """The shipped specs are the reference layout: every schema field is written out."""
    import yaml

    for path in SHIPPED:
        data = yaml.safe_load(path.read_text())
        assert set(data["model"]) == {f.name for f in dataclasses.fields(ModelSpec)}, path
        assert {"gpu", "expert_memory_gib"} <= set(data["target"]), path
        assert set(data["workload"]) == {"token_buckets"} and set(data["offload"]) == {"policy", "prefetch"}


def test_deepseek_values():
    spec = load_spec(SPECS_DIR / "deepseek-v3.yaml")
    m = spec.model
    assert (m.num_experts, m.hidden_size, m.intermediate_size, m.top_k, m.num_layers) == (256, 7168, 2048, 8, 58)
    assert (m.scoring, m.correction_bias, m.n_group, m.topk_group) == ("sigmoid", True, 8, 4)
    assert (m.routed_scaling_factor, m.num_shared_experts, m.shared_intermediate_size) == (2.5, 1, 2048)


def test_tiny_values():
    spec = load_spec(SPECS_DIR / "tiny.yaml")
    m = spec.model
    assert (m.hidden_size, m.intermediate_size, m.num_experts, m.top_k, m.num_layers) == (40, 24, 6, 2, 2)
    assert m.dtype == "float32" and spec.workload.token_buckets == (1, 4, 16, 64)


def test_minimal_spec_defaults():
    spec = load_spec_text(BASE, "min.yaml")
    assert spec == Spec(name="t", model=ModelSpec(64, 32, 8, 2))
    assert spec.model.num_layers == 1 and spec.model.activation == "silu" and spec.model.renormalize is True
    assert spec.target == TargetSpec() and spec.target.gpu == "h200"
    assert spec.workload.token_buckets == DEFAULT_TOKEN_BUCKETS
    assert isinstance(spec.workload.token_buckets, tuple)
    assert spec.offload.policy == "lru" and spec.offload.prefetch == "none"


def test_empty_section_means_defaults():
    spec = load_spec_text(BASE + "offload:\ntarget:\n", "e.yaml")
    assert spec.target == TargetSpec()


def test_int_accepted_for_float_and_null_for_optional():
    spec = load_spec_text(with_model("routed_scaling_factor: 2") + "target:\n  expert_memory_gib: null\n", "f.yaml")
    assert spec.model.routed_scaling_factor == 2.0 and isinstance(spec.model.routed_scaling_factor, float)
    assert spec.target.expert_memory_gib is None


@pytest.mark.parametrize("hidden_size, memory_gib, expected", [
    ("64", "1e2", (64, 100.0)),  # no dot, no sign: a string in YAML 1.1
    ("064", "2.5E-1", (64, 0.25)),  # a leading zero: not octal
    ("0x40", ".5", (64, 0.5)),
    ("0o100", "3", (64, 3.0)),
])
def test_numbers_as_yaml_1_2_reads_them(hidden_size, memory_gib, expected):
    text = replace("hidden_size: 64", f"hidden_size: {hidden_size}") + f"target:\n  expert_memory_gib: {memory_gib}\n"
    spec = load_spec_text(text, "n.yaml")
    assert (spec.model.hidden_size, spec.target.expert_memory_gib) == expected


def test_base_60_is_not_a_number():
    with pytest.raises(SpecError, match="model.hidden_size: expected an integer, got a string"):
        load_spec_text(replace("hidden_size: 64", "hidden_size: 1:04"), "s.yaml")


def test_correction_bias_with_softmax_allowed():
    spec = load_spec_text(with_model("correction_bias: true", "scoring: softmax"), "b.yaml")
    assert spec.model.correction_bias is True


def test_package_name_is_identifier():
    spec = load_spec_text(replace("name: t", "name: My-model.v2_x"), "p.yaml")
    assert spec.package_name == "My_model_v2_x" and spec.package_name.isidentifier()


def test_bool_rejected_for_int():
    with pytest.raises(SpecError, match="boolean"):
        load_spec_text(replace("num_experts: 8", "num_experts: on"), "b.yaml")


# ---------------------------------------------------------------------------------------------
# GPU table


@pytest.mark.parametrize("name", ["h200", "H200", "NVIDIA H200", "nvidia-h200", " nvidia  h200 "])
def test_gpu_lookup_h200(name):
    gpu = lookup_gpu(name)
    assert gpu is not None and gpu.alias == "h200" and gpu.name == "NVIDIA H200"
    assert (gpu.arch, gpu.sm_count, gpu.hbm_gbps, gpu.bf16_tflops) == (90, 132, 4800, 989)
    assert (gpu.host_link_gbps, gpu.memory_gib, gpu.smem_per_block_kib) == (55, 139.8, 227)


def test_gpu_lookup_full_names():
    assert lookup_gpu("NVIDIA GeForce RTX 4090").alias == "rtx4090"
    assert lookup_gpu("NVIDIA A100-SXM4-80GB").alias == "a100"
    assert lookup_gpu("NVIDIA A100-SXM4-40GB").alias == "a100-40gb"
    assert lookup_gpu("NVIDIA H100 80GB HBM3").alias == "h100"
    assert lookup_gpu("h100 pcie").alias == "h100-pcie"
    assert lookup_gpu("a10g").alias == "a10g" and lookup_gpu("A100").alias == "a100"
    assert lookup_gpu("tpu") is None and lookup_gpu("") is None


def test_known_gpus():
    names = known_gpu_names()
    required = {"h100", "h100-pcie", "h200", "h20", "a100", "a100-40gb", "a10g", "l4", "l40s", "rtx4090", "rtx3090", "b200"}
    assert required <= set(names) and len(names) == len(set(names))
    for alias in names:
        gpu = lookup_gpu(alias)
        assert isinstance(gpu, GpuTarget) and lookup_gpu(gpu.name) == gpu
        assert gpu.sm_count > 0 and gpu.hbm_gbps > 0 and gpu.bf16_tflops > 0 and gpu.memory_gib > 0


def test_resolve_target_overrides():
    plain = resolve_target(TargetSpec(gpu="h200"))
    assert plain == lookup_gpu("h200")
    tuned = resolve_target(TargetSpec(gpu="NVIDIA H200", hbm_gbps=4300.0, bf16_tflops=700.0, host_link_gbps=48.5, sm_count=120))
    assert (tuned.hbm_gbps, tuned.bf16_tflops, tuned.host_link_gbps, tuned.sm_count) == (4300.0, 700.0, 48.5, 120)
    assert tuned.memory_gib == plain.memory_gib and tuned.name == "NVIDIA H200"


def test_resolve_target_from_spec_overrides():
    spec = load_spec_text(BASE + "target:\n  gpu: h100\n  hbm_gbps: 3000\n", "o.yaml")
    assert resolve_target(spec.target).hbm_gbps == 3000.0


def test_expert_memory_gib():
    assert expert_memory_gib(load_spec_text(BASE, "d.yaml")) == pytest.approx(0.9 * 139.8)
    assert expert_memory_gib(load_spec_text(BASE + "target:\n  expert_memory_gib: 12\n", "d.yaml")) == 12.0


def test_extra_aliases():
    assert lookup_gpu("H100-SXM").alias == "h100" and lookup_gpu("a100-80gb").alias == "a100"


def test_current_gpu_unknown_device_borrows_closest_arch_and_interpreter(monkeypatch):
    import types

    import torch

    from moegen.target import current_gpu

    props = types.SimpleNamespace(name="NVIDIA Future X1", major=9, minor=0, multi_processor_count=100,
                                  total_memory=64 * 2**30, shared_memory_per_block_optin=200 * 1024,
                                  regs_per_multiprocessor=65536)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    gpu = current_gpu()
    assert (gpu.name, gpu.arch, gpu.sm_count, gpu.memory_gib, gpu.smem_per_block_kib) == ("NVIDIA Future X1", 90, 100, 64.0, 200)
    assert gpu.hbm_gbps == lookup_gpu("h100").hbm_gbps  # first sm_90 entry in the table

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert current_gpu() == lookup_gpu("h200")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert current_gpu() is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert current_gpu() == lookup_gpu("interpreter")


def test_docs_cover_every_field_and_gpu():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "spec.md").read_text()
    from moegen.spec import schema

    for cls in (schema.Spec, schema.ModelSpec, schema.TargetSpec, schema.WorkloadSpec, schema.OffloadSpec):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in docs, f"docs/spec.md does not document {cls.__name__}.{f.name}"
    for alias in known_gpu_names():
        assert f"| `{alias}` |" in docs
