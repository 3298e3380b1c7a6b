"""A large column-major chunk (a transposed view ``torch.save`` kept with its strides) placed
in square tiles, transposed without importing torch.

Its output rows are its stored columns: tiles of whole stored rows would write each output
row in pieces of a few hundred bytes (a 2.4 GB one took 75 s). So each square tile's stored
columns are read, one piece per column (whole columns in one ``preadv``), into a buffer,
transposed there into output rows, cast if asked, and written one piece per output row
(rows that follow each other in the output in one write). With torch the transpose cost
``import torch`` (about 1.5 s here, longer than merging a 1.6 GB model) and its transposing
copy ran at 1.5 GB/s on one core (``benchmarks/floor.py``). numpy, where it is installed,
copies blocks of 256 x 256 elements that fit a core's cache, at 3-6 GB/s for
4-byte elements. The elements are copied as unsigned integers of their width (bytes, never
values), so every dtype comes out bit for bit, NaN payloads included. Without numpy (an
optional speed-up) torch does it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fsdpckpt._io.rawio import ReadAt, pread_into, pread_scattered, scratch
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.merging import _casts
from fsdpckpt.merging._runs import Runs, row_starts

__all__ = ["column_pitch", "place_column_major", "transpose_tile"]

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


def place_column_major(src: int | ReadAt, raw: RawTensor, runs: Runs, out: DType,
                       write: Callable[[memoryview, int], None], tensor_start: int, tile: int,
                       *, source: str, progress: Callable[[int], None] | None) -> None:
    """Place the column-major matrix chunk ``raw`` in square tiles of at most ``tile`` bytes.

    The reads leave storage order, so the caller checks the storage whole, beside the tiles
    (:func:`fsdpckpt.dcp._checked.verify_entry_beside`).

    Args:
        src: the data file's descriptor, or what reads the chunk's bytes by offset.
        raw: the chunk's storage: 2-D, strides ``(1, rows)``.
        runs: :func:`fsdpckpt.merging._runs.chunk_runs` of the chunk in its output tensor.
        out: the output dtype (a cast is done on the contiguous tile, as ``.to()`` does).
        write: puts bytes at a byte offset of the output.
        tensor_start: byte offset of the output tensor's first element.
        tile: the most bytes of one tile, stored or made.
        source: how to name the chunk in messages.
        progress: called with the number of bytes written, as they are.
    """
    in_size, out_size = raw.dtype.itemsize, out.itemsize
    side = max(1, math.isqrt(max(1, tile // max(in_size, out_size))))
    pitch = column_pitch(side, in_size)
    rows, cols = raw.shape
    stored = scratch(side * pitch * in_size, "stored")
    staged = scratch(side * side * in_size, "staged") if raw.dtype.name != out.name else None
    made = scratch(side * side * out_size, "made")
    for first_row in range(0, rows, side):
        height = min(side, rows - first_row)
        lines = row_starts(runs, cols, first_row, height)  # where each output row goes
        for first_col in range(0, cols, side):
            width = min(side, cols - first_col)
            pieces = [stored[k * pitch * in_size:(k * pitch + height) * in_size]
                      for k in range(width)]  # stored column first_col + k: output rows of it
            at = raw.storage_start + (raw.storage_offset + first_col * rows + first_row) * in_size
            if height == rows and isinstance(src, int):  # whole columns, one after another
                pread_scattered(src, pieces, at, source=source)
            else:
                for k, piece in enumerate(pieces):
                    pread_into(src, piece, at + k * rows * in_size, source=source)
            # Reordered first, then cast contiguous to contiguous as .to() does.
            transpose_tile(stored, pitch, width, height, raw.dtype,
                           made if staged is None else staged)
            if staged is not None:
                _casts.cast_block(raw.dtype.name, out.name, staged[:width * height * in_size],
                                  made[:width * height * out_size])
            row, begin = width * out_size, 0  # rows that follow each other go out in one write
            for end in range(1, height + 1):
                if end == height or lines[end] != lines[end - 1] + width:
                    write(made[begin * row:end * row],
                          tensor_start + (lines[begin] + first_col) * out_size)
                    begin = end
            if progress:
                progress(width * height * out_size)
