"""FSDP1's ShardedTensors in a per-rank ``torch.save`` file, parsed without torch.

FSDP1 with ``SHARDED_STATE_DICT`` (Accelerate ``use_dcp=False``) saves each parameter and
optimizer moment as a ``ShardedTensor``. ``torch.save`` pickles one as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, (global size ...), state)``
whose ``state`` is ``ShardedTensor.__getstate__``'s tuple: the rank's local shards (each a
``Shard`` of a tensor and its ``ShardMetadata``: offsets and sizes in the global tensor), the
``ShardedTensorMetadata`` of every rank's shard, the ``ProcessGroupState`` that wrote it
(reached through ``getattr(ShardedTensor, "ProcessGroupState")``), the sharding spec and a
flag.

torch allowlists none of these classes for ``weights_only`` loading (and its own
``__setstate__`` needs the writer's process group). Here each is a data-only stand-in that
keeps what it is given, ``getattr`` answers that one attribute and nothing else, and only
the offsets and sizes a shard declares are used, after checking them against its tensor and
the global shape. :mod:`fsdpckpt.dcp._perrank_file` locates the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdpckpt import _torch
from fsdpckpt.dcp._allowlist import Record, brief
from fsdpckpt.dcp._archive import _TensorRecord, is_plain_int
from fsdpckpt.errors import CorruptCheckpointError, UnsafePickleError

__all__ = ["StandIn", "SHARDED_GLOBALS", "ShardedTensorType", "ShardedValue", "sharded_value",
           "local_shards"]


class StandIn(Record):
    """A stand-in for an instance of an allowlisted class of a per-rank file (DTensor's spec
    classes, ShardedTensor's): keeps what it is given, however the pickle builds it.

    Unlike the metadata's :class:`~fsdpckpt.dcp._allowlist.Record`, it is made by
    ``__new__`` (a pickle's NEWOBJ calls no ``__init__``), so ``args`` and ``state`` are
    always there, and :meth:`field` reads its state.
    """

    kind = "?"
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> StandIn:
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __setstate__(self, state: Any) -> None:
        # A class with __slots__ pickles its state as ``(None, {slot: value})``.
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None and \
                isinstance(state[1], dict):
            state = state[1]
        self.state = state

    def field(self, name: str) -> Any:
        return self.state.get(name) if isinstance(self.state, dict) else None


class ShardedTensorType:
    """The stand-in for the ShardedTensor class itself."""


_PROCESS_GROUP_STATE = type("ProcessGroupState", (StandIn,), {"kind": "ProcessGroupState"})


def _getattr(owner: Any, name: Any) -> Any:
    """``getattr`` as ShardedTensor's pickle uses it: for its nested ProcessGroupState only."""
    if owner is ShardedTensorType and name == "ProcessGroupState":
        return _PROCESS_GROUP_STATE
    raise UnsafePickleError(f"refusing getattr({brief(owner)}, {brief(name)}): a ShardedTensor "
                            "pickle only asks for ShardedTensor.ProcessGroupState. The file "
                            "may be hostile; use an intact copy of the checkpoint.")


#: What a pickled ShardedTensor names, mapped to stand-ins.
SHARDED_GLOBALS: dict[tuple[str, str], Any] = {
    **{key: type(kind, (StandIn,), {"kind": kind})
       for key, kind in _torch.SHARDED_TENSOR_CLASSES.items()},
    _torch.SHARDED_TENSOR: ShardedTensorType,
    ("__builtin__", "getattr"): _getattr,
    ("builtins", "getattr"): _getattr,
}


@dataclass
class ShardedValue:
    """A ShardedTensor as pickled: its global size, and ``ShardedTensor.__getstate__``'s
    local shards, metadata and process group state, unchecked."""

    size: Any
    shards: Any
    metadata: Any
    group: Any


def sharded_value(size: Any, state: Any) -> ShardedValue:
    """A ShardedTensor from the wrapper's size and its pickled state.

    Raises:
        CorruptCheckpointError: the state is not ``ShardedTensor.__getstate__``'s 5-tuple.
    """
    if not (isinstance(state, tuple) and len(state) == 5):
        raise CorruptCheckpointError(f"a ShardedTensor whose state is {brief(state)}, not the "
                                     "5 parts torch pickles")
    return ShardedValue(size, state[0], state[1], state[2])


def _sizes(value: Any, what: str, source: str) -> tuple[int, ...]:
    if isinstance(value, list):
        value = tuple(value)
    if not (isinstance(value, tuple) and all(map(is_plain_int, value))
            and all(v >= 0 for v in value)):
        raise CorruptCheckpointError(f"{source}: {what} is not a list of sizes "
                                     f"({brief(value)}); the file is damaged.")
    return value


def local_shards(value: ShardedValue, shape: tuple[int, ...],
                 source: str) -> list[tuple[tuple[int, ...], tuple[int, ...], _TensorRecord]]:
    """The rank's local shards: ``(offsets, sizes, tensor record)`` each, checked to lie
    inside ``shape`` (the global shape the wrapper declares, which the metadata repeats).

    Raises:
        CorruptCheckpointError: a shard or the metadata is malformed, or a shard lies
            outside the global tensor.
    """
    meta = value.metadata
    if not (isinstance(meta, StandIn) and meta.kind == "ShardedTensorMetadata"):
        raise CorruptCheckpointError(f"{source}: a ShardedTensor without its metadata.")
    declared = meta.field("size")
    if _sizes(declared, "the ShardedTensor's size", source) != shape:
        raise CorruptCheckpointError(f"{source}: a ShardedTensor of size {brief(declared)} "
                                     f"in its metadata but {list(shape)} in its wrapper.")
    if not isinstance(value.shards, list):
        raise CorruptCheckpointError(f"{source}: a ShardedTensor whose local shards are "
                                     f"{brief(value.shards)}.")
    found = []
    for shard in value.shards:
        info = shard.field("metadata") if isinstance(shard, StandIn) else None
        tensor = shard.field("tensor") if isinstance(shard, StandIn) else None
        if not (isinstance(info, StandIn) and info.kind == "ShardMetadata"
                and isinstance(tensor, _TensorRecord)):
            raise CorruptCheckpointError(f"{source}: a ShardedTensor's local shard is "
                                         f"{brief(shard)}, not a tensor and its metadata.")
        offsets = _sizes(info.field("shard_offsets"), "a shard's offsets", source)
        sizes = _sizes(info.field("shard_sizes"), "a shard's sizes", source)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CorruptCheckpointError(
                f"{source}: a shard at {list(offsets)} of size {list(sizes)} does not fit the "
                f"ShardedTensor's shape {list(shape)}; the file is damaged.")
        found.append((offsets, sizes, tensor))
    return found


def world_size(value: ShardedValue) -> int:
    """The world size the writer's ProcessGroupState records (0 when it records none)."""
    group = value.group
    size = group.field("global_world_size") if isinstance(group, StandIn) else None
    return size if isinstance(size, int) and is_plain_int(size) and 0 < size < 1 << 20 else 0
