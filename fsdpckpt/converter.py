"""``convert``: a full safetensors or ``.bin`` state dict into a DCP folder, one tensor at a time.

The reverse of a merge, like torch's ``torch_save_to_dcp`` but streaming: each
tensor is read, written as its own chunk and dropped, so memory holds one
tensor. The folder has one chunk per tensor, and DCP reshards on load, so it
seeds an FSDP run at any world size. By default everything is nested under
``"model"``, the key Accelerate and fsdpckpt's ``load_state`` read a model from.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointNotFoundError, NotACheckpointError
from .formats.safetensors import KEY_PATHS_KEY, OBJECTS_KEY
from .full import shard_files
from .objects import loads
from .writer import OutputExistsError

__all__ = ["convert", "ConvertResult"]

_DATA_FILE = "__0_0.distcp"


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` wrote: the folder, tensor and object counts, tensor bytes."""

    path: Path
    tensors: int
    objects: int
    bytes: int


def _entries(path: Path, key: str | None) -> Iterator[tuple[tuple, Any]]:
    """``(key_path, value)`` for every entry of the full file, one tensor loaded at a time."""
    prefix: tuple = (key,) if key else ()
    if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        from safetensors import safe_open

        for file in shard_files(path):
            with safe_open(str(file), framework="pt") as handle:
                meta = handle.metadata() or {}
                paths = json.loads(meta.get(KEY_PATHS_KEY, "{}"))
                for name in handle.keys():
                    yield prefix + tuple(paths.get(name, [name])), handle.get_tensor(name)
            for name, value in loads(meta.get(OBJECTS_KEY, "{}")).items():
                yield prefix + tuple(paths.get(name, [name])), value
        return
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    for file in shard_files(path):  # a .bin shard index lists .bin files the same way
        # mmap: tensors are paged in as each is written, not loaded all at once.
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(state, dict):
            raise NotACheckpointError(f"{file}: holds a {type(state).__name__}, not a state dict")
        flat, mapping = flatten_state_dict(state)
        for fqn, value in flat.items():
            yield prefix + tuple(mapping[fqn]), value


def convert(full_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
            key: str | None = "model", overwrite: bool = False,
            progress: Callable[[int], None] | None = None) -> ConvertResult:
    """Write the state dict in ``full_file`` as a DCP folder ``out_dir``.

    Args:
        full_file: a ``.safetensors`` file, a shard index (``*.safetensors.index.json``),
            or a ``torch.save`` file (``.bin``/``.pt``).
        out_dir: the DCP folder to create.
        key: nest every entry under this top-level key (``"model"``, as Accelerate's
            ``pytorch_model_fsdp_0`` holds it); None or ``""`` for none.
        overwrite: replace an existing ``out_dir``.
        progress: called with the bytes of each tensor written.

    Returns:
        A :class:`ConvertResult`.

    Example:
        >>> convert("merged/model.safetensors", "seed/pytorch_model_fsdp_0")
    """
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
        TensorStorageMetadata)

    source, out = Path(full_file), Path(out_dir)
    if not source.is_file():
        raise CheckpointNotFoundError(f"{source}: no such file; pass a .safetensors or .bin file")
    if out.exists() and not out.is_dir():
        raise NotACheckpointError(f"{out}: is a file; pass a folder for the DCP output.")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out}: already exists; pass overwrite=True (--overwrite) "
                                "to replace it")
    if out.exists() and any(out.iterdir()) and not (out / ".metadata").is_file():
        # Replacing means deleting: only ever delete a folder that is a DCP checkpoint.
        raise OutputExistsError(f"{out}: exists and is not a DCP folder, so --overwrite will "
                                "not delete it; choose another output folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.fsdpckpt-tmp-", dir=out.parent))
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    tensors = objects = nbytes = 0
    try:
        with open(stage / _DATA_FILE, "wb") as data:
            for path, value in _entries(source, key or None):
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
                    entries[fqn] = TensorStorageMetadata(
                        TensorProperties.create_from_tensor(tensor), tensor.size(),
                        [ChunkStorageMetadata(zeros, tensor.size())])
                    storage[MetadataIndex(fqn, zeros, 0)] = _StorageInfo(
                        _DATA_FILE, offset, data.tell() - offset)
                    tensors, nbytes = tensors + 1, nbytes + tensor.nbytes
                    if progress:
                        progress(tensor.nbytes)
                    del tensor, value
                else:
                    blob = io.BytesIO()
                    torch.save(value, blob)
                    data.write(blob.getbuffer())
                    entries[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = _StorageInfo(_DATA_FILE, offset,
                                                               data.tell() - offset)
                    objects += 1
            data.flush()
            os.fsync(data.fileno())
        metadata = Metadata(entries, planner_data=planner, storage_data=storage,
                            version="1.0.0")
        with open(stage / ".metadata", "wb") as meta:
            pickle.dump(metadata, meta)
            meta.flush()
            os.fsync(meta.fileno())
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    except BaseException as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # torch.save turns Ctrl-C into a RuntimeError
        raise
    return ConvertResult(out, tensors, objects, nbytes)
