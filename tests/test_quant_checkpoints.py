"""The loaders of quantized checkpoints' layouts (moegen/quant/checkpoint.py), against tensors
packed here by hand from each layout's published description (AutoAWQ's GEMM packing, AutoGPTQ's,
compressed-tensors' pack-quantized, DeepSeek-V3's fp8 blocks): never through moegen's own
quantizer or packer. Each checks the dequantized weights, then a MoELayer loaded from a whole
checkpoint against the float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moegen import reference as ref
from moegen.quant.checkpoint import AWQ_ORDER, CheckpointError, repack
from moegen.quant.formats import WeightFormat
from moegen.quant.quantize import dequantize

N, K, GROUP = 64, 96, 32  # outputs, inputs, inputs per group


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """int32 words of eight 4-bit values along the last axis, the first value in the lowest bits."""
    words = np.zeros(nibbles.shape[:-1] + (nibbles.shape[-1] // 8,), dtype=np.uint64)
    for i in range(8):
        words |= nibbles[..., i::8].astype(np.uint64) << np.uint64(4 * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _case(seed: int):
    """Values q [N, K] and zero points [N, K/G] in 0..15, scales [N, K/G], and the weights they stand for."""
    g = np.random.default_rng(seed)
    q = g.integers(0, 16, size=(N, K))
    zero = g.integers(0, 16, size=(N, K // GROUP))
    scale = torch.from_numpy(g.uniform(0.01, 0.05, size=(N, K // GROUP))).to(torch.float16)
    groups = np.arange(K) // GROUP
    weight = (torch.from_numpy(q - zero[:, groups]).double() * scale.double()[:, groups])
    return q, zero, scale, weight


def _awq(q, zero, scale) -> dict:
    # AutoAWQ: the weight transposed to [K, N]; word c of a row packs outputs c*8 + AWQ_ORDER[i] in nibble i.
    order = [c * 8 + AWQ_ORDER[i] for c in range(N // 8) for i in range(8)]
    return {"qweight": _words(q.T[:, order]), "qzeros": _words(zero.T[:, order]), "scales": scale.T.contiguous()}


def _gptq(q, zero, scale, g_idx=None) -> dict:
    # AutoGPTQ: qweight [K/8, N] packs eight consecutive inputs a word; qzeros [K/G, N/8] eight
    # consecutive outputs, each stored one less.
    qweight = _words(q.T.reshape(K // 8, 8, N).transpose(0, 2, 1)).reshape(K // 8, N)
    tensors = {"qweight": qweight, "qzeros": _words((zero.T - 1) % 16), "scales": scale.T.contiguous(),
               "g_idx": torch.arange(K, dtype=torch.int32) // GROUP if g_idx is None else g_idx}
    return tensors


def _compressed(q, zero, scale, symmetric: bool) -> dict:
    # compressed-tensors pack-quantized: signed values stored plus 8, eight consecutive inputs a word;
    # asymmetric zero points likewise, eight consecutive outputs a word.
    tensors = {"weight_packed": _words(q), "weight_scale": scale, "weight_shape": torch.tensor([N, K])}
    if not symmetric:
        tensors["weight_zero_point"] = _words(zero.T).T.contiguous()
    return tensors


@pytest.mark.parametrize("layout", ["awq", "gptq", "compressed-tensors", "compressed-tensors-symmetric"])
def test_int4_layouts_repack_to_the_same_weights(layout):
    q, zero, scale, weight = _case(1)
    symmetric = layout.endswith("symmetric")
    if symmetric:
        zero[:] = 8
        weight = torch.from_numpy(q - 8).double() * scale.double()[:, np.arange(K) // GROUP]
    method = layout.removesuffix("-symmetric")
    tensors = {"awq": _awq, "gptq": _gptq}.get(method, lambda *a: _compressed(*a, symmetric))(q, zero, scale)
    fmt = WeightFormat("int4_group", GROUP, not symmetric, "float16")
    stored = repack(tensors, method, fmt, N, K, "experts.0.gate_proj")
    got = dequantize({name: value[None] for name, value in stored.items()}, fmt, N, K)[0]
    assert torch.equal(got, weight)


def test_fp8_blocks_repack_as_stored():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 300, generator=g).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=g) + 0.5  # one per 128 x 128 block, multiplied in
    fmt = WeightFormat("fp8_block", dtype="bfloat16")
    stored = repack({"weight": weight, "weight_scale_inv": scale_inv}, "fp8", fmt, 200, 300, "w")
    got = dequantize({name: value[None] for name, value in stored.items()}, fmt, 200, 300)[0]
    rows, cols = torch.arange(200) // 128, torch.arange(300) // 128
    assert torch.equal(got, weight.double() * scale_inv.double()[rows][:, cols])


@pytest.mark.parametrize("tensors, fmt, needle", [
    (lambda c: _awq(*c[:3]), WeightFormat("int4_group", 64, True, "float16"),
     "experts.0.gate_proj.qzeros: shape [3, 8], expected [2, 8] (AWQ's GEMM layout, groups of 64"),
    (lambda c: {k: v for k, v in _awq(*c[:3]).items() if k != "scales"}, WeightFormat("int4_group", 32, True, "float16"),
     "experts.0.gate_proj.scales: missing"),
    (lambda c: _gptq(*c[:3], g_idx=torch.arange(K, dtype=torch.int32).flip(0) // GROUP),
     WeightFormat("int4_group", 32, True, "float16"), "g_idx: inputs out of order (act-order"),
    (lambda c: _gptq(*c[:3]), WeightFormat("int4_group", 32, False, "float16"),
     "zero points other than 8, but the spec's quantization_zero_point is false"),
    (lambda c: _awq(*c[:3]), WeightFormat("fp8_block", dtype="float16"),
     "a awq checkpoint, but the spec's quantization is fp8_block"),
])
def test_a_layout_that_does_not_fit_the_spec_is_refused_by_name(tensors, fmt, needle):
    method = "gptq" if "g_idx" in tensors(_case(3)) else "awq"
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        repack(tensors(_case(3)), method, fmt, N, K, "experts.0.gate_proj")


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_moe_layer_loads_a_quantized_checkpoint(method, package_factory):
    """A whole block's checkpoint (router, every expert's three projections in the layout) into
    MoELayer, told the layout or inferring it; the layer's output against the float64 reference
    of the weights the tensors stand for."""
    pkg = package_factory(buckets=(1, 8), hidden_size=K, intermediate_size=N, num_experts=4, top_k=2,
                          dtype="float32", router_dtype="float32", quantization="int4_group",
                          quantization_group_size=GROUP, quantization_zero_point=True)
    pack = {"awq": _awq, "gptq": _gptq, "compressed-tensors": lambda *c: _compressed(*c, False)}[method]
    checkpoint = {"gate.weight": torch.randn(4, K)}
    w13, w2 = torch.zeros(4, 2 * N, K, dtype=torch.float64), torch.zeros(4, K, N, dtype=torch.float64)
    for e in range(4):
        for proj, rows in (("gate_proj", slice(0, N)), ("up_proj", slice(N, 2 * N))):
            q, zero, scale, weight = _case(10 * e + len(proj))
            checkpoint |= {f"experts.{e}.{proj}.{k}": v for k, v in pack(q, zero, scale).items()}
            w13[e, rows] = weight
        # down: [K outputs, N inputs]; the hand-made case is [N, K], so draw it for the down shape
        g = np.random.default_rng(100 + e)
        q, zero = g.integers(0, 16, size=(K, N)), g.integers(0, 16, size=(K, N // GROUP))
        scale = torch.from_numpy(g.uniform(0.01, 0.05, size=(K, N // GROUP))).to(torch.float16)
        w2[e] = torch.from_numpy(q - zero[:, np.arange(N) // GROUP]).double() * scale.double()[:, np.arange(N) // GROUP]
        down = {"awq": lambda: _down_awq(q, zero, scale), "gptq": lambda: _down_gptq(q, zero, scale),
                "compressed-tensors": lambda: _down_compressed(q, zero, scale)}[method]()
        checkpoint |= {f"experts.{e}.down_proj.{k}": v for k, v in down.items()}
    layer = pkg.MoELayer()
    layer.load_hf_state_dict(checkpoint, quant_method=method if method != "awq" else None)
    x = torch.randn(6, K)
    logits = x @ checkpoint["gate.weight"].T
    expected = ref.moe_reference(x, logits, w13, w2, pkg.KERNELS.routing)
    assert ref.relative_error(layer(x), expected) < 1e-5


# The down projection's shape [K outputs, N inputs] swaps the two sizes of the hand-made cases.
def _down_awq(q, zero, scale):
    order = [c * 8 + AWQ_ORDER[i] for c in range(K // 8) for i in range(8)]
    return {"qweight": _words(q.T[:, order]), "qzeros": _words(zero.T[:, order]), "scales": scale.T.contiguous()}


def _down_gptq(q, zero, scale):
    qweight = _words(q.T.reshape(N // 8, 8, K).transpose(0, 2, 1)).reshape(N // 8, K)
    return {"qweight": qweight, "qzeros": _words((zero.T - 1) % 16), "scales": scale.T.contiguous(),
            "g_idx": torch.arange(N, dtype=torch.int32) // GROUP}


def _down_compressed(q, zero, scale):
    return {"weight_packed": _words(q), "weight_scale": scale, "weight_shape": torch.tensor([K, N]),
            "weight_zero_point": _words(zero.T).T.contiguous()}


def test_moe_layer_loads_an_fp8_block_checkpoint(package_factory):
    """DeepSeek-V3's layout: each projection's float8 weight and its per-block weight_scale_inv;
    I = 160 makes the up projection's blocks start mid-way through a 128-row block of w13."""
    h, i, e = 200, 160, 3
    pkg = package_factory(buckets=(1, 8), hidden_size=h, intermediate_size=i, num_experts=e, top_k=2,
                          dtype="float32", router_dtype="float32", quantization="fp8_block")
    g = torch.Generator().manual_seed(5)
    checkpoint = {"gate.weight": torch.randn(e, h, generator=g)}
    w13, w2 = torch.zeros(e, 2 * i, h, dtype=torch.float64), torch.zeros(e, h, i, dtype=torch.float64)
    for expert in range(e):
        for proj, n, k, dest in (("gate_proj", i, h, lambda w: w13[expert, :i].copy_(w)),
                                 ("up_proj", i, h, lambda w: w13[expert, i:].copy_(w)),
                                 ("down_proj", h, i, lambda w: w2[expert].copy_(w))):
            weight = (torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
            scale_inv = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.1
            checkpoint |= {f"experts.{expert}.{proj}.weight": weight,
                           f"experts.{expert}.{proj}.weight_scale_inv": scale_inv}
            dest(weight.double() * scale_inv.double()[torch.arange(n) // 128][:, torch.arange(k) // 128])
    layer = pkg.MoELayer()
    layer.load_hf_state_dict(checkpoint)  # the layout told by the tensors
    x = torch.randn(5, h, generator=g)
    logits = x @ checkpoint["gate.weight"].T
    from moegen.quant.quantize import quantize_activations

    fmt = pkg.KERNELS.weight_format
    weights, ids, _ = ref.route_reference(logits, pkg.KERNELS.routing)
    expected = torch.zeros(5, h, dtype=torch.float64)
    for t in range(5):  # w8a8: the activations quantized as the kernels quantize them
        for j in range(2):
            ex = int(ids[t, j])
            g13 = quantize_activations(x[t:t + 1], fmt) @ w13[ex].T
            mid = (ref.activation_ref(g13[:, :i], "silu") * g13[:, i:]).to(torch.float32)
            expected[t] += weights[t, j] * (quantize_activations(mid, fmt) @ w2[ex].T)[0]
    assert ref.relative_error(layer(x), expected) < 1e-5


transformers = pytest.importorskip("transformers", reason="the checkpoint round trips need transformers (pip install -e '.[test]')")


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="needs transformers 5's MoE blocks")
@pytest.mark.parametrize("fields, args", [
    (dict(quantization="int4_group", quantization_group_size=32, quantization_zero_point=True),
     ["--format", "int4_group", "--group-size", "32", "--zero-point"]),
    (dict(quantization="fp8_block"), ["--format", "fp8_block"]),
    (dict(quantization="fp8_channel"), ["--format", "fp8_channel"]),
], ids=["int4_group", "fp8_block", "fp8_channel"])
def test_moegen_quantize_writes_a_checkpoint_moegen_spec_and_the_loaders_read(fields, args, tmp_path):
    """A transformers Mixtral saved in shards, `moegen quantize`d: `moegen spec` reads the format
    from its quantization_config, and each layer loads its experts from the quantized shards,
    equal to the quantizer's output on the original weights."""
    from safetensors import safe_open

    from moegen import cli, load
    from moegen.quant.quantize import quantize, quantize_w13

    config = transformers.MixtralConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=64, max_position_embeddings=64,
                                        dtype="float32")
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "model", max_shard_size="200KB")
    assert cli.main(["quantize", str(tmp_path / "model"), *args, "-o", str(tmp_path / "quantized")]) == 0
    assert cli.main(["quantize", str(tmp_path / "model"), *args, "-o", str(tmp_path / "quantized")]) == 2  # never over
    assert cli.main(["spec", str(tmp_path / "quantized"), "--name", "mq", "-o", str(tmp_path / "mq.yaml")]) == 0
    assert cli.main(["build", str(tmp_path / "mq.yaml"), "-o", str(tmp_path / "out")]) == 0
    pkg = load(tmp_path / "out" / "mq")
    assert pkg.SPEC.model.quantization == fields["quantization"]
    tensors = {}
    for shard in sorted((tmp_path / "quantized").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}
    fmt = pkg.KERNELS.weight_format
    for index, block in enumerate(m for m in model.modules() if type(m).__name__ == "MixtralSparseMoeBlock"):
        prefix = f"model.layers.{index}.mlp."
        if not any(key.startswith(prefix) for key in tensors):
            prefix = f"model.layers.{index}.block_sparse_moe."
        layer = pkg.MoELayer()
        layer.load_hf_state_dict({k: v for k, v in tensors.items() if k.startswith(prefix)}, prefix=prefix)
        expected13, expected2 = quantize_w13(block.experts.gate_up_proj.detach(), fmt), quantize(
            block.experts.down_proj.detach(), fmt)
        assert torch.equal(layer.w13, expected13["weight"]) and torch.equal(layer.w13_scale, expected13["scale"])
        assert torch.equal(layer.w2, expected2["weight"]) and torch.equal(layer.w2_scale, expected2["scale"])


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="needs transformers 5's MoE blocks")
def test_a_quantized_package_takes_an_unquantized_models_blocks(package_factory):
    """replace_moe_blocks with an int4 package: each block's experts quantized as they load."""
    import moegen
    from moegen.quant.quantize import quantize_w13

    config = transformers.MixtralConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=64, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(config).eval()
    pkg = package_factory(buckets=(1, 8), hidden_size=128, intermediate_size=64, num_experts=4, top_k=2,
                          dtype="float32", quantization="int4_group", quantization_group_size=32)
    experts = [m.experts.gate_up_proj.detach().clone() for m in model.modules()
               if type(m).__name__ == "MixtralSparseMoeBlock"]
    tokens = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        before = model(tokens).logits
        assert moegen.replace_moe_blocks(model, pkg) == 2
        after = model(tokens).logits
    layers = [m for m in model.modules() if isinstance(m, pkg.MoELayer)]
    for layer, w13 in zip(layers, experts):
        assert torch.equal(layer.w13, quantize_w13(w13, pkg.KERNELS.weight_format)["weight"])
    assert bool(torch.isfinite(after).all()) and ref.relative_error(after, before) < 0.2
