"""Chunks that together make whole output rows, written a band of rows at a time.

Tensor parallelism saves a weight in dim-1 chunks, and a 2-D grid saves each band of rows
in several chunks: placed chunk by chunk (:func:`fsdpckpt.merging._copy.place_chunk`) each
row's piece of each chunk is its own ``pwrite`` (8 KiB for a 4096-wide float32 weight split
in two: about 200,000 system calls and as many turns of a Python loop for 1.6 GB, 1.5-1.7x
the plain merge of the same bytes, issue 21). Here a *row group*, the chunks that share one
range of dim 0 and together cover whole rows of the tensor, is recognized from the chunks'
offsets and sizes alone (:func:`row_groups`); then each turn reads a block of rows from
each chunk, in its own storage order, so that each keeps its own
:class:`~fsdpckpt.dcp._checked.CheckedRead` CRC chain (summed on the other core, two
buffers each), casts them if asked, and writes those whole output rows with one ``pwritev``
whose buffers alternate the chunks' row pieces (:func:`fsdpckpt._io.rawio.pwrite_gathered`):
nothing is copied into a band buffer (copying there measured slower than the writes it
saved). Anything else (column-major or strided chunks, compressed or remote sources, casts
only torch makes, groups that do not cover whole rows) is placed chunk by chunk as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsdpckpt._io import background
from fsdpckpt._io.durable import Writeback
from fsdpckpt._io.rawio import iov_max, pwrite_gathered, scratch
from fsdpckpt.dcp._checked import CheckedRead, read_checked
from fsdpckpt.dcp._datafiles import OPEN_FILES, DataFiles
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import Chunk, TensorEntry
from fsdpckpt.merging._casts import cast_block, fast_cast
from fsdpckpt.merging._copy import FileSink, checked_source, locate_stored_chunk, place_stored_chunk
from fsdpckpt.merging._runs import Runs

__all__ = ["RowGroup", "row_groups", "place_row_group", "place_tensor"]

#: Stored bytes read from all of a group's chunks per turn (the rows of one ``pwritev``).
#: Two such blocks are held (the CRC of one is summed while the next is read), plus their
#: cast. Small enough for the CRC and the write to find the bytes still in the CPU cache:
#: writing the 1.6 GB of 24 4096x4096 float32 weights in two dim-1 chunks each (a
#: microbenchmark, CRC beside, medians of 5 on a busy 2-core machine) took 2.0-2.4 s one
#: pwrite per row piece, 1.5-1.6 s with 512 KiB turns, 2.2-2.3 s with 1 MiB, 1.65 s with
#: 256 KiB; the same bytes written in 256 KiB pwrites, 1.5 s. Whole merges: 1.32 s with
#: 512 KiB turns, 1.70 s with 1 MiB (the plain merge 1.49 s).
GROUP_BLOCK = 512 * 2**10
#: The same for a group cast on the way, where the cast's numpy passes cost per call: with
#: 512 KiB turns ``--dtype bf16`` of those chunks took 2.23 s, with 2 MiB 1.64 s, with 4 MiB
#: 1.50 s (the plain merge of the same bytes 1.45 s; whole merges, medians of 5).
GROUP_CAST_BLOCK = 4 * 2**20
#: The most pieces one output row may be made of for a group to be placed here: each piece
#: is a Python object per buffer set, and rows of that many pieces are rare.
MAX_PIECES = 2**14


@dataclass(frozen=True)
class RowGroup:
    """Chunks of a tensor that share rows ``first .. first + rows`` of dim 0 and together
    make each of those output rows whole.

    Attributes:
        members: the chunks' indexes in the tensor's chunk list.
        first, rows: the dim-0 range they share.
        pieces: one output row, in order, as ``(member, element within the member's
            row, count)``: the member's elements that make the next ``count`` of the row.
    """

    members: tuple[int, ...]
    first: int
    rows: int
    pieces: tuple[tuple[int, int, int], ...]


def row_groups(shape: Sequence[int], chunks: Sequence[Chunk], runs: Sequence[Runs], *,
               row_max: int) -> list[RowGroup]:
    """The row groups among ``chunks`` of a tensor of ``shape``, from the metadata alone.

    Args:
        shape: the tensor's shape; chunks, runs: its chunks and where each lands
            (:func:`fsdpckpt.merging._runs.chunk_runs`, as a plan carries them).
        row_max: the most elements one output row may hold for its chunks to be grouped
            (a turn reads at least one row of each): chunks of longer rows already go out
            in long writes.

    Returns:
        Every group of two chunks or more that share a dim-0 range and tile its rows
        exactly, in the order of their first chunk; the other chunks are in none.
    """
    if len(shape) < 2:
        return []
    row = math.prod(shape[1:])
    if not 0 < row <= row_max:
        return []
    bands: dict[tuple[int, int], list[int]] = {}
    for index, chunk in enumerate(chunks):
        bands.setdefault((chunk.offsets[0], chunk.sizes[0]), []).append(index)
    groups = []
    for (first, rows), members in bands.items():
        pieces = _row_pieces(row, first, rows, [(chunks[i], runs[i]) for i in members])
        if len(members) > 1 and pieces is not None:
            groups.append(RowGroup(tuple(members), first, rows, pieces))
    return groups


def _row_pieces(row: int, first: int, rows: int, members: list[tuple[Chunk, Runs]]
                ) -> tuple[tuple[int, int, int], ...] | None:
    """One output row as the members' pieces, in order; None if they do not tile it."""
    if rows <= 0:
        return None
    # (position in the output row, member, element within the member's row, count)
    pieces: list[tuple[int, int, int, int]] = []
    for member, (chunk, (run, starts)) in enumerate(members):
        width = math.prod(chunk.sizes[1:])
        # A chunk partial in some dim after the first is whole runs per dim-0 index; one
        # whole in them is one run of all its rows (it alone makes its rows: no group).
        if run <= 0 or width % run or len(starts) != rows * (width // run):
            return None
        if len(pieces) + width // run > MAX_PIECES:
            return None
        base = first * row
        pieces.extend((starts[i] - base, member, i * run, run) for i in range(width // run))
    pieces.sort()
    at = 0
    for position, _, _, count in pieces:
        if position != at:  # a gap or an overlap: the metadata's business, not this path's
            return None
        at += count
    if at != row:
        return None
    return tuple((member, within, count) for _, member, within, count in pieces)


def place_row_group(files: DataFiles, tensor: TensorEntry, group: RowGroup, out: DType,
                    fd: int, tensor_start: int, *,
                    progress: Callable[[int], None] | None = None,
                    writeback: Writeback | None = None) -> bool:
    """Write the rows of ``group`` at their place in the output file ``fd``.

    Args:
        files: the open data files of the tensor's folder.
        tensor: the stored tensor; group: a row group of its chunks (:func:`row_groups`).
        out: the output dtype. fd, tensor_start: the output file and the byte offset of the
            tensor's first element in it.
        progress: called with the number of bytes written, as they are.
        writeback: told of each band of whole rows written (:class:`Writeback`).

    Returns:
        False, having read and written nothing, when a member is stored in a way only the
        chunk-by-chunk path places (not row-major, compressed, remote, a cast only torch
        makes), or the members lie in more files than :class:`DataFiles` keeps open; True
        when done.

    Raises:
        NotACheckpointError, CorruptCheckpointError: as
            :func:`fsdpckpt.merging._copy.place_stored_chunk`.
        ChecksumError: a member's bytes do not match the CRC-32 its archive records; each
            is checked as it is read, all before this returns (so before a commit).
    """
    if len({tensor.chunks[index].file for index in group.members}) > OPEN_FILES:
        return False  # its members' descriptors are held together: no more than stay open
    located = []
    for index in group.members:
        chunk = tensor.chunks[index]
        raw, src, source = locate_stored_chunk(files, tensor, chunk, verify=False)
        if not isinstance(src, int) or not raw.is_contiguous or \
                tuple(raw.shape) != tuple(chunk.sizes) or \
                raw.dtype.name != out.name and fast_cast(raw.dtype.name, out.name) is None:
            return False
        located.append((chunk, raw, src, source))
    reads = [checked_source(files, chunk, raw, src, source)
             for chunk, raw, src, source in located]
    in_size, out_size = tensor.dtype.itemsize, out.itemsize
    cast = tensor.dtype.name != out.name
    widths = [math.prod(chunk.sizes[1:]) for chunk, _, _, _ in located]
    row = sum(widths)
    turn_bytes = GROUP_CAST_BLOCK if cast else GROUP_BLOCK
    step = min(group.rows, max(1, turn_bytes // (row * max(in_size, out_size))),
               max(1, iov_max() // len(group.pieces)))  # rows per turn
    # Each member's rows of a turn: two stored buffers taking turns (the CRC of one is
    # summed while the other is read), and two made ones for their cast (made on the other
    # core while this one reads the next turn and writes the one before).
    stored = scratch(2 * step * row * in_size, "rows-stored")
    turns = [_split(stored[parity * step * row * in_size:], widths, step * in_size)
             for parity in (0, 1)]
    made = [_split(scratch(step * row * out_size, slot), widths, step * out_size)
            for slot in ("rows-made", "rows-made-2")] if cast else None
    # The buffers of a turn's output rows are the same every turn of a parity: made once.
    gathers = [_gather(views, widths, group.pieces, step, out_size)
               for views in (made if made is not None else turns)]

    def count_of(turn: int) -> int:
        return min(step, group.rows - turn * step)

    def read_turn(turn: int) -> None:
        count, done = count_of(turn), turn * step  # done: rows before this turn
        for member, ((_, raw, _, source), read) in enumerate(zip(located, reads)):
            block = turns[turn % 2][member][:count * widths[member] * in_size]
            at = raw.data_start + done * widths[member] * in_size
            read_checked(read, block, at, source=source)  # else checked whole already

    # Whether each parity's casts were done on the cast thread: a turn that needs torch (a
    # block holding NaN) is cast again here, where torch's import gives this thread's buffers
    # back first.
    cast_done = [True, True]

    def cast_turn(turn: int, with_torch: bool = False) -> None:
        count = count_of(turn)
        cast_done[turn % 2] = all([cast_block(
            tensor.dtype.name, out.name, turns[turn % 2][member][:count * width * in_size],
            casts[turn % 2][member][:count * width * out_size], with_torch=with_torch)
            for member, width in enumerate(widths)])

    def write_turn(turn: int) -> None:
        count = count_of(turn)
        if not cast_done[turn % 2]:
            cast_turn(turn, with_torch=True)
        views = gathers[turn % 2]
        at = tensor_start + (group.first + turn * step) * row * out_size
        pwrite_gathered(fd, views if count == step else views[:count * len(group.pieces)], at)
        if writeback:
            writeback.wrote(at, at + count * row * out_size)
        if progress:
            progress(count * row * out_size)

    total = -(-group.rows // step)
    casts = made or []
    if made is not None:
        background.alternate(total, read_turn, cast_turn, write_turn, name="cast")
    else:
        for turn in range(total):
            read_turn(turn)
            write_turn(turn)
    for read in reads:
        if isinstance(read, CheckedRead):
            read.finish()
    return True


def _split(buffer: memoryview, widths: Sequence[int], scale: int) -> list[memoryview]:
    """``buffer`` cut into consecutive parts of ``width * scale`` bytes, one per width."""
    parts, at = [], 0
    for width in widths:
        parts.append(buffer[at:at + width * scale])
        at += width * scale
    return parts


def _gather(views: Sequence[memoryview], widths: Sequence[int],
            pieces: Sequence[tuple[int, int, int]], rows: int, size: int) -> list[memoryview]:
    """The buffers of ``rows`` whole output rows, in order: each piece of each row in the
    block of its member (``views``, ``widths[member]`` elements of ``size`` bytes a row)."""
    return [views[member][(r * widths[member] + within) * size:
                          (r * widths[member] + within + count) * size]
            for r in range(rows) for member, within, count in pieces]


def place_tensor(files: DataFiles, tensor: TensorEntry, runs: Sequence[Runs], out: DType,
                 fd: int, tensor_start: int, *,
                 progress: Callable[[int], None] | None = None,
                 writeback: Writeback | None = None) -> None:
    """Write every chunk of ``tensor`` at its place in the output file ``fd``: its row
    groups a band of rows at a time (:func:`place_row_group`), the rest chunk by chunk
    (:func:`fsdpckpt.merging._copy.place_stored_chunk`).

    Args:
        files: the open data files of the tensor's folder.
        tensor: the stored tensor; runs: where each of its chunks lands (a plan's).
        out, fd, tensor_start, progress, writeback: as for :func:`place_row_group`.

    Raises:
        As :func:`fsdpckpt.merging._copy.place_stored_chunk`.
    """
    placed: set[int] = set()
    widest = max(tensor.dtype.itemsize, out.itemsize)
    for group in row_groups(tensor.shape, tensor.chunks, runs, row_max=GROUP_BLOCK // widest):
        if place_row_group(files, tensor, group, out, fd, tensor_start, progress=progress,
                           writeback=writeback):
            placed.update(group.members)
    for index, (chunk, chunk_runs) in enumerate(zip(tensor.chunks, runs, strict=True)):
        if index not in placed:
            place_stored_chunk(files, tensor, chunk, chunk_runs, out, FileSink(fd, writeback),
                               tensor_start, progress=progress)
