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

from pathlib import Path
from typing import Any

from fsdpckpt._io.dcp_storage import dcp_reader
from fsdpckpt._io.storage import Place
from fsdpckpt._torch import storage_info, store_loaded_value
from fsdpckpt.dcp._checked import check_archive
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp._zstd import OBJECT_LIMIT, chunk_limit, open_entry
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


def _torch_metadata(folder: Place) -> tuple[Any, dict[Any, _Archive]]:
    """``folder``'s metadata as torch's ``Metadata``, built from fsdpckpt's safe parse, and
    where each storage index's archive lies (for :func:`check_reads`)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    meta = read_dcp_folder(folder).metadata
    limits: dict[Any, _Archive] = {}
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for tensor in meta.tensors:
        dtype = getattr(torch, tensor.dtype.name, None)
        if not isinstance(dtype, torch.dtype):  # a dtype newer than this torch
            raise NotACheckpointError(f"{folder / METADATA_FILE}: tensor '{tensor.name}' has "
                                      f"dtype {tensor.dtype.name}, which this torch "
                                      f"({torch.__version__}) lacks; load it with a newer torch")
        chunks = []
        for i, chunk in enumerate(tensor.chunks):
            chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)))
            if chunk.file is not None:  # without a location, torch says so if it is needed
                index = MetadataIndex(tensor.name, chunk.offsets, i)
                storage[index] = storage_info(chunk.file, chunk.offset, chunk.length,
                                              chunk.transforms)
                limits[index] = (chunk.file, chunk.offset, chunk.length, chunk.transforms,
                                 chunk_limit(tensor, chunk))
        # Only the dtype is kept: layout, memory format and the rest are what DCP always
        # writes (strided, contiguous) and the loader does not use them.
        entries[tensor.name] = TensorStorageMetadata(TensorProperties(dtype=dtype),
                                                     torch.Size(tensor.shape), chunks)
        planner[tensor.name] = tensor.key_path
    for obj in meta.objects:
        entries[obj.name] = BytesStorageMetadata()
        if obj.file is not None:
            storage[MetadataIndex(obj.name)] = storage_info(obj.file, obj.offset, obj.length,
                                                            obj.transforms)
            limits[MetadataIndex(obj.name)] = (obj.file, obj.offset, obj.length,
                                               obj.transforms, OBJECT_LIMIT)
        planner[obj.name] = obj.key_path
    return Metadata(entries, planner_data=planner, storage_data=storage,
                    version=meta.version), limits


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
