"""Where a stored chunk's elements land in its row-major output tensor: runs of
consecutive elements, computed from the metadata's offsets and sizes alone."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from fsdpckpt.dcp.metadata import Chunk

__all__ = ["RunStarts", "chunk_runs", "Runs", "boxes"]

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
