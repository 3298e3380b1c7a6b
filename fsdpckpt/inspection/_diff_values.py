"""The running comparison of one tensor's values, tile after tile, for ``diff``.

Each tile of each side comes as its row-major bytes. Where numpy is installed and both
dtypes are ones it widens exactly to float64 (every integer and bool, float16/32/64,
bfloat16 as the top half of a float32), the values are compared with numpy: ``import
torch`` took 6-26 s on a busy machine for a diff of two 4-tensor checkpoints that differ,
where reading and comparing them takes milliseconds. Other dtypes (float8, float4, complex:
numpy's complex ``abs`` can differ from torch's in the last bit), or a machine without
numpy, are compared with torch. Both follow one rule, written once in
:func:`_compare` over either module: ``diff``'s rule of what is equal
(:mod:`fsdpckpt.inspection.diff`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fsdpckpt import _torch
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.errors import FsdpCkptError
from fsdpckpt.inspection._diff_sources import same_bytes
from fsdpckpt.merging import _casts

__all__ = ["Accumulator"]

#: numpy's name for each dtype it holds as it is (bfloat16 is widened from its bits).
_NUMPY = {"float64": "f8", "float32": "f4", "float16": "f2", "int64": "i8", "int32": "i4",
          "int16": "i2", "int8": "i1", "uint64": "u8", "uint32": "u4", "uint16": "u2",
          "uint8": "u1", "bool": "?"}
_COMPLEX = ("complex32", "complex64", "complex128")

#: A tile: its row-major bytes, or a function that gives them (called only where needed).
Tile = memoryview | Callable[[], memoryview]


def _numpy_for(*dtypes: str) -> Any:
    """numpy, where it is installed and widens every one of ``dtypes``; else None."""
    if not all(d in _NUMPY or d == "bfloat16" for d in dtypes):
        return None
    return _casts._numpy()


def _numpy_wide(np: Any, data: memoryview, dtype: str, count: int, wide: str) -> Any:
    """The ``count`` elements of ``data`` as a numpy array of ``wide`` (float64), exactly as
    torch's ``.to`` gives them."""
    if dtype == "bfloat16":  # a float32's top half: exact, NaN stays NaN
        top = np.frombuffer(data, dtype=np.uint16, count=count).astype(np.uint32)
        return (top << np.uint32(16)).view(np.float32).astype(wide)
    return np.frombuffer(data, dtype=_NUMPY[dtype], count=count).astype(wide)


def _torch_values(data: memoryview, dtype: str, count: int) -> Any:
    torch = _casts.import_torch()
    return torch.frombuffer(data, dtype=_torch.dtype(dtype), count=count)


def _sum_of_squares(xp: Any, x: Any) -> float:
    """``sum |x|**2`` of a 1-D float64 (or complex128) array, in float64: one BLAS dot for
    real values, no copy."""
    if x.dtype == xp.complex128:
        return float((abs(x) ** 2).sum())
    return float(xp.dot(x, x))


class Accumulator:
    """The running comparison of one tensor, tile after tile."""

    def __init__(self, norms: bool = False) -> None:
        self.identical = True
        self.comparable = True
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.mismatched = 0
        #: With ``norms``, the sums of ``|a|**2`` and ``|a - b|**2`` (float64), tile by tile;
        #: ``normless`` once a tile's values could not be had (a dtype torch cannot build).
        self.norms, self.sq_a, self.sq_diff, self.normless = norms, 0.0, 0.0, False

    @property
    def rel_change(self) -> float | None:
        """``||a - b|| / ||a||`` over the whole tensor (0 when equal; ``inf`` when only
        ``a`` is all zeros); None without ``norms`` or when not comparable by value."""
        if not self.norms or not self.comparable or self.normless:
            return None
        if math.isnan(self.sq_a) or math.isnan(self.sq_diff):  # a NaN in A, or one side's
            return math.nan
        if self.sq_diff == 0:
            return 0.0
        return math.sqrt(self.sq_diff / self.sq_a) if self.sq_a > 0 else math.inf

    def same(self, a: Tile, dtype: str, count: int) -> None:
        """A tile whose bytes are the same on both sides: only ``||a||`` grows (its bytes
        are not even needed without ``norms``)."""
        if not self.norms or self.normless:
            return
        data = a() if callable(a) else a
        wide = "complex128" if dtype in _COMPLEX else "float64"
        np = _numpy_for(dtype)
        if np is not None:
            self.sq_a += _sum_of_squares(np, _numpy_wide(np, data, dtype, count, wide))
            return
        try:
            torch = _casts.import_torch()
            x = _torch_values(data, dtype, count).to(getattr(torch, wide))
            self.sq_a += _sum_of_squares(torch, x)
        except (RuntimeError, TypeError, FsdpCkptError):  # float4, or a dtype this torch
            self.normless = True                          # lacks: equal as bytes, no norm

    def add(self, a: memoryview, dtype_a: str, b: memoryview, dtype_b: str, count: int,
            atol: float, rtol: float) -> None:
        """Compare one tile: the row-major bytes of ``count`` elements on each side."""
        a, b = a[:count * _itemsize(dtype_a)], b[:count * _itemsize(dtype_b)]
        if dtype_a == dtype_b and same_bytes(a, b):
            self.same(a, dtype_a, count)
            return
        self.identical = False
        wide = "complex128" if dtype_a in _COMPLEX or dtype_b in _COMPLEX else "float64"
        np = _numpy_for(dtype_a, dtype_b)
        if np is not None:
            with np.errstate(all="ignore"):  # inf - inf, x / 0: handled by the rule itself
                self._compare(np, _numpy_wide(np, a, dtype_a, count, wide),
                              _numpy_wide(np, b, dtype_b, count, wide), atol, rtol)
            return
        torch = _casts.import_torch()
        ta, tb = _torch_values(a, dtype_a, count), _torch_values(b, dtype_b, count)
        try:
            x, y = ta.to(getattr(torch, wide)), tb.to(getattr(torch, wide))
        except (RuntimeError, TypeError):  # float4 and others torch cannot convert
            self.comparable = False
            self.mismatched += int((ta.view(torch.uint8) != tb.view(torch.uint8)).sum()) \
                if dtype_a == dtype_b else count
            return
        self._compare(torch, x, y, atol, rtol)

    def _compare(self, xp: Any, x: Any, y: Any, atol: float, rtol: float) -> None:
        """The rule, over numpy or torch (``xp``): ``x`` and ``y`` are 1-D float64 (or
        complex128) arrays of equal length."""
        same = (x == y) | (xp.isnan(x) & xp.isnan(y))
        one_nan = xp.isnan(x) ^ xp.isnan(y)
        infinite = xp.isinf(x) | xp.isinf(y)
        size = xp.where(same, 0.0, xp.where(one_nan, math.inf, abs(x - y)))
        scale = abs(y)
        close = same | ((size <= atol + rtol * scale) & ~infinite)
        # nan_to_num's default turns inf into the largest float64, in numpy as in torch.
        rel = xp.nan_to_num(xp.where(size == 0, 0.0, size / scale), nan=math.inf)
        self.mismatched += int((~close).sum())
        if self.norms:
            self.sq_a += _sum_of_squares(xp, x)
            self.sq_diff += _sum_of_squares(xp, size)
        if len(size):
            self.max_abs = max(self.max_abs, float(size.max()))
            self.max_rel = max(self.max_rel, float(rel.max()))


def _itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize
