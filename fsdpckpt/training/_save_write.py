"""The write stage of ``save_pretrained``: a :class:`~fsdpckpt.training._save_plan.SavePlan`
executed into a spread target (:mod:`fsdpckpt._io.spread`), each rank writing only the
bytes of its own boxes.

Each tensor is walked in windows of at most :data:`WINDOW` bytes of the output, the same
windows on every rank (so every rank calls ``step()`` as often as the others, as object
storage needs). In a window, a rank casts the elements its boxes have there, one slice of
each local tensor at a time (``Tensor.to``: the cast export-hf's is equal to), and writes
them as runs of contiguous file bytes (:func:`~fsdpckpt.merging._runs.chunk_runs`), in
increasing file order. Memory: the rank's own shards plus one window.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsdpckpt._io.spread import SpreadFile, SpreadTarget
from fsdpckpt.dcp.metadata import Chunk
from fsdpckpt.merging._runs import chunk_runs
from fsdpckpt.training._save_plan import SavedTensor, SavePlan, local_tensors

__all__ = ["WINDOW", "Elements", "write_weights", "plain_elements", "elements_of",
           "cut_elements"]

#: The most output bytes of a tensor handled at once: a window's cast buffers are at most
#: this, and each rank calls ``step()`` once per window.
WINDOW = 64 * 2**20

#: ``elements(local, start, stop)``: elements ``[start, stop)`` of this rank's local tensor
#: ``local`` of one output tensor, flat, cast to the output dtype, contiguous on the CPU.
Elements = Callable[[int, int, int], Any]


def elements_of(tensor: Any, start: int, stop: int) -> Any:
    """Elements ``[start, stop)`` of ``tensor`` in row-major order, as a 1-D tensor; a view
    of a contiguous tensor, else copied one row block at a time (never the whole tensor)."""
    tensor = tensor.detach()
    if tensor.is_contiguous():
        return tensor.reshape(-1)[start:stop]
    if tensor.dim() <= 1:
        return tensor.reshape(-1)[start:stop] if tensor.dim() == 0 else tensor[start:stop]
    import torch

    inner = math.prod(tensor.shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        return elements_of(tensor[first], start - first * inner, stop - first * inner)
    # The rows between lie inside [start, stop): their copy is no larger than the window.
    return torch.cat([elements_of(tensor[first], start - first * inner, inner),
                      tensor[first + 1:last].reshape(-1),
                      elements_of(tensor[last], 0, stop - last * inner)])


def plain_elements(value: Any, saved: SavedTensor) -> Elements:
    """The :data:`Elements` of a state-dict value as it is, cast exactly by ``Tensor.to``."""
    import torch

    locals_ = local_tensors(value)
    dtype = getattr(torch, saved.dtype.name)

    def elements(local: int, start: int, stop: int) -> Any:
        return elements_of(locals_[local], start, stop).to(dtype).cpu().contiguous()

    return elements


def cut_elements(source: Elements, saved: SavedTensor) -> Elements:
    """The :data:`Elements` of a piece of a tensor (:func:`~fsdpckpt.training._save_plan.cut`)
    from those of the whole (``source``): the part of a local tensor inside the piece, in
    the piece's row-major order, taken run by run from the local tensor's elements, so a
    window's elements are made, and cast, once (a fused LoRA weight too)."""
    import torch

    held, mine = dict(saved.whole.boxes if saved.whole else ()), dict(saved.boxes)

    def elements(local: int, start: int, stop: int) -> Any:
        box, part = held[local], mine[local]
        # The part as a box of the local tensor, which is ``box`` of the whole.
        inside = Chunk(tuple(p + a - b for p, a, b in zip(part.offsets, saved.at, box.offsets)),
                       part.sizes, None, 0, 0)
        run, starts = chunk_runs(box.sizes, inside)
        parts = []
        for i in range(start // run, (stop - 1) // run + 1):
            a, b = max(start, i * run), min(stop, (i + 1) * run)
            first = starts[i] + a - i * run
            parts.append(source(local, first, first + b - a))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return elements


def _pieces(saved: SavedTensor, runs: Sequence[tuple[int, tuple[int, Sequence[int]]]],
            lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    # (global element, local tensor, local element, count) of each run piece in [lo, hi).
    pieces = []
    for local, (run, starts) in runs:
        first = max(0, bisect_right(starts, lo) - 1)
        for i in range(first, bisect_left(starts, hi)):
            a, b = max(starts[i], lo), min(starts[i] + run, hi)
            if a < b:
                pieces.append((a, local, i * run + a - starts[i], b - a))
    pieces.sort()
    return pieces


def _write_tensor(file: SpreadFile, saved: SavedTensor, start: int,
                  elements: Elements) -> None:
    import torch

    size = saved.dtype.itemsize
    per = max(1, WINDOW // size)
    runs = [(local, chunk_runs(saved.grid or saved.shape, box)) for local, box in saved.boxes]
    for lo in range(0, saved.numel, per):
        pieces = _pieces(saved, runs, lo, min(saved.numel, lo + per))
        spans: dict[int, tuple[int, int]] = {}  # a local tensor's elements in this window
        for _, local, first, count in pieces:
            a, b = spans.get(local, (first, first + count))
            spans[local] = (min(a, first), max(b, first + count))
        data = {local: elements(local, a, b).view(torch.uint8).numpy()
                for local, (a, b) in spans.items()}
        for at, local, first, count in pieces:
            skip = (first - spans[local][0]) * size
            file.write(start + at * size, memoryview(data[local][skip:skip + count * size]))
        file.step()


def write_weights(target: SpreadTarget, plan: SavePlan, rank: int,
                  elements: Mapping[str, Callable[[SavedTensor], Elements]]) -> None:
    """Every file of ``plan`` into ``target``, this rank's bytes of each (rank 0 also the
    headers and the index); ``elements[key](saved)`` gives a tensor's :data:`Elements`."""
    for planned in plan.files:
        file = target.open(planned.name, planned.size)
        if rank == 0:
            file.write(0, planned.header)
        for saved, start in planned.tensors:
            made = elements[saved.key]
            _write_tensor(file, saved, start, made(saved) if saved.whole is None else
                          cut_elements(made(saved.whole), saved))
        file.finish()
    if plan.index is not None and rank == 0:
        target.put(*plan.index)
