"""Fingerprint the kernels the shipped tuning database launches, without a GPU.

Compiles, for sm_90 on the CPU (Triton's wheel carries ptxas; a stand-in driver answers the
questions compiling asks), every kernel that each tuned config in tuned/ launches, and writes
one sha256 per compiled kernel of its PTX without line information. Two runs that write the same
file compiled the same kernels: a template edit that leaves them all unchanged keeps the tuned
entries valid (only their template hash moves), one that changes any of them needs a re-tune.

    python tools/kernel_fingerprint.py OUT.json      # before and after the edit, then
    python tools/kernel_fingerprint.py --compare BEFORE.json AFTER.json

The comparison lists, per kernel (shape aside), how many of its compiled variants are identical:
an edit that changes only the routing kernels (and the decode kernel's routing) keeps the
entries' choices valid too (docs/DESIGN.md), one that changes a GEMM needs a re-tune or an A/B
of the shipped entries on the old and new tree (as the row-block groups had, DESIGN.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Debug information and the labels it anchors differ with source line numbers, not with code.
_NOT_CODE = re.compile(r"^\s*(\.loc|\.file|//|\$L__tmp\d+:$)")


def code_lines(ptx: str) -> str:
    lines = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            break
        if not _NOT_CODE.match(line):
            lines.append(line)
    return "\n".join(lines)


def main(out: Path) -> int:
    cache = tempfile.mkdtemp(prefix="moegen-fingerprint-")
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ["MOEGEN_PRECOMPILE"] = "0"
    sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]
    from first_launch_replay import use_stand_in_hopper

    use_stand_in_hopper()

    from moegen.ir import lower
    from moegen.package import build, precompile
    from moegen.package.loader import load_package
    from moegen.runtime import fused
    from moegen.spec.loader import load_spec
    spec_of = {}  # signature key -> the first spec (by name) of that shape
    for spec_file in sorted((REPO_ROOT / "specs").glob("*.yaml")):
        spec_of.setdefault(lower(load_spec(spec_file), spec_file).signature.key, spec_file)
    for db_file in sorted((REPO_ROOT / "tuned").glob("*.json")):
        spec_file = spec_of[db_file.name.split("__")[0]]
        entries = json.loads(db_file.read_text())["buckets"]
        folder, _ = build(spec_file, Path(tempfile.mkdtemp(prefix="moegen-fingerprint-build-")))
        ks = load_package(folder).KERNELS
        buckets = tuple(b for b in ks.buckets if str(b) in entries)  # a file may hold some buckets only
        configs = tuple(fused.KernelConfig(**entries[str(b)]["config"]) for b in buckets)
        precompile.compile_buckets(replace(ks, configs=configs, buckets=buckets))
        print(f"{db_file.name}: {len(configs)} buckets compiled ({spec_file.name})", flush=True)
    prints: dict[str, list[str]] = {}
    for ptx in sorted(Path(cache).rglob("*.ptx")):
        meta = json.loads(ptx.with_suffix(".json").read_text())
        label = f"{ptx.stem} warps={meta['num_warps']} stages={meta['num_stages']}"
        prints.setdefault(label, []).append(hashlib.sha256(code_lines(ptx.read_text()).encode()).hexdigest())
    out.write_text(json.dumps({k: sorted(v) for k, v in sorted(prints.items())}, indent=1) + "\n")
    print(f"{sum(map(len, prints.values()))} kernels -> {out}")
    return 0


def kernel_of(label: str) -> str:
    """moe_gate_up_silu_bf16_h2048_i768_e128_k8 warps=8 stages=4 -> moe_gate_up (the shape and
    launch settings aside; the routing pair and the decode finish keep their suffix)."""
    return re.sub(r"_[a-z0-9]+_[a-z0-9]+_h\d+_i\d+_e\d+_k\d+", "", label.split(" ")[0])


def compare(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, tuple[int, int]]:
    """Per kernel: (variants compiled before, how many of them compile identically after)."""
    table: dict[str, list[int]] = {}
    for label, hashes in sorted(before.items()):
        counts = table.setdefault(kernel_of(label), [0, 0])
        counts[0] += len(hashes)
        counts[1] += sum((Counter(hashes) & Counter(after.get(label, ()))).values())  # duplicates count too
    return {kernel: (total, same) for kernel, (total, same) in table.items()}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        rows = compare(*(json.loads(Path(f).read_text()) for f in sys.argv[2:]))
        print("| kernel | variants before | identical after |\n|---|---:|---:|")
        print("\n".join(f"| {kernel} | {total} | {same} |" for kernel, (total, same) in rows.items()))
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
