"""A Hugging Face checkpoint whose experts exceed the GPU, ready for `generate`: every weight but
the routed experts on the GPU, the experts in pinned host memory, each MoE block replaced by a
layer that routes on the GPU and runs its experts through the offload runtime's slot pools.

    model = moegen.load_offloaded("path/to/Mixtral-8x7B", package, expert_memory_gib=20)
    model.generate(...)

The model is built by transformers on the meta device (no memory), then filled shard by shard
straight from the safetensors files: non-expert tensors to the GPU, experts into their pinned
host buffers (moegen.runtime.host_experts, through the files' memory maps). Peak host memory is
about the experts' bytes; nothing beyond the plan's slots of experts reaches the GPU.
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from moegen.ir import lower
from moegen.plan.offload import OffloadPlan, plan_offload
from moegen.quant.checkpoint import dequantize_linear, infer_method
from moegen.quant.formats import WeightFormat
from moegen.runtime.host_experts import HostExperts
from moegen.runtime.layer import Router, shared_experts_output
from moegen.runtime.offload import OffloadedMoE
from moegen.runtime.routing import route

ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # a routed expert's module in a per-expert checkpoint


class OffloadedMoELayer(torch.nn.Module):
    """One MoE block of an offloaded model: its router (and shared experts) on the GPU, its
    routed experts in the offload runtime's layer `layer`."""

    runtime: Optional[OffloadedMoE] = None  # set once every layer's router has loaded

    def __init__(self, layer: int, package, device):
        super().__init__()
        spec = package.SPEC
        m = spec.model
        self.layer, self.spec, self.kernels = layer, spec, package.KERNELS
        dtype = package.KERNELS.dtype
        self.gate = Router(m.hidden_size, m.num_experts, getattr(torch, m.router_dtype) if m.router_dtype else dtype,
                           device)
        self.correction_bias = (torch.nn.Parameter(torch.zeros(m.num_experts, device=device), requires_grad=False)
                                if m.correction_bias else None)
        shared = m.num_shared_experts * m.shared_intermediate_size
        self.shared_w13 = (torch.nn.Parameter(torch.empty(2 * shared, m.hidden_size, device=device, dtype=dtype),
                                              requires_grad=False) if shared else None)
        self.shared_w2 = (torch.nn.Parameter(torch.empty(m.hidden_size, shared, device=device, dtype=dtype),
                                             requires_grad=False) if shared else None)

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """The block's checkpoint names (below its prefix) -> the tensors they fill."""
        targets = {"gate.weight": self.gate.weight}
        if self.correction_bias is not None:
            targets["gate.e_score_correction_bias"] = self.correction_bias
        if self.shared_w13 is not None:
            half = self.shared_w13.shape[0] // 2
            targets.update({"shared_experts.gate_proj.weight": self.shared_w13[:half],
                            "shared_experts.up_proj.weight": self.shared_w13[half:],
                            "shared_experts.down_proj.weight": self.shared_w2})
        return targets

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = route(self.gate(x), self.kernels.routing, self.correction_bias)
        out = self.runtime.forward(self.layer, x, weights, ids)
        if self.shared_w13 is not None:
            out = out + shared_experts_output(x, self.shared_w13, self.shared_w2, self.spec.model.activation)
        return out.view(shape)


def offload_plan_for(package, num_layers: int, expert_memory_gib: Optional[float] = None,
                     policy: Optional[str] = None, prefetch: Optional[str] = None) -> OffloadPlan:
    """The package's offload plan for a model of `num_layers` MoE layers, the budget, policy and
    prefetch mode the spec's unless given (moegen.errors.SpecError where the budget cannot hold
    one token's experts in every layer)."""
    spec = package.SPEC
    target = spec.target if expert_memory_gib is None else replace(spec.target, expert_memory_gib=expert_memory_gib)
    offload = replace(spec.offload, **{k: v for k, v in (("policy", policy), ("prefetch", prefetch)) if v is not None})
    spec = replace(spec, model=replace(spec.model, num_layers=num_layers), target=target, offload=offload)
    return plan_offload(lower(spec, f"{spec.name} (offloaded)"))


def load_offloaded(folder, package, *, expert_memory_gib: Optional[float] = None, policy: Optional[str] = None,
                   prefetch: Optional[str] = None, device="cuda", cap_prefetch_at_lru: bool = False):
    """The causal LM of a Hugging Face model folder (config.json and *.safetensors shards of
    unquantized weights) with its routed experts offloaded to pinned host memory under the
    package's plan; `model.moegen_offload` is the OffloadedMoE (stats, stall_s). The budget,
    policy and prefetch mode are the spec's unless given; prefetches may move more bytes than
    LRU's demand loads would (the link idles otherwise) unless cap_prefetch_at_lru."""
    import transformers

    from moegen.runtime.hf import moe_block_slots, require_package_for
    from moegen.spec.from_hf import moe_layer_ids, read_config

    folder = Path(folder)
    values, source = read_config(folder)
    fmt = package.KERNELS.weight_format
    quantized_checkpoint = bool(values.get("quantization_config"))
    if quantized_checkpoint and not fmt.quantized:
        raise ValueError(f"{source}: a quantized checkpoint ({values['quantization_config'].get('quant_method')}), "
                         f"and this package's experts are unquantized: build the spec `moegen spec {folder}` writes "
                         "(it carries the checkpoint's quantization)")
    config = transformers.AutoConfig.from_pretrained(folder)
    config.__dict__.pop("quantization_config", None)  # moegen reads the quantized tensors, not transformers
    dtype = package.KERNELS.dtype
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    require_package_for(model, package, source)
    layer_ids = moe_layer_ids(values, source)
    slots = moe_block_slots(model)
    if len(slots) != len(layer_ids):
        raise ValueError(f"{type(model).__name__} has {len(slots)} MoE blocks, {source} names {len(layer_ids)}")

    plan = offload_plan_for(package, len(layer_ids), expert_memory_gib, policy, prefetch)
    device = torch.device(device)
    block_prefix = "block_sparse_moe" if values["model_type"] == "mixtral" else "mlp"
    layers = {}
    for index, ((parent, child), layer_id) in enumerate(zip(slots, layer_ids)):
        layer = OffloadedMoELayer(index, package, device)
        setattr(parent, child, layer)
        layers[f"model.layers.{layer_id}.{block_prefix}."] = layer
    _load_non_experts(model, folder, layers, device, fmt if quantized_checkpoint else None)

    if quantized_checkpoint:
        host = HostExperts.from_quantized_checkpoint(folder, fmt)
    else:  # a quantized package's experts quantized one by one as they are read
        host = HostExperts.from_hf_checkpoint(folder, fmt=fmt)
    return _attach_runtime(model, package, plan, host, list(layers.values()), device, cap_prefetch_at_lru)


def offload_model(model: torch.nn.Module, package, *, expert_memory_gib: Optional[float] = None,
                  policy: Optional[str] = None, prefetch: Optional[str] = None, device="cuda",
                  cap_prefetch_at_lru: bool = False):
    """A transformers 5 model already built in host memory, offloaded as load_offloaded offloads a
    checkpoint: each MoE block's experts into pinned host memory (block by block, each block
    freed as its layer takes its place), the rest of the model to `device`. Returns the model."""
    from moegen.runtime.hf import BLOCK_CLASSES, moe_block_slots, require_package_for

    require_package_for(model, package)
    slots = moe_block_slots(model)
    if not slots:
        raise ValueError(f"{type(model).__name__} has no MoE block moegen knows ({', '.join(BLOCK_CLASSES)})")
    plan = offload_plan_for(package, len(slots), expert_memory_gib, policy, prefetch)
    device = torch.device(device)
    fmt = package.KERNELS.weight_format
    layers, stores = [], []
    for index, (parent, child) in enumerate(slots):
        block = getattr(parent, child)
        if block.experts.gate_up_proj.is_meta:
            raise ValueError(f"{type(model).__name__} is on the meta device (no weights): load it from its checkpoint "
                             "folder with moegen.load_offloaded")
        experts = (block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
        # Pinned as they are, or quantized straight into pinned buffers (no pinned copy of the
        # unquantized experts on the way).
        store = HostExperts((experts[0],), (experts[1],)).quantized(fmt) if fmt.quantized else \
            HostExperts.from_tensors([experts])
        stores.append({name: parts[0] for name, parts in store.parts.items()})
        layer = OffloadedMoELayer(index, package, device)
        state = block.state_dict()
        with torch.no_grad():
            for name, target in layer.checkpoint_targets().items():
                target.copy_(state[name])
        setattr(parent, child, layer)
        layers.append(layer)
        del block, state
    model.to(device)
    return _attach_runtime(model, package, plan, HostExperts.of_layers(stores), layers, device, cap_prefetch_at_lru)


def _attach_runtime(model, package, plan: OffloadPlan, host: HostExperts, layers: list, device,
                    cap_prefetch_at_lru: bool):
    runtime = OffloadedMoE.from_plan(package.KERNELS, plan, host, device=device,
                                     routers=[layer.gate.weight for layer in layers],
                                     cap_bytes_at_lru=cap_prefetch_at_lru)
    for layer in layers:
        layer.runtime = runtime
    model.moegen_offload = runtime
    return model.eval()


def _load_non_experts(model: torch.nn.Module, folder: Path, layers: dict, device: torch.device,
                      quantized: Optional[WeightFormat] = None) -> None:
    """Every tensor of the shards but the routed experts into the model: the MoE blocks' into
    their OffloadedMoELayer, the rest into the model's own (meta) parameters, on `device`.
    Tensors the model does not have (an MTP head, a tied lm_head) are passed over. In a quantized
    checkpoint (its format `quantized`), the other linear layers stored quantized (attention,
    shared experts) are dequantized as they load."""
    from safetensors import safe_open

    own = dict(model.named_parameters(remove_duplicate=False))
    targets = {prefix: layer.checkpoint_targets() for prefix, layer in layers.items()}
    files = sorted(folder.glob("*.safetensors"))

    def destination(key: str, path: Path):
        """The tensor `key` (of the shard `path`) fills, or None: passed over."""
        prefix = next((p for p in targets if key.startswith(p)), None)
        if prefix is None:
            return own[key] if key in own and own[key].is_meta else None
        rest = key[len(prefix):]
        if rest.startswith("experts."):
            return None  # the host store has them
        target = targets[prefix].get(rest)
        if target is None:
            raise ValueError(f"{path}: {key}: a tensor of a MoE block that moegen's layer does not hold")
        return target

    def put(key: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
        if target.is_meta:
            _assign(model, key, tensor.to(device=device, dtype=target.dtype))
        else:
            with torch.no_grad():
                target.copy_(tensor)

    linears = _quantized_linears(files) if quantized is not None else {}
    pending: dict[str, dict] = {}  # a quantized linear's tensors read so far
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for key in shard.keys():
                module, _, suffix = key.rpartition(".")
                if suffix in linears.get(module, ()):
                    target = destination(module + ".weight", path)
                    if target is not None:
                        parts = pending.setdefault(module, {})
                        parts[suffix] = shard.get_tensor(key)
                        if len(parts) == len(linears[module]):
                            put(module + ".weight", dequantize_linear(pending.pop(module), quantized,
                                                                      *target.shape, f"{path}: {module}"), target)
                    continue
                target = destination(key, path)
                if target is not None:
                    put(key, shard.get_tensor(key), target)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    _rebuild_meta_buffers(model, device)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{folder}: the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")


def _quantized_linears(files) -> dict[str, set]:
    """The modules of the shards stored in a quantized layout, but the routed experts: module ->
    the suffixes of its weight's tensors (a bias loads as it is)."""
    from safetensors import safe_open

    modules: dict[str, set] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as shard:
            for key in shard.keys():
                module, _, suffix = key.rpartition(".")
                if suffix != "bias":
                    modules.setdefault(module, set()).add(suffix)
    return {module: suffixes for module, suffixes in modules.items()
            if infer_method(suffixes) is not None and not ROUTED_EXPERT.search(module + ".")}


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, torch.nn.Parameter(tensor, requires_grad=False))


def _rebuild_meta_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers no checkpoint holds (rotary frequencies) were made on the meta device: each module
    that has one is made again from the model's config, on `device`."""
    for name, module in list(model.named_modules()):
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            if not name or not hasattr(module, "config"):
                raise ValueError(f"{type(module).__name__} ({name or 'the model'}) has buffers no checkpoint holds "
                                 "and no config to make them from")
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, type(module)(module.config).to(device))
