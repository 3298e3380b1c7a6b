"""The two sides of a diff: any state source, read as named tensors one bounded box at a time.

A source is a DCP folder (or the model or optimizer folder of a whole checkpoint), a
safetensors file or shard index, a ``.bin``/``.pt`` ``torch.save`` file or shard index,
or a folder holding a merged or Hugging Face model (``model.safetensors``,
``pytorch_model.bin``, or their index). Each is opened as a :class:`Source`: the names,
dtypes and shapes of its tensors (from metadata or headers alone), its non-tensor entries
by value, and :meth:`Source.read`, which fills a caller's buffer with one box of one
tensor. A box (:func:`boxes`) is always a contiguous run of the tensor's row-major
elements, so both sides are read in the same pieces and nothing larger is ever held.

Names follow the merge's rule (:mod:`fsdpckpt.merging._keys`), so a DCP folder and its
merged file name their entries alike: the top-level key every entry shares (Accelerate's
``model``) is dropped from nested key paths, and wrapper segments
(``_fsdp_wrapped_module.``...) are dropped everywhere unless ``keep_keys``.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.rawio import read_exact
from fsdpckpt.dcp._archive import RawTensor, locate_tensor
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp._objects import loads, read_object, to_torch
from fsdpckpt.dcp._zstd import ZstdEntry, chunk_limit, open_entry
from fsdpckpt.dcp.checks import check_folder
from fsdpckpt.dcp.dtypes import DTYPES, DType, dtype_from_name
from fsdpckpt.dcp.layout import find_layout
from fsdpckpt.dcp.metadata import Chunk, KeyPath, ObjectEntry, TensorEntry
from fsdpckpt.dcp.reader import is_dcp_folder, read_dcp_folder
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from fsdpckpt.formats.safetensors import OBJECTS_KEY, RESERVED_NAME
from fsdpckpt.merging._copy import MemorySink, place_chunk
from fsdpckpt.merging._keys import clean_key, output_name, shares_top_key
from fsdpckpt.merging._runs import chunk_runs
from fsdpckpt.merging._validate import choose_parts

__all__ = ["TensorInfo", "Source", "open_source", "boxes", "MERGED_FILES"]

#: What a folder that is no checkpoint is read as, first found first (model, then optimizer).
MERGED_FILES = {
    "model": ("model.safetensors.index.json", "model.safetensors",
              "pytorch_model.bin.index.json", "pytorch_model.bin"),
    "optimizer": ("optimizer.safetensors.index.json", "optimizer.safetensors",
                  "optimizer.bin.index.json", "optimizer.bin"),
}
# safetensors refuses headers over 100 MB; so does this reader, before reading one.
_MAX_HEADER = 100 * 10**6
_FROM_SAFETENSORS = {d.safetensors: d for d in DTYPES.values() if d.safetensors}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a source: its name as compared, dtype and shape."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def boxes(shape: Sequence[int], max_elements: int) -> Iterator[tuple[tuple[int, ...],
                                                                     tuple[int, ...]]]:
    """Cut a tensor into boxes of at most ``max_elements`` elements (or one innermost
    element's worth, if less), each a contiguous run of its row-major elements, in order.

    Yields:
        ``(offsets, sizes)`` of each box. A tensor with no elements yields nothing.
    """
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return
    if not shape:
        yield (), ()
        return
    # The outermost dim whose trailing block fits: boxes take a range of it, every index
    # of the dims after it, and one index of each dim before it.
    dim = next(d for d in range(len(shape)) if math.prod(shape[d + 1:]) <= max_elements)
    inner = math.prod(shape[dim + 1:])
    step = max(1, max_elements // inner)
    for lead in _indices(shape[:dim]):
        for start in range(0, shape[dim], step):
            size = min(step, shape[dim] - start)
            yield lead + (start,) + (0,) * len(shape[dim + 1:]), \
                (1,) * dim + (size,) + shape[dim + 1:]


def _indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for first in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (first,) + rest


class Source:
    """One side of a diff. Subclasses fill :attr:`tensors` when opened.

    Attributes:
        path: what was read (a folder a whole checkpoint resolves to, or the file).
        kind: ``"dcp"``, ``"safetensors"`` or ``"torch"``.
        tensors: every tensor, by name, in the source's order.
    """

    path: Path
    kind: str
    tensors: dict[str, TensorInfo]

    def objects(self) -> dict[str, Any]:
        """The non-tensor entries by name, as plain values (tensors in them as torch's)."""
        raise NotImplementedError

    def object_names(self) -> list[str]:
        """The names of the non-tensor entries, without reading their values."""
        raise NotImplementedError

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        """Fill ``out`` with the row-major elements of the box ``offsets``/``sizes``
        (from :func:`boxes`) of tensor ``name``, in its own dtype."""
        raise NotImplementedError

    def close(self) -> None:
        """Close what the source opened."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _names(key_paths: Sequence[KeyPath], *, keep_keys: bool, source: Path) -> list[str]:
    strip = shares_top_key(key_paths)
    names = [output_name(p, strip_top=strip, clean=not keep_keys) for p in key_paths]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise NotACheckpointError(f"{source}: two entries are both named '{name}' once "
                                      "wrapper segments are dropped; pass --keep-keys")
        seen.add(name)
    return names


class DcpSource(Source):
    """A DCP folder: metadata read once, chunks placed box by box with the copy engine."""

    kind = "dcp"

    def __init__(self, path: Path, *, keep_keys: bool) -> None:
        self.path = path
        folder = read_dcp_folder(path)
        problems = check_folder(folder)
        if problems:  # declared sizes checked against the bytes before anything is read
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"{problems[0]}{more}; run `fsdpckpt inspect {path}` "
                                         "for the full list")
        meta = folder.metadata
        entries = list(meta.tensors) + list(meta.objects)
        names = _names([e.key_path for e in entries], keep_keys=keep_keys, source=path)
        self._entries = dict(zip(names, entries))
        self.tensors = {n: TensorInfo(n, e.dtype, e.shape) for n, e in self._entries.items()
                        if isinstance(e, TensorEntry)}
        self._files = DataFiles(path)
        self._raws: tuple[str, list[tuple[Chunk, RawTensor, int | ZstdEntry, str]]] | None = None

    def object_names(self) -> list[str]:
        return [n for n, e in self._entries.items() if not isinstance(e, TensorEntry)]

    def objects(self) -> dict[str, Any]:
        found = {}
        for name in self.object_names():
            entry = cast(ObjectEntry, self._entries[name])
            if entry.file is None:
                raise NotACheckpointError(f"{self.path}: object '{entry.name}' has no storage "
                                          "entry in .metadata")
            value = read_object(self._files.open(entry.file).file, entry,
                                source=str(self.path / str(entry.file)))
            found[name] = to_torch(value)
        return found

    def _chunks(self, name: str) -> list[tuple[Chunk, RawTensor, int | ZstdEntry, str]]:
        """Each chunk of ``name`` with where its data is, located once per tensor."""
        if self._raws is not None and self._raws[0] == name:
            return self._raws[1]
        tensor = cast(TensorEntry, self._entries[name])  # a name from self.tensors
        located = []
        for chunk in tensor.chunks:
            source = f"{self.path / str(chunk.file)} (tensor '{tensor.name}' chunk at " \
                     f"{list(chunk.offsets)})"
            if chunk.file is None:
                raise NotACheckpointError(f"{source}: the metadata has no storage entry")
            data = self._files.open(chunk.file)
            handle, start, length = open_entry(data.file, chunk.offset, chunk.length,
                                               chunk.transforms,
                                               limit=chunk_limit(tensor, chunk), source=source)
            raw = locate_tensor(handle, start, length, source=source)
            if raw.dtype.name != tensor.dtype.name:
                raise CorruptCheckpointError(f"{source}: holds {raw.dtype.name}, the metadata "
                                             f"says {tensor.dtype.name}")
            if raw.shape != chunk.sizes:
                raise CorruptCheckpointError(f"{source}: holds shape {list(raw.shape)}, the "
                                             f"metadata says {list(chunk.sizes)}")
            # A compressed chunk is read through its decoder, a plain one by descriptor.
            src: int | ZstdEntry = handle if isinstance(handle, ZstdEntry) else data.fd
            located.append((chunk, raw, src, source))
        self._raws = (name, located)
        return located

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        dtype = self.tensors[name].dtype
        sink = MemorySink(out)
        for chunk, raw, fd, source in self._chunks(name):
            low = [max(b, c) for b, c in zip(offsets, chunk.offsets)]
            high = [min(b + s, c + k) for b, s, c, k in
                    zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(h <= lo for lo, h in zip(low, high)):
                continue
            # The part of the chunk inside the box is itself a strided tensor of the same
            # storage: place it as a chunk of the box, so only that part is read.
            part = tuple(h - lo for lo, h in zip(low, high))
            skip = sum((lo - c) * st for lo, c, st in zip(low, chunk.offsets, raw.stride))
            sub_raw = RawTensor(raw.storage_start, raw.storage_nbytes, raw.dtype,
                                raw.storage_offset + skip, part, raw.stride)
            sub = Chunk(tuple(lo - b for lo, b in zip(low, offsets)), part, chunk.file, 0, 0)
            place_chunk(fd, sub_raw, sub, chunk_runs(sizes, sub), dtype, sink, 0, source=source)

    def close(self) -> None:
        self._files.close()


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
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such file or folder; check the path.")
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
