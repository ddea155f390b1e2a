"""moegen.load_offloaded: a Hugging Face checkpoint folder as a causal LM whose experts live in host
memory under an expert budget. Its logits are transformers' own and its greedy continuations the
same, for every family moegen reads (float32, tiny shapes; the kernels in the interpreter on the
CPU)."""
from __future__ import annotations

import copy
import json
import zlib

import pytest
import torch

import moegen
from moegen import reference as ref
from moegen.errors import SpecError
from moegen.quant.checkpoint import CheckpointError
from moegen.runtime.hf import moe_block_slots
from moegen.spec.from_hf import model_fields
from test_hf_parity import MODELS, _randomized, _tiny_model, needs_transformers_5

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-4  # float32


def _checkpoint(family: str, tmp_path, package_factory, **package_fields):
    """(transformers' model, its checkpoint folder in shards of 100 KB, the package, MoE layers)."""
    _, model_class, config_class, config_fields = next(m for m in MODELS if m[0] == family)
    model, config = _tiny_model(model_class, config_class, config_fields)
    model = _randomized(model, torch.Generator().manual_seed(zlib.crc32(family.encode())))
    model.save_pretrained(tmp_path / family, max_shard_size="100KB")
    pkg = package_factory(**(model_fields(config.to_dict()) | {"dtype": "float32", "num_layers": 1} | package_fields))
    return model.to(DEVICE), tmp_path / family, pkg, len(moe_block_slots(model))


def _budget_gib(pkg, layers: int, slots: int) -> float:
    return layers * slots * pkg.SPEC.model.expert_bytes / 2**30


def _logits_error(offloaded, model, seed: int) -> float:
    """Relative error of the offloaded model's logits against `model`'s on a random 5-token prompt."""
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    with torch.no_grad():
        return ref.relative_error(offloaded(prompt).logits.double(), model(prompt).logits.double())


@needs_transformers_5
@pytest.mark.parametrize("family,prefetch", [(m[0], "none") for m in MODELS] + [("mixtral", "router"),
                                                                                  ("deepseek_v3", "router")])
def test_an_offloaded_checkpoint_generates_as_transformers_does(family, prefetch, tmp_path, package_factory):
    model, folder, pkg, layers = _checkpoint(family, tmp_path, package_factory)
    top_k = pkg.SPEC.model.top_k
    offloaded = moegen.load_offloaded(folder, pkg, expert_memory_gib=_budget_gib(pkg, layers, top_k + 1),
                                      prefetch=prefetch, device=DEVICE)
    runtime = offloaded.moegen_offload
    assert runtime.plan.offloaded and runtime.plan.slots_per_layer == (top_k + 1,) * layers
    # No routed expert is a parameter of the model: they are the host store's, and the GPU's
    # share of them is the pools' slots.
    assert not [name for name, _ in offloaded.named_parameters() if ".experts." in name]
    assert runtime.pool_bytes == sum(runtime.plan.slots_per_layer) * runtime.plan.expert_bytes

    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        expected, logits = model(prompt).logits, offloaded(prompt).logits
        tokens = offloaded.generate(prompt, max_new_tokens=4, do_sample=False)
        expected_tokens = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert ref.relative_error(logits.double(), expected.double()) <= TOLERANCE
    assert torch.equal(tokens, expected_tokens)
    stats = runtime.stats
    assert stats.demand_loads > 0 and stats.hits > 0
    assert (stats.prefetch_loads > 0) == (prefetch == "router")


@needs_transformers_5
def test_a_quantized_package_quantizes_the_experts_as_they_load(tmp_path, package_factory):
    model, folder, pkg, layers = _checkpoint("qwen3_moe", tmp_path, package_factory, quantization="int4_group",
                                             quantization_group_size=32)
    offloaded = moegen.load_offloaded(folder, pkg, expert_memory_gib=_budget_gib(pkg, layers, 6), device=DEVICE)
    host = offloaded.moegen_offload.host
    assert sorted(host.parts) == ["w13", "w13_scale", "w2", "w2_scale"]
    # The same model offloaded from host memory: its experts quantized into the same bytes.
    in_place = moegen.offload_model(copy.deepcopy(model).cpu(), pkg, expert_memory_gib=_budget_gib(pkg, layers, 6),
                                    device=DEVICE).moegen_offload.host
    assert all(torch.equal(a, b) for name in host.parts for a, b in zip(host.parts[name], in_place.parts[name]))
    assert moegen.replace_moe_blocks(model, pkg) == layers  # all resident, quantized as they load: the same bytes
    assert _logits_error(offloaded, model, seed=4) <= TOLERANCE


@needs_transformers_5
def test_a_quantized_checkpoint_loads_as_stored(tmp_path, package_factory):
    """A compressed-tensors int4 checkpoint (`moegen quantize`), one attention projection stored
    quantized too (as AWQ and fp8 checkpoints hold every linear layer): the experts' stored bytes
    go to the host store as they are, the projection is dequantized, and the logits are those of
    the unquantized model with the same weights rounded."""
    from safetensors.torch import load_file, save_file

    from moegen.quant.convert import quantize_checkpoint, quantized_tensors
    from moegen.quant.quantize import dequantize, quantize

    fields = dict(quantization="int4_group", quantization_group_size=32, quantization_zero_point=True)
    model, folder, pkg, layers = _checkpoint("qwen3_moe", tmp_path, package_factory, **fields)
    fmt = pkg.KERNELS.weight_format
    assert quantize_checkpoint(folder, tmp_path / "int4", fmt) == layers * 12 * 3
    projection = "model.layers.1.self_attn.q_proj"
    shard = next(path for path in sorted((tmp_path / "int4").glob("*.safetensors"))
                 if f"{projection}.weight" in load_file(path))
    tensors = load_file(shard)
    weight = tensors.pop(f"{projection}.weight")
    save_file(tensors | quantized_tensors(projection, weight, fmt), shard, metadata={"format": "pt"})

    fp8 = package_factory(**(model_fields(model.config.to_dict()) | {"dtype": "float32", "num_layers": 1,
                                                                      "quantization": "fp8_block"}))
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+\.safetensors: model\.layers\.1\.self_attn\.q_proj"
                                              r"\.weight: missing; float8_e4m3fn weights"):
        moegen.load_offloaded(tmp_path / "int4", fp8, device=DEVICE)  # an int4 checkpoint, an fp8 package
    offloaded = moegen.load_offloaded(tmp_path / "int4", pkg, expert_memory_gib=_budget_gib(pkg, layers, 6),
                                      device=DEVICE)
    assert sorted(offloaded.moegen_offload.host.parts) == ["w13", "w13_scale", "w13_zero", "w2", "w2_scale",
                                                           "w2_zero"]
    assert moegen.replace_moe_blocks(model, pkg) == layers  # the same rounding, all resident
    q_proj = model.get_submodule(projection)
    with torch.no_grad():
        q_proj.weight.copy_(dequantize(quantize(weight[None], fmt), fmt, *weight.shape)[0])
    assert _logits_error(offloaded, model, seed=6) <= TOLERANCE


@needs_transformers_5
def test_what_load_offloaded_refuses(tmp_path, package_factory):
    model, folder, pkg, layers = _checkpoint("mixtral", tmp_path, package_factory)
    with pytest.raises(SpecError, match="need"):  # a budget below one token's experts in every layer
        moegen.load_offloaded(folder, pkg, expert_memory_gib=_budget_gib(pkg, layers, 1), device=DEVICE)
    other = package_factory(**(model_fields(model.config.to_dict()) | {"dtype": "float32", "num_layers": 1,
                                                                       "top_k": 3}))
    with pytest.raises(ValueError, match="built for another model: top_k 3"):
        moegen.load_offloaded(folder, other, device=DEVICE)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match=r"a quantized checkpoint \(awq\), and this package's experts are "
                                         r"unquantized: build the spec `moegen spec"):
        moegen.load_offloaded(folder, pkg, device=DEVICE)
    (folder / "config.json").write_text(json.dumps(config))
    shard = sorted(folder.glob("*.safetensors"))[0]
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    dropped = next(name for name in tensors if "self_attn" in name)
    save_file({k: v for k, v in tensors.items() if k != dropped}, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="the checkpoint lacks 1 of the model's tensors"):
        moegen.load_offloaded(folder, pkg, device=DEVICE)


@needs_transformers_5
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_a_model_built_in_host_memory_offloads_in_place(family, tmp_path, package_factory):
    model, _, pkg, layers = _checkpoint(family, tmp_path, package_factory)
    model = model.cpu()
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, expected_tokens = model(prompt).logits, model.generate(prompt, max_new_tokens=3, do_sample=False)
    top_k = pkg.SPEC.model.top_k
    offloaded = moegen.offload_model(model, pkg, expert_memory_gib=_budget_gib(pkg, layers, top_k), device=DEVICE)
    assert offloaded is model and not [name for name, _ in model.named_parameters() if ".experts." in name]
    prompt = prompt.to(DEVICE)
    with torch.no_grad():
        assert ref.relative_error(model(prompt).logits.double().cpu(), expected.double()) <= TOLERANCE
        assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False).cpu(), expected_tokens)
    with torch.device("meta"):
        empty = type(model)(model.config)
    with pytest.raises(ValueError, match="meta device"):
        moegen.offload_model(empty, pkg, expert_memory_gib=_budget_gib(pkg, layers, top_k), device=DEVICE)


@needs_transformers_5
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_batches_of_sequences_decode_as_transformers_does(batch, tmp_path, package_factory):
    """Batch rows route to different experts: more distinct experts per step than a layer has
    slots (the runtime then streams the step's experts through the pool in groups)."""
    model, folder, pkg, layers = _checkpoint("qwen3_moe", tmp_path, package_factory)
    top_k = pkg.SPEC.model.top_k
    offloaded = moegen.load_offloaded(folder, pkg, expert_memory_gib=_budget_gib(pkg, layers, top_k + 2),
                                      prefetch="router", device=DEVICE)
    prompt = torch.randint(0, 64, (batch, 4), generator=torch.Generator().manual_seed(batch)).to(DEVICE)
    with torch.no_grad():
        tokens = offloaded.generate(prompt, max_new_tokens=3, do_sample=False)
        assert torch.equal(tokens, model.generate(prompt, max_new_tokens=3, do_sample=False))
