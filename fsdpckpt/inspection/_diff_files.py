"""The file sides of a diff (safetensors files and indexes, ``torch.save`` files, merged
and Hugging Face folders), and :func:`open_source`, which picks the reader for a path.
The DCP side and what every source shares are in :mod:`fsdpckpt.inspection._diff_sources`.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.rawio import read_exact
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt.dcp._objects import loads, to_torch
from fsdpckpt.dcp.dtypes import DType, dtype_from_name
from fsdpckpt.dcp.layout import find_layout
from fsdpckpt.dcp.metadata import KeyPath
from fsdpckpt.dcp.reader import is_dcp_folder
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from fsdpckpt.formats.safetensors import OBJECTS_KEY, RESERVED_NAME
from fsdpckpt.inspection._diff_sources import (
    _FROM_SAFETENSORS,
    _MAX_HEADER,
    MERGED_FILES,
    DcpSource,
    Source,
    TensorInfo,
    _names,
)
from fsdpckpt.merging._keys import clean_key
from fsdpckpt.merging._validate import choose_parts

__all__ = ["SafetensorsSource", "TorchSource", "open_source"]


class SafetensorsSource(Source):
    """safetensors files (one, or an index's shards): headers parsed and checked here, data
    read with ``pread`` at known offsets (a memory map would count every page read as
    resident memory)."""

    kind = "safetensors"

    def __init__(self, files: list[Path], *, path: Path, keep_keys: bool) -> None:
        self.path = path
        self._fds: list[int] = []
        self._where: dict[str, tuple[int, int, str]] = {}  # name -> (fd, data start, file)
        self._objects: dict[str, Any] = {}
        infos: list[TensorInfo] = []
        try:
            for file in files:
                infos += self._open(file, keep_keys)
        except BaseException:
            self.close()
            raise
        self.tensors = {}
        for info in infos:
            if info.name in self.tensors:
                raise NotACheckpointError(f"{path}: two tensors are both named '{info.name}'"
                                          + ("" if keep_keys else " once wrapper segments are "
                                             "dropped; pass --keep-keys"))
            self.tensors[info.name] = info

    def _open(self, file: Path, keep_keys: bool) -> list[TensorInfo]:
        fd = os.open(file, os.O_RDONLY)
        self._fds.append(fd)
        size = os.fstat(fd).st_size
        source = str(file)
        if size < 8:
            raise CorruptCheckpointError(f"{file}: not a safetensors file (only {size} bytes)")
        (length,) = struct.unpack("<Q", read_exact(fd, 8, 0, source=source))
        if length > min(size - 8, _MAX_HEADER):
            raise CorruptCheckpointError(f"{file}: a safetensors header of {length} bytes in a "
                                         f"file of {size}: it is truncated or damaged")
        try:
            header = parse_json(bytes(read_exact(fd, length, 8, source=source)))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{file}: its safetensors header is {exc}") from None
        if not isinstance(header, dict):
            raise CorruptCheckpointError(f"{file}: its safetensors header is not a JSON object")
        data_start, data_size = 8 + length, size - 8 - length
        meta = header.pop(RESERVED_NAME, None) or {}
        infos = []
        for stored, entry in header.items():
            name = stored if keep_keys else clean_key(stored)
            dtype, shape = _header_entry(file, stored, entry, data_size)
            self._where[name] = (fd, data_start + entry["data_offsets"][0], source)
            infos.append(TensorInfo(name, dtype, shape))
        if isinstance(meta, dict) and OBJECTS_KEY in meta:
            try:
                values = loads(meta[OBJECTS_KEY])
            except ValueError as exc:
                raise CorruptCheckpointError(f"{file}: its fsdpckpt metadata is garbled "
                                             f"({exc})") from None
            self._objects.update({n if keep_keys else clean_key(n): v for n, v in values.items()})
        return infos

    def object_names(self) -> list[str]:
        return list(self._objects)

    def objects(self) -> dict[str, Any]:
        return {name: to_torch(value) for name, value in self._objects.items()}

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        from fsdpckpt._io.rawio import pread_into

        info = self.tensors[name]
        fd, start, source = self._where[name]
        first = _row_major_index(info.shape, offsets)  # a box is a contiguous run
        pread_into(fd, out, start + first * info.dtype.itemsize,
                   source=f"{source} (tensor '{name}')")

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def _row_major_index(shape: Sequence[int], index: Sequence[int]) -> int:
    flat = 0
    for size, at in zip(shape, index):
        flat = flat * size + at
    return flat


def _header_entry(file: Path, name: str, entry: Any, data_size: int) -> tuple[DType,
                                                                              tuple[int, ...]]:
    """A header entry's dtype and shape, its byte range checked against the data present."""
    where = f"{file}: tensor '{name}'"
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{where}: its header entry is not an object")
    dtype = _FROM_SAFETENSORS.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise NotACheckpointError(f"{where}: the dtype {entry.get('dtype')!r} is one "
                                  "fsdpckpt does not read")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
            and isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets)):
        raise CorruptCheckpointError(f"{where}: its header entry has no valid 'shape' and "
                                     "'data_offsets'")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise CorruptCheckpointError(f"{where}: bytes {begin}..{end} lie outside the "
                                     f"{data_size} bytes of data: the file is truncated")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CorruptCheckpointError(f"{where}: {end - begin} bytes for shape {shape} of "
                                     f"{dtype.name}; the header is damaged")
    return dtype, tuple(shape)


class TorchSource(Source):
    """``torch.save`` files, loaded through torch's weights-only allowlist with ``mmap``, so
    a tensor's pages are read as its boxes are."""

    kind = "torch"

    def __init__(self, files: list[tuple[Path, str]], *, path: Path, keep_keys: bool) -> None:
        import torch

        from fsdpckpt._torch import flatten_state_dict
        from fsdpckpt.merging.to_dcp import _torch_load

        self.path = path
        entries: list[tuple[KeyPath, Any]] = []
        for file, kind in files:
            state = _torch_load(file, kind)
            if not isinstance(state, dict):
                raise NotACheckpointError(f"{file}: holds a {type(state).__name__}, not a "
                                          "state dict of names to tensors")
            flat, mapping = flatten_state_dict(state)
            entries += [(tuple(mapping[fqn]), value) for fqn, value in flat.items()]
        names = _names([p for p, _ in entries], keep_keys=keep_keys, source=path)
        self._values = dict(zip(names, (v for _, v in entries)))
        self.tensors = {}
        for name, value in self._values.items():
            if isinstance(value, torch.Tensor):
                dtype = dtype_from_name(str(value.dtype))
                if dtype is None:
                    raise NotACheckpointError(f"{path}: tensor '{name}' has the dtype "
                                              f"{value.dtype}, which fsdpckpt does not read")
                self.tensors[name] = TensorInfo(name, dtype, tuple(value.shape))

    def object_names(self) -> list[str]:
        return [n for n in self._values if n not in self.tensors]

    def objects(self) -> dict[str, Any]:
        return {n: self._values[n] for n in self.object_names()}

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        import torch

        value = self._values[name]
        box = value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        torch.frombuffer(out, dtype=value.dtype, count=math.prod(sizes)).view(sizes).copy_(box)


def _file_source(path: Path, *, keep_keys: bool, shown: Path) -> Source:
    from fsdpckpt.merging.to_dcp import _shards, _sniff

    files = _shards(path)
    kinds = [(f, _sniff(f)) for f in files]
    if all(kind == "safetensors" for _, kind in kinds):
        return SafetensorsSource(files, path=shown, keep_keys=keep_keys)
    if any(kind == "safetensors" for _, kind in kinds):
        raise NotACheckpointError(f"{path}: its shards mix safetensors and torch.save files")
    return TorchSource(kinds, path=shown, keep_keys=keep_keys)


def open_source(path: str | os.PathLike[str], *, optimizer: bool = False,
                model_index: int | None = None, keep_keys: bool = False) -> Source:
    """Open ``path`` as one side of a diff.

    Args:
        path: a DCP folder; a whole checkpoint (Accelerate's or HF Trainer's layout: its
            model folder, or with ``optimizer`` its optimizer folder); a ``.safetensors``,
            ``.bin``/``.pt`` file or shard index; or a folder holding a merged or Hugging
            Face model (:data:`MERGED_FILES`; with ``optimizer``, the optimizer's).
        optimizer: compare the optimizer state instead of the model.
        model_index: which model of a checkpoint holding several (``pytorch_model_fsdp_N``).
        keep_keys: keep wrapper segments in names.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        NotACheckpointError, CorruptCheckpointError, UnsafePickleError: it cannot be read.
    """
    p = location(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such file or folder; check the path.")
    if isinstance(p, RemotePath):
        if is_dcp_folder(p):
            return DcpSource(p, keep_keys=keep_keys)
        raise NotACheckpointError(f"{p}: only DCP folders are read from object storage yet "
                                  "(merged files, per-rank files: not yet); download it first")
    if p.is_file():
        return _file_source(p, keep_keys=keep_keys, shown=p)
    if is_dcp_folder(p):
        return DcpSource(p, keep_keys=keep_keys)
    wanted = MERGED_FILES["optimizer" if optimizer else "model"]
    for name in wanted:
        if (p / name).is_file():
            return _file_source(p / name, keep_keys=keep_keys, shown=p / name)
    try:
        layout = find_layout(p)
    except NotACheckpointError:
        raise NotACheckpointError(
            f"{p}: neither a checkpoint (no .metadata, no pytorch_model_fsdp_0/) nor a merged "
            f"model ({', '.join(wanted)}); pass a DCP folder, a checkpoint folder, or a "
            ".safetensors or .bin file") from None
    parts = choose_parts(layout, optimizer=optimizer, model_index=model_index)
    if optimizer:
        parts = [part for part in parts if part.kind == "optimizer"] or parts
    return DcpSource(parts[-1].path if optimizer else parts[0].path, keep_keys=keep_keys)
