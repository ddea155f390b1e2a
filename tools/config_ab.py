"""Time a spec's tuned entries against variants of them, on the GPU, as gpu_check times a call.

For each bucket, the database's entry for this GPU (or, where the bucket has none, the entry of
the nearest smaller bucket, which is what the package launches there) and each variant of it: the
entry with some fields replaced. Every config is checked against the float64 reference first;
then each is timed from an evicted L2 on the tuner's routing samples, in turns, and its mean
is printed beside the entry's. A variant the format or the device refuses is reported, not run.

    PYTHONPATH=. python tools/config_ab.py specs/mixtral-8x7b-int4.yaml --tokens 4096,16384 \\
        --variant int4_swapped=1 --variant int4_swapped=1,block_n=128,num_warps=8

What this measures says whether a re-tune (`moegen tune SPEC --buckets ... --force`) is worth
its device time after a new tuned option lands (docs/PERFORMANCE.md, the ideas table).
"""
from __future__ import annotations

import argparse
import dataclasses
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
            raise SystemExit(f"error: --variant {text!r}: {item!r} is not FIELD=VALUE with FIELD one of {sorted(types)}")
        overrides[name] = value.lower() in ("1", "true") if types[name] in (bool, "bool") else int(value)
    return overrides


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec")
    parser.add_argument("--tokens", required=True, help="comma-separated token counts")
    parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE,...",
                        help="fields replaced in the entry (repeatable)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))

    import torch

    from moegen.ir import lower
    from moegen.plan.configs import fit_format, violation
    from moegen.render import kernel_templates
    from moegen.spec import load_spec
    from moegen.target import current_gpu
    from moegen.tune import bench, db as tuning_db
    from moegen.tune.runner import CONFIRM_SAMPLES, _load_kernels, _Problem, _Sample, _Search, _weights

    if not torch.cuda.is_available():
        raise SystemExit("error: config_ab times kernels on a CUDA GPU")
    variants = [parse_variant(v) for v in args.variant]
    spec = load_spec(args.spec)
    ir = dataclasses.replace(lower(spec, args.spec), target=current_gpu())
    sig, gpu = ir.signature, ir.target
    db = tuning_db.TuningDb()
    tuned = sorted(t for t in spec.workload.token_buckets
                   if db.lookup(gpu, sig, t, kernel_templates(sig)) is not None)
    ceilings = bench.measure_ceilings()[2:]
    print(f"## {spec.name} on {gpu.name}: entries against variants (mean us over {CONFIRM_SAMPLES} routings, "
          f"L2 evicted)\n")
    print("| tokens | config | us | vs entry | % of floor |\n|---:|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="moegen-ab-") as workdir:
        kernels = _load_kernels(ir, Path(workdir))
        weights = _weights(ir, "cuda")
        for tokens in (int(t) for t in args.tokens.split(",")):
            below = [t for t in tuned if t <= tokens]
            if not below:
                print(f"| {tokens} | no entry at or below this bucket | | | |")
                continue
            entry = db.lookup(gpu, sig, below[-1], kernel_templates(sig)).config
            problem = _Problem(ir, tokens, weights, "cuda", ceilings)
            samples = [problem] + [_Sample(ir, tokens, weights, "cuda", seed=tokens + 1000 * s)
                                   for s in range(1, CONFIRM_SAMPLES)]
            search = _Search(kernels, problem, True, {}, lambda line: print(line, file=sys.stderr))
            configs = [entry]
            for overrides in variants:
                config = fit_format(dataclasses.replace(entry, **overrides), sig)
                refused = violation(config, sig, gpu)
                if refused:
                    print(f"| {tokens} | `{config.key}` refused: {refused} | | | |")
                elif config not in configs:
                    configs.append(config)
            ran = [c for c in configs if search.measure(c) < float("inf")]
            means = search.judged_means(ran, samples)
            for config in configs:
                if config not in means:
                    print(f"| {tokens} | `{config.key}` failed: {search.failures.get(config.key, '')} | | | |")
                    continue
                ratio = f"{means[config] / means[entry]:.3f}" if entry in means else ""
                label = f"`{config.key}`" + (f" (entry of {below[-1]})" if config == entry else "")
                print(f"| {tokens} | {label} | {means[config]:.1f} | {ratio} | "
                      f"{100 * problem.floor_us / means[config]:.1f} |", flush=True)
            del problem, samples
    return 0


if __name__ == "__main__":
    sys.exit(main())
