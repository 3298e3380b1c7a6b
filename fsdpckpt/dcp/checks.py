"""Structural checks of a DCP folder, from its metadata and file sizes alone.

They answer "is this folder whole?" without reading tensor data: every chunk
has a storage entry inside a file that exists and is long enough, and the
chunks of each tensor tile it exactly (no gap, no overlap). Problems are
collected, never raised, so a user sees all of them.

A rank with no data file is not a problem by itself: with
``FileSystemWriter(single_file_per_rank=False)`` each rank writes one file per
item (``__{rank}_0.distcp``, ``__{rank}_1.distcp``...) and a rank with nothing
to write writes none. ``.metadata`` names every file a load needs, and each of
those is checked. It does not record the world size, which
:func:`known_world_size` therefore gives as a lower bound when the files
cannot tell it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from fsdpckpt.dcp._allowlist import cap
from fsdpckpt.dcp._bulk import paused_gc
from fsdpckpt.dcp._objects import DecodedObject
from fsdpckpt.dcp._zstd import MAX_RATIO
from fsdpckpt.dcp.metadata import Chunk, TensorEntry, rank_file_parts
from fsdpckpt.dcp.reader import DcpFolder
from fsdpckpt.errors import CorruptCheckpointError

__all__ = ["Problem", "check_folder", "check_tensor_chunks", "known_world_size",
           "require_whole"]

_SHOWN = 5  # problems of one kind named in full; the rest are counted


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the one problem type that :func:`check_folder`,
    :func:`fsdpckpt.inspect_checkpoint` and :func:`fsdpckpt.verify_checkpoint` report.

    Attributes:
        path: the file or folder concerned.
        message: what is wrong, naming the entry where there is one.
    """

    path: str
    message: str

    #: Not a sequence: without this, ``__getitem__`` would make ``iter(problem)`` "work".
    __iter__ = None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"

    def to_json(self) -> dict[str, str]:
        """``{"path": ..., "message": ...}``: the form ``--json`` prints."""
        return {"path": self.path, "message": self.message}

    def __getitem__(self, key: str) -> str:
        """``problem["message"]``, as when problems were dicts; prefer ``problem.message``."""
        return self.to_json()[key]


def _named(name: str) -> str:
    """A name from ``.metadata`` as messages quote it: at most 200 characters."""
    return f"'{cap(name, 200)}'"


def _dims(values: Sequence[int]) -> str:
    """Offsets, sizes or a shape as messages give them: at most 8 dims written out."""
    if len(values) <= 8:
        return str(list(values))
    return str(list(values[:8]))[:-1] + f", ... ({len(values)} dims)]"


def _overlaps(a: Chunk, b: Chunk) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


#: Grid cells the painting check may visit per chunk (plus a floor): past it, chunks cut in
#: three or more dims at misaligned places are refused as too irregular rather than checked
#: in quadratic time. Any grid DCP writes paints exactly one cell per chunk.
_CELLS_PER_CHUNK = 8
_CELLS_FLOOR = 1 << 20


def _sweep_overlap(boxes: list[tuple[Chunk, tuple[int, int], tuple[int, int]]]
                   ) -> tuple[Chunk, Chunk] | None:
    """The first overlapping pair of 2-d boxes ``(chunk, (x0, x1), (y0, y1))``, or None.

    A sweep along x: boxes leave before boxes at the same x enter (intervals are
    half-open), and the active y-intervals, kept sorted by start, are pairwise disjoint
    until the first overlap is found, so one bisect tells whether a new interval meets
    any of them. O(n log n) comparisons (list inserts move memory, not Python objects).
    """
    events = sorted([(x1, 0, i) for i, (_, (x0, x1), _) in enumerate(boxes)]
                    + [(x0, 1, i) for i, (_, (x0, x1), _) in enumerate(boxes)])
    starts: list[int] = []  # sorted y0 of the active boxes
    owners: list[int] = []  # their box indices, in the same order
    for _, entering, i in events:
        y0, y1 = boxes[i][2]
        at = bisect.bisect_left(starts, y0)
        if not entering:
            del starts[at], owners[at]
            continue
        for near in (at - 1, at):  # only the neighbours can meet [y0, y1)
            if 0 <= near < len(starts):
                other = boxes[owners[near]][2]
                if other[0] < y1 and y0 < other[1]:
                    return boxes[owners[near]][0], boxes[i][0]
        starts.insert(at, y0)
        owners.insert(at, i)
    return None


def _paint_overlap(chunks: list[Chunk], dims: list[int]) -> tuple[Chunk, Chunk] | None | str:
    """The first overlapping pair found by painting a coordinate-compressed grid.

    Returns the pair, None when no two chunks overlap, or a message when the grid is
    too fine to paint within the budget (see ``_CELLS_PER_CHUNK``).
    """
    cuts = [sorted({c.offsets[d] for c in chunks} | {c.offsets[d] + c.sizes[d] for c in chunks})
            for d in dims]
    spans = []
    cells = 0
    budget = _CELLS_FLOOR + _CELLS_PER_CHUNK * len(chunks)
    for chunk in chunks:
        span = [range(bisect.bisect_left(cut, chunk.offsets[d]),
                      bisect.bisect_left(cut, chunk.offsets[d] + chunk.sizes[d]))
                for cut, d in zip(cuts, dims)]
        cells += math.prod(len(r) for r in span)
        if cells > budget:
            return (f"{len(chunks)} chunks cut it at misaligned places in {len(dims)} dims, "
                    "more finely than any DCP save does; the metadata is damaged or crafted")
        spans.append(span)
    owner: dict[tuple[int, ...], Chunk] = {}
    for chunk, span in zip(chunks, spans):
        for cell in itertools.product(*span):
            if cell in owner:
                return owner[cell], chunk
            owner[cell] = chunk
    return None


def _first_overlap(chunks: list[Chunk]) -> tuple[Chunk, Chunk] | None | str:
    """Two non-empty chunks that overlap, exactly, in O(n log n) for cuts in up to 2 dims."""
    if len(chunks) < 2:
        return None
    ndim = len(chunks[0].sizes)
    # A dim where every chunk spans the same interval separates none of them: drop it.
    dims = [d for d in range(ndim)
            if len({(c.offsets[d], c.sizes[d]) for c in chunks}) > 1]
    if not dims:
        return chunks[0], chunks[1]
    if len(dims) <= 2:
        ys = (lambda c: (c.offsets[dims[1]], c.offsets[dims[1]] + c.sizes[dims[1]])) \
            if len(dims) == 2 else (lambda c: (0, 1))
        return _sweep_overlap([(c, (c.offsets[dims[0]], c.offsets[dims[0]] + c.sizes[dims[0]]),
                                ys(c)) for c in chunks])
    return _paint_overlap(chunks, dims)


def _rows_tile(shape: tuple[int, ...], chunks: Sequence[Chunk]) -> bool:
    """Whether ``chunks`` tile ``shape`` as FSDP2 saves every tensor: whole in every dim
    but the first, their rows end to end from 0 to the last (empty ones anywhere inside
    the shape). True only where :func:`check_tensor_chunks` would find nothing: its usual
    case, in one pass and a sort of the rows, not its general sweep (millions of chunks at
    thousands of ranks)."""
    if not shape:
        return False
    rest, zeros, rows = tuple(shape[1:]), (0,) * (len(shape) - 1), shape[0]
    spans = []
    for chunk in chunks:
        offsets, sizes = chunk.offsets, chunk.sizes
        if tuple(offsets[1:]) != zeros or tuple(sizes[1:]) != rest or \
                len(offsets) != len(shape) or len(sizes) != len(shape):
            return False
        start, count = offsets[0], sizes[0]
        if start < 0 or count < 0 or start + count > rows:
            return False
        if count:
            spans.append((start, count))
    spans.sort()
    at = 0
    for start, count in spans:
        if start != at:
            return False
        at += count
    return at == rows


def check_tensor_chunks(tensor: TensorEntry) -> list[str]:
    """Say how the chunks of ``tensor`` fail to tile its shape exactly (empty if they do).

    Exact for any chunks, and bounded: O(n log n) in the number of chunks when they
    are cut in at most two dims (every FSDP/TP layout), a painted grid otherwise.
    """
    shape, found = tensor.shape, []
    if not tensor.chunks:
        return ["has no chunks"]
    if _rows_tile(shape, tensor.chunks):
        return []
    for chunk in tensor.chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            found.append(f"chunk at {_dims(chunk.offsets)} has {len(chunk.sizes)} dims, "
                         f"the tensor has {len(shape)}")
        elif any(o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape)):
            found.append(f"chunk at {_dims(chunk.offsets)} of size {_dims(chunk.sizes)} reaches "
                         f"outside the shape {_dims(shape)}")
    if found:
        return found[:_SHOWN] + ([f"{len(found) - _SHOWN} more such chunks"]
                                 if len(found) > _SHOWN else [])
    total = sum(c.numel for c in tensor.chunks)
    overlap = _first_overlap([c for c in tensor.chunks if c.numel])
    if isinstance(overlap, str):
        return [overlap]
    if overlap is not None:
        a, b = sorted(overlap, key=lambda c: c.offsets)
        found.append(f"chunks at {_dims(a.offsets)} and {_dims(b.offsets)} overlap")
    elif total < tensor.numel:
        found.append(f"chunks cover {total} of {tensor.numel} elements: there is a gap")
    return found


def check_folder(folder: DcpFolder) -> list[Problem]:
    """Check a DCP folder's structure against its files.

    Args:
        folder: the folder, as :func:`fsdpckpt.dcp.reader.read_dcp_folder` read it.

    Returns:
        Every problem found, in a stable order; empty when the folder is whole.
    """
    with paused_gc():  # a tuple per chunk, none in a cycle (see _bulk)
        return _check_folder(folder)


def _check_folder(folder: DcpFolder) -> list[Problem]:
    problems: list[Problem] = []
    missing: dict[str, list[str]] = {}
    # A cut-short file: one problem, not one per chunk past its end (a big model's
    # truncated rank file holds thousands): (the first one, how many, where the last ends).
    cut: dict[str, list[Any]] = {}
    sizes = folder.file_sizes
    base = str(folder.path)

    def check_location(what: str, file: str | None, offset: int, length: int) -> None:
        if file is None:
            problems.append(Problem(base, f"{what} has no storage entry in .metadata"))
        elif file not in sizes:
            missing.setdefault(file, []).append(what)
        elif offset < 0 or length <= 0:
            problems.append(Problem(
                f"{base}/{file}",
                f"{what} lies at bytes {offset}..{offset + length}, past the end of the file "
                f"({sizes[file]} bytes): the file is truncated"))
        elif offset + length > sizes[file]:
            found = cut.get(file)
            if found is None:
                cut[file] = [what, offset, offset + length, 1, offset + length]
            else:
                found[3] += 1
                found[4] = max(found[4], offset + length)

    # (file, offset, end, what): ``what`` a name, or (tensor, chunk) said only if it matters.
    ranges: list[tuple[str, int, int, Any]] = []
    add_range = ranges.append
    for tensor in folder.metadata.tensors:
        for message in check_tensor_chunks(tensor):
            problems.append(Problem(base, f"tensor {_named(tensor.name)}: {message}"))
        itemsize = tensor.dtype.itemsize
        for chunk in tensor.chunks:
            file, offset, length = chunk.file, chunk.offset, chunk.length
            nbytes = math.prod(chunk.sizes) * itemsize
            if file is not None and length > 0 and offset + length <= sizes.get(file, -1) and \
                    nbytes <= length and offset >= 0:  # the usual case, said in one test
                if nbytes:
                    add_range((file, offset, offset + length, (tensor, chunk)))
                continue
            what = _chunk_what((tensor, chunk))
            check_location(what, file, offset, length)
            # The chunk's archive holds its elements: a declared size larger than the
            # archive is refused here, before anything allocates or reserves it.
            # A compressed one may decode to more, but no more than zstd's format allows.
            stored = length * (MAX_RATIO if chunk.transforms else 1)
            if file is not None and nbytes > stored:
                problems.append(Problem(
                    f"{base}/{file}",
                    f"{what} declares {nbytes} bytes of "
                    f"{tensor.dtype.name} (sizes {_dims(chunk.sizes)}), but its archive holds "
                    f"only {stored} bytes: the metadata is damaged or crafted"))
            if file is not None and nbytes:
                # Empty chunks of one tensor share one storage entry (DCP keys it by
                # name and offsets, the same for them all): only real data must not share.
                add_range((file, offset, offset + length, (tensor, chunk)))
    for obj in folder.metadata.objects:
        if isinstance(obj, DecodedObject):
            continue  # decoded already (a per-rank file's inline value): no bytes to check
        what = f"object {_named(obj.name)}"
        check_location(what, obj.file, obj.offset, obj.length)
        if obj.file is not None:
            ranges.append((obj.file, obj.offset, obj.offset + obj.length, what))
    problems.extend(_shared_bytes(base, ranges))

    for file, (what, offset, end, count, last) in cut.items():
        more = (f"; {count - 1} more chunks and objects lie past it too, the last ending at "
                f"byte {last}") if count > 1 else ""
        problems.append(Problem(
            f"{base}/{file}",
            f"the file is truncated: it has {sizes[file]} bytes, but {what} lies at bytes "
            f"{offset}..{end}{more}; copy it again from the machine that wrote the checkpoint"))
    for file, needers in sorted(missing.items()):
        more = f" and {len(needers) - 1} more" if len(needers) > 1 else ""
        problems.append(Problem(f"{base}/{file}", f"missing file, needed by {needers[0]}{more}; "
                                "copy it from the machine that wrote the checkpoint"))
    return problems


def require_whole(folder: DcpFolder) -> None:
    """Refuse ``folder`` unless :func:`check_folder` finds nothing: what every reader of
    chunk data calls first, so the sizes the metadata declares are checked against the
    bytes present before anything is allocated or read.

    Raises:
        CorruptCheckpointError: the first problem (and how many more), and the command that
            lists them all.
    """
    problems = check_folder(folder)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptCheckpointError(f"{problems[0]}{more}; run `fsdpckpt inspect "
                                     f"{folder.path}` for the full list")


def _chunk_what(owner: Any) -> str:
    """How a message names a byte range's owner: a name, or a tensor's chunk."""
    if isinstance(owner, str):
        return owner
    tensor, chunk = owner
    return f"tensor {_named(tensor.name)} chunk at {_dims(chunk.offsets)}"


def _shared_bytes(base: str, ranges: list[tuple[str, int, int, Any]]) -> list[Problem]:
    """Entries whose byte ranges overlap in one file (DCP writes each item once, in turn).

    Sorted by file and offset, one pass finds them; refusing them keeps the work of
    every reader proportional to the bytes on disk (no archive is parsed twice).
    """
    found: list[Problem] = []
    ranges.sort(key=itemgetter(0, 1, 2))  # the owners (last) need not compare
    for (file_a, _, end_a, what_a), (file_b, start_b, _, what_b) in zip(ranges, ranges[1:]):
        if file_a == file_b and start_b < end_a:
            found.append(Problem(f"{base}/{file_a}", f"{_chunk_what(what_a)} and "
                                 f"{_chunk_what(what_b)} share bytes "
                                 f"from {start_b}: the metadata is damaged or crafted"))
            if len(found) == _SHOWN:
                break
    return found


def known_world_size(folder: DcpFolder) -> tuple[int, bool]:
    """The world size that wrote ``folder``, and whether it is exact or only a lower bound.

    ``.metadata`` does not record the world size; the rank file names show it. With
    torch's default (``single_file_per_rank=True``, one writer thread) every rank writes
    exactly ``__{rank}_0.distcp``, even with nothing to write, so ranks ``0..N-1`` each
    with that one file give exactly ``N``. Any other pattern (a rank without a file,
    ``__{rank}_1.distcp`` and beyond) may come from ``single_file_per_rank=False``,
    where ranks with nothing to write, the last ones included, write no file: then
    ``N`` is a lower bound.

    Returns:
        ``(world_size, exact)``; ``(0, False)`` for a folder with no rank files.
    """
    names = {f.name for f in folder.files} | set(folder.metadata.referenced_files)
    found = [parts for parts in map(rank_file_parts, names) if parts]
    if not found:
        return 0, False
    ranks = {rank for rank, _ in found}
    world = max(ranks) + 1
    one_file_per_rank = all(index == 0 for _, index in found) and len(ranks) == world
    return world, one_file_per_rank
