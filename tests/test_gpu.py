"""The shipped specs' kernels on a real GPU, in bf16, against the float64 reference.

Runs only where CUDA is available (`pytest -m gpu tests/test_gpu.py`; tools/gpu_check.py runs it
first). Each shipped spec is built once per module and its random weights are allocated once
(about 27 GB for all four, deepseek-v3 alone 22.5 GB) and freed at the end. The reference runs
in float64 on the GPU, converting one expert at a time.

Inputs are random, never zero; router logits come from separated_router_logits (or are
redrawn until clear-cut for the skewed routings), so kernels must route exactly like the
reference and any difference is the kernels' own arithmetic. Before every call the caching
allocator is poisoned (a large and many small buffers filled with 0xFF bytes, a NaN in every
float format, then freed), so a kernel that reads memory it never wrote produces NaN.
"""
from __future__ import annotations

import functools
import gc
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from moegen import reference as ref
from moegen.runtime import fused
from moegen.runtime.step_graphs import capture_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is false)"),
]

REPO_ROOT = Path(__file__).resolve().parent.parent
SPECS = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3")
TOLERANCE = 1.5e-2  # relative Frobenius error, bf16 in and out
ROW_TOLERANCE = 4e-2  # worst single token: catches a dropped or garbage row hidden in a large T
MIN_MARGIN = 1e-3  # routing margin of the redrawn skewed logits (as separated_router_logits)
DEVICE = "cuda"
DTYPE = torch.bfloat16  # every shipped spec is bf16


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


# ---------------------------------------------------------------------------------------------
# Packages and weights, once per module
# ---------------------------------------------------------------------------------------------


@dataclass
class Model:
    pkg: object  # the generated package
    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def m(self):
        return self.pkg.SPEC.model

    @property
    def routing(self):
        return self.pkg.KERNELS.routing


class _Models:
    """spec name -> Model, allocated on first use and kept until the module's end."""

    def __init__(self, packages: dict):
        self._packages = packages
        self._models: dict[str, Model] = {}

    def __getitem__(self, name: str) -> Model:
        if name not in self._models:
            pkg = self._packages[name]
            m = pkg.SPEC.model
            g = torch.Generator(device=DEVICE).manual_seed(_seed("weights", name))
            e, h, i = m.num_experts, m.hidden_size, m.intermediate_size
            w13 = torch.randn(e, 2 * i, h, generator=g, device=DEVICE, dtype=DTYPE).mul_(h ** -0.5)
            w2 = torch.randn(e, h, i, generator=g, device=DEVICE, dtype=DTYPE).mul_(i ** -0.5)
            self._models[name] = Model(pkg, w13, w2)
        return self._models[name]

    def clear(self) -> None:
        self._models.clear()


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    from moegen import load
    from moegen.package import build

    out = tmp_path_factory.mktemp("gpu_packages")
    return {name: load(build(REPO_ROOT / "specs" / f"{name}.yaml", out)[0]) for name in SPECS}


@pytest.fixture(scope="module")
def models(packages):
    cache = _Models(packages)
    yield cache
    cache.clear()
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def poison_allocator() -> None:
    """Fill cached-but-free allocator memory with 0xFF bytes (NaN as bf16/fp16/fp32), so the
    next allocations start as NaN: one big block and a few medium ones for the large pool, many
    small ones for the small pool (allocations under 1 MiB come from 2 MiB segments)."""
    free, _ = torch.cuda.mem_get_info()
    big = min(4 << 30, int(free * 0.5))
    blocks = [torch.empty(big, dtype=torch.uint8, device=DEVICE)]
    blocks += [torch.empty(size << 20, dtype=torch.uint8, device=DEVICE) for size in (2, 4, 8, 16, 32) * 4]
    blocks += [torch.empty(256 << 10, dtype=torch.uint8, device=DEVICE) for _ in range(64)]
    for block in blocks:
        block.fill_(0xFF)
    del blocks


def row_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The worst token's relative error (rows whose reference is ~0 count absolutely)."""
    diff = torch.linalg.vector_norm(out.to(torch.float64) - expected, dim=1)
    norm = torch.linalg.vector_norm(expected, dim=1).clamp_min(1e-6)
    return float((diff / norm).max())


def random_bias(num_experts: int, scale: float, generator) -> torch.Tensor:
    return (torch.randn(num_experts, generator=generator) * scale).to(torch.float32).to(DEVICE)


def skewed_logits(num_tokens: int, p, bias, generator, routing: str, hot: int,
                  enabled: Optional[torch.Tensor]) -> torch.Tensor:
    """Random logits reshaped so that every token picks expert `hot` ("one_expert") or only
    experts in `enabled` ("half_experts"); rows are redrawn until the routing is clear-cut."""
    e = p.num_experts
    bias_cpu = None if bias is None else bias.cpu()

    def shape(raw: torch.Tensor) -> torch.Tensor:
        z = raw.clone()
        if routing == "one_expert":
            z[:, hot] = z.max(dim=1).values + 3.0
        else:
            z[:, ~enabled] = -20.0
        return z.to(torch.float32)

    raw = torch.randn(num_tokens, e, generator=generator, dtype=torch.float64)
    for _ in range(500):
        logits = shape(raw)
        _, ids, margin = ref.route_reference(logits, p, bias_cpu)
        good = margin >= MIN_MARGIN
        if routing == "one_expert":
            good &= (ids == hot).any(dim=1)
        else:
            good &= enabled[ids].all(dim=1)
        if bool(good.all()):
            return logits.to(DEVICE)
        bad = ~good
        raw[bad] = torch.randn(int(bad.sum()), e, generator=generator, dtype=torch.float64)
    raise RuntimeError(f"could not draw clear-cut {routing} logits")


def fresh_hidden(num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=g, device=DEVICE, dtype=DTYPE)


def check_close(out: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOLERANCE) -> None:
    assert bool(torch.isfinite(out).all()), f"{what}: output has NaN/inf (reads of unwritten memory?)"
    err = ref.relative_error(out, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    worst = row_error(out, expected)
    assert worst <= ROW_TOLERANCE, f"{what}: worst token's relative error {worst:.3e} > {ROW_TOLERANCE:.1e}"


# ---------------------------------------------------------------------------------------------
# The case matrix
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    spec: str
    tokens: int
    routing: str = "random"  # random | one_expert | half_experts
    bias_scale: float = 0.05  # correction bias ~ N(0, scale^2) for specs that have one

    def __str__(self) -> str:
        extra = "" if self.routing == "random" else f"-{self.routing}"
        extra += "" if self.bias_scale == 0.05 else f"-bias{self.bias_scale:g}"
        return f"{self.spec}-T{self.tokens}{extra}"


CASES = (
    [Case(spec, t) for spec in SPECS for t in (1, 7, 64, 1000, 4096)]
    + [Case(spec, 0) for spec in SPECS]
    + [Case(spec, 300, "one_expert") for spec in SPECS]
    + [Case(spec, 200, "half_experts") for spec in SPECS]
    + [Case("deepseek-v3", 64, bias_scale=0.5), Case("deepseek-v3", 1000, bias_scale=0.5)]
)


def case_inputs(case: Case, model: Model):
    m, p = model.m, model.routing
    g = torch.Generator().manual_seed(_seed("case", case))
    bias = random_bias(m.num_experts, case.bias_scale, g) if m.correction_bias else None
    x = fresh_hidden(case.tokens, m.hidden_size, _seed("x", case))
    if case.routing == "random":
        logits = ref.separated_router_logits(case.tokens, p, bias, generator=g, device=DEVICE)
        return x, logits, bias, {}
    hot = int(torch.randint(m.num_experts, (1,), generator=g))
    enabled = torch.zeros(m.num_experts, dtype=torch.bool)
    enabled[torch.randperm(m.num_experts, generator=g)[: m.num_experts // 2]] = True
    logits = skewed_logits(case.tokens, p, bias, g, case.routing, hot, enabled)
    return x, logits, bias, {"hot": hot, "enabled": enabled}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_moe_matches_float64_reference(case, models):
    model = models[case.spec]
    m, p = model.m, model.routing
    x, logits, bias, info = case_inputs(case, model)
    poison_allocator()
    out = model.pkg.fused_moe(x, logits, model.w13, model.w2, correction_bias=bias)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (case.tokens, m.hidden_size)
    assert out.dtype == DTYPE and out.device == x.device
    if case.tokens == 0:
        return

    _, ids, _ = ref.route_reference(logits, p, bias)
    if case.routing == "one_expert":
        assert bool((ids == info["hot"]).any(dim=1).all())
    elif case.routing == "half_experts":
        touched = torch.unique(ids).cpu()
        assert bool(info["enabled"][touched].all()) and touched.numel() <= m.num_experts // 2
    if bias is not None and case.bias_scale >= 0.5:
        # The bias must matter for this case to test anything: it changes some tokens' experts.
        unbiased = ref.route_reference(logits, p, torch.zeros_like(bias))[1]
        assert not torch.equal(ids.sort(dim=1).values, unbiased.sort(dim=1).values)

    expected = ref.moe_reference(x, logits, model.w13, model.w2, p, m.activation, bias)
    check_close(out, expected, str(case))
    ks = model.pkg.KERNELS
    config = ks.config_for(case.tokens)
    if case.tokens <= fused.DECODE_MAX_TOKENS and not fused.uses_decode(config, case.tokens):
        # The eager call above may have decoded (host-paced, fused_moe): the bucket's tuned path too.
        out = fused.fused_moe(ks, x, logits, model.w13, model.w2, correction_bias=bias, config=config)
        check_close(out, expected, f"{case} tuned path")


DECODE_CASES = (
    [Case(spec, t) for spec in SPECS for t in (1, 3, 8, 16)]
    + [Case(spec, 12, "one_expert") for spec in SPECS]
    + [Case("deepseek-v3", 16, bias_scale=0.5)]
)


@pytest.mark.parametrize("stagger_k", [False, True], ids=["", "k_staggered"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_kernel_matches_float64_reference(case, stagger_k, models):
    """The one-launch decode kernel at the batch sizes it serves, whatever the tuned configs
    chose, with GEMM1's walk staggered and not; called twice, as the second call finds the
    workspace the first re-zeroed."""
    from dataclasses import replace

    from moegen.plan.configs import DECODE_DEFAULT
    from moegen.runtime.fused import fused_moe

    model = models[case.spec]
    ks = model.pkg.KERNELS
    config = replace(ks.config_for(case.tokens), tma=True, **DECODE_DEFAULT, decode_stagger_k=stagger_k)
    x, logits, bias, _ = case_inputs(case, model)
    expected = ref.moe_reference(x, logits, model.w13, model.w2, model.routing, model.m.activation, bias)
    for call in range(2):
        poison_allocator()
        out = fused_moe(ks, x, logits, model.w13, model.w2, correction_bias=bias, config=config)
        torch.cuda.synchronize()
        check_close(out, expected, f"{case} decode call {call}")


@pytest.mark.parametrize("evict_first", [False, True], ids=["", "l2_evict_first"])
@pytest.mark.parametrize("case", [Case(spec, t) for spec in SPECS for t in (1, 8, 300, 2000)]
                         + [Case(spec, 300, "one_expert") for spec in SPECS], ids=str)
def test_l2_marked_copies_match_float64_reference(case, evict_first, models):
    """Every kernel's tensor copies with the L2 evict-first mark (their PTX rewritten) and without,
    on the bucket's config read through descriptors, whatever the tuned configs chose."""
    from dataclasses import replace

    model = models[case.spec]
    check_config(case, model, replace(model.pkg.KERNELS.config_for(case.tokens), tma=True, l2_evict_first=evict_first))


TAIL_CASES = (
    [Case(spec, t) for spec in SPECS for t in (300, 2000)]
    + [Case(spec, 300, "one_expert") for spec in SPECS]
)
# (block_m, tail_m, descriptors, warps, GEMM2 register cap, streams, split, tails first): tail
# rows on both ways of reading the weights, with GEMM2 capped to two programs per SM, in
# two-stream halves (groups of 1), whose second half finds its tail rows through a shifted base,
# split (the half-width tail MMA where the remainder fits), and with the runs that carry them
# first (on their first block).
TAIL_CONFIGS = ((64, 16, False, 4, 0, 1, False, False), (128, 32, True, 8, 0, 1, False, False),
                (128, 32, True, 8, 128, 1, False, False), (64, 16, False, 4, 0, 2, False, False),
                (128, 16, True, 8, 128, 2, False, False), (128, 32, True, 8, 128, 1, True, False),
                (64, 32, False, 4, 0, 2, True, False), (128, 64, True, 8, 0, 1, True, False),
                (128, 32, True, 8, 128, 1, True, True), (128, 32, True, 8, 128, 2, True, True),
                (64, 16, False, 4, 0, 2, False, True))


@pytest.mark.parametrize("tail", TAIL_CONFIGS,
                         ids=lambda t: f"m{t[0]}t{t[1]}{'s' if t[6] else ''}{'f' if t[7] else ''}"
                         f"{'_tma' if t[2] else ''}{f'_r{t[4]}' if t[4] else ''}{'_2s' if t[5] == 2 else ''}")
@pytest.mark.parametrize("case", TAIL_CASES, ids=str)
def test_tail_rows_match_float64_reference(case, tail, models):
    """Blocks carrying their expert's last rows as tail rows, whatever the tuned configs chose."""
    block_m, tail_m, tma, warps, max_registers, streams, split, first = tail
    model = models[case.spec]
    group_m = 1 if streams == 2 else model.pkg.KERNELS.config_for(case.tokens).group_m
    check_row_layout(case, model, block_m=block_m, tail_m=tail_m, tma=tma, num_warps=warps,
                     down_num_warps=warps, down_max_registers=max_registers, streams=streams, group_m=group_m,
                     tail_split=split, tails_first=first)


def check_row_layout(case: Case, model: Model, **fields) -> None:
    """The case's call with its bucket's config on 64 x 64 tiles of three stages, the row layout
    as fields set it, against the float64 reference."""
    from dataclasses import replace

    check_config(case, model, replace(model.pkg.KERNELS.config_for(case.tokens), decode_block_n=0, block_n=64,
                                      block_k=64, num_stages=3, down_block_n=64, down_block_k=64,
                                      down_num_stages=3, split_k=1, **fields))


def check_config(case: Case, model: Model, config) -> None:
    """The case's call with config, against the float64 reference."""
    from moegen.runtime.fused import fused_moe

    x, logits, bias, _ = case_inputs(case, model)
    poison_allocator()
    out = fused_moe(model.pkg.KERNELS, x, logits, model.w13, model.w2, correction_bias=bias, config=config)
    torch.cuda.synchronize()
    expected = ref.moe_reference(x, logits, model.w13, model.w2, model.routing, model.m.activation, bias)
    check_close(out, expected, f"{case} {config.key}")


# (block_m, tail_m, descriptors, warps, streams): half blocks (swapped MMAs of half a block's
# rows) of 16 and 32 rows, on both ways of reading the weights, beside tail rows, in two-stream halves.
HALF_BLOCK_CONFIGS = ((32, 0, False, 4, 1), (64, 0, True, 4, 1), (64, 16, True, 4, 2), (128, 32, True, 8, 1))


@pytest.mark.parametrize("half", HALF_BLOCK_CONFIGS,
                         ids=lambda h: f"m{h[0]}t{h[1]}{'_tma' if h[2] else ''}{'_2s' if h[4] == 2 else ''}")
@pytest.mark.parametrize("case", [Case(spec, t) for spec in SPECS for t in (64, 300)]
                         + [Case(spec, 300, "one_expert") for spec in SPECS], ids=str)
def test_half_blocks_match_float64_reference(case, half, models):
    """Blocks whose rows fit in their first half multiply only that half, whatever the tuned
    configs chose."""
    block_m, tail_m, tma, warps, streams = half
    check_row_layout(case, models[case.spec], block_m=block_m, tail_m=tail_m, tma=tma, num_warps=warps,
                     down_num_warps=warps, down_max_registers=0, streams=streams, group_m=1, tail_split=False,
                     tails_first=False, half_blocks=True)


@pytest.mark.parametrize("case", [Case(spec, t) for spec in SPECS for t in (64, 300)]
                         + [Case(spec, 300, "one_expert") for spec in SPECS], ids=str)
def test_two_stream_halves_match_float64_reference(case, models):
    """Row blocks in halves on two streams, eagerly and as a CUDA graph replay (the side stream
    forked and joined inside the capture), whatever the tuned configs chose."""
    from dataclasses import replace

    from moegen.runtime.fused import fused_moe

    model = models[case.spec]
    ks = model.pkg.KERNELS
    config = replace(ks.config_for(case.tokens), streams=2, tail_m=0, decode_block_n=0)
    x, logits, bias, _ = case_inputs(case, model)
    expected = ref.moe_reference(x, logits, model.w13, model.w2, model.routing, model.m.activation, bias)
    poison_allocator()
    out = fused_moe(ks, x, logits, model.w13, model.w2, correction_bias=bias, config=config)
    torch.cuda.synchronize()
    check_close(out, expected, f"{case} two streams")
    graph, replayed = capture_graph(
        lambda: fused_moe(ks, x, logits, model.w13, model.w2, correction_bias=bias, config=config), warmups=2)
    poison_allocator()
    graph.replay()
    torch.cuda.synchronize()
    check_close(replayed, expected, f"{case} two streams, graph replay")


def spy_launches(monkeypatch) -> list:
    """(kernel, stream) of every launch of the runtime from now on, appended as they happen."""
    launched = []
    real_launch = fused.launch
    monkeypatch.setattr(fused, "launch", lambda kernel, grid, stream, *args, **kwargs: (
        launched.append((kernel, stream)), real_launch(kernel, grid, stream, *args, **kwargs)))
    return launched


def eager_calls_as_the_gpu_falls_behind(call, after: Callable[[str], None]) -> dict:
    """label -> output of eager calls (after(label) following each): two with the GPU caught up,
    two queued behind a sleeping kernel whose call before last has ended (the GPU within a call
    of the host), and one more than a call behind."""
    outputs = {}
    poison_allocator()
    for label in ("caught up", "caught up again"):
        torch.cuda.synchronize()
        outputs[label] = call()
        after(label)
    torch.cuda.synchronize()
    torch.cuda._sleep(2 ** 27)  # ~70 ms: the next calls' kernels wait behind it
    for label in ("queued", "queued, a call behind", "more than a call behind"):
        outputs[label] = call()
        after(label)
    return outputs


def check_graph_replay(case, call, expected, after: Callable[[], None]) -> None:
    """call captured in a CUDA graph (after() following the capture) and replayed, right."""
    graph, replayed = capture_graph(call)
    after()
    poison_allocator()
    graph.replay()
    torch.cuda.synchronize()
    check_close(replayed, expected, f"{case} graph replay")


@pytest.mark.parametrize("case", [Case(spec, t) for spec in ("qwen3-30b-a3b", "mixtral-8x7b") for t in (16, 300)],
                         ids=str)
def test_eager_calls_fork_the_second_stream_only_while_the_gpu_is_behind(case, models, monkeypatch):
    """An eager call of a two-stream config runs on the caller's stream alone unless the GPU has
    yet to finish the eager call before last (it is more than a call behind the host), and then
    forks the second stream, but for decode batches, which never do; a call captured in a CUDA
    graph always forks it. Right every way."""
    from dataclasses import replace

    model = models[case.spec]
    ks = model.pkg.KERNELS
    config = replace(ks.config_for(case.tokens), streams=2, decode_block_n=0)
    x, logits, bias, _ = case_inputs(case, model)
    expected = ref.moe_reference(x, logits, model.w13, model.w2, model.routing, model.m.activation, bias)
    launched = spy_launches(monkeypatch)
    side = fused.side_stream(x.device)

    def call():
        launched.clear()
        return fused.fused_moe(ks, x, logits, model.w13, model.w2, correction_bias=bias, config=config)

    def forked() -> bool:
        return any(stream is side for _, stream in launched)

    def after(label):  # decode batches: one stream
        assert forked() == (label == "more than a call behind" and case.tokens > fused.EAGER_ONE_STREAM_MAX_TOKENS)

    outputs = eager_calls_as_the_gpu_falls_behind(call, after)
    torch.cuda.synchronize()
    for label, out in outputs.items():
        check_close(out, expected, f"{case} eager, GPU {label}")

    def captured():
        assert forked()

    check_graph_replay(case, call, expected, captured)


@pytest.mark.parametrize("case", [Case("qwen3-30b-a3b", t) for t in (12, 16)]
                         + [Case("deepseek-v3", t) for t in (2, 16)], ids=str)
def test_host_paced_eager_decode_batches_take_the_decode_kernel(case, models, monkeypatch):
    """An eager call of a decode batch whose bucket runs the three-kernel path takes the decode
    kernel of the largest bucket that has one while the GPU is within a call of the host, and
    the tuned path once it is more than a call behind; a call captured in a CUDA graph, or given
    its config, the tuned path. Right every way."""
    model = models[case.spec]
    ks = model.pkg.KERNELS
    assert not fused.uses_decode(ks.config_for(case.tokens), case.tokens) and ks.eager_decode_bucket is not None
    x, logits, bias, _ = case_inputs(case, model)
    expected = ref.moe_reference(x, logits, model.w13, model.w2, model.routing, model.m.activation, bias)
    launched = spy_launches(monkeypatch)

    def call(config=None):
        launched.clear()
        return fused.fused_moe(ks, x, logits, model.w13, model.w2, correction_bias=bias, config=config)

    def decoded() -> bool:
        kernels = {kernel for kernel, _ in launched}
        assert (ks.decode in kernels) != (ks.gate_up in kernels)
        return ks.decode in kernels

    def after(label):
        assert decoded() == (label != "more than a call behind"), label

    outputs = eager_calls_as_the_gpu_falls_behind(call, after)
    outputs["config given"] = call(config=ks.config_for(case.tokens))
    assert not decoded()
    torch.cuda.synchronize()
    for label, out in outputs.items():
        check_close(out, expected, f"{case} eager, GPU {label}")

    def captured():
        assert not decoded()

    check_graph_replay(case, call, expected, captured)


def test_correction_bias_is_required(models):
    model = models["deepseek-v3"]
    x = fresh_hidden(3, model.m.hidden_size, 1)
    logits = torch.randn(3, model.m.num_experts, device=DEVICE)
    with pytest.raises(ValueError, match="correction_bias"):
        model.pkg.fused_moe(x, logits, model.w13, model.w2)


# ---------------------------------------------------------------------------------------------
# Routing options beyond the shipped specs', compiled (the interpreter runs the CPU matrix)
# ---------------------------------------------------------------------------------------------

# Small experts, so that only the routing differs from what the shipped specs compile: every
# scoring, grouping and bias option, and expert counts that are not powers of two.
ROUTING_OPTIONS = {
    "softmax_60": dict(num_experts=60, top_k=4),
    "softmax_no_renormalize": dict(num_experts=128, top_k=8, renormalize=False),
    "sigmoid_top1": dict(num_experts=16, top_k=1, scoring="sigmoid", renormalize=False),
    # DeepSeek-V2's group-limited greedy: softmax, groups by their best score, no bias.
    "grouped_softmax_deepseek_v2": dict(num_experts=160, top_k=6, n_group=8, topk_group=3, renormalize=False,
                                        routed_scaling_factor=16.0),
    "grouped_softmax_128": dict(num_experts=128, top_k=6, n_group=8, topk_group=3),
    "grouped_softmax_64": dict(num_experts=64, top_k=8, n_group=8, topk_group=3),
    "grouped_sigmoid_no_bias": dict(num_experts=256, top_k=8, n_group=8, topk_group=4, scoring="sigmoid"),
    "grouped_bias": dict(num_experts=256, top_k=8, n_group=8, topk_group=4, scoring="sigmoid", correction_bias=True,
                         routed_scaling_factor=2.5),
    "grouped_bias_softmax_groups_of_six": dict(num_experts=24, top_k=4, n_group=4, topk_group=2,
                                               correction_bias=True),
}
ROUTE_TILE_ROWS = (1, 2, 4, 8, 16)  # token rows of the routing tiles the runtime sizes


def routing_option_package(name: str, package_factory):
    return package_factory(buckets=(1, 8, 64), hidden_size=128, intermediate_size=64, dtype="bfloat16",
                           **ROUTING_OPTIONS[name])


def routing_option_model(name: str, package_factory) -> Model:
    pkg = routing_option_package(name, package_factory)
    e, h, i = pkg.SPEC.model.num_experts, pkg.SPEC.model.hidden_size, pkg.SPEC.model.intermediate_size
    g = torch.Generator(device=DEVICE).manual_seed(_seed("routing weights", name))
    w13 = torch.randn(e, 2 * i, h, generator=g, device=DEVICE, dtype=DTYPE).mul_(h ** -0.5)
    w2 = torch.randn(e, h, i, generator=g, device=DEVICE, dtype=DTYPE).mul_(i ** -0.5)
    return Model(pkg, w13, w2)


@pytest.mark.parametrize("name", ROUTING_OPTIONS)
def test_routing_options_match_float64_reference(name, package_factory):
    """Every path's routing (the decode kernel's, the single program's, the count kernel's) on
    the compiled kernels, eager and replayed: Triton 3.6 computes group-limited routing without a
    bias wrongly in some tiles of 2 to 8 token rows, where the interpreter computes it right
    (fused.route_tile_rows)."""
    model = routing_option_model(name, package_factory)
    m, p = model.m, model.routing
    g = torch.Generator().manual_seed(_seed("routing", name))
    bias = random_bias(m.num_experts, 0.05, g) if m.correction_bias else None
    for tokens in (1, 3, 8, 9, 64, 300):
        x = fresh_hidden(tokens, m.hidden_size, _seed("routing x", name, tokens))
        logits = ref.separated_router_logits(tokens, p, bias, generator=g, device=DEVICE)
        expected = ref.moe_reference(x, logits, model.w13, model.w2, p, m.activation, bias)
        call = functools.partial(model.pkg.fused_moe, x, logits, model.w13, model.w2, correction_bias=bias)
        check_close(call(), expected, f"{name} T={tokens} eager")
        graph, out = capture_graph(call)
        graph.replay()
        check_close(out, expected, f"{name} T={tokens} replayed")


@pytest.mark.parametrize("name", ROUTING_OPTIONS)
def test_count_kernel_routes_at_every_token_tile(name, package_factory):
    """The multi-program routing's count kernel at each token tile the runtime may launch it
    with (fused.route_tile_rows of the sizes it picks by the expert count): the experts and
    weights of every token."""
    ks = routing_option_package(name, package_factory).KERNELS
    p, tokens = ks.routing, 64
    g = torch.Generator().manual_seed(_seed("count", name))
    bias = random_bias(p.num_experts, 0.05, g) if p.correction_bias else None
    logits = ref.separated_router_logits(tokens, p, bias, generator=g, device=DEVICE)
    want_weights, want_ids, _ = ref.route_reference(logits, p, bias)
    slots = tokens * p.top_k
    for block_t in sorted({fused.route_tile_rows(ks, rows) for rows in ROUTE_TILE_ROWS}):
        weights = torch.empty(slots, dtype=torch.float32, device=DEVICE)
        ids = torch.empty(slots, dtype=torch.int32, device=DEVICE)
        ranks = torch.empty(slots, dtype=torch.int32, device=DEVICE)
        counts = torch.full((p.num_experts,), slots, dtype=torch.int32, device=DEVICE)
        ks.route_count[(tokens // block_t,)](logits, weights if bias is None else bias, weights, ids, ranks, counts,
                                             tokens, logits.stride(0), BLOCK_T=block_t, ROUTE=True, USE_PDL=False)
        # Picks in order of their choice score, as the reference ranks them.
        assert torch.equal(ids.view(tokens, p.top_k).long(), want_ids), f"{name} BLOCK_T={block_t}: experts"
        torch.testing.assert_close(weights.view(tokens, p.top_k).double(), want_weights, rtol=1e-5, atol=1e-6,
                                   msg=lambda text: f"{name} BLOCK_T={block_t}: weights: {text}")
        assert torch.equal(counts - slots, torch.bincount(want_ids.flatten(), minlength=p.num_experts).int()), \
            f"{name} BLOCK_T={block_t}: counts"


# ---------------------------------------------------------------------------------------------
# fused_experts with the caller's routing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("tokens", [3, 97])  # the single-program alignment of picks (or the decode kernel), the pair's
def test_fused_experts_with_caller_routing(spec, ids_dtype, tokens, models):
    model = models[spec]
    m = model.m
    g = torch.Generator().manual_seed(_seed("experts", spec, ids_dtype, tokens))
    # k distinct experts per token, arbitrary positive weights (not normalized).
    ids = torch.rand(tokens, m.num_experts, generator=g).argsort(dim=1)[:, : m.top_k].to(ids_dtype).to(DEVICE)
    weights = (torch.rand(tokens, m.top_k, generator=g) + 0.1).to(DEVICE)
    x = fresh_hidden(tokens, m.hidden_size, _seed("experts-x", spec))
    poison_allocator()
    out = model.pkg.fused_experts(x, weights, ids, model.w13, model.w2)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (tokens, m.hidden_size) and out.dtype == DTYPE
    expected = ref.experts_reference(x, weights, ids, model.w13, model.w2, m.activation)
    check_close(out, expected, f"{spec} fused_experts")


# ---------------------------------------------------------------------------------------------
# MoELayer end to end, shared expert included
# ---------------------------------------------------------------------------------------------


def test_moe_layer_deepseek_with_shared_expert(packages):
    pkg = packages["deepseek-v3"]
    m, p = pkg.SPEC.model, pkg.KERNELS.routing
    assert m.num_shared_experts > 0
    torch.manual_seed(_seed("layer"))
    layer = pkg.MoELayer(device=DEVICE)  # its own 22.5 GB of random (normal, 1/sqrt(fan_in)) weights
    try:
        with torch.no_grad():
            layer.correction_bias.copy_(torch.randn(m.num_experts, device=DEVICE) * 0.05)
            batch, seq, h = 3, 11, m.hidden_size
            x = torch.randn(batch * seq, h, device=DEVICE, dtype=DTYPE)
            # The layer routes on its own bf16 gate output, where ties are possible: redraw tokens
            # until every selection is clear-cut, so any difference is the kernels' arithmetic.
            for _ in range(100):
                margin = ref.route_reference(layer.gate(x), p, layer.correction_bias)[2]
                bad = margin < 1e-4
                if not bool(bad.any()):
                    break
                x[bad] = torch.randn(int(bad.sum()), h, device=DEVICE, dtype=DTYPE)
            else:
                pytest.fail("could not draw clear-cut hidden states for the layer test")
            seen = []
            hook = layer.gate.register_forward_hook(lambda _mod, _inp, logits: seen.append(logits))
            poison_allocator()
            out = layer(x.view(batch, seq, h))
            torch.cuda.synchronize()
            hook.remove()
            assert tuple(out.shape) == (batch, seq, h) and out.dtype == DTYPE
            logits = seen[0]
            expected = ref.moe_reference(x, logits, layer.w13, layer.w2, p, m.activation, layer.correction_bias)
            shared = ref.gated_mlp_reference(x, layer.shared_w13, layer.shared_w2, m.activation)
            expected = expected + shared
            # the shared expert contributes a sizeable part: the test would catch it missing
            assert float(shared.norm()) > 0.1 * float(expected.norm())
            check_close(out.view(-1, h), expected, "deepseek-v3 MoELayer")
    finally:
        del layer
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# CUDA graphs: a decode step captured once, replayed with new inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("case", [Case(spec, t) for spec in ("qwen3-30b-a3b", "deepseek-v3") for t in (1, 64, 300)],
                         ids=str)
def test_compiled_kernels_launch_without_triton_run(case, streams, models, monkeypatch):
    """Once a call has compiled its kernels, every launch of the next call goes straight to the
    compiled kernel's launcher (moegen.runtime.launch), on the right streams; with a launch hook
    set (a profiler's), launches go through Triton's own path and reach the hook. Both right."""
    from dataclasses import replace

    import triton

    from moegen.runtime import launch
    from moegen.runtime.fused import fused_moe

    if not launch.DIRECT:
        pytest.skip(f"direct launches are written for Triton 3.6; this is {triton.__version__}")
    model = models[case.spec]
    ks = model.pkg.KERNELS
    config = replace(ks.config_for(case.tokens), streams=streams)
    x, logits, bias, _ = case_inputs(case, model)
    expected = ref.moe_reference(x, logits, model.w13, model.w2, model.routing, model.m.activation, bias)

    def call():
        return fused_moe(ks, x, logits, model.w13, model.w2, correction_bias=bias, config=config)

    call()
    through_triton = []
    triton_launch = launch._triton_launch
    monkeypatch.setattr(launch, "_triton_launch", lambda kernel, *rest: (through_triton.append(kernel),
                                                                         triton_launch(kernel, *rest)))
    poison_allocator()
    out = call()
    torch.cuda.synchronize()
    assert through_triton == []
    check_close(out, expected, f"{case} streams={streams}")

    hooked = []
    hook = hooked.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        poison_allocator()
        out = call()
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert through_triton and len(hooked) == len(through_triton)
    check_close(out, expected, f"{case} streams={streams}, launch hook set")


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_graph_decode_step(spec, tokens, models):
    model = models[spec]
    m, p = model.m, model.routing
    g = torch.Generator().manual_seed(_seed("graph", spec, tokens))

    def draw(round_: int):
        x = fresh_hidden(tokens, m.hidden_size, _seed("graph-x", spec, tokens, round_))
        bias = random_bias(m.num_experts, 0.05, g) if m.correction_bias else None
        logits = ref.separated_router_logits(tokens, p, bias, generator=g, device=DEVICE)
        return x, logits, bias

    static_x, static_logits, static_bias = (t.clone() if t is not None else None for t in draw(0))

    def step():
        return model.pkg.fused_moe(static_x, static_logits, model.w13, model.w2, correction_bias=static_bias)

    graph, static_out = capture_graph(step, warmups=3)

    for round_ in (1, 2):  # two rounds: replays must not return a stale result
        x, logits, bias = draw(round_)
        static_x.copy_(x)
        static_logits.copy_(logits)
        if bias is not None:
            static_bias.copy_(bias)
        graph.replay()
        torch.cuda.synchronize()
        replayed = static_out.clone()
        poison_allocator()
        eager = model.pkg.fused_moe(x, logits, model.w13, model.w2, correction_bias=bias)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(replayed).all())
        # Same kernels and config: equal up to the order of the atomic top-k reduction (a stale
        # replay, computed from the previous round's inputs, would be off by ~100%).
        assert ref.relative_error(replayed, eager) <= TOLERANCE, f"replay differs from eager (round {round_})"
        expected = ref.moe_reference(x, logits, model.w13, model.w2, p, m.activation, bias)
        check_close(replayed, expected, f"{spec} T={tokens} graph replay {round_}")
        check_close(eager, expected, f"{spec} T={tokens} eager {round_}")
    del graph


# ---------------------------------------------------------------------------------------------
# The TMA streaming read behind the bandwidth ceiling and the read-only bound
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 255, 256, 257, 256 * 132 * 3 + 77, 1 << 20], ids=str)
def test_tma_read_visits_every_box(rows):
    """Each box's first rows reach the per-program sums, in a graph replay too: every box is read,
    where it lies, the partial last one zero-filled past the end; a ceiling measured with a reader
    that skipped boxes would be too high."""
    from moegen.tune import tma_read

    if not tma_read.available(torch.device(DEVICE)):
        pytest.skip("the TMA reader needs sm_90 or newer")
    src = torch.randn(rows, tma_read.BOX_COLUMNS, generator=torch.Generator(DEVICE).manual_seed(rows),
                      device=DEVICE, dtype=DTYPE)
    padded = torch.zeros(-(-rows // tma_read.BOX_ROWS) * tma_read.BOX_ROWS, tma_read.BOX_COLUMNS,
                         device=DEVICE, dtype=torch.float64)
    padded[:rows] = src.double()
    boxes = padded.view(-1, tma_read.BOX_ROWS, tma_read.BOX_COLUMNS)
    expected = boxes[:, :tma_read.SUMMED_ROWS].sum().item()
    scale = boxes[:, :tma_read.SUMMED_ROWS].abs().sum().item()
    read = tma_read.TmaRead(src.view(-1))
    graph, _ = capture_graph(read, warmups=1)
    for run in (read, graph.replay):
        read.sums.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        assert abs(read.first_rows_sum() - expected) <= 1e-5 * scale, run


# ---------------------------------------------------------------------------------------------
# The tuner's paired timing (a forced re-tune's duel)
# ---------------------------------------------------------------------------------------------


def test_paired_rounds_replay_each_call():
    """bench.time_in_rounds captures each call once and replays it in every round: each call's
    counter advances by at least time_evicted's minimum of replays per round, and every round
    gives a finite time."""
    from moegen.tune import bench

    counters = [torch.zeros(1, device=DEVICE, dtype=torch.float64) for _ in range(2)]
    times = bench.time_in_rounds([lambda c=c: c.add_(1.0) for c in counters], True, 3)
    assert [len(t) for t in times] == [3, 3]
    assert all(0.0 < us < float("inf") for t in times for us in t)
    assert all(c.item() >= 3 * 5 for c in counters)
