"""The transposing copy itself: a tile of stored columns into row-major rows, and any other
stored layout into row-major order, without importing torch where numpy is installed.

numpy copies blocks of 256 x 256 elements (or 256 x 512 where a core's first-level cache
holds them) that stay in a core's caches, at 3-6 GB/s for 4-byte elements; torch's
transposing copy ran at 1.5 GB/s on one core (``benchmarks/floor.py``) and costs ``import
torch``. The elements are copied as unsigned integers of their width (bytes, never values),
so every dtype comes out bit for bit, NaN payloads included. Without numpy (an optional
speed-up) torch does it.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

from fsdpckpt import _torch
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.merging import _casts

__all__ = ["column_pitch", "reorder", "transpose_tile"]

#: Elements per side of the block numpy copies at once: a block of 256 x 256 float32 read
#: and written (512 KiB) stays in the cache; 128 ran at half the speed, whole tiles at a tenth.
_BLOCK = 256
#: A core's first-level data cache from which blocks are twice as wide (256 x 512): each
#: output row of a block reads one element from each of its stored columns' cache lines, and
#: 512 lines (32 KiB) must stay in that cache for the next rows (48 KiB here: 4.1 to 4.9
#: GB/s, and a 2.4 GB column-major merge 2.11 s to 2.01 s; with 32 KiB they would not).
_WIDE_BLOCK_L1 = 48 * 2**10
#: numpy types that copy an element's bytes as they are, by width.
_UNSIGNED = {1: "u1", 2: "u2", 4: "u4", 8: "u8", 16: "V16"}


@functools.cache
def _l1_data_bytes(root: str = "/sys/devices/system/cpu") -> int:
    """The smallest first-level data cache of the machine's cores (a hybrid CPU's efficiency
    cores have less, and the transpose thread may run on one), from Linux's sysfs; 0 where
    any core's is not known."""
    try:
        cpus = [name for name in os.listdir(root) if name[:3] == "cpu" and name[3:].isdigit()]
    except OSError:
        return 0
    sizes = [_l1_of(f"{root}/{cpu}/cache") for cpu in cpus]
    return min(sizes) if sizes and all(sizes) else 0


def _l1_of(folder: str) -> int:
    """One core's first-level data cache, from its sysfs cache folder; 0 where not known."""
    try:
        for index in sorted(os.listdir(folder)):
            with open(f"{folder}/{index}/level") as level, open(f"{folder}/{index}/type") as kind:
                if level.read().strip() != "1" or kind.read().strip() != "Data":
                    continue
            with open(f"{folder}/{index}/size") as size:
                text = size.read().strip().upper()
            units = {"K": 2**10, "M": 2**20}
            return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except (OSError, ValueError):
        pass
    return 0


def column_pitch(side: int, itemsize: int) -> int:
    """Elements between the starts of two stored columns in a tile's buffer: ``side``, or
    one cache line more where that is a multiple of 4 KiB (columns that far apart fall in
    the same cache sets and evict each other: 2048-element float32 columns transposed at
    2.7 GB/s, 6.3 GB/s one cache line apart)."""
    return side + (64 // itemsize or 1) if side * itemsize % 4096 == 0 else side


def transpose_tile(stored: memoryview, pitch: int, width: int, height: int, dtype: DType,
                   target: memoryview, *, skip: int = 0, row_pitch: int | None = None) -> None:
    """Fill ``target`` with the row-major ``height x width`` matrix whose column ``k`` is the
    run of ``height`` elements at element ``k * pitch + skip`` of ``stored``.

    Args:
        stored: the tile's stored columns, ``pitch`` elements apart (at least ``width * pitch``).
        pitch: elements from one column's start to the next's (at least ``skip + height``).
        width, height: the tile's output columns and rows, at least 1 each.
        dtype: the elements' dtype (only its width matters to numpy).
        target: filled row by row: at least ``(height - 1) * row_pitch + width`` elements.
        skip: elements of each stored column before the tile's first row.
        row_pitch: elements from one output row's start to the next's: ``width`` (the
            default) where the rows follow each other, more where the tile is a group of
            columns of a wider matrix.
    """
    row_pitch = width if row_pitch is None else row_pitch
    np = _casts._numpy()
    if np is None or dtype.itemsize not in _UNSIGNED:
        _transpose_torch(stored, pitch, width, height, dtype, target, skip, row_pitch)
        return
    element = np.dtype(_UNSIGNED[dtype.itemsize])
    columns = np.frombuffer(stored, dtype=element, count=width * pitch).reshape(
        width, pitch)[:, skip:skip + height]
    rows = np.lib.stride_tricks.as_strided(
        np.frombuffer(target, dtype=element, count=(height - 1) * row_pitch + width),
        (height, width), (row_pitch * element.itemsize, element.itemsize))
    across = _BLOCK * 2 if _l1_data_bytes() >= _WIDE_BLOCK_L1 else _BLOCK  # columns a block
    for top in range(0, height, _BLOCK):
        band, source = rows[top:top + _BLOCK], columns[:, top:top + _BLOCK]
        for left in range(0, width, across):
            np.copyto(band[:, left:left + across], source[left:left + across].T)


def reorder(stored: memoryview, count: int, sizes: Sequence[int], stride: Sequence[int],
            offset: int, dtype: DType, target: memoryview) -> None:
    """Fill ``target`` with the elements, in row-major order, of the view of ``sizes`` and
    ``stride`` (elements) from element ``offset`` of the ``count`` elements of ``stored``:
    any stored layout (a permuted or expanded tensor ``torch.save`` kept with its strides).
    numpy copies the bytes as unsigned integers of the element's width; torch where numpy
    is missing."""
    np = _casts._numpy()
    numel = math.prod(sizes)
    if np is None or dtype.itemsize not in _UNSIGNED:
        torch = _casts.import_torch()

        kind = _torch.dtype(dtype.name)
        torch.frombuffer(target, dtype=kind, count=numel).view(tuple(sizes)).copy_(
            torch.frombuffer(stored, dtype=kind, count=count).as_strided(
                tuple(sizes), tuple(stride), offset))
        return
    element = np.dtype(_UNSIGNED[dtype.itemsize])
    view = np.lib.stride_tricks.as_strided(
        np.frombuffer(stored, dtype=element, count=count)[offset:], tuple(sizes),
        tuple(step * element.itemsize for step in stride), writeable=False)
    np.copyto(np.frombuffer(target, dtype=element, count=numel).reshape(tuple(sizes)), view)


def _transpose_torch(stored: memoryview, pitch: int, width: int, height: int, dtype: DType,
                     target: memoryview, skip: int, row_pitch: int) -> None:
    torch = _casts.import_torch()

    kind = _torch.dtype(dtype.name)
    columns = torch.frombuffer(stored, dtype=kind, count=(width - 1) * pitch + skip + height)
    rows = torch.frombuffer(target, dtype=kind, count=(height - 1) * row_pitch + width)
    rows.as_strided((height, width), (row_pitch, 1)).copy_(
        columns.as_strided((height, width), (1, pitch), skip))
