"""Cold start: compile every bucket's kernels at build time for the GPU the build runs on and
ship the compiled binaries inside the package, so that the first call after import loads them
instead of compiling (seconds per kernel otherwise).

Triton looks kernels up in its file cache by a hash of source, options, target and version; the
package carries those cache entries (triton_cache/<hash>/...) and, at import, copies the missing
ones into the active Triton cache. Group files hold absolute paths: they are written relative
here and made absolute again where they are installed.
"""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from moegen.package.writer import as_bytes, write_package

CACHE_FOLDER = "triton_cache"
SOURCE_MTIME = 315532800  # 1980-01-01, the zip epoch: the staged sources' time, for reproducible binaries
_GROUP_PREFIX = "__grp__"


def _mock_launch_args(ks):
    """Arguments with the same types and specializations as the runtime's launches: dtypes
    stand in for tensors (Triton's warmup mocks them), strides and sizes as the runtime passes.
    The routing kernels' first argument, the logits, is left for the caller to choose; the
    GEMMs' operands that may be tensor descriptors, for _operands()."""
    import torch

    h, i, e = ks.hidden_size, ks.intermediate_size, ks.num_experts
    n = 1 << 20  # stands in for the token-dependent sizes, which are never specialized
    # The weights' strides as stored (int4 packs two inputs a byte: rows of ceil(K/2)).
    w13_rows, w13_k = ks.weight_format.w13_shapes(h, i)["weight"][1:]
    w2_rows, w2_k = ks.weight_format.shapes(h, i)["weight"][1:]
    route = (torch.float32, torch.float32, torch.int32, torch.int32, torch.int32, torch.int32, n, e, n)
    count = (torch.float32, torch.float32, torch.int32, torch.int32, torch.int32, n, e)
    place = (torch.int32,) * 6 + (n, n)
    gate_up = (ks.dtype, ks.dtype, torch.int32, torch.int32, torch.int32, n, n, n, n, h, w13_rows * w13_k, w13_k, i)
    down = (torch.float32, torch.int32, torch.int32, torch.int32, n, n, n, i, w2_rows * w2_k, w2_k, h)
    decode = (torch.float32, n, e, h, w13_rows * w13_k, w13_k, w2_rows * w2_k, w2_k)  # after logits, bias, x, w13, w2
    return route, count, place, gate_up, down, decode


def _mock_scales(ks, proj: str) -> tuple:
    """A quantized projection's scale parameters as the runtime passes them
    (moegen.runtime.fused.weight_scales): dtypes for the tensors, their contiguous strides."""
    from moegen.runtime.fused import stored_dtype

    fmt, h, i = ks.weight_format, ks.hidden_size, ks.intermediate_size
    if not fmt.quantized:
        return ()
    shape = (fmt.w13_shapes(h, i) if proj == "w13" else fmt.shapes(h, i))["scale"]
    strides = (shape[1] * (shape[2] if len(shape) > 2 else 1), shape[2] if len(shape) > 2 else 1)
    zero = (stored_dtype(ks, "zero" if fmt.zero_point else "scale"),) if fmt.quantization == "int4_group" else ()
    return (stored_dtype(ks, "scale"), *zero, *strides)


def _mock_descriptor(dtype, shape: list[int], block: list[int]):
    """A tensor descriptor of a contiguous tensor, as the runtime builds (MockTensor.stride() is
    wrong beyond 2-D, so the strides are spelled out)."""
    from triton.runtime.jit import MockTensor
    from triton.tools.tensor_descriptor import TensorDescriptor

    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return TensorDescriptor(MockTensor(dtype), shape, strides, block)


def _operands(ks, cfg, use_tma: bool):
    """(w13 for GEMM1; inter, w2 for GEMM2): dtypes, or mock descriptors shaped as the runtime's."""
    import torch

    from moegen.runtime.fused import stored_dtype

    if not use_tma:  # the intermediate as GEMM2 reads it: quantized first where the format says
        inter = ks.dtype if ks.quantize_rows is None else torch.float8_e4m3fn
        return stored_dtype(ks, "weight"), (inter, stored_dtype(ks, "weight"))
    h, i, e, d = ks.hidden_size, ks.intermediate_size, ks.num_experts, ks.dtype
    return (_mock_descriptor(d, [e, 2 * i, h], [1, cfg.block_n, cfg.block_k]),
            (_mock_descriptor(d, [1 << 20, i], [cfg.block_m, cfg.down_block_k]),
             _mock_descriptor(d, [e, h, i], [1, cfg.down_block_n, cfg.down_block_k])))


def _decode_operands(ks, cfg, use_tma: bool):
    """(w13, w2) of the decode kernel: dtypes, or mock descriptors shaped as the runtime's."""
    from moegen.runtime.fused import stored_dtype

    if not use_tma:
        return stored_dtype(ks, "weight"), stored_dtype(ks, "weight")
    h, i, e, d = ks.hidden_size, ks.intermediate_size, ks.num_experts, ks.dtype
    return (_mock_descriptor(d, [e, 2 * i, h], [1, cfg.decode_block_n, cfg.decode_block_k]),
            _mock_descriptor(d, [e, h, i], [1, cfg.decode_block_h, cfg.decode_block_n]))


def _with_launcher(compiled) -> None:
    """Build the host-side launcher of a compiled kernel too (Triton compiles one C module per
    argument signature, ~0.5 s, on a kernel's first launch) so that it lands in the same cache."""
    if compiled is not None:
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        compiled.run  # noqa: B018 - the property loads the binary and builds the launcher


def _int4_mma_kernels(ks, cfg) -> list:
    """The Gluon int4 decode kernel of a config, for batches of up to 8 and up to 16 tokens (its
    two tiles of tokens)."""
    import torch

    from moegen.runtime.fused import int4_mma_constexprs
    from moegen.runtime.int4_mma import int4_decode_mma

    scale = ks.dtype
    zero = torch.uint8 if ks.weight_format.zero_point else scale  # the scales stand in without zero points
    return [int4_decode_mma.warmup(ks.dtype, torch.int32, torch.float32, torch.int32, scale, zero, torch.int32,
                                   scale, zero, torch.float32, 1 << 20, **int4_mma_constexprs(ks, cfg, tokens),
                                   grid=(1, 1))
            for tokens in (8, 16)]


def compile_buckets(ks, launchers: bool = False) -> None:
    """Compile (without launching) every kernel each bucket's config will launch; with
    ``launchers`` (on the GPU) their launchers as well."""
    import torch

    from moegen.runtime.fused import (DECODE_FINISH_BLOCK, DECODE_MAX_TOKENS, QUANTIZE_ROWS_BLOCK, decode_block_t,
                                      decode_routed_block_t, dependent_launch,
                                      down_launch, l2_evict_first, multi_route_launch, pdl_supported,
                                      single_route_launch, single_route_max_tokens, tma_possible, uses_decode,
                                      uses_tma)

    route, count, place, gate_up, down, decode = _mock_launch_args(ks)
    scales13, scales2 = _mock_scales(ks, "w13"), _mock_scales(ks, "w2")
    pdl = torch.cuda.is_available() and pdl_supported(torch.device("cuda"))
    as_dependent = dependent_launch(pdl)  # the routing and GEMM kernels and the decode finish
    count_launch, place_launch = multi_route_launch(ks)
    # Router logits come in the model's dtype (MoELayer) or float32: compile both.
    logits_dtypes = sorted({ks.dtype, torch.float32}, key=str)
    # Routed, with the logits in each dtype, and the picks of callers who route themselves
    # (align_picks: float32 stand-ins for the pointers it does not read).
    routings = [(dtype, True) for dtype in logits_dtypes] + [(torch.float32, False)]
    single_max = single_route_max_tokens(ks.num_experts)
    compiled, previous = [], 0
    # The GEMMs' activation rows (a pointer, and its scales where the format quantizes them first).
    rows = (ks.dtype,)
    if ks.quantize_rows is not None:
        rows = (torch.float8_e4m3fn, torch.float32)
        for width, slot_rows in ((ks.hidden_size, False), (ks.intermediate_size, True)):
            compiled.append(ks.quantize_rows.warmup(
                ks.dtype, torch.float8_e4m3fn, torch.float32, 1 << 20, torch.int32 if slot_rows else ks.dtype,
                1 << 20, K_SIZE=width, BLOCK_R=QUANTIZE_ROWS_BLOCK, SLOT_ROWS=slot_rows, num_warps=4, grid=(1, 1)))
    for index, (bucket, cfg) in enumerate(zip(ks.buckets, ks.configs)):
        if previous < single_max:  # some of this bucket's batches are routed by one program
            for logits_dtype, routed in routings:
                compiled.append(ks.route_align.warmup(logits_dtype, *route, BLOCK_M=cfg.block_m, TAIL_M=cfg.tail_m,
                                                      TAILS_FIRST=cfg.tails_first, ROUTE=routed, **as_dependent,
                                                      **single_route_launch(ks, bucket), grid=(1,)))
        if bucket > single_max:  # and some by the multi-program pair
            for logits_dtype, routed in routings:
                compiled.append(ks.route_count.warmup(logits_dtype, *count, ROUTE=routed, **count_launch,
                                                      **as_dependent, grid=(1,)))
            compiled.append(ks.route_place.warmup(*place, BLOCK_M=cfg.block_m, TAIL_M=cfg.tail_m,
                                                  TAILS_FIRST=cfg.tails_first, **place_launch, **as_dependent,
                                                  grid=(1,)))
        use_tma = uses_tma(ks, cfg) and tma_possible(ks)
        evict_first = l2_evict_first(ks, cfg, use_tma)
        w13, (inter, w2) = _operands(ks, cfg, use_tma)
        compiled.append(ks.gate_up.warmup(
            *rows, w13, *scales13, *gate_up, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, TAIL_M=cfg.tail_m, TAIL_SPLIT=cfg.tail_split, HALF_BLOCKS=cfg.half_blocks,
            USE_TMA=use_tma, L2_EVICT_FIRST=evict_first, INT4_PAIR_OPS=cfg.int4_pair_ops,
            INT4_SWAPPED=cfg.int4_swapped, **as_dependent, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            grid=(1,)))
        compiled.append(ks.down_reduce.warmup(
            inter, *rows, w2, *scales2, ks.dtype, *down, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n,
            BLOCK_K=cfg.down_block_k, GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k, TAIL_M=cfg.tail_m,
            TAIL_SPLIT=cfg.tail_split, HALF_BLOCKS=cfg.half_blocks, USE_TMA=use_tma, L2_EVICT_FIRST=evict_first,
            INT4_PAIR_OPS=cfg.int4_pair_ops, INT4_SWAPPED=cfg.int4_swapped, **as_dependent, **down_launch(cfg),
            grid=(1, 1)))
        decodes = cfg.decode_block_n and previous < DECODE_MAX_TOKENS  # some of this bucket's batches decode
        if decodes:  # the finish of either decode kernel
            compiled.append(ks.decode_finish.warmup(torch.float32, ks.dtype, 1 << 20, BLOCK=DECODE_FINISH_BLOCK,
                                                    num_warps=4, **as_dependent, grid=(1,)))
        if decodes and cfg.decode_int4_mma:  # the Gluon int4 decode kernel
            compiled.extend(_int4_mma_kernels(ks, cfg))
        elif decodes:
            w13, w2 = _decode_operands(ks, cfg, use_tma)
            decode_options = dict(BLOCK_N=cfg.decode_block_n, BLOCK_K=cfg.decode_block_k, BLOCK_H=cfg.decode_block_h,
                                  STAGGER_K=cfg.decode_stagger_k, USE_TMA=use_tma, L2_EVICT_FIRST=evict_first,
                                  USE_PDL=pdl, num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
                                  grid=(1, 1))
            last = DECODE_MAX_TOKENS if bucket == ks.buckets[-1] else min(bucket, DECODE_MAX_TOKENS)
            tokens = set(range(previous + 1, last + 1))  # beyond the last bucket too
            if index == ks.eager_decode_bucket:  # and the host-paced eager calls of buckets that do not decode
                tokens |= {t for t in range(1, DECODE_MAX_TOKENS + 1) if not uses_decode(ks.config_for(t), t)}
            block_ts = sorted({decode_block_t(ks, t) for t in tokens})
            for block_t, logits_dtype in itertools.product(block_ts, logits_dtypes):
                compiled.append(ks.decode.warmup(
                    logits_dtype, torch.float32, ks.dtype, w13, *scales13, w2, *scales2, *decode,
                    BLOCK_T=block_t, **decode_options))
            # The same for callers who route themselves (their picks as routing gives them:
            # float32 weights, int32 ids), over the batches of this bucket's own.
            own = range(previous + 1, last + 1)
            for block_t in sorted({decode_routed_block_t(ks, t) for t in own}):
                compiled.append(ks.decode_routed.warmup(
                    torch.float32, torch.int32, ks.dtype, w13, *scales13, w2, *scales2,
                    *decode[:2], *decode[3:],  # no logits stride
                    BLOCK_T=block_t, **decode_options))
        previous = bucket
    if launchers:
        for kernel in compiled:
            _with_launcher(kernel)


def precompiled_files(package_folder: Path) -> dict[str, bytes]:
    """Import the package at package_folder, compile its kernels into an empty Triton cache and
    return that cache as package files {triton_cache/<hash>/<name>: bytes}."""
    import triton

    from moegen.package.loader import load_package

    # Triton builds its driver's own C helpers into the active cache on first use: load the driver
    # now, so they land in the user's cache, and the package holds the same kernels whether this
    # is the process's first build or not.
    triton.runtime.driver.active.get_current_target()
    with tempfile.TemporaryDirectory(prefix="moegen-precompile-") as cache, triton.knobs.cache.scope():
        triton.knobs.cache.dir = cache
        package = load_package(package_folder)
        try:
            compile_buckets(package.KERNELS, launchers=True)
        finally:  # the next build from this folder imports afresh: new kernels, an empty cache
            for module in [m for m in sys.modules if m == package.__name__ or m.startswith(package.__name__ + ".")]:
                del sys.modules[module]
        files = {}
        for path in sorted(Path(cache).rglob("*")):
            if not path.is_file() or path.name.startswith("tmp."):
                continue
            data = path.read_bytes()
            if path.name.startswith(_GROUP_PREFIX):  # absolute child paths -> bare file names
                group = json.loads(data)
                group["child_paths"] = {k: Path(v).name for k, v in sorted(group["child_paths"].items())}
                data = json.dumps(group, sort_keys=True).encode()
            files[f"{CACHE_FOLDER}/{path.relative_to(cache).as_posix()}"] = data
        return files


def precompiled_sources(name: str, files: dict[str, str | bytes]) -> dict[str, bytes]:
    """precompiled_files of the package `files` make, compiled in a staging folder whose path
    depends only on those files, from sources with a fixed modification time: compiled kernels
    record their source's path and mtime (line info), so the same inputs give the same bytes,
    and a rebuild finds its package up to date."""
    digest = hashlib.sha256()
    for file_name, content in sorted(files.items()):
        digest.update(file_name.encode() + b"\0" + as_bytes(content) + b"\0")
    staging = Path(tempfile.gettempdir()) / f"moegen-build-{os.getuid()}-{digest.hexdigest()[:16]}"  # per user
    with open(f"{staging}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent build of the same sources waits its turn
        shutil.rmtree(staging, ignore_errors=True)
        try:
            write_package(staging / name, files)
            for path in (staging / name).rglob("*"):
                os.utime(path, (SOURCE_MTIME, SOURCE_MTIME))
            return precompiled_files(staging / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def install(package_folder: Path) -> int:
    """Copy the package's precompiled kernels into Triton's active cache; returns entries added.
    Never fatal: on any problem the kernels simply compile on first use."""
    source = Path(package_folder) / CACHE_FOLDER
    if not source.is_dir():
        return 0
    try:
        import triton

        cache = Path(triton.knobs.cache.dir)
        added = 0
        for entry in sorted(p for p in source.iterdir() if p.is_dir()):
            destination = cache / entry.name
            if destination.exists():
                continue
            cache.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f"tmp.moegen_{entry.name[:8]}_", dir=cache))
            for item in entry.iterdir():
                if item.name.startswith(_GROUP_PREFIX):
                    group = json.loads(item.read_text())
                    group["child_paths"] = {k: str(destination / v) for k, v in group["child_paths"].items()}
                    (staging / item.name).write_text(json.dumps(group))
                else:
                    shutil.copyfile(item, staging / item.name)
            try:
                os.rename(staging, destination)  # atomic; a concurrent installer may have won
                added += 1
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
        return added
    except Exception as error:  # noqa: BLE001 - a cache problem must not break the import
        warnings.warn(f"moegen: precompiled kernels in {source} not installed ({error}); "
                      "they will compile on first use", stacklevel=2)
        return 0
