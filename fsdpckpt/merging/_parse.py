"""What users write for a merge's sizes and dtypes (``--max-shard-size 5GB``, ``--dtype
bf16``), read into bytes and :class:`DType`; re-exported by :mod:`fsdpckpt.merging.plan`."""

from __future__ import annotations

from typing import Any

from fsdpckpt.dcp.dtypes import DType, dtype_from_name
from fsdpckpt.errors import MergePlanError

__all__ = ["parse_size", "parse_dtype"]

#: Decimal with or without the B (``5G`` is ``5GB``, as transformers reads ``5GB``); binary
#: with the i, with or without the B (``5GiB``, ``5Gi``).
_UNITS = {"": 1, "B": 1,
          **{f"{p}{b}": 10**(3 * i) for i, p in enumerate("KMGT", 1) for b in ("", "B")},
          **{f"{p}I{b}": 2**(10 * i) for i, p in enumerate("KMGT", 1) for b in ("", "B")}}
_SIZE_HINT = "write it like 5GB, 5G, 500MB, 2GiB or a number of bytes"

_DTYPE_WORDS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as transformers reads them; ``5G`` the same;
    ``GiB`` and ``Gi`` binary; a plain number is bytes).

    Args:
        text: the size as a user writes it (``"5GB"``, ``"5G"``, ``"500MiB"``, ``"1000"``),
            or a number of bytes.

    Returns:
        The size in bytes.

    Raises:
        MergePlanError: the size is unreadable, or not positive.

    Example:
        >>> parse_size("5G"), parse_size("2GiB")
        (5000000000, 2147483648)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise MergePlanError(f"the size {text!r} must be positive")
        return text
    if not isinstance(text, str):
        raise MergePlanError(f"cannot read the size {text!r}; {_SIZE_HINT}")
    value = text.strip().upper().replace(" ", "")
    number = value.rstrip("KMGTIB")
    unit = value[len(number):]
    try:
        size = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError, OverflowError):  # OverflowError: "inf", "1e400"
        raise MergePlanError(f"cannot read the size {text!r}; {_SIZE_HINT}") from None
    if size <= 0:
        raise MergePlanError(f"the size {text!r} must be positive")
    return size


def parse_dtype(value: DType | str | Any | None) -> DType | None:
    """The export dtype meant by ``value``; None stays None.

    Args:
        value: a :class:`DType`, a word (``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``)
            or a ``torch.dtype``.

    Raises:
        MergePlanError: ``value`` names no floating-point dtype.
    """
    if value is None:
        return None
    dtype = value if isinstance(value, DType) else None
    if dtype is None:
        text = str(value).lower()  # str(torch.bfloat16) is "torch.bfloat16"
        dtype = dtype_from_name(_DTYPE_WORDS.get(text, text))
    if dtype is None or not dtype.is_floating:
        raise MergePlanError(f"unknown export dtype {value!r}; choose bf16 (bfloat16), "
                             "fp16 (float16) or fp32 (float32)")
    return dtype
