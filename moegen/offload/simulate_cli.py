"""`moegen simulate SPEC --trace FILE --slots N [--policy NAME] [--lookahead L] [--json]`.

Replays a recorded routing trace through the expert-offload policies (moegen.offload.simulate) with
the spec's expert size, decode compute floor and host link. Results go to stdout (one JSON object
with --json, else a table), notes and progress to stderr. Bad input raises SimulateInputError
(exit code 2); a bad trace file raises TraceError (exit code 2).
"""
from __future__ import annotations

import json
import math
import sys

from moegen.errors import MoegenError
from moegen.offload.simulate import PRESETS, REQUIRED


class SimulateInputError(MoegenError):
    exit_code = 2


def add_simulate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="replay a routing trace through the expert-offload cache policies",
        description="Replay a moegen-trace v1 file through the expert cache policies: hit rate, bytes "
                    "moved and stall per token with the spec's expert size, compute floor and host link. "
                    "lru and belady are always included as reference points.",
        epilog="hit rate: accesses whose expert was resident or already being prefetched when the token reached "
               "the layer; bytes: all host-to-GPU copies; stall_ms: mean milliseconds per token that compute "
               "waits for copies (one FIFO link at the target's host_link_gbps, layers computing at the cost "
               "model's one-token floor). See moegen/offload/simulate.py.")
    p.add_argument("spec", help="spec file (expert size, top-k and target GPU)")
    p.add_argument("--trace", required=True, help="routing trace (moegen-trace v1, .jsonl.gz)")
    p.add_argument("--slots", required=True,
                   help="GPU expert slots per layer: a count (4) or a fraction of num_experts (0.25; rounded, "
                        "at least top_k)")
    p.add_argument("--policy", help=f"simulate only this policy (and lru, belady); one of: {', '.join(PRESETS)}")
    p.add_argument("--lookahead", type=int, default=1,
                   help="issue prefetches this many layers before they are needed (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_simulate)


def parse_slots(text: str, num_experts: int, top_k: int) -> int:
    """'4' -> 4 slots; '0.25' -> 25% of num_experts, rounded half up, at least top_k."""
    fix = f"pass a count in {top_k}..{num_experts} (top_k..num_experts) or a fraction in (0, 1], e.g. 0.25"
    try:
        value = float(text)
    except ValueError:
        raise SimulateInputError(f"--slots {text!r}: not a number; {fix}") from None
    if text.strip().lstrip("+").isdigit():
        slots = int(value)
    elif 0 < value <= 1:
        slots = max(top_k, math.floor(value * num_experts + 0.5))
    else:
        raise SimulateInputError(f"--slots {text!r}: neither a whole count nor a fraction in (0, 1]; {fix}")
    if slots < top_k:
        raise SimulateInputError(f"--slots {text!r}: {slots} slots per layer cannot hold the {top_k} experts "
                                 f"one token needs; {fix}")
    if slots > num_experts:
        raise SimulateInputError(f"--slots {text!r}: more slots than the model's {num_experts} experts; {fix}")
    return slots


def run_simulate(args) -> int:
    from moegen.offload.simulate import link_model, simulate_all
    from moegen.offload.trace import load_trace
    from moegen.spec import load_spec

    spec = load_spec(args.spec)
    m = spec.model
    if args.policy is not None and args.policy not in PRESETS:
        raise SimulateInputError(f"--policy {args.policy!r}: unknown policy; use one of: {', '.join(PRESETS)}")
    if args.lookahead < 1:
        raise SimulateInputError(f"--lookahead {args.lookahead}: must be at least 1 layer")
    trace = load_trace(args.trace)
    for field in ("num_experts", "top_k"):
        if getattr(trace, field) != getattr(m, field):
            raise SimulateInputError(
                f"{args.trace}: the trace has {field} {getattr(trace, field)} but {args.spec} says "
                f"model.{field}: {getattr(m, field)}; simulate with the spec of the model that recorded the trace")
    if trace.num_layers != m.num_layers:
        print(f"note: {args.trace} has {trace.num_layers} MoE layers, {args.spec} says {m.num_layers}; "
              f"simulating the trace's {trace.num_layers}", file=sys.stderr)
    slots = parse_slots(args.slots, m.num_experts, m.top_k)
    policies = list(PRESETS) if args.policy is None else \
        [p for p in PRESETS if p in REQUIRED or p == args.policy]
    link = link_model(spec)
    results = simulate_all(trace, slots, link, policies, args.lookahead,
                           progress=lambda name: print(f"simulating {name} ...", file=sys.stderr))
    if args.json:
        print(json.dumps({"trace": args.trace, "slots_per_layer": slots,
                          "policies": {name: r.to_json() for name, r in results.items()}}, sort_keys=True))
        return 0
    print(f"{args.trace}: {trace.num_tokens} tokens, {trace.num_layers} layers, top-{trace.top_k} of "
          f"{trace.num_experts}; {slots} slots per layer; expert {link.expert_bytes / 2**20:.1f} MiB, "
          f"copy {link.transfer_ms:.3f} ms, layer compute {link.layer_ms * 1e3:.1f} us")
    print(format_table(results))
    return 0


def format_table(results: dict) -> str:
    lru, belady = results["lru"].hit_rate, results["belady"].hit_rate
    rows = [["policy", "online", "hit rate", "gap closed", "timely hits", "GB moved", "stall ms/token"]]
    for name, r in results.items():
        gap = f"{(r.hit_rate - lru) / (belady - lru):.0%}" if belady > lru else "-"
        rows.append([name, "yes" if r.online else "no", f"{r.hit_rate:.3f}", gap, f"{r.timely_hit_rate:.3f}",
                     f"{r.bytes / 1e9:.1f}", f"{r.stall_ms:.2f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    notes = ("gap closed: share of the LRU -> Belady hit-rate gap; timely hits: hits whose copy had "
             "finished when the layer started (the rest stall)")
    return "\n".join(lines + [notes])
