"""The plan of ``save_pretrained``: which files, which tensors at which offsets, and which
bytes this rank writes, from the model's sharded state's metadata alone (no tensor data).

The files are export-hf's own (:func:`~fsdpckpt.merging.plan.computed_plan`: the same
shard split, names and index; :meth:`~fsdpckpt.formats.safetensors.SafetensorsFormat.
layout`: the same header bytes and offsets), so a model saved here and a ``save_state`` of
it exported by ``export-hf`` are byte for byte the same files. What this rank writes of each
tensor is a list of boxes of the global tensor (:class:`~fsdpckpt.dcp.metadata.Chunk`:
offsets and sizes), each from one of its local tensors: its own shards, and of a value held
by several ranks (a replicated DTensor, a plain tensor under DDP) only where it is the
designated writer, so every byte of a file is written by exactly one rank. The tensors come
in the order a ``save_state`` of the model lists them in (:func:`dcp_order`), export-hf's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt.dcp.dtypes import DType, dtype_from_name
from fsdpckpt.dcp.metadata import Chunk
from fsdpckpt.errors import MergePlanError
from fsdpckpt.export._moe import Piece
from fsdpckpt.formats import TensorSpec
from fsdpckpt.formats._shards import index_bytes
from fsdpckpt.merging.plan import MergePlan, computed_plan, no_metadata, parse_dtype, parse_size
from fsdpckpt.training._pretrained_read import dtensor_box

__all__ = ["SavedTensor", "SavedFile", "SavePlan", "owned_boxes", "plan_save", "cut",
           "exported_dtype_name", "held_chunks", "dcp_order"]

#: A chunk a rank holds: ``(key, offsets, bytes)``.
HeldChunk = tuple[str, tuple[int, ...], int]


@dataclass(frozen=True)
class SavedTensor:
    """One tensor of the output.

    Attributes:
        key: its key in the model's state dict. name: its Hugging Face name.
        shape: the global shape. dtype: the dtype written.
        boxes: the parts of it this rank writes, each ``(local, box)``: the index of the
            local tensor (:func:`local_tensors`) and the box of the global tensor it holds;
            empty where other ranks write all of it.
        whole, at, grid: for a piece of a model tensor (a hub tensor cut from it,
            :mod:`fsdpckpt.training._save_moe`): that tensor's own plan, where the piece's
            box starts in it and its sizes there; ``boxes`` are then boxes of ``grid``,
            each the part of the local tensor's box inside the piece.
    """

    key: str
    name: str
    shape: tuple[int, ...]
    dtype: DType
    boxes: tuple[tuple[int, Chunk], ...]
    whole: SavedTensor | None = None
    at: tuple[int, ...] = ()
    grid: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SavedFile:
    """One safetensors file: its name, size, header, and its tensors with where each
    tensor's bytes start, in file order."""

    name: str
    size: int
    header: bytes
    tensors: tuple[tuple[SavedTensor, int], ...]


@dataclass(frozen=True)
class SavePlan:
    """Everything ``save_pretrained`` writes of the weights.

    Attributes:
        files: the safetensors files. index: the index file's name and bytes (None: one
            file). merge: export-hf's plan of the same files (names, split, index).
        dtype_name: the dtype the config names (:func:`exported_dtype_name`).
    """

    files: tuple[SavedFile, ...]
    index: tuple[str, bytes] | None
    merge: MergePlan
    dtype_name: str

    @property
    def tensor_bytes(self) -> int:
        return self.merge.tensor_bytes

    @property
    def num_tensors(self) -> int:
        return self.merge.num_tensors


def _dtype_of(value: Any, key: str) -> DType:
    dtype = dtype_from_name(str(value.dtype))
    if dtype is None or dtype.safetensors is None:
        raise MergePlanError(f"{key}: safetensors has no type for {value.dtype}; leave it out "
                             "of the model's state dict")
    return dtype


def local_tensors(value: Any) -> list[Any]:
    """The tensors this rank holds of ``value``: a DTensor's local tensor, a ShardedTensor's
    local shards, a plain tensor itself."""
    if hasattr(value, "to_local"):
        return [value.to_local()]
    if hasattr(value, "local_shards"):
        return [shard.tensor for shard in value.local_shards()]
    return [value]


def _box(offsets: Sequence[int], sizes: Sequence[int]) -> Chunk:
    return Chunk(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes), None, 0, 0)


def owned_boxes(key: str, value: Any, rank: int) -> tuple[tuple[int, Chunk], ...]:
    """The boxes of ``value`` (a state-dict value) this rank writes, each with the index of
    the local tensor that holds it.

    A DTensor: this rank's box, as DCP places it (``_pretrained_read.dtensor_box``),
    written only by the ranks at coordinate 0 of every mesh dimension it is replicated over.
    A ShardedTensor (FSDP1): each local shard, unless a lower rank holds the same box.
    A plain tensor (DDP, a plain module, FSDP2's unsharded buffers): rank 0.

    Raises:
        MergePlanError: a DTensor with a ``Partial`` placement (not reduced yet).
    """
    if hasattr(value, "device_mesh"):
        mesh, placements = value.device_mesh, value.placements
        if any(p.is_partial() for p in placements):
            raise MergePlanError(f"{key}: a DTensor with a Partial placement ({placements}) "
                                 "holds unreduced values; redistribute it to Shard or "
                                 "Replicate before saving")
        coordinate = mesh.get_coordinate()
        if coordinate is None or any(p.is_replicate() and c != 0
                                     for p, c in zip(placements, coordinate)):
            return ()
        box = dtensor_box(key, value)
        return ((0, _box(*box)),) if box and math.prod(box[1]) else ()
    if hasattr(value, "local_shards"):
        owner: dict[tuple, int] = {}
        for meta in value.metadata().shards_metadata:
            where = (tuple(meta.shard_offsets), tuple(meta.shard_sizes))
            held = meta.placement.rank() if meta.placement is not None else 0
            owner[where] = min(owner.get(where, held), held)
        boxes = []
        for i, shard in enumerate(value.local_shards()):
            where = (tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
            if owner.get(where, rank) == rank and math.prod(where[1]):
                boxes.append((i, _box(*where)))
        return tuple(boxes)
    if rank != 0 or value.numel() == 0:
        return ()
    return ((0, _box((0,) * value.dim(), tuple(value.shape))),)


def cut(whole: SavedTensor, piece: Piece) -> SavedTensor:
    """The output tensor ``piece`` of ``whole``: this rank writes, of each of its boxes, the
    part inside the piece's box, placed in the piece's own row-major order. A whole piece
    is the tensor renamed."""
    if piece.whole and tuple(piece.shape) == whole.shape:
        return dataclasses.replace(whole, name=piece.name)
    boxes = []
    for local, box in whole.boxes:
        lo = [max(a, b) for a, b in zip(box.offsets, piece.offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in
              zip(box.offsets, box.sizes, piece.offsets, piece.sizes)]
        if all(a < b for a, b in zip(lo, hi)):
            boxes.append((local, _box([a - o for a, o in zip(lo, piece.offsets)],
                                      [b - a for a, b in zip(lo, hi)])))
    return SavedTensor(whole.key, piece.name, piece.shape, whole.dtype, tuple(boxes), whole,
                       piece.offsets, piece.sizes)


def held_chunks(state: Mapping[str, Any]) -> list[HeldChunk]:
    """The chunks of ``state`` this rank holds, as DCP's save plan lists them (each
    rank's DTensor box, replicas included; each local shard; a plain tensor whole)."""
    held: list[HeldChunk] = []
    for key, value in state.items():
        if not hasattr(value, "shape"):
            continue
        size = value.dtype.itemsize
        if hasattr(value, "device_mesh"):
            box = dtensor_box(key, value) if value.device_mesh.get_coordinate() is not None \
                else None
            if box is not None:
                held.append((key, box[0], math.prod(box[1]) * size))
        elif hasattr(value, "local_shards"):
            held += [(key, tuple(s.metadata.shard_offsets), s.tensor.numel() * size)
                     for s in value.local_shards()]
        else:
            held.append((key, (0,) * value.dim(), value.numel() * size))
    return held


def dcp_order(plans: Sequence[Sequence[HeldChunk]]) -> list[str]:
    """The order a ``dcp.save`` of this state lists its keys in (every rank's
    :func:`held_chunks`), which export-hf keeps: torch's ``dedup_save_plans`` gives each
    chunk held by several ranks to the one with the fewest bytes so far, then
    ``create_default_global_save_plan`` lists the keys rank by rank. Where every rank holds
    its own boxes (FSDP2, FSDP1, tensor parallel) this is the state dict's order; where
    ranks hold replicas (DDP, HSDP, plain buffers) it follows that balance."""
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    sizes: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, plan in enumerate(plans):
        for key, offsets, nbytes in plan:
            holders.setdefault((key, offsets), []).append(rank)
            sizes[(key, offsets)] = nbytes
    load = [0] * len(plans)
    kept: set[tuple[int, str, tuple[int, ...]]] = set()
    for item, ranks in holders.items():
        rank = min(sorted(ranks), key=lambda r: load[r])
        load[rank] += sizes[item] or 1  # as torch: an empty tensor counts one
        kept.add((rank, *item))
    order: dict[str, None] = {}
    for rank, plan in enumerate(plans):
        for key, offsets, _ in plan:
            if (rank, key, offsets) in kept:
                order.setdefault(key, None)
    return list(order)


def exported_dtype_name(tensors: Sequence[SavedTensor]) -> str:
    """The dtype the config names, as export-hf chooses it: the one most of the written
    floating-point bytes have (``float32`` when there are none)."""
    sizes: dict[str, int] = {}
    for t in tensors:
        if t.dtype.is_floating:
            sizes[t.dtype.name] = sizes.get(t.dtype.name, 0) + t.numel * t.dtype.itemsize
    # Counter.most_common's order: the largest, the first seen among equals.
    return max(sizes, key=lambda n: sizes[n]) if sizes else "float32"


def plan_save(state: Sequence[tuple[str, str, Any]], *, rank: int, dtype: Any,
              max_shard_size: str | int | None, out: Path | Any,
              skip: Callable[[str], bool] = lambda name: False,
              stem: str = "model",
              pieces: Mapping[str, tuple[Piece, ...]] | None = None) -> SavePlan:
    """Plan the weights of ``save_pretrained``.

    Args:
        state: ``(key, Hugging Face name, value)`` of every tensor, in state-dict order
            (the order ``save_state`` stores them in, which export-hf keeps).
        rank: this rank. dtype: the cast of floating-point tensors (None: as held).
        max_shard_size: the largest file, as export-hf reads it (``"5GB"``); None: one file.
        out: the output folder (named in the plan, never touched).
        skip: names left out (tied targets).
        stem: the file names' (``model``; ``adapter_model`` for a PEFT adapter).
        pieces: each name -> the tensors it is written as (the hub's,
            :func:`~fsdpckpt.training._save_moe.hub_layout`); a name not there as it is.

    Raises:
        MergePlanError: an unreadable size or dtype, a type safetensors cannot hold, two
            keys with one name, a Partial DTensor.
    """
    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    every: list[SavedTensor] = []
    tensors: list[SavedTensor] = []
    seen: dict[str, str] = {}
    for key, name, value in state:
        held = _dtype_of(value, key)
        out_dtype = cast if cast is not None and held.is_floating else held
        whole = SavedTensor(key, name, tuple(value.shape), out_dtype,
                            owned_boxes(key, value, rank) if not skip(name) else ())
        every.append(whole)
        written = [cut(whole, p) for p in (pieces or {}).get(name, ())] or [whole]
        for saved in written:
            if saved.name in seen:
                raise MergePlanError(f"{seen[saved.name]} and {key} would both be saved as "
                                     f"{saved.name}")
            seen[saved.name] = key
        tensors += written if not skip(name) else []
    if not tensors:
        raise MergePlanError("the model has no tensor to save")
    specs = [TensorSpec(t.name, (t.name,), t.dtype, t.shape) for t in tensors]
    merge = computed_plan(no_metadata(out), specs, lambda: iter(()), max_shard_size=limit,
                          stem=stem)
    by_name = {t.name: t for t in tensors}
    files = []
    for planned in merge.files:
        layout = merge.format.layout([t.spec for t in planned.tensors], [], nested=False)
        (start, header), = layout.fixed
        placed = sorted(((by_name[n], s) for n, s in layout.starts.items()), key=lambda p: p[1])
        files.append(SavedFile(planned.name, layout.size, header, tuple(placed)))
    index = (merge.index_name, index_bytes(merge.index())) if merge.index_name else None
    # As export-hf: the dtype is chosen before the tied targets are left out.
    return SavePlan(tuple(files), index, merge, exported_dtype_name(every))
