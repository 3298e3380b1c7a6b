"""A column-major tile made row-major without importing torch.

A column-major chunk (a transposed view ``torch.save`` kept with its strides) is placed in
square tiles (:func:`fsdpckpt.merging._copy.place_chunk`): its stored columns are read, one
piece per column, into a buffer, and the tile is transposed there into output rows. With
torch that cost ``import torch`` (about 1.5 s here, longer than merging a 1.6 GB model) and
its transposing copy ran at 1.5 GB/s on one core (``benchmarks/floor.py``). numpy, where it
is installed, copies blocks of 256 x 256 elements that fit a core's cache, at 3-6 GB/s for
4-byte elements. The elements are copied as unsigned integers of their width (bytes, never
values), so every dtype comes out bit for bit, NaN payloads included. Without numpy (an
optional speed-up) torch does it.
"""

from __future__ import annotations

from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.merging import _casts

__all__ = ["column_pitch", "transpose_tile"]

#: Elements per side of the block numpy copies at once: a block of 256 x 256 float32 read
#: and written (512 KiB) stays in the cache; 128 ran at half the speed, whole tiles at a tenth.
_BLOCK = 256
#: numpy types that copy an element's bytes as they are, by width.
_UNSIGNED = {1: "u1", 2: "u2", 4: "u4", 8: "u8", 16: "V16"}


def column_pitch(side: int, itemsize: int) -> int:
    """Elements between the starts of two stored columns in a tile's buffer: ``side``, or
    one cache line more where that is a multiple of 4 KiB (columns that far apart fall in
    the same cache sets and evict each other: 2048-element float32 columns transposed at
    2.7 GB/s, 6.3 GB/s one cache line apart)."""
    return side + (64 // itemsize or 1) if side * itemsize % 4096 == 0 else side


def transpose_tile(stored: memoryview, pitch: int, width: int, height: int, dtype: DType,
                   target: memoryview) -> None:
    """Fill ``target`` with the row-major ``height x width`` matrix whose column ``k`` is the
    run of ``height`` elements at element ``k * pitch`` of ``stored``.

    Args:
        stored: the tile's stored columns, ``pitch`` elements apart (at least ``width * pitch``).
        pitch: elements from one column's start to the next's (at least ``height``).
        width, height: the tile's output columns and rows, at least 1 each.
        dtype: the elements' dtype (only its width matters to numpy).
        target: at least ``width * height`` elements, filled row by row.
    """
    np = _casts._numpy()
    if np is None or dtype.itemsize not in _UNSIGNED:
        _transpose_torch(stored, pitch, width, height, dtype, target)
        return
    element = np.dtype(_UNSIGNED[dtype.itemsize])
    columns = np.frombuffer(stored, dtype=element, count=width * pitch).reshape(
        width, pitch)[:, :height]
    rows = np.frombuffer(target, dtype=element, count=width * height).reshape(height, width)
    for top in range(0, height, _BLOCK):
        band, source = rows[top:top + _BLOCK], columns[:, top:top + _BLOCK]
        for left in range(0, width, _BLOCK):
            np.copyto(band[:, left:left + _BLOCK], source[left:left + _BLOCK].T)


def _transpose_torch(stored: memoryview, pitch: int, width: int, height: int, dtype: DType,
                     target: memoryview) -> None:
    import torch

    kind = getattr(torch, dtype.name)
    columns = torch.frombuffer(stored, dtype=kind, count=(width - 1) * pitch + height)
    rows = torch.frombuffer(target, dtype=kind, count=width * height).view(height, width)
    rows.copy_(columns.as_strided((height, width), (1, pitch)))
