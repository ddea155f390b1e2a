"""`moegen doctor`: what moegen sees on this machine: versions, the GPU and its figures, every
MOEGEN_* variable, where templates, tuning results and compiled kernels live, and which tuning
entries apply here. A bad setting is shown, not fatal: finding it is what the command is for."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Optional

import moegen
from moegen import knobs
from moegen.errors import MoegenError

# Variables of other tools that change what moegen does.
OTHER_VARIABLES = {
    "TRITON_INTERPRET": "1: kernels run on the CPU in Triton's interpreter (set before importing a package)",
    "TRITON_CACHE_DIR": "where Triton keeps compiled kernels (default ~/.triton/cache)",
    "CUDA_VISIBLE_DEVICES": "which GPUs torch sees; moegen uses device 0 of those",
}


def _versions() -> dict:
    from moegen.tune.db import installed_version

    return {"moegen": moegen.__version__, "python": platform.python_version(),
            **{name: installed_version(name) for name in ("torch", "triton", "transformers", "numpy", "safetensors")}}


def _gpu(measure: bool) -> dict:
    import torch

    from moegen.target import INTERPRETER, current_gpu, lookup_gpu

    gpu = current_gpu()
    if gpu is None or gpu.name == INTERPRETER:
        # Under the interpreter, entries tuned for it are this machine's.
        return {"device": None, "cuda": torch.version.cuda, "tuning_device": gpu.name if gpu else None,
                "note": "no CUDA GPU (torch.cuda.is_available() is false)"
                        + ("; kernels run in Triton's interpreter" if gpu is not None else
                           "; set TRITON_INTERPRET=1 to run kernels on the CPU (tiny shapes)")}
    known = lookup_gpu(gpu.name) is not None
    info = {
        "device": gpu.name, "tuning_device": gpu.name, "cuda": torch.version.cuda, "arch": f"sm_{gpu.arch}",
        "sm_count": gpu.sm_count,
        "memory_gib": gpu.memory_gib, "spec_alias": gpu.alias if known else None,
        "known_figures": {"hbm_gbps": gpu.hbm_gbps, "bf16_tflops": gpu.bf16_tflops,
                          "host_link_gbps": gpu.host_link_gbps,
                          "source": "moegen's table (datasheet leads)" if known else
                          "borrowed from the table entry of the closest compute capability"},
    }
    if measure:
        from moegen.tune.bench import measure_ceilings

        copy_gbps, read_gbps, hbm_gbps, tflops = measure_ceilings()
        info["measured"] = {"copy_gbps": copy_gbps, "read_gbps": read_gbps, "hbm_gbps": hbm_gbps,
                            "bf16_tflops": tflops, "host_link_gbps": pinned_link_gbps()}
    return info


def pinned_link_gbps() -> float:
    """Pinned host-to-device copy of 1 GiB, the best of three (what expert offload moves experts over)."""
    import torch

    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return host.numel() / (best * 1e6)


def _variables() -> list[dict]:
    rows = []
    for variable in knobs.VARIABLES:
        value = os.environ.get(variable.name)
        try:
            effective, problem = variable.read(), None
        except MoegenError as error:
            effective, problem = None, str(error)
        rows.append({"name": variable.name, "value": value, "meaning": variable.meaning,
                     "effective": str(effective) if isinstance(effective, Path) else effective, "problem": problem})
    rows += [{"name": name, "value": os.environ.get(name), "meaning": meaning, "effective": None, "problem": None}
             for name, meaning in OTHER_VARIABLES.items()]
    return rows


def _locations() -> dict:
    import triton

    from moegen.tune import db

    def safe(read):
        try:
            return read()
        except MoegenError as error:
            return f"unusable: {error}"

    search = safe(db.default_search_path)
    return {
        "package": str(Path(moegen.__file__).resolve().parent),
        "templates": str(safe(knobs.template_dir)),
        "tuning_search_path": [{"path": str(d), "files": len(db.db_files(d))} for d in search]
        if isinstance(search, list) else search,
        "tune_saves_to": str(safe(knobs.tuned_config_dir) or db.shipped_dir()),
        "triton_cache": str(triton.knobs.cache.dir),
    }


def _entries(device: Optional[str]) -> list[dict]:
    """Every tuning file in the search path, and whether it serves this machine: its device, this
    Triton and these templates (a build takes a bucket's config only from such a file)."""
    from moegen.tune import db

    try:
        search = db.default_search_path()
    except MoegenError as error:
        return [{"path": None, "status": f"unusable: {error}"}]
    entries = []
    for directory in search:
        for path in db.db_files(directory):
            try:
                content = db.load_file(path)
            except db.TuningInputError as error:
                entries.append({"path": str(path), "device": None, "buckets": None, "status": f"corrupt: {error}"})
                continue
            meta = content["metadata"]
            try:  # the device is compared apart: an entry for another GPU is not stale
                stale = db.differences(db.DbMetadata.from_dict(meta), db.current_versions(meta))
            except MoegenError as error:  # MOEGEN_TEMPLATE_DIR unusable
                entries.append({"path": str(path), "device": meta.get("device"), "status": f"unusable: {error}"})
                continue
            if stale:
                status = "stale: " + "; ".join(stale)
            elif device is None:
                status = "current (no GPU here to match)"  # nor the interpreter
            else:
                status = "matches this machine" if meta.get("device") == device else "current, for another GPU"
            entries.append({"path": str(path), "device": meta.get("device"),
                            "signature": path.name.split("__")[0], "buckets": len(content["buckets"]),
                            "status": status})
    return entries


def doctor(measure: bool = False) -> dict:
    gpu = _gpu(measure)
    return {"versions": _versions(), "gpu": gpu, "variables": _variables(), "locations": _locations(),
            "tuning_entries": _entries(gpu["tuning_device"])}


def _print(report: dict) -> None:
    v = report["versions"]
    print("versions: " + ", ".join(f"{name} {version or 'not installed'}" for name, version in v.items()))
    gpu = report["gpu"]
    print()
    if gpu["device"] is None:
        print(f"GPU: {gpu['note']}")
    else:
        k = gpu["known_figures"]
        print(f"GPU: {gpu['device']} ({gpu['arch']}, {gpu['sm_count']} SMs, {gpu['memory_gib']} GiB; CUDA "
              f"{gpu['cuda']}); spec target.gpu: {gpu['spec_alias'] or 'not in moegen table (docs/spec.md)'}")
        print(f"  known: HBM {k['hbm_gbps']:g} GB/s, bf16 {k['bf16_tflops']:g} TFLOP/s, host link "
              f"{k['host_link_gbps']:g} GB/s ({k['source']})")
        measured = gpu.get("measured")
        if measured:
            print(f"  measured: HBM {measured['hbm_gbps']:.0f} GB/s (copy {measured['copy_gbps']:.0f}, read "
                  f"{measured['read_gbps']:.0f}), bf16 {measured['bf16_tflops']:.1f} TFLOP/s, pinned host link "
                  f"{measured['host_link_gbps']:.1f} GB/s")
        else:
            print("  measured: not measured (`moegen doctor --measure` times a copy, a read, a GEMM and the link)")
    print()
    print("environment:")
    width = max(len(row["name"]) for row in report["variables"])
    for row in report["variables"]:
        value = "unset" if row["value"] is None else repr(row["value"])
        print(f"  {row['name']:<{width}}  {value}" + (f"  INVALID: {row['problem']}" if row["problem"] else "")
              + f"\n  {'':<{width}}  {row['meaning']}")
    loc = report["locations"]
    print()
    print("locations:")
    print(f"  moegen package:        {loc['package']}")
    print(f"  kernel templates:      {loc['templates']}")
    search = loc["tuning_search_path"]
    if isinstance(search, list):
        for i, entry in enumerate(search):
            label = "tuning database:" if i == 0 else ""
            print(f"  {label:<22} {entry['path']} ({entry['files']} files)")
    else:
        print(f"  tuning database:       {search}")
    print(f"  moegen tune saves to:  {loc['tune_saves_to']}")
    print(f"  Triton kernel cache:   {loc['triton_cache']}")
    print()
    entries = report["tuning_entries"]
    matching = [e for e in entries if e["status"] == "matches this machine"]
    print(f"tuning entries: {len(matching)} of {len(entries)} match this machine"
          + ("" if gpu["tuning_device"] else " (no GPU here: builds use them for the spec's target GPU)"))
    for entry in entries:
        print(f"  {Path(entry['path']).name if entry['path'] else '-'}: {entry.get('buckets') or 0} buckets, "
              f"{entry.get('device') or '?'}: {entry['status']}")


def run_doctor(as_json: bool, measure: bool) -> int:
    report = doctor(measure)
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print(report)
    invalid = [row["name"] for row in report["variables"] if row["problem"]]
    if invalid:
        print(f"moegen: {', '.join(invalid)} set to a value moegen cannot use (see above)", file=sys.stderr)
    return 2 if invalid else 0
