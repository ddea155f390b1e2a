"""Render: the jinja2 environment, value-to-literal lowering and procedural kernel names.

Templates only substitute: every decision (dtype, activation, precision) is made here and
handed over as a finished literal."""
from __future__ import annotations

import hashlib
from pathlib import Path

import jinja2

from moegen import knobs
from moegen.errors import SettingError
from moegen.quant.formats import QUANTIZATIONS

ROUTE_ALIGN_TEMPLATE = "moe_route_align.py.jinja"
GATE_UP_TEMPLATE = "moe_gate_up.py.jinja"
DOWN_TEMPLATE = "moe_down_reduce.py.jinja"
DECODE_TEMPLATE = "moe_decode.py.jinja"
# The templates whose text shapes the compiled kernels (and so the tuning results), with the
# weight format's macros (kernel_templates).
KERNEL_TEMPLATES = (ROUTE_ALIGN_TEMPLATE, GATE_UP_TEMPLATE, DOWN_TEMPLATE, DECODE_TEMPLATE)
# How each weight format loads a weight tile and its scales and turns them into MMA operands:
# the macros the kernel templates import (templates/weights_none.jinja documents them).
WEIGHT_FORMAT_TEMPLATES = {q: f"weights_{q}.jinja" for q in QUANTIZATIONS}
# Templates a weight format's template imports: part of what its kernels are rendered from.
FORMAT_IMPORTS = {"fp8_block": ("fp8_cast.jinja",), "fp8_channel": ("fp8_cast.jinja",)}

def kernel_templates(signature) -> tuple[str, ...]:
    """The templates a signature's kernels are rendered from: the kernels' and its weight format's."""
    return format_templates(signature.quantization)


def format_templates(quantization: str) -> tuple[str, ...]:
    """The kernel templates and those of a weight format (unknown to this moegen: the kernels' alone)."""
    weights = WEIGHT_FORMAT_TEMPLATES.get(quantization)
    return KERNEL_TEMPLATES + ((weights, *FORMAT_IMPORTS.get(quantization, ())) if weights else ())


TL_DTYPES = {"bfloat16": "tl.bfloat16", "float16": "tl.float16", "float32": "tl.float32"}
TORCH_DTYPES = {"bfloat16": "_torch.bfloat16", "float16": "_torch.float16", "float32": "_torch.float32"}
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# float32 models use exact fp32 products: tf32 would miss the 1e-4 accuracy bar.
DOT_PRECISION = {"bfloat16": '"tf32"', "float16": '"tf32"', "float32": '"ieee"'}


def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(knobs.template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template_name: str, **values) -> str:
    """The template rendered; a Python template's output must compile. A problem with an edited
    template (MOEGEN_TEMPLATE_DIR) is a SettingError naming it; with moegen's own, a bug."""
    try:
        text = environment().get_template(template_name).render(**values)
        if template_name.endswith(".py.jinja"):
            compile(text, template_name, "exec")
        return text
    except (jinja2.TemplateError, UnicodeDecodeError, SyntaxError) as error:
        if knobs.template_dir() == knobs.SHIPPED_TEMPLATES:
            raise
        if isinstance(error, SyntaxError):
            detail = f" renders Python that does not compile (line {error.lineno} of its output: {error.msg})"
        elif isinstance(error, jinja2.TemplateSyntaxError):
            detail = f" line {error.lineno}: {error}"
        else:
            detail = f": {error}"
        raise SettingError("MOEGEN_TEMPLATE_DIR", str(knobs.template_dir()), template_name + detail,
                           "fix the template, or unset it") from None


def template_hashes() -> dict[str, str]:
    """sha256 of every template, by file name: part of the manifest and of tuning keys."""
    folder = knobs.template_dir()
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(folder).glob("*.jinja"))
    }


def kernel_name(stage: str, activation: str, dtype: str, h: int, i: int, e: int, k: int) -> str:
    """e.g. moe_gate_up_silu_bf16_h4096_i14336_e8_k2: identifier-safe by construction."""
    return f"moe_{stage}_{activation}_{SHORT_DTYPES[dtype]}_h{h}_i{i}_e{e}_k{k}"
