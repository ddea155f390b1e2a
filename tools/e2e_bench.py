#!/usr/bin/env python
"""End-to-end generation: a whole Mixtral-architecture model (transformers, random bf16 weights,
its published config from specs/hf/), greedy decoding at batch 1 and 16 under CUDA graphs
(torch.compile mode="reduce-overhead", a static KV cache), tokens/s with transformers' own bf16
experts and with moegen's blocks in their place: bf16, fp8_block and int4_group experts (the
quantized ones quantized from the same seeded weights as they load), and how many greedy tokens
each variant shares with transformers' before the first difference.

    python tools/e2e_bench.py [--layers L] [--new-tokens N] [--variants transformers,bf16,fp8,int4]
    TRITON_INTERPRET=1 python tools/e2e_bench.py --cpu-smoke     # the plumbing, tiny, on the CPU

Each variant builds the model afresh (a replaced block's experts are freed), so one variant's
memory is in use at a time: the whole Mixtral-8x7B in bf16 (~93 GB) needs an H200; pass
--layers to fit a smaller GPU, and say so beside the figures. Prints a markdown table; with $OUT
set, also writes it to $OUT/e2e_bench.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# variant -> the spec's quantization fields (None: transformers' own experts); int4 as the shipped
# mixtral-8x7b-int4 (AWQ's groups of 128 with zero points), whose tuned entries it then shares.
VARIANTS = {"transformers": None, "bf16": {}, "fp8": {"quantization": "fp8_block"},
            "int4": {"quantization": "int4_group", "quantization_zero_point": True}}
BATCHES = (1, 16)
PROMPT_TOKENS = 64


def _config(values: dict, layers: int | None, smoke: bool) -> dict:
    values = dict(values)
    if layers:
        values["num_hidden_layers"] = layers
    if smoke:  # a toy of the same architecture, float32 for the interpreter
        values.update(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                      num_hidden_layers=2, vocab_size=128, torch_dtype="float32")
    return values


def build_model(values: dict, device: str, dtype):
    import torch
    import transformers

    keys = {k: v for k, v in values.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = transformers.CONFIG_MAPPING[values["model_type"]](**keys)
    torch.manual_seed(0)  # every variant starts from the same weights, so their tokens compare
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: decode every step
    return model.eval()


def build_package(values: dict, variant: str, folder: Path, gpu: str):
    """The variant's package, built for `gpu` (the GPU it runs on, so that its tuned entries apply)."""
    import moegen
    from moegen import knobs
    from moegen.package import build
    from moegen.spec.from_hf import spec_text

    name = f"e2e-{variant}"
    text = spec_text(values, "specs/hf/mixtral-8x7b.json", name, gpu=gpu, model_overrides=VARIANTS[variant])
    spec = folder / f"{name}.yaml"
    spec.write_text(text)
    with knobs.scope(MOEGEN_PRECOMPILE="0"):  # the warm-up compiles the shapes the benchmark runs
        package_folder, _ = build(str(spec), folder)
    return moegen.load(package_folder)


def tokens_per_s(model, batch: int, new_tokens: int, device: str) -> tuple[float, list]:
    """Greedy tokens per second of `batch` sequences (prefill excluded: the time of generating
    new_tokens less that of generating 1), and the tokens of the first sequence. generate runs the
    prefill eagerly, which sets up the static cache, then its compiled decode step: CUDA graphs
    ("reduce-overhead") on the GPU; on the CPU, inductor's code without graphs."""
    import torch
    from transformers import CompileConfig

    prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT_TOKENS), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device == "cuda" else "default")
    compile_config._compile_all_devices = device != "cuda"  # transformers' switch for compiling off the GPU
    kwargs = dict(do_sample=False, cache_implementation="static", compile_config=compile_config)

    def generate(steps: int):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    generate(new_tokens)  # warm-up: compiles and captures every shape
    one, _ = generate(1)
    many, out = generate(new_tokens)
    return batch * (new_tokens - 1) / max(many - one, 1e-9), out[0, PROMPT_TOKENS:].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, help="decoder layers (default: the published config's 32)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {','.join(VARIANTS)}")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU, compiled without graphs")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from moegen.bench.report import publish
    from moegen.target import current_gpu

    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    values = _config(json.loads((REPO_ROOT / "specs" / "hf" / "mixtral-8x7b.json").read_text()), args.layers, smoke)
    new_tokens = 4 if smoke else args.new_tokens
    gpu = "h200" if smoke else current_gpu().alias
    lines = ["| experts | batch | tokens/s | vs transformers | first tokens agree with transformers |",
             "|---|---:|---:|---:|---|"]
    baseline, reference_tokens = {}, {}
    with tempfile.TemporaryDirectory(prefix="moegen-e2e-") as folder:
        for variant in args.variants.split(","):
            moegen_experts = VARIANTS[variant] is not None
            package = build_package(values, variant, Path(folder), gpu) if moegen_experts else None
            for batch in BATCHES if not smoke else (1, 2):
                model = build_model(values, device, dtype)
                if package is not None:
                    import moegen

                    moegen.replace_moe_blocks(model, package)
                rate, tokens = tokens_per_s(model, batch, new_tokens, device)
                if variant == "transformers":
                    baseline[batch], reference_tokens[batch] = rate, tokens
                agree = "-" if batch not in reference_tokens else \
                    f"{next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens[batch])) if a != b), len(tokens))}" \
                    f" of {len(tokens)}"
                vs = f"{rate / baseline[batch]:.2f}x" if batch in baseline else "-"
                label = f"moegen {variant}" if moegen_experts else variant
                lines.append(f"| {label} | {batch} | {rate:.1f} | {vs} | {agree} |")
                print(lines[-1], file=sys.stderr, flush=True)
                del model
                if device == "cuda":
                    torch.cuda.empty_cache()
    header = [f"# End-to-end generation: Mixtral-8x7B architecture, {values['num_hidden_layers']} layers, "
              f"random weights", "",
              f"- {'CPU smoke run (tiny, compiled without CUDA graphs)' if smoke else torch.cuda.get_device_name()}; torch {torch.__version__}; "
              f"prompt {PROMPT_TOKENS} tokens, {new_tokens} greedy tokens, prefill excluded", ""]
    publish(header + lines, "e2e_bench.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
