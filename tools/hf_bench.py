"""Hugging Face models on moegen's blocks, run by tools/gpu_check.py (section "Hugging Face models").

Each shipped model's architecture (specs/hf/NAME.json) is built by transformers with random
bf16 weights on the GPU, and the package that `moegen spec` of the same config builds is put
beside its MoE blocks (`shared_blocks`: moegen's layers hold the blocks' own expert tensors).
A batch of prompts is run with transformers' own experts (`grouped_mm` for the prefill,
`batched_mm` while `generate` decodes: its defaults) and with moegen's blocks swapped in, both
eager (no CUDA graphs, no torch.compile), so the difference is the MoE blocks alone.
Reported: the prefill's and a greedy decode step's wall time (an eager forward is bound by the
host's kernel launches; timed in turns), the host time of one MoE block call inside them (the
part of the host's time the swap changes), the time their kernels kept the GPU busy (torch.profiler;
transformers' decode step outside `generate` runs its default `grouped_mm`), the relative
difference of the prefill logits beside transformers' own between its eager and grouped_mm
experts, and how many greedy steps agree.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
CASES = ("olmoe-1b-7b", "qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b")
BATCHES = (1, 16)
PROMPT_TOKENS = 128
NEW_TOKENS = 32  # greedy steps compared between the two
EAGER_STEPS = 8  # decode steps per eager timing
EAGER_ROUNDS = 5  # eager timings of the two in turns, medians reported (the host drifts between rounds)


@dataclass(frozen=True)
class Timing:
    prefill_ms: float  # wall clock, eager
    step_ms: float  # wall clock per greedy decode step, eager
    prefill_block_us: float  # host time of one MoE block call inside the eager prefill (BlockClock)
    step_block_us: float  # the same inside a decode step
    prefill_gpu_ms: float  # the GPU's busy time in the prefill's kernels (profiler, overlaps counted once)
    step_gpu_ms: float


@dataclass
class HfRow:
    model: str
    batch: int
    hf: Timing
    moegen: Timing
    logits_rel_diff: float
    noise_rel_diff: float  # transformers' eager experts against its grouped_mm
    tokens_agreeing: str


def build_model(values: dict):
    import transformers

    keys = {k: v for k, v in values.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = transformers.CONFIG_MAPPING[values["model_type"]](**keys)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: decode every step
    return model.eval()


def build_package(values: dict, name: str, folder: Path):
    import moegen
    from moegen.package import build
    from moegen.spec.from_hf import spec_text

    spec = folder / f"{name}.yaml"
    spec.write_text(spec_text(values, f"specs/hf/{name}.json", name))
    # Not compiled at build time: the warm-up compiles the few shapes the benchmark runs.
    saved = os.environ.get("MOEGEN_PRECOMPILE")
    os.environ["MOEGEN_PRECOMPILE"] = "0"
    try:
        package_folder, _ = build(str(spec), folder)
    finally:
        os.environ.pop("MOEGEN_PRECOMPILE") if saved is None else os.environ.update(MOEGEN_PRECOMPILE=saved)
    return moegen.load(package_folder)


def _seconds(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def busy_us(intervals) -> float:
    """The time covered by at least one of the (start, end) intervals. Summed durations count
    overlapping kernels twice: a programmatic dependent (the decode kernel's finish) is resident,
    waiting, through its primary's last wave, and two streams' kernels run side by side."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def _kernel_ms(fn) -> float:
    """How long the GPU was busy with the kernels and copies fn launches (one profiled run)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return busy_us((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


class BlockClock:
    """The host time of every MoE block call inside the model, transformers' blocks and moegen's
    layers alike (forward pre- and post-hooks, no synchronization): the part of an eager
    forward's host time that swapping the blocks changes. The wall clock of a whole forward
    drifts with the host by tens of percent between rounds; this does not depend on the rest."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    def attach(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit)

    def _enter(self, module, args) -> None:
        self._start = time.perf_counter()

    def _exit(self, module, args, output) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def shared_blocks(model, package, clock: BlockClock | None = None):
    """Put the package's MoELayers in the model beside transformers' MoE blocks and return
    use(moegen: bool), which swaps one kind in for the other. Each layer's experts are its
    block's own tensors (transformers 5 stacks them as moegen does), so both fit at once, even
    Mixtral's, and the eager timings can alternate between them in one process: the host's
    speed, which bounds an eager forward, drifts by tens of percent over minutes. `clock`, if
    given, times every call of both kinds."""
    from moegen.runtime.hf import moe_block_slots

    swaps = []
    for parent, child in moe_block_slots(model):
        block = getattr(parent, child)
        device = block.experts.gate_up_proj.device
        layer = package.MoELayer(device="meta")
        layer.w13 = torch.nn.Parameter(block.experts.gate_up_proj.detach(), requires_grad=False)
        layer.w2 = torch.nn.Parameter(block.experts.down_proj.detach(), requires_grad=False)
        for module in layer.modules():  # the router, bias and shared experts: small, copied
            for param_name, param in list(module.named_parameters(recurse=False)):
                if param.is_meta:
                    setattr(module, param_name, torch.nn.Parameter(torch.empty_like(param, device=device),
                                                                   requires_grad=False))
        layer.load_hf_state_dict(block.state_dict())  # checked; the experts copy onto themselves
        swaps.append((parent, child, block, layer))
        if clock is not None:
            clock.attach(block)
            clock.attach(layer)

    def use(moegen: bool) -> None:
        for parent, child, block, layer in swaps:
            setattr(parent, child, layer if moegen else block)

    return use


def _generate(model, prompt, steps: int):
    return model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)


def outputs(model, prompt) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(prefill logits at the last position, greedy tokens, the prefill's and a decode step's
    kernel time in ms); warms up every shape the eager timings run."""
    def step():  # one decode step after a fresh prefill
        cache = model(prompt, use_cache=True).past_key_values
        token = prompt[:, -1:]
        return lambda: model(token, past_key_values=cache, use_cache=True)

    logits = model(prompt).logits[:, -1].float()
    tokens = _generate(model, prompt, NEW_TOKENS + 1)
    _generate(model, prompt, 1)
    _generate(model, prompt, EAGER_STEPS + 1)
    prefill_gpu = _kernel_ms(lambda: model(prompt))
    step()()  # a decode step outside generate, once untimed
    return logits, tokens, prefill_gpu, _kernel_ms(step())


def eager_ms(model, prompt, clock: BlockClock) -> tuple[float, float, float, float]:
    """(prefill, decode step) wall clock in ms: the median of three prefills, and greedy
    generation of EAGER_STEPS + 1 tokens less that of 1, per step; then the median host time
    in us of one MoE block call in those prefills and in the decode steps."""
    clock.seconds.clear()
    prefill = statistics.median(_seconds(lambda: model(prompt))[0] for _ in range(3))
    prefill_calls = list(clock.seconds)
    first = _seconds(lambda: _generate(model, prompt, 1))[0]
    clock.seconds.clear()
    whole = _seconds(lambda: _generate(model, prompt, EAGER_STEPS + 1))[0]
    step_calls = clock.seconds[len(clock.seconds) // (EAGER_STEPS + 1):]  # every forward calls each block once
    return (prefill * 1e3, (whole - first) / EAGER_STEPS * 1e3,
            statistics.median(prefill_calls) * 1e6, statistics.median(step_calls) * 1e6)


def bench_model(name: str, folder: Path) -> list[HfRow]:
    values = json.loads((REPO_ROOT / "specs" / "hf" / f"{name}.json").read_text())
    model = build_model(values)
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompts = {b: torch.randint(0, values["vocab_size"], (b, PROMPT_TOKENS), generator=generator, device="cuda")
               for b in BATCHES}
    clock = BlockClock()
    use_moegen = shared_blocks(model, build_package(values, name, folder), clock)
    with torch.no_grad():
        model.set_experts_implementation("eager")  # the bf16 noise floor: transformers against itself
        eager = {b: model(prompts[b]).logits[:, -1].float() for b in BATCHES}
        model.set_experts_implementation("grouped_mm")
        results, samples = {}, {}
        for moegen in (False, True):
            use_moegen(moegen)
            results.update({(moegen, b): outputs(model, prompts[b]) for b in BATCHES})
        for _ in range(EAGER_ROUNDS):  # in turns
            for moegen in (False, True):
                use_moegen(moegen)
                for b in BATCHES:
                    samples.setdefault((moegen, b), []).append(eager_ms(model, prompts[b], clock))
    rows = []
    for b in BATCHES:
        timing = {}
        for moegen in (False, True):
            prefill, step, prefill_block, step_block = (statistics.median(c) for c in zip(*samples[moegen, b]))
            timing[moegen] = Timing(prefill, step, prefill_block, step_block, *results[moegen, b][2:])
        hf_logits, hf_tokens = results[False, b][:2]
        logits, tokens = results[True, b][:2]
        generated = tokens[:, PROMPT_TOKENS:]
        agree = int((generated == hf_tokens[:, PROMPT_TOKENS:]).all(dim=0).cumprod(0).sum())  # leading steps
        rows.append(HfRow(name, b, timing[False], timing[True], _rel(logits, hf_logits), _rel(eager[b], hf_logits),
                          f"{agree}/{generated.shape[1]}"))
    del model, use_moegen
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def table(rows: list[HfRow]) -> list[str]:
    lines = ["| model | batch | prefill ms, eager (transformers / moegen) | MoE block host us | kernels only | "
             "decode step ms, eager | MoE block host us | kernels only | logits rel diff (noise) | "
             "greedy steps agreeing |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        h, m = r.hf, r.moegen
        lines.append(f"| {r.model} | {r.batch} | {h.prefill_ms:.1f} / {m.prefill_ms:.1f} | "
                     f"{h.prefill_block_us:.0f} / {m.prefill_block_us:.0f} | "
                     f"{h.prefill_gpu_ms:.2f} / {m.prefill_gpu_ms:.2f} ({h.prefill_gpu_ms / m.prefill_gpu_ms:.2f}x) | "
                     f"{h.step_ms:.2f} / {m.step_ms:.2f} | {h.step_block_us:.0f} / {m.step_block_us:.0f} | "
                     f"{h.step_gpu_ms:.2f} / {m.step_gpu_ms:.2f} ({h.step_gpu_ms / m.step_gpu_ms:.2f}x) | "
                     f"{r.logits_rel_diff:.1e} ({r.noise_rel_diff:.1e}) | {r.tokens_agreeing} |")
    return lines


def run_all(say, cases=CASES) -> list[str]:
    """Runs every case, prints the table; returns problems."""
    import transformers

    rows, problems = [], []
    with tempfile.TemporaryDirectory(prefix="moegen-hf-") as folder:
        for name in cases:
            try:
                rows.extend(bench_model(name, Path(folder)))
            except Exception as error:  # noqa: BLE001 - keep going with the other models
                problems.append(f"hf {name}: {type(error).__name__}: {error}")
                gc.collect()
                torch.cuda.empty_cache()
    for line in table(rows):
        say(line)
    say()
    say(f"- transformers {transformers.__version__}, random bf16 weights; {PROMPT_TOKENS}-token prompts; "
        f"prefill: one forward of the batch; decode step: greedy `generate` of {EAGER_STEPS + 1} tokens less that "
        f"of 1, per step; eager: wall clock after a warm-up (an eager forward is bound by the host's launches), "
        f"the median of {EAGER_ROUNDS} rounds that time transformers' and moegen's blocks in turns in one model "
        f"(moegen's layers hold the blocks' own expert tensors); MoE block host us: the median host time of one "
        f"MoE block's call inside those eager forwards (forward hooks, no synchronization; medians of the rounds), "
        f"the part of the host's time that swapping the blocks changes; kernels only: the time the GPU was busy "
        f"with the kernels of one eager prefill and of one eager decode step (torch.profiler; kernels that "
        f"overlap, such as a programmatic dependent waiting for its primary, counted once), where moegen's "
        f"calls take the paths of a host-paced caller (one stream; the decode kernel at decode batches whose "
        f"bucket has none), which CUDA graphs replace by the tuned ones")
    say("- transformers' experts: its defaults, grouped_mm (torch._grouped_mm) for the prefill and batched_mm "
        "while generate decodes (the kernels-only decode step, a forward outside generate, runs grouped_mm); "
        "moegen: the model's MoE blocks swapped for the package of `moegen spec` of the same config "
        "(everything else the same model)")
    say("- logits rel diff: last-position prefill logits, moegen against transformers; (noise): transformers' "
        "eager experts against its grouped_mm, the same comparison between two of its own bf16 paths; greedy "
        f"steps agreeing: leading steps of {NEW_TOKENS + 1}-token generations where every sequence of the batch "
        "picked the same token")
    return problems


if __name__ == "__main__":
    import sys

    sys.exit(1 if run_all(print, sys.argv[1:] or CASES) else 0)
