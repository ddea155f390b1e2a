"""`moegen quantize`: a Hugging Face checkpoint folder with its routed experts quantized (round to
nearest, moegen.quant.quantize) into a published layout that moegen (and other engines) read:

- fp8_block: DeepSeek-V3's, each projection's `weight` float8_e4m3fn with `weight_scale_inv`
  per 128 x 128 block, and `quantization_config` {"quant_method": "fp8", "weight_block_size"};
- fp8_channel: fbgemm's, `weight` with `weight_scale` [N, 1], {"quant_method": "fbgemm_fp8"};
- int4_group: compressed-tensors pack-quantized, `weight_packed`, `weight_scale`, `weight_shape`
  (and packed `weight_zero_point`), {"quant_method": "compressed-tensors", ...}.

Shard by shard, tensor by tensor: the experts of one shard in memory at a time. Every other
tensor, and every other file of the folder, is copied as it is."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

from moegen.errors import UsageError
from moegen.quant.formats import FP8_BLOCK, WeightFormat
from moegen.quant.quantize import quantize, unpack_int4

# A routed expert's projection in a per-expert checkpoint (Mixtral's w1/w3/w2, the others'
# gate/up/down_proj); shared experts have no expert number and stay as they are.
EXPERT_WEIGHT = re.compile(r"^(?P<base>.*\.experts\.\d+\.(?:w1|w2|w3|gate_proj|up_proj|down_proj))\.weight$")


def quantization_config(fmt: WeightFormat) -> dict:
    """The config.json `quantization_config` of the layout quantize_checkpoint writes."""
    if fmt.quantization == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    if fmt.quantization == "fp8_channel":
        return {"quant_method": "fbgemm_fp8"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": not fmt.zero_point, "strategy": "group",
                "group_size": fmt.group_size}}},
            "ignore": [r"re:^(?!.*\.experts\.\d+\.).*"]}  # only the routed experts are quantized


def pack_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values (0..15) per int32 word along `dim`, the first in the lowest bits
    (moegen.quant.checkpoint.unpack_int32's inverse); `dim` padded to a multiple of 8."""
    values = values.to(torch.int64).movedim(dim, -1)
    pad = -values.shape[-1] % 8
    values = torch.nn.functional.pad(values, (0, pad)).reshape(*values.shape[:-1], -1, 8)
    words = sum(values[..., i] << (4 * i) for i in range(8))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).movedim(-1, dim).contiguous()


def quantized_tensors(base: str, weight: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """One projection's checkpoint tensors in the format's layout."""
    n, k = weight.shape
    stored = {name: value[0] for name, value in quantize(weight[None], fmt).items()}
    if fmt.quantization == "fp8_block":
        return {f"{base}.weight": stored["weight"], f"{base}.weight_scale_inv": stored["scale"]}
    if fmt.quantization == "fp8_channel":
        return {f"{base}.weight": stored["weight"], f"{base}.weight_scale": stored["scale"][:, None]}
    tensors = {f"{base}.weight_packed": pack_int32(unpack_int4(stored["weight"], k), 1),
               f"{base}.weight_scale": stored["scale"], f"{base}.weight_shape": torch.tensor([n, k])}
    if fmt.zero_point:
        tensors[f"{base}.weight_zero_point"] = pack_int32(stored["zero"], 0)
    return tensors


def quantize_checkpoint(source: Path, destination: Path, fmt: WeightFormat) -> int:
    """Write `destination` (a new folder) as `source` with its experts quantized; returns how many
    expert projections were quantized. Written to a sibling first and renamed, so a failure
    leaves no half-written folder."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, destination = Path(source), Path(destination)
    config_file = source / "config.json"
    if not config_file.is_file():
        raise UsageError(f"{source}: no config.json; pass a Hugging Face model folder")
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise UsageError(f"{source}: no *.safetensors beside config.json")
    if destination.exists():
        raise UsageError(f"-o {destination}: exists; moegen quantize writes a new folder: pick another name")
    config = json.loads(config_file.read_text())
    if config.get("quantization_config"):
        raise UsageError(f"{config_file}: the checkpoint is quantized already "
                         f"({config['quantization_config'].get('quant_method')}); quantize an unquantized one")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    quantized, renamed = 0, {}
    try:
        for item in source.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copy2(item, staging / item.name)
        for shard in shards:
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(shard), framework="pt") as f:
                metadata = f.metadata()
                for key in f.keys():
                    match = EXPERT_WEIGHT.match(key)
                    if match is None:
                        out[key] = f.get_tensor(key)
                        continue
                    tensors = quantized_tensors(match["base"], f.get_tensor(key), fmt)
                    out.update(tensors)
                    renamed[key] = (list(tensors), shard.name)
                    quantized += 1
            save_file(out, str(staging / shard.name), metadata=metadata)
        index = source / "model.safetensors.index.json"
        if index.is_file():
            content = json.loads(index.read_text())
            weight_map = dict(content.get("weight_map", {}))
            for key, (names, shard_name) in renamed.items():
                weight_map.pop(key, None)
                weight_map.update({name: shard_name for name in names})
            content["weight_map"] = dict(sorted(weight_map.items()))
            (staging / index.name).write_text(json.dumps(content, indent=2) + "\n")
        config["quantization_config"] = quantization_config(fmt)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if quantized == 0:
            raise UsageError(f"{source}: no routed expert weights (`...experts.<e>.<proj>.weight`) to quantize")
        staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return quantized
