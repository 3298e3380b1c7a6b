"""``convert``: a full safetensors or ``.bin`` state dict into a DCP folder, one tensor at a time.

The reverse of a merge, like torch's ``torch_save_to_dcp`` but streaming: each
tensor is read, written as its own chunk and dropped, so memory holds one
tensor. The folder has one chunk per tensor, and DCP reshards on load, so it
seeds an FSDP run at any world size. By default everything is nested under
``"model"``, the key Accelerate and fsdpckpt's ``load_state`` read a model from.

Inputs are recognized by their first bytes, not their names, and checked before
anything is written, so a text file, a truncated download or a hostile pickle
is one clear error naming the file. Nothing in them is unpickled outside torch's
``weights_only`` allowlist.

The input may be on object storage (``s3://...``): it is recognized and checked by ranged
reads, then each file is downloaded (in bounded pieces) into the staging folder, because
torch's memory-mapped loader and ``safe_open`` read local files, and removed before the
output is committed.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt import _torch
from fsdpckpt._io import publish, storage
from fsdpckpt._io.durable import Writeback
from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
from fsdpckpt._progress import ProgressFactory, start_progress
from fsdpckpt._torch import flatten_state_dict, storage_info
from fsdpckpt.dcp._objects import loads, torch_load_allowlisted
from fsdpckpt.errors import (
    CorruptCheckpointError,
    FsdpCkptError,
    NotACheckpointError,
    OutputExistsError,
    UnsafePickleError,
)
from fsdpckpt.formats.safetensors import KEY_PATHS_KEY, OBJECTS_KEY
from fsdpckpt.merging._convert_source import (
    MODEL_FILES,
    first_line,
    resolve_source,
    shards,
    sniff,
)

__all__ = ["convert", "ConvertResult", "MODEL_FILES"]

_DATA_FILE = "__0_0.distcp"

@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` wrote.

    Attributes:
        path: the DCP folder written.
        tensors: tensor entries. objects: non-tensor entries. bytes: tensor bytes.
        source: the file read (a folder given to :func:`convert` resolves to its model file).
    """

    path: Place
    tensors: int
    objects: int
    bytes: int
    source: Place | None = None

    def to_json(self) -> dict[str, Any]:
        """What ``fsdpckpt convert --json`` prints."""
        return {"source": str(self.source), "output": str(self.path), "tensors": self.tensors,
                "objects": self.objects, "bytes": self.bytes}


def _torch_load(file: Path, kind: str) -> Any:
    """``torch.load`` through torch's weights-only allowlist; its failures as our errors."""
    try:
        # mmap: tensors are paged in as each is written, not loaded all at once (the legacy
        # format cannot be mapped).
        return torch_load_allowlisted(file, mmap=kind == "torch")
    except FsdpCkptError:
        raise  # already names the file (a checksum that fails, a refused value)
    except pickle.UnpicklingError as exc:
        asked = re.search(r"GLOBAL (\S+)", str(exc))
        if asked:
            raise UnsafePickleError(
                f"{file}: refused: its pickle asks for {asked.group(1)}, which a state dict "
                "of tensors never holds; nothing in it was run. Convert only files you trust, "
                "saved as a plain state dict.") from None
        raise CorruptCheckpointError(f"{file}: a torch.save file whose pickle cannot be read "
                                     "by torch's weights-only loader; it is damaged or not "
                                     "a state dict.") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if isinstance(exc, OSError) and exc.filename:
            raise  # a real I/O error, which names its file
        raise CorruptCheckpointError(f"{file}: not a readable torch.save file "
                                     f"({first_line(exc)}); it is truncated or damaged.") from None


def key_paths(text: str) -> dict[str, list[str | int]]:
    """The ``fsdpckpt.key_paths`` metadata: each name's key path, checked against its schema.

    Raises:
        ValueError: not JSON, too deep, or not an object of names to non-empty lists of
            string or integer keys.
    """
    paths = parse_json(text)
    if not (isinstance(paths, dict) and all(
            isinstance(v, list) and v and all(isinstance(k, str) or type(k) is int for k in v)
            for v in paths.values())):
        raise ValueError(f"'{KEY_PATHS_KEY}' is not an object of names to lists of keys")
    return paths


def _safetensors_entries(file: Path, prefix: tuple) -> Iterator[tuple[tuple, Any]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            meta = handle.metadata() or {}
            try:
                paths = key_paths(meta.get(KEY_PATHS_KEY, "{}"))
                objects = loads(meta.get(OBJECTS_KEY, "{}")).items()
            except (ValueError, TypeError, AttributeError) as exc:
                raise CorruptCheckpointError(f"{file}: its fsdpckpt metadata is garbled "
                                             f"({first_line(exc)})") from None
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                yield prefix + tuple(paths.get(name, [name])), handle.get_tensor(name)
    except SafetensorError as exc:
        raise CorruptCheckpointError(f"{file}: not a readable safetensors file "
                                     f"({first_line(exc)}); it is truncated or damaged.") \
            from None
    for name, value in objects:
        yield prefix + tuple(paths.get(name, [name])), value


_DOWNLOADS = ".downloads"


def _local_copies(files: list[tuple[Place, str]], stage: Path) -> list[tuple[Path, str]]:
    """``files`` as local files: a remote one downloaded into ``stage``'s download folder
    (under its own name, in a folder of its own), a local one as it is."""
    def scratch(number: int) -> Path:
        folder = stage / _DOWNLOADS / str(number)
        folder.mkdir(parents=True)
        return folder

    return [(storage.local_file(file, functools.partial(scratch, number)), kind)
            for number, (file, kind) in enumerate(files)]


def _entries(files: list[tuple[Path, str]], key: str | None) -> Iterator[tuple[tuple, Any]]:
    """``(key_path, value)`` for every entry of the full file, one tensor loaded at a time."""
    prefix: tuple = (key,) if key else ()
    for file, kind in files:
        if kind == "safetensors":
            yield from _safetensors_entries(file, prefix)
            continue
        state = _torch_load(file, kind)
        if not isinstance(state, dict):
            raise NotACheckpointError(f"{file}: holds a {type(state).__name__}, not a state "
                                      "dict; convert needs a dict of names to tensors")
        flat, mapping = flatten_state_dict(state)
        for fqn, value in flat.items():
            yield prefix + tuple(mapping[fqn]), value


def convert(full_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
            key: str | None = "model", overwrite: bool = False,
            progress: ProgressFactory | None = None,
            storage_options: dict[str, Any] | None = None) -> ConvertResult:
    """Write the state dict in ``full_file`` as a DCP folder ``out_dir``.

    Args:
        full_file: a ``.safetensors`` file, a shard index (``*.index.json``), a
            ``torch.save`` file (``.bin``/``.pt``), or a folder holding a merged or Hugging
            Face model (the first of :data:`MODEL_FILES` in it is read). Files are
            recognized by content, whatever their names. Local, or on object storage
            (``s3://bucket/model``: downloaded into the staging folder, then removed).
        out_dir: the DCP folder to create; on object storage, it is built in ``$TMPDIR``
            and uploaded, ``.metadata`` last.
        key: nest every entry under this top-level key (``"model"``, as Accelerate's
            ``pytorch_model_fsdp_0`` holds it); None or ``""`` for none.
        overwrite: replace an existing ``out_dir``.
        progress: a progress factory, as for :func:`fsdpckpt.merge`: called once as
            ``progress(total_bytes, files)`` with the bytes of the source files before any
            is read; the callback it returns is given each tensor's bytes as it is written.
        storage_options: fsspec options for a ``full_file`` or ``out_dir`` on object storage
            (``{"endpoint_url": ...}``, credentials); None uses the environment's.

    Returns:
        A :class:`ConvertResult`.

    Raises:
        CheckpointNotFoundError: ``full_file`` (or a shard its index lists) does not exist.
        NotACheckpointError: it is neither format, a DCP checkpoint already (use ``merge``),
            a folder without a model file, or holds no state dict.
        CorruptCheckpointError: it is truncated or damaged.
        UnsafePickleError: its pickle asks for code outside torch's weights-only allowlist.

    Example:
        >>> convert("merged/model.safetensors", "seed/pytorch_model_fsdp_0")
    """
    out = location(out_dir, storage_options=storage_options)
    found: list[Any] = []  # (source, files), from prepare()

    def prepare(target: Path) -> None:
        # The input, then the folder the output replaces: all checked before writing.
        source = resolve_source(location(full_file, storage_options=storage_options))
        found[:] = [source, [(file, sniff(file, "convert")) for file in shards(source, "convert")]]
        if target.exists() and not target.is_dir():
            raise NotACheckpointError(f"{target}: is a file; pass a folder for the DCP output.")
        if target.exists() and not overwrite:
            raise OutputExistsError(f"{target}: already exists; pass overwrite=True to replace "
                                    "it")
        if target.exists() and any(target.iterdir()) and not (target / ".metadata").is_file():
            # Replacing means deleting: only ever delete a folder that is a DCP checkpoint.
            raise OutputExistsError(f"{target}: exists and is not a DCP folder, so "
                                    "overwrite=True will not delete it; choose another output "
                                    "folder")

    # Built in a hidden folder and published as a whole (on object storage: built locally,
    # uploaded with .metadata last); fsdpckpt/_io/publish.py.
    return publish.folder(out, lambda stage: _write(stage, out, found[0], found[1], key,
                                                    progress),
                          overwrite=overwrite, last=(".metadata",), prepare=prepare)


def _write(stage: Path, out: Place, source: Place, files: list[tuple[Place, str]],
           key: str | None, progress: ProgressFactory | None) -> ConvertResult:
    """Every entry of ``files`` into the DCP folder ``stage``; what :func:`convert` returns
    once it is published as ``out``."""
    total = sum(storage.size(file) for file, _kind in files)
    callback = start_progress(progress, total, len(files))  # before any byte is read
    local: list[tuple[Path, str]] = []
    try:
        local = _local_copies(files, stage)
        return _write_local(stage, out, source, local, key, callback, total)
    except FsdpCkptError as exc:
        copies = {str(copy): str(file) for (copy, _), (file, _) in zip(local, files)
                  if copy != file}
        message = str(exc)
        for copy, remote in copies.items():  # name the remote file, not the download
            message = message.replace(copy, remote)
        if message == str(exc):
            raise
        raise type(exc)(message) from None
    except BaseException as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # torch.save turns Ctrl-C into a RuntimeError
        raise


def _write_local(stage: Path, out: Place, source: Place, local: list[tuple[Path, str]],
                 key: str | None, callback: Callable[[int], None] | None,
                 total: int) -> ConvertResult:
    import torch
    from torch.distributed.checkpoint import metadata as dcp

    reported = 0
    entries: dict[str, Any] = {}
    storage_data: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    tensors = objects = nbytes = 0
    with open(stage / _DATA_FILE, "wb") as data, Writeback(data.fileno()) as writeback:
        for path, value in _entries(local, key or None):
            fqn = ".".join(map(str, path))
            if fqn in planner:
                raise NotACheckpointError(f"{source}: two entries are both named '{fqn}'")
            planner[fqn] = path
            offset = data.tell()
            if isinstance(value, torch.Tensor):
                tensor = value.detach().contiguous()
                if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()  # as DCP does: save only the chunk's own bytes
                torch.save(tensor, data)
                zeros = torch.Size([0] * tensor.dim())
                entries[fqn] = dcp.TensorStorageMetadata(
                    dcp.TensorProperties.create_from_tensor(tensor), tensor.size(),
                    [dcp.ChunkStorageMetadata(zeros, tensor.size())])
                storage_data[dcp.MetadataIndex(fqn, zeros, 0)] = storage_info(
                    _DATA_FILE, offset, data.tell() - offset)
                tensors, nbytes = tensors + 1, nbytes + tensor.nbytes
                if callback and reported + tensor.nbytes <= total:
                    callback(tensor.nbytes)
                    reported += tensor.nbytes
                del tensor, value
            else:
                blob = io.BytesIO()
                torch.save(value, blob)
                data.write(blob.getbuffer())
                entries[fqn] = dcp.BytesStorageMetadata()
                storage_data[dcp.MetadataIndex(fqn)] = storage_info(_DATA_FILE, offset,
                                                                data.tell() - offset)
                objects += 1
            data.flush()  # on its way to disk while the next entry is read
            writeback.wrote(offset, data.tell())
        data.flush()
        os.fsync(data.fileno())
    if callback and reported < total:  # headers and pickles: the bar ends at 100%
        callback(total - reported)
    metadata = _torch.dcp_metadata(entries, planner_data=planner, storage_data=storage_data,
                                   version="1.0.0")
    with open(stage / ".metadata", "wb") as meta:
        pickle.dump(metadata, meta)
        meta.flush()
        os.fsync(meta.fileno())
    shutil.rmtree(stage / _DOWNLOADS, ignore_errors=True)  # no part of the output
    return ConvertResult(out, tensors, objects, nbytes, source)
