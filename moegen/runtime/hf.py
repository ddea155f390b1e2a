"""A generated package's MoELayer in place of the MoE blocks of a Hugging Face transformers model."""
from __future__ import annotations

import torch

from moegen.spec.from_hf import model_fields

# transformers 5's MoE blocks of the families `moegen spec` reads: each takes and returns the
# hidden states, as MoELayer does.
BLOCK_CLASSES = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "DeepseekV2Moe",
                 "DeepseekV3MoE")


def _spec_differences(model: torch.nn.Module, spec) -> list[str]:
    """The model fields where the package's spec and the model's config disagree (the layer
    count, dtype and weight format aside: a package serves any number of layers, the weights'
    dtype is checked per block, and a quantized package quantizes the blocks' experts)."""
    wanted = model_fields(model.config.to_dict(), f"{type(model).__name__}.config")
    # The experts' format is the package's to choose: a layer quantizes unquantized experts as it loads.
    ignored = ("num_layers", "dtype", "quantization", "quantization_group_size", "quantization_zero_point")
    return [f"{name} {getattr(spec, name)} (model: {value})" for name, value in wanted.items()
            if name not in ignored and getattr(spec, name) != value]


def require_package_for(model: torch.nn.Module, package, config_source: str = "the model's config.json") -> None:
    """ValueError unless the package was built for the model's config (layer count, dtype and
    weight format aside, as _spec_differences says)."""
    differences = _spec_differences(model, package.SPEC.model)
    if differences:
        raise ValueError(f"package {package.SPEC.name} was built for another model: {'; '.join(differences)}; "
                         f"build a spec from {config_source} (moegen spec)")


def replace_moe_blocks(model: torch.nn.Module, package) -> int:
    """Swap every MoE block of `model` for `package.MoELayer` holding the block's weights, on
    the block's device; returns how many were swapped. The package must be built for the
    model's config (`moegen spec` writes that spec) and the weights' dtype. Each block is freed
    as its layer takes its place, so the experts are never held twice."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"transformers {transformers.__version__}: replace_moe_blocks needs transformers 5, whose "
                           "MoE blocks return only the hidden states; with 4, load blocks into package.MoELayer "
                           "with load_hf_state_dict")
    if not isinstance(getattr(model, "config", None), transformers.PretrainedConfig):
        raise TypeError(f"expected a transformers model, got {type(model).__name__}")
    require_package_for(model, package)
    slots = moe_block_slots(model)
    if not slots:
        raise ValueError(f"{type(model).__name__} has no MoE block moegen knows ({', '.join(BLOCK_CLASSES)})")
    dtypes = {getattr(parent, child).experts.gate_up_proj.dtype for parent, child in slots}
    if dtypes != {package.KERNELS.dtype}:
        raise ValueError(f"the model's experts are {', '.join(map(str, dtypes))}, the package's kernels "
                         f"{package.KERNELS.dtype}; build for the model's dtype or convert the model")
    for parent, child in slots:
        block = getattr(parent, child)
        layer = package.MoELayer(device="meta").to_empty(device=block.experts.gate_up_proj.device)
        layer.load_hf_state_dict(block.state_dict())
        setattr(parent, child, layer)
    return len(slots)


def moe_block_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(parent module, attribute name) of every MoE block moegen knows in `model`, in module
    order: where a layer takes a block's place. No reference to the blocks themselves is kept,
    so that each is freed once its layer replaces it."""
    slots = []
    for name, module in model.named_modules():
        if type(module).__name__ in BLOCK_CLASSES:
            parent, _, child = name.rpartition(".")
            slots.append((model.get_submodule(parent), child))
    return slots
