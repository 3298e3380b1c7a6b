"""A chunk stored in another dim order (a permuted view ``torch.save`` kept with its strides,
dim 0 not outermost in storage: a 3-D weight saved as ``w.permute(1, 0, 2)`` of a
contiguous one): placed in boxes of whole output rows, each box's stored runs read together
and reordered in memory, then written in a few large pieces.

Tiles whose stored bytes are one contiguous span (``_copy._place_tiled``) write such a
chunk's output in small scattered pieces (for 1 GiB of ``(1024, 64, 1024)`` float32 stored
``(64, 1024, 1024)``: 65,000 writes of 12 KiB, 2.0 s against 0.9 s for the plain merge of
the same bytes). Here a box is a range of output rows whose storage is many runs (64 of
256 KiB there), read in one batch (:mod:`fsdpckpt._io.batched`): reads scattered in the
page cache cost little, writes scattered through it a lot. The reads leave storage order,
so the caller checks the storage whole beside them, as for column-major tiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fsdpckpt._io import batched
from fsdpckpt._io.rawio import ReadAt, pread_into
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.merging import _casts

__all__ = ["box_rows", "box_runs", "compact_strides", "dense_order", "read_box"]

#: The shortest stored run, in bytes, for which boxes of whole rows pay: shorter, a box's
#: reads cost more per byte than the scattered writes they save.
_MIN_RUN = 4096


def dense_order(shape: Sequence[int], stride: Sequence[int]) -> list[int] | None:
    """The dims of size over 1, innermost in storage first, where the layout is a dense
    permutation of a contiguous one (each such dim's stride the product of the sizes inside
    it); else None (an expanded or gapped view)."""
    dims = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: stride[d])
    expected = 1
    for d in dims:
        if stride[d] != expected:
            return None
        expected *= shape[d]
    return dims


def box_rows(raw: RawTensor, out: DType, budget: int) -> int:
    """How many rows of dim 0 one box holds (``budget`` bytes at most, stored or made), or 0
    where boxes of whole rows do not pay: a layout that is not a dense permutation, dim 0
    outermost in storage already (tiles read such boxes as one span), a row over the
    budget, or stored runs under :data:`_MIN_RUN` bytes."""
    shape, stride = raw.shape, raw.stride
    order = dense_order(shape, stride) if len(shape) >= 2 and _casts._numpy() is not None else None
    if not order or order[-1] == 0 or 0 not in order or 0 in shape:
        return 0
    row = math.prod(shape[1:]) * max(raw.dtype.itemsize, out.itemsize)
    if row > budget:
        return 0
    rows = min(shape[0], budget // row)
    run, _ = _run(shape, stride, rows, order)  # its length only: no starts built to decide
    return rows if run * raw.dtype.itemsize >= _MIN_RUN else 0


def _run(shape: Sequence[int], stride: Sequence[int], rows: int,
         order: Sequence[int]) -> tuple[int, int]:
    """The elements of one stored run of a box of ``rows`` rows, and how many of ``order``'s
    dims (innermost first) it spans."""
    run, inner = 1, 0
    for d in order:  # innermost first: dims that continue the run
        if stride[d] != run:
            break
        size = rows if d == 0 else shape[d]
        run *= size
        inner += 1
        if size != shape[d]:  # a part of this dim: the next one's stride is not ``run``
            break
    return run, inner


def box_runs(shape: Sequence[int], stride: Sequence[int], first: int, rows: int,
             order: Sequence[int]) -> tuple[int, Any]:
    """The stored runs of the box of rows ``first .. first + rows`` of dim 0 (every other dim
    whole), in storage order: ``(elements per run, numpy array of each run's first element,
    from the chunk's first)``.

    Args:
        order: :func:`dense_order` of the layout.
    """
    np = _casts._numpy()
    sizes = [rows if d == 0 else shape[d] for d in range(len(shape))]
    run, inner = _run(shape, stride, rows, order)
    starts = np.zeros(1, dtype=np.int64)
    for d in order[inner:]:  # outward: each outer dim repeats the starts inside it
        steps = np.arange(first, first + rows, dtype=np.int64) if d == 0 else \
            np.arange(sizes[d], dtype=np.int64)
        starts = (steps[:, None] * stride[d] + starts[None, :]).reshape(-1)
    if 0 in order[:inner]:  # dim 0 inside a run: the box starts ``first`` rows in
        starts = starts + first * stride[0]
    return run, starts


def compact_strides(sizes: Sequence[int], order: Sequence[int]) -> list[int]:
    """Strides, in elements, of a box of ``sizes`` read run after run in storage order into
    one buffer (``order``: its dims of size over 1, innermost first)."""
    strides, step = [0] * len(sizes), 1
    for d in order:
        strides[d] = step
        step *= sizes[d]
    return strides


def read_box(src: int | ReadAt, raw: RawTensor, buffer: memoryview, run: int, starts: Any,
             *, source: str) -> None:
    """Read the box's runs (``starts`` from :func:`box_runs`) one after another into
    ``buffer``: batched from a local file, one read each from anything else."""
    size = raw.dtype.itemsize
    offsets = raw.storage_start + (raw.storage_offset + starts) * size
    if isinstance(src, int):
        batched.read_pieces(src, buffer, range(0, len(starts) * run * size, run * size),
                            [run * size] * len(starts), offsets, source=source)
        return
    for k, offset in enumerate(offsets.tolist()):
        pread_into(src, buffer[k * run * size:(k + 1) * run * size], offset, source=source)
