"""moegen command line. Exit codes: 0 ok, 1 failure, 2 bad input (spec or arguments)."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from pathlib import Path

from moegen import knobs
from moegen.errors import MoegenError, UsageError
from moegen.spec.schema import DTYPES, INT4_GROUP_SIZES, OFFLOAD_POLICIES, PREFETCH_MODES, QUANTIZATIONS
from moegen.bench.command import add_bench_parser
from moegen.offload.simulate_cli import add_simulate_parser
from moegen.tune.cache_cli import add_cache_parser


def _cmd_validate(args) -> int:
    from moegen.spec import load_spec

    spec = load_spec(args.spec)
    m = spec.model
    experts = m.dtype if m.quantization == "none" else f"{m.dtype}, experts {m.weight_format.key}"
    print(f"{args.spec}: ok ({spec.name}: E={m.num_experts}, top-{m.top_k}, H={m.hidden_size}, "
          f"I={m.intermediate_size}, {experts}, package {spec.package_name})")
    return 0


def _token_counts(text: str | None, flag: str = "--buckets"):
    if text is None:
        return None
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UsageError(f"{flag} {text!r}: expected comma-separated token counts of at least 1, e.g. 1,8,64")
    return counts



def _output_folder(text: str) -> Path:
    """-o: a folder, created if missing; checked before a tune or build spends any time."""
    fix = "pass a folder (created if missing)"
    if not text.strip():
        raise UsageError(f"-o {text!r}: empty; {fix}")
    path = Path(text)
    try:
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if existing.is_symlink() and not existing.exists():
            raise UsageError(f"-o {text}: {existing} is a link to nothing; {fix}")
        if not existing.is_dir():
            raise UsageError(f"-o {text}: {existing} is a file, not a folder; {fix}")
    except OSError as error:  # a name too long, a loop of links
        raise UsageError(f"-o {text}: unusable ({error.strerror}); {fix}") from None
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"-o {text}: {existing} is a folder moegen may not write to; build elsewhere")
    return path


def _cmd_tune(args) -> int:
    from moegen.tune.runner import tune

    tune(args.spec, buckets=_token_counts(args.buckets), save_dir=args.save_dir, force=args.force,
         refine=args.refine)
    return 0


def _offload_overrides(spec, args):
    """The spec with `moegen plan`'s --expert-memory-gib, --policy and --prefetch applied, checked
    as the spec's own fields are (an error names the argument)."""
    from dataclasses import replace

    from moegen.spec.loader import expert_memory_shortfall
    from moegen.target import lookup_gpu

    if args.expert_memory_gib is not None:
        gpu = lookup_gpu(spec.target.gpu)
        if not 0 < args.expert_memory_gib <= gpu.memory_gib:
            raise UsageError(f"--expert-memory-gib {args.expert_memory_gib:g}: use a budget in GiB above 0 and at "
                             f"most the {gpu.alias}'s {gpu.memory_gib:g}")
        spec = replace(spec, target=replace(spec.target, expert_memory_gib=args.expert_memory_gib))
        shortfall = expert_memory_shortfall(spec)
        if shortfall is not None:
            _, problem, fix = shortfall
            raise UsageError(f"--expert-memory-gib {args.expert_memory_gib:g}: {problem}; "
                             f"{fix.replace('target.expert_memory_gib', '--expert-memory-gib')}")
    overrides = {name: getattr(args, name) for name in ("policy", "prefetch") if getattr(args, name) is not None}
    return replace(spec, offload=replace(spec.offload, **overrides)) if overrides else spec


def _cmd_plan(args) -> int:
    import json

    from moegen.ir import lower
    from moegen.package.sources import offload_summary
    from moegen.plan.offload import plan_for_trace, plan_offload
    from moegen.spec import load_spec

    ir = lower(_offload_overrides(load_spec(args.spec), args), args.spec)
    offload = plan_for_trace(ir, args.trace) if args.trace else plan_offload(ir)
    if args.json:
        print(json.dumps(offload.to_json(), indent=2, sort_keys=True))
    else:
        print(f"# offload plan: {ir.spec.name}")
        for name, value in offload_summary(offload):
            print(f"{name:34s} {value}")
    return 0


def _cmd_spec(args) -> int:
    from moegen.spec.from_hf import default_name, read_config, spec_text

    values, source = read_config(Path(args.config))
    buckets = _token_counts(args.buckets)
    text = spec_text(values, source, args.name or default_name(values, source), args.gpu,
                     tuple(buckets) if buckets else None, args.dtype)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "x", encoding="utf-8") as handle:  # "x": never over a file of the user's
            handle.write(text)
    except FileExistsError:
        raise UsageError(f"-o {args.output}: exists; moegen spec writes only a new file: pick another name") from None
    except OSError as error:
        raise UsageError(f"-o {args.output}: cannot write it ({error.strerror}); pass a file in a folder "
                         "that exists and is writable") from None
    print(f"{args.output}: written; check it, then `moegen build {args.output}`", file=sys.stderr)
    return 0


def _cmd_build(args) -> int:
    from moegen.package import build

    output = _output_folder(args.output)
    if args.tune:
        from moegen.ir import lower
        from moegen.spec import load_spec
        from moegen.target import current_gpu
        from moegen.tune.runner import tune

        target = lower(load_spec(args.spec), args.spec).target
        here = current_gpu()
        if here is None or here.name != target.name:
            raise UsageError(f"{args.spec}: --tune measures this machine's GPU ({here.name if here else 'none'}) "
                             f"but the spec targets {target.name}; tune on a {target.name} or change target.gpu")
        tune(args.spec, save_dir=args.save_dir)
    folder, changed = build(args.spec, output)
    print(f"{folder}: {'built' if changed else 'up to date'}")
    return 0


def _cmd_quantize(args) -> int:
    from moegen.quant.convert import quantize_checkpoint
    from moegen.quant.formats import WeightFormat
    from moegen.spec.from_hf import model_fields, read_config

    values, source = read_config(Path(args.model))
    dtype = args.dtype or model_fields(values, source)["dtype"]
    if args.format != "int4_group" and (args.group_size != 128 or args.zero_point):
        raise UsageError(f"--group-size and --zero-point apply to int4_group, not {args.format}")
    fmt = WeightFormat(args.format, args.group_size if args.format == "int4_group" else 0, args.zero_point, dtype)
    count = quantize_checkpoint(Path(args.model), Path(args.output), fmt)
    print(f"{args.output}: {count} expert projections quantized to {fmt.key or args.format}; "
          f"`moegen spec {args.output}` writes its spec", file=sys.stderr)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moegen", description="Ahead-of-time compiler for fused MoE inference.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("validate", help="check a spec file and report every problem as FILE:LINE:COL")
    v.add_argument("spec")
    v.set_defaults(run=_cmd_validate)

    s = sub.add_parser("spec", help="write a spec for a Hugging Face model from its config.json")
    s.add_argument("config", help="the model's config.json, or the folder holding it")
    s.add_argument("--name", help="the spec's name (default: from the model's folder)")
    s.add_argument("--gpu", default="h200", help="target.gpu (default: h200)")
    s.add_argument("--buckets", help="comma-separated token buckets (default: moegen's)")
    s.add_argument("--dtype", choices=DTYPES,
                   help="the dtype the model runs in (default: the config's torch_dtype)")
    s.add_argument("-o", "--output", help="write this new file instead of printing the spec")
    s.set_defaults(run=_cmd_spec)

    b = sub.add_parser("build", help="render a spec into an importable package")
    b.add_argument("spec")
    b.add_argument("-o", "--output", default="generated", help="output folder (default: generated/)")
    b.add_argument("--tune", action="store_true",
                   help="first tune the buckets the tuning database lacks for this GPU (needs the target GPU)")
    b.add_argument("--save-dir", type=Path, default=None,
                   help="where tuning results go (default: MOEGEN_TUNED_CONFIG_DIR, else the shipped tuned/)")
    b.set_defaults(run=_cmd_build)

    t = sub.add_parser("tune", help="autotune kernel configs per token bucket on this GPU into the tuning database")
    t.add_argument("spec")
    t.add_argument("--buckets", help="comma-separated token buckets (default: the spec's)")
    t.add_argument("--save-dir", type=Path, default=None,
                   help="where results go (default: MOEGEN_TUNED_CONFIG_DIR, else the shipped tuned/)")
    t.add_argument("--force", action="store_true",
                   help="re-tune buckets the database already has (an entry stays unless a config is at least 1%% "
                        "faster in the confirmation and again in a paired duel with it)")
    t.add_argument("--refine", action="store_true",
                   help="re-tune every bucket starting from its entry (or the nearest smaller bucket's) instead of the "
                        "cost model's: after a tuned option lands, fewer candidates than a full search")
    t.set_defaults(run=_cmd_tune)

    pl = sub.add_parser("plan", help="print the expert-offload plan (slots, pinned experts, prefetch, expected cost)")
    pl.add_argument("spec")
    pl.add_argument("--trace", type=Path, help="a moegen-trace v1 file: profile, pinning and simulated hit rate")
    pl.add_argument("--expert-memory-gib", type=float, metavar="GIB",
                    help="the GPU memory for experts, in place of the spec's target.expert_memory_gib")
    pl.add_argument("--policy", choices=OFFLOAD_POLICIES, help="in place of the spec's offload.policy")
    pl.add_argument("--prefetch", choices=PREFETCH_MODES, help="in place of the spec's offload.prefetch")
    pl.add_argument("--json", action="store_true", help="print plan.json's content")
    pl.set_defaults(run=_cmd_plan)

    q = sub.add_parser("quantize", help="a Hugging Face checkpoint folder with its routed experts quantized "
                                        "(round to nearest) into a layout moegen and other engines read")
    q.add_argument("model", help="the model folder (config.json and *.safetensors)")
    q.add_argument("--format", required=True, choices=[f for f in QUANTIZATIONS if f != "none"],
                   help="fp8_block (DeepSeek-V3's layout), fp8_channel (fbgemm's), int4_group (compressed-tensors')")
    q.add_argument("--group-size", type=int, default=128, choices=INT4_GROUP_SIZES, help="int4_group: inputs per scale")
    q.add_argument("--zero-point", action="store_true", help="int4_group: a zero point per group")
    q.add_argument("--dtype", choices=DTYPES, help="int4_group's scales (default: the config's torch_dtype)")
    q.add_argument("-o", "--output", required=True, help="the new folder to write")
    q.set_defaults(run=_cmd_quantize)

    add_cache_parser(sub)
    add_simulate_parser(sub)
    add_bench_parser(sub, lambda text: _token_counts(text, "--tokens"))

    d = sub.add_parser("doctor", help="versions, the GPU and its figures, MOEGEN_* settings, where tuning "
                                      "results and compiled kernels live, and which tuning entries apply here")
    d.add_argument("--measure", action="store_true",
                   help="also measure the GPU's bandwidth, GEMM rate and pinned host link (a few seconds)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    # Reports bad settings instead of stopping at them.
    d.set_defaults(run=_cmd_doctor, checks_settings=False)
    return p


def _cmd_doctor(args) -> int:
    from moegen.doctor import run_doctor

    return run_doctor(args.json, args.measure)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line naming moegen, not Python's source excerpt."""
    print(f"moegen: warning: {str(message).removeprefix('moegen: ')}", file=sys.stderr)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            if getattr(args, "checks_settings", True):
                knobs.check()
            return args.run(args)
    except MoegenError as error:
        print(f"moegen: {error}" if error.exit_code != 2 else str(error), file=sys.stderr)
        return error.exit_code
    except BrokenPipeError:
        # The reader of the output left (`moegen simulate ... | head`): it has what it wanted. The
        # rest goes nowhere, so that the interpreter's last flush does not fail on the pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:
        print(f"moegen: {error}; nothing already built was changed", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
