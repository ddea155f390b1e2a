"""`moegen bench SPEC`: the roofline table of one spec on this machine's GPU (or, under Triton's
interpreter, a CPU smoke run of a tiny spec): moegen against its peers, each checked against the
float64 reference first, with the ceilings measured in the same process."""
from __future__ import annotations

import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from moegen import knobs
from moegen.errors import UsageError

TOKENS = (1, 8, 64, 512, 4096, 16384)
# Under the interpreter every program runs on the host: a spec beyond this many expert weights
# would take hours (specs/tiny.yaml has 35 thousand).
INTERPRETER_MAX_EXPERT_ELEMENTS = 1 << 20


def _device(spec):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if not knobs.triton_interpret():
        raise UsageError("moegen bench: it times the kernels on a CUDA GPU and this machine has none "
                         "(torch.cuda.is_available() is false); run it on the GPU, or set TRITON_INTERPRET=1 for "
                         "a smoke run of a tiny float32 spec on the CPU")
    m = spec.model
    if m.dtype == "bfloat16":
        raise UsageError(f"moegen bench {spec.name}: a bfloat16 spec on the CPU: Triton's interpreter computes bf16 dots wrongly "
                         "(triton-lang/triton#11584); bench a float32 or float16 spec such as specs/tiny.yaml there")
    if 3 * m.num_experts * m.hidden_size * m.intermediate_size > INTERPRETER_MAX_EXPERT_ELEMENTS:
        raise UsageError(f"moegen bench {spec.name}: too large for Triton's interpreter on the CPU (every kernel program runs on "
                         "the host); bench it on a GPU, or a tiny spec such as specs/tiny.yaml here")
    return torch.device("cpu")


def _build(spec_path: Path, folder: Path):
    """The spec built into folder (kernels compiled at their first call: the timed calls come after
    warm-up, and compiling every bucket into the package would only cost time) and imported."""
    from moegen import load
    from moegen.package import build

    if knobs.precompile() is None:
        with knobs.scope(MOEGEN_PRECOMPILE="0"):
            package, _ = build(spec_path, folder)
    else:
        package, _ = build(spec_path, folder)
    return load(package)


def run_bench(spec_path: str, tokens: Optional[Sequence[int]], peers: Sequence[str], quick: bool,
              as_json: bool) -> int:
    """Prints the table (or JSON); returns 1 where moegen was wrong or failed, else 0."""
    import torch
    import triton

    from moegen.bench import report
    from moegen.bench.cells import Workload, measure_row
    from moegen.bench.peers import implementations
    from moegen.bench.roofline import Timer, measure_ceilings
    from moegen.spec import load_spec
    from moegen.target import current_gpu, resolve_target

    spec = load_spec(spec_path)
    device = _device(spec)
    token_list = list(tokens or TOKENS)
    here = current_gpu()
    target = resolve_target(spec.target)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    print(f"moegen bench {spec.name} on {device_name}: building...", file=sys.stderr, flush=True)
    timer = Timer(device, quick)
    with tempfile.TemporaryDirectory(prefix="moegen-bench-") as folder:
        pkg = _build(Path(spec_path), Path(folder))
        work = Workload(pkg, device, seed=sum(map(ord, spec.name)))
        impls = {name: fn for name, fn in implementations(work).items() if name in peers}
        print("measuring the ceilings...", file=sys.stderr, flush=True)
        ceilings = measure_ceilings(timer)
        rows, problems = [], []
        for t in token_list:
            row, row_problems = measure_row(work, spec.name, t, impls, ceilings, timer)
            rows.append(row)
            problems += row_problems
            print(f"  T={t}: " + ", ".join(f"{n} {r.us:.1f} us" if r.us is not None else f"{n} n/a"
                                          for n, r in row.results.items()), file=sys.stderr, flush=True)
    context = {
        "spec": spec.name, "spec_file": str(spec_path), "device": device_name,
        "target": target.name, "tuned_for_this_gpu": here is not None and here.name == target.name,
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "python": platform.python_version()},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "weights": spec.model.quantization,
        "ceilings": {"copy_gbps": ceilings.copy_gbps, "read_gbps": ceilings.read_gbps,
                     "hbm_gbps": ceilings.hbm_gbps, "gemm_tflops": ceilings.gemm_tflops,
                     "gemm_dtype": ceilings.gemm_dtype, "fp8_tflops": ceilings.fp8_tflops},
    }
    if as_json:
        print(json.dumps({**context, "rows": [report.row_json(row) for row in rows], "problems": problems},
                         indent=2, sort_keys=True))
    else:
        _print_table(context, rows, problems, ceilings, timer.cuda)
    return 1 if problems else 0


def _print_table(context: dict, rows, problems: list[str], ceilings, on_gpu: bool) -> None:
    from moegen.bench import report

    v = context["versions"]
    print(f"# moegen bench: {context['spec']} on {context['device']}")
    print()
    print(f"- torch {v['torch']}, triton {v['triton']}, python {v['python']}; {context['date']}")
    if on_gpu and not context["tuned_for_this_gpu"]:
        print(f"- the spec targets {context['target']}: its kernel configs were chosen for that GPU, not this one "
              "(`moegen tune SPEC` here, or a spec whose target.gpu is this GPU)")
    print(f"- ceilings: {ceilings.hbm_gbps:.0f} GB/s (copy {ceilings.copy_gbps:.0f}, counting read + write; "
          f"streaming read {ceilings.read_gbps:.0f}), {ceilings.gemm_dtype} GEMM {ceilings.gemm_tflops:.1f} TFLOP/s")
    print()
    for line in report.results_table(rows) + [""] + report.legend(ceilings, on_gpu) + report.notes(rows):
        print(line)
    for problem in problems:
        print(f"- problem: {problem}")


def add_bench_parser(subparsers, parse_tokens) -> None:
    from moegen.bench.peers import IMPLS

    def peer_list(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        unknown = [name for name in names if name not in IMPLS]
        if unknown or "moegen" not in names:
            raise UsageError(f"--peers {text!r}: expected moegen and any of {', '.join(IMPLS[1:])}, comma-separated")
        return names

    b = subparsers.add_parser("bench", help="time one spec on this GPU against the roofline and its peers "
                                            "(checked against the float64 reference first)")
    b.add_argument("spec")
    b.add_argument("--tokens", help=f"comma-separated token counts (default: {','.join(map(str, TOKENS))})")
    b.add_argument("--peers", default=",".join(IMPLS),
                   help=f"implementations to time, comma-separated (default: {','.join(IMPLS)})")
    b.add_argument("--quick", action="store_true", help="fewer repeats per cell")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.set_defaults(run=lambda args: run_bench(args.spec, parse_tokens(args.tokens), peer_list(args.peers),
                                              args.quick, args.json))
