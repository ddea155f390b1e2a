"""Time a spec's tuned entries against variants of them, on the GPU, as gpu_check times a call.

For each token count, the database's entry for this GPU at that bucket (or else the nearest
smaller bucket's: beyond the spec's largest bucket, what the package launches; between two
buckets the package launches the larger one's config, so pass buckets; the cost model's config
where no bucket at or below has an entry) and each variant of it: the entry with some fields
replaced. Every config is checked against the float64 reference first; then each is timed from
an evicted L2 on the tuner's routing samples, in turns, and its mean is printed beside the
entry's. A variant the format or the device refuses is reported, not run.

    PYTHONPATH=. python tools/config_ab.py specs/mixtral-8x7b-int4.yaml --tokens 4096,16384 \\
        --variant int4_swapped=1 --variant int4_swapped=1,block_n=128,num_warps=8

With --profile, each config that ran is called once more between cudaProfilerStart and
cudaProfilerStop, for Nsight Compute to profile just those calls' kernels:

    ncu --clock-control none --profile-from-start off --csv --page details --log-file ncu.csv \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
        python tools/config_ab.py specs/qwen3-30b-a3b-int4.yaml --tokens 1 --profile

With --templates DIR (an edited copy of templates/), each entry also runs on the kernels DIR
renders, checked and timed in the same turns: the A/B of a template edit, old tree against new,
that a change of the GEMMs needs before the shipped entries are re-stamped (docs/DESIGN.md).

What this measures says whether a re-tune (`moegen tune SPEC --buckets ... --refine`) is worth
its device time after a new tuned option lands (docs/PERFORMANCE.md, the ideas table).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_variant(text: str) -> dict:
    """'field=value,...' -> {field: typed value}, typed by KernelConfig's fields."""
    from moegen.runtime.fused import KernelConfig

    types = {f.name: f.type for f in dataclasses.fields(KernelConfig)}
    overrides = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in types or not value:
            raise SystemExit(f"error: --variant {text!r}: {item!r} is not FIELD=VALUE with FIELD one of "
                             f"{sorted(types)}")
        overrides[name] = value.lower() in ("1", "true") if types[name] in (bool, "bool") else int(value)
    return overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec")
    parser.add_argument("--tokens", required=True, help="comma-separated token counts")
    parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE,...",
                        help="fields replaced in the entry (repeatable)")
    parser.add_argument("--cpu-smoke", action="store_true", help="on the CPU, in Triton's interpreter (tiny specs)")
    parser.add_argument("--templates", type=Path, metavar="DIR",
                        help="an edited copy of templates/: each entry also runs on the kernels it renders")
    parser.add_argument("--profile", action="store_true",
                        help="then one more call of each config between cudaProfilerStart and Stop (for ncu)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(REPO_ROOT))

    import torch

    from moegen import knobs
    from moegen.ir import lower
    from moegen.plan.configs import default_config, fit_format, violation
    from moegen.spec import load_spec
    from moegen.target import current_gpu
    from moegen.tune import bench, db as tuning_db
    from moegen.tune.runner import (CONFIRM_SAMPLES, _load_kernels, _Problem, _Sample, _Search, _weights,
                                    judged_means, nearest_entry)

    on_gpu = torch.cuda.is_available()
    if not (on_gpu or args.cpu_smoke):
        raise SystemExit("error: config_ab times kernels on a CUDA GPU (or, with --cpu-smoke, in the interpreter)")
    device = "cuda" if on_gpu else "cpu"
    variants = [parse_variant(v) for v in args.variant]
    spec = load_spec(args.spec)
    ir = dataclasses.replace(lower(spec, args.spec), target=current_gpu())
    sig, gpu = ir.signature, ir.target
    db = tuning_db.TuningDb()
    ceilings = bench.measure_ceilings()[2:] if on_gpu else (gpu.hbm_gbps, gpu.bf16_tflops)
    samples = CONFIRM_SAMPLES if on_gpu else 1  # the interpreter's times mean nothing: one routing
    print(f"## {spec.name} on {gpu.name}: entries against variants (mean us over {samples} routings, "
          f"L2 evicted)\n")
    print("| tokens | config | us | vs entry | % of floor |\n|---:|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="moegen-ab-") as workdir:
        kernels = _load_kernels(ir, Path(workdir))
        edited = None  # the kernels of --templates, a package of its own name
        if args.templates:
            with knobs.scope(MOEGEN_TEMPLATE_DIR=str(args.templates.resolve())):
                edited_ir = dataclasses.replace(ir, spec=dataclasses.replace(ir.spec, name=f"{spec.name}-edited"))
                edited = _load_kernels(edited_ir, Path(workdir))
        weights = _weights(ir, device)
        for tokens in (int(t) for t in args.tokens.split(",")):
            found = nearest_entry(db, gpu, ir, tokens)
            entry = found[1] if found else default_config(sig, gpu, tokens)
            source = f"entry of {found[0]}" if found else "cost model"
            problem = _Problem(ir, tokens, weights, device, ceilings)
            routings = [problem] + [_Sample(ir, tokens, weights, device, seed=tokens + 1000 * s)
                                    for s in range(1, samples)]
            search = _Search(kernels, problem, on_gpu, {}, lambda line: print(line, file=sys.stderr))
            configs = [entry]
            for overrides in variants:
                config = fit_format(dataclasses.replace(entry, **overrides), sig)
                refused = violation(config, sig, gpu)
                if refused:
                    print(f"| {tokens} | `{config.key}` refused: {refused} | | | |")
                elif config not in configs:
                    configs.append(config)
            # Rows: (label, search, config); the edited templates' entry after the repository's.
            rows = [(f"`{c.key}`" + (f" ({source})" if c == entry else ""), search, c) for c in configs]
            if edited is not None:
                edited_search = _Search(edited, problem, on_gpu, {}, lambda line: print(line, file=sys.stderr))
                rows.insert(1, (f"`{entry.key}` ({source}, {args.templates} templates)", edited_search, entry))
            ran = [row for row in rows if row[1].measure(row[2]) < float("inf")]
            means = judged_means({label: (timed_by, config) for label, timed_by, config in ran}, routings)
            entry_label = rows[0][0]
            for label, timed_by, config in rows:
                if label not in means:
                    print(f"| {tokens} | {label} failed: {timed_by.failures.get(config.key, '')} | | | |")
                    continue
                ratio = f"{means[label] / means[entry_label]:.3f}" if entry_label in means else ""
                print(f"| {tokens} | {label} | {means[label]:.1f} | {ratio} | "
                      f"{100 * problem.floor_us / means[label]:.1f} |", flush=True)
            if args.profile and on_gpu:
                for _, timed_by, config in ran:  # in the order of the table's rows
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    timed_by._call(config, problem)
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
            del problem, routings
    return 0


if __name__ == "__main__":
    sys.exit(main())
