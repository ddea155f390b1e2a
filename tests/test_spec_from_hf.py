"""`moegen spec`: a spec from a Hugging Face config.json. The shipped models' published configs
(specs/hf) give the shipped specs' model sections; bad configs exit 2 naming the file and
the key. (tests/test_hf_parity.py runs the mapping against transformers' own blocks.)"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from moegen.cli import main
from moegen.spec import load_spec
from moegen.spec.from_hf import model_fields
from moegen.spec.schema import ModelSpec

SPECS = Path(__file__).resolve().parent.parent / "specs"

# The published configs' keys (specs/hf/README.md), one per shipped spec but the tiny one.
PUBLISHED = {path.stem: json.loads(path.read_text()) for path in sorted((SPECS / "hf").glob("*.json"))}


# Shipped specs of quantized experts: the published model's config with the quantization_config
# of its checkpoints in that format.
GPTQ_INT4 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
AWQ_INT4 = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
FP8_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
QUANTIZED_SPECS = {
    "qwen3-30b-a3b-int4": ("qwen3-30b-a3b", GPTQ_INT4),
    "olmoe-1b-7b-int4": ("olmoe-1b-7b", GPTQ_INT4),
    "mixtral-8x7b-int4": ("mixtral-8x7b", AWQ_INT4),
    "qwen3-30b-a3b-fp8": ("qwen3-30b-a3b", FP8_BLOCKS),
    "deepseek-v3-fp8": ("deepseek-v3", FP8_BLOCKS),
}


def _quantized(spec_name: str) -> tuple[str, dict]:
    """(the published model a shipped spec is of, the quantization_config its spec adds: {} if none)."""
    if spec_name in QUANTIZED_SPECS:
        model, quantization_config = QUANTIZED_SPECS[spec_name]
        return model, {"quantization_config": quantization_config}
    return spec_name, {}


SHIPPED_MODELS = sorted(p.stem for p in SPECS.glob("*.yaml") if p.stem != "tiny")


def test_every_shipped_model_has_its_config():
    assert set(PUBLISHED) == {_quantized(name)[0] for name in SHIPPED_MODELS}


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_published_configs_give_the_shipped_models(name):
    shipped = load_spec(SPECS / f"{name}.yaml").model
    model, quantization = _quantized(name)
    fields = model_fields(PUBLISHED[model] | quantization)
    assert ModelSpec(**(dict(router_dtype=fields["dtype"]) | fields)) == shipped


@pytest.mark.parametrize("name,keys,layers", [
    ("qwen3-30b-a3b", dict(num_hidden_layers=10, decoder_sparse_step=2, mlp_only_layers=[1, 2, 40]), 4),
    ("deepseek-v3", dict(num_hidden_layers=10, first_k_dense_replace=3, moe_layer_freq=2), 3),
    ("deepseek-v3", dict(num_hidden_layers=3, first_k_dense_replace=5), 0),
])
def test_moe_layers_are_counted_as_the_model_places_them(name, keys, layers):
    assert model_fields(PUBLISHED[name] | keys)["num_layers"] == layers


def test_cli_writes_a_spec_that_builds_the_same_package_inputs(tmp_path, capsys):
    folder = tmp_path / "DeepSeek-V3"  # a model snapshot: the name comes from its folder
    folder.mkdir()
    (folder / "config.json").write_text((SPECS / "hf" / "deepseek-v3.json").read_text())
    assert main(["spec", str(folder), "--buckets", "1,8,64", "-o", str(tmp_path / "spec.yaml")]) == 0
    spec = load_spec(tmp_path / "spec.yaml")
    assert spec.name == "deepseek-v3" and spec.workload.token_buckets == (1, 8, 64)
    assert spec.model == load_spec(SPECS / "deepseek-v3.yaml").model
    assert main(["spec", str(folder / "config.json"), "--name", "dsv3", "--dtype", "float16"]) == 0  # to stdout
    out = capsys.readouterr().out
    assert "name: dsv3\n" in out and "  dtype: float16\n  router_dtype: float32\n" in out


QUANTIZED = [  # quantization_config -> the spec's quantization fields
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     ("fp8_block", 128, False)),  # DeepSeek-V3, Qwen3-30B-A3B-FP8
    ({"quant_method": "fbgemm_fp8"}, ("fp8_channel", 128, False)),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
     ("int4_group", 128, True)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True}, ("int4_group", 64, False)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False}, ("int4_group", 32, True)),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 128}}}}, ("int4_group", 128, False)),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     ("fp8_channel", 128, False)),
]


@pytest.mark.parametrize("quantization, fields", QUANTIZED, ids=lambda v: v["quant_method"] if isinstance(v, dict) else "")
def test_a_quantized_checkpoint_gives_a_quantized_spec(quantization, fields, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PUBLISHED["deepseek-v3"] | {"quantization_config": quantization}))
    out = tmp_path / "spec.yaml"
    assert main(["spec", str(config), "--name", "dsv3", "-o", str(out)]) == 0
    m = load_spec(out).model
    assert (m.quantization, m.quantization_group_size, m.quantization_zero_point) == fields
    assert f"The checkpoint's experts are quantized ({fields[0]})" in out.read_text()


@dataclass(frozen=True)
class Bad:
    name: str
    config: object  # a dict written as JSON, or raw text
    message: str


MIXTRAL = PUBLISHED["mixtral-8x7b"]
BAD_CONFIGS = [
    Bad("unknown_family", MIXTRAL | {"model_type": "llama"}, "model_type: 'llama' is not a model family moegen reads"),
    Bad("qwen2_moe", MIXTRAL | {"model_type": "qwen2_moe"}, "shared_expert_gate"),
    Bad("no_model_type", {k: v for k, v in MIXTRAL.items() if k != "model_type"}, "model_type: missing"),
    Bad("missing_key", {k: v for k, v in MIXTRAL.items() if k != "hidden_size"}, "hidden_size: missing"),
    Bad("string_number", MIXTRAL | {"hidden_size": "4096"}, 'hidden_size: expected int, got "4096"'),
    Bad("bool_number", MIXTRAL | {"num_experts_per_tok": True}, "num_experts_per_tok: expected int, got true"),
    Bad("tanh_gelu", MIXTRAL | {"hidden_act": "gelu_pytorch_tanh"}, "activation 'gelu_pytorch_tanh' is not supported"),
    Bad("fp8_dtype", MIXTRAL | {"torch_dtype": "float8_e4m3fn"}, "torch_dtype: dtype 'float8_e4m3fn' is not supported"),
    Bad("topk_method", PUBLISHED["deepseek-v3"] | {"topk_method": "random"}, "topk_method: 'random' is not supported"),
    Bad("spec_rule", MIXTRAL | {"num_experts_per_tok": 9}, "model.top_k: top_k 9 is larger than num_experts 8"),
    Bad("huge_layer_count", PUBLISHED["qwen3-30b-a3b"] | {"num_hidden_layers": 10 ** 15},
        "num_hidden_layers: 1000000000000000 layers, over MAX_LAYERS = 4096"),
    Bad("no_layer_count", {k: v for k, v in MIXTRAL.items() if k != "num_hidden_layers"}, "num_hidden_layers: missing"),
    Bad("zero_sparse_step", PUBLISHED["qwen3-30b-a3b"] | {"decoder_sparse_step": 0},
        "decoder_sparse_step: 0 is not a positive count"),
    Bad("nested_dense_layers", PUBLISHED["qwen3-30b-a3b"] | {"mlp_only_layers": [[1]]},
        "mlp_only_layers: expected a list of layer numbers"),
    Bad("fp8_blocks", MIXTRAL | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
        "quantization_config.weight_block_size: [64, 64] is not supported"),
    Bad("awq_8bit", MIXTRAL | {"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}},
        "quantization_config: awq with 8 bits in groups of 128 is not supported"),
    Bad("bitsandbytes", MIXTRAL | {"quantization_config": {"quant_method": "bitsandbytes"}},
        'quantization_config.quant_method: "bitsandbytes" is not supported'),
    Bad("not_json", "{", "not JSON"),
    Bad("not_an_object", "[1, 2]", "not a JSON object"),
]


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[c.name for c in BAD_CONFIGS])
def test_bad_configs_exit_2_naming_file_and_key(case, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(case.config if isinstance(case.config, str) else json.dumps(case.config))
    assert main(["spec", str(config), "--name", "m", "-o", str(tmp_path / "spec.yaml")]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and case.message in err, err
    assert not (tmp_path / "spec.yaml").exists()


def test_no_config_and_existing_output_exit_2(tmp_path, capsys):
    assert main(["spec", str(tmp_path)]) == 2  # a folder without config.json
    assert f"{tmp_path / 'config.json'}: no such file" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    mine = tmp_path / "spec.yaml"
    mine.write_text("my own notes\n")
    assert main(["spec", str(tmp_path), "-o", str(mine)]) == 2
    assert "exists" in capsys.readouterr().err and mine.read_text() == "my own notes\n"


@pytest.mark.parametrize("relative, name", [
    ("Mixtral-8x7B-Instruct-v0.1/config.json", "mixtral-8x7b-instruct-v0.1"),  # a model folder
    ("configs/Mixtral 8x7B.json", "mixtral-8x7b"),  # a config saved under its own name
])
def test_the_default_name_follows_the_folder_or_the_file(relative, name, tmp_path, capsys):
    config = tmp_path / relative
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(MIXTRAL))
    assert main(["spec", str(config)]) == 0
    assert f"\nname: {name}\n" in capsys.readouterr().out
