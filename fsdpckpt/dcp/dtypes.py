"""Tensor element types, described without importing torch.

Importing torch costs seconds; the read-only tools only need each dtype's name,
size and the names other formats give it, so this table stands in for
``torch.dtype`` wherever fsdpckpt reads a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DType", "DTYPES", "dtype_from_name"]


@dataclass(frozen=True)
class DType:
    """One tensor element type.

    Attributes:
        name: torch's name without the ``torch.`` prefix, e.g. ``"float32"``.
        itemsize: bytes per element.
        safetensors: the safetensors dtype code (``"F32"``), or None where the oldest
            safetensors fsdpckpt supports (0.8, see ``pyproject.toml``) cannot load it
            into torch (``safetensors.torch._TYPES``): a merge then asks for ``--format bin``.
        is_floating: whether a ``--dtype`` conversion applies to it.
        storage_class: the legacy ``torch.<X>Storage`` name ``torch.save`` pickles, if any.
    """

    name: str
    itemsize: int
    safetensors: str | None
    is_floating: bool
    storage_class: str | None = None

    def __str__(self) -> str:
        return self.name


# safetensors codes, checked against safetensors.torch._TYPES: U16/U32/U64 load since
# safetensors 0.6.1, C64 since 0.7.0, the float8 FNUZ codes since 0.8.0 (hence the floor).
# F8_E8M0 is a header code but no version's torch loader maps it, so float8_e8m0fnu has
# none; complex32 and complex128 have no code at all.
_TABLE = [
    DType("float64", 8, "F64", True, "DoubleStorage"),
    DType("float32", 4, "F32", True, "FloatStorage"),
    DType("float16", 2, "F16", True, "HalfStorage"),
    DType("bfloat16", 2, "BF16", True, "BFloat16Storage"),
    DType("float8_e4m3fn", 1, "F8_E4M3", True),
    DType("float8_e5m2", 1, "F8_E5M2", True),
    DType("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", True),
    DType("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", True),
    DType("float8_e8m0fnu", 1, None, True),
    # Two float4 values packed per byte; torch has no conversion to or from it, so a
    # --dtype export leaves it as it is.
    DType("float4_e2m1fn_x2", 1, None, False),
    DType("int64", 8, "I64", False, "LongStorage"),
    DType("int32", 4, "I32", False, "IntStorage"),
    DType("int16", 2, "I16", False, "ShortStorage"),
    DType("int8", 1, "I8", False, "CharStorage"),
    DType("uint64", 8, "U64", False),
    DType("uint32", 4, "U32", False),
    DType("uint16", 2, "U16", False),
    DType("uint8", 1, "U8", False, "ByteStorage"),
    DType("bool", 1, "BOOL", False, "BoolStorage"),
    DType("complex32", 4, None, False),  # torch.chalf: saved as an untyped storage
    DType("complex64", 8, "C64", False, "ComplexFloatStorage"),
    DType("complex128", 16, None, False, "ComplexDoubleStorage"),
]

#: Every dtype fsdpckpt knows, by torch name.
DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}

# torch also accepts these spellings (``torch.float`` is ``torch.float32``).
_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "chalf": "complex32",
    "cfloat": "complex64",
    "cdouble": "complex128",
}


def dtype_from_name(name: str) -> DType | None:
    """Return the dtype called ``name`` (``"float32"`` or ``"torch.float32"``), or None."""
    name = name.removeprefix("torch.")
    return DTYPES.get(_ALIASES.get(name, name))

