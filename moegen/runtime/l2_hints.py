"""L2 evict-first tensor-descriptor copies, which Triton 3.6 cannot ask for (its descriptor loads
take no eviction policy, and the policy a lower layer would accept is dropped on the way to PTX).

A kernel compiled with a true constexpr calls mark_tma_copies_evict_first(), which leaves MARKER
in its PTX; the stage hook installed at import rewrites such PTX before ptxas: one L2 policy
(createpolicy ... evict_first) made at the entry, and every global-to-shared tensor copy
(cp.async.bulk.tensor) given it as its cache hint. The tiles copied that way (the weights, and
GEMM2's intermediate) then leave L2 first, ahead of what the kernels read with plain loads (the
gathered token rows) and the sums they add into: 2-7% faster where experts expect at most a
block of rows (docs/PERFORMANCE.md, ideas table). The constexpr is part of Triton's cache key,
so marked and unmarked kernels never share a cache entry; every module whose kernels can carry
the mark imports this one, so every compile of them sees the hook.
"""
from __future__ import annotations

import re

import triton
import triton.language as tl

MARKER = "moegen: tensor copies L2 evict_first"
_MARKER_COMMENT = tl.constexpr(f"// {MARKER}")  # the kernels' inline assembly: MARKER, once
POLICY_REGISTER = "%rd_l2_evict_first"
_COPY = re.compile(r"^(\s*(?:@!?%p\d+\s+)?cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global"
                   r"\.mbarrier::complete_tx::bytes)(\s+\[.*\]);\s*$")
_DECLARATION = re.compile(r"^\s*(\.reg\s|\.shared\s|\.local\s|//|$)")


@triton.jit
def mark_tma_copies_evict_first():
    """Leaves MARKER in the kernel's PTX (a comment: no instruction)."""
    tl.inline_asm_elementwise(_MARKER_COMMENT, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


def evict_first_copies(ptx: str) -> str:
    """The PTX with an evict-first L2 policy made after the entry's declarations and given to every
    global-to-shared tensor copy as its cache hint."""
    lines = ptx.splitlines()
    entries = [i for i, line in enumerate(lines) if line.lstrip().startswith((".entry", ".visible .entry"))]
    if len(entries) != 1:
        raise ValueError(f"expected one kernel entry in the PTX, found {len(entries)}")
    body = lines.index("{", entries[0]) + 1  # the entry's body opens on a line of its own
    first_instruction = next(i for i in range(body, len(lines)) if not _DECLARATION.match(lines[i]))
    out = lines[:first_instruction] + [f"\t.reg .b64 \t{POLICY_REGISTER};",
                                       f"\tcreatepolicy.fractional.L2::evict_first.b64 \t{POLICY_REGISTER}, 1.0;"]
    for line in lines[first_instruction:]:
        copy = _COPY.match(line)
        out.append(f"{copy.group(1)}.L2::cache_hint{copy.group(2)}, {POLICY_REGISTER};" if copy else line)
    return "\n".join(out) + "\n"


def _with_evict_first_copies(make_ptx):
    def make(src, metadata):
        ptx = make_ptx(src, metadata)
        return evict_first_copies(ptx) if MARKER in ptx else ptx

    return make


def _install() -> None:
    """Chains the rewrite after any stage hook already set (once per process)."""
    previous = triton.knobs.runtime.add_stages_inspection_hook
    if getattr(previous, "moegen_l2_hints", False):
        return

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        if "ptx" in stages:
            stages["ptx"] = _with_evict_first_copies(stages["ptx"])

    hook.moegen_l2_hints = True
    triton.knobs.runtime.add_stages_inspection_hook = hook


_install()
