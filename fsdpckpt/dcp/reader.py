"""Reading a DCP folder: its ``.metadata`` (safely) and the data files beside it.

Torch reads ``.metadata`` with a plain ``pickle.load``; here it goes through the allowlist
(:mod:`fsdpckpt.dcp._fast_pickle`) and the schema (:mod:`fsdpckpt.dcp._schema`), so a
hostile file is refused and torch is never imported. The result is the plain data model of
:mod:`fsdpckpt.dcp.metadata`.
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
from fsdpckpt.dcp._paths import METADATA_FILE, data_file_path, open_data_file, path_inside
from fsdpckpt.dcp._schema import parse_metadata
from fsdpckpt.dcp.metadata import DataFile, DcpMetadata
from fsdpckpt.errors import CheckpointNotFoundError, FsdpCkptError, NotACheckpointError

__all__ = ["DcpFolder", "read_dcp_folder", "parse_metadata", "shared_parses", "is_dcp_folder",
           "METADATA_FILE", "data_file_path", "open_data_file", "path_inside", "read_whole"]

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


#: A file read whole may be mostly holes only up to this size: past it, a file whose holes
#: are more than half of it is refused unread (``truncate`` makes a 6 GB file in no disk).
SPARSE_FLOOR = 1 << 20


def read_whole(path: Place, error: type[FsdpCkptError] = NotACheckpointError) -> bytes:
    """All the bytes of ``path``, a file read whole (metadata, a manifest), bounded by the
    bytes it holds: a sparse file (over :data:`SPARSE_FLOOR`, under half of it data) is
    refused with ``error`` before any of it is read. Data files, read by ranges, are left
    to their own checks (simulated checkpoints keep them sparse on purpose).

    Raises:
        CheckpointNotFoundError: no such file.
    """
    size = storage.size(path)
    if size > SPARSE_FLOOR:
        present = storage.present_size(path)
        if present * 2 < size:
            raise error(f"{path}: {size} bytes long but only {present} of them on disk (a "
                        "sparse file, as truncate makes): no save writes one, so it is "
                        "damaged or crafted; use an intact copy")
    return storage.read_bytes(path)


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
    return read_whole(path)


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
    listed = storage.entries(folder)  # links not followed, nothing opened
    # A name the folder lists as a regular file (no link) is inside it: only the others (a
    # link, a path, a missing file) need the check, before any of them is sized or opened.
    plain = {e.name for e in listed if e.is_file}
    for name in sorted(metadata.referenced_files):
        if name not in plain:
            data_file_path(folder, name)
    # A link is taken when it leads to a regular file inside the folder (sized as resolved).
    files = tuple(DataFile(e.name, e.size if e.is_file else
                           storage.size(data_file_path(folder, e.name)))
                  for e in listed if e.name.endswith(".distcp")
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
