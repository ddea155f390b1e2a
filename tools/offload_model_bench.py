#!/usr/bin/env python
"""Offloaded whole models (issue 80's measurements): transformers builds each architecture from its
published config (specs/hf/) with random bf16 weights and saves it as safetensors; moegen loads the
folder with moegen.load_offloaded at expert budgets of 25% and 50% of the experts and all-resident,
with bf16 and int4 experts; accelerate's offload (device_map="auto", the same GPU memory) is the
anchor a Hugging Face user has today.

Per row: greedy decode tokens/s at batch 1 and 8 (at the median step after the prompt's; batch 1's
fastest and slowest step beside it),
prefill tokens/s of one 2048-token prompt, the decode floor (the bytes moved per token over the
pinned host-to-device bandwidth measured here, plus the all-resident model's fastest batch-1 step), the
share of the copies' link time the kernels did not wait for, hit rate, bytes moved per token,
peak GPU and host memory against the budget, and agreement with the all-resident load (logits;
greedy tokens, and where they part, how near a tie the resident's choice was).

    python tools/offload_model_bench.py [--models mixtral-8x7b,qwen3-30b-a3b,deepseek-v2-lite] [--layers N]
    TRITON_INTERPRET=1 python tools/offload_model_bench.py --cpu-smoke   # the plumbing, tiny, on the CPU

`--layers` (default 4) keeps each model within the GPU machine's disk and time: say so beside the
figures. Prints a markdown table; with $OUT set, also writes it to $OUT/offload_model_bench.md, and
with --profile each row's torch profile of four batch-1 steps to $OUT/profile-<model>-<experts>-<budget>.txt.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite")
BUDGETS = (0.25, 0.5, 1.0)  # shares of the experts' bytes; 1.0: all resident
EXPERTS = {"bf16": "none", "int4": "int4_group"}


def model_values(name: str, layers: int, smoke: bool) -> dict:
    values = json.loads((REPO_ROOT / "specs" / "hf" / f"{name}.json").read_text())
    values["num_hidden_layers"] = layers
    if smoke:  # a toy of the same architecture, float32 for the interpreter
        values.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128, torch_dtype="float32", kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=16)
    return values


def save_checkpoint(values: dict, folder: Path, dtype) -> None:
    import torch
    import transformers

    keys = {k: v for k, v in values.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = transformers.CONFIG_MAPPING[values["model_type"]](**keys)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder, max_shard_size="2GB")


def build_package(folder: Path, experts: str, out: Path, smoke: bool):
    import moegen
    from moegen import knobs
    from moegen.package import build
    from moegen.spec.from_hf import read_config, spec_text

    values, source = read_config(folder)
    name = f"{folder.name}-{experts}"
    quantization = {"quantization": EXPERTS[experts]}
    if smoke and experts == "int4":
        quantization["quantization_group_size"] = 32
    text = spec_text(values, source, name, model_overrides=quantization)
    spec = out / f"{name}.yaml"
    spec.write_text(text)
    with knobs.scope(MOEGEN_PRECOMPILE="0"):
        package_folder, _ = build(str(spec), out)
    return moegen.load(package_folder)


def timed(torch, device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


class GcClock:
    """Seconds the garbage collector has run in this process (gc.callbacks)."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._phase)

    def _phase(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


GC_CLOCK = GcClock()


class StepClock:
    """A transformers streamer: the time, bytes copied and stall as each step's tokens arrive
    (generate hands them over on the host, after the step)."""

    def __init__(self, torch, runtime):
        self.torch, self.runtime, self.marks = torch, runtime, []

    def put(self, value) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        counters = (self.runtime.stats.bytes_moved, self.runtime.stall_s) if self.runtime else (0, 0.0)
        self.marks.append((time.perf_counter(), *counters, GC_CLOCK.seconds))

    def end(self) -> None:
        pass


def decode_rate(torch, model, device, batch: int, new_tokens: int) -> dict:
    """Greedy decoding of `batch` sequences, per step after the first (which runs the prompt):
    tokens/s at the median step, the steps' fastest and slowest ms, bytes copied and stall per token."""
    prompt = torch.randint(0, model.config.vocab_size, (batch, 32), generator=torch.Generator().manual_seed(batch))
    prompt = prompt.to(device)
    runtime = getattr(model, "moegen_offload", None)

    def run(steps) -> StepClock:
        clock = StepClock(torch, runtime)
        model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, streamer=clock)
        return clock

    # A warm-up as long as the timed run: a row's first steps can run slow for a while (DeepSeek-V2
    # int4 on the H200: 5.3-5.9 ms for 5-13 steps, then 3.3-3.7 ms, resident rows too; PERFORMANCE.md).
    run(new_tokens)
    marks = run(new_tokens).marks[1:]  # from the first new token on
    in_order = [(1e3 * (b[0] - a[0]), 1e3 * (b[3] - a[3])) for a, b in zip(marks, marks[1:])]
    # Each step's ms and the garbage collector's share of it, in order (PERFORMANCE.md: the slow
    # batch-1 steps of a process's first rows; process CPU time told nothing: synchronize spins).
    print(f"batch {batch} steps, ms/of which gc: " + " ".join(f"{w:.1f}/{c:.1f}" for w, c in in_order),
          file=sys.stderr, flush=True)
    steps = sorted(ms for ms, _ in in_order)
    tokens = batch * (len(marks) - 1)
    return {"rate": 1e3 * batch / steps[len(steps) // 2], "step_ms": (steps[0], steps[-1]),
            "bytes": (marks[-1][1] - marks[0][1]) / tokens, "stall": (marks[-1][2] - marks[0][2]) / tokens}


def measure(torch, model, device, new_tokens: int, prefill_tokens: int) -> dict:
    row = {}
    for batch in (1, 8):
        decode = decode_rate(torch, model, device, batch, new_tokens)
        row[f"decode{batch}"] = decode["rate"]
        if batch == 1:
            row["bytes_per_token"], row["stall_per_token"] = decode["bytes"], decode["stall"]
            row["step_ms"] = decode["step_ms"]
    prompt = torch.randint(0, model.config.vocab_size, (1, prefill_tokens), generator=torch.Generator().manual_seed(9))
    prompt = prompt.to(device)
    with torch.no_grad():
        model(prompt)  # compiles the prompt's kernels
        row["prefill"] = prefill_tokens / timed(torch, device, lambda: model(prompt))
    runtime = getattr(model, "moegen_offload", None)
    row["hit_rate"] = runtime.stats.hit_rate if runtime else 1.0
    row["logits"], row["greedy"] = agreement_probe(torch, model, device)
    return row


def agreement_probe(torch, model, device):
    """(float32 logits of a fixed prompt, its greedy continuation, each step's scores): the
    offloaded loads are compared with the all-resident one (issue 80's item 5 at the published
    shapes, bf16)."""
    prompt = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(11))
    prompt = prompt.to(device)
    with torch.no_grad():
        logits = model(prompt).logits.float().cpu()
        out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return logits, (out.sequences.cpu(), torch.stack([s.float().cpu() for s in out.scores]))


def greedy_agreement(torch, row, resident) -> str:
    """"True" where the greedy tokens equal the all-resident load's; else where they first part and
    how near a tie the resident's choice was there: its top-two score gap against the largest score
    difference between the loads at that step (bf16 noise flips a choice only within it)."""
    (tokens, scores), (tokens_resident, scores_resident) = row["greedy"], resident["greedy"]
    if torch.equal(tokens, tokens_resident):
        return "True"
    prompt = tokens.shape[1] - scores.shape[0]
    differ = (tokens != tokens_resident)[:, prompt:]
    step = int(differ.any(dim=0).nonzero()[0])
    sequence = int(differ[:, step].nonzero()[0])
    top2 = scores_resident[step, sequence].topk(2).values
    noise = (scores[step, sequence] - scores_resident[step, sequence]).abs().max()
    return f"False (step {step + 1}: gap {float(top2[0] - top2[1]):.2g}, noise {float(noise):.2g})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help=f"comma-separated, of {','.join(MODELS)} (default: all; --cpu-smoke: mixtral)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of each model (default 4)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU, eager")
    ap.add_argument("--profile", action="store_true", help="a torch profile of four batch-1 steps per row, to $OUT")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    models = args.models.split(",") if args.models else list(MODELS[:1] if smoke else MODELS)
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import moegen
    from moegen.bench.report import publish
    from moegen.doctor import pinned_link_gbps
    from moegen.spec.from_hf import moe_layer_ids

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    new_tokens, prefill_tokens = (2, 16) if smoke else (args.new_tokens, 2048)
    link = pinned_link_gbps() if device.type == "cuda" else float("nan")
    lines = ["| model | experts | budget | decode tok/s b1 | b1 step ms (min-max) | b8 | prefill tok/s | floor tok/s b1 | % of floor "
             "| link time hidden | hit rate | MB moved/token | peak GPU GiB | peak host GiB | logits vs resident | greedy same |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    work = Path(tempfile.mkdtemp(prefix="moegen-offload-model-"))
    try:
        for name in models:
            values = model_values(name, args.layers, smoke)
            folder = work / name
            save_checkpoint(values, folder, dtype)
            if not args.skip_accelerate and not smoke:
                bf16_experts = len(moe_layer_ids(values)) * 3 * experts_elements(values) * 2
                gpu_bytes = checkpoint_bytes(folder) - bf16_experts + 0.5 * bf16_experts
                lines.append(accelerate_row(torch, name, folder, device, new_tokens, gpu_bytes, "50%"))
                lines.append(accelerate_row(torch, name, folder, device, new_tokens, None, "all on the GPU"))
                print("\n".join(lines[-2:]), file=sys.stderr, flush=True)
            for experts in EXPERTS:
                resident = None  # the same experts' all-resident row
                package = build_package(folder, experts, work, smoke)
                m = package.SPEC.model
                layers = len(moe_layer_ids(values))
                all_bytes = layers * m.num_experts * m.expert_bytes
                for share in sorted(BUDGETS, reverse=True):
                    budget = max(share * all_bytes, layers * m.top_k * m.expert_bytes) / 2**30
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    reset_peak_host_memory()
                    model = moegen.load_offloaded(folder, package, expert_memory_gib=budget * 1.0001, device=device,
                                                  prefetch="router")
                    model.generation_config.pad_token_id = 0
                    model.generation_config.eos_token_id = None  # random weights: decode every step
                    row = measure(torch, model, device, new_tokens, prefill_tokens)
                    resident = resident or row
                    row.update(name=name, experts=experts, share=share, budget=budget, resident=resident,
                               gpu_peak=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
                               host_peak=peak_host_gib())
                    lines.append(row)
                    print(table_line(torch, row, link), file=sys.stderr, flush=True)
                    if args.profile:
                        profile(torch, model, device, Path(os.environ.get("OUT", "."))
                                / f"profile-{name}-{experts}-{share * 100:.0f}pct.txt")
                    del model
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if device.type == "cuda":
        # Measured again after the rows, the faster of the two: a start copy slowed by whatever
        # else the host did then would loosen every floor (47.5 GB/s where that run's own decode
        # steps moved 53.8, PERFORMANCE.md).
        link = max(link, pinned_link_gbps())
    lines = [line if isinstance(line, str) else table_line(torch, line, link) for line in lines]
    header = [f"# Offloaded whole models: {args.layers} decoder layers each, random weights", "",
              f"- {'CPU smoke run (tiny, interpreter)' if smoke else torch.cuda.get_device_name()}; torch "
              f"{torch.__version__}; pinned host-to-device {link:.1f} GB/s (measured here, before and after the rows: "
              f"the faster); {new_tokens} greedy "
              f"tokens after a 32-token prompt; prefill one {prefill_tokens}-token prompt; prefetch: router", ""]
    publish(header + lines, "offload_model_bench.md")
    return 0


def table_line(torch, row: dict, link: float) -> str:
    """A moegen row of the table; the floor and the hidden share at the link rate `link` (GB/s)."""
    resident = row["resident"]
    floor = "- | -"  # tok/s | % of floor; on the GPU, for the offloaded rows
    if link == link and row["share"] < 1.0:
        # The all-resident compute at its fastest step: its median moves with the host
        # (PERFORMANCE.md: resident batch-1 steps of 3.7-47 ms).
        floor_s = resident["step_ms"][0] / 1e3 + row["bytes_per_token"] / (link * 1e9)
        floor = f"{1 / floor_s:.1f} | {row['decode1'] * floor_s:.0%}"
    link_s = row["bytes_per_token"] / (link * 1e9) if link == link else float("nan")
    hidden = f"{1 - row['stall_per_token'] / link_s:.0%}" if link_s == link_s and link_s > 0 else "-"
    return (f"| {row['name']} | {row['experts']} | {row['share']:.0%} ({row['budget']:.2f} GiB) | {row['decode1']:.1f} "
            f"| {row['step_ms'][0]:.2f}-{row['step_ms'][1]:.2f} | {row['decode8']:.1f} | {row['prefill']:.0f} | {floor} "
            f"| {hidden} | {row['hit_rate']:.3f} | {row['bytes_per_token'] / 1e6:.1f} | {row['gpu_peak']:.2f} "
            f"| {row['host_peak']:.2f} | {relative_error(row['logits'], resident['logits']):.1e} "
            f"| {greedy_agreement(torch, row, resident)} |")


def profile(torch, model, device, path: Path) -> None:
    """torch.profiler's tables (by host time, then by device time) of four greedy batch-1 steps."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1)).to(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    table = prof.key_averages()
    path.write_text(table.table(sort_by="self_cpu_time_total", row_limit=30) + "\n"
                    + (table.table(sort_by="self_cuda_time_total", row_limit=20) if device.type == "cuda" else ""))


def reset_peak_host_memory() -> None:
    """Start the process's peak resident memory (VmHWM) afresh, where Linux allows it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_host_gib() -> float:
    """Peak resident host memory since the last reset (VmHWM; elsewhere the process's maximum)."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 2**20
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def experts_elements(values: dict) -> int:
    """Elements of one projection (H x I) of all of a layer's routed experts, from a config's values."""
    from moegen.spec.from_hf import model_fields

    fields = model_fields(values)
    return fields["num_experts"] * fields["hidden_size"] * fields["intermediate_size"]


def checkpoint_bytes(folder: Path) -> int:
    """The bf16 checkpoint's bytes: every tensor of its shards."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as shard:
            for key in shard.keys():
                count = 1
                for size in shard.get_slice(key).get_shape():
                    count *= size
                total += 2 * count
    return total


def accelerate_row(torch, name: str, folder: Path, device, new_tokens: int, gpu_bytes, budget: str) -> str:
    """transformers' own experts: with accelerate's offload (device_map="auto") when the GPU is given
    gpu_bytes (the non-expert weights and half the experts' bytes: the 50% budget), else all on
    the GPU. Decode tokens/s at batch 1 (and 8 on the GPU)."""
    import transformers

    placement = (dict(device_map="auto", max_memory={0: int(gpu_bytes), "cpu": "110GiB"}) if gpu_bytes
                 else dict(device_map=str(device)))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **placement)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    one = decode_rate(torch, model, device, 1, max(4, new_tokens // 4))
    rate8 = f"{decode_rate(torch, model, device, 8, new_tokens)['rate']:.1f}" if not gpu_bytes else "-"
    del model
    torch.cuda.empty_cache()
    memory = f"{gpu_bytes / 2**30:.2f} GiB of GPU in all" if gpu_bytes else "experts resident"
    return (f"| {name} | transformers bf16 | {budget} ({memory}) | {one['rate']:.2f} "
            f"| {one['step_ms'][0]:.2f}-{one['step_ms'][1]:.2f} | {rate8} | - | - | - | - | - | - | - | - | - | - |")


def relative_error(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


if __name__ == "__main__":
    sys.exit(main())
