"""Where a rank's pieces of a model's state lie in the full tensors, and filling them from a file.

A value of ``get_model_state_dict`` is a DTensor (FSDP2, tensor parallel: its local tensor is
one box of the full tensor, placed as DCP places it), a ShardedTensor (FSDP1: its local
shards, each a box) or a plain tensor (DDP, a plain module: the whole). :func:`fill` reads
exactly the elements of one box from the weight's file, in boxes of at most
:data:`BOX_BYTES`, cast to the piece's dtype exactly as ``Tensor.to`` casts (the merge's
copy engine: :func:`~fsdpckpt.merging._copy.place_chunk`), straight into the memory of a
contiguous CPU piece (through a scratch box and ``copy_`` for a GPU or strided one): memory
holds at most one box beside the rank's own shards, however large the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from fsdpckpt._io.rawio import scratch
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp.dtypes import DTYPES, DType
from fsdpckpt.dcp.metadata import Chunk
from fsdpckpt.errors import OptionError
from fsdpckpt.merging._copy import MemorySink, place_chunk
from fsdpckpt.merging._runs import boxes, chunk_runs
from fsdpckpt.training._pretrained_source import OpenFiles, Stored

__all__ = ["BOX_BYTES", "Piece", "local_pieces", "dtype_of", "fill", "same_values"]

#: The most bytes of one box read (and of its cast) at once.
BOX_BYTES = 32 * 2**20

#: ``(local tensor, its offsets in the full tensor)``.
Piece = tuple[Any, tuple[int, ...]]


def dtensor_box(key: str, value: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where this rank's local tensor of the DTensor ``value`` lies in the full tensor:
    ``(offsets, sizes)``, or None where this rank holds none of it.

    DCP's own answer (``__create_chunk_list__``, what ``dcp.save`` records), so a box here is
    where DCP puts it, ``_StridedShard`` (FSDP over tensor parallel) included.

    Raises:
        OptionError: a local tensor that is not one box of the full tensor.
    """
    chunks = value.__create_chunk_list__()
    if not chunks:
        return None
    local = value.to_local()
    if len(chunks) > 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise OptionError(f"model key '{key}': a DTensor whose local tensor is not one "
                          f"box of the full tensor (placements {value.placements}).")
    return tuple(chunks[0].offsets), tuple(chunks[0].sizes)


def local_pieces(key: str, value: Any) -> list[Piece]:
    """This rank's pieces of the state-dict value ``value`` (key ``key``) and where each
    starts in the full tensor.

    Raises:
        OptionError: a DTensor placed so that its local tensor is not a box of the full
            tensor (``Partial``), or a piece still on the meta device.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if any(p.is_partial() for p in value.placements):
            raise OptionError(f"model key '{key}': a DTensor placed as {value.placements}, "
                              "whose local tensors are partial values to be reduced, not "
                              "pieces of the weight; load before wrapping it so.")
        local = value.to_local()
        box = dtensor_box(key, value) if local.numel() else None
        pieces = [(local, box[0])] if box else []
    elif callable(getattr(value, "local_shards", None)):
        pieces = [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    else:
        pieces = [(value, (0,) * value.dim())]
    if any(t.is_meta for t, _ in pieces):
        raise OptionError(f"model key '{key}' is on the meta device: it has no memory to load "
                          "into. Call model.to_empty(device=...) after wrapping, then "
                          "load_pretrained.")
    return pieces


def dtype_of(tensor: Any) -> str:
    """The torch name of a tensor's dtype (``bfloat16``)."""
    return str(tensor.dtype).removeprefix("torch.")


def _read_boxes(shape: tuple[int, ...], offsets: tuple[int, ...], stored: Stored,
                out: DType, files: OpenFiles, slot: str, box_bytes: int,
                into: memoryview | None = None,
                ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], memoryview]]:
    """The elements of the box ``offsets``/``shape`` of ``stored``, cast to ``out``, in boxes
    of at most ``box_bytes``: ``(where in the box, sizes, the bytes)``. The bytes land in
    ``into`` (the whole box's memory, row-major) at their place, else in the scratch
    ``slot`` (valid until the next box)."""
    raw = stored.raw
    src, source = files.src(stored.file), f"{stored.file} (tensor at {list(offsets)})"
    per_box = max(1, box_bytes // max(raw.dtype.itemsize, out.itemsize))
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for at, sizes in boxes(shape, per_box):
        first = [o + a for o, a in zip(offsets, at)]
        # The box as a strided view of the file's storage: the copy engine reads its runs.
        skip = sum(f * s for f, s in zip(first, raw.stride))
        box = RawTensor(raw.storage_start, raw.storage_nbytes, raw.dtype,
                        raw.storage_offset + skip, sizes, raw.stride)
        chunk = Chunk((0,) * len(sizes), sizes, None, 0, 0)
        nbytes = math.prod(sizes) * out.itemsize
        if into is not None:  # each box is one run of the whole box's row-major elements
            start = sum(a * s for a, s in zip(at, strides)) * out.itemsize
            buffer = into[start:start + nbytes]
        else:
            buffer = scratch(nbytes, slot)
        place_chunk(src, box, chunk, chunk_runs(sizes, chunk), out, MemorySink(buffer), 0,
                    source=source)
        yield at, sizes, buffer


def _memory_of(tensor: Any) -> memoryview | None:
    """The bytes of a contiguous CPU tensor, to be written in place; None for any other
    (a GPU's, a strided one), which is filled through a scratch buffer."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return None
    import ctypes

    array = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(
        tensor.data_ptr())
    return memoryview(array).cast("B")


def fill(piece: Piece, stored: Stored, files: OpenFiles, *, box_bytes: int = BOX_BYTES) -> None:
    """Read the elements of ``piece`` (a local tensor at its offsets) from ``stored``, cast
    to the piece's dtype as ``Tensor.to`` casts, and put them in; one box at a time, read
    straight into the memory of a contiguous CPU tensor.

    Raises:
        CorruptCheckpointError: the file ends early.
    """
    import torch

    tensor, offsets = piece
    out, memory = DTYPES[dtype_of(tensor)], _memory_of(tensor)
    for at, sizes, buffer in _read_boxes(tuple(tensor.shape), offsets, stored, out, files,
                                         "pretrained", box_bytes, memory):
        if memory is None:
            made = torch.frombuffer(buffer, dtype=tensor.dtype, count=math.prod(sizes))
            tensor[tuple(slice(a, a + s) for a, s in zip(at, sizes))].copy_(made.view(sizes))


def same_values(pieces: list[Piece], a: Stored, b: Stored, files: OpenFiles, *,
                box_bytes: int = BOX_BYTES // 2) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes (same dtype) over this rank's ``pieces``,
    read box by box side by side (two tied names of one parameter)."""
    if a.raw.dtype != b.raw.dtype:
        return False
    for tensor, offsets in pieces:
        shape = tuple(tensor.shape)
        left = _read_boxes(shape, offsets, a, a.raw.dtype, files, "tie-a", box_bytes)
        right = _read_boxes(shape, offsets, b, b.raw.dtype, files, "tie-b", box_bytes)
        if any(x[2] != y[2] for x, y in zip(left, right)):
            return False
    return True
