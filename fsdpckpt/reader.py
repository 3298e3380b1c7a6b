"""Reading a DCP folder: its ``.metadata`` (safely) and the data files beside it.

Torch reads ``.metadata`` with a plain ``pickle.load``; here it goes through
:mod:`fsdpckpt.safe_pickle`, so a hostile file is refused and torch is never
imported. The result is the plain data model of :mod:`fsdpckpt.metadata`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dtypes import DType
from .errors import CheckpointNotFoundError, NotACheckpointError
from .metadata import Chunk, DataFile, DcpMetadata, KeyPath, ObjectEntry, TensorEntry, rank_of_file
from .safe_pickle import METADATA_GLOBALS, Record, safe_loads

__all__ = ["DcpFolder", "read_dcp_folder", "parse_metadata", "is_dcp_folder", "METADATA_FILE",
           "data_file_path", "open_data_file", "path_inside"]

METADATA_FILE = ".metadata"

_ONLY_INSIDE = "fsdpckpt reads a checkpoint's data files only from inside its folder"


def path_inside(folder: Path, relative: str) -> Path:
    """``folder / relative``, checked to stay inside ``folder`` once symlinks are followed.

    This is the one rule every reader applies before it opens or sizes a data file:
    the file must lie inside the checkpoint folder. A symlink is followed only when
    it leads to a place inside the folder; an absolute path, a ``..`` that climbs
    out, or a symlink to a file elsewhere is refused, so a checkpoint can never make
    fsdpckpt read (or merge, or load) a file that is not part of it.

    Raises:
        NotACheckpointError: the path leads outside ``folder``; the message says where.
    """
    path = folder / relative
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if os.path.isabs(relative) or os.path.commonpath([root, real]) != root or real == root:
        how = f"a symlink to {real}" if os.path.islink(path) else f"resolves to {real}"
        fix = (f"; replace the link by the file itself (cp --remove-destination {real} {path})"
               if os.path.islink(path) else "; use an intact copy of the checkpoint")
        raise NotACheckpointError(f"{path}: {how}, outside the checkpoint folder {folder}; "
                                  f"{_ONLY_INSIDE}{fix}")
    return path


def data_file_path(folder: Path, name: str) -> Path:
    """The path of the data file ``name`` of the DCP folder ``folder``, checked.

    DCP's ``FileSystemWriter`` names data files by plain file names (``__0_0.distcp``);
    a ``.metadata`` naming a path (``/elsewhere/x``, ``../x``, ``sub/x``) is damaged or
    crafted and refused. The file itself must then pass :func:`path_inside`.

    Raises:
        NotACheckpointError: ``name`` is not a plain file name, or leads outside.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or \
            "\\" in name or "\0" in name:
        raise NotACheckpointError(f"{folder / METADATA_FILE}: names the data file {name!r}, a "
                                  "path that may lead outside the checkpoint folder where DCP "
                                  f"writes plain names (__0_0.distcp); {_ONLY_INSIDE}, so this "
                                  ".metadata is damaged or crafted: use an intact copy")
    return path_inside(folder, name)


def open_data_file(folder: Path, name: str) -> int:
    """Open the data file ``name`` of ``folder`` for reading (by :func:`data_file_path`'s rule).

    Returns:
        A file descriptor; the caller closes it.

    Raises:
        NotACheckpointError: the name or the file leads outside the folder, or it is
            not a regular file.
        CheckpointNotFoundError: the file is missing.
    """
    path = data_file_path(folder, name)
    real = os.path.realpath(path)  # opened as resolved, so no link is followed after the check
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise NotACheckpointError(f"{path}: not a regular file; a data file must be one")
        return os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing data file; copy it from the machine that "
                                      "wrote the checkpoint") from None


@dataclass(frozen=True)
class DcpFolder:
    """A DCP folder on disk: its metadata and the data files present.

    Attributes:
        path: the folder.
        metadata: what ``.metadata`` says.
        files: the ``*.distcp`` files present, sorted by name, with their sizes.
    """

    path: Path
    metadata: DcpMetadata
    files: tuple[DataFile, ...]

    @property
    def file_sizes(self) -> dict[str, int]:
        return {f.name: f.size for f in self.files}

    @property
    def world_size(self) -> int:
        """Ranks that wrote this folder, as the rank file names (present or referenced) show."""
        names = {f.name for f in self.files} | set(self.metadata.referenced_files)
        # Only names DCP could write (__{rank}_{n}.distcp, numbers of at most 9 digits): a
        # longer one is no rank file, and converting it costs time quadratic in its length.
        ranks = [r for r in map(rank_of_file, (n for n in names if len(n) <= 28))
                 if r is not None and r < 10**9]
        return max(ranks) + 1 if ranks else 0

    @property
    def nbytes(self) -> int:
        """Bytes on disk: the data files plus ``.metadata``."""
        return sum(f.size for f in self.files) + (self.path / METADATA_FILE).stat().st_size


def is_dcp_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding a ``.metadata`` file."""
    return (path / METADATA_FILE).is_file()


#: A ``.metadata`` may exceed the data files beside it by this much. It describes them, at
#: a few hundred bytes per chunk where each chunk's archive takes at least one or two
#: kilobytes (a 4,000-tensor one is 1.6 MB; fixtures run at 1/7 of their data), so a
#: larger one describes bytes that are not there: it is refused before it is read, which
#: bounds the reader's memory by the checkpoint's real size, not by what a file declares.
METADATA_SLACK = 8 << 20


def _read_metadata_bounded(folder: Path, meta_path: Path) -> bytes:
    """The bytes of ``.metadata``, refused unread when larger than the data it could describe."""
    size = os.stat(path_inside(folder, METADATA_FILE)).st_size
    if size > METADATA_SLACK:
        data = sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(folder)
                   if e.name.endswith(".distcp") and e.is_file(follow_symlinks=False))
        if size > METADATA_SLACK + data:
            raise NotACheckpointError(
                f"{meta_path}: {size} bytes of metadata for {data} bytes of data files; a "
                f".metadata is a small part of its checkpoint (at most {METADATA_SLACK} bytes "
                "more than its data files), so this one is damaged, crafted, or its data "
                "files are missing: use an intact copy")
    return path_inside(folder, METADATA_FILE).read_bytes()


def read_dcp_folder(path: str | os.PathLike[str]) -> DcpFolder:
    """Read a DCP folder's metadata and list its data files, without unpickling anything unsafe.

    Args:
        path: the DCP folder (the one holding ``.metadata``).

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
    folder = Path(path)
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
    metadata = parse_metadata(_read_metadata_bounded(folder, meta_path), source=str(meta_path))
    for name in sorted(metadata.referenced_files):  # before any of them is sized or opened
        data_file_path(folder, name)
    files = tuple(
        DataFile(entry.name, os.stat(data_file_path(folder, entry.name)).st_size)
        for entry in sorted(os.scandir(folder), key=lambda e: e.name)
        if entry.name.endswith(".distcp") and entry.is_file()
    )
    return DcpFolder(folder, metadata, files)


def _attr(record: Any, name: str, source: str, default: Any = ...) -> Any:
    value = getattr(record, name, default)
    if value is ...:
        raise NotACheckpointError(
            f"{source}: a {getattr(record, 'kind', type(record).__name__)} entry lacks "
            f"'{name}'; the file is damaged or from an unsupported torch version."
        )
    return value


def _is(record: Any, kind: str) -> bool:
    return isinstance(record, Record) and record.kind == kind


def _properties_dtype(props: Any, source: str) -> DType:
    # TensorProperties pickles its fields as a tuple (dtype first) since torch 2.0.
    state = props.state if _is(props, "TensorProperties") else None
    dtype = state[0] if isinstance(state, tuple) and state else getattr(props, "dtype", None)
    if not isinstance(dtype, DType):
        raise NotACheckpointError(f"{source}: a tensor entry has no recognizable dtype.")
    return dtype


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
    root = safe_loads(data, allowed=METADATA_GLOBALS, source=source)
    if not _is(root, "Metadata"):
        raise NotACheckpointError(
            f"{source}: holds a {type(root).__name__}, not DCP checkpoint metadata."
        )
    entries = _attr(root, "state_dict_metadata", source)
    storage = getattr(root, "storage_data", None) or {}
    planner = getattr(root, "planner_data", None) or {}
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise NotACheckpointError(f"{source}: metadata fields have unexpected types.")

    locations: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in storage.items():
        if not (_is(index, "MetadataIndex") and _is(info, "_StorageInfo")):
            raise NotACheckpointError(
                f"{source}: storage entries are not file locations; this folder was not "
                "written by FileSystemWriter (e.g. HuggingFaceStorageWriter), which is not "
                "supported."
            )
        if getattr(info, "transform_descriptors", None):
            raise NotACheckpointError(
                f"{source}: entry '{index.fqn}' is stored with transforms "
                f"{list(info.transform_descriptors)}, which fsdpckpt does not read yet."
            )
        offset = getattr(index, "offset", None)
        key = (_attr(index, "fqn", source), tuple(offset) if offset is not None else None)
        locations[key] = (
            _attr(info, "relative_path", source),
            int(_attr(info, "offset", source)),
            int(_attr(info, "length", source)),
        )

    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    for fqn, entry in entries.items():
        key_path: KeyPath = tuple(planner.get(fqn) or fqn.split("."))
        if _is(entry, "BytesStorageMetadata"):
            file, offset, length = locations.get((fqn, None), (None, 0, 0))
            objects.append(ObjectEntry(fqn, file, offset, length, key_path))
        elif _is(entry, "TensorStorageMetadata"):
            chunks = []
            for chunk in _attr(entry, "chunks", source):
                offsets = tuple(_attr(chunk, "offsets", source))
                file, offset, length = locations.get((fqn, offsets), (None, 0, 0))
                chunks.append(Chunk(offsets, tuple(_attr(chunk, "sizes", source)), file,
                                    offset, length))
            dtype = _properties_dtype(_attr(entry, "properties", source), source)
            shape = tuple(_attr(entry, "size", source))
            tensors.append(TensorEntry(fqn, dtype, shape, tuple(chunks), key_path))
        else:
            raise NotACheckpointError(f"{source}: entry '{fqn}' has an unknown storage kind.")
    version = getattr(root, "version", None)
    return DcpMetadata(tuple(tensors), tuple(objects), version if isinstance(version, str) else None)
