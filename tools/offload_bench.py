"""Expert-offload benchmark on the GPU, run by tools/gpu_check.py (section "Expert offload").

A stack of the first `layers` MoE layers of a model, its experts in pinned host memory, decodes
with routing replayed from a real trace at several residencies: tokens/s against the same stack
all-resident and against the physical floor (bytes actually moved / measured host-link
bandwidth + the all-resident compute), stall time and the share of transfer time hidden.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moegen import knobs, load
from moegen.ir import lower
from moegen.offload.trace import load_trace
from moegen.package import build
from moegen.plan.offload import plan_offload
from moegen.runtime import fused
from moegen.runtime.host_experts import HostExperts
from moegen.offload.engine import engine_for_plan, routing_predictor
from moegen.runtime.offload import OffloadedMoE
from moegen.runtime.step_graphs import StepGraphs
from moegen.spec import load_spec

CASES = (  # spec, trace, MoE layers in the stack, tokens replayed
    ("mixtral-8x7b", "mixtral-8x7b-gsm8k.jsonl.gz", 8, 244),
    ("deepseek-v2-lite", "deepseek-v2-lite-intent.jsonl.gz", 8, 300),
)
RESIDENCIES = (0.25, 0.5, 0.75)
# Quantized experts at the same expert memory budgets as the case's bf16 ones (which then hold
# about four times as many int4 experts): spec name -> quantization.
QUANTIZED = {"mixtral-8x7b": "int4_group"}
# name: (eviction policy, prefetch predictor). Demand-fetch LRU; decayed LFU with the
# nearest-tokens prefetch within LRU's bytes (the best hit rate of `moegen simulate` on the shared
# traces); the same predictor guiding the evictions only (the fewest bytes: link-bound stacks).
POLICIES = {"lru": ("lru", "none"), "neighbors": ("decayed_lfu", "neighbors"), "neighbor_lfu": ("neighbor_lfu", "none")}


def engine_for(policy: str, plan):
    evict, predictor = POLICIES[policy]
    return engine_for_plan(plan, evict, routing_predictor(predictor, plan.num_layers, plan.num_experts))


@dataclass
class OffloadRow:
    case: str
    residency: str
    policy: str
    tokens_per_s: float
    resident_tokens_per_s: float
    floor_tokens_per_s: float
    hit_rate: float
    gib_moved: float
    stall_ms_per_token: float
    hidden_pct: float
    peak_pool_gib: float
    budget_gib: float
    max_rel_diff: float


def measure_h2d_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - start) / 1e9


def _random_host_experts(pkg, layers: int, generator) -> HostExperts:
    m = pkg.SPEC.model
    host = HostExperts.empty(layers, m.num_experts, m.hidden_size, m.intermediate_size, pkg.KERNELS.dtype)
    for layer in range(layers):  # drawn on the GPU, one layer at a time, then copied to pinned memory
        host.w13[layer].copy_(torch.randn(host.w13[layer].shape, device="cuda", generator=generator,
                                          dtype=torch.bfloat16).mul_(m.hidden_size ** -0.5))
        host.w2[layer].copy_(torch.randn(host.w2[layer].shape, device="cuda", generator=generator,
                                         dtype=torch.bfloat16).mul_(m.intermediate_size ** -0.5))
    return host


def _decode(step, tokens: int, layers: int, on_sequence_start=None, seq=None) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for t in range(tokens):
        if on_sequence_start is not None and t > 0 and seq[t] != seq[t - 1]:
            on_sequence_start()
        for layer in range(layers):
            step(t, layer)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_case(spec_name: str, trace_path: Path, layers: int, tokens: int, build_dir: Path,
               policies: tuple[str, ...] = tuple(POLICIES), quantization: str = "none") -> list[OffloadRow]:
    """Decoding the trace through the stack; with a quantization, the experts stored in it, at the
    budgets that hold the bf16 experts' residencies."""
    spec_path = Path(__file__).resolve().parent.parent / "specs" / f"{spec_name}.yaml"
    if quantization != "none":  # the spec with quantized experts
        text = spec_path.read_text().replace("quantization: none", f"quantization: {quantization}")
        spec_path = build_dir / f"{spec_name}-{quantization}.yaml"
        spec_path.write_text(text.replace(f"name: {spec_name}", f"name: {spec_name}-{quantization}"))
    with knobs.scope(MOEGEN_PRECOMPILE="0"):  # cold start is measured elsewhere; save the compile
        pkg = load(build(spec_path, build_dir)[0])
    ks, m = pkg.KERNELS, pkg.SPEC.model
    trace = load_trace(trace_path)
    tokens = min(tokens, trace.num_tokens)
    ids = torch.from_numpy(trace.experts[:tokens, :layers].astype("int64")).cuda()  # [T, L, k]
    weights = torch.full((1, m.top_k), 1.0 / m.top_k, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    host = _random_host_experts(pkg, layers, generator)
    unquantized_expert_bytes = host.expert_bytes
    if ks.weight_format.quantized:
        host = host.quantized(ks.weight_format)
    x = torch.randn(tokens, 1, m.hidden_size, device="cuda", generator=generator, dtype=torch.bfloat16)

    # All resident: the same stack with every expert on the GPU, each layer's step a CUDA graph
    # as in the offloaded runtime.
    resident = [{name: parts[l].cuda() for name, parts in host.parts.items()} for l in range(layers)]
    resident_out = {}
    graphs = StepGraphs("cuda")

    def resident_step(t, layer):
        experts = functools.partial(fused.fused_experts, ks, **resident[layer])
        out = graphs(layer, experts, x[t], weights, ids[t, layer].view(1, -1))
        if t < 4:
            resident_out[(t, layer)] = out

    for layer in range(layers):  # capture the graphs before the clock starts
        resident_step(0, layer)
    resident_s = _decode(resident_step, tokens, layers)
    compute_s_per_token = resident_s / tokens
    del resident, graphs
    torch.cuda.empty_cache()
    link_gbps = measure_h2d_gbps()

    ir = lower(load_spec(spec_path), spec_path)
    ir = replace(ir, spec=replace(ir.spec, model=replace(ir.spec.model, num_layers=layers)))
    rows = []
    for residency in RESIDENCIES:
        # The budget that holds this share of the bf16 experts; quantized experts fill it with more.
        budget_gib = layers * max(m.top_k, round(m.num_experts * residency)) * unquantized_expert_bytes / 2**30
        slots = min(m.num_experts, int(budget_gib * 2**30 // (layers * host.expert_bytes)))
        # A hair over the pools, so the plan's floor division gives every layer `slots`.
        plan_gib = (layers * slots + 0.5) * host.expert_bytes / 2**30
        ir_budget = replace(ir, spec=replace(ir.spec, target=replace(ir.spec.target, expert_memory_gib=plan_gib)))
        for policy in policies:
            plan = plan_offload(ir_budget)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            runtime = OffloadedMoE(ks, plan, host, engine_for(policy, plan))
            runtime.capture(x[0], weights, ids[0, 0].view(1, -1))
            pool_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
            diffs = []

            def step(t, layer):
                out = runtime.forward(layer, x[t], weights, ids[t, layer].view(1, -1))
                if (t, layer) in resident_out:
                    ref = resident_out[(t, layer)].float()
                    diffs.append(float((out.float() - ref).norm() / ref.norm()))

            seconds = _decode(step, tokens, layers, on_sequence_start=runtime.begin_sequence, seq=trace.seq)
            peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
            s = runtime.stats
            transfer_s = s.bytes_moved / (link_gbps * 1e9)
            stall_s = runtime.stall_s
            floor_s = transfer_s + compute_s_per_token * tokens
            rows.append(OffloadRow(
                case=f"{spec_name} x{layers} layers" + (f" ({quantization})" if quantization != "none" else ""),
                residency=f"{slots}/{m.num_experts}", policy=policy,
                tokens_per_s=tokens / seconds, resident_tokens_per_s=tokens / resident_s,
                floor_tokens_per_s=tokens / floor_s, hit_rate=s.hit_rate, gib_moved=s.bytes_moved / 2**30,
                stall_ms_per_token=1e3 * stall_s / tokens,
                hidden_pct=100.0 * max(0.0, 1.0 - stall_s / transfer_s) if transfer_s else 100.0,
                peak_pool_gib=max(pool_gib, peak_gib), budget_gib=budget_gib,
                max_rel_diff=max(diffs) if diffs else float("nan"),
            ))
            del runtime
            torch.cuda.empty_cache()
    return rows


def run_all(traces_dir: Path, build_dir: Path, say) -> list[str]:
    """Every case; returns problems (a case that fails does not stop the others)."""
    problems, rows = [], []
    for spec_name, trace_name, layers, tokens in CASES:
        trace_path = traces_dir / trace_name
        if not trace_path.exists():
            problems.append(f"offload {spec_name}: no trace {trace_path} (pass --traces DIR)")
            continue
        try:
            rows += bench_case(spec_name, trace_path, layers, tokens, build_dir)
            if spec_name in QUANTIZED:
                rows += bench_case(spec_name, trace_path, layers, tokens, build_dir, quantization=QUANTIZED[spec_name])
        except Exception as error:  # noqa: BLE001 - report and go on
            import traceback

            traceback.print_exc()
            problems.append(f"offload {spec_name}: {type(error).__name__}: {error}")
        torch.cuda.empty_cache()
    for line in table(rows, f"{measure_h2d_gbps():.1f} GB/s measured"):
        say(line)
    return problems


def table(rows: list[OffloadRow], link_note: str) -> list[str]:
    out = ["| stack | resident | policy | tok/s | all-resident tok/s | floor tok/s | % of floor | hit rate | "
           "GiB moved | stall ms/token | transfer hidden | peak expert GiB (budget) | max rel diff vs resident |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        out.append(f"| {r.case} | {r.residency} | {r.policy} | {r.tokens_per_s:.1f} | {r.resident_tokens_per_s:.1f} | "
                   f"{r.floor_tokens_per_s:.1f} | {100 * r.tokens_per_s / r.floor_tokens_per_s:.0f}% | "
                   f"{r.hit_rate:.3f} | {r.gib_moved:.1f} | {r.stall_ms_per_token:.2f} | {r.hidden_pct:.0f}% | "
                   f"{r.peak_pool_gib:.2f} ({r.budget_gib:.2f}) | {r.max_rel_diff:.1e} |")
    out.append("")
    out.append(f"- floor = bytes moved / measured pinned host-to-device bandwidth ({link_note}) + the "
               "all-resident compute time; transfer hidden = 1 - stall / transfer time")
    return out
