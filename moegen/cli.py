"""moegen command line. Exit codes: 0 ok, 1 failure, 2 bad input (spec or arguments)."""
from __future__ import annotations

import argparse
import sys

from moegen.errors import MoegenError


def _cmd_validate(args) -> int:
    from moegen.spec import load_spec

    spec = load_spec(args.spec)
    m = spec.model
    print(f"{args.spec}: ok ({spec.name}: E={m.num_experts}, top-{m.top_k}, H={m.hidden_size}, "
          f"I={m.intermediate_size}, {m.dtype}, package {spec.package_name})")
    return 0


def _cmd_build(args) -> int:
    from moegen.package import build

    folder, changed = build(args.spec, args.output)
    print(f"{folder}: {'built' if changed else 'up to date'}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moegen", description="Ahead-of-time compiler for fused MoE inference.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("validate", help="check a spec file and report every problem as FILE:LINE:COL")
    v.add_argument("spec")
    v.set_defaults(run=_cmd_validate)

    b = sub.add_parser("build", help="render a spec into an importable package")
    b.add_argument("spec")
    b.add_argument("-o", "--output", default="generated", help="output folder (default: generated/)")
    b.set_defaults(run=_cmd_build)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except MoegenError as error:
        print(f"moegen: {error}" if error.exit_code != 2 else str(error), file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(f"moegen: {error}; nothing already built was changed", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
