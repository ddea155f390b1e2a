"""The TMA reader (moegen.tune.tma_read) compiles for sm_90 with this Triton: Gluon kernels cannot
run in the interpreter, so CI checks here that the GPU machine will be able to build it (its
numbers are checked on the GPU, tests/test_gpu.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMPILE = """
import os, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="moegen-tma-read-")
sys.path[:0] = [{repo!r}, {tests!r}]
from first_launch_replay import use_stand_in_hopper
use_stand_in_hopper()
from pathlib import Path
import torch
from moegen.tune import tma_read as r
desc = r.box_descriptor(torch.zeros(1000, r.BOX_COLUMNS, dtype=torch.bfloat16))
r._tma_read_kernel.warmup(desc, torch.zeros(4), 4, STAGES=r.STAGES, SUMMED_ROWS=r.SUMMED_ROWS, num_warps=4,
                          grid=(4,))
ptx = "".join(p.read_text() for p in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.ptx"))
print(ptx.count("cp.async.bulk.tensor"), ptx.count("mbarrier.try_wait"))
"""


def test_tma_reader_compiles_for_sm90(sm90_compile_env):
    code = COMPILE.format(repo=str(REPO), tests=str(REPO / "tests"))
    result = subprocess.run([sys.executable, "-c", code], env=sm90_compile_env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    copies, waits = map(int, result.stdout.split()[-2:])
    assert copies >= 1 and waits >= 2  # the TMA copy, and both partitions waiting on the ring
