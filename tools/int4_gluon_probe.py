"""Probe: how far an int4 (w4a16, bf16) GEMM gets when its layouts are chosen by hand (Gluon).

The int4 GEMMs of the templates are bound by instruction issue (docs/PERFORMANCE.md): Triton 3.6
gives both dot operands kWidth 8 when one is dequantized, and every HMMA's activation quad is then
assembled with register moves. Gluon (triton.experimental.gluon) lets the kernel say the layouts:
here the weight words are loaded so that each thread holds exactly the nibbles of its mma.sync
B fragments (kWidth 2), a shift and a LOP3 make each bf16x2 register of the fragment, and the
activations reach the MMA through shared memory and LDSM, permuted to the order the nibbles come
in. The weights stay in moegen's int4 layout (moegen.quant.quantize.pack_int4); the MMA takes
128 + nibble exactly, and each group's 128-input tile is finished in float32 as
(product - (128 + zero) * sum of the activations) * scale.

This is one weight matrix times up to 16 rows: the inner loop of a decode GEMM, not a MoE kernel.

    python tools/int4_gluon_probe.py --sass        # CPU: compile for sm_90, count the K loop's SASS
    PYTHONPATH=. python tools/int4_gluon_probe.py  # GPU: float64 check; one token's weights of each
                                                   # spec timed against moegen's int4 layer and the
                                                   # read-only bound of the same bytes
"""
import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

GROUP_SIZE = 128  # inputs per scale; one K step of the probe
GROUP = gl.constexpr(GROUP_SIZE)

# Two words w0, w1 of a thread (consecutive registers: pack=2), eight nibbles each. Output p is
# the bf16x2 (128 + nibble at bit 4 (p % 4), 128 + nibble at bit 16 + 4 (p % 4)) of word p // 4:
# its low lane is the element of w0, its high lane that of w1.
UNPACK = gl.constexpr(
    "{\n.reg .b32 a1, a2, a3, b1, b2, b3;\n"
    "shr.u32 a1, $8, 4;\nshr.u32 a2, $8, 8;\nshr.u32 a3, $8, 12;\n"
    "shr.u32 b1, $9, 4;\nshr.u32 b2, $9, 8;\nshr.u32 b3, $9, 12;\n"
    "lop3.b32 $0, $8, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $1, a1, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 $2, a2, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $3, a3, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 $4, $9, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $5, b1, 0x000F000F, 0x43004300, 0xEA;\n"
    "lop3.b32 $6, b2, 0x000F000F, 0x43004300, 0xEA;\nlop3.b32 $7, b3, 0x000F000F, 0x43004300, 0xEA;\n}")

# The unpacked words [KB, 4, BLOCK_N, c, a, d] (the eight outputs joined, p = 4 d + 2 a + c),
# split as [KB // 2, e, 4, BLOCK_N, c, a, d] (e: the lane, which word of a pair the element
# stands for) and permuted to (i, d, a, c, t, e, n): the MMA's input order. The activations'
# inputs [16, t, b, e, a, c] permuted to (m, b, a, c, t, e), the same order.
WEIGHT_ORDER = gl.constexpr((0, 6, 5, 4, 2, 1, 3))
ACTIVATION_ORDER = gl.constexpr((0, 2, 4, 5, 1, 3))


@gluon.jit
def int4_tile_gemm(w_ptr, x_ptr, scale_ptr, out_ptr, rows, K: gl.constexpr, N: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, PREFETCH: gl.constexpr,
                   REPACKED: gl.constexpr):
    """out[:rows, n0:n0 + BLOCK_N] = x[:rows] @ ((q - 8) * scale)^T for q in moegen's int4 bytes
    [N, K / 2] (or, REPACKED, those bytes in the MMA's order: repacked()), scales [N, K / GROUP];
    x and out have 16 rows."""
    BLOCK_K: gl.constexpr = GROUP
    KB: gl.constexpr = BLOCK_K // 32  # words a thread loads per column and step
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # Words [KB, 4, BLOCK_N] (b, t, n): word 4 t + b of the step's row n. Lane bits hold t and the
    # low bits of n, as the B fragment's do; a thread's KB words are contiguous (one LDG.128).
    w_layout: gl.constexpr = gl.BlockedLayout([KB, 1, 1], [1, 4, 8], [1, 1, NUM_WARPS], [0, 1, 2])
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])

    n0 = gl.program_id(0) * BLOCK_N
    ob = gl.arange(0, KB, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_layout)))
    ot = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_layout)))
    on = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    w_ptrs = w_ptr + (n0 + on)[None, None, :] * (K // 8) + ot[None, :, None] * KB + ob[:, None, None]
    scale_ptrs = scale_ptr + (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))) * (K // GROUP)
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, x_layout))
    x_ptrs = x_ptr + xm[:, None] * K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))[None, :]
    x_mask = (xm < rows)[:, None]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BLOCK_K], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    acc = gl.zeros([16, BLOCK_N], gl.float32, layout=mma)
    words_next = gl.load(w_ptrs)
    scale_next = gl.load(scale_ptrs)
    for k in range(0, K, BLOCK_K):
        if PREFETCH:  # the next step's words in flight during this one's MMAs (no pipeliner here)
            words = words_next
            scale = scale_next.to(gl.float32)
            if k + BLOCK_K < K:
                words_next = gl.load(w_ptrs + (k + BLOCK_K) // 8)
                scale_next = gl.load(scale_ptrs + (k + BLOCK_K) // GROUP)
        else:
            words = gl.load(w_ptrs + k // 8)
            scale = gl.load(scale_ptrs + k // GROUP).to(gl.float32)
        o = gl.inline_asm_elementwise(UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                      dtype=[gl.bfloat16] * 8, is_pure=True, pack=2)
        # Output p = 4 d + 2 a + c of the pair of words (2 i, 2 i + 1), lane e, is MMA input
        # L = 64 i + 32 d + 16 a + 8 c + 2 t + e and holds the step's input 32 t + 8 (2 i + d) + 4 e + 2 a + c.
        w = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])),
                    gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))  # [KB, 4, BLOCK_N, c, a, d]
        w = gl.permute(gl.reshape(w, [KB // 2, 2, 4, BLOCK_N, 2, 2, 2]), WEIGHT_ORDER.value)
        w = gl.convert_layout(gl.reshape(w, [BLOCK_K, BLOCK_N]), b_layout, assert_trivial=True)
        # Unless REPACKED (L is the input itself), the activations in the same order: input
        # 32 t + 8 b + 4 e + 2 a + c to L = 32 b + 16 a + 8 c + 2 t + e.
        x = gl.load(x_ptrs + k, mask=x_mask, other=0.0)
        x_sum = gl.convert_layout(gl.sum(x.to(gl.float32), axis=1), gl.SliceLayout(1, mma))
        if not REPACKED:
            x = gl.reshape(gl.permute(gl.reshape(x, [16, 4, KB, 2, 2, 2]), ACTIVATION_ORDER.value), [16, BLOCK_K])
        gl.thread_barrier()  # the previous step's LDSMs are done with the buffer
        x_smem.store(x)
        gl.thread_barrier()
        part = mma_v2(x_smem.load(a_layout), w, gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
        acc += (part - 136.0 * x_sum[:, None]) * scale[None, :]  # 136 = 128 + the zero point 8
    om = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    on_out = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + om[:, None] * N + on_out[None, :], acc)


CONFIGS = ((64, 4, False), (64, 4, True), (128, 4, False), (128, 4, True), (128, 8, True), (256, 8, True))


def repacked(words: torch.Tensor) -> torch.Tensor:
    """Words [N, K / 8] of moegen's int4 layout with each group's nibbles moved to where the probe
    reads MMA input L: word 4 t + b of a group, nibble 4 q + 16 e holds input
    32 b + 16 (q >> 1) + 8 (q & 1) + 2 t + e (the layout a repack at load time would store)."""
    n, k = words.shape[0], words.shape[1] * 8
    q = torch.stack((words.view(torch.uint8) & 0xF, words.view(torch.uint8) >> 4), dim=-1).reshape(n, k // GROUP_SIZE, -1)
    t, b, j, e = torch.meshgrid(*(torch.arange(s) for s in (4, GROUP_SIZE // 32, 4, 2)), indexing="ij")
    source = (32 * b + 16 * (j >> 1) + 8 * (j & 1) + 2 * t + e).reshape(-1).to(words.device)
    nibbles = q[:, :, source].reshape(n, k // GROUP_SIZE, 4 * GROUP_SIZE // 32, 4, 2).to(torch.int64)
    shifts = (4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]).to(words.device)
    packed = (nibbles << shifts).sum(dim=(-2, -1))
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32).reshape(n, k // 8)


def loop_counts(cubin: bytes) -> tuple[int, Counter]:
    """Instructions of the longest backward-branch loop of a cubin's SASS, and their opcodes."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path("/tmp/int4_gluon_probe.cubin")
    path.write_bytes(cubin)
    sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in
            re.finditer(r"/\*([0-9a-f]{4})\*/\s*(.*?);", sass)]
    loops = [(int(b.group(1), 16), at) for at, text in code if (b := re.search(r"BRA (0x[0-9a-f]+)", text))
             and int(b.group(1), 16) < at]
    start, end = max(loops, key=lambda span: span[1] - span[0])
    ops = Counter(text.split()[1 if text.startswith("@") else 0].split(".")[0]
                  for at, text in code if start <= at <= end)
    return sum(ops.values()), ops


def sass_report() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {"w_ptr": "*i32", "x_ptr": "*bf16", "scale_ptr": "*bf16", "out_ptr": "*fp32", "rows": "i32",
                 "K": "constexpr", "N": "constexpr", "BLOCK_N": "constexpr", "NUM_WARPS": "constexpr",
                 "PREFETCH": "constexpr", "REPACKED": "constexpr"}
    for repack in (False, True):
        for block_n, warps, prefetch in CONFIGS:
            src = GluonASTSource(int4_tile_gemm, signature,
                                 attrs={(i,): [["tt.divisibility", 16]] for i in range(4)},
                                 constexprs={"K": 4096, "N": 28672, "BLOCK_N": block_n, "NUM_WARPS": warps,
                                             "PREFETCH": prefetch, "REPACKED": repack})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            total, ops = loop_counts(kernel.asm["cubin"])
            weights = GROUP_SIZE * block_n // (32 * warps)
            print(f"{'repacked' if repack else 'moegen'} layout, BLOCK_N {block_n:3d}, {warps} warps, prefetch "
                  f"{int(prefetch)}: {total} instructions a K step, {weights} weights a thread: "
                  f"{total / weights:.2f} a weight; {dict(ops.most_common(8))}")


def _probe_us(timer, words, scale, x, rows: int) -> float:
    """The fastest of CONFIGS on words [N, K / 8] of moegen's layout and on them repacked
    (microseconds), each checked against float64 (a wrong one is not counted)."""
    n, k = words.shape[0], words.shape[1] * 8
    q = torch.stack((words.view(torch.uint8) & 0xF, words.view(torch.uint8) >> 4), dim=-1).reshape(n, k)
    ref = x[:rows].double() @ ((q.double() - 8) * scale.double().repeat_interleave(GROUP_SIZE, dim=1)).T
    best = float("inf")
    for repack, stored in ((False, words), (True, repacked(words))):
        for block_n, warps, prefetch in CONFIGS:
            out = torch.empty(16, n, device="cuda", dtype=torch.float32)

            def call():
                int4_tile_gemm[(n // block_n,)](stored, x, scale, out, rows, K=k, N=n, BLOCK_N=block_n,
                                                NUM_WARPS=warps, PREFETCH=prefetch, REPACKED=repack,
                                                num_warps=warps)

            call()
            torch.cuda.synchronize()
            err = ((out[:rows].double() - ref).norm() / ref.norm()).item()
            us = timer.median_us(call)
            wrong = not err < 1e-4  # float32 sums of exact products: ~1e-6
            print(f"    {'repacked' if repack else 'moegen'} layout, BLOCK_N {block_n:3d}, {warps} warps, prefetch "
                  f"{int(prefetch)}: {us:7.1f} us, err {err:.1e}" + (" WRONG" if wrong else ""), flush=True)
            if not wrong:
                best = min(best, us)
    return best


def _random_words(n: int, k: int):
    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    scale = (torch.rand(n, k // GROUP_SIZE, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
    return pack_words(q), scale


def pack_words(q: torch.Tensor) -> torch.Tensor:
    """[N, K] nibbles in moegen's int4 layout, as the int32 words the probe loads."""
    from moegen.quant.quantize import pack_int4

    return pack_int4(q[None])[0].view(torch.int32)


def gpu_report(specs: list[str]) -> None:
    """Per spec, one token: moegen's int4 layer (routing, both GEMMs, the reduction) against the
    probe on the same weight bytes (the top-k experts' W13 and W2 stacked along N), both against
    the read-only bound of those bytes; then the probe alone at 16 rows."""
    import tempfile

    from moegen import load
    from moegen.bench.cells import Workload
    from moegen.bench.roofline import Timer, read_only_us
    from moegen.package import build

    torch.manual_seed(0)
    timer = Timer(torch.device("cuda"))
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for spec in specs:
        pkg = load(build(Path(spec), Path(tempfile.mkdtemp(prefix="int4-probe-")))[0])
        m = pkg.SPEC.model
        work = Workload(pkg, torch.device("cuda"), 79)
        x1, logits = work.inputs(1)
        layer_us = timer.median_us(lambda: work.kernel_call(x1, logits, work.w13, work.w2))
        stored = work.stored(work.w13, work.w2)
        layer_bytes = sum(t.nbytes for part in stored for t in part.values()) * m.top_k // m.num_experts
        del work
        shapes = (("W13", m.top_k * 2 * m.intermediate_size, m.hidden_size),
                  ("W2", m.top_k * m.hidden_size, m.intermediate_size))
        probe_us, probe_bytes = 0.0, 0
        x = torch.zeros(16, max(k for _, _, k in shapes), device="cuda", dtype=torch.bfloat16)
        x.normal_()
        for name, n, k in shapes:
            words, scale = _random_words(n, k)
            print(f"  {spec} {name} of the top {m.top_k} experts (N {n}, K {k}), one row:", flush=True)
            probe_us += _probe_us(timer, words, scale, x[:, :k].contiguous(), 1)
            probe_bytes += words.nbytes + scale.nbytes
            for rows in (16,):
                print(f"  the same, {rows} rows:", flush=True)
                _probe_us(timer, words, scale, x[:, :k].contiguous(), rows)
        read_only = read_only_us(timer, layer_bytes)
        print(f"{spec}, one token: moegen int4 layer {layer_us:.1f} us ({layer_us / read_only:.2f}x read-only of "
              f"its {layer_bytes / 1e6:.1f} MB); probe W13 + W2 {probe_us:.1f} us ({probe_us / read_only:.2f}x, "
              f"{probe_bytes / 1e6:.1f} MB, no routing, activation or reduction); read-only {read_only:.1f} us",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="compile for sm_90 (no GPU needed) and count the K loop")
    parser.add_argument("--specs", default="specs/mixtral-8x7b-int4.yaml,specs/qwen3-30b-a3b-int4.yaml",
                        help="int4 specs whose one-token layer is compared (comma-separated)")
    args = parser.parse_args()
    if args.sass:
        sass_report()
    elif torch.cuda.is_available():
        gpu_report(args.specs.split(","))
    else:
        print("no GPU: run with --sass to count instructions, or on a GPU to check and time", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
