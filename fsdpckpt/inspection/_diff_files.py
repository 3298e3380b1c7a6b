"""The file sides of a diff (safetensors files and indexes, ``torch.save`` files, merged
and Hugging Face folders), and :func:`open_source`, which picks the reader for a path.
The DCP side and what every source shares are in :mod:`fsdpckpt.inspection._diff_sources`.

Any of them may be on object storage: safetensors files are read by ranged reads (headers,
then each box), and a ``torch.save`` file is downloaded in bounded pieces into a temporary
folder first (torch's memory-mapped loader reads local files), removed when the side closes.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.rawio import ReadAt
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._hfstorage import parse_header
from fsdpckpt.dcp._objects import loads, to_torch
from fsdpckpt.dcp._trainers import trainer_of
from fsdpckpt.dcp.dtypes import dtype_from_name
from fsdpckpt.dcp.layout import find_layout, refuse_links_out
from fsdpckpt.dcp.metadata import KeyPath
from fsdpckpt.dcp.reader import is_dcp_folder
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FsdpCkptError,
    NotACheckpointError,
)
from fsdpckpt.formats.safetensors import OBJECTS_KEY
from fsdpckpt.inspection._diff_sources import (
    MERGED_FILES,
    DcpSource,
    Source,
    TensorInfo,
    _names,
)
from fsdpckpt.inspection._diff_tiles import Piece
from fsdpckpt.merging._keys import clean_key
from fsdpckpt.merging._validate import choose_parts

__all__ = ["SafetensorsSource", "TorchSource", "open_source", "value_info", "read_value_box"]


def value_info(path: Place, name: str, value: Any) -> TensorInfo:
    """The :class:`TensorInfo` of a tensor held in memory (``value``), named ``name``.

    Raises:
        NotACheckpointError: its dtype is one fsdpckpt does not read (naming ``path``).
    """
    dtype = dtype_from_name(str(value.dtype))
    if dtype is None:
        raise NotACheckpointError(f"{path}: tensor '{name}' has the dtype {value.dtype}, "
                                  "which fsdpckpt does not read")
    return TensorInfo(name, dtype, tuple(value.shape))


def read_value_box(value: Any, offsets: tuple[int, ...], sizes: tuple[int, ...],
                   out: memoryview) -> Any:
    """Fill ``out`` with the box ``offsets``/``sizes`` of the in-memory tensor ``value``
    (:meth:`Source.read`); returns the box read, a view of ``value``."""
    import torch

    box = value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    torch.frombuffer(out, dtype=value.dtype, count=math.prod(sizes)).view(sizes).copy_(box)
    return box


class SafetensorsSource(Source):
    """safetensors files (one, or an index's shards): headers parsed and checked here, data
    read with ``pread`` at known offsets (a memory map would count every page read as
    resident memory)."""

    kind = "safetensors"

    def __init__(self, files: list[Place], *, path: Place,
                 keep_keys: bool) -> None:
        self.path = path
        self._fds: list[storage.OpenFile] = []
        # name -> (descriptor or remote file, data start, file)
        self._where: dict[str, tuple[int | ReadAt, int, str]] = {}
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
                                             "dropped; pass keep_keys=True"))
            self.tensors[info.name] = info

    def _open(self, file: Place, keep_keys: bool) -> list[TensorInfo]:
        opened = storage.open_file(file)
        self._fds.append(opened)
        fd, size = storage.descriptor(opened), opened.size
        source = str(file)
        header = parse_header(fd, size, source)  # the one safetensors header parser
        meta = header.metadata
        infos = []
        for stored, (dtype, shape, begin, _end) in header.tensors.items():
            name = stored if keep_keys else clean_key(stored)
            self._where[name] = (fd, header.data_start + begin, source)
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

    def pieces(self, name: str) -> list[Piece] | None:
        info = self.tensors[name]
        fd, start, source = self._where[name]
        stride = tuple(math.prod(info.shape[d + 1:]) for d in range(len(info.shape)))
        return [Piece((0,) * len(info.shape), info.shape, fd, start, 0, stride,
                      info.dtype.itemsize, f"{source} (tensor '{name}')")]

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
            fd.close()


def _row_major_index(shape: Sequence[int], index: Sequence[int]) -> int:
    flat = 0
    for size, at in zip(shape, index):
        flat = flat * size + at
    return flat


def _little_endian(file: Path) -> bool:
    """Whether torch maps the archive's storages as they are: a big-endian archive is
    byte-swapped in place after mapping, so its pages are private copies, not the file's."""
    import sys
    import zipfile

    with zipfile.ZipFile(file) as archive:
        orders = [n for n in archive.namelist() if n.endswith("/byteorder")]
        order = archive.read(orders[0]).decode(errors="replace") if orders else "little"
    return order == sys.byteorder == "little"


def _release_pages(box: Any) -> None:
    """Drop the pages a box of a memory-mapped tensor spans from this process's resident
    set (``MADV_DONTNEED``): read once, they are not needed again, and without this every
    page read of a ``.bin`` counts toward peak memory (the file stays in the page cache).

    Only for storages mapped read-only in effect from an unmodified file (torch maps them
    private, and nothing writes to them): dropped pages are read back from the file if
    touched again. Does nothing where ``madvise`` is not available.
    """
    if _MADVISE is None or not box.numel():
        return
    size = box.element_size()
    low = sum(min(0, (s - 1) * st) for s, st in zip(box.shape, box.stride()))
    high = sum(max(0, (s - 1) * st) for s, st in zip(box.shape, box.stride())) + 1
    start = box.data_ptr() + low * size
    end = box.data_ptr() + high * size
    first = start - start % _PAGE
    last = -(-end // _PAGE) * _PAGE
    _MADVISE(first, last - first, _MADV_DONTNEED)


def _madvise() -> Any:
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADVISE = _madvise()


class TorchSource(Source):
    """``torch.save`` files, loaded through torch's weights-only allowlist with ``mmap``, so
    a tensor's pages are read as its boxes are, and released once compared
    (:func:`_release_pages`), so that peak memory does not grow with the file."""

    kind = "torch"

    def __init__(self, files: list[tuple[Place, str]], *, path: Place,
                 keep_keys: bool) -> None:
        self.path = path
        self._downloads: Path | None = None
        try:
            self._load(files, keep_keys)
        except BaseException:
            self.close()
            raise

    def _local(self, file: Place) -> Path:
        """``file``, downloaded into this side's temporary folder when it is remote."""
        return storage.local_file(file, self._scratch)

    def _scratch(self) -> Path:
        """A new empty folder in this side's temporary folder (made on first use)."""
        if self._downloads is None:
            self._downloads = Path(tempfile.mkdtemp(prefix="fsdpckpt-diff-"))
        folder = self._downloads / str(len(list(self._downloads.iterdir())))
        folder.mkdir()
        return folder

    def _load(self, files: list[tuple[Place, str]], keep_keys: bool) -> None:
        import torch

        from fsdpckpt._torch import flatten_state_dict
        from fsdpckpt.merging.to_dcp import _torch_load

        path = self.path
        entries: list[tuple[KeyPath, Any, bool]] = []
        for shown, kind in files:
            file = self._local(shown)
            try:
                state = _torch_load(file, kind)
            except FsdpCkptError as exc:  # name the remote file, not the temporary copy
                if file == shown:
                    raise
                raise type(exc)(str(exc).replace(str(file), str(shown))) from None
            if not isinstance(state, dict):
                raise NotACheckpointError(f"{shown}: holds a {type(state).__name__}, not a "
                                          "state dict of names to tensors")
            # Only a zip archive is memory-mapped (the legacy format is read into memory).
            mapped = kind == "torch" and _little_endian(file)
            flat, mapping = flatten_state_dict(state)
            entries += [(tuple(mapping[fqn]), value, mapped) for fqn, value in flat.items()]
        names = _names([p for p, _, _ in entries], keep_keys=keep_keys, source=path)
        self._values = dict(zip(names, (v for _, v, _ in entries)))
        self._mapped = {n for n, (_, _, m) in zip(names, entries) if m}
        self.tensors = {name: value_info(path, name, value)
                        for name, value in self._values.items()
                        if isinstance(value, torch.Tensor)}

    def object_names(self) -> list[str]:
        return [n for n in self._values if n not in self.tensors]

    def objects(self) -> dict[str, Any]:
        return {n: self._values[n] for n in self.object_names()}

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        box = read_value_box(self._values[name], offsets, sizes, out)
        if name in self._mapped:
            _release_pages(box)

    def close(self) -> None:
        self._values = {}
        folder, self._downloads = self._downloads, None
        if folder is not None:  # the mapped tensors are dropped above; Linux keeps open maps
            shutil.rmtree(folder, ignore_errors=True)


def _file_source(path: Place, *, keep_keys: bool,
                 shown: Place) -> Source:
    from fsdpckpt.merging._convert_source import shards, sniff

    files = shards(path)
    kinds = [(f, sniff(f)) for f in files]
    if all(kind == "safetensors" for _, kind in kinds):
        return SafetensorsSource(files, path=shown, keep_keys=keep_keys)
    if any(kind == "safetensors" for _, kind in kinds):
        raise NotACheckpointError(f"{path}: its shards mix safetensors and torch.save files")
    return TorchSource(kinds, path=shown, keep_keys=keep_keys)


def open_source(path: str | os.PathLike[str] | Place, *, optimizer: bool = False,
                model_index: int | None = None, keep_keys: bool = False,
                storage_options: dict[str, Any] | None = None) -> Source:
    """Open ``path`` as one side of a diff.

    Args:
        path: a DCP folder; a whole checkpoint (Accelerate's or HF Trainer's layout: its
            model folder, or with ``optimizer`` its optimizer folder); a ``.safetensors``,
            ``.bin``/``.pt`` file or shard index; or a folder holding a merged or Hugging
            Face model (:data:`MERGED_FILES`; with ``optimizer``, the optimizer's); local
            or on object storage (``s3://...``).
        optimizer: compare the optimizer state instead of the model.
        model_index: which model of a checkpoint holding several (``pytorch_model_fsdp_N``).
        keep_keys: keep wrapper segments in names.
        storage_options: fsspec options for a ``path`` on object storage.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        NotACheckpointError, CorruptCheckpointError, UnsafePickleError: it cannot be read.
    """
    p = location(path, storage_options=storage_options)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such file or folder; check the path.")
    if p.is_file():
        return _file_source(p, keep_keys=keep_keys, shown=p)
    if is_dcp_folder(p) and not trainer_of(p):  # a trainer's folder: its model, as merged
        return DcpSource(p, keep_keys=keep_keys)
    wanted = MERGED_FILES["optimizer" if optimizer else "model"]
    for name in wanted:
        if (p / name).is_file():
            return _file_source(p / name, keep_keys=keep_keys, shown=p / name)
    refuse_links_out(p)  # said as itself, not as "neither a checkpoint nor a model"
    try:
        layout = find_layout(p)
    except NotACheckpointError as exc:
        if exc.checkpoints:  # a folder of checkpoints: listed, as every verb lists them
            raise
        raise NotACheckpointError(
            f"{p}: neither a checkpoint (no .metadata, no pytorch_model_fsdp_0/) nor a merged "
            f"model ({', '.join(wanted)}); pass a DCP folder, a checkpoint folder, or a "
            ".safetensors or .bin file") from None
    parts = choose_parts(layout, optimizer=optimizer, model_index=model_index)
    if optimizer:
        parts = [part for part in parts if part.kind == "optimizer"] or parts
    part = parts[-1] if optimizer else parts[0]
    return DcpSource(part.path, keep_keys=keep_keys, name=part.name)
