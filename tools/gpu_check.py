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
   Timing: CUDA events, warm-up then the median of repeats, with L2 evicted (a 256 MiB read)
   before each timed call; moegen and grouped_mm are captured in a CUDA graph and replays are
   timed, as serving engines run them (the naive loop synchronizes with the host, so it runs
   eagerly).
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
import functools
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SHIPPED_SPECS = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3")
TOKENS = (1, 8, 64, 512, 4096, 16384)
SMOKE_SPECS = ("tiny",)
SMOKE_TOKENS = (1, 5, 17)
REFERENCE_MAX_TOKENS = 4096  # larger T are timed but not checked against the float64 reference
IMPLS = ("moegen", "naive", "grouped_mm")
STACK_MAX_TOKENS = 512  # decode and middle cells, where a call's launch is a visible part of its time
STACK_MAX_LAYERS = 8


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
# Timing
# ---------------------------------------------------------------------------------------------


class Timer:
    """Median wall time of fn() in microseconds: on the GPU moegen.tune.bench.time_evicted (CUDA
    events, L2 evicted by a clean 256 MiB read before each timed call, outside the timed region),
    which the tuner's confirmation also times with; perf_counter on the CPU."""

    def __init__(self, torch, device, quick: bool):
        self.torch, self.device, self.quick = torch, device, quick
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def median_us(self, fn: Callable, warmup: int = 2, target_s: Optional[float] = None,
                  min_reps: Optional[int] = None, max_reps: Optional[int] = None) -> float:
        from moegen.tune.bench import JUDGED_TIMING_S, time_cpu, time_evicted

        target_s = target_s if target_s is not None else (0.08 if self.quick else JUDGED_TIMING_S)
        min_reps = min_reps if min_reps is not None else (3 if self.quick else 5)
        max_reps = max_reps if max_reps is not None else (25 if self.quick else 200)

        if self.cuda:
            return time_evicted(fn, warmup, target_s, min_reps, max_reps)
        return time_cpu(fn, repeats=min_reps)  # the CPU smoke run: only that it runs


# ---------------------------------------------------------------------------------------------
# Step 2: ceilings
# ---------------------------------------------------------------------------------------------


@dataclass
class Ceilings:
    copy_gbps: float
    read_gbps: float
    gemm_tflops: float  # timed like the kernels: the floor's rate
    gemm_dtype: str

    @property
    def hbm_gbps(self) -> float:
        return max(self.copy_gbps, self.read_gbps)


def measure_ceilings(torch, device, timer: Timer, smoke: bool) -> Ceilings:
    if timer.cuda:
        from moegen.tune.bench import measure_ceilings as measure

        copy_gbps, read_gbps, _, tflops = measure()  # the tuner's figures: its GEMM rate timed as the kernels
        torch.cuda.empty_cache()
        return Ceilings(copy_gbps, read_gbps, tflops, "bfloat16")
    # CPU smoke run: small problems, figures only to exercise the table.
    src = torch.ones(64 << 20, dtype=torch.uint8)
    t = timer.median_us(lambda: src.clone(), warmup=1, target_s=0.05)
    n = 256
    a = torch.randn(n, n)
    t_mm = timer.median_us(lambda: a @ a, warmup=1, target_s=0.05)
    tflops = 2 * n ** 3 / (t_mm * 1e6)
    return Ceilings(2 * src.numel() / (t * 1e3), src.numel() / (t * 1e3), tflops, "float32")


# ---------------------------------------------------------------------------------------------
# Step 3: the three implementations
# ---------------------------------------------------------------------------------------------


def make_peers(torch, route):
    import torch.nn.functional as F

    def activation(name):
        return F.silu if name == "silu" else F.gelu

    def naive_moe(x, logits, w13, w2, p, bias, act):
        """Route, then per expert: gather its tokens, two matmuls, weighted index_add.
        One host synchronization (the per-expert counts) decides which experts run."""
        weights, ids = route(logits, p, bias)
        t, k = ids.shape
        inter = w2.shape[-1]
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=p.num_experts).tolist()
        token = order // k
        slot_weight = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = token[start:start + n]
            h = x[rows] @ w13[expert].T
            y = (activation(act)(h[:, :inter]) * h[:, inter:]) @ w2[expert].T
            out.index_add_(0, rows, y.float() * slot_weight[start:start + n])
            start += n
        return out.to(x.dtype)

    def grouped_mm_moe(x, logits, w13, w2, p, bias, act):
        """Route, sort slots by expert, torch._grouped_mm twice, weighted scatter-add back.
        No host synchronization (counts by scatter_add, offsets as an int32 cumsum)."""
        weights, ids = route(logits, p, bias)
        t, k = ids.shape
        inter = w2.shape[-1]
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(p.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        token = order // k
        h = torch._grouped_mm(x[token], w13.transpose(-2, -1), offs=offs)
        a = activation(act)(h[:, :inter]) * h[:, inter:]
        y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token, y.float() * weights.reshape(-1)[order].unsqueeze(1))
        return out.to(x.dtype)

    return naive_moe, grouped_mm_moe


@dataclass
class Measured:
    us: Optional[float] = None
    err: Optional[float] = None
    wrong: bool = False
    graph: bool = False
    note: str = ""  # why n/a, or "eager" when graph capture failed


@dataclass
class Row:
    spec: str
    tokens: int
    floor_us: float
    bound: str
    touched: int
    results: dict = field(default_factory=dict)
    read_us: Optional[float] = None  # one streaming-read launch over the floor's bytes


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
    candidate = REPO_ROOT / "specs" / f"{name}.yaml"
    if candidate.exists():
        return candidate
    raise FileNotFoundError(f"no spec {name!r} (looked for {candidate})")


def bench_spec(ctx, spec_name: str, build_dir: Path) -> tuple[Optional[Cold], list[Row], list[Stack], list[str]]:
    torch, device, timer, ceil, args = ctx["torch"], ctx["device"], ctx["timer"], ctx["ceil"], ctx["args"]
    from moegen import load
    from moegen import reference as ref
    from moegen.package import build

    problems: list[str] = []
    start = time.perf_counter()
    folder, _ = build(resolve_spec(spec_name), build_dir)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    pkg = load(folder)
    import_ms = (time.perf_counter() - start) * 1e3

    m, p, ks = pkg.SPEC.model, pkg.KERNELS.routing, pkg.KERNELS
    dtype = ks.dtype
    elt = torch.tensor([], dtype=dtype).element_size()
    h, inter, e, k = m.hidden_size, m.intermediate_size, m.num_experts, m.top_k
    tol = ref.TOLERANCE[m.dtype]
    seed = sum(map(ord, spec_name))
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    bank = torch.empty(bank_numel(e, h, inter), device=device, dtype=dtype)
    w13, w2 = bank_views(bank, e, h, inter)
    torch.randn(w13.shape, generator=gen, out=w13).mul_(h ** -0.5)
    torch.randn(w2.shape, generator=gen, out=w2).mul_(inter ** -0.5)
    bias = ref.balanced_correction_bias(e, device) if m.correction_bias else None

    def inputs(t: int):
        x = torch.randn(t, h, generator=gen, device=device, dtype=dtype)
        logits = ref.separated_router_logits(t, p, bias, generator=cpu_gen, device=device)
        return x, logits

    # Cold start: the first call after import for every bucket (in bucket order), Triton
    # compilation included unless the build precompiled the kernels into the package.
    first_ms, second_ms, compiled = {}, {}, {}
    cold_tokens = [t for t in ks.buckets if t <= (17 if args.cpu_smoke else 1 << 30)]
    for t in cold_tokens:
        x, logits = inputs(t)
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
                pkg.fused_moe(x, logits, w13, w2, correction_bias=bias)
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

    from moegen.runtime.routing import route
    from moegen.runtime.step_graphs import capture_graph
    naive_moe, grouped_mm_moe = make_peers(torch, route)
    # Each implementation as a function of one layer's inputs and experts, for both tables.
    impls = {
        "moegen": lambda x, logits, w13, w2: pkg.fused_moe(x, logits, w13, w2, correction_bias=bias),
        "naive": lambda x, logits, w13, w2: naive_moe(x, logits, w13, w2, p, bias, m.activation),
        "grouped_mm": lambda x, logits, w13, w2: grouped_mm_moe(x, logits, w13, w2, p, bias, m.activation),
    }

    def reference(x, logits, w13, w2):
        return ref.moe_reference(x, logits, w13, w2, p, m.activation, bias)

    rows = []

    def floor_of(t: int, logits) -> Floor:
        _, ids = route(logits, p, bias)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * 3 * h * inter * elt + 2 * t * h * elt
        mem_s = nbytes / (ceil.hbm_gbps * 1e9)
        flop_s = 6 * t * k * h * inter / (ceil.gemm_tflops * 1e12)
        return Floor(max(mem_s, flop_s) * 1e6, "memory" if mem_s >= flop_s else "compute", touched, nbytes)

    for t in args.token_list:
        x, logits = inputs(t)
        floor = floor_of(t, logits)
        row = Row(spec_name, t, floor.us, floor.bound, floor.touched)
        if timer.cuda and row.bound == "memory":
            row.read_us = read_only_us(torch, device, timer, floor.nbytes)
        expected = reference(x, logits, w13, w2) if t <= REFERENCE_MAX_TOKENS else None
        calls = {name: functools.partial(impl, x, logits, w13, w2) for name, impl in impls.items()}
        for name, fn in calls.items():
            res = Measured()
            row.results[name] = res
            try:
                out = fn()
                timer.sync()
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                res.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                if name == "moegen":
                    problems.append(f"{spec_name} T={t}: moegen raised {res.note}")
                    traceback.print_exc()
                continue
            finite = bool(torch.isfinite(out).all())
            if expected is not None:
                res.err = ref.relative_error(out, expected)
            res.wrong = (not finite) or (res.err is not None and res.err > tol)
            if res.wrong and name == "moegen":
                problems.append(f"{spec_name} T={t}: moegen relative error {res.err} > {tol}")
            del out
            timed, graph = fn, None
            if timer.cuda and name != "naive":
                try:
                    graph, _ = capture_graph(fn, warmups=2)
                    timed, res.graph = graph.replay, True
                except Exception as exc:  # noqa: BLE001
                    res.note = "eager: graph capture failed"
                    print(f"[{spec_name} T={t} {name}] graph capture failed: {exc}", file=sys.stderr)
                    if name == "moegen":
                        problems.append(f"{spec_name} T={t}: moegen graph capture failed: {exc}")
                    torch.cuda.synchronize()
            try:
                res.us = timer.median_us(timed)
            except Exception as exc:  # noqa: BLE001
                res.note = f"timing failed: {type(exc).__name__}"
                if name == "moegen":
                    problems.append(f"{spec_name} T={t}: moegen timing failed: {exc}")
            del graph, timed
        rows.append(row)
        del expected, x, logits, calls
        gc.collect()
        if timer.cuda:
            torch.cuda.empty_cache()
        print(f"  {spec_name} T={t}: " + ", ".join(
            f"{n} {r.us:.1f} us" if r.us is not None else f"{n} n/a" for n, r in row.results.items()),
            file=sys.stderr, flush=True)

    stacks = []
    stack_tokens = [t for t in args.token_list if t <= STACK_MAX_TOKENS]
    if stack_tokens:
        buffers = [bank, *(bank.clone() for _ in range(stack_layers(torch, timer, bank) - 1))]
        # The naive loop synchronizes with the host, so it cannot be captured: not stacked.
        stacked = {name: impl for name, impl in impls.items() if name != "naive"}
        for t in stack_tokens:
            layers = [Layer(b, *bank_views(b, e, h, inter), *inputs(t)) for b in buffers]
            try:
                stack = bench_stack(ctx, spec_name, t, layers, stacked, reference, floor_of, tol)
            except Exception as exc:  # noqa: BLE001 - the spec's one-call rows still stand
                traceback.print_exc()
                problems.append(f"{spec_name} T={t} in a stack of layers: {type(exc).__name__}: {exc}")
                continue
            if "moegen" in stack.wrong:
                problems.append(f"{spec_name} T={t} in a stack of {stack.layers} layers: moegen relative "
                                f"error {stack.err['moegen']} > {tol}")
            stacks.append(stack)
            print(f"  {spec_name} T={t} stack of {stack.layers}: " + ", ".join(
                f"{n} {us:.1f} us" for n, us in stack.us.items()), file=sys.stderr, flush=True)
            del layers
        del buffers
    del bank, w13, w2, bias, impls
    gc.collect()
    if timer.cuda:
        torch.cuda.empty_cache()
    return cold, rows, stacks, problems


def bank_numel(e: int, h: int, inter: int) -> int:
    """Elements of one layer's experts (w13 then w2) in one buffer, with room after them for the
    activations in and out of STACK_MAX_TOKENS tokens: a stacked layer's read-only bound reads
    its floor's bytes from the start of its own buffer."""
    return 3 * e * inter * h + 2 * STACK_MAX_TOKENS * h + 64  # + 64: a 128-byte row of rounding


def bank_views(bank, e: int, h: int, inter: int):
    """(w13 [E, 2I, H], w2 [E, H, I]) as views of a bank_numel buffer."""
    w13_numel = 2 * e * inter * h
    return bank[:w13_numel].view(e, 2 * inter, h), bank[w13_numel:w13_numel + e * h * inter].view(e, h, inter)


def stack_layers(torch, timer: Timer, bank) -> int:
    """Layers of a stack: STACK_MAX_LAYERS where three quarters of the free memory holds their
    copies of the experts, fewer where it does not (DeepSeek-V3's are 22.5 GB a layer), at least 2."""
    if not timer.cuda:
        return 2
    free, _ = torch.cuda.mem_get_info()
    copies = int(0.75 * free // (bank.numel() * bank.element_size()))
    return 1 + max(1, min(STACK_MAX_LAYERS - 1, copies))


@dataclass
class Floor:
    us: float
    bound: str  # "memory" or "compute"
    touched: int  # distinct experts the routing chose
    nbytes: int  # the memory floor's bytes


@dataclass
class Layer:
    bank: object  # the buffer w13 and w2 view
    w13: object
    w2: object
    x: object
    logits: object


def bench_stack(ctx, spec_name: str, t: int, layers: list[Layer], impls: dict, reference: Callable,
                floor_of: Callable, tol: float) -> Stack:
    """Each impl's layers captured back to back in one CUDA graph (run eagerly on the CPU),
    checked after the timed replays against the float64 reference; and the read-only bound the
    same way: one streaming read per layer over its floor's bytes, from its own buffer."""
    torch, timer = ctx["torch"], ctx["timer"]
    from moegen import reference as ref
    from moegen.runtime.step_graphs import capture_graph

    floors = [floor_of(t, layer.logits) for layer in layers]
    stack = Stack(spec_name, t, len(layers), sum(f.us for f in floors) / len(layers))
    expected = [reference(layer.x, layer.logits, layer.w13, layer.w2) for layer in layers]
    for name, impl in impls.items():
        def run():
            return [impl(layer.x, layer.logits, layer.w13, layer.w2) for layer in layers]

        graph, outs = capture_graph(run, warmups=2) if timer.cuda else (None, run())
        stack.us[name] = timer.median_us(graph.replay if graph else run) / len(layers)
        timer.sync()
        stack.err[name] = max(ref.relative_error(out, want) for out, want in zip(outs, expected))
        if not stack.err[name] <= tol:
            stack.wrong.add(name)
        del graph, outs
    if timer.cuda and all(f.bound == "memory" for f in floors):
        # The bank's slack after the experts covers the rounding up to whole rows.
        spans = [layer.bank[:whole_rows_numel(f.nbytes, layer.bank.element_size())]
                 for layer, f in zip(layers, floors)]
        stack.us["read-only"] = fastest_read_us(timer, spans)
    return stack


def read_only_us(torch, device, timer: Timer, nbytes: int) -> float:
    """The fastest streaming read (moegen.tune.bench.streaming_reads) of nbytes in one launch, as
    a CUDA-graph replay with L2 evicted first: the launch, ramp-up and drain that any single
    kernel reading those bytes pays."""
    src = torch.empty(whole_rows_numel(nbytes, 2), dtype=torch.bfloat16, device=device)  # contents do not matter
    best = fastest_read_us(timer, [src])
    del src
    torch.cuda.empty_cache()
    return best


def whole_rows_numel(nbytes: int, element_size: int) -> int:
    """Elements of the whole 128-byte rows that cover nbytes (at most 126 bytes more): the TMA
    reader reads whole rows."""
    return -(-nbytes // 128) * 128 // element_size


def fastest_read_us(timer: Timer, spans: list) -> float:
    """Microseconds per span of one graph that reads every span in turn, one launch each, with
    the fastest of moegen.tune.bench.streaming_reads."""
    from moegen.runtime.step_graphs import capture_graph
    from moegen.tune.bench import streaming_reads

    readers = [streaming_reads(span) for span in spans]
    best = math.inf
    for kind in range(min(map(len, readers))):
        def read_all(kind=kind):
            for per_span in readers:
                per_span[kind]()

        graph, _ = capture_graph(read_all)
        best = min(best, timer.median_us(graph.replay))
        del graph
    return best / len(spans)


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def fmt_us(us: float) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def fmt_err(err: Optional[float]) -> str:
    return "-" if err is None else ("inf" if math.isinf(err) else f"{err:.1e}")


def fmt_pct(floor_us: float, us: float) -> str:
    # One decimal, rounded down: a cell at 84.5% or 84.96% must not read as a met 85% line.
    return f"{math.floor(1000 * floor_us / us + 1e-9) / 10:.1f}%"


def cells(res: Optional[Measured], floor_us: float) -> tuple[str, str]:
    if res is None or res.us is None:
        return "n/a", ""
    time_cell = fmt_us(res.us)
    if res.note.startswith("eager"):
        time_cell += " (eager)"
    if res.wrong:
        time_cell += " **WRONG**"
    return time_cell, fmt_pct(floor_us, res.us)


def results_table(rows: list[Row]) -> list[str]:
    out = ["| spec | T | moegen us | %floor | naive us | %floor | grouped_mm us | %floor | floor us | bound "
           "| read-only us | %floor | err |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for row in rows:
        parts = [row.spec, str(row.tokens)]
        for name in IMPLS:
            parts.extend(cells(row.results.get(name), row.floor_us))
        errs = " / ".join(fmt_err(row.results[n].err) if n in row.results else "-" for n in IMPLS)
        read = (fmt_us(row.read_us), fmt_pct(row.floor_us, row.read_us)) if row.read_us else ("-", "-")
        parts += [fmt_us(row.floor_us), row.bound, *read, errs]
        out.append("| " + " | ".join(parts) + " |")
    return out


def stack_table(stacks: list[Stack]) -> list[str]:
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

    timer = Timer(torch, device, args.quick)
    ceil = measure_ceilings(torch, device, timer, args.cpu_smoke)
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
    colds: list[Cold] = []
    problems: list[str] = []
    rate_before: dict[str, float] = {}  # the GEMM rate again before each spec: how far it drifts
    from moegen.tune.bench import measure_gemm_tflops

    with tempfile.TemporaryDirectory(prefix="moegen-gpu-check-") as build_dir:
        for spec_name in args.spec_list:
            if timer.cuda:
                rate_before[spec_name] = measure_gemm_tflops()
                torch.cuda.empty_cache()
            try:
                cold, spec_rows, spec_stacks, spec_problems = bench_spec(ctx, spec_name, Path(build_dir))
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
            problems.extend(spec_problems)

    say("## fused MoE: moegen vs peers")
    say()
    for line in results_table(rows):
        say(line)
    say()
    say("- us: median wall time of one call, routing included"
        + ("" if args.cpu_smoke else "; moegen and grouped_mm as CUDA-graph replays, naive eagerly (it "
           "synchronizes with the host); L2 evicted before each call"))
    say("- %floor: floor / time (100% = at the roofline floor); floor = max((distinct experts touched "
        "x 3*H*I + 2*T*H) bytes / bandwidth, 6*T*k*H*I FLOPs / GEMM rate), with the measured ceilings")
    say("- read-only: memory-bound cells only, one launch of the fastest streaming read (a load-instruction "
        "kernel; on Hopper also a TMA reader) over exactly the floor's bytes, timed as moegen: what a kernel "
        "that does nothing but read them takes")
    say(f"- err: relative Frobenius error vs the float64 reference, moegen / naive / grouped_mm; "
        f"checked for T <= {REFERENCE_MAX_TOKENS} only ('-' above: the reference is too slow there); "
        "**WRONG**: above the dtype's tolerance or not finite")
    if rate_before:
        say(f"- {ceil.gemm_dtype} GEMM rate measured again before each spec (the floors use the one above): "
            + ", ".join(f"{name} {rate:.1f}" for name, rate in rate_before.items()) + " TFLOP/s")
    notes = sorted({f"{r.spec} T={r.tokens} {n}: {res.note}" for r in rows for n, res in r.results.items()
                    if res.note and not res.note.startswith("eager")})
    for note in notes:
        say(f"- n/a {note}")
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
