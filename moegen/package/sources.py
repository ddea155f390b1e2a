"""Render a BuildPlan into the generated package's files: {relative path: text}.

Deterministic: no timestamps, sorted keys, fixed float formatting; the same plan and versions
give byte-identical files."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from moegen import __version__
from moegen.package.loader import content_hash
from moegen.package.writer import GENERATED_MARK, as_bytes
from moegen.plan import BuildPlan
from moegen.plan.configs import pow2_at_least
from moegen.plan.cost_model import FORMULAS, matrix_tflops
from moegen.plan.offload import OFFLOAD_FORMULAS, OffloadPlan
from moegen.runtime.align import EXPERT_MASK, LEFT_SHIFT, RANK_SHIFT, RUN_WRAP
from moegen.runtime.fused import group_tile
from moegen.render import (DECODE_TEMPLATE, DOT_PRECISION, DOWN_TEMPLATE, GATE_UP_TEMPLATE, ROUTE_ALIGN_TEMPLATE,
                           TL_DTYPES, TORCH_DTYPES, WEIGHT_FORMAT_TEMPLATES, kernel_name, render, template_hashes)



def tool_versions() -> dict[str, str]:
    import torch
    import triton

    return {"moegen": __version__, "torch": torch.__version__, "triton": triton.__version__}


def _config_literal(config) -> str:
    fields = ", ".join(f"{k}={v!r}" for k, v in asdict(config).items())
    return f"KernelConfig({fields})"


def manifest(build: BuildPlan, versions: dict[str, str], files: dict[str, str],
             spec_path: str | None = None) -> dict:
    """What the package was built from, and the sha256 of every other file it was built with:
    the import checks both (moegen.package.loader.checked_manifest). spec_path: the spec file
    relative to the package folder, for the rebuild command a stale package prints."""
    ir = build.ir
    content = {
        "generator": "moegen",
        "versions": versions,
        "spec_file": ir.spec_file,
        "spec_path": spec_path,
        "spec_hash": ir.spec_hash,
        "spec": ir.spec.to_dict(),
        "signature": asdict(ir.signature),
        "target": asdict(ir.target),
        "templates": template_hashes(),
        "buckets": [
            {"tokens": b.tokens, "config": asdict(b.config), "source": b.source} for b in build.buckets
        ],
        "files": {name: hashlib.sha256(as_bytes(text)).hexdigest() for name, text in sorted(files.items())},
    }
    return {**content, "content_sha256": content_hash(content)}


def _report_rows(build: BuildPlan) -> list[list[str]]:
    rows = []
    for b in build.buckets:
        c, cost = b.config, b.cost
        rows.append([
            str(b.tokens), f"{cost.experts_touched:.2f}", f"{cost.flops / 1e9:.3f}",
            f"{cost.bytes / 1e6:.2f}", f"{cost.intensity:.1f}", f"{cost.floor_us:.2f}", cost.bound,
            str(c.block_m) + (f" + {c.tail_m} tail" if c.tail_m else ""), f"{c.block_n} x {c.block_k}",
            f"{c.down_block_n} x {c.down_block_k}",
            str(c.group_m), str(c.num_warps), str(c.num_stages), b.source,
        ])
    return rows


def offload_summary(p: OffloadPlan) -> list[tuple[str, str]]:
    """(quantity, value) rows for REPORT.md and `moegen plan`."""
    slots = sorted(set(p.slots_per_layer))
    return [
        ("experts offloaded", "yes" if p.offloaded else "no: every expert fits the budget"),
        ("expert size", f"{p.expert_bytes / 2**20:.1f} MiB"),
        ("budget", f"{p.budget_bytes / 2**30:.1f} GiB for {p.num_layers} x {p.num_experts} experts "
                   f"({p.num_layers * p.num_experts * p.expert_bytes / 2**30:.1f} GiB)"),
        ("slots per layer", ", ".join(map(str, slots)) if len(slots) <= 4 else f"{slots[0]}..{slots[-1]}"),
        ("pinned experts", str(sum(len(x) for x in p.pinned))),
        ("policy / prefetch", f"{p.policy} / {p.prefetch} (lookahead {p.lookahead} layers)"),
        ("layer compute / expert transfer", f"{p.layer_compute_us:.1f} us / {p.transfer_us:.1f} us"),
        ("expected hit rate", f"{p.expected_hit_rate:.3f} ({p.estimate_from})"),
        ("bytes moved per token", f"{p.bytes_per_token / 2**20:.1f} MiB"),
        ("stall per token", f"{p.stall_ms_per_token:.2f} ms"),
    ]


def weight_summary(fmt) -> str:
    """The experts' format in words, for the package's docstring."""
    if not fmt.quantized:
        return f"{fmt.dtype} weights"
    detail = {"fp8_block": "float8_e4m3fn, a float32 scale per 128 x 128 block, fp8 activations",
              "fp8_channel": "float8_e4m3fn, a float32 scale per output channel, fp8 activations",
              "int4_group": f"4-bit, a {fmt.dtype} scale per {fmt.group_size} inputs"
                            + (" with zero points" if fmt.zero_point else "")}[fmt.quantization]
    return f"{fmt.quantization} ({detail}; w13_scale and w2_scale{', w13_zero and w2_zero' if fmt.zero_point else ''} " \
           "go with the weights)"


def render_sources(build: BuildPlan, versions: dict[str, str], spec_path: str | None = None) -> dict[str, str]:
    """spec_path: the spec file relative to the package's folder (recorded in the manifest)."""
    ir = build.ir
    sig = ir.signature
    header = f"{GENERATED_MARK} {versions['moegen']} from {ir.spec_file}: do not edit."
    names = {stage: kernel_name(stage, sig.activation, sig.dtype, sig.hidden_size,
                                sig.intermediate_size, sig.num_experts, sig.top_k)
             for stage in ("route_align", "gate_up", "down_reduce", "decode")}
    kernel_values = dict(
        header=header, hidden_size=sig.hidden_size, intermediate_size=sig.intermediate_size,
        top_k=sig.top_k, dot_precision=DOT_PRECISION[sig.dtype],
        weight_format=WEIGHT_FORMAT_TEMPLATES[sig.quantization], group_size=sig.group_size,
        zero_point=repr(sig.zero_point), weight_dtype=TL_DTYPES[sig.dtype],
    )
    routing_args = ", ".join(f"{k}={v!r}" for k, v in asdict(ir.routing).items())
    target = ir.target
    r = ir.routing
    groups_pow2, group_size_pow2 = group_tile(r)
    route_values = dict(
        header=header, kernel_name=names["route_align"], scoring=r.scoring, top_k=r.top_k,
        top_k_pow2=pow2_at_least(r.top_k),
        num_experts=r.num_experts, num_experts_pow2=pow2_at_least(r.num_experts),
        use_softmax=repr(r.scoring == "softmax"), use_bias=repr(r.correction_bias),
        renormalize=repr(r.renormalize), routed_scaling_factor=repr(float(r.routed_scaling_factor)),
        n_group=r.n_group, n_group_pow2=groups_pow2, topk_group=r.topk_group,
        group_size_pow2=group_size_pow2,
        run_wrap=RUN_WRAP, rank_shift=RANK_SHIFT, left_shift=LEFT_SHIFT, expert_mask=EXPERT_MASK,
    )
    files = {
        "_moe_route_align.py": render(ROUTE_ALIGN_TEMPLATE, **route_values),
        "_moe_gate_up.py": render(GATE_UP_TEMPLATE, **kernel_values, kernel_name=names["gate_up"],
                                  activation_fn=f"_{sig.activation}"),
        "_moe_down_reduce.py": render(DOWN_TEMPLATE, **kernel_values, kernel_name=names["down_reduce"]),
        "_moe_decode.py": render(DECODE_TEMPLATE, **kernel_values, kernel_name=names["decode"],
                                 activation_fn=f"_{sig.activation}"),
        "_configs.py": render(
            "configs.py.jinja", header=header,
            buckets=repr(tuple(b.tokens for b in build.buckets)),
            config_lines=[_config_literal(b.config) for b in build.buckets],
        ),
        "__init__.py": render(
            "package_init.py.jinja", header=header, name=ir.spec.name,
            summary=(f"E={sig.num_experts}, top-{sig.top_k}, H={sig.hidden_size}, "
                     f"I={sig.intermediate_size}, {sig.activation}, {sig.dtype}"),
            route_align_kernel=names["route_align"], gate_up_kernel=names["gate_up"],
            down_reduce_kernel=names["down_reduce"], decode_kernel=names["decode"],
            hidden_size=sig.hidden_size, intermediate_size=sig.intermediate_size,
            num_experts=sig.num_experts, top_k=sig.top_k, activation=repr(sig.activation),
            torch_dtype=TORCH_DTYPES[sig.dtype],
            routing_args=routing_args,
            weight_format_args=", ".join(f"{k}={v!r}" for k, v in asdict(sig.weight_format).items()),
            weight_summary=weight_summary(sig.weight_format),
        ),
        "REPORT.md": render(
            "report.md.jinja", header_md=f"<!-- {header[2:]} -->", name=ir.spec.name,
            signature=sig.key, target_name=target.name, hbm_gbps=f"{target.hbm_gbps:g}",
            tflops=f"{matrix_tflops(sig, target):g}",
            rate_note=" (fp32 without tensor cores)" if sig.dtype == "float32" else "",
            sm_count=target.sm_count,
            formula_rows=[(k, str(v)) for k, v in FORMULAS.items()],
            bucket_rows=_report_rows(build),
            offload_rows=offload_summary(build.offload),
            offload_formulas=[(k, str(v)) for k, v in OFFLOAD_FORMULAS.items()],
        ),
        "plan.json": json.dumps(build.offload.to_json(), indent=2, sort_keys=True) + "\n",
    }
    files["manifest.json"] = json.dumps(manifest(build, versions, files, spec_path), indent=2, sort_keys=True) + "\n"
    return files
