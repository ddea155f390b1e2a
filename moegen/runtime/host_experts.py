"""Expert weights of all MoE layers in pinned host memory, the source of every expert transfer.

One pinned [E, 2I, H] and [E, H, I] buffer per layer, filled expert by expert, so a checkpoint is
never held twice in pageable memory: tensors handed in are copied into the pinned buffers (and
may be dropped by the caller), safetensors files are read through their memory map one expert
at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from moegen.quant.formats import named_storage
from moegen.quant.quantize import quantize, quantize_w13

# Checkpoint names per expert projection: Mixtral (w1 gate, w3 up, w2 down) and the
# Qwen/DeepSeek/OLMoE style (gate_proj, up_proj, down_proj).
PROJECTION_NAMES = {"mixtral": ("w1", "w3", "w2"), "llama": ("gate_proj", "up_proj", "down_proj")}
MIXTRAL_EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{expert}."
LLAMA_EXPERT = "model.layers.{layer}.mlp.experts.{expert}."  # Qwen3-MoE, OLMoE, DeepSeek
MIXTRAL_KEY = MIXTRAL_EXPERT + "{proj}.weight"
LLAMA_KEY = LLAMA_EXPERT + "{proj}.weight"


def _pinned_empty(shape, dtype) -> torch.Tensor:
    # Pinned memory needs a CUDA driver; on a CPU-only machine plain memory stands in.
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


@dataclass(frozen=True)
class HostExperts:
    """Per layer the experts' stored tensors, pinned: `w13` [E, 2I, H] and `w2` [E, H, I], or for
    quantized experts their storage (moegen/quant/formats.py) with `scales`: per name (w13_scale,
    w2_scale, w13_zero, w2_zero) a tensor per layer, expert first. Every transfer copies an
    expert's slice of each."""

    w13: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]
    scales: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.w13)

    @property
    def parts(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Every stored tensor name -> its per-layer tensors: what a transfer copies."""
        return {"w13": self.w13, "w2": self.w2, **self.scales}

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes as stored (weights, scales, zero points): what a transfer moves."""
        return sum(layers[0][0].nbytes for layers in self.parts.values())

    def quantized(self, fmt) -> "HostExperts":
        """These unquantized experts in a quantized format (moegen.quant.quantize), layer by
        layer and expert by expert into new pinned buffers."""
        layers = []
        for w13, w2 in zip(self.w13, self.w2):
            stored: dict = {}
            for e in range(w13.shape[0]):
                one = named_storage(quantize_w13(w13[e:e + 1], fmt), quantize(w2[e:e + 1], fmt))
                for name, value in one.items():
                    if name not in stored:
                        stored[name] = _pinned_empty((w13.shape[0], *value.shape[1:]), value.dtype)
                    stored[name][e].copy_(value[0])
            layers.append(stored)
        return HostExperts.of_layers(layers)

    @classmethod
    def of_layers(cls, layers: Sequence[dict]) -> "HostExperts":
        """The store of per-layer {stored name: tensor, expert first} (w13, w2 and any scales)."""
        return cls(tuple(layer["w13"] for layer in layers), tuple(layer["w2"] for layer in layers),
                   {name: tuple(layer[name] for layer in layers) for name in layers[0] if name not in ("w13", "w2")})

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, hidden: int, inter: int, dtype) -> "HostExperts":
        return cls(tuple(_pinned_empty((num_experts, 2 * inter, hidden), dtype) for _ in range(num_layers)),
                   tuple(_pinned_empty((num_experts, hidden, inter), dtype) for _ in range(num_layers)))

    @classmethod
    def from_tensors(cls, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "HostExperts":
        """layers: per layer (w13 [E,2I,H], w2 [E,H,I]). Pinned inputs are used as they are;
        others are copied into pinned buffers expert by expert."""
        def pinned(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu" and (t.is_pinned() or not torch.cuda.is_available()):
                return t.contiguous()
            buffer = _pinned_empty(tuple(t.shape), t.dtype)
            for e in range(t.shape[0]):
                buffer[e].copy_(t[e])
            return buffer

        return cls(tuple(pinned(w13) for w13, _ in layers), tuple(pinned(w2) for _, w2 in layers))

    @classmethod
    def from_hf_checkpoint(cls, folder: str | Path, num_layers: int | None = None, fmt=None) -> "HostExperts":
        """The routed experts of a Hugging Face model folder (config.json beside its safetensors
        shards) for every MoE layer, or the first num_layers of them, read as `moegen spec` reads
        the config: its sizes and dtype, and which layers are MoE layers. With `fmt` (a quantized
        package's format) each expert is quantized as it is read, so that host memory never
        holds the unquantized experts, only the quantized ones."""
        from moegen.spec.from_hf import model_fields, moe_layer_ids, read_config

        if fmt is not None and fmt.quantized:
            def quantized(tensors_of, names, hidden, inter):
                gate, up, down = (_weight(*tensors_of(name), n, k) for name, n, k in
                                  ((names[0], inter, hidden), (names[1], inter, hidden), (names[2], hidden, inter)))
                stored = named_storage(quantize_w13(torch.cat((gate, up))[None], fmt), quantize(down[None], fmt))
                return {name: value[0] for name, value in stored.items()}

            return cls._expert_by_expert(folder, quantized, num_layers)
        values, source = read_config(Path(folder))
        model, layer_ids = model_fields(values, source), moe_layer_ids(values, source)[:num_layers]
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files beside config.json")
        key_format, names = (MIXTRAL_KEY, "mixtral") if values["model_type"] == "mixtral" else (LLAMA_KEY, "llama")
        return cls.from_safetensors(files, len(layer_ids), model["num_experts"], model["hidden_size"],
                                    model["intermediate_size"], getattr(torch, model["dtype"]), key_format, names,
                                    layer_ids)

    @classmethod
    def from_quantized_checkpoint(cls, folder: str | Path, fmt) -> "HostExperts":
        """The routed experts of a quantized Hugging Face model folder (fp8, AWQ, GPTQ or
        compressed-tensors per-expert tensors, moegen/quant/checkpoint.py) for every MoE layer,
        repacked expert by expert into pinned buffers of the format `fmt` (the package's)."""
        from moegen.quant.checkpoint import CheckpointError, infer_method, repack_expert

        method = None

        def repacked(tensors_of, names, hidden, inter):
            nonlocal method
            if method is None:
                tensors, where = tensors_of(names[0])
                method = infer_method(tensors)
                if method is None:
                    raise CheckpointError(f"{where}: tensors {sorted(tensors)}, not a layout moegen reads; expected "
                                          "fp8, AWQ, GPTQ or compressed-tensors per-expert tensors")
            return repack_expert(tensors_of, names, method, fmt, hidden, inter)

        return cls._expert_by_expert(folder, repacked)

    @classmethod
    def _expert_by_expert(cls, folder: str | Path, storage_of, num_layers: int | None = None) -> "HostExperts":
        """Every MoE layer's experts (or the first num_layers layers'), one expert at a time through
        the shards' memory maps, as storage_of(tensors_of, projection names, hidden, inter) stores
        them (by stored name, without the expert dimension; tensors_of(projection) -> ({suffix:
        tensor}, its checkpoint name)), into pinned buffers made at each layer's first expert: the
        checkpoint is never held in pageable memory."""
        from contextlib import ExitStack

        from safetensors import safe_open

        from moegen.spec.from_hf import model_fields, moe_layer_ids, read_config

        values, source = read_config(Path(folder))
        model, layer_ids = model_fields(values, source), moe_layer_ids(values, source)[:num_layers]
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files beside config.json")
        expert_format, names = ((MIXTRAL_EXPERT, "mixtral") if values["model_type"] == "mixtral"
                                else (LLAMA_EXPERT, "llama"))
        names, experts = PROJECTION_NAMES[names], model["num_experts"]
        layers = []
        with ExitStack() as stack:
            by_module: dict[str, dict] = {}  # module name -> {suffix: its shard}
            for path in files:
                shard = stack.enter_context(safe_open(str(path), framework="pt"))
                for key in shard.keys():
                    module, _, suffix = key.rpartition(".")
                    by_module.setdefault(module, {})[suffix] = shard
            for layer in layer_ids:
                stored: dict = {}
                for e in range(experts):
                    base = expert_format.format(layer=layer, expert=e)

                    def tensors_of(name):
                        shards = by_module.get(base + name, {})
                        return {suffix: shard.get_tensor(f"{base}{name}.{suffix}")
                                for suffix, shard in shards.items()}, base + name

                    for name, value in storage_of(tensors_of, names, model["hidden_size"],
                                                  model["intermediate_size"]).items():
                        if name not in stored:
                            stored[name] = _pinned_empty((experts, *value.shape), value.dtype)
                        stored[name][e].copy_(value)
                layers.append(stored)
        return cls.of_layers(layers)

    @classmethod
    def from_safetensors(cls, files: Iterable[str | Path], num_layers: int, num_experts: int, hidden: int,
                         inter: int, dtype, key_format: str = MIXTRAL_KEY, names: str = "mixtral",
                         layer_ids: Sequence[int] | None = None) -> "HostExperts":
        """Read expert projections named like key_format (fields layer, expert, proj) from a
        (sharded) safetensors checkpoint. layer_ids: the checkpoint's layer index of each MoE
        layer (default 0..num_layers-1; DeepSeek's first layers are dense)."""
        from safetensors import safe_open

        gate, up, down = PROJECTION_NAMES[names]
        layer_ids = list(layer_ids) if layer_ids is not None else list(range(num_layers))
        host = cls.empty(len(layer_ids), num_experts, hidden, inter, dtype)
        wanted = {}
        for index, layer in enumerate(layer_ids):
            for e in range(num_experts):
                for proj, (target, rows) in ((gate, ("w13", slice(0, inter))), (up, ("w13", slice(inter, 2 * inter))),
                                             (down, ("w2", slice(None)))):
                    wanted[key_format.format(layer=layer, expert=e, proj=proj)] = (target, index, e, rows)
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in wanted:
                        target, index, e, rows = wanted.pop(key)
                        dest, shape = getattr(host, target)[index][e, rows], f.get_slice(key).get_shape()
                        if tuple(shape) != tuple(dest.shape):  # copy_ would broadcast a [1, H] row
                            raise ValueError(f"{path}: {key}: expected shape {list(dest.shape)}, got {list(shape)}; "
                                             f"the checkpoint does not fit hidden {hidden}, intermediate {inter}")
                        dest.copy_(f.get_tensor(key))
        if wanted:
            missing = sorted(wanted)[:3]
            raise KeyError(f"{len(wanted)} expert tensors not found in the checkpoint, e.g. {missing}")
        return host


def _weight(tensors: dict, name: str, n: int, k: int) -> torch.Tensor:
    """An unquantized projection's `weight` [n, k] among its checkpoint tensors."""
    weight = tensors.get("weight")
    if weight is None:
        raise KeyError(f"{name}.weight: not found in the checkpoint")
    if tuple(weight.shape) != (n, k):
        raise ValueError(f"{name}.weight: expected shape {[n, k]}, got {list(weight.shape)}; the checkpoint does "
                         "not fit the package's hidden and intermediate sizes")
    return weight
