"""A model's tensors, one at a time, from a checkpoint: what LoRA export and fusion read.

A DCP folder (or a checkpoint's model folder, chosen as merge chooses it) is read
tensor by tensor through fsdpckpt's own chunk reader (checked, allowlisted), so that
memory holds one tensor at a time; a merged ``.safetensors`` file (or its index) is read
by ranged reads of its checked header and of each tensor's bytes, locally as on object
storage (never a full download). Names are the model's state-dict
names: the top-level key a save wraps around them (``{"model": ...}``) and wrapper segments
(``_fsdp_wrapped_module``...) dropped, as ``fsdpckpt merge`` names them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp.checks import require_whole
from fsdpckpt.dcp.layout import DcpPart, find_layout
from fsdpckpt.dcp.metadata import TensorEntry
from fsdpckpt.dcp.parts import open_part
from fsdpckpt.dcp.reader import DcpFolder
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError
from fsdpckpt.formats._shards import read_header
from fsdpckpt.merging._validate import choose_parts

__all__ = ["ModelSource", "open_model_source", "folder_source"]


@dataclass(frozen=True)
class ModelSource:
    """The model tensors of a checkpoint, by name, readable one at a time.

    Attributes:
        path: the DCP folder or safetensors file read.
        names: every tensor's name, in stored order.
        shapes, dtypes: each tensor's shape and dtype name (``"float32"``...), by name.
    """

    path: Place
    names: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    _entries: dict[str, Any]
    _files: tuple[Place, ...] = ()

    def read(self, want: Callable[[str], bool] | None = None) -> Iterator[tuple[str, Any]]:
        """``(name, tensor)`` for each tensor ``want`` accepts (all by default), in stored
        order, each read when it is reached and not kept.

        Raises:
            CorruptCheckpointError: a data file is short or damaged.
        """
        if self._files:
            yield from self._read_safetensors(want)
        else:
            yield from self._read_dcp(want)

    def stored_entry(self, name: str) -> TensorEntry | None:
        """The DCP metadata entry of ``name`` (its stored chunks), for a writer that copies
        it as a merge copies it; None for a tensor of a ``.safetensors`` file."""
        return self._entries.get(name)

    def _read_dcp(self, want: Callable[[str], bool] | None) -> Iterator[tuple[str, Any]]:
        from fsdpckpt._io.rawio import reusing_scratch
        from fsdpckpt.dcp._datafiles import DataFiles
        from fsdpckpt.merging._copy import place_stored_chunk
        from fsdpckpt.merging._runs import chunk_runs
        from fsdpckpt.merging.full import _empty

        with DataFiles(self.path) as files, reusing_scratch():
            for name in self.names:
                if want is not None and not want(name):
                    continue
                entry: TensorEntry = self._entries[name]
                full, sink = _empty(entry.dtype, entry.shape)
                for chunk in entry.chunks:
                    place_stored_chunk(files, entry, chunk, chunk_runs(entry.shape, chunk),
                                       entry.dtype, sink, 0)
                yield name, full

    def _read_safetensors(self, want: Callable[[str], bool] | None) -> Iterator[tuple[str, Any]]:
        for file in self._files:
            yield from _read_safetensors(file, want)


def _from_dcp(part: DcpPart) -> ModelSource:
    dcp = open_part(part.path, part.name)  # as merge reads it: any layout's part
    require_whole(dcp)  # declared sizes checked against the bytes before anything is read
    return folder_source(dcp)


def folder_source(dcp: DcpFolder) -> ModelSource:
    """The model tensors of a DCP folder already read (and checked whole), as a merge's
    validate stage reads it: its ``.metadata`` is not read again."""
    from fsdpckpt.merging._keys import output_name, shares_top_key

    folder = dcp.path
    tensors = dcp.metadata.tensors
    strip = shares_top_key([t.key_path for t in tensors])
    entries: dict[str, TensorEntry] = {}
    for tensor in tensors:
        name = output_name(tensor.key_path, strip_top=strip)
        if name in entries:
            raise NotACheckpointError(f"{folder}: tensors '{entries[name].name}' and "
                                      f"'{tensor.name}' both become '{name}' once wrapper "
                                      "names are dropped; this is not one model's state dict")
        entries[name] = tensor
    return ModelSource(folder, tuple(entries), {n: e.shape for n, e in entries.items()},
                       {n: e.dtype.name for n, e in entries.items()}, dict(entries))


def _read_safetensors(file: Place, want: Callable[[str], bool] | None
                      ) -> Iterator[tuple[str, Any]]:
    # Local or remote alike: the checked header, then each tensor's bytes by a ranged read.
    import torch

    with storage.opened(file) as opened:
        header = read_header(file, opened)
        # In name order, as safe_open lists them (the order the metadata gave the names).
        for name in sorted(header.tensors):
            if want is not None and not want(name):
                continue
            dtype, shape, begin, end = header.tensors[name]  # checked against the file's size
            torch_dtype = getattr(torch, dtype.name)
            if end == begin:
                yield name, torch.empty(shape, dtype=torch_dtype)
                continue
            memory = bytearray(end - begin)
            opened.read_at(memoryview(memory), header.data_start + begin)
            yield name, torch.frombuffer(memory, dtype=torch_dtype).view(shape)


def _from_safetensors(path: Place) -> ModelSource:
    from fsdpckpt.merging.full import shard_files

    files = tuple(shard_files(path))
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        header = read_header(file)
        for name in sorted(header.tensors):
            dtype, shape, _, _ = header.tensors[name]
            shapes[name], dtypes[name] = shape, dtype.name
    return ModelSource(path, tuple(shapes), shapes, dtypes, {}, files)


def open_model_source(checkpoint: str | os.PathLike[str] | RemotePath, *,
                      storage_options: dict[str, Any] | None = None,
                      model_index: int | None = None) -> ModelSource:
    """The model tensors of ``checkpoint``.

    Args:
        checkpoint: a DCP folder; a checkpoint folder in any layout merge reads (its model
            folder, ``pytorch_model_fsdp_0/``, chosen as merge chooses it); or a merged
            ``.safetensors`` file or index. Local, or on object storage (a URL).
        storage_options: for URLs: the fsspec filesystem's options (docs/remote.md).
        model_index: of several model folders, the one numbered so (merge's
            ``model_index``).

    Raises:
        CheckpointNotFoundError: nothing at the path.
        NotACheckpointError: no model weights there; several model folders and none
            chosen; the chosen one unfinished (no ``.metadata``).
        CorruptCheckpointError: the metadata disagrees with the data files.
    """
    path = location(checkpoint, storage_options=storage_options)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or folder; check the path.")
    if path.is_file():
        if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
            return _from_safetensors(path)
        raise NotACheckpointError(f"{path}: not a DCP folder or a .safetensors file; pass the "
                                  "checkpoint folder")
    layout = find_layout(path)
    if not any(p.kind in ("model", "dcp") for p in layout.parts):
        raise NotACheckpointError(f"{path}: holds no finished model folder "
                                  "(pytorch_model_fsdp_0/ with .metadata); pass the checkpoint "
                                  "that holds the model")
    # The merge's choice: the one model folder (or the one numbered ``model_index``); several
    # and none chosen, or an unfinished one, is refused as merge refuses it.
    (part, *_) = choose_parts(layout, model_index=model_index)
    return _from_dcp(part)
