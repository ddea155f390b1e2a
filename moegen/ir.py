"""ModelIR: a validated spec lowered to what the later stages need (frozen, hashable)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from moegen.quant.formats import WeightFormat
from moegen.runtime.routing import RoutingParams
from moegen.spec.schema import DTYPE_BYTES, Spec
from moegen.target import GpuTarget, resolve_target


def canonical_hash(value) -> str:
    """sha256 over canonical JSON (sorted keys, no whitespace variance)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class KernelSignature:
    """Everything baked into the kernels' source: a change here means a different kernel."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    activation: str
    dtype: str
    # The experts' weight format (moegen/quant/formats.py): unquantized signatures keep the fields
    # at their defaults, so their keys (and tuning files) are those of before quantized formats.
    quantization: str = "none"
    group_size: int = 0
    zero_point: bool = False

    @property
    def weight_format(self) -> WeightFormat:
        return WeightFormat(self.quantization, self.group_size, self.zero_point, self.dtype)

    @property
    def key(self) -> str:
        fmt = self.weight_format.key
        return (f"h{self.hidden_size}_i{self.intermediate_size}_e{self.num_experts}_k{self.top_k}"
                f"_{self.activation}_{self.dtype}" + (f"_{fmt}" if fmt else ""))

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation element (the model dtype)."""
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ModelIR:
    spec: Spec
    spec_file: str  # the spec's file name, as generated files cite it
    spec_hash: str
    target: GpuTarget
    signature: KernelSignature
    routing: RoutingParams


def lower(spec: Spec, spec_path: str | Path) -> ModelIR:
    m = spec.model
    return ModelIR(
        spec=spec,
        spec_file=Path(spec_path).name,
        spec_hash=canonical_hash(asdict(spec)),
        target=resolve_target(spec.target),
        signature=KernelSignature(m.hidden_size, m.intermediate_size, m.num_experts, m.top_k,
                                  m.activation, m.dtype, m.weight_format.quantization,
                                  m.weight_format.group_size, m.weight_format.zero_point),
        routing=RoutingParams.from_model(m),
    )
