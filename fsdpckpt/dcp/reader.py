"""Reading a DCP folder: its ``.metadata`` (safely) and the data files beside it.

Torch reads ``.metadata`` with a plain ``pickle.load``; here it goes through
:mod:`fsdpckpt.dcp._safe_pickle`, so a hostile file is refused and torch is never
imported. The result is the plain data model of :mod:`fsdpckpt.dcp.metadata`.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
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
from fsdpckpt.dcp._paths import METADATA_FILE, data_file_path, open_data_file, path_inside
from fsdpckpt.dcp._zstd import check_transforms
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import Chunk, DataFile, DcpMetadata, KeyPath, ObjectEntry, TensorEntry
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

__all__ = ["DcpFolder", "read_dcp_folder", "parse_metadata", "shared_parses", "is_dcp_folder", "METADATA_FILE",
           "data_file_path", "open_data_file", "path_inside"]

@dataclass(frozen=True)
class DcpFolder:
    """A DCP folder on disk: its metadata and the data files present.

    Attributes:
        path: the folder.
        metadata: what ``.metadata`` says.
        files: the ``*.distcp`` files present, sorted by name, with their sizes.
    """

    path: Place
    metadata: DcpMetadata
    files: tuple[DataFile, ...]

    @property
    def file_sizes(self) -> dict[str, int]:
        return {f.name: f.size for f in self.files}

    @property
    def nbytes(self) -> int:
        """Bytes on disk: the data files plus ``.metadata``."""
        return sum(f.size for f in self.files) + (self.path / METADATA_FILE).stat().st_size


def is_dcp_folder(path: Place) -> bool:
    """Whether ``path`` is a folder holding a ``.metadata`` file."""
    return (path / METADATA_FILE).is_file()


#: A ``.metadata`` may exceed the data files beside it by this much. It describes them, at
#: a few hundred bytes per chunk where each chunk's archive takes at least one or two
#: kilobytes (a 4,000-tensor one is 1.6 MB; fixtures run at 1/7 of their data), so a
#: larger one describes bytes that are not there: it is refused before it is read, which
#: bounds the reader's memory by the checkpoint's real size, not by what a file declares.
METADATA_SLACK = 8 << 20


def _data_files(folder: Place) -> list[tuple[str, int]]:
    """``(name, size)`` of the ``*.distcp`` regular files in ``folder`` (links not followed)."""
    return [(e.name, e.size) for e in storage.entries(folder)
            if e.name.endswith(".distcp") and e.is_file]


def _read_metadata_bounded(folder: Place, meta_path: Place) -> bytes:
    """The bytes of ``.metadata``, refused unread when larger than the data it could describe."""
    path = path_inside(folder, METADATA_FILE)
    size = storage.size(path)
    if size > METADATA_SLACK:
        data = sum(size for _, size in _data_files(folder))
        if size > METADATA_SLACK + data:
            raise NotACheckpointError(
                f"{meta_path}: {size} bytes of metadata for {data} bytes of data files; a "
                f".metadata is a small part of its checkpoint (at most {METADATA_SLACK} bytes "
                "more than its data files), so this one is damaged, crafted, or its data "
                "files are missing: use an intact copy")
    return storage.read_bytes(path)


def read_dcp_folder(path: str | os.PathLike[str] | Place) -> DcpFolder:
    """Read a DCP folder's metadata and list its data files, without unpickling anything unsafe.

    Args:
        path: the DCP folder (the one holding ``.metadata``): local, or a remote URL /
            :class:`~fsdpckpt._io.remote.RemotePath`.

    Returns:
        A :class:`DcpFolder`.

    Raises:
        CheckpointNotFoundError: ``path`` or its ``.metadata`` does not exist.
        NotACheckpointError: ``.metadata`` is not a DCP metadata pickle, or a data file
            (named in it, or present) leads outside the folder (see :func:`path_inside`).
        UnsafePickleError: ``.metadata`` names a global a DCP pickle never holds.

    Example:
        >>> folder = read_dcp_folder("ckpt/pytorch_model_fsdp_0")
        >>> [t.name for t in folder.metadata.tensors][:2]
        ['model.0.weight', 'model.0.bias']
    """
    folder = location(path)
    if not folder.exists():
        raise CheckpointNotFoundError(f"{folder}: no such file or folder; check the path.")
    if not folder.is_dir():
        raise NotACheckpointError(f"{folder}: is a file; pass the DCP folder that holds .metadata.")
    meta_path = folder / METADATA_FILE
    if not meta_path.is_file():
        raise CheckpointNotFoundError(
            f"{folder}: no .metadata file, so this is not a complete DCP checkpoint folder "
            "(DCP writes .metadata last; a save that did not finish leaves none). "
            "Pass the folder that holds .metadata."
        )
    metadata = _parsed_once(folder, meta_path)
    for name in sorted(metadata.referenced_files):  # before any of them is sized or opened
        data_file_path(folder, name)
    # A link is taken when it leads to a regular file inside the folder (sized as resolved).
    files = tuple(DataFile(e.name, storage.size(data_file_path(folder, e.name)))
                  for e in storage.entries(folder) if e.name.endswith(".distcp")
                  and (e.is_file or (e.is_link and e.path.is_file())))
    return DcpFolder(folder, metadata, files)


# -- one parse per process ---------------------------------------------------------------
#
# A load reads a folder's .metadata in several places (the checks of the model against it,
# the storage reader DCP loads through, the manifest's chunk checks): each gets the one
# parse, which is immutable, for as long as anything holds it, and within shared_parses()
# for the whole block. A local file is known by its device, inode, size and modification
# time: a save publishes .metadata by rename, so a new one is a new inode.

_PARSED: weakref.WeakValueDictionary[tuple[Any, ...], DcpMetadata] = \
    weakref.WeakValueDictionary()
_HELD: list[list[DcpMetadata]] = []
#: How many times .metadata was parsed in this process (tests count it).
parse_count = 0


@contextmanager
def shared_parses() -> Iterator[None]:
    """Keep every ``.metadata`` parsed in the block until it ends, so that each is parsed
    once however many times the block reads its folder."""
    held: list[DcpMetadata] = []
    _HELD.append(held)
    try:
        yield
    finally:
        _HELD.remove(held)


def _identity(meta_path: Place) -> tuple[Any, ...] | None:
    if not isinstance(meta_path, Path):
        return None  # object storage: read anew each time
    try:
        st = os.stat(meta_path)
    except OSError:
        return None
    return (os.path.abspath(meta_path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _parsed_once(folder: Place, meta_path: Place) -> DcpMetadata:
    global parse_count
    key = _identity(meta_path)
    metadata = _PARSED.get(key) if key is not None else None
    if metadata is None:
        metadata = parse_metadata(_read_metadata_bounded(folder, meta_path),
                                  source=str(meta_path))
        parse_count += 1
        if key is not None:
            _PARSED[key] = metadata
    for held in _HELD:
        held.append(metadata)
    return metadata


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
    """``value`` as a tuple of int64-range integers, or None to take the checked path.
    (Written out again inline in the loops below, which run once per chunk.)"""
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
    plain_types, index_class, info_class, top = _INTS.issuperset, _INDEX_CLASS, _INFO_CLASS, _INT64
    while storage:
        index, info = storage.popitem()
        key, fields = getattr(index, "state", None), getattr(info, "state", None)
        if type(index) is index_class and type(info) is info_class and \
                type(key) is dict and type(fields) is dict:
            fqn, offsets = key.get("fqn"), key.get("offset")
            file, offset = fields.get("relative_path"), fields.get("offset")
            length, transforms = fields.get("length"), fields.get("transform_descriptors")
            if type(offsets) is Size:
                ints: tuple[int, ...] | None = tuple(offsets)
                if not (plain_types(map(type, ints)) and  # type: ignore[arg-type]
                        (not ints or (min(ints) >= 0 and max(ints) < top))):
                    ints = _plain_ints(offsets)  # plain tuples too (None where not ints)
            else:
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


def _tensor(fqn: str, entry: Any, locations: dict[Any, _Location],
            key_path: KeyPath) -> TensorEntry:
    where = f"tensor {brief(fqn)}"
    fields = _fields(entry, "TensorStorageMetadata", where)
    shape = _ints(fields.get("size"), f"{where}: size")
    chunks = []
    plain_types, chunk_class, top = _INTS.issuperset, _CHUNK_CLASS, _INT64
    missing, get = (None, 0, 0, ()), locations.get
    for i, chunk in enumerate(_list(fields.get("chunks"), f"{where}: chunks")):
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


def _parse(root: Any) -> DcpMetadata:
    """Check ``root`` (the unpickled stand-ins) against the schema and convert it."""
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
            tensors.append(_tensor(fqn, entry, locations, key_path))
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
        return _parse(root)
    except _SchemaError as exc:
        raise NotACheckpointError(
            f"{source}: {exc}; the file is damaged, crafted, or from an unsupported torch "
            "version: use an intact copy of the checkpoint."
        ) from None
    except (RecursionError, MemoryError) as exc:  # a key too deeply nested to hash, say
        raise NotACheckpointError(f"{source}: not readable DCP metadata "
                                  f"({type(exc).__name__})") from None
