"""The offload runtime on the CPU (Triton interpreter): outputs equal the all-resident kernels'
for any routing, pools never exceed the plan, checkpoints load into pinned host buffers."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moegen import reference as ref
from moegen.ir import lower
from moegen.plan.offload import plan_offload
from moegen.runtime import fused
from moegen.runtime.host_experts import MIXTRAL_KEY, HostExperts
from moegen.offload.engine import engine_for_plan
from moegen.runtime.offload import OffloadedMoE, RouterPredictor, runtime_predictor
from moegen.spec.schema import ModelSpec, OffloadSpec, Spec, TargetSpec, WorkloadSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODEL = dict(hidden_size=40, intermediate_size=24, num_experts=6, top_k=2, num_layers=3, dtype="float32")


def _setup(package_factory, slots: int, prefetch: str = "none", policy: str = "lru"):
    pkg = package_factory(**MODEL)
    expert_bytes = 3 * 40 * 24 * 4
    spec = Spec("offload", ModelSpec(**MODEL), TargetSpec(expert_memory_gib=3 * slots * expert_bytes / 2**30),
                WorkloadSpec((1, 8, 64)), OffloadSpec(policy=policy, prefetch=prefetch))
    plan = plan_offload(lower(spec, "offload.yaml"))
    generator = torch.Generator().manual_seed(0)
    layers = [(torch.randn(6, 48, 40, generator=generator) * 40 ** -0.5, torch.randn(6, 40, 24, generator=generator) * 24 ** -0.5)
              for _ in range(3)]
    return pkg, plan, HostExperts.from_tensors(layers), layers


@pytest.mark.parametrize("slots,predictor,tokens,policy", [
    (2, None, 1, "lru"), (3, None, 1, "lru"), (4, "history", 1, "lru"), (3, "xlayer", 1, "lru"),
    (3, "neighbors", 1, "decayed_lfu"), (4, "router", 1, "lru"), (3, None, 5, "lru"), (2, None, 4, "lru"),
    (4, "neighbors", 3, "neighbor_lfu"), (3, None, 1, "neighbor_lfu"), (3, None, 40, "lru"),
    (4, "history", 40, "decayed_lfu")])
def test_offloaded_output_equals_all_resident(package_factory, slots, predictor, tokens, policy):
    pkg, plan, host, layers = _setup(package_factory, slots, prefetch="none" if predictor is None else "history",
                                     policy=policy)
    assert plan.offloaded and plan.slots_per_layer == (slots,) * 3
    routers = [torch.randn(6, 40) for _ in range(3)]
    engine = engine_for_plan(plan, predictor=runtime_predictor(predictor, plan, routers) if predictor else None)
    runtime = OffloadedMoE(pkg.KERNELS, plan, host, engine, device=DEVICE)
    assert runtime.pool_bytes == 3 * slots * plan.expert_bytes <= plan.budget_bytes
    generator = torch.Generator().manual_seed(slots)
    # Step graphs captured up front (on a GPU) must leave the engine and its tables as they were.
    runtime.capture(torch.randn(tokens, 40).to(DEVICE), torch.rand(tokens, 2).to(DEVICE),
                    torch.zeros(tokens, 2, dtype=torch.int64).to(DEVICE))
    assert runtime.stats.accesses == 0
    for step in range(12):
        for layer in range(3):
            x = torch.randn(tokens, 40, generator=generator).to(DEVICE)
            ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(tokens)]).to(DEVICE)
            weights = torch.rand(tokens, 2, generator=generator).to(DEVICE)
            out = runtime.forward(layer, x, weights, ids)
            assert runtime.pool_bytes <= plan.budget_bytes
            expected = fused.fused_experts(pkg.KERNELS, x, weights, ids, *[w.to(DEVICE) for w in layers[layer]])
            assert ref.relative_error(out, expected) <= 1e-6
    stats = runtime.stats
    assert (len(runtime.graphs) >= 3) if DEVICE == "cuda" else not runtime.graphs  # per layer (and batch shape)
    if tokens == 1:  # a decode step: one access per routed expert
        assert stats.accesses == 12 * 3 * 2
    assert 0 <= stats.hits <= stats.accesses
    if slots < 6:
        assert stats.demand_loads > 0
        assert runtime.stall_s > 0  # the steps waited for their demand copies (GPU: timed by events)


@pytest.mark.parametrize("slots,pinned", [(6, ()), (4, (0, 3))], ids=["whole_layer", "pinned"])
def test_experts_no_policy_evicts_are_copied_in_before_the_first_step(package_factory, slots, pinned):
    """A pool that holds its whole layer is filled, and pinned experts are placed, as the runtime
    starts: their first use is a hit, not a demand load that stalls the first tokens (a budget
    that holds every expert then runs as the all-resident model from its first token)."""
    pkg, plan, host, layers = _setup(package_factory, slots)
    plan = replace(plan, pinned=(pinned,) * 3)
    runtime = OffloadedMoE(pkg.KERNELS, plan, host, engine_for_plan(plan), device=DEVICE)
    generator = torch.Generator().manual_seed(slots)
    ids = torch.tensor([[0, 3]]).to(DEVICE)
    for layer in range(3):
        x = torch.randn(1, 40, generator=generator).to(DEVICE)
        weights = torch.rand(1, 2, generator=generator).to(DEVICE)
        out = runtime.forward(layer, x, weights, ids)
        expected = fused.fused_experts(pkg.KERNELS, x, weights, ids, *[w.to(DEVICE) for w in layers[layer]])
        assert ref.relative_error(out, expected) <= 1e-6
    stats = runtime.stats
    assert stats.accesses == stats.hits == 6 and stats.loads == 0


def test_router_prediction_takes_hidden_states_in_another_dtype_than_its_router():
    """A bf16 model whose routers run in float32 (DeepSeek-V2's spec, router_dtype float32): the
    prediction multiplies in the router's dtype, as the layer's own routing does (it failed with a
    dtype mismatch on the GPU)."""
    routers = [torch.randn(6, 40, generator=torch.Generator().manual_seed(layer)) for layer in range(2)]
    predictor = RouterPredictor(routers, top_k=2, candidates=4)
    hidden = torch.randn(3, 40, generator=torch.Generator().manual_seed(9))
    predictor.stage(1, hidden.to(torch.bfloat16))
    staged = predictor.predict(1, None)
    expected = torch.softmax(hidden.to(torch.bfloat16).float() @ routers[1].T, dim=-1).amax(dim=0).topk(4).indices
    assert [e for e, _ in staged] == expected.tolist()


def test_router_prefetch_brings_experts_in_before_their_layer(package_factory):
    """With a hidden state that changes little between layers (as in a real model), the next
    layer's router predicts its experts: they are prefetched, found resident, and the output
    still equals the all-resident kernels'."""
    pkg, plan, host, layers = _setup(package_factory, 4, prefetch="router")
    generator = torch.Generator().manual_seed(5)
    routers = [torch.randn(6, 40, generator=generator).to(DEVICE) * 3.0 for _ in range(3)]
    engine = engine_for_plan(plan, predictor=runtime_predictor("router", plan, routers), cap_bytes_at_lru=False)
    runtime = OffloadedMoE(pkg.KERNELS, plan, host, engine, device=DEVICE)
    for step in range(10):
        x = torch.randn(1, 40, generator=generator).to(DEVICE)
        for layer in range(3):
            ids = (x @ routers[layer].T).topk(2, dim=-1).indices
            weights = torch.rand(1, 2, generator=generator).to(DEVICE)
            out = runtime.forward(layer, x, weights, ids)
            expected = fused.fused_experts(pkg.KERNELS, x, weights, ids, *[w.to(DEVICE) for w in layers[layer]])
            assert ref.relative_error(out, expected) <= 1e-6
    stats = runtime.stats
    assert stats.prefetch_loads > 0 and stats.prefetch_hits > 0
    assert stats.bytes_moved == (stats.demand_loads + stats.prefetch_loads) * plan.expert_bytes
    # The runtime stages each prediction before the layer's synchronization (so that the copies
    # overlap the layer's kernels); staged or computed on the spot, it is the same.
    predictor = engine.predictor
    on_the_spot = predictor.predict(1, engine.context(x))
    predictor.stage(1, x)
    assert predictor.predict(1, engine.context(None)) == on_the_spot
    predictor.stage(2, x)  # a staged prediction serves only its own layer
    assert predictor.predict(1, engine.context(x)) == on_the_spot and predictor.predict(2, engine.context(None)) == []


@pytest.mark.parametrize("layer,name,spoil,message", [
    (1, "w13", lambda t: t[:, :24], r"w13 of layer 1: expected \[6, 48, 40\] torch.float32, got \[6, 24, 40\]"),
    (2, "w2", lambda t: t.double(), r"w2 of layer 2: expected \[6, 40, 24\] torch.float32, got .* torch.float64"),
])
def test_runtime_rejects_host_experts_that_do_not_fit(package_factory, layer, name, spoil, message):
    pkg, plan, _, layers = _setup(package_factory, 3)
    w13, w2 = layers[layer]
    layers[layer] = (spoil(w13), w2) if name == "w13" else (w13, spoil(w2))
    with pytest.raises(ValueError, match=message):
        OffloadedMoE(pkg.KERNELS, plan, HostExperts.from_tensors(layers), engine_for_plan(plan), device=DEVICE)


BAD_ROUTING = [  # (case, layer, topk_ids, message); 6 experts, top-2, 3 layers, one token
    ("id_past_the_experts", 0, [[0, 6]], r"topk_ids\[0, 1\] = 6: expected an expert id in 0..5 \(layer 0\)"),
    ("negative_id", 1, [[-1, 2]], r"topk_ids\[0, 0\] = -1: expected an expert id in 0..5 \(layer 1\)"),
    ("layer_past_the_plan", 3, [[0, 1]], r"layer 3: expected an index in 0..2"),
    ("negative_layer", -1, [[0, 1]], r"layer -1: expected an index in 0..2"),
    ("ids_wider_than_top_k", 0, [[0, 1, 2]], r"topk_ids: expected shape \[1, 2\], got \[1, 3\]"),
    ("float_ids", 0, [[0.0, 1.0]], r"topk_ids: expected an integer dtype, got torch.float32"),
    ("bool_ids", 0, [[False, True]], r"topk_ids: expected an integer dtype, got torch.bool"),
]


@pytest.mark.parametrize("case,layer,ids,message", BAD_ROUTING, ids=[c[0] for c in BAD_ROUTING])
def test_runtime_rejects_a_routing_it_cannot_run(package_factory, case, layer, ids, message):
    """forward() has the ids on the host anyway (for the cache policy): a wrong one is named there,
    before any copy or launch, and the engine has counted nothing."""
    pkg, plan, host, _ = _setup(package_factory, 3)
    runtime = OffloadedMoE(pkg.KERNELS, plan, host, engine_for_plan(plan), device=DEVICE)
    x, weights, ids = torch.randn(1, 40).to(DEVICE), torch.rand(1, 2).to(DEVICE), torch.tensor(ids).to(DEVICE)
    with pytest.raises(ValueError, match=message):
        runtime.forward(layer, x, weights, ids)
    if "layer" not in case:  # capture() takes the batch a forward() will: refused alike
        with pytest.raises(ValueError, match=message.split(r" \(layer")[0]):
            runtime.capture(x, weights, ids)
    assert runtime.stats.accesses == 0


@pytest.mark.parametrize("rows,width,dtype,message", [
    (3, 40, torch.float32, r"topk_ids: expected shape \[3, 2\], got \[1, 2\]"),  # a row the routing lacks
    (1, 39, torch.float32, r"hidden_states: expected shape \[1, 40\], got \[1, 39\]"),
    (1, 40, torch.float64, r"hidden_states: expected dtype torch.float32, got torch.float64"),
])
def test_runtime_rejects_hidden_states_that_do_not_match(package_factory, rows, width, dtype, message):
    """Checked with the routing, before the engine or a prefetch sees the step (a chunked batch
    would otherwise drop extra rows silently)."""
    pkg, plan, host, _ = _setup(package_factory, 2)
    runtime = OffloadedMoE(pkg.KERNELS, plan, host, engine_for_plan(plan), device=DEVICE)
    x = torch.randn(rows, width, dtype=dtype).to(DEVICE)
    weights, ids = torch.rand(1, 2).to(DEVICE), torch.tensor([[0, 1]]).to(DEVICE)
    with pytest.raises(ValueError, match=message):
        runtime.forward(0, x, weights, ids)
    assert runtime.stats.accesses == 0 and runtime.stats.prefetch_loads == 0


@pytest.mark.parametrize("change,message", [
    (dict(num_experts=8), "the plan routes top-2 of 8 experts, the kernels top-2 of 6"),
    (dict(expert_bytes=3 * 32 * 24 * 4), "the plan's experts take 9216 bytes, the kernels' 11520"),  # H 32, not 40
    (dict(slots_per_layer=(2, 2, 2)), r"the engine caches 6 experts in slots \[3, 3, 3\], the plan 6 in \[2, 2, 2\]"),
])
def test_runtime_rejects_a_plan_or_engine_of_another_shape(package_factory, change, message):
    pkg, plan, host, _ = _setup(package_factory, 3)
    engine = engine_for_plan(plan)
    with pytest.raises(ValueError, match=message):
        OffloadedMoE(pkg.KERNELS, replace(plan, **change), host, engine, device=DEVICE)


def test_host_experts_from_safetensors(tmp_path):
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    tensors, expected = {}, []
    for layer in range(2):
        w13, w2 = torch.randn(3, 8, 5, generator=generator), torch.randn(3, 5, 4, generator=generator)
        expected.append((w13, w2))
        for e in range(3):
            tensors[MIXTRAL_KEY.format(layer=layer, expert=e, proj="w1")] = w13[e, :4].clone()
            tensors[MIXTRAL_KEY.format(layer=layer, expert=e, proj="w3")] = w13[e, 4:].clone()
            tensors[MIXTRAL_KEY.format(layer=layer, expert=e, proj="w2")] = w2[e].clone()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[: len(names) // 2]}, str(tmp_path / "a.safetensors"))
    save_file({k: tensors[k] for k in names[len(names) // 2:]}, str(tmp_path / "b.safetensors"))
    host = HostExperts.from_safetensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], 2, 3, 5, 4,
                                        torch.float32)
    for layer, (w13, w2) in enumerate(expected):
        assert torch.equal(host.w13[layer], w13) and torch.equal(host.w2[layer], w2)
    with pytest.raises(KeyError, match="not found"):
        HostExperts.from_safetensors([tmp_path / "a.safetensors"], 2, 3, 5, 4, torch.float32)
    key = MIXTRAL_KEY.format(layer=1, expert=2, proj="w2")
    save_file({**tensors, key: tensors[key][:1]}, str(tmp_path / "broadcastable.safetensors"))
    with pytest.raises(ValueError, match=rf"{key}: expected shape \[5, 4\], got \[1, 4\]"):
        HostExperts.from_safetensors([tmp_path / "broadcastable.safetensors"], 2, 3, 5, 4, torch.float32)


@pytest.mark.parametrize("quantization", [
    dict(quantization="int4_group", quantization_group_size=32, quantization_zero_point=True),
    dict(quantization="fp8_block")], ids=["int4_group", "fp8_block"])
def test_quantized_experts_offload_their_stored_bytes(package_factory, quantization):
    """The host store and the slot pools hold the quantized storage (weights, scales, zero points);
    every copy moves an expert's slice of each, and the output equals the all-resident kernels' on
    the same storage. The plan counts the stored bytes: the same budget holds more experts."""
    model = dict(MODEL, hidden_size=64, intermediate_size=32, **quantization)
    pkg = package_factory(**model)
    fmt = pkg.KERNELS.weight_format
    spec = Spec("offload", ModelSpec(**model), TargetSpec(expert_memory_gib=3 * 3 * ModelSpec(**model).expert_bytes
                                                                                 / 2**30), WorkloadSpec((1, 8, 64)))
    plan = plan_offload(lower(spec, "offload.yaml"))
    assert plan.expert_bytes == fmt.expert_bytes(64, 32) < 3 * 64 * 32 * 4 // 2 and plan.slots_per_layer == (3,) * 3
    generator = torch.Generator().manual_seed(9)
    layers = [(torch.randn(6, 64, 64, generator=generator) * 64 ** -0.5,
               torch.randn(6, 64, 32, generator=generator) * 32 ** -0.5) for _ in range(3)]
    host = HostExperts.from_tensors(layers).quantized(fmt)
    assert host.expert_bytes == plan.expert_bytes and sorted(host.scales) == sorted(
        ["w13_scale", "w2_scale"] + (["w13_zero", "w2_zero"] if fmt.zero_point else []))
    with pytest.raises(ValueError, match="HostExperts.quantized"):
        OffloadedMoE(pkg.KERNELS, plan, HostExperts.from_tensors(layers), engine_for_plan(plan), device=DEVICE)
    runtime = OffloadedMoE(pkg.KERNELS, plan, host, engine_for_plan(plan), device=DEVICE)
    assert runtime.pool_bytes == 3 * 3 * plan.expert_bytes <= plan.budget_bytes
    for step in range(6):
        for layer in range(3):
            x = torch.randn(2, 64, generator=generator).to(DEVICE)
            ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(2)]).to(DEVICE)
            weights = torch.rand(2, 2, generator=generator).to(DEVICE)
            out = runtime.forward(layer, x, weights, ids)
            stored = {name: parts[layer].to(DEVICE) for name, parts in host.parts.items()}
            expected = fused.fused_experts(pkg.KERNELS, x, weights, ids, stored.pop("w13"), stored.pop("w2"), **stored)
            assert ref.relative_error(out, expected) <= 1e-6
    assert runtime.stats.demand_loads > 0
