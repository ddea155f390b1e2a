"""The benchmark's tables (markdown) and JSON."""
from __future__ import annotations

import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from moegen.bench.cells import REFERENCE_MAX_TOKENS, Measured, Row
from moegen.bench.peers import IMPLS
from moegen.bench.roofline import Ceilings


def publish(lines: list[str], file_name: str) -> None:
    """Print a report, and with $OUT set (the GPU machine's folder of results) write it there too."""
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], file_name).write_text(text + "\n")


def fmt_us(us: float) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def fmt_err(err: Optional[float]) -> str:
    return "-" if err is None else ("inf" if math.isinf(err) else f"{err:.1e}")


def pct_of_floor(floor_us: float, us: float) -> float:
    """floor / time in percent, one decimal rounded down: a cell at 84.96% must not read as a met 85%."""
    return math.floor(1000 * floor_us / us + 1e-9) / 10


def fmt_pct(floor_us: float, us: float) -> str:
    return f"{pct_of_floor(floor_us, us):.1f}%"


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


def legend(ceilings: Ceilings, on_gpu: bool) -> list[str]:
    """What the table's columns mean, as bullet lines."""
    return [
        "- us: median wall time of one call, routing included"
        + ("; moegen and grouped_mm as CUDA-graph replays, naive eagerly (it synchronizes with the host); "
           "L2 evicted before each call" if on_gpu else " (CPU smoke run: perf_counter, no graphs)"),
        "- %floor: floor / time (100% = at the roofline floor); floor = max((distinct experts touched "
        "x each one's stored bytes (3*H*I elements unquantized) + 2*T*H elements) / bandwidth, 6*T*k*H*I FLOPs / "
        f"GEMM rate (fp8 experts: the fp8 rate)), with the measured ceilings ({ceilings.hbm_gbps:.0f} GB/s, "
        f"{ceilings.gemm_dtype} {ceilings.gemm_tflops:.1f} TFLOP/s"
        + (f", fp8 {ceilings.fp8_tflops:.1f}" if ceilings.fp8_tflops and on_gpu else "")
        + (f", fp8 with fp8_block's scales {ceilings.fp8_block_tflops:.1f}" if ceilings.fp8_block_tflops and on_gpu
           else "") + ")",
        "- read-only: memory-bound cells only, one launch of the fastest streaming read (a load-instruction "
        "kernel; on Hopper also a TMA reader) over exactly the floor's bytes, timed as moegen: what a kernel "
        "that does nothing but read them takes",
        f"- err: relative Frobenius error vs the float64 reference, moegen / naive / grouped_mm; checked for "
        f"T <= {REFERENCE_MAX_TOKENS} only ('-': the reference is too slow there); **WRONG**: above the dtype's "
        "tolerance or not finite",
    ]


def notes(rows: list[Row]) -> list[str]:
    """Why cells are n/a (a peer that raised or could not be timed), one bullet each."""
    return [f"- n/a {note}" for note in sorted({f"{r.spec} T={r.tokens} {n}: {res.note}" for r in rows
                                                for n, res in r.results.items()
                                                if res.note and not res.note.startswith("eager")})]


def row_json(row: Row) -> dict:
    """One row as `moegen bench --json` prints it: %floor beside each time."""
    return {
        "tokens": row.tokens, "floor_us": row.floor_us, "bound": row.bound, "experts_touched": row.touched,
        "floor_bytes": row.nbytes,
        "read_only_us": row.read_us,
        "read_only_pct_floor": pct_of_floor(row.floor_us, row.read_us) if row.read_us else None,
        "implementations": {
            name: {**asdict(res), "pct_floor": pct_of_floor(row.floor_us, res.us) if res.us else None}
            for name, res in row.results.items()},
    }
