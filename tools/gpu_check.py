#!/usr/bin/env python
"""One-shot GPU check of moegen on the H200: tests, ceilings, and kernels against peers.

    python tools/gpu_check.py [--specs a,b] [--tokens 1,8] [--skip-tests] [--quick]
    TRITON_INTERPRET=1 python tools/gpu_check.py --cpu-smoke      # the same pipeline on the CPU

1. Runs `pytest -q -m gpu tests/test_gpu.py` in a subprocess and prints its summary line
   (a failure does not stop the script, but it exits non-zero at the end).
2. Measures the two ceilings in this process: HBM bandwidth (moegen.tune.bench.measure_ceilings,
   as the tuner: the better of a 4 GiB device-to-device copy, counting bytes read + written, and
   the fastest streaming read: a load-instruction Triton kernel and, on Hopper, a TMA reader) and
   the bf16 GEMM rate (8192^3 matmul, random data), timed as the kernels of step 3 are.
3. For each shipped spec and token count, times moegen's fused_moe (routing included), a naive
   per-expert PyTorch loop and torch._grouped_mm, each first checked against the float64
   reference (T <= 4096 only: the reference at T = 16384 costs more than the whole benchmark).
   Routing is uniform random: normal router logits, and for DeepSeek-V3 a correction bias that
   keeps it so (moegen.reference.balanced_correction_bias).
   Timing: CUDA events, 30 ms of calls first (moegen.tune.bench.WARM_UP_S), then the median of
   repeats, with L2 evicted (a 256 MiB read) before each timed call; moegen and grouped_mm are
   captured in a CUDA graph and replays are timed, as serving engines run them (the naive loop
   synchronizes with the host, so it runs eagerly).
   Floor = max(bytes of the distinct experts this routing touches + activations in and out) /
   HBM bandwidth, 6*T*k*H*I / GEMM rate), both measured in step 2. For memory-bound cells also
   the read-only bound: one launch of the fastest streaming read (the same two readers) over
   exactly the floor's bytes, timed as moegen is: a kernel that does nothing but read them.
   Cells of at most 512 tokens again as a stack of layers: 2-8 calls (as memory allows), each
   with its own inputs and its own copy of the experts, back to back in one CUDA graph, L2
   evicted before the replay, time per layer; moegen, grouped_mm and the read-only bound. That
   is how a layer meets them inside a model's graph, where one call per replay adds its launch.
4. Records the first fused_moe call after import per spec and bucket (from an empty Triton
   cache unless --warm-triton-cache: a build on the target GPU ships compiled kernels) and the
   kernels Triton compiled during it: any, for a package that ships them, is a failure.
5. The expert-offload benchmark (tools/offload_bench.py): Mixtral- and DeepSeek-V2-Lite-sized
   stacks decoding with routing replayed from ../shared/traces at 25/50/75% residency.
6. Hugging Face models (tools/hf_bench.py): each shipped model's architecture in transformers
   (random bf16 weights), prefill and greedy decoding with transformers' own experts and with
   moegen's blocks in their place, timed in turns (moegen's layers share the blocks' experts).

Prints a markdown report; with $OUT set, also writes it to $OUT/gpu_check.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # imported where used: the script sets Triton's variables before importing torch
    from moegen.bench.cells import Row, Workload
    from moegen.bench.roofline import Timer

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SHIPPED_SPECS = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3")
TOKENS = (1, 8, 64, 512, 4096, 16384)  # as `moegen bench` (moegen.bench.command.TOKENS)
SMOKE_SPECS = ("tiny",)
SMOKE_TOKENS = (1, 5, 17)
STACK_MAX_TOKENS = 512  # decode and middle cells, where a call's launch is a visible part of its time
STACK_MAX_LAYERS = 8
CALLER_MAX_TOKENS = 64  # fused_experts against fused_moe: the decode cells


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", help="comma-separated spec names (files in specs/) or paths; "
                    f"default: {','.join(SHIPPED_SPECS)}")
    ap.add_argument("--tokens", help=f"comma-separated token counts; default: {','.join(map(str, TOKENS))}")
    ap.add_argument("--skip-tests", action="store_true", help="do not run tests/test_gpu.py first")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the whole pipeline on the CPU (Triton interpreter, specs/tiny.yaml, "
                         "perf_counter timing, no graphs)")
    ap.add_argument("--traces", type=Path, default=REPO_ROOT.parent / "shared" / "traces",
                    help="folder of moegen-trace files for the offload benchmark (default ../shared/traces)")
    ap.add_argument("--skip-offload", action="store_true", help="do not run the expert-offload benchmark")
    ap.add_argument("--skip-hf", action="store_true", help="do not run the Hugging Face models benchmark")
    ap.add_argument("--warm-triton-cache", action="store_true",
                    help="keep the user's Triton cache (the cold-start column then may not compile)")
    args = ap.parse_args(argv)
    args.spec_list = (args.specs.split(",") if args.specs
                      else list(SMOKE_SPECS if args.cpu_smoke else SHIPPED_SPECS))
    args.token_list = ([int(t) for t in args.tokens.split(",")] if args.tokens
                       else list(SMOKE_TOKENS if args.cpu_smoke else TOKENS))
    if any(t < 1 for t in args.token_list):
        ap.error("--tokens must be positive")
    for name in args.spec_list:
        try:
            resolve_spec(name)
        except FileNotFoundError as exc:
            ap.error(str(exc))
    return args


class Report:
    """Prints as it goes and keeps every line for $OUT/gpu_check.md."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.extend(text.split("\n"))

    def write(self, path: Path) -> None:
        path.write_text("\n".join(self.lines) + "\n")


# ---------------------------------------------------------------------------------------------
# Step 1: the GPU tests
# ---------------------------------------------------------------------------------------------


def run_tests(env: dict, say: Report) -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"]
    say(f"$ {' '.join(cmd[2:])}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    words = ("passed", "failed", "skipped", "error", "no tests ran", "deselected")
    summary = next((line.strip("= ") for line in reversed(lines) if any(w in line for w in words)),
                   lines[-1] if lines else "(no output)")
    ok = proc.returncode == 0
    say(f"tests: {summary} (exit {proc.returncode}, {time.perf_counter() - start:.0f} s wall)")
    if not ok:
        say("```")
        for line in proc.stdout.splitlines()[-60:]:
            say(line)
        say("```")
    return ok


# ---------------------------------------------------------------------------------------------
# Step 3: the three implementations
# ---------------------------------------------------------------------------------------------


@dataclass
class Stack:
    """A cell of at most STACK_MAX_TOKENS tokens timed as a model's layers meet it: `layers`
    calls, each with its own inputs and its own copy of the experts (so no layer finds another's
    weights in L2), back to back in one CUDA graph, L2 evicted before the replay; per layer."""
    spec: str
    tokens: int
    layers: int
    floor_us: float  # the layers' mean floor
    us: dict = field(default_factory=dict)  # impl or "read-only" -> microseconds per layer
    err: dict = field(default_factory=dict)  # impl -> worst relative error of its layers in the replay
    wrong: set = field(default_factory=set)


@dataclass
class Cold:
    spec: str
    build_s: float
    precompiled: int  # Triton cache entries the build shipped in the package
    import_ms: float
    first_ms: dict  # bucket -> first call after import (ms), compilation included if any
    second_ms: dict  # bucket -> the same call again (ms)
    compiled: dict  # bucket -> kernels (or launchers) Triton compiled during that first call


def triton_cache_entries() -> set[str]:
    import triton

    folder = Path(triton.knobs.cache.dir)
    return set(os.listdir(folder)) if folder.is_dir() else set()


def compiled_names(entries) -> list[str]:
    """Kernel names of new Triton cache entries ('launcher' for a host-side launcher)."""
    import triton

    names = []
    for entry in sorted(entries):
        metadata = [p for p in (Path(triton.knobs.cache.dir) / entry).glob("*.json") if not p.name.startswith("__grp__")]
        names.append(json.loads(metadata[0].read_text()).get("name", entry) if metadata else "launcher")
    return names


def resolve_spec(name: str) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path.resolve()
    for folder in ("specs", "specs/untuned"):  # shipped, then untuned (the quantized variants among them)
        candidate = REPO_ROOT / folder / f"{name}.yaml"
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"no spec {name!r} (looked in specs/ and specs/untuned/)")


def config_sources(package_folder: Path) -> str:
    """Where a built package took its kernel configs (its manifest's buckets): tuned entries for
    its target.gpu, which need not be the card that runs it, or the cost model."""
    from moegen.plan import COST_MODEL

    manifest = json.loads((package_folder / "manifest.json").read_text())
    tuned = sum(bucket["source"] != COST_MODEL for bucket in manifest["buckets"])
    return f"{tuned} of {len(manifest['buckets'])} buckets tuned for the {manifest['target']['name']}"


def bench_spec(ctx, spec_name: str, build_dir: Path, sources: dict[str, str]) -> tuple[
        Optional[Cold], list[Row], list[Stack], list["CallerRouted"], list[str]]:
    """The spec's tables; `sources` gets where its build took its configs, as soon as it is built."""
    torch, device, timer, ceil, args = ctx["torch"], ctx["device"], ctx["timer"], ctx["ceil"], ctx["args"]
    from moegen import load
    from moegen import reference as ref
    from moegen.package import build

    problems: list[str] = []
    start = time.perf_counter()
    folder, _ = build(resolve_spec(spec_name), build_dir)
    build_s = time.perf_counter() - start
    sources[spec_name] = config_sources(folder)
    start = time.perf_counter()
    pkg = load(folder)
    import_ms = (time.perf_counter() - start) * 1e3

    from moegen.bench.cells import Workload, measure_row
    from moegen.bench.peers import EAGER_ONLY, implementations

    m, ks = pkg.SPEC.model, pkg.KERNELS
    spec_name = pkg.SPEC.name  # rows are labelled by the spec's name, also where a path was given
    h, inter, e = m.hidden_size, m.intermediate_size, m.num_experts
    tol = ref.TOLERANCE[m.dtype]
    # One buffer holds the experts, so that the stacked layers' copies of it can be read whole.
    bank = torch.empty(bank_numel(e, h, inter), device=device, dtype=ks.dtype)
    work = Workload(pkg, device, sum(map(ord, spec_name)), *bank_views(bank, e, h, inter))

    # Cold start: the first call after import for every bucket (in bucket order), Triton
    # compilation included unless the build precompiled the kernels into the package.
    first_ms, second_ms, compiled = {}, {}, {}
    cold_tokens = [t for t in ks.buckets if t <= (17 if args.cpu_smoke else 1 << 30)]
    for t in cold_tokens:
        x, logits = work.inputs(t)
        before = triton_cache_entries()
        # One timing each, so with Python's cyclic collector off (as timeit does): a collection
        # lands on whichever call crosses the allocation threshold (0.18-0.25 s with the four
        # packages loaded). Not collected first either: right after a build that freed a lot,
        # the first call then ran 1-28 ms slower (docs/PERFORMANCE.md, Cold start).
        gc.disable()
        try:
            for record in (first_ms, second_ms):
                timer.sync()
                start = time.perf_counter()
                work.kernel_call(x, logits, work.w13, work.w2)
                timer.sync()
                record[t] = (time.perf_counter() - start) * 1e3
        finally:
            gc.enable()
        compiled[t] = compiled_names(triton_cache_entries() - before)
    precompiled = sum(1 for _ in (folder / "triton_cache").glob("*")) if (folder / "triton_cache").is_dir() else 0
    cold = Cold(spec_name, build_s, precompiled, import_ms, first_ms, second_ms, compiled)
    if precompiled and not args.warm_triton_cache and any(compiled.values()):
        problems.append(f"{spec_name}: the first calls compiled {sum(map(len, compiled.values()))} kernels "
                        "although the package ships compiled kernels (see the cold-start table)")

    impls = implementations(work)  # each a function of one layer's inputs and experts
    rows = []
    for t in args.token_list:
        row, row_problems = measure_row(work, spec_name, t, impls, ceil, timer)
        rows.append(row)
        problems += row_problems
        gc.collect()
        if timer.cuda:
            torch.cuda.empty_cache()
        print(f"  {spec_name} T={t}: " + ", ".join(
            f"{n} {r.us:.1f} us" if r.us is not None else f"{n} n/a" for n, r in row.results.items()),
            file=sys.stderr, flush=True)

    callers = [bench_caller_routed(ctx, work, spec_name, t) for t in args.token_list if t <= CALLER_MAX_TOKENS]
    problems += [f"{c.spec} T={c.tokens}: fused_experts relative error {c.err} > {tol}" for c in callers
                 if not c.err <= tol]

    stacks = []
    stack_tokens = [t for t in args.token_list if t <= STACK_MAX_TOKENS]
    # Quantized: a layer's storage, and as much again while quantize() joins its chunks' storage.
    stored_bytes = 2 * e * m.expert_bytes if work.fmt.quantized else 0
    layers_fit = stack_layers(torch, timer, bank, stored_bytes) if stack_tokens else 0
    if layers_fit == 1:
        print(f"  {spec_name}: no stack of layers (a second layer's experts do not fit)", file=sys.stderr, flush=True)
    if layers_fit > 1:
        buffers = [bank, *(bank.clone() for _ in range(layers_fit - 1))]
        stacked = {name: impl for name, impl in impls.items() if name not in EAGER_ONLY}
        for t in stack_tokens:
            layers = [Layer(b, *bank_views(b, e, h, inter), *work.inputs(t)) for b in buffers]
            try:
                stack = bench_stack(ctx, spec_name, t, layers, stacked, work, tol)
            except Exception as exc:  # noqa: BLE001 - the spec's one-call rows still stand
                traceback.print_exc()
                problems.append(f"{spec_name} T={t} in a stack of layers: {type(exc).__name__}: {exc}")
                del layers
                continue
            if "moegen" in stack.wrong:
                problems.append(f"{spec_name} T={t} in a stack of {stack.layers} layers: moegen relative "
                                f"error {stack.err['moegen']} > {tol}")
            stacks.append(stack)
            print(f"  {spec_name} T={t} stack of {stack.layers}: " + ", ".join(
                f"{n} {us:.1f} us" for n, us in stack.us.items()), file=sys.stderr, flush=True)
            del layers
        del buffers
    del bank, work, impls
    gc.collect()
    if timer.cuda:
        torch.cuda.empty_cache()
    return cold, rows, stacks, callers, problems


@dataclass
class CallerRouted:
    spec: str
    tokens: int
    fused_moe_us: float
    fused_experts_us: float
    err: float  # fused_experts' relative error against the float64 reference


def bench_caller_routed(ctx, work, spec_name: str, tokens: int) -> CallerRouted:
    """fused_moe (routing in the kernels) against fused_experts given the same picks, routed
    beforehand as a caller who routes itself does: each one call per CUDA-graph replay."""
    timer = ctx["timer"]
    from moegen import reference as ref
    from moegen.runtime.routing import route
    from moegen.runtime.step_graphs import capture_graph

    x, logits = work.inputs(tokens)
    weights, ids = route(logits, work.pkg.KERNELS.routing, work.bias)
    calls = {"fused_moe": lambda: work.kernel_call(x, logits, work.w13, work.w2),
             "fused_experts": lambda: work.experts_call(x, weights, ids, work.w13, work.w2)}
    err = ref.relative_error(calls["fused_experts"](), work.reference(x, logits, work.w13, work.w2))
    us = {}
    for name, call in calls.items():
        graph = capture_graph(call, warmups=2)[0] if timer.cuda else None
        us[name] = timer.median_us(graph.replay if graph else call)
        del graph
    return CallerRouted(spec_name, tokens, us["fused_moe"], us["fused_experts"], err)


def caller_routed_table(callers: list[CallerRouted]) -> list[str]:
    from moegen.bench.report import fmt_err, fmt_us

    out = ["| spec | T | fused_moe us | fused_experts us | fused_experts / fused_moe | fused_experts err |",
           "|---|---:|---:|---:|---:|---|"]
    out += [f"| {c.spec} | {c.tokens} | {fmt_us(c.fused_moe_us)} | {fmt_us(c.fused_experts_us)} "
            f"| {c.fused_experts_us / c.fused_moe_us:.2f} | {fmt_err(c.err)} |" for c in callers]
    return out


def bank_numel(e: int, h: int, inter: int) -> int:
    """Elements of one layer's experts (w13 then w2) in one buffer, with room after them for the
    activations in and out of STACK_MAX_TOKENS tokens: a stacked layer's read-only bound reads
    its floor's bytes from the start of its own buffer."""
    return 3 * e * inter * h + 2 * STACK_MAX_TOKENS * h + 64  # + 64: a 128-byte row of rounding


def bank_views(bank, e: int, h: int, inter: int):
    """(w13 [E, 2I, H], w2 [E, H, I]) as views of a bank_numel buffer."""
    w13_numel = 2 * e * inter * h
    return bank[:w13_numel].view(e, 2 * inter, h), bank[w13_numel:w13_numel + e * h * inter].view(e, h, inter)


def stack_layers(torch, timer: Timer, bank, stored_bytes: int) -> int:
    """Layers of a stack: STACK_MAX_LAYERS where three quarters of the free memory holds their
    copies of the experts (the bank, and quantized, their storage too), fewer where it does not
    (DeepSeek-V3's are 22.5 GB a layer); 1 (no stack) where not even one copy fits."""
    if not timer.cuda:
        return 2
    free, _ = torch.cuda.mem_get_info()
    copies = int(0.75 * free // (bank.numel() * bank.element_size() + stored_bytes))
    return 1 + min(STACK_MAX_LAYERS - 1, copies)


@dataclass
class Layer:
    bank: object  # the buffer w13 and w2 view
    w13: object
    w2: object
    x: object
    logits: object


def bench_stack(ctx, spec_name: str, t: int, layers: list[Layer], impls: dict, work: Workload,
                tol: float) -> Stack:
    """Each impl's layers captured back to back in one CUDA graph (run eagerly on the CPU),
    checked after the timed replays against the float64 reference; and the read-only bound the
    same way: one streaming read per layer over its floor's bytes, from its own buffer."""
    timer, ceil = ctx["timer"], ctx["ceil"]
    from moegen import reference as ref
    from moegen.bench.roofline import fastest_read_us, whole_rows_numel
    from moegen.runtime.step_graphs import capture_graph

    floors = [work.floor(layer.logits, ceil) for layer in layers]
    stack = Stack(spec_name, t, len(layers), sum(f.us for f in floors) / len(layers))
    expected = [work.reference(layer.x, layer.logits, layer.w13, layer.w2) for layer in layers]
    # The peers multiply the dequantized weights and unquantized activations (as measure_row checks them).
    peers_expected = ([work.reference(layer.x, layer.logits, layer.w13, layer.w2, quantized=False) for layer in layers]
                      if work.fmt.quantized else expected)
    for name, impl in impls.items():
        def run():
            return [impl(layer.x, layer.logits, layer.w13, layer.w2) for layer in layers]

        graph, outs = capture_graph(run, warmups=2) if timer.cuda else (None, run())
        stack.us[name] = timer.median_us(graph.replay if graph else run) / len(layers)
        timer.sync()
        wanted = expected if name == "moegen" else peers_expected
        stack.err[name] = max(ref.relative_error(out, want) for out, want in zip(outs, wanted))
        if not stack.err[name] <= tol:
            stack.wrong.add(name)
        del graph, outs
    if timer.cuda and all(f.bound == "memory" for f in floors):
        # The bank's slack after the experts covers the rounding up to whole rows.
        spans = [layer.bank[:whole_rows_numel(f.nbytes, layer.bank.element_size())]
                 for layer, f in zip(layers, floors)]
        stack.us["read-only"] = fastest_read_us(timer, spans)
    return stack


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def stack_table(stacks: list[Stack]) -> list[str]:
    from moegen.bench.report import fmt_err, fmt_pct, fmt_us

    out = ["| spec | T | layers | moegen us | %floor | grouped_mm us | %floor | floor us | read-only us | %floor "
           "| err |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for st in stacks:
        def cell(name):
            us = st.us.get(name)
            if us is None:
                return ["-", "-"]
            return [fmt_us(us) + (" **WRONG**" if name in st.wrong else ""), fmt_pct(st.floor_us, us)]

        errs = " / ".join(fmt_err(st.err.get(n)) for n in ("moegen", "grouped_mm"))
        parts = [st.spec, str(st.tokens), str(st.layers), *cell("moegen"), *cell("grouped_mm"), fmt_us(st.floor_us),
                 *cell("read-only"), errs]
        out.append("| " + " | ".join(parts) + " |")
    return out


QUANTIZED_SUFFIXES = ("-int4", "-fp8")  # specs/<model>-int4.yaml, specs/untuned/<model>-fp8.yaml, ...


def quantized_table(rows: list) -> list[str]:
    """Each quantized spec's moegen time against its bf16 spec's at the same T (both in this
    run), and against the read-only time of its own floor's bytes."""
    from moegen.bench.report import fmt_us

    moegen_us = {(r.spec, r.tokens): r.results["moegen"].us for r in rows if "moegen" in r.results}
    out = ["| spec | T | moegen us | bf16 moegen us | speedup | read-only us | time / read-only |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next((r.spec[:-len(s)] for s in QUANTIZED_SUFFIXES if r.spec.endswith(s)), None)
        us, bf16 = moegen_us.get((r.spec, r.tokens)), moegen_us.get((base, r.tokens))
        if base is None or us is None or bf16 is None:
            continue
        read = (fmt_us(r.read_us), f"{us / r.read_us:.2f}") if r.read_us else ("-", "-")
        out.append(f"| {r.spec} | {r.tokens} | {fmt_us(us)} | {fmt_us(bf16)} | {bf16 / us:.2f}x | {read[0]} | {read[1]} |")
    return out if len(out) > 2 else []


def cold_table(colds: list[Cold]) -> list[str]:
    out = ["| spec | build s | kernels shipped | import ms | first call after import, ms, per bucket (second call) "
           "| worst first-call overhead ms | compiled at first call |",
           "|---|---:|---:|---:|---|---:|---|"]
    for c in colds:
        per_bucket = ", ".join(f"T={t}: {c.first_ms[t]:.1f} ({c.second_ms[t]:.1f})" for t in c.first_ms)
        worst = max((c.first_ms[t] - c.second_ms[t] for t in c.first_ms), default=0.0)
        compiled = "; ".join(f"T={t}: {', '.join(names)}" for t, names in c.compiled.items() if names) or "nothing"
        out.append(f"| {c.spec} | {c.build_s:.2f} | {c.precompiled} | {c.import_ms:.0f} | {per_bucket} | {worst:.1f} "
                   f"| {compiled} |")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    # The tests check correctness: compiling every bucket into their packages would only cost time.
    test_env = dict(os.environ, MOEGEN_PRECOMPILE="0")
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit decorates the kernels
    elif not args.warm_triton_cache:
        # A fresh Triton cache, so the cold-start column includes compilation.
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="moegen-triton-cold-")

    import torch
    import triton

    wall_start = time.perf_counter()
    say = Report()
    if args.cpu_smoke:
        device = torch.device("cpu")
        device_name = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --cpu-smoke to exercise the pipeline on the CPU)",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
    say("# moegen GPU check")
    say()
    say(f"- device: {device_name}")
    say(f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}")
    say(f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    say(f"- specs: {', '.join(args.spec_list)}; tokens: {', '.join(map(str, args.token_list))}"
        f"{'; quick' if args.quick else ''}{'; CPU smoke run' if args.cpu_smoke else ''}")
    say()

    failed = False
    if args.skip_tests:
        say("tests: skipped (--skip-tests)")
    else:
        failed |= not run_tests(test_env, say)
    say()

    from moegen.bench.report import legend, notes, results_table
    from moegen.bench.roofline import Timer, measure_ceilings

    timer = Timer(device, args.quick)
    ceil = measure_ceilings(timer)
    say("## Ceilings (measured)")
    say()
    say(f"- memory bandwidth: {ceil.hbm_gbps:.0f} GB/s (device-to-device copy {ceil.copy_gbps:.0f} GB/s "
        f"counting read + write; fastest streaming read {ceil.read_gbps:.0f} GB/s)")
    say(f"- {ceil.gemm_dtype} GEMM: {ceil.gemm_tflops:.1f} TFLOP/s ({256 if args.cpu_smoke else 8192}^3 "
        f"torch.matmul, random data, timed as the kernels below)")
    say()

    ctx = dict(torch=torch, device=device, timer=timer, ceil=ceil, args=args)
    rows: list[Row] = []
    stacks: list[Stack] = []
    callers: list[CallerRouted] = []
    colds: list[Cold] = []
    problems: list[str] = []
    rate_before: dict[str, float] = {}  # the GEMM rate again before each spec: how far it drifts
    sources: dict[str, str] = {}  # where each spec's configs come from
    from moegen.tune.bench import measure_gemm_tflops

    with tempfile.TemporaryDirectory(prefix="moegen-gpu-check-") as build_dir:
        for spec_name in args.spec_list:
            if timer.cuda:
                rate_before[spec_name] = measure_gemm_tflops()
                torch.cuda.empty_cache()
            try:
                cold, spec_rows, spec_stacks, spec_callers, spec_problems = bench_spec(ctx, spec_name,
                                                                                      Path(build_dir), sources)
            except Exception as exc:  # noqa: BLE001 - keep going with the other specs
                traceback.print_exc()
                problems.append(f"{spec_name}: {type(exc).__name__}: {exc}")
                gc.collect()
                if timer.cuda:
                    torch.cuda.empty_cache()
                continue
            colds.append(cold)
            rows.extend(spec_rows)
            stacks.extend(spec_stacks)
            callers.extend(spec_callers)
            problems.extend(spec_problems)
            if timer.cuda:  # what a spec leaves allocated, the next one cannot use
                print(f"  after {spec_name}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated",
                      file=sys.stderr, flush=True)

    say("## fused MoE: moegen vs peers")
    say()
    for line in results_table(rows):
        say(line)
    say()
    for line in legend(ceil, timer.cuda):
        say(line)
    if rate_before:
        say(f"- {ceil.gemm_dtype} GEMM rate measured again before each spec (the floors use the one above): "
            + ", ".join(f"{name} {rate:.1f}" for name, rate in rate_before.items()) + " TFLOP/s")
    if sources:
        say("- configs (each spec's build, for its target.gpu; the others from the cost model): "
            + "; ".join(f"{name} {source}" for name, source in sources.items()))
    for line in notes(rows):
        say(line)
    say()
    quantized = quantized_table(rows)
    if quantized:
        say("## Quantized experts against moegen's bf16")
        say()
        for line in quantized:
            say(line)
        say()
        say("- speedup: the bf16 spec's moegen time / the quantized spec's, same T, same run; time / read-only: "
            "against one streaming read of the quantized cell's floor bytes (weights, scales, activations)")
        say()
    if callers:
        say("## Callers who route themselves: fused_experts against fused_moe")
        say()
        for line in caller_routed_table(callers):
            say(line)
        say()
        say("- fused_experts is given the picks of moegen.runtime.routing.route, computed before the timing; "
            "fused_moe routes in its kernels; each one call per CUDA-graph replay, as the table above")
        say()
    if stacks:
        say(f"## In a stack of layers (T <= {STACK_MAX_TOKENS})")
        say()
        for line in stack_table(stacks):
            say(line)
        say()
        say("- us: per layer, the median replay of one CUDA graph holding every layer's call back to back, "
            "L2 evicted before the replay, divided by the layers; each layer has its own inputs, routing "
            "and copy of the experts (no layer finds another's weights in L2), as a model's graph meets "
            "them, where the table above times one call per replay, its launch included")
        say("- %floor: the layers' mean floor (as above, each from its own routing) / the time per layer; "
            "read-only: one streaming read per layer over its floor's bytes, captured the same way")
        say("- err: the worst layer's relative error after the timed replays, moegen / grouped_mm")
        say()
    say("## Cold start (first call after import)")
    say()
    for line in cold_table(colds):
        say(line)
    say()
    if not args.cpu_smoke and not args.warm_triton_cache:
        say("- from an empty Triton cache: a package built on this GPU ships its compiled kernels "
            "('kernels shipped'), so the first call only loads them; otherwise it compiles")
    if not args.cpu_smoke and not args.skip_offload:
        from tools.offload_bench import run_all

        say("## Expert offload: decode with routing replayed from real traces")
        say()
        with tempfile.TemporaryDirectory(prefix="moegen-offload-") as build_dir:
            problems.extend(run_all(args.traces, Path(build_dir), say))
        say()
    if not args.cpu_smoke and not args.skip_hf:
        from tools.hf_bench import run_all as run_hf_models

        say("## Hugging Face models: transformers with moegen's MoE blocks")
        say()
        problems.extend(run_hf_models(say))
        say()
    if problems:
        failed = True
        say("## Problems")
        say()
        for problem in problems:
            say(f"- {problem}")
        say()
    say(f"total {time.perf_counter() - wall_start:.0f} s; {'FAILED' if failed else 'OK'}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        say.write(Path(out_dir) / "gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
