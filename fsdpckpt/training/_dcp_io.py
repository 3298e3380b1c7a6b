"""What ``dcp.load`` reads a checkpoint through on the training load path.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``,
and when that fails ``dcp.load`` asks it for a rank-local ``__{rank}.metadata``, again
with plain ``pickle``: a file fsdpckpt's own checks never looked at could run code.
:func:`safe_storage_reader` closes both doors at the root: its metadata is built from
fsdpckpt's allowlisted parse (:func:`fsdpckpt.dcp.reader.read_dcp_folder`) into torch's own
classes, and it never opens any other metadata file; a folder holding rank-local
metadata files is refused outright.

What else the load path reads from a checkpoint, audited in torch 2.13:

- tensor chunks: ``FileSystemReader.read_data`` calls ``torch.load(..., weights_only=True)``
  (torch's allowlist; explicit, so ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot switch it
  off), on a view bounded by the chunk's offset and length;
- non-tensor entries: torch's ``DefaultLoadPlanner.load_bytes`` unpickles them with the
  allowlist switched off; :func:`safe_load_planner` loads them with ``weights_only=True``.

Nothing else on that path unpickles file bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fsdpckpt import _torch
from fsdpckpt._io.dcp_storage import dcp_reader
from fsdpckpt._io.storage import Place
from fsdpckpt._torch import storage_info, store_loaded_value
from fsdpckpt.dcp._checked import check_archive
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp._zstd import OBJECT_LIMIT, chunk_limit, open_entry
from fsdpckpt.dcp.metadata import DcpMetadata
from fsdpckpt.dcp.reader import METADATA_FILE, read_dcp_folder
from fsdpckpt.errors import NotACheckpointError

#: Where one archive lies in a DCP folder: ``(file, offset, length, transforms, size limit)``.
_Archive = tuple[str, int, int, tuple[str, ...], int]

__all__ = ["check_local_reads", "check_reads", "safe_storage_reader", "safe_load_planner",
           "stray_metadata_files"]


def stray_metadata_files(folder: Place) -> list[Place]:
    """The rank-local metadata files (``__{rank}.metadata``) in the DCP folder ``folder``.

    DCP writes them only when a save runs without collectives, and then writes no
    ``.metadata``; beside a ``.metadata`` they are never part of the checkpoint, and
    torch's reader would unpickle them without an allowlist.
    """
    return sorted((p for p in folder.glob("__*" + METADATA_FILE) if p.name != METADATA_FILE),
                  key=str)


def _refuse_strays(folder: Place) -> None:
    strays = stray_metadata_files(folder)
    if strays:
        raise NotACheckpointError(
            f"{strays[0]}: a rank-local DCP metadata file beside {METADATA_FILE}; it is not "
            "part of a committed checkpoint and torch would unpickle it without an allowlist, "
            "so this checkpoint is refused. Nothing was executed. Delete "
            + ", ".join(p.name for p in strays) + " if you made the checkpoint; otherwise "
            "get an intact copy")


def check_reads(folder: Place, archives: set[_Archive]) -> None:
    """Read every entry of each of ``archives`` (``(file, offset, length, transforms,
    limit)``) of ``folder`` against the CRC-32s its zip records: torch's loader does not.

    Raises:
        ChecksumError: naming the file and the entry whose bytes changed.
    """
    with DataFiles(folder) as files:
        for name, offset, length, transforms, limit in sorted(archives):
            source = f"{folder / name} (the archive at offset {offset})"
            handle, start, size = open_entry(files.open(name).file, offset, length, transforms,
                                             limit=limit, source=source)
            check_archive(handle, start, size, source=source)


def check_local_reads(reader: Any, state_dict: Any) -> None:
    """Check every archive ``dcp.load(state_dict, storage_reader=reader)`` will read on this
    rank against its CRC-32s, before the load changes anything: the local plan is what the
    default planner would make (the global step leaves it as it is)."""
    planner = safe_load_planner()
    planner.set_up_planner(state_dict, reader.read_metadata(), False)
    reader.check_items(planner.create_local_plan().items)


def _torch_metadata(folder: Place) -> tuple[Any, Mapping[Any, _Archive]]:
    """``folder``'s metadata as torch's ``Metadata``, built from fsdpckpt's safe parse, and
    where each storage index's archive lies (for :func:`check_reads`)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    meta = read_dcp_folder(folder).metadata
    if not _torch.reads_transforms() and any(c.transforms for t in meta.tensors
                                              for c in t.chunks):
        raise NotACheckpointError(
            f"{folder}: its chunks are compressed (DCP's zstd extension), which the loader of "
            f"torch {torch.__version__} cannot decode; load it with a torch whose DCP has "
            "torch.distributed.checkpoint._extension (2.6 lacks it), or merge it with fsdpckpt, "
            "which decodes it without torch")
    entries: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    for tensor in meta.tensors:
        dtype = _torch.dtype(tensor.dtype.name,
                             what=f"{folder / METADATA_FILE}: tensor '{tensor.name}'")
        chunks = [ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes))
                  for chunk in tensor.chunks]
        # Only the dtype is kept: layout, memory format and the rest are what DCP always
        # writes (strided, contiguous) and the loader does not use them.
        entries[tensor.name] = TensorStorageMetadata(TensorProperties(dtype=dtype),
                                                     torch.Size(tensor.shape), chunks)
        planner[tensor.name] = tensor.key_path
    for obj in meta.objects:
        entries[obj.name] = BytesStorageMetadata()
        planner[obj.name] = obj.key_path

    def located(entry: Any, chunk: Any) -> Any:
        where = chunk or entry
        return storage_info(where.file, where.offset, where.length, where.transforms)

    def archive(entry: Any, chunk: Any) -> _Archive:
        where = chunk or entry
        return (where.file, where.offset, where.length, where.transforms,
                OBJECT_LIMIT if chunk is None else chunk_limit(entry, chunk))

    return _torch.dcp_metadata(entries, version=meta.version, planner_data=planner,
                               storage_data=_Located(meta, located)), _Located(meta, archive)


class _Located(Mapping[Any, Any]):
    """Storage index (torch's ``MetadataIndex``) -> what ``make(entry, chunk)`` makes of the
    chunk (None: an object) it names, made when asked.

    A rank reads a few of a large run's millions of chunks: a dict of every index would
    build three objects per chunk on every rank before the load reads a byte. The planner
    names each chunk with its place in its tensor's list (``index``): found at once.
    """

    def __init__(self, meta: DcpMetadata, make: Callable[[Any, Any], Any]) -> None:
        self._tensors = {t.name: t for t in meta.tensors}
        self._objects = {o.name: o for o in meta.objects}
        self._make = make

    def _find(self, index: Any) -> tuple[Any, Any]:
        offsets = getattr(index, "offset", None)
        if offsets is None:
            entry = self._objects.get(str(getattr(index, "fqn", "")))
            if entry is None or entry.file is None:
                raise KeyError(index)
            return entry, None
        tensor = self._tensors.get(index.fqn)
        if tensor is None:
            raise KeyError(index)
        chunks, hint, offsets = tensor.chunks, index.index, tuple(offsets)
        found: Any = None
        if isinstance(hint, int) and 0 <= hint < len(chunks) and \
                tuple(chunks[hint].offsets) == offsets:
            found = chunks[hint]
        else:  # no hint, or another list's: DCP keys chunks by their offsets
            found = next((c for c in reversed(chunks) if tuple(c.offsets) == offsets), None)
        if found is None or found.file is None:
            raise KeyError(index)
        return tensor, found

    def __getitem__(self, index: Any) -> Any:
        return self._make(*self._find(index))

    def __contains__(self, index: object) -> bool:
        try:
            self._find(index)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for tensor in self._tensors.values():
            for i, chunk in enumerate(tensor.chunks):
                if chunk.file is not None:
                    yield MetadataIndex(tensor.name, chunk.offsets, i)
        for obj in self._objects.values():
            if obj.file is not None:
                yield MetadataIndex(obj.name)

    def __len__(self) -> int:
        return sum(c.file is not None for t in self._tensors.values() for c in t.chunks) + \
            sum(o.file is not None for o in self._objects.values())


def safe_storage_reader(folder: Place) -> Any:
    """A ``FileSystemReader`` for the DCP folder ``folder`` that never unpickles metadata
    (for a remote folder, torch's ``FsspecReader`` over the client fsdpckpt resolved).

    The metadata is read and checked here, before ``dcp.load`` runs, so a refused file
    raises fsdpckpt's error at once instead of torch's wrapped one.

    Raises:
        NotACheckpointError: the folder holds rank-local metadata files, or its
            ``.metadata`` is not DCP metadata fsdpckpt can read.
        UnsafePickleError: ``.metadata`` names a global outside the allowlist.
        CheckpointNotFoundError: the folder or its ``.metadata`` is missing.
    """
    from torch.distributed.checkpoint.metadata import StorageMeta

    _refuse_strays(folder)
    metadata, limits = _torch_metadata(folder)

    class SafeFileSystemReader:
        load_id: Any  # set by torch's reader, which this class goes before

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # Asked with rank=... (torch's fallback to rank-local files), the answer is
            # the same: only ``.metadata``, as fsdpckpt parsed it.
            metadata.storage_meta = StorageMeta(load_id=self.load_id)
            return metadata

        def check_items(self, items: Any) -> None:
            """Read each archive the read items name against its CRC-32s, once each."""
            check_reads(folder, {limits[item.storage_index] for item in items
                                 if item.storage_index in limits})

    return dcp_reader(folder, SafeFileSystemReader)


def safe_load_planner() -> Any:
    """DCP's default load planner, but non-tensor values load with ``weights_only=True``.

    torch's planner unpickles them with the allowlist switched off: a checkpoint whose
    ``param_groups`` entry hides a ``__reduce__`` would run code on load.
    """
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from fsdpckpt.training._rng import refused

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)  # safe: torch's allowlist
            except Exception as exc:  # noqa: BLE001 - one clear error
                raise refused(Path(f"entry '{fqn}'"), exc, "checkpoint entry") from None
            store_loaded_value(self, fqn, obj)

    return SafeLoadPlanner()
