"""The element types remapdsl knows (the 22 codes of safetensors 0.8): rule-file (torch) names, safetensors
codes and bit widths, one table for the language, the header parser and the executors. Sub-byte codes count
elements: a tensor is prod(shape) * bits / 8 bytes, a whole number (safetensors rejects `F4 [3]`); torch's
`float4_e2m1fn_x2` packs two per element, so its last dim is half the header's. `F6_E2M3` / `F6_E3M2` have
no torch dtype (OCP / ml_dtypes names)."""

from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    name: str  # the name in rule files and in torch (`torch.<name>`)
    safetensors: str  # the code in a safetensors header
    bits: int  # bits per element as the header counts them (4 for F4, 6 for F6)
    kind: str  # "float", "int", "uint", "bool", "complex"
    in_torch: bool = True  # whether torch has it, so a rule may cast to it


DTYPES: tuple[DType, ...] = (
    DType("float64", "F64", 64, "float"),
    DType("float32", "F32", 32, "float"),
    DType("float16", "F16", 16, "float"),
    DType("bfloat16", "BF16", 16, "float"),
    DType("float8_e4m3fn", "F8_E4M3", 8, "float"),
    DType("float8_e5m2", "F8_E5M2", 8, "float"),
    DType("float8_e8m0fnu", "F8_E8M0", 8, "float"),
    DType("float8_e4m3fnuz", "F8_E4M3FNUZ", 8, "float"),
    DType("float8_e5m2fnuz", "F8_E5M2FNUZ", 8, "float"),
    DType("float6_e2m3fn", "F6_E2M3", 6, "float", in_torch=False),
    DType("float6_e3m2fn", "F6_E3M2", 6, "float", in_torch=False),
    DType("float4_e2m1fn_x2", "F4", 4, "float"),
    DType("int64", "I64", 64, "int"),
    DType("int32", "I32", 32, "int"),
    DType("int16", "I16", 16, "int"),
    DType("int8", "I8", 8, "int"),
    DType("uint64", "U64", 64, "uint"),
    DType("uint32", "U32", 32, "uint"),
    DType("uint16", "U16", 16, "uint"),
    DType("uint8", "U8", 8, "uint"),
    DType("bool", "BOOL", 8, "bool"),
    DType("complex64", "C64", 64, "complex"),
)

BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in DTYPES}
RULE_DTYPE_NAMES: tuple[str, ...] = tuple(d.name for d in DTYPES if d.in_torch)  # `cast(...)`, `to=`
