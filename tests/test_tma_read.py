"""The TMA reader (moegen.tune.tma_read) compiles for sm_90 with this Triton: Gluon kernels cannot
run in the interpreter, so CI checks here that the GPU machine will be able to build it (its
numbers are checked on the GPU, tests/test_gpu.py)."""
from __future__ import annotations

COMPILE = """
import torch
from moegen.tune import tma_read as r
desc = r.box_descriptor(torch.zeros(1000, r.BOX_COLUMNS, dtype=torch.bfloat16))
r._tma_read_kernel.warmup(desc, torch.zeros(4), 4, STAGES=r.STAGES, SUMMED_ROWS=r.SUMMED_ROWS, num_warps=4,
                          grid=(4,))
"""


def test_tma_reader_compiles_for_sm90(compile_sm90):
    ptx = "".join(compile_sm90(COMPILE).values())
    # the TMA copy, and both partitions waiting on the ring
    assert ptx.count("cp.async.bulk.tensor") >= 1 and ptx.count("mbarrier.try_wait") >= 2
