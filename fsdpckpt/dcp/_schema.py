"""The schema of a DCP ``.metadata``: its bytes to :class:`~fsdpckpt.dcp.metadata.DcpMetadata`.

The pickle is read through the allowlist (:mod:`fsdpckpt.dcp._fast_pickle`), then every
field is checked against the schema below and converted; :mod:`fsdpckpt.dcp.reader` reads
the file and keeps one parse per process.
"""

from __future__ import annotations

from typing import Any

from fsdpckpt._torch import DCP_METADATA_MODULE, STORAGE_INFO
from fsdpckpt.dcp._allowlist import (
    METADATA_GLOBALS,
    STORAGE_INFO_KIND,
    DTypeGlobal,
    Record,
    Size,
    brief,
)
from fsdpckpt.dcp._bulk import paused_gc
from fsdpckpt.dcp._fast_pickle import fast_loads
from fsdpckpt.dcp._zstd import check_transforms
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import Chunk, DcpMetadata, KeyPath, ObjectEntry, TensorEntry
from fsdpckpt.errors import NotACheckpointError

__all__ = ["chunk_budget", "parse_metadata"]


# -- the schema of a DCP .metadata -------------------------------------------------------
#
# Every field is checked for type and range before it is used: a damaged or crafted file
# then fails with one NotACheckpointError naming the file and the entry, never with a
# TypeError or AttributeError from deep inside. Integers are bounded by int64, as torch's
# own sizes and offsets are.

_INT64 = 2**63


class _SchemaError(Exception):
    """What is wrong with one field; :func:`parse_metadata` adds the file and the advice."""


def _fields(record: Any, kind: str, where: str) -> dict[str, Any]:
    """The pickled fields of a ``kind`` record (its state dict, or dict and slots merged)."""
    if not (isinstance(record, Record) and type(record).kind == kind):
        raise _SchemaError(f"{where} is a {_kind(record)}, not a {kind}")
    state = getattr(record, "state", None)
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and \
            (state[0] is None or isinstance(state[0], dict)):
        state = {**(state[0] or {}), **state[1]}
    if state is None:
        state = {}
    if not isinstance(state, dict):
        raise _SchemaError(f"{where} ({kind}) holds a {_kind(state)} where its fields belong")
    return state


def _kind(value: Any) -> str:
    return type(value).kind if isinstance(value, Record) else type(value).__name__


def _int(value: Any, where: str) -> int:
    if not (type(value) is int and 0 <= value < _INT64):
        raise _SchemaError(f"{where} is {brief(value)}, not an integer in 0..2**63-1")
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise _SchemaError(f"{where} is {brief(value)}, not a tuple of integers")
    ints = tuple(value)
    # The common case in one pass of C-level checks; the slow path names the culprit.
    if all(type(v) is int for v in ints) and (not ints or (min(ints) >= 0 and max(ints) < _INT64)):
        return ints
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(ints))


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _SchemaError(f"{where} is {brief(value)}, not a string")
    return value


def _dict(value: Any, where: str, optional: bool = False) -> dict[Any, Any]:
    if value is None and optional:
        return {}
    if type(value) is not dict:
        raise _SchemaError(f"{where} is {brief(value)}, not a dict")
    return value


def _list(value: Any, where: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _SchemaError(f"{where} is {brief(value)}, not a list")
    return value


def _key_path(value: Any, where: str) -> KeyPath:
    path = tuple(_list(value, where))
    for i, key in enumerate(path):
        if type(key) is not str:
            _int(key, f"{where}[{i}]")
    return path


def _dtype(props: Any, where: str) -> DType:
    # TensorProperties pickles its fields as a tuple (dtype first) since torch 2.0.
    if not (isinstance(props, Record) and type(props).kind == "TensorProperties"):
        raise _SchemaError(f"{where} is a {_kind(props)}, not a TensorProperties")
    state = getattr(props, "state", None)
    dtype = state[0] if isinstance(state, tuple) and state else \
        state.get("dtype") if isinstance(state, dict) else None
    if isinstance(dtype, DTypeGlobal):
        dtype = dtype.dtype
    if not isinstance(dtype, DType):
        raise _SchemaError(f"{where} has no recognizable dtype ({brief(dtype)})")
    return dtype


_Location = tuple[str, int, int, tuple[str, ...]]


def _location(index: Any, info: Any) -> tuple[tuple[str, tuple[int, ...] | None], _Location]:
    """One ``storage_data`` entry, every field checked, every message naming it."""
    if not (isinstance(index, Record) and type(index).kind == "MetadataIndex" and
            isinstance(info, Record) and type(info).kind == STORAGE_INFO_KIND):
        raise _SchemaError(
            "storage entries are not file locations; this folder was not written by "
            "FileSystemWriter (e.g. HuggingFaceStorageWriter), which is not supported")
    key = _fields(index, "MetadataIndex", "a storage index")
    fqn = _str(key.get("fqn"), "a storage index's fqn")
    where = f"the storage entry of {brief(fqn)}"
    offsets = key.get("offset")
    fields = _fields(info, STORAGE_INFO_KIND, where)
    try:
        transforms = check_transforms(fields.get("transform_descriptors"))
    except ValueError as exc:
        raise _SchemaError(f"{where} {exc}") from None
    return (fqn, None if offsets is None else _ints(offsets, f"{where}: offset")), (
        _str(fields.get("relative_path"), f"{where}: relative_path"),
        _int(fields.get("offset"), f"{where}: offset"),
        _int(fields.get("length"), f"{where}: length"),
        transforms,
    )


_INDEX_CLASS = METADATA_GLOBALS[(DCP_METADATA_MODULE, "MetadataIndex")]
_INFO_CLASS = METADATA_GLOBALS[STORAGE_INFO]
_CHUNK_CLASS = METADATA_GLOBALS[(DCP_METADATA_MODULE, "ChunkStorageMetadata")]


_INTS = {int}


def _plain_ints(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of int64-range integers, or None to take the checked path."""
    if type(value) is not Size and type(value) is not tuple:
        return None
    ints = tuple(value)
    if _INTS.issuperset(map(type, ints)) and (not ints or (min(ints) >= 0 and
                                                           max(ints) < _INT64)):
        return ints
    return None


def _locations(storage: dict[Any, Any]) -> dict[tuple[str, tuple[int, ...] | None], _Location]:
    """``(fqn, chunk offsets or None) -> (file, offset, length, transforms)`` from
    ``storage_data``. Entries are emptied from ``storage`` as they are read (the records go
    as soon as they are converted); those of the usual form skip building the messages
    :func:`_location` would name them with."""
    locations: dict[tuple[str, tuple[int, ...] | None], _Location] = {}
    index_class, info_class, top = _INDEX_CLASS, _INFO_CLASS, _INT64
    while storage:
        index, info = storage.popitem()
        key, fields = getattr(index, "state", None), getattr(info, "state", None)
        if type(index) is index_class and type(info) is info_class and \
                type(key) is dict and type(fields) is dict:
            fqn, offsets = key.get("fqn"), key.get("offset")
            file, offset = fields.get("relative_path"), fields.get("offset")
            length, transforms = fields.get("length"), fields.get("transform_descriptors")
            ints = None if offsets is None else _plain_ints(offsets)
            if type(fqn) is str and type(file) is str and type(offset) is int and \
                    type(length) is int and 0 <= offset < top and 0 <= length < top \
                    and (offsets is None or ints is not None) and not transforms:
                locations[(fqn, ints)] = (file, offset, length, ())
                continue
        where, location = _location(index, info)
        locations[where] = location
    return locations


def _chunk(fqn: str, i: int, chunk: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One chunk's ``(offsets, sizes)``, every field checked, every message naming it."""
    at = f"tensor {brief(fqn)}: chunk {i}"
    chunk_fields = _fields(chunk, "ChunkStorageMetadata", at)
    offsets = _ints(chunk_fields.get("offsets"), f"{at}: offsets")
    sizes = _ints(chunk_fields.get("sizes"), f"{at}: sizes")
    if len(offsets) != len(sizes):
        raise _SchemaError(f"{at} has {len(offsets)} offsets but {len(sizes)} sizes")
    return offsets, sizes


#: Chunks a ``.metadata`` may list: a floor, plus one per this many of its bytes. torch
#: writes a chunk and its storage entry in 160 to 740 bytes (a simulated 256-rank 70B run:
#: 168); a pickle's memo makes a chunk listed again cost 2 bytes, so 2 million copies of
#: one fit in 4 MB and would be built, and checked for overlaps, one by one.
_CHUNK_FLOOR = 4096
_BYTES_PER_CHUNK = 16


def chunk_budget(nbytes: int) -> int:
    """How many chunks, all tensors together, a ``.metadata`` of ``nbytes`` may list."""
    return _CHUNK_FLOOR + nbytes // _BYTES_PER_CHUNK


def _tensor(fqn: str, entry: Any, locations: dict[Any, _Location],
            key_path: KeyPath, budget: list[int]) -> TensorEntry:
    """One tensor's entry; ``budget[0]``, the chunks the file may still list, goes down by
    its chunks, counted before any is built."""
    where = f"tensor {brief(fqn)}"
    fields = _fields(entry, "TensorStorageMetadata", where)
    shape = _ints(fields.get("size"), f"{where}: size")
    listed = _list(fields.get("chunks"), f"{where}: chunks")
    budget[0] -= len(listed)
    if budget[0] < 0:
        raise _SchemaError(f"{where} lists {len(listed)} chunks, more than a .metadata of "
                           f"this size describes (at most {budget[1]} chunks in all)")
    chunks = []
    plain_types, chunk_class, top = _INTS.issuperset, _CHUNK_CLASS, _INT64
    missing, get = (None, 0, 0, ()), locations.get
    for i, chunk in enumerate(listed):
        state = getattr(chunk, "state", None)
        if type(chunk) is chunk_class and type(state) is dict:
            offsets, sizes = state.get("offsets"), state.get("sizes")
            if type(offsets) is Size and type(sizes) is Size and len(offsets) == len(sizes):
                both = offsets + sizes  # one check of both (a plain tuple)
                if plain_types(map(type, both)) and (not both or (min(both) >= 0 and
                                                                  max(both) < top)):
                    offsets = both[:len(sizes)]
                    chunks.append(Chunk(offsets, both[len(sizes):],
                                        *get((fqn, offsets), missing)))
                    continue
        offsets, sizes = _chunk(fqn, i, chunk)
        chunks.append(Chunk(offsets, sizes, *get((fqn, offsets), missing)))
    dtype = _dtype(fields.get("properties"), f"{where}: properties")
    return TensorEntry(fqn, dtype, shape, tuple(chunks), key_path)


def _parse(root: Any, nbytes: int) -> DcpMetadata:
    """Check ``root`` (the unpickled stand-ins of ``nbytes`` of pickle) against the schema
    and convert it."""
    fields = _fields(root, "Metadata", "the root")
    entries = _dict(fields.get("state_dict_metadata"), "state_dict_metadata")
    storage = _dict(fields.get("storage_data"), "storage_data", optional=True)
    planner = _dict(fields.get("planner_data"), "planner_data", optional=True)
    meta = fields.get("storage_meta")
    if meta is not None:
        _fields(meta, "StorageMeta", "storage_meta")
    version = fields.get("version")
    if version is not None:
        _str(version, "version")
    if storage and (storage is entries or storage is planner) or (entries and entries is planner):
        # Read destructively below (each record freed once converted): three dicts.
        raise _SchemaError("state_dict_metadata, storage_data and planner_data are not three "
                           "separate dicts")
    locations = _locations(storage)
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    budget = [chunk_budget(nbytes)] * 2  # what is left, and the whole
    for fqn in list(entries):
        entry = entries.pop(fqn)  # its records go once converted
        if type(fqn) is not str:
            _str(fqn, "a state_dict_metadata key")
        planned = planner.get(fqn)
        key_path = _key_path(planned, f"planner_data[{brief(fqn)}]") if planned else \
            tuple(fqn.split("."))
        if isinstance(entry, Record) and type(entry).kind == "BytesStorageMetadata":
            file, offset, length, transforms = locations.get((fqn, None), (None, 0, 0, ()))
            objects.append(ObjectEntry(fqn, file, offset, length, key_path, transforms))
        elif isinstance(entry, Record) and type(entry).kind == "TensorStorageMetadata":
            tensors.append(_tensor(fqn, entry, locations, key_path, budget))
        else:
            raise _SchemaError(f"entry {brief(fqn)} has an unknown storage kind "
                               f"({_kind(entry)})")
    return DcpMetadata(tuple(tensors), tuple(objects), version)


def parse_metadata(data: bytes, *, source: str) -> DcpMetadata:
    """Turn the bytes of a ``.metadata`` file into a :class:`DcpMetadata`.

    Args:
        data: the file's bytes.
        source: the file's path, for messages.

    Returns:
        The metadata as plain values.

    Raises:
        NotACheckpointError: the bytes are not a DCP metadata pickle.
        UnsafePickleError: the pickle names a global outside the allowlist.
    """
    if not data:
        raise NotACheckpointError(f"{source}: the file is empty; the save did not finish.")
    with paused_gc():
        return _checked_parse(data, source)


def _checked_parse(data: bytes, source: str) -> DcpMetadata:
    root = fast_loads(data, allowed=METADATA_GLOBALS, source=source)
    if not (isinstance(root, Record) and type(root).kind == "Metadata"):
        raise NotACheckpointError(
            f"{source}: holds a {_kind(root)}, not DCP checkpoint metadata."
        )
    try:
        return _parse(root, len(data))
    except _SchemaError as exc:
        raise NotACheckpointError(
            f"{source}: {exc}; the file is damaged, crafted, or from an unsupported torch "
            "version: use an intact copy of the checkpoint."
        ) from None
    except (RecursionError, MemoryError) as exc:  # a key too deeply nested to hash, say
        raise NotACheckpointError(f"{source}: not readable DCP metadata "
                                  f"({type(exc).__name__})") from None
