"""``load_full_state_dict``: a whole (unsharded) state dict in memory, for those who want one.

From a DCP folder it gives exactly what torch's ``dcp_to_torch_save`` saves
(nested by the stored key paths, top-level key included); from a merged file
it gives the merged state dict, nested again where the merge kept key paths.
Unlike the merge, this holds the whole state dict: it is for models that fit.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from fsdpckpt import _torch
from fsdpckpt._io import storage
from fsdpckpt._io.rawio import reusing_scratch
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp._nesting import unflatten
from fsdpckpt.dcp._objects import loads, read_object, to_torch, torch_load_allowlisted
from fsdpckpt.dcp._trainers import trainer_meta, with_trainer_meta
from fsdpckpt.dcp.checks import require_whole
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.layout import find_layout, refuse_links_out, refuse_rank_file
from fsdpckpt.dcp.parts import open_part
from fsdpckpt.dcp.reader import DcpFolder
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from fsdpckpt.formats._shards import read_shard_index
from fsdpckpt.formats.safetensors import KEY_PATHS_KEY, OBJECTS_KEY
from fsdpckpt.merging._copy import MemorySink, place_stored_chunk
from fsdpckpt.merging._runs import chunk_runs
from fsdpckpt.merging._validate import choose_parts

__all__ = ["load_full_state_dict", "shard_files"]

# PEFT's adapter file after the model's: an adapter export loads as the tensors it holds.
_MERGED_NAMES = ["model.safetensors.index.json", "model.safetensors",
                 "pytorch_model.bin.index.json", "pytorch_model.bin", "adapter_model.safetensors",
                 "optimizer.safetensors.index.json", "optimizer.safetensors",
                 "optimizer.bin.index.json", "optimizer.bin"]


def _empty(dtype: DType, shape: tuple[int, ...]) -> tuple[Any, MemorySink]:
    """A tensor to fill, and a sink writing into its memory."""
    import torch

    memory = bytearray(math.prod(shape) * dtype.itemsize)
    if not memory:
        return torch.empty(shape, dtype=_torch.dtype(dtype.name)), MemorySink(memoryview(memory))
    flat = torch.frombuffer(memory, dtype=_torch.dtype(dtype.name))  # keeps ``memory`` alive
    return flat.view(shape), MemorySink(memoryview(memory))


def _from_checkpoint(path: Place) -> dict[Any, Any] | None:
    """The model of the checkpoint folder ``path``, read, or None when it holds no DCP part.

    The part is found and opened as merge finds and opens it (:func:`~fsdpckpt.dcp.layout.
    find_layout`, the merge's choice, :func:`~fsdpckpt.dcp.parts.open_part`), so every
    layout merge reads loads here too: a DCP folder, per-rank ``torch.save`` files
    (Accelerate ``use_dcp=False``, VeRL), torch's ``HuggingFaceStorageWriter`` files, or
    the model folder of a whole Accelerate / HF Trainer checkpoint.

    Raises:
        NotACheckpointError: the folder holds several models, or several checkpoints and
            no merged output (the message lists them: pass one).
    """
    refuse_links_out(path)  # said as such, not taken below for "no DCP part here"
    try:
        layout = find_layout(path)
    except NotACheckpointError as exc:
        # A folder of checkpoints holding no merged output: listed, as every verb lists them.
        if exc.checkpoints and not any((path / n).is_file() for n in _MERGED_NAMES):
            raise
        return None  # a merged output, or nothing this reads (_merged_output says which)
    if layout.style == "lightning":
        return _lightning(layout.path)
    if layout.style in ("torchtitan", "torchtune"):
        # The folder whole, as their own consolidation (torch's dcp_to_torch_save, which
        # torchtitan's docs name) gives it: model, optimizer, scheduler, dataloader, state.
        return _from_folder(open_part(layout.path, layout.path.name), [])
    models = [part for part in layout.parts if part.kind == "model"]
    if layout.style != "dcp" and len(models) > 1:  # merge's refusal names its --model-index
        raise NotACheckpointError(f"{path}: holds {len(models)} models; pass one of: "
                                  + ", ".join(str(part.path) for part in models))
    chosen = choose_parts(layout)
    if len(chosen) != 1:  # a folder of several plain DCP folders
        raise NotACheckpointError(f"{path}: holds {len(chosen)} DCP folders; pass one of: "
                                  + ", ".join(str(part.path) for part in chosen))
    part = chosen[0]
    return _from_folder(open_part(part.path, part.name), [])


def _lightning(path: Place) -> dict[Any, Any]:
    """What Lightning's own ``consolidate_checkpoint`` gives for its ``*.ckpt/`` folder: the
    whole DCP folder (model and optimizer) with ``meta.pt``'s entries at the top level."""
    meta = trainer_meta(path)  # decoded first: a refused meta.pt costs no tensor read
    whole = _from_folder(open_part(path, path.name), [])  # its own name: the folder whole
    return with_trainer_meta(whole, meta) if meta is not None else whole


@reusing_scratch()
def _from_folder(folder: DcpFolder, values: list[tuple[tuple, Any]]) -> dict[Any, Any]:
    path = folder.path
    require_whole(folder)  # before anything is allocated
    items: list[tuple[tuple, Any]] = [(key, to_torch(value)) for key, value in values]
    with DataFiles(path) as files:
        for tensor in folder.metadata.tensors:
            full, sink = _empty(tensor.dtype, tensor.shape)
            for chunk in tensor.chunks:
                # Straight into the tensor's memory: nothing is held but the tensor itself.
                place_stored_chunk(files, tensor, chunk, chunk_runs(tensor.shape, chunk),
                                   tensor.dtype, sink, 0)
            items.append((tensor.key_path, full))
        for obj in folder.metadata.objects:
            if obj.file is None:
                raise NotACheckpointError(f"{path}: object '{obj.name}' has no storage entry "
                                          "in .metadata")
            value = read_object(files.open(obj.file).file, obj, source=str(path / str(obj.file)))
            items.append((obj.key_path, to_torch(value)))
    return unflatten(items)


def _from_safetensors(files: list[Path]) -> dict[Any, Any]:
    from safetensors import SafetensorError, safe_open

    from fsdpckpt.merging.to_dcp import key_paths

    flat: dict[str, Any] = {}
    paths: dict[str, list] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                meta = handle.metadata() or {}
                flat.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118 - not a dict
        except SafetensorError as exc:
            detail = (str(exc).splitlines() or ["?"])[0][:200]
            raise CorruptCheckpointError(f"{file}: not a readable safetensors file ({detail}); "
                                         "it is truncated or damaged.") from None
        try:  # JSON from the file: checked (depth, schema) so it fails as one error
            if OBJECTS_KEY in meta:
                flat.update(to_torch(loads(meta[OBJECTS_KEY])))
            if KEY_PATHS_KEY in meta:
                paths.update(key_paths(meta[KEY_PATHS_KEY]))
        except ValueError as exc:
            if isinstance(exc, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"{file}: its fsdpckpt metadata is garbled ({exc}); "
                                         "merge it again.") from None
    if not paths:
        return flat
    return unflatten((tuple(paths.get(name, [name])), value) for name, value in flat.items())


#: How a shard index that cannot be read is refused here (formats._shards.Wording).
_INDEX_WORDING = {
    "size": "{index}: {detail} bytes is too large for a shard index; pass the "
            "model.safetensors.index.json a merge wrote",
    "json": "{index}: {detail}; the file is damaged or was not written as JSON.",
    "outside": "{index}: {detail}; a shard index names the files beside it",
    "*": "{index}: not a shard index (a JSON object with a 'weight_map' of names to file "
         "names).",
}


def shard_files(path: Place) -> list[Place]:
    """The files a shard index (``*.index.json``) lists, in order; any other path alone
    (local, or on object storage).

    Raises:
        NotACheckpointError: the index is not a JSON object with a ``weight_map``, is
            too large to be one, or names a file outside its folder.
    """
    if path.name.endswith(".index.json"):
        return read_shard_index(path, wording=_INDEX_WORDING).files
    return [path]


def _deep_update(target: dict[Any, Any], extra: dict[Any, Any]) -> None:
    # Shards of a nested state dict (optimizer state) each hold part of the same subtrees.
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def _from_file(path: Path) -> dict[Any, Any]:
    if path.name.endswith(".index.json"):
        shards = [cast(Path, f) for f in shard_files(path)]
        if path.name.startswith(("model.safetensors", "optimizer.safetensors")) or \
                shards and shards[0].suffix == ".safetensors":
            return _from_safetensors(shards)
        merged: dict[Any, Any] = {}
        for shard in shards:
            _deep_update(merged, _from_file(shard))
        return merged
    if path.suffix == ".safetensors":
        return _from_safetensors([path])
    return torch_load_allowlisted(path)


def _from_merged(path: Place) -> dict[Any, Any]:
    """A merged file (or shard index), local or on object storage.

    safetensors' and torch's loaders read local files only: from object storage, the file
    and the shards its index lists are copied (:func:`storage.local_file`), each under its
    name relative to the index, into a temporary folder removed before this returns (the
    tensors loaded no longer need it: they are copies, or mappings that outlive the name).
    """
    names = [path.name]
    if path.name.endswith(".index.json"):
        names += read_shard_index(path, wording=_INDEX_WORDING).names
    with tempfile.TemporaryDirectory(prefix="fsdpckpt-load-") as scratch:
        def folder_of(name: str) -> Callable[[], Path]:  # where a copy of ``name`` goes
            def make() -> Path:
                folder = Path(scratch, name).parent  # the index refused '..' and '/abs'
                folder.mkdir(parents=True, exist_ok=True)
                return folder
            return make

        local = storage.local_file(path, folder_of(path.name))
        for name in names[1:]:
            storage.local_file(path.parent / name, folder_of(name))
        return _from_file(local)


def load_full_state_dict(path: str | os.PathLike[str], *,
                         storage_options: dict[str, Any] | None = None) -> dict[Any, Any]:
    """Load the full, unsharded state dict of a DCP folder or of a merged output.

    Args:
        path: a DCP folder; a folder of per-rank ``torch.save`` files (Accelerate's
            ``use_dcp=False``, VeRL's: the model's are read); a folder written by torch's
            ``HuggingFaceStorageWriter`` (per-rank shards, or consolidated); a merged
            ``.safetensors`` / ``.bin`` file or shard index; or a folder holding one merged output
            (``model.safetensors``...). Local, or a URL on object storage (merged files are
            downloaded to a temporary folder, removed before this returns).
        storage_options: for URLs (``s3://``...): the fsspec filesystem's options
            (``{"endpoint_url": ..., "profile": ...}``); None: the backend's defaults
            (``AWS_*`` variables, ``~/.aws``...). See docs/remote.md.

    Returns:
        For a DCP folder, the nested dict ``dcp_to_torch_save`` would save. For Lightning's
        ``*.ckpt/`` folder, what Lightning's own ``consolidate_checkpoint`` saves: that dict
        (``model``, ``optimizer_0``...) with ``meta.pt``'s entries (``epoch``, ``loops``,
        ``lr_schedulers``...) at the top level. For torchtune's ``dist_epoch_N/`` and
        torchtitan's ``step-N/``, the folder whole, as ``dcp_to_torch_save`` gives it
        (torchtitan's model entries at the top level beside ``optimizer``,
        ``lr_scheduler``, ``dataloader`` and ``train_state``; torchtune's under ``model``
        beside ``optimizer``, ``seed``, ``epochs_run``...). For a merged
        output, the merged state dict, nested again by the key paths the merge kept
        (optimizer state), with non-tensor entries restored.

    Example:
        >>> sd = load_full_state_dict("ckpt/pytorch_model_fsdp_0")
        >>> sd["model"]["layers.0.weight"].shape
        torch.Size([4096, 4096])
    """
    p = location(path, storage_options=storage_options)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such file or folder; check the path.")
    if p.is_file():
        refuse_rank_file(p)  # torch would call a healthy rank file a damaged archive
        return _from_merged(p)
    if (model := _from_checkpoint(p)) is not None:
        return model
    return _from_merged(_merged_output(p))


def _merged_output(folder: Place) -> Place:
    """The merged output (its index when sharded) a folder holds."""
    found = [folder / name for name in _MERGED_NAMES if (folder / name).is_file()]
    if not found:
        raise NotACheckpointError(f"{folder}: neither a DCP folder nor a merged output "
                                  "(model.safetensors, pytorch_model.bin...); pass a file or a "
                                  "DCP folder")
    return found[0]
