"""One per-rank ``torch.save`` file, parsed without torch: which tensors it holds and where.

The rank file's ``data.pkl`` goes through the restricted unpickler with stand-ins for exactly
the classes ``torch.distributed.tensor`` registers as safe for ``weights_only`` loading
(DTensor, DTensorSpec, TensorMeta, ShardOrderEntry, DeviceMesh and its layout, the
placements), plus the tensor rebuild functions torch's own ``weights_only`` loader allows.
No tensor byte is read: each tensor becomes the position of its elements in the zip
(:class:`~fsdpckpt.dcp._archive.RawTensor`), and each DTensor's local piece is placed in
the global tensor by its placements and the rank's mesh coordinate (torch.chunk's split).
:mod:`fsdpckpt.dcp._perrank` puts the ranks together.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from fsdpckpt import _torch
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._allowlist import BUILTIN_GLOBALS, brief, layout_name
from fsdpckpt.dcp._archive import (
    _STORAGE_GLOBALS,
    RawTensor,
    _persistent_storage,
    _rebuild_v2,
    _rebuild_v3,
    _TensorRecord,
    is_plain_int,
    locate_record,
)
from fsdpckpt.dcp._graph import is_leaf_list, measure, node_budget, tree_items
from fsdpckpt.dcp._perrank_sharded import (
    SHARDED_GLOBALS,
    ShardedTensorType,
    ShardedValue,
    StandIn,
    local_shards,
    sharded_value,
    world_size,
)
from fsdpckpt.dcp._safe_pickle import RestrictedUnpickler, safe_loads
from fsdpckpt.dcp._ziparchive import entry_info, open_archive, read_entry
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import KeyPath
from fsdpckpt.dcp.reader import open_data_file
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError

__all__ = ["RankTensor", "open_rank_file", "read_rank"]

# -- stand-ins for what a DTensor pickles ------------------------------------------------


_SPEC_CLASSES = {key: type(kind, (StandIn,), {"kind": kind})
                 for key, kind in _torch.DTENSOR_SPEC_CLASSES.items()}


class _DTensorType:
    """The stand-in for the DTensor class itself."""


class _Wrapper:
    def __init__(self, dtype: Any, size: Any) -> None:
        self.dtype, self.size = dtype, size
        self.local: Any = None
        self.spec: Any = None


def _rebuild_wrapper(cls: Any, dtype: Any, size: Any, *_: Any) -> _Wrapper:
    if cls is not _DTensorType and cls is not ShardedTensorType:
        raise CorruptCheckpointError(f"a wrapper tensor of an unexpected class {brief(cls)}")
    return _Wrapper(dtype, size)


def _rebuild_from_type(func: Any, new_type: Any, args: Any,
                       state: Any) -> _Wrapper | ShardedValue:
    if new_type is ShardedTensorType and func is _rebuild_wrapper and isinstance(args, tuple) \
            and args and args[0] is ShardedTensorType:
        return sharded_value(_rebuild_wrapper(*args).size, state)  # FSDP1's ShardedTensor
    # torch pickles a subclass's state as ``(__dict__ or None, slots dict)``.
    if isinstance(state, tuple) and len(state) == 2 and all(
            part is None or isinstance(part, dict) for part in state):
        state = {**(state[0] or {}), **(state[1] or {})}
    if func is not _rebuild_wrapper or new_type is not _DTensorType or \
            not isinstance(args, tuple) or not isinstance(state, dict):
        raise CorruptCheckpointError("a tensor subclass other than DTensor, or a damaged one")
    value = _rebuild_wrapper(*args)
    value.local, value.spec = state.get("_local_tensor"), state.get("_spec")
    return value


_GLOBALS: dict[tuple[str, str], Any] = {
    **BUILTIN_GLOBALS,
    **_STORAGE_GLOBALS,
    **_SPEC_CLASSES,
    **SHARDED_GLOBALS,
    _torch.TORCH_SIZE: lambda dims=(): tuple(dims),
    _torch.GET_LAYOUT: layout_name,
    _torch.TORCH_DEVICE: lambda *a: "device",
    _torch.DTENSOR: _DTensorType,
    _torch.REBUILD_WRAPPER_SUBCLASS: _rebuild_wrapper,
    _torch.REBUILD_FROM_TYPE_V2: _rebuild_from_type,
    _torch.REBUILD_TENSOR_V2: _rebuild_v2,
    _torch.REBUILD_TENSOR_V3: _rebuild_v3,
}


class _RankUnpickler(RestrictedUnpickler):
    """The restricted unpickler, plus the one state a module's ``state_dict()`` carries:
    its ``_metadata`` attribute (per-module version numbers), which is dropped."""

    dispatch = dict(RestrictedUnpickler.dispatch)
    builds_dicts = True  # for the shape walk: BUILD may be aimed at a dict (this one case)

    def _load_build_state_dict(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        if type(target) is dict and self._built.get(id(target)) is target and \
                isinstance(state, dict) and set(state) == {"_metadata"}:
            self.stack.pop()
            return
        RestrictedUnpickler._load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build_state_dict


# -- one rank file ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankTensor:
    """One tensor of one rank: its global shape and dtype, and where this rank's piece goes.

    ``crc`` is the CRC-32 the rank's zip directory records for the piece's storage entry (so
    pieces two ranks both hold can be compared without reading them), and ``whole`` says
    the rank stored a plain tensor (no DTensor or ShardedTensor placing it)."""

    dtype: DType
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    raw: RawTensor
    crc: int = 0
    whole: bool = False


def _ints(value: Any, what: str, source: str) -> tuple[int, ...]:
    if not (isinstance(value, tuple) and all(map(is_plain_int, value))
            and all(v >= 0 for v in value)):
        raise CorruptCheckpointError(f"{source}: {what} is not a tuple of sizes "
                                     f"({brief(value)}); the file is damaged.")
    return value


def _mesh(spec: StandIn, source: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(mesh shape, this rank's coordinate)`` of a DTensor's device mesh."""
    mesh = spec.field("mesh")
    if not isinstance(mesh, StandIn) or mesh.kind != "DeviceMesh":
        raise CorruptCheckpointError(f"{source}: a DTensor without a device mesh.")
    ranks = mesh.field("_rank_map")
    if not isinstance(ranks, _TensorRecord):  # torch < 2.9 pickled the mesh tensor itself
        ranks = mesh.field("mesh")
    if not isinstance(ranks, _TensorRecord):
        raise CorruptCheckpointError(f"{source}: a device mesh that gives no shape.")
    coordinate = mesh.field("_coordinate_on_dim")
    shape = _ints(tuple(ranks.shape) if isinstance(ranks.shape, (tuple, list)) else None,
                  "the mesh shape", source)
    coordinate = _ints(tuple(coordinate) if isinstance(coordinate, (tuple, list)) else None,
                       "the rank's mesh coordinate", source)
    if len(coordinate) != len(shape) or any(c >= s for c, s in zip(coordinate, shape)):
        raise CorruptCheckpointError(f"{source}: mesh coordinate {brief(list(coordinate))} "
                                     f"outside the mesh {brief(list(shape))}.")
    return shape, coordinate


def _place(name: str, value: _Wrapper, raw: RawTensor,
           source: str) -> tuple[tuple[int, ...], int]:
    """Where the rank's local tensor starts in the global tensor (torch.chunk's split), and
    how many ranks its mesh spans."""
    shape = _ints(value.size, f"the global shape of {brief(name, 200)}", source)
    spec = value.spec
    if not isinstance(spec, StandIn) or spec.kind != "DTensorSpec":
        raise CorruptCheckpointError(f"{source}: DTensor {brief(name, 200)} has no spec.")
    mesh_shape, coordinate = _mesh(spec, source)
    placements = spec.field("placements")
    if not isinstance(placements, tuple) or len(placements) != len(mesh_shape):
        raise CorruptCheckpointError(f"{source}: DTensor {brief(name, 200)} has placements "
                                     f"{brief(placements)} for a mesh of {len(mesh_shape)} dims.")
    offsets, sizes = [0] * len(shape), list(shape)
    for placement, parts, at in zip(placements, mesh_shape, coordinate):
        kind = getattr(placement, "kind", None)
        if kind == "Replicate":
            continue
        _refuse_placement(name, placement, source)
        dim = placement.field("dim") if kind == "Shard" else None
        if not isinstance(dim, int) or not is_plain_int(dim) or not 0 <= dim < len(shape):
            raise NotACheckpointError(
                f"{source}: DTensor {brief(name, 200)} is placed as "
                f"{kind or brief(placement)}; fsdpckpt reads Shard(dim) and Replicate() "
                "placements (FSDP2, HSDP, tensor parallel).")
        full = -(-sizes[dim] // parts)
        start = min(at * full, sizes[dim])
        offsets[dim] += start
        sizes[dim] = max(0, min(full, sizes[dim] - start))
    if tuple(sizes) != raw.shape:
        raise CorruptCheckpointError(
            f"{source}: DTensor {brief(name, 200)} holds a local tensor of shape "
            f"{brief(list(raw.shape))}, but its placements give this rank {brief(sizes)} of "
            f"{brief(list(shape))}; the file is damaged.")
    return tuple(offsets), math.prod(mesh_shape)


def _refuse_placement(name: str, placement: Any, source: str) -> None:
    """Refuse the placements whose pieces are not simply placed side by side."""
    kind = getattr(placement, "kind", None)
    if kind == "Partial":
        op = placement.field("reduce_op") or (placement.args[0] if placement.args else "sum")
        raise NotACheckpointError(
            f"{source}: DTensor {brief(name, 200)} is placed as Partial({brief(op)}): each rank "
            "holds a partial value that must be reduced across ranks, not placed, so the file "
            "alone cannot give the tensor. Save a full (or replicated) state dict instead, e.g. "
            "get_state_dict(..., options=StateDictOptions(full_state_dict=True)).")
    if kind == "_StridedShard":
        raise NotACheckpointError(
            f"{source}: DTensor {brief(name, 200)} is placed as _StridedShard(dim="
            f"{brief(placement.field('dim'))}, split_factor="
            f"{brief(placement.field('split_factor'))}) (FSDP2 over tensor parallelism): "
            "fsdpckpt does not reassemble its interleaved pieces from per-rank files. Save "
            "with DCP (Accelerate use_dcp=True, which records every piece's place) or a full "
            "state dict instead.")


def _is_branch(value: Any) -> bool:
    """As DCP's ``flatten_state_dict``: through dicts (string keys) and through lists that
    hold dicts (``param_groups``: int keys)."""
    return isinstance(value, list) and not is_leaf_list(value)


#: The last key of an FSDP1 flat parameter (``LOCAL_STATE_DICT``).
_FLAT_PARAM_NAMES = ("_flat_param", "flat_param")


@contextlib.contextmanager
def open_rank_file(folder: Place, name: str) -> Iterator[tuple[IO[bytes], int]]:
    """The rank file ``name`` of ``folder`` (by the data files' inside-the-folder rule) as a
    seekable file object and its size; on object storage, a buffered reader over ranged
    reads (its size from the listing), so only the zip's headers and ``data.pkl`` are read.

    Raises:
        NotACheckpointError: the name leads outside the folder, or is no regular file.
        CheckpointNotFoundError: the file is missing.
    """
    opened = open_data_file(folder, name)
    try:
        yield opened.file(), opened.size
    finally:
        opened.close()


def read_rank(folder: Place, name: str) -> tuple[dict[KeyPath, list[RankTensor]],
                                                list[tuple[KeyPath, Any]], int]:
    """Parse one rank file: its tensors' pieces and their places, its other values
    (decoded), and the most ranks that wrote a DTensor or ShardedTensor (0 without them).

    Raises:
        NotACheckpointError: an FSDP1 flat parameter (``LOCAL_STATE_DICT``), a placement
            that cannot be placed (``Partial``, ``_StridedShard``), or no state dict.
    """
    source = str(folder / name)
    with open_rank_file(folder, name) as (file, size), \
            open_archive(file, 0, size, source) as archive:
        pkl = entry_info(archive, "/data.pkl", source)
        prefix = pkl.filename[: -len("data.pkl")]
        storage = _persistent_storage
        data = read_entry(archive, pkl, source=source, start=0)
        value = safe_loads(data, allowed=_GLOBALS, source=source, persistent_load=storage,
                           unpickler_class=_RankUnpickler)
        if not isinstance(value, dict):
            raise NotACheckpointError(f"{source}: holds {type(value).__name__}, not a "
                                      "state dict.")
        # Once over every container (by identity), before anything walks it by its paths.
        measure(value, source=source, budget=node_budget(len(data)))
        items = tree_items(value, is_branch=_is_branch, source=source)

        crcs: dict[int, int] = {}  # storage start -> its entry's recorded CRC-32

        def locate(record: _TensorRecord, what: str) -> RawTensor:
            raw = locate_record(file, 0, size, archive, prefix, record, source=what)
            key = getattr(record.storage, "key", None)
            info = archive.NameToInfo.get(f"{prefix}data/{key}")
            crcs[raw.storage_start] = info.CRC if info is not None else 0
            return raw

        tensors: dict[KeyPath, list[RankTensor]] = {}
        others: list[tuple[KeyPath, Any]] = []
        mesh_ranks = 0
        for path, item in items:
            label = ".".join(map(str, path))
            what = f"{source} (tensor '{label}')"
            if path and path[-1] in _FLAT_PARAM_NAMES and \
                    isinstance(item, (_TensorRecord, _Wrapper, ShardedValue)):
                raise NotACheckpointError(
                    f"{source}: '{label}' is an FSDP1 flat parameter (state_dict_type="
                    "LOCAL_STATE_DICT): every parameter of a module flattened into one "
                    "padded piece per rank, and which parameter lies where is not in the "
                    "file, so it cannot be merged. Save with state_dict_type="
                    "SHARDED_STATE_DICT (or FULL_STATE_DICT) instead.")
            if isinstance(item, ShardedValue):
                shape = _ints(tuple(item.size) if isinstance(item.size, (tuple, list))
                              else None, "the global shape", what)
                pieces = []
                for offsets, sizes, record in local_shards(item, shape, what):
                    raw = locate(record, what)
                    if raw.shape != sizes:
                        raise CorruptCheckpointError(
                            f"{what}: a shard declared {brief(list(sizes))} holds a tensor "
                            f"of shape {brief(list(raw.shape))}; the file is damaged.")
                    pieces.append(RankTensor(raw.dtype, shape, offsets, raw,
                                             crcs[raw.storage_start]))
                tensors[path] = pieces
                mesh_ranks = max(mesh_ranks, world_size(item))
            elif isinstance(item, _Wrapper):
                if not isinstance(item.local, _TensorRecord):
                    raise CorruptCheckpointError(f"{what}: a DTensor without its local "
                                                 "tensor.")
                raw = locate(item.local, what)
                offsets, ranks = _place(label, item, raw, what)
                mesh_ranks = max(mesh_ranks, ranks)
                tensors[path] = [RankTensor(raw.dtype, _ints(item.size, "the global shape",
                                                         what), offsets, raw,
                                            crcs[raw.storage_start])]
            elif isinstance(item, _TensorRecord):  # a plain tensor: whole on every rank
                raw = locate(item, what)
                tensors[path] = [RankTensor(raw.dtype, raw.shape, (0,) * len(raw.shape),
                                            raw, crcs[raw.storage_start], whole=True)]
            else:
                others.append((path, item))
    return tensors, others, mesh_ranks
