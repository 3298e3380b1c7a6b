"""Where a stored chunk's elements land in its row-major output tensor: runs of
consecutive elements, computed from the metadata's offsets and sizes alone."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from fsdpckpt.dcp.metadata import Chunk

__all__ = ["RunStarts", "chunk_runs", "Runs", "boxes", "row_starts", "tiles"]

#: ``(run, starts)``: ``len(starts)`` runs of ``run`` consecutive elements each.
Runs = tuple[int, Sequence[int]]


class RunStarts(Sequence[int]):
    """The first tensor element of each run of a chunk, computed on demand.

    A chunk of many short runs (a width-1 column of a 10^8-row tensor) would otherwise
    need a list of 10^8 Python ints, gigabytes, before one byte is copied. Run ``i``
    starts at ``base + sum(digit_d(i) * stride_d)``, the digits being ``i`` written in
    the mixed radix of the chunk's outer sizes; runs ascend with ``i``.
    """

    def __init__(self, base: int, sizes: Sequence[int], strides: Sequence[int]) -> None:
        self._base, self._sizes, self._strides = base, tuple(sizes), tuple(strides)
        self._count = math.prod(self._sizes)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):  # an int or a slice, as a Sequence
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        start = self._base
        for size, stride in zip(reversed(self._sizes), reversed(self._strides)):
            index, digit = divmod(index, size)
            start += digit * stride
        return start

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(self._count))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def chunk_runs(shape: Sequence[int], chunk: Chunk) -> tuple[int, Sequence[int]]:
    """Where a chunk's elements land in its row-major tensor.

    Returns:
        ``(run, starts)``: the chunk, read in row-major order, is ``len(starts)``
        runs of ``run`` consecutive elements; run ``i`` starts at element
        ``starts[i]`` of the tensor (a :class:`RunStarts`, computed on demand, ascending).
        One run means a single contiguous copy.
    """
    ndim = len(shape)
    if ndim == 0:
        return 1, [0]
    if not math.prod(chunk.sizes) or not math.prod(shape):
        # No element, no run: a shape like (200000000, 2, 0) must not enumerate its rows.
        return 0, []
    stride = [math.prod(shape[d + 1:]) for d in range(ndim)]
    k = ndim - 1  # the outermost dim of the contiguous run: all dims after it are whole
    while k > 0 and chunk.sizes[k] == shape[k]:
        k -= 1
    run = math.prod(chunk.sizes[k:])
    base = sum(o * s for o, s in zip(chunk.offsets, stride))
    return run, RunStarts(base, chunk.sizes[:k], stride[:k])


def row_starts(runs: Runs, width: int, first: int, count: int) -> list[int]:
    """The tensor element where each of ``count`` rows of a 2-D chunk ``width`` elements
    wide begins, from row ``first``; ``runs`` are the chunk's (:func:`chunk_runs`: one run,
    or one per row, so a row never straddles two)."""
    run, starts = runs
    return [starts[row * width // run] + row * width % run for row in range(first, first + count)]


def boxes(shape: Sequence[int], max_elements: int) -> Iterator[tuple[tuple[int, ...],
                                                                     tuple[int, ...]]]:
    """Cut a tensor into boxes of at most ``max_elements`` elements (or one innermost
    element's worth, if less), each a contiguous run of its row-major elements, in order.

    Yields:
        ``(offsets, sizes)`` of each box. A tensor with no elements yields nothing.
    """
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return
    if not shape:
        yield (), ()
        return
    # The outermost dim whose trailing block fits: boxes take a range of it, every index
    # of the dims after it, and one index of each dim before it.
    dim = next(d for d in range(len(shape)) if math.prod(shape[d + 1:]) <= max_elements)
    inner = math.prod(shape[dim + 1:])
    step = max(1, max_elements // inner)
    for lead in itertools.product(*map(range, shape[:dim])):  # row-major, no recursion
        for start in range(0, shape[dim], step):
            size = min(step, shape[dim] - start)
            yield lead + (start,) + (0,) * len(shape[dim + 1:]), \
                (1,) * dim + (size,) + shape[dim + 1:]


def tiles(shape: Sequence[int], stride: Sequence[int], span_max: int,
          numel_max: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut a strided tensor into boxes that each span and hold few enough elements.

    A box's span is the distance, in elements of the storage, from its first
    stored element to its last (plus one). Boxes come in row-major order of
    their corners where the layout allows, and together cover every element once.

    Args:
        shape, stride: the tensor's shape and strides, in elements.
        span_max: the most storage elements one box may span (at least 1).
        numel_max: the most elements one box may hold (at least 1).

    Yields:
        ``(offsets, sizes)`` of each non-empty box.
    """
    ndim = len(shape)
    stack = [((0,) * ndim, tuple(shape))]
    while stack:
        offsets, sizes = stack.pop()
        numel = math.prod(sizes)
        if numel == 0:
            continue
        reach = [(s - 1) * abs(st) for s, st in zip(sizes, stride)]
        span = 1 + sum(reach)
        if span <= span_max and numel <= numel_max:
            yield offsets, sizes
            continue
        cuttable = [d for d in range(ndim) if sizes[d] > 1]
        if span > span_max:
            # Cutting the dim with the widest step shrinks the span most; a transposed
            # chunk is cut across its stored rows, not along them.
            d = max(cuttable, key=lambda k: abs(stride[k]))
            rest = span - reach[d]
            piece = (span_max - rest) // abs(stride[d]) + 1 if rest < span_max else 1
        else:
            d = cuttable[0]  # the outermost: boxes stay whole rows, written in one piece
            piece = max(1, numel_max // (numel // sizes[d]))
        parts = []
        for start in range(0, sizes[d], piece):
            part = list(sizes)
            part[d] = min(piece, sizes[d] - start)
            corner = list(offsets)
            corner[d] += start
            parts.append((tuple(corner), tuple(part)))
        stack.extend(reversed(parts))
