"""MoELayer against the Hugging Face transformers modules it stands in for: each model family's
MoE block with random weights; the layer's spec read from the block's config as `moegen spec`
reads a config.json, its state dict loaded as it is (per-expert keys in transformers 4, stacked
experts in transformers 5) and per expert as checkpoint files hold it; the same hidden states
through both.

float32 and float16 everywhere, bfloat16 on a GPU only (the interpreter computes bf16 dots
wrongly). In float16 the router's dtype matters: DeepSeek's routers run in float32, and
logits rounded to float16 would pick other experts near ties."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moegen import reference as ref
from moegen.runtime.hf import BLOCK_CLASSES
from moegen.spec.from_hf import model_fields

transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (pip install -e '.[test]')")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I = 32, 24  # I not a multiple of the kernels' 16-wide tiles


@dataclass(frozen=True)
class Family:
    name: str
    checkpoint_names: tuple[str, str, str]  # gate, up and down per expert in the model's checkpoints
    module: str  # transformers.models.<module>
    config: str
    block: str
    config_fields: dict  # beside the hidden size; the spec comes from the config (`moegen spec`)


LLAMA_NAMES = ("gate_proj", "up_proj", "down_proj")
FAMILIES = [
    Family("mixtral", ("w1", "w3", "w2"), "mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
           dict(intermediate_size=I, num_local_experts=6, num_experts_per_tok=2)),
    Family("qwen3_moe", LLAMA_NAMES, "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
           dict(moe_intermediate_size=I, num_experts=12, num_experts_per_tok=4, norm_topk_prob=True)),
    Family("olmoe", LLAMA_NAMES, "olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock",
           dict(intermediate_size=I, num_experts=10, num_experts_per_tok=3, norm_topk_prob=False)),
    Family("deepseek_v2_lite", LLAMA_NAMES, "deepseek_v2", "DeepseekV2Config", "DeepseekV2Moe",
           dict(moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)),
    Family("deepseek_v2_grouped", LLAMA_NAMES, "deepseek_v2", "DeepseekV2Config", "DeepseekV2Moe",
           dict(moe_intermediate_size=I, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=1,
                topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0,
                norm_topk_prob=False)),
    Family("deepseek_v3", LLAMA_NAMES, "deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
           dict(moe_intermediate_size=I, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
]
BATCHES = [(1, 1), (2, 5), (3, 11)]  # (batch, sequence): one token, a decode batch, beyond the smallest buckets
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LAYOUTS = ["module", "checkpoint"]  # the block's own state dict; per-expert tensors as checkpoint files store them


def _hf_block(family: Family, generator: torch.Generator) -> tuple[torch.nn.Module, dict]:
    """The block with random weights, and the config's values."""
    try:
        models = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
        config_class = getattr(transformers, family.config)
        block_class = getattr(models, family.block)
    except (ImportError, AttributeError):
        pytest.skip(f"transformers {transformers.__version__} has no {family.block}")
    config = config_class(hidden_size=H, hidden_act="silu", **family.config_fields)
    return _randomized(block_class(config).eval(), generator), config.to_dict()


def _randomized(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """Every matrix normal, scaled by its input width (so the experts weigh in a model's output);
    norms as they are; DeepSeek's correction bias small and positive."""
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) * 0.1)
            elif "norm" not in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * tensor.shape[-1] ** -0.5)
    return module


def _per_expert(state_dict: dict, names: tuple[str, str, str]) -> dict:
    """transformers 5's stacked experts split into the per-expert tensors of a checkpoint file
    (transformers 4 modules hold them so already)."""
    if "experts.gate_up_proj" not in state_dict:
        return state_dict
    result = {k: v for k, v in state_dict.items() if not k.startswith("experts.")}
    for e, (gate_up, down) in enumerate(zip(state_dict["experts.gate_up_proj"], state_dict["experts.down_proj"])):
        gate, up = gate_up.chunk(2)
        result |= {f"experts.{e}.{names[0]}.weight": gate, f"experts.{e}.{names[1]}.weight": up,
                   f"experts.{e}.{names[2]}.weight": down}
    return result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", BATCHES, ids=[f"{b}x{s}" for b, s in BATCHES])
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_layer_matches_the_transformers_block(family, batch, layout, dtype, package_factory):
    if dtype == "bfloat16" and DEVICE == "cpu":
        pytest.skip("bf16 needs the GPU: the interpreter computes bf16 dots wrongly (triton-lang/triton#11584)")
    generator = torch.Generator().manual_seed(zlib.crc32(family.name.encode()) + batch[1])
    block, config = _hf_block(family, generator)
    block = block.to(DEVICE, DTYPES[dtype])  # where the layer runs: the same router matmul
    pkg = package_factory(**(model_fields(config) | {"dtype": dtype, "num_layers": 1}))
    layer = pkg.MoELayer(device=DEVICE)
    state_dict = block.state_dict() if layout == "module" else _per_expert(block.state_dict(), family.checkpoint_names)
    layer.load_hf_state_dict({f"mlp.{k}": v for k, v in state_dict.items()}, prefix="mlp.")
    x = torch.randn(*batch, H, generator=generator).to(DEVICE, DTYPES[dtype])
    with torch.no_grad():
        expected = block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected  # transformers 4: (out, logits)
        out = layer(x)
    assert out.shape == x.shape
    assert ref.relative_error(out.double(), expected.double()) <= ref.TOLERANCE[dtype]


needs_transformers_5 = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                          reason="whole models on moegen's layers need transformers 5's blocks")
MODELS = [  # (family, CausalLM class, config class, the config beside the MoE sizes, attention kept tiny)
    ("mixtral", "MixtralForCausalLM", "MixtralConfig",
     dict(intermediate_size=I, num_local_experts=6, num_experts_per_tok=2, num_key_value_heads=2)),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
     dict(intermediate_size=40, moe_intermediate_size=I, num_experts=12, num_experts_per_tok=4, norm_topk_prob=True,
          num_key_value_heads=2, head_dim=8)),
    ("olmoe", "OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=I, num_experts=10, num_experts_per_tok=3)),
    ("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config",
     dict(intermediate_size=40, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
          first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
          v_head_dim=8, num_key_value_heads=4)),
    ("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
     dict(intermediate_size=40, moe_intermediate_size=I, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
          topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
]


LAYERS = 3  # the DeepSeek models' first is dense


def _tiny_model(model_class: str, config_class: str, config_fields: dict):
    """(a float32 causal LM of LAYERS layers with transformers' own initial weights, its config)."""
    config = getattr(transformers, config_class)(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4,
                                                 vocab_size=64, max_position_embeddings=64, **config_fields)
    return getattr(transformers, model_class)(config).eval(), config


def _package_for(config, package_factory, **fields):
    return package_factory(**(model_fields(config.to_dict()) | {"dtype": "float32", "num_layers": 1} | fields))


@needs_transformers_5
@pytest.mark.parametrize("family,model_class,config_class,config_fields", MODELS, ids=[m[0] for m in MODELS])
def test_a_model_with_moegen_blocks_gives_the_same_logits(family, model_class, config_class, config_fields,
                                                          package_factory):
    """moegen.replace_moe_blocks on a whole transformers model: the logits of a prompt and the
    greedy continuation stay the model's own (float32)."""
    import moegen

    model, config = _tiny_model(model_class, config_class, config_fields)
    generator = torch.Generator().manual_seed(zlib.crc32(family.encode()))
    model = _randomized(model, generator).to(DEVICE)
    prompt = torch.randint(0, 64, (2, 7), generator=generator).to(DEVICE)
    with torch.no_grad():
        expected = model(prompt).logits
        expected_tokens = model.generate(prompt, max_new_tokens=4, do_sample=False)
    pkg = _package_for(config, package_factory)
    moe_layers = LAYERS - config_fields.get("first_k_dense_replace", 0)
    assert moegen.replace_moe_blocks(model, pkg) == moe_layers
    assert sum(isinstance(m, pkg.MoELayer) for m in model.modules()) == moe_layers
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert ref.relative_error(logits.double(), expected.double()) <= ref.TOLERANCE["float32"]
    assert torch.equal(tokens, expected_tokens)


def _hf_bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("hf_bench", Path(__file__).parent.parent / "tools" / "hf_bench.py")
    hf_bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hf_bench", hf_bench)  # for its dataclasses
    spec.loader.exec_module(hf_bench)
    return hf_bench


@pytest.mark.parametrize("intervals,busy", [
    ([], 0.0),
    ([(5.0, 7.5)], 2.5),
    ([(0.0, 2.0), (3.0, 4.0)], 3.0),  # the gap between kernels is idle
    ([(0.0, 10.0), (8.0, 12.0)], 12.0),  # a dependent resident through its primary's last wave
    ([(8.0, 12.0), (0.0, 10.0)], 12.0),  # in any order
    ([(0.0, 10.0), (2.0, 3.0), (4.0, 11.0), (11.0, 13.0)], 13.0),  # nested, chained end to start
    ([(1.0, 4.0), (1.0, 2.0)], 3.0),  # the same start
])
def test_benchmark_counts_overlapping_kernels_once(intervals, busy, monkeypatch):
    """hf_bench's kernels-only column: the time the GPU was busy, not the kernels' summed time."""
    assert _hf_bench(monkeypatch).busy_us(intervals) == busy


@needs_transformers_5
@pytest.mark.parametrize("family,model_class,config_class,config_fields", [MODELS[0], MODELS[4]],
                         ids=[MODELS[0][0], MODELS[4][0]])
def test_benchmark_swaps_in_layers_that_share_the_blocks_experts(family, model_class, config_class, config_fields,
                                                                 package_factory, monkeypatch):
    """tools/hf_bench.py times transformers' blocks and moegen's in turns in one model: its
    layers hold the blocks' own expert tensors (nothing copied) and give the model's logits;
    swapped back, the model is transformers' own again. Its clock times every call of both kinds."""
    hf_bench = _hf_bench(monkeypatch)
    model, config = _tiny_model(model_class, config_class, config_fields)
    model = _randomized(model, torch.Generator().manual_seed(zlib.crc32(family.encode()))).to(DEVICE)
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCK_CLASSES]
    pkg = _package_for(config, package_factory)
    with torch.no_grad():
        expected = model(prompt).logits
        clock = hf_bench.BlockClock()
        use_moegen = hf_bench.shared_blocks(model, pkg, clock)
        use_moegen(True)
        layers = [m for m in model.modules() if isinstance(m, pkg.MoELayer)]
        logits = model(prompt).logits
        use_moegen(False)
        again = model(prompt).logits
    assert len(layers) == len(blocks) == LAYERS - config_fields.get("first_k_dense_replace", 0)
    for layer, block in zip(layers, blocks):
        assert layer.w13.data_ptr() == block.experts.gate_up_proj.data_ptr()
        assert layer.w2.data_ptr() == block.experts.down_proj.data_ptr()
    assert ref.relative_error(logits.double(), expected.double()) <= ref.TOLERANCE["float32"]
    assert not any(isinstance(m, pkg.MoELayer) for m in model.modules())
    assert torch.equal(again, expected)
    assert len(clock.seconds) == 2 * len(blocks) and all(t > 0 for t in clock.seconds)


@needs_transformers_5
def test_replace_moe_blocks_refuses_a_package_for_another_model(package_factory):
    import moegen

    model, config = _tiny_model(*MODELS[0][1:])
    model = model.to(DEVICE)
    for package, error, message in (
            (_package_for(config, package_factory, top_k=3), ValueError, r"top_k 3 \(model: 2\)"),
            (_package_for(config, package_factory, dtype="float16"), ValueError,
             r"experts are torch.float32, the package's kernels torch.float16")):
        with pytest.raises(error, match=message):
            moegen.replace_moe_blocks(model, package)
    with pytest.raises(TypeError, match="expected a transformers model, got Linear"):
        moegen.replace_moe_blocks(torch.nn.Linear(2, 2), package)
    assert not any(type(m).__name__ == "MoELayer" for m in model.modules())  # refused before any block moved


@needs_transformers_5
@pytest.mark.parametrize("family,model_class,config_class,config_fields", [MODELS[0], MODELS[4]],
                         ids=[MODELS[0][0], MODELS[4][0]])
def test_torch_compile_traces_the_model_around_moegen_layers(family, model_class, config_class, config_fields,
                                                             package_factory):
    """torch.compile(fullgraph=True) of a model on moegen's layers: each MoE call is one opaque
    operator (moegen::fused_moe), so nothing breaks the graph, and the logits are eager's."""
    import moegen

    torch._dynamo.reset()
    model, config = _tiny_model(model_class, config_class, config_fields)
    model = model.to(DEVICE)
    moegen.replace_moe_blocks(model, _package_for(config, package_factory))
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        eager = model(prompt).logits
        compiled = torch.compile(model, fullgraph=True)(prompt).logits
    assert ref.relative_error(compiled.double(), eager.double()) <= ref.TOLERANCE["float32"]


@needs_transformers_5
@pytest.mark.parametrize("family,model_class,config_class,config_fields", MODELS, ids=[m[0] for m in MODELS])
def test_host_experts_read_a_saved_model(family, model_class, config_class, config_fields, tmp_path):
    """The offload runtime's pinned experts from a model folder as save_pretrained writes it
    (config.json and safetensors shards): every MoE layer's experts, dense layers skipped; for a
    quantized package, quantized as they are read."""
    from moegen.quant.formats import WeightFormat
    from moegen.runtime.host_experts import HostExperts

    model, _ = _tiny_model(model_class, config_class, config_fields)
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCK_CLASSES]
    host = HostExperts.from_hf_checkpoint(tmp_path)
    assert host.num_layers == len(blocks) == LAYERS - config_fields.get("first_k_dense_replace", 0)
    for layer, block in enumerate(blocks):
        assert torch.equal(host.w13[layer], block.experts.gate_up_proj.detach())
        assert torch.equal(host.w2[layer], block.experts.down_proj.detach())
    assert HostExperts.from_hf_checkpoint(tmp_path, num_layers=1).num_layers == 1
    # A quantized package's experts, quantized one by one as they are read: the same bytes as
    # quantizing the whole unquantized store.
    fmt = WeightFormat("int4_group", 32, True, "float32")
    read_quantized, quantized_after = HostExperts.from_hf_checkpoint(tmp_path, fmt=fmt), host.quantized(fmt)
    assert sorted(read_quantized.parts) == sorted(quantized_after.parts)
    assert all(torch.equal(a, b) for name in read_quantized.parts
               for a, b in zip(read_quantized.parts[name], quantized_after.parts[name]))
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tmp_path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files beside config.json"):
        HostExperts.from_hf_checkpoint(config_only)
