"""A column-major chunk (a transposed view ``torch.save`` kept with its strides) placed
without importing torch, its transposes on the transpose thread while this one reads and
writes (:mod:`fsdpckpt._io.background`).

Its output rows are its stored columns: tiles of whole stored rows would write each output
row in pieces of a few hundred bytes (a 2.4 GB one took 75 s). Two ways, by size:

- held whole (:func:`place_column_major_whole`, up to :data:`WHOLE` bytes stored and made,
  the usual FSDP or tensor-parallel chunk of a transposed weight): read in storage order,
  so its CRC-32 is computed as it is read, then transposed in bands of whole output rows,
  each band one write while the next is made (cast, it goes in groups of stored columns
  instead: :mod:`fsdpckpt.merging._transpose_cast`);
- larger (:func:`place_column_major`): tiles, each tile's stored columns read one piece
  per column and written one piece per output row, those calls batched
  (:mod:`fsdpckpt._io.batched`) and the reads and transposes on the transpose thread while
  this one writes; the caller checks the storage whole beside them. Where that thread reads
  (a local file, Linux AIO) and nothing is cast, it reads 8 MiB groups of columns, each
  transposed as soon as it is read, and, without torch in the process, the tiles are six
  times as wide as they are tall; otherwise they are square.

The transposing copy itself, bit for bit without torch where numpy is installed:
:mod:`fsdpckpt.merging._blocks`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fsdpckpt._io import background, batched
from fsdpckpt._io.rawio import ReadAt, pread_into, pread_scattered, scratch
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp._checked import CheckedRead, read_checked
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.merging import _casts
from fsdpckpt.merging._blocks import _UNSIGNED, column_pitch, transpose_tile
from fsdpckpt.merging._runs import Runs, row_starts

__all__ = ["WHOLE", "fits_whole", "is_column_major", "place_column_major",
           "place_column_major_whole"]

#: The most bytes of a column-major chunk held whole, stored and made together: such a chunk
#: is read in storage order, its CRC-32 computed on the way (no second pass over it), and
#: written in bands of whole output rows, not in pieces of rows (1.6 GB of 32 MiB chunks:
#: measured in docs/benchmarks.md).
WHOLE = 64 * 2**20
_WHOLE_WITH_TORCH = 48 * 2**20
#: Output bytes made per band, and the most rows in one (a narrow chunk's bands stay short
#: lists of row starts): each band is written while the next one is transposed. Taller
#: bands transpose faster (1.6 GB of 32 MiB chunks: 1.96 s with 1 MiB bands, 1.71 s with 2,
#: 1.64 s with 4, 1.69 s with 8).
_BAND = 4 * 2**20
_BAND_ROWS = 4096
#: Columns of a large column-major chunk's tile per row of it, where torch is not in the
#: process and its stored columns are read in groups (:data:`_GROUP`): the output rows'
#: pieces, one write each, are six times as long as square tiles' (a 2.4 GB float32 tensor:
#: 2048 x 12288 tiles, 48 KiB pieces). Its two made tiles then hold 192 MiB, the whole
#: process about 245 MB. With torch (220 MB) the tiles stay square, within 300 MB.
#: Measured on that tensor, groups of 8 MiB, 2 MiB pages (alternated runs, medians of 5,
#: its plain merge 1.46 s): 2048 x 4096 tiles 2.30 s, 2048 x 8192 2.07 s, 2048 x 12288
#: 1.94 s, 1024 x 24576 (whole output rows, 4 KiB reads) 2.00 s.
_WIDE = 6
#: Bytes of stored columns read at once, where the transpose thread reads: each group is
#: transposed as soon as it is read, while its bytes are still in the CPU's caches, and only
#: a group is held stored, not a tile (a 2.4 GB float32 tensor in 2048 x 8192 tiles: whole
#: tiles read then transposed 2.35 s, groups of 2 MiB 2.44 s, 4 MiB 2.33 s, 8 MiB 2.25 s,
#: 16 MiB 2.21 s; with 4 KiB pages).
_GROUP = 8 * 2**20


def is_column_major(raw: RawTensor) -> bool:
    """Whether ``raw`` is a column-major matrix (a transposed view ``torch.save`` kept with
    its strides): its output rows are its stored columns."""
    return len(raw.shape) == 2 and raw.shape[0] > 1 and raw.shape[1] > 1 and \
        tuple(raw.stride) == (1, raw.shape[0])


def torch_may_come(raw: RawTensor, out: DType) -> bool:
    """Whether placing ``raw`` as ``out`` may import torch (about 220 MB): a cast (torch casts
    what numpy does not, and any piece holding NaN), or a transpose numpy cannot do."""
    return "torch" not in sys.modules and (
        raw.dtype.name != out.name or _casts._numpy() is None
        or raw.dtype.itemsize not in _UNSIGNED)


def _wide_tiles(raw: RawTensor, out: DType) -> bool:
    """Whether a large column-major chunk's tiles may be :data:`_WIDE` times as wide as they
    are tall: torch is not in the process, and placing the chunk will not bring it."""
    return "torch" not in sys.modules and not torch_may_come(raw, out)


def fits_whole(raw: RawTensor, out: DType) -> bool:
    """Whether the column-major chunk ``raw`` is small enough to be held whole, stored and
    made (:func:`place_column_major_whole`): :data:`WHOLE` bytes, or what three 16 MiB
    tiles held before where a cast is asked or torch may be imported meanwhile (the
    process then stays within 300 MB with torch in it)."""
    limit = WHOLE if raw.dtype.name == out.name and not torch_may_come(raw, out) else \
        _WHOLE_WITH_TORCH
    return math.prod(raw.shape) * (raw.dtype.itemsize + out.itemsize) <= limit


def place_column_major_whole(src: int | ReadAt, raw: RawTensor, runs: Runs, out: DType,
                             write_pieces: Callable[[memoryview, Any, Any, Any], None],
                             tensor_start: int, *, source: str,
                             progress: Callable[[int], None] | None) -> None:
    """Place a column-major matrix chunk that :func:`fits_whole`: read whole, in storage order
    (through a :class:`~fsdpckpt.dcp._checked.CheckedRead`, its CRC-32 computed on the CRC
    thread on the way: no second pass), transposed in bands of whole output rows on the
    transpose thread, each band written (one write where the chunk's rows follow each other
    in the output) while the next is transposed.

    Args:
        src: the data file's descriptor, a checked read of the chunk's storage, or what reads
            its bytes by offset.
        raw, runs, out, write_pieces, tensor_start, source, progress: as for
            :func:`place_column_major`.
    """
    in_size, out_size = raw.dtype.itemsize, out.itemsize
    rows, cols = raw.shape
    local = isinstance(src, int) or isinstance(src, CheckedRead) and src.local
    pitch = column_pitch(rows, in_size) if local else rows
    stored = scratch(cols * pitch * in_size, "stored")
    at = raw.storage_start + raw.storage_offset * in_size
    if pitch == rows:
        read_checked(src, stored, at, source=source)
    else:  # a padded pitch only where a column is 4 KiB or more: a few thousand views at most
        pieces = [stored[k * pitch * in_size:(k * pitch + rows) * in_size] for k in range(cols)]
        if isinstance(src, CheckedRead):
            src.read_scattered(pieces, at, later=True)
        else:
            pread_scattered(src, pieces, at, source=source)  # type: ignore[arg-type]
    made = scratch(rows * cols * out_size, "made")
    height = max(1, min(_BAND_ROWS, _BAND // (cols * max(in_size, out_size))))
    staged = scratch(height * cols * in_size, "staged") if raw.dtype.name != out.name else None
    row = cols * out_size
    bands = [(first, min(height, rows - first)) for first in range(0, rows, height)]
    jobs: list[Future[None]] = []
    try:
        for first, tall in bands:
            jobs.append(background.submit("transpose", _make, stored, pitch, cols, tall,
                                          raw.dtype, out, made[first * row:(first + tall) * row],
                                          staged, first))
        for (first, tall), job in zip(bands, jobs):
            job.result()
            write_pieces(made[first * row:(first + tall) * row],
                         *_row_pieces(row_starts(runs, cols, first, tall), cols, 0, out_size,
                                      tensor_start))
            if progress:
                progress(tall * row)
    finally:
        if jobs:  # no transpose may still fill a buffer that is handed out again
            background.drain("transpose")


def _make(stored: memoryview, pitch: int, width: int, height: int, dtype: DType, out: DType,
          target: memoryview, staged: memoryview | None, skip: int = 0) -> None:
    """On the transpose thread: transpose (:func:`transpose_tile`), then cast if asked."""
    if staged is None:
        transpose_tile(stored, pitch, width, height, dtype, target, skip=skip)
        return
    # Reordered first, then cast contiguous to contiguous as .to() does.
    part = staged[:width * height * dtype.itemsize]
    transpose_tile(stored, pitch, width, height, dtype, part, skip=skip)
    _casts.cast_block(dtype.name, out.name, part, target)  # work buffers: this thread's own


def _row_pieces(lines: list[int], width: int, first_col: int, out_size: int,
                tensor_start: int) -> tuple[Any, Any, Any]:
    """Where the rows of a made block (``width`` elements each, from column ``first_col`` of
    the output rows starting at element ``lines``) go, as
    :func:`fsdpckpt._io.batched.write_pieces` takes them: ``(starts in the block, lengths,
    output offsets)``, rows that follow each other in the output as one piece."""
    row = width * out_size
    np = _casts._numpy()
    if np is not None:
        at = np.asarray(lines, dtype=np.int64)
        begins = np.concatenate(([0], np.flatnonzero(np.diff(at) != width) + 1))
        ends = np.append(begins[1:], len(at))
        return begins * row, (ends - begins) * row, tensor_start + (at[begins] + first_col) * \
            out_size
    runs, begin = [], 0
    for end in range(1, len(lines) + 1):
        if end == len(lines) or lines[end] != lines[end - 1] + width:
            runs.append((begin, end))
            begin = end
    return ([first * row for first, _ in runs], [(end - first) * row for first, end in runs],
            [tensor_start + (lines[first] + first_col) * out_size for first, _ in runs])


def place_column_major(src: int | ReadAt, raw: RawTensor, runs: Runs, out: DType,
                       write_pieces: Callable[[memoryview, Any, Any, Any], None],
                       tensor_start: int, tile: int, *, source: str,
                       progress: Callable[[int], None] | None,
                       settled: Callable[[int, int], None] | None = None) -> None:
    """Place the column-major matrix chunk ``raw`` in square tiles of at most ``tile`` bytes,
    :data:`_WIDE` times as wide where the transpose thread reads them uncast and torch is not
    in the process (:func:`_wide_tiles`).

    Each tile is one piece per stored column read and one piece per output row written, so
    the calls are batched (:mod:`fsdpckpt._io.batched`: a few ``io_submit`` a tile, the GIL
    released for each batch). Batched, a tile is read and transposed on the transpose thread
    while this one writes the tile before: two made buffers take turns (a
    2.4 GB tensor in 16 MiB tiles: 3.4 s against 4.5 s read here in 8 KiB calls and 2.6 s
    for its plain merge). Uncast, that thread reads the tile's stored columns in groups of
    :data:`_GROUP` bytes, each transposed into the tile as soon as it is read. Where calls
    are not batched (a remote file, no Linux AIO or numpy) reads stay on this thread:
    from two threads each call's return waits for the GIL the other holds.

    The reads leave storage order, so the caller checks the storage whole, beside the tiles
    (:func:`fsdpckpt.dcp._checked.verify_entry_beside`).

    Args:
        src: the data file's descriptor, or what reads the chunk's bytes by offset.
        raw: the chunk's storage: 2-D, strides ``(1, rows)``.
        runs: :func:`fsdpckpt.merging._runs.chunk_runs` of the chunk in its output tensor.
        out: the output dtype (a cast is done on the contiguous tile, as ``.to()`` does).
        write_pieces: puts pieces of a buffer at byte offsets of the output, as
            :func:`fsdpckpt._io.batched.write_pieces` takes them.
        tensor_start: byte offset of the output tensor's first element.
        tile: the most bytes of one square tile, stored or made.
        source: how to name the chunk in messages.
        progress: called with the number of bytes written, as they are.
        settled: called with the byte range of each row of tiles once it is written, where
            the chunk's rows are whole rows of the output (one run): its pieces made it
            whole (:class:`fsdpckpt._io.durable.Writeback`).
    """
    in_size, out_size = raw.dtype.itemsize, out.itemsize
    side = max(1, math.isqrt(max(1, tile // max(in_size, out_size))))
    pitch = column_pitch(side, in_size)
    rows, cols = raw.shape
    aside = isinstance(src, int) and batched.available()  # reads on the transpose thread
    # There, uncast, each group of stored columns is transposed as soon as it is read: only
    # a group is held stored, which leaves room for wide tiles (a cast goes whole tile to
    # whole tile, as .to() does).
    grouped = aside and raw.dtype.name == out.name
    wide = side * _WIDE if grouped and _wide_tiles(raw, out) else side  # a tile's columns
    group = max(1, min(wide, _GROUP // (pitch * in_size))) if grouped else wide
    # One stored buffer: the transpose thread reads a tile only once it has made the one
    # before; this thread reads one only once that tile is made. Wide tiles' buffers go back
    # when the chunk is done: kept, a later chunk whose cast imports torch on the transpose
    # thread would hold them beside it (up to 200 MiB beside torch's 220 MB; that import
    # gives back that thread's own).
    keep = wide == side
    stored = scratch(group * pitch * in_size, "stored" if keep else None)
    made = [scratch(side * wide * out_size, slot if keep else None)
            for slot in ("made", "made-2")]
    staged = scratch(side * wide * in_size, "staged") if raw.dtype.name != out.name else None

    def read(buffer: memoryview, first_row: int, height: int, first_col: int,
             width: int) -> None:
        at = raw.storage_start + (raw.storage_offset + first_col * rows + first_row) * in_size
        if height == rows and isinstance(src, int):  # whole columns, one after another
            pread_scattered(src, [buffer[k * pitch * in_size:(k * pitch + height) * in_size]
                                  for k in range(width)], at, source=source)
        elif isinstance(src, int):
            batched.read_pieces(src, buffer, range(0, width * pitch * in_size, pitch * in_size),
                                [height * in_size] * width,
                                range(at, at + width * rows * in_size, rows * in_size),
                                source=source)
        else:
            for k in range(width):
                pread_into(src, buffer[k * pitch * in_size:(k * pitch + height) * in_size],
                           at + k * rows * in_size, source=source)

    def read_and_make(buffer: memoryview, first_row: int, height: int, first_col: int,
                      width: int, target: memoryview) -> None:
        if not grouped:
            read(buffer, first_row, height, first_col, width)
            _make(buffer, pitch, width, height, raw.dtype, out, target, staged)
            return
        for left in range(0, width, group):
            span = min(group, width - left)
            read(buffer, first_row, height, first_col + left, span)
            transpose_tile(buffer, pitch, span, height, raw.dtype, target[left * out_size:],
                           row_pitch=width)

    running: Future[None] | None = None  # the last tile submitted (they run in order)
    previous: _Made | None = None
    whole_rows = settled is not None and len(runs[1]) == 1
    try:
        turn = 0
        for first_row in range(0, rows, side):
            height = min(side, rows - first_row)
            lines = row_starts(runs, cols, first_row, height)  # where each output row goes
            for first_col in range(0, cols, wide):
                width = min(wide, cols - first_col)
                target = made[turn % 2][:width * height * out_size]
                # Its made buffer last held the tile two before, which this thread wrote
                # after submitting the tile before and before this one.
                if aside:
                    running = background.submit("transpose", read_and_make, stored, first_row,
                                                height, first_col, width, target)
                else:
                    if running is not None:
                        running.result()  # the tile before is made: its stored bytes are free
                    read(stored, first_row, height, first_col, width)
                    running = background.submit("transpose", _make, stored, pitch, width,
                                                height, raw.dtype, out, target, staged)
                ends = (tensor_start + lines[0] * out_size,
                        tensor_start + (lines[0] + height * cols) * out_size) \
                    if whole_rows and first_col + width == cols else None
                before, previous = previous, (running, target, lines, first_col, width, ends)
                if before is not None:  # written while this tile is read and made
                    _write_made(before, write_pieces, out_size, tensor_start, progress, settled)
                turn += 1
        if previous is not None:
            _write_made(previous, write_pieces, out_size, tensor_start, progress, settled)
    finally:
        if running is not None:  # no read or transpose may still fill a buffer handed out again
            background.drain("transpose")


#: A tile submitted: its transpose, its made buffer, where its output rows start, its first
#: column and width, and the byte range of its row of tiles where it ends that row (whole
#: output rows) else None.
_Made = tuple[Future[None], memoryview, list[int], int, int, tuple[int, int] | None]


def _write_made(tile: _Made, write_pieces: Callable[[memoryview, Any, Any, Any], None],
                out_size: int, tensor_start: int, progress: Callable[[int], None] | None,
                settled: Callable[[int, int], None] | None) -> None:
    made, target, lines, first_col, width, ends = tile
    made.result()
    write_pieces(target, *_row_pieces(lines, width, first_col, out_size, tensor_start))
    if progress:
        progress(len(target))
    if ends is not None and settled is not None:
        settled(*ends)
