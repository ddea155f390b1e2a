"""The L2 evict-first mark of tensor copies (moegen/runtime/l2_hints.py): the PTX rewrite on its
own, and kernels compiled for sm_90 on the CPU (Triton's wheel carries ptxas, which must accept
the rewritten PTX) with the mark and without."""
from __future__ import annotations

from pathlib import Path

import pytest

from moegen.runtime import l2_hints

ENTRY = """\
.version 8.7
.target sm_90a
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .align 64 .b8 k_param_1[128]
)
.reqntid 128, 1, 1
{
\t.reg .pred \t%p<4>;
\t.reg .b64 \t%rd<8>;
\t// demoted variable
\t.shared .align 16 .b8 global_smem[];

\tmov.b64 \t%rd1, k_param_1;
\tcvta.param.u64 \t%rd2, %rd1;
COPIES
\tret;
}
"""
LOAD = ("\t{pred}cp.async.bulk.tensor.{dims}d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%r1], [%rd2, {{%r2, %r3}}], [%r4];")
STORE = "\tcp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd2, {%r2, %r3}], [%r5];"


@pytest.mark.parametrize("pred,dims", [("", 2), ("@%p1 ", 3), ("@!%p2 ", 5)])
def test_every_tensor_load_takes_the_policy_made_after_the_declarations(pred, dims):
    copies = "\n".join([LOAD.format(pred=pred, dims=dims)] * 2 + [STORE])
    lines = l2_hints.evict_first_copies(ENTRY.replace("COPIES", copies)).splitlines()
    policy = lines.index(f"\tcreatepolicy.fractional.L2::evict_first.b64 \t{l2_hints.POLICY_REGISTER}, 1.0;")
    assert lines[policy - 1] == f"\t.reg .b64 \t{l2_hints.POLICY_REGISTER};"
    assert lines.index("\t.shared .align 16 .b8 global_smem[];") < policy - 1  # after every declaration,
    assert lines[policy + 1] == "\tmov.b64 \t%rd1, k_param_1;"  # before the first instruction
    hinted = [line for line in lines if "L2::cache_hint" in line]
    assert hinted == [f"\t{pred}cp.async.bulk.tensor.{dims}d.shared::cluster.global.mbarrier::complete_tx::bytes"
                      f".L2::cache_hint [%r1], [%rd2, {{%r2, %r3}}], [%r4], {l2_hints.POLICY_REGISTER};"] * 2
    assert STORE in lines  # stores keep their own way


def test_ptx_without_one_kernel_entry_is_refused():
    with pytest.raises(ValueError, match="one kernel entry"):
        l2_hints.evict_first_copies(".version 8.7\n.target sm_90a\n")


COMPILE = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moegen.runtime import l2_hints


@triton.jit
def copy_tile(desc, out_ptr, MARKED: tl.constexpr):
    if MARKED:
        l2_hints.mark_tma_copies_evict_first()
    tile = desc.load([0, 0])
    rows = tl.arange(0, 64)
    tl.store(out_ptr + rows[:, None] * 64 + rows[None, :], tile)


marked = sys.argv[1] == "marked"
source = ASTSource(copy_tile, signature={"desc": "tensordesc<fp16[64, 64]>", "out_ptr": "*fp16",
                                         "MARKED": "constexpr"}, constexprs={"MARKED": marked})
print(json.dumps(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]))
"""


@pytest.mark.parametrize("marked", [True, False])
def test_marked_kernels_compile_with_hinted_copies_and_unmarked_ones_without(marked, tmp_path,
                                                                              sm90_compile_env):
    import json
    import subprocess
    import sys

    script = tmp_path / "compile_copy_tile.py"
    script.write_text(COMPILE)
    env = dict(sm90_compile_env, TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, str(script), "marked" if marked else "plain"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    ptx = json.loads(run.stdout)  # through ptxas: the rewritten PTX is valid
    copies = [line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
    assert copies
    assert (l2_hints.MARKER in ptx) == marked
    assert all(("L2::cache_hint" in line) == marked for line in copies)
    assert ("createpolicy" in ptx) == marked
