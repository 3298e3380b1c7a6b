"""Reading two sides of a diff in tiles that are cheap to read on both.

A side's tensor is a set of :class:`Piece` s: boxes of the tensor, each stored with its own
strides (a DCP chunk, a whole safetensors tensor). Comparing in the tensor's row-major
order is what made differently laid-out sides slow: a chunk stored transposed, or cut on
dim 1, had to be read across its whole storage for every few rows. Here each overlap of a
piece of A with a piece of B is cut into tiles (:func:`tile_sizes`) whose elements lie in
long contiguous runs on both sides, each side's tile is read run by run with ``pread``
(:func:`read_tile`, nothing outside the tile), and the two are compared as strided views.
The verdict of a diff does not depend on the order elements are compared in, only on which
element faces which.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from fsdpckpt._io.rawio import ReadAt, pread_into, scratch
from fsdpckpt.dcp._checked import CheckedRead
from fsdpckpt.dcp._zstd import ZstdEntry
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.merging import _casts
from fsdpckpt.merging._blocks import reorder

__all__ = ["Piece", "compressed", "finish_checks", "overlaps", "row_major", "tile_sizes",
           "tiles_of", "read_tile"]


@dataclass(frozen=True)
class Piece:
    """A box of a tensor and where its elements are stored.

    Attributes:
        offsets, sizes: the box, in the tensor.
        src: the open file descriptor, or the decoded bytes of a compressed entry, or
            either through a :class:`~fsdpckpt.dcp._checked.CheckedRead`.
        storage_start: byte offset of the storage in ``src``.
        storage_offset: the box's first element, in elements of the storage.
        stride: the box's strides in the storage, in elements.
        itemsize: bytes an element.
        source: how to name it in messages.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src: int | ReadAt
    storage_start: int
    storage_offset: int
    stride: tuple[int, ...]
    itemsize: int
    source: str


def overlaps(a: Sequence[Piece], b: Sequence[Piece]) -> Iterator[tuple[Piece, Piece,
                                                                    tuple[int, ...],
                                                                    tuple[int, ...]]]:
    """Each pair of pieces that share elements, with the box they share (offsets, sizes)."""
    for pa in a:
        for pb in b:
            low = tuple(max(x, y) for x, y in zip(pa.offsets, pb.offsets))
            high = tuple(min(x + s, y + t) for x, s, y, t in
                         zip(pa.offsets, pa.sizes, pb.offsets, pb.sizes))
            if all(h > lo for lo, h in zip(low, high)):
                yield pa, pb, low, tuple(h - lo for lo, h in zip(low, high))


def _inner_first(sizes: Sequence[int], stride: Sequence[int]) -> list[int]:
    """The dims from the one stored innermost to the outermost (size-1 dims last)."""
    return sorted(range(len(sizes)), key=lambda d: (sizes[d] == 1, abs(stride[d])))


def tile_sizes(sizes: Sequence[int], stride_a: Sequence[int], stride_b: Sequence[int],
               max_elements: int) -> tuple[int, ...]:
    """The sizes of the tiles a box is cut into: at most ``max_elements`` elements each,
    and long contiguous runs on both sides.

    When both sides store the same dim innermost, tiles take whole stretches of it and
    then of the next dims in A's order (a row-major pair reads whole rows). When they
    differ (one side transposed), a tile is a square-ish block of the two inner dims, so
    that both sides read runs of about ``sqrt(max_elements)`` elements.
    """
    budget = max(1, max_elements)
    tile = [1] * len(sizes)
    order = _inner_first(sizes, stride_a)
    inner_b = _inner_first(sizes, stride_b)[:1]
    if order and inner_b and order[0] != inner_b[0] and sizes[inner_b[0]] > 1:
        i, j = order[0], inner_b[0]
        tile[i] = min(sizes[i], max(1, math.isqrt(budget)))
        tile[j] = min(sizes[j], max(1, budget // tile[i]))
        tile[i] = min(sizes[i], max(1, budget // tile[j]))
        budget //= tile[i] * tile[j]
        order = [d for d in order if d not in (i, j)]
    for d in order:
        tile[d] = min(sizes[d], max(1, budget))
        budget //= tile[d]
    return tuple(tile)


def tiles_of(offsets: Sequence[int], sizes: Sequence[int], tile: Sequence[int],
             stride: Sequence[int] | None = None) -> Iterator[tuple[tuple[int, ...],
                                                                    tuple[int, ...]]]:
    """The tiles of ``tile`` sizes (smaller at the far edges) covering the box, each once.

    With ``stride`` (a side's storage strides), tiles come in that side's storage order, so
    its reads only ever move forward: a compressed chunk is decoded once, not restarted
    for every row of tiles. Without, in the tensor's row-major order.
    """
    ndim = len(sizes)
    order = list(range(ndim)) if stride is None else \
        list(reversed(_inner_first(sizes, stride)))
    starts = [range(offsets[d], offsets[d] + sizes[d], tile[d]) for d in order]
    for permuted in itertools.product(*starts):
        corner = [0] * ndim
        for d, at in zip(order, permuted):
            corner[d] = at
        yield tuple(corner), tuple(min(t, o + s - c) for c, t, o, s in
                                   zip(corner, tile, offsets, sizes))


def read_tile(piece: Piece, offsets: Sequence[int], sizes: Sequence[int],
              buffer: memoryview, *, later: bool = False) -> tuple[int, ...]:
    """Read the tile ``offsets``/``sizes`` (in the tensor) of ``piece`` into ``buffer``, in
    the piece's storage order, reading nothing outside it.

    A piece read through a :class:`~fsdpckpt.dcp._checked.CheckedRead` sums the bytes as
    they come; with ``later`` on the other core (``CheckedRead.read_at``), and then
    ``buffer`` must stay as it is until the piece's next read or its ``settle``. Whoever
    reads pieces calls :func:`finish_checks` on them before using what it read.

    Returns:
        The strides (in elements) at which the tile lies in ``buffer``, one per tensor dim:
        ``buffer`` viewed with ``sizes`` and these strides is the tile.
    """
    ndim = len(sizes)
    local = [o - p for o, p in zip(offsets, piece.offsets)]
    base = piece.storage_offset + sum(x * st for x, st in zip(local, piece.stride))
    # Storage order, outermost first; the tile lies row-major in that order in the buffer.
    perm = list(reversed(_inner_first(sizes, piece.stride)))
    strides = [0] * ndim
    step = 1
    for d in reversed(perm):
        strides[d] = step
        step *= sizes[d]
    # The innermost dims whose storage strides follow on from each other make one run.
    run, inner = 1, 0
    for d in reversed(perm):
        if sizes[d] != 1 and piece.stride[d] != run:
            break
        run *= sizes[d]
        inner += 1
    outer = perm[:ndim - inner]
    if outer:
        starts = _run_starts(base, [sizes[d] for d in outer], [piece.stride[d] for d in outer])
    else:
        starts = [base]
    size = piece.itemsize
    nbytes = run * size
    view = buffer.cast("B") if buffer.format != "B" else buffer
    for k, first in enumerate(starts):
        part = view[k * nbytes:(k + 1) * nbytes]
        at = piece.storage_start + first * size
        if isinstance(piece.src, int):
            pread_into(piece.src, part, at, source=piece.source)
        elif isinstance(piece.src, CheckedRead):
            piece.src.read_at(part, at, later=later)
        else:
            piece.src.read_at(part, at)
    return tuple(strides)


def _run_starts(base: int, sizes: Sequence[int], strides: Sequence[int]) -> list[int]:
    """The storage offsets (elements) of the runs of a tile, outer dims first: numpy's
    outer sums where it is installed, torch's otherwise."""
    np = _casts._numpy()
    if np is not None:
        grid = np.array(base, dtype=np.int64)
        for size, stride in zip(sizes, strides):
            grid = grid[..., None] + np.arange(size, dtype=np.int64) * stride
        found_np: list[int] = grid.reshape(-1).tolist()
        return found_np
    torch = _casts.import_torch()
    found = torch.tensor(base, dtype=torch.int64)
    for size, stride in zip(sizes, strides):
        found = found.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    starts: list[int] = found.reshape(-1).tolist()
    return starts


def finish_checks(pieces: Iterable[Piece]) -> None:
    """Finish the check of every piece read through a
    :class:`~fsdpckpt.dcp._checked.CheckedRead` (each once): what the tiles did not read in
    storage order is read now, and the whole entry is compared with its recorded CRC-32.

    Raises:
        ChecksumError: a piece's stored bytes do not match their recorded CRC-32.
    """
    checks = {id(p.src): p.src for p in pieces if isinstance(p.src, CheckedRead)}
    for check in checks.values():
        check.finish()


def compressed(piece: Piece) -> bool:
    """Whether the piece is read through the decoder of a compressed entry (its reads are
    cheap only moving forward)."""
    src = piece.src.src if isinstance(piece.src, CheckedRead) else piece.src
    return isinstance(src, ZstdEntry)


def row_major(buffer: memoryview, dtype: DType, sizes: Sequence[int], strides: Sequence[int],
              slot: str) -> memoryview:
    """The bytes of the tile read by :func:`read_tile`, in the tile's row-major order: a
    slice of ``buffer`` where it lies so, else a copy in the scratch ``slot``, bit for bit
    (without torch where numpy is installed: :func:`~fsdpckpt.merging._blocks.reorder`)."""
    count = math.prod(sizes)
    nbytes = count * dtype.itemsize
    step, expected = 1, [0] * len(sizes)
    for d in reversed(range(len(sizes))):
        expected[d] = step
        step *= sizes[d]
    if all(n == 1 or s == e for n, s, e in zip(sizes, strides, expected)):
        return buffer[:nbytes]
    rows = scratch(nbytes, slot)
    reorder(buffer, count, sizes, strides, 0, dtype, rows)
    return rows[:nbytes]
