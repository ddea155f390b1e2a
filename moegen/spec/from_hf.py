"""A spec from a Hugging Face config.json: the MoE fields of each model family moegen runs, read
as that family's transformers code uses them. The result is spec YAML in the shipped specs'
layout, validated by the spec loader before it is returned."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Optional

from moegen.errors import SpecError
from moegen.spec.loader import MAX_LAYERS, MAX_NAME_LEN, load_spec_text
from moegen.quant.formats import FP8_BLOCK, INT4_GROUP_SIZES
from moegen.spec.schema import DTYPES, ModelSpec

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}  # HF's "gelu" is the exact (erf) GELU
_MISSING = object()


class _Config:
    """The config's values, each read through a check that names the file and the key."""

    def __init__(self, values: Mapping, source: str):
        self.values, self.source = values, source

    def get(self, key: str, kind: type, default: Any = _MISSING, aliases: tuple[str, ...] = ()) -> Any:
        """The value of key, or of the first alias present (config classes rename keys on saving)."""
        key = next((k for k in (key, *aliases) if k in self.values), key)
        value = self.values.get(key, default)
        if value is _MISSING:
            family = self.values.get("model_type")
            owner = f"a {family} config.json" if isinstance(family, str) else "a model's config.json"
            raise SpecError(self.source, key, "missing", f"{owner} has `{key}`; pass the model's own config.json")
        if value is None and default is not _MISSING:
            return default
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {bool: isinstance(value, bool), int: number and isinstance(value, int), float: number}.get(
            kind, isinstance(value, kind))
        if not ok:
            raise SpecError(self.source, key, f"expected {kind.__name__}, got {json.dumps(value)[:40]}",
                            "pass the model's own config.json")
        return value

    def fail(self, key: str, problem: str, fix: str):
        raise SpecError(self.source, key, problem, fix)


_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _common(c: _Config, inter_key: str, experts_key: str) -> dict:
    act = c.get("hidden_act", str, "silu")
    if act not in _ACTIVATIONS:
        c.fail("hidden_act", f"activation {act!r} is not supported", f"moegen's experts run {', '.join(_ACTIVATIONS)}")
    dtype_key = "torch_dtype" if c.values.get("torch_dtype") is not None else "dtype"  # transformers 5: dtype
    dtype = c.get(dtype_key, str, "bfloat16")
    if dtype not in DTYPES:
        c.fail(dtype_key, f"dtype {dtype!r} is not supported",
               "moegen builds bfloat16, float16 or float32 kernels; edit model.dtype in the spec")
    return dict(hidden_size=c.get("hidden_size", int), intermediate_size=c.get(inter_key, int),
                num_experts=c.get(experts_key, int, aliases=_EXPERT_COUNT_KEYS), top_k=c.get("num_experts_per_tok", int),
                activation=_ACTIVATIONS[act], dtype=dtype)


def _positive(c: _Config, key: str, default: Any = _MISSING) -> int:
    value = c.get(key, int, default)
    if value < 1:
        c.fail(key, f"{value} is not a positive count", "pass the model's own config.json")
    return value


def _layers(c: _Config) -> int:
    total = _positive(c, "num_hidden_layers")
    if total > MAX_LAYERS:  # before any list of layers is made
        c.fail("num_hidden_layers", f"{total} layers, over MAX_LAYERS = {MAX_LAYERS}", "pass the model's own config.json")
    return total


def _every_layer(c: _Config) -> list[int]:
    return list(range(_layers(c)))


def _mixtral(c: _Config) -> dict:
    return dict(_common(c, "intermediate_size", "num_local_experts"), scoring="softmax", renormalize=True)


def _olmoe(c: _Config) -> dict:
    return dict(_common(c, "intermediate_size", "num_experts"), scoring="softmax",
                renormalize=c.get("norm_topk_prob", bool, False))


def _qwen3_moe_layers(c: _Config) -> list[int]:
    # Layer i (0-based) is sparse where (i + 1) is a multiple of decoder_sparse_step, unless
    # mlp_only_layers lists it.
    step, dense = _positive(c, "decoder_sparse_step", 1), c.get("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        c.fail("mlp_only_layers", "expected a list of layer numbers", "pass the model's own config.json")
    return [i for i in range(_layers(c)) if (i + 1) % step == 0 and i not in dense]


def _qwen3_moe(c: _Config) -> dict:
    return dict(_common(c, "moe_intermediate_size", "num_experts"), scoring="softmax",
                renormalize=c.get("norm_topk_prob", bool, False))


def _deepseek_layers(c: _Config) -> list[int]:
    # Layer i is sparse from first_k_dense_replace on where i is a multiple of moe_layer_freq.
    every, first = _positive(c, "moe_layer_freq", 1), c.get("first_k_dense_replace", int, 0)
    return [i for i in range(max(first, 0), _layers(c)) if i % every == 0]


def _deepseek(c: _Config) -> dict:
    """DeepSeek-V2 (softmax, greedy or group-limited top-k) and V3 (sigmoid, noaux_tc: a
    correction bias and groups scored by their two best)."""
    v3 = c.values["model_type"] != "deepseek_v2"  # transformers' V3 config omits the two keys its router implies
    method = c.get("topk_method", str, "noaux_tc" if v3 else "greedy")
    methods = {"greedy": False, "group_limited_greedy": False, "noaux_tc": True}
    if method not in methods:
        c.fail("topk_method", f"{method!r} is not supported", f"moegen routes {', '.join(methods)}")
    scoring = c.get("scoring_func", str, "sigmoid" if v3 else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        c.fail("scoring_func", f"{scoring!r} is not supported", "moegen scores by softmax or sigmoid")
    grouped = method != "greedy"
    shared = c.get("n_shared_experts", int, 0)
    return dict(_common(c, "moe_intermediate_size", "n_routed_experts"), scoring=scoring,
                renormalize=c.get("norm_topk_prob", bool, False),
                n_group=c.get("n_group", int, 1) if grouped else 1,
                topk_group=c.get("topk_group", int, 1) if grouped else 1,
                routed_scaling_factor=float(c.get("routed_scaling_factor", float, 1.0)),
                correction_bias=methods[method], num_shared_experts=shared,
                shared_intermediate_size=c.get("moe_intermediate_size", int) if shared else 0,
                router_dtype="float32")  # DeepseekV*TopkRouter: float32 logits


# model_type: (the model fields but the layer count, the MoE layers' indices among all layers)
FAMILIES: dict[str, tuple[Callable[[_Config], dict], Callable[[_Config], list[int]]]] = {
    "mixtral": (_mixtral, _every_layer), "olmoe": (_olmoe, _every_layer), "qwen3_moe": (_qwen3_moe, _qwen3_moe_layers),
    "deepseek_v2": (_deepseek, _deepseek_layers), "deepseek_v3": (_deepseek, _deepseek_layers),
    "kimi_k2": (_deepseek, _deepseek_layers),
}
_REFUSED = {
    "qwen2_moe": "its shared expert is scaled by a sigmoid gate of its own (shared_expert_gate), which moegen's "
                 "spec does not model",
}


def _family(c: _Config) -> str:
    family = c.get("model_type", str)
    if family in _REFUSED:
        c.fail("model_type", f"{family!r} is not supported: {_REFUSED[family]}", "write the spec by hand if it fits")
    if family not in FAMILIES:
        c.fail("model_type", f"{family!r} is not a model family moegen reads",
               f"known: {', '.join(FAMILIES)}; or write the spec by hand (docs/spec.md)")
    return family


def _quantization(c: _Config) -> dict:
    """The spec's quantization fields from a checkpoint's `quantization_config` (none without one):
    fp8 with 128 x 128 weight blocks (DeepSeek-V3, Qwen3-FP8), fbgemm's per-channel fp8, AWQ and
    GPTQ 4-bit, and compressed-tensors' 4-bit groups, fp8 channels and fp8 blocks."""
    q = c.get("quantization_config", dict, {})
    if not q:
        return {}
    method = q.get("quant_method")
    key = "quantization_config"
    unsupported = f"moegen runs fp8 (128 x 128 blocks or per channel) and 4-bit groups of {INT4_GROUP_SIZES}"
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            return dict(quantization="fp8_channel")
        if list(block) != [FP8_BLOCK, FP8_BLOCK]:
            c.fail(f"{key}.weight_block_size", f"{json.dumps(block)} is not supported", unsupported)
        return dict(quantization="fp8_block")
    if method == "fbgemm_fp8":
        return dict(quantization="fp8_channel")
    if method in ("awq", "gptq"):
        bits, group = q.get("bits", 4), q.get("group_size", 128)
        if bits != 4 or group not in INT4_GROUP_SIZES:
            c.fail(f"{key}", f"{method} with {bits} bits in groups of {group} is not supported", unsupported)
        if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
            c.fail(f"{key}.version", f"AWQ's {q.get('version')!r} layout is not supported", "moegen reads AWQ's GEMM layout")
        zero_point = bool(q.get("zero_point", True)) if method == "awq" else not q.get("sym", True)
        return dict(quantization="int4_group", quantization_group_size=group, quantization_zero_point=zero_point)
    if method == "compressed-tensors":
        groups = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values() if isinstance(g, Mapping)]
        if len(groups) != 1:
            c.fail(f"{key}.config_groups", f"{len(groups)} weight schemes", "moegen reads one scheme for every expert")
        w = groups[0]
        kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if (kind, bits, strategy) == ("int", 4, "group") and w.get("group_size") in INT4_GROUP_SIZES:
            return dict(quantization="int4_group", quantization_group_size=w["group_size"],
                        quantization_zero_point=not w.get("symmetric", True))
        if (kind, bits, strategy) == ("float", 8, "channel"):
            return dict(quantization="fp8_channel")
        if (kind, bits, strategy) == ("float", 8, "block") and list(w.get("block_structure") or []) == [FP8_BLOCK] * 2:
            return dict(quantization="fp8_block")
        c.fail(f"{key}.config_groups", f"weights {json.dumps(w, sort_keys=True)[:120]} are not supported", unsupported)
    c.fail(f"{key}.quant_method", f"{json.dumps(method)[:40]} is not supported",
           "moegen reads fp8, fbgemm_fp8, awq, gptq and compressed-tensors checkpoints; dequantize the weights, or "
           "write the spec's quantization by hand (docs/spec.md)")


def model_fields(config: Mapping, source: str = "<config>") -> dict:
    """ModelSpec fields from a config.json's values."""
    c = _Config(config, source)
    fields_of, layers_of = FAMILIES[_family(c)]
    return dict(fields_of(c), num_layers=len(layers_of(c)), **_quantization(c))


def moe_layer_ids(config: Mapping, source: str = "<config>") -> list[int]:
    """The MoE layers' indices among the model's layers (DeepSeek's first layers are dense)."""
    c = _Config(config, source)
    return FAMILIES[_family(c)][1](c)


def read_config(path: Path) -> tuple[dict, str]:
    """(values, the file read) of a config.json, or of the config.json in a model folder."""
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = file.read_bytes()[: MAX_CONFIG_BYTES + 1] if file.is_file() else None
    except OSError as error:
        raise SpecError(str(file), "", f"cannot read the file ({error.strerror})", "check its permissions") from None
    if raw is None:
        raise SpecError(str(file), "", "no such file", "pass a model's config.json or the folder holding it")
    if len(raw) > MAX_CONFIG_BYTES:
        raise SpecError(str(file), "", f"over {MAX_CONFIG_BYTES} bytes", "pass the model's config.json")
    try:
        values = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise SpecError(str(file), "", f"not JSON ({str(error)[:80]})", "pass the model's config.json") from None
    if not isinstance(values, dict):
        raise SpecError(str(file), "", "not a JSON object", "pass the model's config.json")
    return values, str(file)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and not re.fullmatch(r"[A-Za-z0-9_.\-]+", value):
        return json.dumps(value)  # a JSON string is a YAML scalar: no name or GPU can add YAML of its own
    return str(value)


def spec_text(config: Mapping, source: str, name: str, gpu: str = "h200",
              token_buckets: Optional[tuple[int, ...]] = None, dtype: Optional[str] = None,
              model_overrides: Optional[Mapping] = None) -> str:
    """Spec YAML for the model of this config (every model field written out), checked by the
    spec loader; a SpecError names the config's key or the spec field that does not fit.
    dtype: the dtype the model will run in, where not the config's (which may be float32).
    model_overrides: model fields to write in place of the config's (a benchmark's expert format)."""
    checkpoint = model_fields(config, source)
    model = checkpoint | ({"dtype": dtype} if dtype else {}) | dict(model_overrides or {})
    model.setdefault("router_dtype", model["dtype"])  # every field written out, as in the shipped specs
    lines = [f"# Generated by `moegen spec` from {json.dumps(source)} (model_type {config['model_type']}).",
             "# Check it against the model card before building: docs/spec.md explains every field."]
    if checkpoint.get("quantization"):
        lines.append(f"# The checkpoint's experts are quantized ({checkpoint['quantization']}): so are the kernels'.")
    lines += [f"name: {_yaml(name)}", "model:"]
    lines += [f"  {f.name}: {_yaml(model.get(f.name, f.default))}" for f in fields(ModelSpec)]
    lines += ["target:", f"  gpu: {_yaml(gpu)}"]
    if token_buckets:
        lines += ["workload:", f"  token_buckets: [{', '.join(map(str, token_buckets))}]"]
    text = "\n".join(lines) + "\n"
    load_spec_text(text, f"<spec from {source}>")  # what the loader refuses is refused here
    return text


def default_name(config: Mapping, file: str) -> str:
    """A spec name from the model's folder (e.g. 'Mixtral-8x7B-v0.1' -> 'mixtral-8x7b-v0.1'), or
    from the file's own name where it is not config.json (specs/hf/olmoe-1b-7b.json)."""
    path = Path(file).resolve()
    source = path.parent.name if path.name == "config.json" else path.stem
    candidate = re.sub(r"[^a-z0-9_.\-]+", "-", source.lower()).strip("-.")
    if not candidate or not candidate[0].isalpha():
        candidate = str(config.get("model_type", "model")).replace("_", "-")
    return candidate[:MAX_NAME_LEN]
