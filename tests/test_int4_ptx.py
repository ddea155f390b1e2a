"""The int4 kernels' inline PTX (INT4_PAIR_ASM, templates/weights_int4_group.jinja) runs only on a
GPU, where the interpreter runs the same steps in Triton ops: here a small model of the few PTX
instructions it uses runs the rendered string on every byte with random scales and zero points: each
weight must equal (q - zero) * scale rounded once to the model dtype, the low nibble's in the
first output."""
from __future__ import annotations

import importlib
import re

import pytest
import torch

SHAPE = dict(hidden_size=96, intermediate_size=80, num_experts=6, top_k=2)  # only the rendered string matters


def _bits(value: float, dtype) -> int:
    return int(torch.tensor([value], dtype=torch.float32).to(dtype).view(torch.int16)) & 0xFFFF


def _value(bits: int, dtype) -> float:
    return float(torch.tensor([bits - (1 << 16) * (bits >> 15)], dtype=torch.int16).view(dtype).float())


def run_ptx(asm: str, registers: dict, dtype) -> dict:
    """Registers after the asm: 32-bit values by name, 16-bit halves as their own names."""
    regs = dict(registers)
    value = lambda name: int(name, 0) if name[0].isdigit() else regs[name]  # noqa: E731
    for line in asm.replace("{\n", "\n").split("\n"):
        line = line.strip().rstrip(";")
        if not line or line == "}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        split = re.fullmatch(r"\{([$\w]+), ([$\w]+)\}, (\S+)", args)
        dest, *ops = [a.strip() for a in re.split(r",(?![^{]*\})", args)]
        if op == "mov.b32" and split:
            low, high, source = split.groups()
            regs[low], regs[high] = value(source) & 0xFFFF, value(source) >> 16
        elif op == "mov.b32" and ops[0].startswith("{"):
            low, high = ops[0].strip("{}").replace(" ", "").split(",")
            regs[dest] = value(low) | value(high) << 16
        elif op == "mov.b32":
            regs[dest] = value(ops[0])
        elif op == "shr.u32":
            regs[dest] = value(ops[0]) >> value(ops[1])
        elif op == "mul.lo.u32":
            regs[dest] = value(ops[0]) * value(ops[1]) & 0xFFFFFFFF
        elif op == "lop3.b32":
            a, b, c, table = (value(o) for o in ops)
            assert table == 0xEA  # (a & b) | c
            regs[dest] = (a & b) | c
        elif op.startswith("fma.rn."):
            a, b, c = (value(o) for o in ops)
            lanes = [_value((a >> s) & 0xFFFF, dtype) * _value((b >> s) & 0xFFFF, dtype) + _value((c >> s) & 0xFFFF, dtype)
                     for s in (0, 16)]
            regs[dest] = _bits(lanes[0], dtype) | _bits(lanes[1], dtype) << 16  # exact in float32: one rounding
        else:
            raise AssertionError(f"no model of {line!r}")
    return regs


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_int4_pair_asm_dequantizes_a_byte_as_the_reference(dtype, zero_point, package_factory):
    pkg = package_factory(buckets=(1,), dtype=dtype, router_dtype="float32", quantization="int4_group",
                          quantization_group_size=32, quantization_zero_point=zero_point, **SHAPE)
    gate_up = importlib.import_module(pkg.KERNELS.gate_up.fn.__module__)
    asm, magic, torch_dtype = gate_up.INT4_PAIR_ASM.value, gate_up.INT4_MAGIC.value, getattr(torch, dtype)
    g = torch.Generator().manual_seed(79)
    scales = [_bits(float(s), torch_dtype) for s in torch.randn(16, generator=g) * 0.02]
    for byte in range(256):
        scale = scales[byte % 16]
        zero = byte % 16 if zero_point else 8
        out = run_ptx(asm, {"$2": byte, "$3": scale, "$4": _bits(-(magic + zero), torch_dtype)}, torch_dtype)
        for name, nibble in (("$0", byte & 0xF), ("$1", byte >> 4)):
            expected = _value(_bits((nibble - zero) * _value(scale, torch_dtype), torch_dtype), torch_dtype)
            assert _value(out[name], torch_dtype) == expected, (byte, name)
