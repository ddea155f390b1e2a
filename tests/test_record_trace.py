"""moegen.record_trace: a transformers model's routing recorded while it generates, written as a
moegen-trace file that load_trace, `moegen plan --trace` and `moegen simulate` read."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import moegen
from moegen.offload.trace import load_trace, save_trace
from moegen.spec.from_hf import model_fields
from test_hf_parity import MODELS, _randomized, _tiny_model, needs_transformers_5

PROMPT, NEW = 5, 3  # tokens per prompt; generated tokens (the last is never fed back)


def _package(config, package_factory):
    return package_factory(**(model_fields(config.to_dict()) | {"dtype": "float32", "num_layers": 1}))


def _router_picks(model) -> list:
    """transformers' own picks: every router returns (logits, weights, indices)."""
    picks = []
    for module in model.modules():
        if type(module).__name__.endswith(("SparseMoeBlock", "Moe", "MoE")) and hasattr(module, "gate"):
            module.gate.register_forward_hook(lambda gate, args, out: picks.append(out[2].cpu()))
    return picks


@needs_transformers_5
@pytest.mark.parametrize("family,model_class,config_class,config_fields", MODELS, ids=[m[0] for m in MODELS])
def test_a_recorded_trace_holds_the_model_s_own_picks(family, model_class, config_class, config_fields,
                                                      package_factory, tmp_path):
    model, config = _tiny_model(model_class, config_class, config_fields)
    model = _randomized(model, torch.Generator().manual_seed(zlib.crc32(family.encode())))
    pkg = _package(config, package_factory)
    own = _router_picks(model)
    prompts = torch.randint(0, 64, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    with moegen.record_trace(model, pkg) as recorder, torch.no_grad():
        model.generate(prompts, max_new_tokens=NEW, do_sample=False)
        model.generate(prompts[:1, :3], max_new_tokens=2, do_sample=False)  # a third sequence, alone
    trace = load_trace(recorder.save(tmp_path / f"{family}.jsonl.gz", note="test"))

    layers = len(recorder.blocks)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (layers, pkg.SPEC.model.num_experts,
                                                                   pkg.SPEC.model.top_k)
    lengths = [PROMPT + NEW - 1] * 2 + [3 + 2 - 1]
    assert trace.seq.tolist() == [s for s, n in enumerate(lengths) for _ in range(n)]
    # transformers' picks, forward by forward and layer by layer, put in the trace's token order.
    forwards = [own[i:i + layers] for i in range(0, len(own), layers)]
    rows = {0: [], 1: [], 2: []}
    for number, step in enumerate(forwards):
        ids = torch.stack(step, dim=1)  # [rows * tokens, layers, k]
        batch = 1 if number >= NEW else 2
        for row in range(batch):
            rows[row + (2 if number >= NEW else 0)].append(ids.reshape(batch, -1, layers, ids.shape[-1])[row])
    expected = torch.cat([torch.cat(rows[s]) for s in range(3)]).numpy()
    assert np.array_equal(np.sort(trace.experts, axis=2), np.sort(expected, axis=2))


def test_the_recorder_leaves_the_model_as_it_was(package_factory):
    model, config = _tiny_model(*MODELS[0][1:])
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    with moegen.record_trace(model, _package(config, package_factory)):
        assert sum(len(m._forward_pre_hooks) for m in model.modules()) > hooks
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks


def test_recording_nothing_or_a_model_without_moe_blocks_says_so(package_factory, tmp_path):
    model, config = _tiny_model(*MODELS[0][1:])
    pkg = _package(config, package_factory)
    with pytest.raises(ValueError, match="no tokens recorded"), moegen.record_trace(model, pkg) as recorder:
        recorder.save(tmp_path / "empty.jsonl.gz")
    with pytest.raises(ValueError, match="has no MoE block to record"):
        moegen.record_trace(torch.nn.Linear(4, 4), pkg)
    assert not (tmp_path / "empty.jsonl.gz").exists()


def test_save_trace_round_trips_through_load_trace(tmp_path):
    experts = np.array([[[0, 3], [2, 1]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]])
    path = save_trace(tmp_path / "t.jsonl.gz", experts, [0, 0, 1], model="m", num_experts=4, source="s",
                      weights=np.full(experts.shape, 0.5))
    trace = load_trace(path)
    assert np.array_equal(trace.experts, experts) and trace.seq.tolist() == [0, 0, 1]
    assert (trace.model, trace.source, trace.num_experts) == ("m", "s", 4)
    assert not list(tmp_path.glob("*.partial"))
