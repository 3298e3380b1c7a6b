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

import io
import os
import pickle
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.remote import RemotePath, download, location
from fsdpckpt._progress import ProgressFactory, start_progress
from fsdpckpt._torch import flatten_state_dict, storage_info
from fsdpckpt.dcp._objects import loads, torch_load_allowlisted
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FsdpCkptError,
    NotACheckpointError,
    UnsafePickleError,
)
from fsdpckpt.formats.safetensors import KEY_PATHS_KEY, OBJECTS_KEY
from fsdpckpt.merging.writer import OutputExistsError

__all__ = ["convert", "ConvertResult", "MODEL_FILES"]

_DATA_FILE = "__0_0.distcp"

#: What convert reads from a folder, first found first: a merged (or Hugging Face) model.
MODEL_FILES = ("model.safetensors.index.json", "model.safetensors",
               "pytorch_model.bin.index.json", "pytorch_model.bin")

_ACCEPTS = "convert reads a .safetensors file, a .bin/.pt file written by torch.save, or a " \
           "shard index (*.index.json)"
# torch.save's legacy (non-zip) format starts by pickling this number.
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` wrote.

    Attributes:
        path: the DCP folder written.
        tensors: tensor entries. objects: non-tensor entries. bytes: tensor bytes.
        source: the file read (a folder given to :func:`convert` resolves to its model file).
    """

    path: Path | RemotePath
    tensors: int
    objects: int
    bytes: int
    source: Path | RemotePath | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _head(file: Path | RemotePath) -> tuple[bytes, int, bool]:
    """The first 64 bytes of ``file``, its size, and whether it reads as a zip archive."""
    if isinstance(file, RemotePath):
        remote = file.open_file()
        first = bytearray(min(64, remote.size))
        remote.read_at(memoryview(first), 0)
        try:
            is_zip = first.startswith(_ZIP_MAGIC) and zipfile.is_zipfile(remote.file())
        finally:
            remote.close()
        return bytes(first), remote.size, is_zip
    with open(file, "rb") as handle:
        head = handle.read(64)
        size = os.fstat(handle.fileno()).st_size
    return head, size, head.startswith(_ZIP_MAGIC) and zipfile.is_zipfile(file)


def _sniff(file: Path | RemotePath) -> str:
    """``"safetensors"`` or ``"torch"`` (``"torch-legacy"`` for the pre-zip format), by content.

    Raises:
        NotACheckpointError: neither format; CorruptCheckpointError: a safetensors header
            that cannot be whole.
    """
    head, size, is_zip = _head(file)
    if head.startswith(_ZIP_MAGIC):
        if not is_zip:  # torch.save's zip directory is written last
            raise CorruptCheckpointError(
                f"{file}: a torch.save archive without its zip directory at the end: it is "
                "truncated; download or save it again.")
        return "torch"
    if head.startswith(b"\x80") and _LEGACY_MAGIC in head[:32]:
        return "torch-legacy"
    if len(head) >= 9 and head[8:9] == b"{":
        (header,) = struct.unpack("<Q", head[:8])
        if 8 + header > size:
            raise CorruptCheckpointError(
                f"{file}: a safetensors file whose header says {8 + header} bytes, but the "
                f"file has {size}: it is truncated; download or merge it again.")
        return "safetensors"
    what = "the file is empty" if not head else "it holds text" if _is_text(head) else \
        "its first bytes match neither"
    raise NotACheckpointError(f"{file}: not a safetensors or torch.save file ({what}); "
                              f"{_ACCEPTS}.")


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _shards(path: Path | RemotePath) -> list[Path | RemotePath]:
    """The files to read: those a shard index lists, else ``path`` alone; each checked."""
    if not path.name.endswith(".index.json"):
        return [path]
    try:
        index = parse_json(path.read_bytes())
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise TypeError("no 'weight_map' object")
        names = list(dict.fromkeys(weight_map.values()))
        if not all(isinstance(n, str) and n for n in names):
            raise TypeError("a file name is not a string")
        # Shards lie beside their index (symlinks, as in the Hugging Face cache, are fine):
        # an index may not send us to read files elsewhere.
        if outside := [n for n in names if os.path.isabs(n) or ".." in Path(n).parts]:
            raise ValueError(f"'{outside[0]}' lies outside the index's folder")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise NotACheckpointError(
            f"{path}: not a shard index (a JSON file with a 'weight_map' of names to files: "
            f"{_first_line(exc)}); {_ACCEPTS}.") from None
    files = [path.parent / name for name in names]
    for file in files:
        if not file.is_file():
            raise CheckpointNotFoundError(f"{file}: listed in {path.name} but missing; copy "
                                          "every shard beside the index.")
    return files


def _resolve(source: Path | RemotePath) -> Path | RemotePath:
    """The file to convert: ``source`` itself, or the model file of a folder.

    A folder holding a merged or Hugging Face model stands for its model file (the first of
    :data:`MODEL_FILES` present, the order ``load_full_state_dict`` uses). A checkpoint
    folder is already DCP: the message points to ``merge``.
    """
    if not source.exists():
        raise CheckpointNotFoundError(f"{source}: no such file or folder; check the path.")
    if not source.is_dir():
        return source
    for name in MODEL_FILES:
        if (source / name).is_file():
            return source / name
    from fsdpckpt.dcp.layout import find_layout

    try:
        find_layout(source)
    except (CheckpointNotFoundError, NotACheckpointError):
        pass
    else:
        raise NotACheckpointError(
            f"{source}: is a DCP checkpoint already; convert turns a full .safetensors or "
            f".bin file into one. To get a full file from it: fsdpckpt merge {source} OUT_DIR")
    entries = source.iterdir() if isinstance(source, RemotePath) else \
        [Path(e.path) for e in os.scandir(source)]
    candidates = sorted(e.name for e in entries if e.is_file() and
                        e.name.endswith((".safetensors", ".bin", ".pt", ".index.json")))
    hint = f"; pass one of its files, e.g. {source / candidates[0]}" if candidates else \
        f"; {_ACCEPTS}"
    raise NotACheckpointError(f"{source}: is a folder without {' or '.join(MODEL_FILES[1::2])}"
                              f"{hint}.")


def _torch_load(file: Path, kind: str) -> Any:
    """``torch.load`` through torch's weights-only allowlist; its failures as our errors."""
    try:
        # mmap: tensors are paged in as each is written, not loaded all at once (the legacy
        # format cannot be mapped).
        return torch_load_allowlisted(file, mmap=kind == "torch")
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
                                     f"({_first_line(exc)}); it is truncated or damaged.") from None


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
                                             f"({_first_line(exc)})") from None
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                yield prefix + tuple(paths.get(name, [name])), handle.get_tensor(name)
    except SafetensorError as exc:
        raise CorruptCheckpointError(f"{file}: not a readable safetensors file "
                                     f"({_first_line(exc)}); it is truncated or damaged.") \
            from None
    for name, value in objects:
        yield prefix + tuple(paths.get(name, [name])), value


_DOWNLOADS = ".downloads"


def _local_copies(files: list[tuple[Path | RemotePath, str]],
                  stage: Path) -> list[tuple[Path, str]]:
    """``files`` as local files: a remote one downloaded into ``stage``'s download folder
    (under its own name, in a folder of its own), a local one as it is."""
    local: list[tuple[Path, str]] = []
    for number, (file, kind) in enumerate(files):
        if isinstance(file, RemotePath):
            folder = stage / _DOWNLOADS / str(number)
            folder.mkdir(parents=True)
            download(file, folder / file.name)
            local.append((folder / file.name, kind))
        else:
            local.append((file, kind))
    return local


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
    if isinstance(out, RemotePath):  # built locally, uploaded with .metadata last
        from fsdpckpt.merging._remote_out import publish_folder

        done, _ = publish_folder(out, lambda folder: convert(
            full_file, folder, key=key, progress=progress, storage_options=storage_options),
            overwrite=overwrite, last=(".metadata",))
        return replace(done, path=out)
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    source = _resolve(location(full_file, storage_options=storage_options))
    out = Path(out_dir)
    files = [(file, _sniff(file)) for file in _shards(source)]  # all checked before writing
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
    total = sum(file.stat().st_size for file, _kind in files)
    callback, reported = start_progress(progress, total, len(files)), 0
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.fsdpckpt-tmp-", dir=out.parent))
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    tensors = objects = nbytes = 0
    local: list[tuple[Path, str]] = []
    try:
        local = _local_copies(files, stage)
        with open(stage / _DATA_FILE, "wb") as data:
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
                    entries[fqn] = TensorStorageMetadata(
                        TensorProperties.create_from_tensor(tensor), tensor.size(),
                        [ChunkStorageMetadata(zeros, tensor.size())])
                    storage[MetadataIndex(fqn, zeros, 0)] = storage_info(
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
                    entries[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = storage_info(_DATA_FILE, offset,
                                                               data.tell() - offset)
                    objects += 1
            data.flush()
            os.fsync(data.fileno())
        if callback and reported < total:  # headers and pickles: the bar ends at 100%
            callback(total - reported)
        metadata = Metadata(entries, planner_data=planner, storage_data=storage,
                            version="1.0.0")
        with open(stage / ".metadata", "wb") as meta:
            pickle.dump(metadata, meta)
            meta.flush()
            os.fsync(meta.fileno())
        shutil.rmtree(stage / _DOWNLOADS, ignore_errors=True)  # no part of the output
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    except FsdpCkptError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        copies = {str(copy): str(file) for (copy, _), (file, _) in zip(local, files)
                  if copy != file}
        message = str(exc)
        for copy, remote in copies.items():  # name the remote file, not the download
            message = message.replace(copy, remote)
        if message == str(exc):
            raise
        raise type(exc)(message) from None
    except BaseException as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # torch.save turns Ctrl-C into a RuntimeError
        raise
    return ConvertResult(out, tensors, objects, nbytes, source)
