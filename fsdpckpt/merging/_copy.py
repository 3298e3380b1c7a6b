"""Moving one chunk's bytes to their place in an output, in bounded blocks.

The fast path never decodes a tensor: a chunk that is one contiguous run of
its output tensor (FSDP's dim-0 shards) is copied file to file with
``os.copy_file_range``; a chunk that is many runs (dim-1 shards) is read in
16 MiB blocks and written run by run, cast on the way by :mod:`fsdpckpt.merging._casts`
for the common exports (fp32 to bf16 or fp16), without torch (a merge writes the chunks that
together make whole rows, dim-1 shards and 2-D grids, a band of rows at a time instead:
:mod:`fsdpckpt.merging._rows`). Any other cast,
or a non-contiguous stored chunk, imports torch, and then works tile by tile: each
tile is a box of the chunk whose stored bytes span at most ``_SPAN`` bytes and
whose output is at most ``_TILE`` bytes, so memory stays flat however large
the tensor (a transposed 2.4 GB chunk used to be held whole, three times). A large
column-major chunk goes in square tiles instead, transposed by numpy where it is installed
(:mod:`fsdpckpt.merging._transpose`), without torch unless a cast needs it.

Every chunk's bytes are checked against the CRC-32 its archive records as they are read
(:mod:`fsdpckpt.dcp._checked`), so a checked chunk goes through memory, never
``copy_file_range``; readers of parts of a chunk check its storage whole, once (a
column-major chunk's on the CRC thread, beside its tiles).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from fsdpckpt._io import background, batched
from fsdpckpt._io.durable import Writeback
from fsdpckpt._io.rawio import ReadAt, copy_range, pread_into, pwrite_all, scratch
from fsdpckpt.dcp import _checked
from fsdpckpt.dcp._archive import RawTensor, locate_tensor
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp._perrank import PerRankChunk
from fsdpckpt.dcp._zstd import ZstdEntry, chunk_limit, open_entry
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import Chunk, TensorEntry
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError
from fsdpckpt.merging._blocks import reorder
from fsdpckpt.merging._casts import cast_block, fast_cast
from fsdpckpt.merging._gather import box_rows, box_runs, compact_strides, dense_order, read_box
from fsdpckpt.merging._runs import Runs, chunk_runs, tiles
from fsdpckpt.merging._transpose import (
    fits_whole,
    is_column_major,
    place_column_major,
    place_column_major_whole,
)
from fsdpckpt.merging._transpose_cast import in_groups, place_cast_in_groups

__all__ = ["checked_source", "place_chunk", "place_stored_chunk", "tiles", "FileSink",
           "MemorySink"]

# Stored bytes read for one tile, and output bytes made by one tile. With torch
# imported (about 220 MB here) two such buffers keep a merge under 300 MB.
_SPAN = 16 * 2**20
_TILE = 16 * 2**20
#: Bytes read, checked (and cast) and written per block from a local file: small enough that
#: the CRC (on the other core) and the write find the bytes still in the CPU cache. With
#: 16 MiB blocks each byte crossed memory three times, and a checked merge took 3x the
#: unchecked one; with the CRC beside the write, 256 KiB blocks merged 1.6 GB in 1.23 s,
#: 1 MiB in 2.1 s, 4 MiB in 2.8 s, 128 KiB in 1.8 s (a durable cp -r: 1.17 s).
_LOCAL_BLOCK = 256 * 2**10
#: The same for a block that is cast on the way, or written in many runs: the cast's numpy
#: passes and the runs' writes cost per call (1 MiB blocks export fp32 to bf16 in 1.62 s
#: against 2.09 s with 256 KiB).
_LOCAL_CAST_BLOCK = 2**20


class Sink(Protocol):
    """Where placed bytes go: an output file, or memory (``load_full_state_dict``)."""

    def write(self, data: memoryview, offset: int) -> None:
        """Put all of ``data`` at byte ``offset``."""

    def write_pieces(self, data: memoryview, starts: Any, lengths: Any, offsets: Any) -> None:
        """Put ``data[starts[i]:starts[i] + lengths[i]]`` at byte ``offsets[i]``, every ``i``."""

    def copy_from(self, src: int, src_offset: int, offset: int, count: int, *, source: str,
                  progress: Callable[[int], None] | None) -> None:
        """Put ``count`` bytes of the file ``src`` from ``src_offset`` at byte ``offset``."""

    def settled(self, start: int, end: int) -> None:
        """Bytes ``[start, end)``, put in scattered pieces, are all put now."""


class FileSink:
    """An open output file, written with looping ``pwrite`` and ``copy_file_range``; each run
    of adjacent bytes put is reported to ``writeback`` (the kernel writes it back meanwhile),
    and so is each region put in pieces once the placer says it is whole (:meth:`settled`)."""

    def __init__(self, fd: int, writeback: Writeback | None = None) -> None:
        self.fd, self.writeback = fd, writeback

    def write(self, data: memoryview, offset: int) -> None:
        pwrite_all(self.fd, data, offset)
        self.settled(offset, offset + len(data))

    def write_pieces(self, data: memoryview, starts: Any, lengths: Any, offsets: Any) -> None:
        batched.write_pieces(self.fd, data, starts, lengths, offsets)
        if len(offsets) == 1:  # whole rows that follow each other: one piece
            self.settled(int(offsets[0]), int(offsets[0]) + int(lengths[0]))

    def copy_from(self, src: int, src_offset: int, offset: int, count: int, *, source: str,
                  progress: Callable[[int], None] | None) -> None:
        end = offset

        def copied(count: int) -> None:
            nonlocal end
            self.settled(end, end + count)
            end += count
            if progress:
                progress(count)

        copy_range(src, src_offset, self.fd, offset, count, source=source, progress=copied)

    def settled(self, start: int, end: int) -> None:
        if self.writeback is not None:
            self.writeback.wrote(start, end)


class MemorySink:
    """A writable buffer (the memory of a tensor being filled): reads land in it directly."""

    def __init__(self, view: memoryview) -> None:
        self.view = view.cast("B")

    def write(self, data: memoryview, offset: int) -> None:
        self.view[offset:offset + len(data)] = data

    def write_pieces(self, data: memoryview, starts: Any, lengths: Any, offsets: Any) -> None:
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        for start, length, offset in zip(starts, lengths, offsets):
            self.write(data[int(start):int(start) + int(length)], int(offset))

    def copy_from(self, src: int, src_offset: int, offset: int, count: int, *, source: str,
                  progress: Callable[[int], None] | None) -> None:
        pread_into(src, self.view[offset:offset + count], src_offset, source=source)
        if progress:
            progress(count)

    def settled(self, start: int, end: int) -> None:
        pass  # memory has no writeback


#: Where a chunk's stored bytes are read from: a data file's descriptor, or the decoded
#: bytes of a compressed entry.
Source = int | ReadAt


def _runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Runs:
    return chunk_runs(shape, Chunk(tuple(offsets), tuple(sizes), None, 0, 0))


def _pieces(chunk_sizes: Sequence[int], box_offsets: Sequence[int], box_sizes: Sequence[int],
            run: int, starts: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(position in the box's row-major output, element of the tensor, count)``, coalesced."""
    box_run, box_starts = _runs(chunk_sizes, box_offsets, box_sizes)
    pending: list[int] | None = None
    for k, first in enumerate(box_starts):  # ``first``: element index within the chunk
        at, left = k * box_run, box_run
        while left:
            index, within = divmod(first, run)
            count = min(left, run - within)
            target = starts[index] + within
            if pending is not None and pending[1] + pending[2] == target:
                pending[2] += count
            else:
                if pending is not None:
                    yield pending[0], pending[1], pending[2]
                pending = [at, target, count]
            at, first, left = at + count, first + count, left - count
    if pending is not None:
        yield pending[0], pending[1], pending[2]


def _place_contiguous(src: Source, raw: RawTensor, run: int, starts: Sequence[int], out: DType,
                      sink: Sink, tensor_start: int, source: str,
                      progress: Callable[[int], None] | None) -> None:
    """A row-major chunk: read blocks of elements, cast them if asked, write each run's part."""
    in_size, out_size = raw.dtype.itemsize, out.itemsize
    total = run * len(starts)  # elements
    local = isinstance(src, int) or isinstance(src, _checked.CheckedRead) and src.local
    # Small blocks pay where each block is one write (one run, not cast); a chunk of many
    # runs (dim-1 chunks: 2.44 s against 3.23 s) or a cast is faster in larger ones.
    one_write = raw.dtype == out and len(starts) == 1
    block_bytes = (_LOCAL_BLOCK if one_write else _LOCAL_CAST_BLOCK) if local else _SPAN
    per_block = max(1, block_bytes // max(in_size, out_size))
    # A checked read: its CRC runs on the other core while the block is written (and, from
    # remote storage, the next one fetched), so two buffers take turns (CheckedRead.read_at's
    # ``later``). Remote blocks are 16 MiB: the second costs 16 MiB; a merge from S3 summed
    # every byte on the main thread before (issue 21: 768 MiB from a loopback SeaweedFS,
    # 3.72 s against 3.54 s after, a plain s3fs download 3.20 s, on a busy 2-core machine).
    checked = src if isinstance(src, _checked.CheckedRead) else None
    cast = raw.dtype != out
    # Two stored buffers where the CRC or a cast runs beside (each turn's, while the next is
    # read), and two made ones where a cast does.
    buffers = [scratch(min(total, per_block) * in_size, slot)
               for slot in (("stored", "stored-2") if checked or cast else ("stored",))]
    made = [scratch(min(total, per_block) * out_size, slot)
            for slot in (("made", "made-2") if cast else ())]

    def block(turn: int) -> tuple[int, memoryview]:
        count = min(total - turn * per_block, per_block)
        return count, buffers[turn % len(buffers)][:count * in_size]

    def read(turn: int) -> None:
        count, stored = block(turn)
        _checked.read_checked(src, stored, raw.data_start + turn * per_block * in_size,
                              source=source)

    # Whether each parity's cast was done on the cast thread: one that needs torch (a block
    # holding NaN) is cast again here, where torch's import gives this thread's buffers back.
    cast_done = [True, True]

    def cast_turn(turn: int) -> None:
        count, stored = block(turn)
        cast_done[turn % 2] = cast_block(raw.dtype.name, out.name, stored,
                                         made[turn % 2][:count * out_size], with_torch=False)

    def write(turn: int) -> None:
        count, stored = block(turn)
        written = made[turn % 2][:count * out_size] if cast else stored
        if not cast_done[turn % 2]:
            cast_block(raw.dtype.name, out.name, stored, written)
        done, at = turn * per_block, 0  # done: elements placed before this turn
        while at < count:
            index, within = divmod(done + at, run)
            piece = min(count - at, run - within)
            sink.write(written[at * out_size:(at + piece) * out_size],
                       tensor_start + (starts[index] + within) * out_size)
            at += piece
        if progress:
            progress(count * out_size)

    turns = -(-total // per_block)
    if cast:  # the cast on the other core, while this one reads and writes
        background.alternate(turns, read, cast_turn, write, name="cast")
        return
    for turn in range(turns):
        read(turn)
        write(turn)


def _place_tiled(src: Source, raw: RawTensor, chunk: Chunk, run: int, starts: Sequence[int],
                 out: DType, sink: Sink, tensor_start: int, source: str,
                 progress: Callable[[int], None] | None) -> None:
    """Any other stored layout, and casts numpy does not do: one bounded tile at a time,
    reordered (:func:`~fsdpckpt.merging._blocks.reorder`: by numpy, without torch, where
    it is installed), then cast contiguous to contiguous as ``.to()`` of the contiguous
    tensor torch loads casts (torch casts a strided source on another path, and the two
    disagree on NaN bits: 0x7FC0 against 0xFFFF for bf16)."""
    in_size, out_size = raw.dtype.itemsize, out.itemsize
    cast = raw.dtype.name != out.name
    span_max = max(1, _SPAN // in_size)
    numel_max = max(1, _TILE // max(in_size, out_size))
    numel_cap = min(math.prod(raw.shape), numel_max)
    # Boxes of whole output rows, their stored runs gathered, where the layout is another
    # dim order (_gather); else tiles whose stored bytes are one span.
    rows = box_rows(raw, out, _TILE)
    if rows:
        order = dense_order(raw.shape, raw.stride) or []
        boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]] = [
            ((first,) + (0,) * (len(raw.shape) - 1),
             (min(rows, raw.shape[0] - first),) + tuple(raw.shape[1:]))
            for first in range(0, raw.shape[0], rows)]
        stored = scratch(numel_cap * in_size, "stored")
    else:
        boxes = tiles(raw.shape, raw.stride, span_max, numel_max)
        stored = scratch(min(raw.storage_nbytes, span_max * in_size), "stored")
    made = scratch(numel_cap * out_size, "made")
    staged = scratch(numel_cap * in_size, "staged") if cast else made  # reordered, to cast
    for offsets, sizes in boxes:
        numel = math.prod(sizes)
        if rows:
            length, firsts = box_runs(raw.shape, raw.stride, offsets[0], sizes[0], order)
            read_box(src, raw, stored, length, firsts, source=source)
            reorder(stored, numel, sizes, compact_strides(sizes, order), 0, raw.dtype, staged)
        else:
            base = raw.storage_offset + sum(o * st for o, st in zip(offsets, raw.stride))
            low = base + sum(min(0, (s - 1) * st) for s, st in zip(sizes, raw.stride))
            high = base + sum(max(0, (s - 1) * st) for s, st in zip(sizes, raw.stride)) + 1
            pread_into(src, stored[:(high - low) * in_size], raw.storage_start + low * in_size,
                       source=source)
            reorder(stored, high - low, sizes, raw.stride, base - low, raw.dtype, staged)
        if cast:
            cast_block(raw.dtype.name, out.name, staged[:numel * in_size],
                       made[:numel * out_size])
        # Each run of the tile in the output (one per row, for some layouts: thousands), in
        # batches (fsdpckpt._io.batched).
        pieces = list(_pieces(chunk.sizes, offsets, sizes, run, starts))
        sink.write_pieces(made, [at * out_size for at, _, _ in pieces],
                          [count * out_size for _, _, count in pieces],
                          [tensor_start + element * out_size for _, element, _ in pieces])
        if progress:
            progress(numel * out_size)


def column_major_past_a_span(raw: RawTensor) -> bool:
    """Whether ``raw`` is a column-major matrix (a transposed view ``torch.save`` kept with
    its strides) whose storage is more than one tile's span: its output rows are its stored
    columns, and tiles of whole stored rows would write each output row in pieces of a few
    hundred bytes (a 2.4 GB one took 75 s)."""
    return is_column_major(raw) and raw.storage_nbytes > _SPAN


def _in_boxes(raw: RawTensor, out: DType) -> bool:
    # Another dim order, placed in boxes of whole rows whose stored runs are gathered.
    return not raw.is_contiguous and not is_column_major(raw) and box_rows(raw, out, _TILE) > 0


def _in_square_tiles(raw: RawTensor, out: DType) -> bool:
    # Read out of storage order: too large to hold whole, past one tile's span.
    return column_major_past_a_span(raw) and not fits_whole(raw, out)


def place_chunk(src: Source, raw: RawTensor, chunk: Chunk, runs: Runs,
                out: DType, dst: int | Sink, tensor_start: int, *, source: str,
                progress: Callable[[int], None] | None = None) -> None:
    """Write one chunk's elements at their place in the output tensor.

    Args:
        src: the open data file holding the chunk, or the decoded bytes of a compressed one.
        raw: where the chunk's storage is, and its dtype, shape and strides.
        chunk: the chunk, as the metadata places it.
        runs: :func:`fsdpckpt.merging._runs.chunk_runs` of the chunk in its tensor.
        out: the output dtype.
        dst: the open output file, or a :class:`MemorySink`.
        tensor_start: byte offset of the output tensor's first element.
        source: how to name the chunk in messages.
        progress: called with the number of bytes written, as they are.
    """
    run, starts = runs
    if not starts:
        return
    if raw.shape != chunk.sizes:
        raise CorruptCheckpointError(f"{source}: holds shape {list(raw.shape)}, the metadata "
                                     f"says {list(chunk.sizes)}")
    sink = FileSink(dst) if isinstance(dst, int) else dst
    same = raw.dtype.name == out.name
    if same and raw.is_contiguous and len(starts) == 1 and isinstance(src, int):
        sink.copy_from(src, raw.data_start, tensor_start + starts[0] * out.itemsize,
                       raw.nbytes, source=source, progress=progress)
    elif raw.is_contiguous and (same or fast_cast(raw.dtype.name, out.name) is not None):
        _place_contiguous(src, raw, run, starts, out, sink, tensor_start, source, progress)
    elif is_column_major(raw) and fits_whole(raw, out):
        place = place_cast_in_groups if in_groups(raw, out) else place_column_major_whole
        place(src, raw, runs, out, sink.write_pieces, tensor_start, source=source,
              progress=progress)
    elif column_major_past_a_span(raw) and not isinstance(src, _checked.CheckedRead):
        place_column_major(src, raw, runs, out, sink.write_pieces, tensor_start, _TILE,
                           source=source, progress=progress, settled=sink.settled)
    else:
        _place_tiled(src, raw, chunk, run, starts, out, sink, tensor_start, source, progress)


def locate_stored_chunk(files: DataFiles, tensor: TensorEntry, chunk: Chunk, *,
                        check_shape: bool = False, verify: bool = True,
                        held: bool = False) -> tuple[RawTensor, Source, str]:
    """Where ``chunk`` of ``tensor`` is stored, checked against the metadata and (with
    ``verify``, for readers that take parts of it) its whole storage entry read once against
    the CRC-32 its archive records (:func:`fsdpckpt.dcp._checked.verify_entry_once`).

    Returns:
        ``(its archive record, what to read its bytes from, a label naming it for errors)``:
        the bytes come through the decoder of a compressed entry, else by offset from the
        data file (a descriptor, or a remote file). Used before ``files`` opens another file,
        unless ``held``: then it reads through :meth:`DataFiles.reader`, which outlives any
        number of other files opened meanwhile.

    Raises:
        NotACheckpointError: the metadata gives the chunk no storage entry.
        CorruptCheckpointError: its archive is damaged, or holds another dtype (with
            ``check_shape``, another shape) than the metadata says.
        ChecksumError: with ``verify``, its bytes do not match their recorded CRC-32.
    """
    source = f"{files.folder}/{chunk.file} (tensor '{tensor.name}' chunk at " \
             f"{list(chunk.offsets)})"  # a string, not a path: one per chunk
    if chunk.file is None:
        raise NotACheckpointError(f"{source}: the metadata has no storage entry")
    data = files.open(chunk.file)
    reader = files.reader(chunk.file) if held else None
    fd = data.fd
    # A plain chunk's archive is located through the descriptor (no buffered file made).
    handle, start, length = (fd, chunk.offset, chunk.length) \
        if not chunk.transforms and isinstance(fd, int) else \
        open_entry(data.file, chunk.offset, chunk.length, chunk.transforms,
                   limit=chunk_limit(tensor, chunk), source=source, reader=reader)
    # A per-rank file's chunk is a storage entry inside the rank's zip, located when read.
    raw = chunk.raw if isinstance(chunk, PerRankChunk) and chunk.raw else \
        locate_tensor(handle, start, length, source=source)
    if raw.dtype.name != tensor.dtype.name:
        raise CorruptCheckpointError(f"{source}: holds {raw.dtype.name}, the metadata says "
                                     f"{tensor.dtype.name}")
    if check_shape and tuple(raw.shape) != tuple(chunk.sizes):
        raise CorruptCheckpointError(f"{source}: holds shape {list(raw.shape)}, the metadata "
                                     f"says {list(chunk.sizes)}")
    src = handle if isinstance(handle, ZstdEntry) else reader if reader is not None else fd
    if verify:
        _checked.verify_entry_once(files.checked, (chunk.file, chunk.offset, raw.storage_start),
                                   src, raw.storage_start, raw.storage_nbytes, raw.crc32,
                                   source=source, entry=raw.entry)
    return raw, src, source


def place_stored_chunk(files: DataFiles, tensor: TensorEntry, chunk: Chunk, runs: Runs,
                       out: DType, dst: int | Sink, tensor_start: int, *,
                       progress: Callable[[int], None] | None = None) -> None:
    """Find ``chunk`` of ``tensor`` in its data file, check it, and place it (:func:`place_chunk`).

    Args:
        files: the open data files of the tensor's folder.
        tensor, chunk: the stored tensor and the chunk of it to place.
        runs: :func:`fsdpckpt.merging._runs.chunk_runs` of the chunk (a plan carries them).
        out, dst, tensor_start, progress: as for :func:`place_chunk`.

    Raises:
        NotACheckpointError: the metadata gives the chunk no storage entry.
        CorruptCheckpointError: its archive is damaged or holds another dtype than the metadata.
        ChecksumError: its storage entry's bytes do not match the CRC-32 its archive
            records; checked as they are read (:class:`fsdpckpt.dcp._checked.CheckedRead`),
            so before the caller commits anything made from them.
    """
    raw, src, source = locate_stored_chunk(files, tensor, chunk, verify=False)
    out_of_order = _in_square_tiles(raw, out) or _in_boxes(raw, out)
    if out_of_order and isinstance(src, int):
        # Read out of storage order (in tiles or boxes): its storage is read whole against
        # its CRC on the other core meanwhile (2.4 GB: 1 s of the 8-10 s this merge took).
        with _checked.verify_entry_beside(files.checked, (chunk.file, chunk.offset,
                                                          raw.storage_start),
                                          src, raw.storage_start, raw.storage_nbytes,
                                          raw.crc32, source=source, entry=raw.entry):
            place_chunk(src, raw, chunk, runs, out, dst, tensor_start, source=source,
                        progress=progress)
        return
    # A chunk of a decoder or a remote file read out of storage order (large column-major,
    # or in boxes) is checked whole first.
    read = checked_source(files, chunk, raw, src, source, in_order=not out_of_order)
    place_chunk(read, raw, chunk, runs, out, dst, tensor_start, source=source,
                progress=progress)
    if isinstance(read, _checked.CheckedRead):
        read.finish()


def checked_source(files: DataFiles, chunk: Chunk, raw: RawTensor, src: Source, source: str,
                   *, in_order: bool = True) -> Source:
    """What to read the bytes of a located chunk from so that every byte is checked.

    A :class:`~fsdpckpt.dcp._checked.CheckedRead` that sums the bytes as they are read (the
    caller calls its ``finish`` before it uses what it made of them); or, where that cannot
    check as it reads, ``src`` itself, after its whole storage entry was read once against
    its CRC-32 (:func:`~fsdpckpt.dcp._checked.verify_entry_once`): no CRC recorded, a view
    of a storage other tensors share (an FSDP1 flat parameter in a rank file), or a reader
    that does not read in storage order (not ``in_order``).

    Raises:
        ChecksumError: checked whole here, the bytes do not match their recorded CRC-32.
    """
    if raw.crc32 is None or not _checked.ENABLED or raw.storage_offset or \
            raw.nbytes != raw.storage_nbytes or not in_order:
        _checked.verify_entry_once(files.checked, (chunk.file, chunk.offset, raw.storage_start),
                                   src, raw.storage_start, raw.storage_nbytes, raw.crc32,
                                   source=source, entry=raw.entry)
        return src
    return _checked.CheckedRead(src, raw.storage_start, raw.storage_nbytes, raw.crc32,
                                source=source, entry=raw.entry)
