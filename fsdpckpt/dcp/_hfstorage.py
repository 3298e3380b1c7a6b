"""Folders written by torch's ``HuggingFaceStorageWriter``, read as DCP metadata: no torch.

``dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, ...))`` writes safetensors
files instead of ``.distcp`` files and no ``.metadata``. What lands on disk (torch 2.13,
``torch/distributed/checkpoint/hf_storage.py``, ``_hf_utils.py``,
``_consolidate_hf_safetensors.py``):

- ``save_distributed=True``: each rank writes ``shard-{rank+1:05}-model-{i:05}-of-{N:05}
  .safetensors`` (``i`` from ``fqn_to_index_mapping``, else 1 of 1) holding its local pieces,
  and the header's ``__metadata__["DCP_SHARDING_INFO"]`` (a JSON string) gives each piece's
  ``saved_offsets`` in the full tensor. Nothing else: no index, no metadata file.
- ``enable_consolidation=True`` as well: those files go to ``sharded/``, and rank 0 then
  writes the full tensors to ``model-{i:05}-of-{N:05}.safetensors`` (a header without
  ``__metadata__``) and ``model.safetensors.index.json`` in the folder itself.
- ``save_distributed=False`` (a full state dict saved by one rank): ``model-*-of-*.safetensors``
  with ``DCP_SHARDING_INFO`` (every offset 0) and the index.

As torch's ``HuggingFaceStorageReader`` does, each stored tensor becomes one chunk at its
saved offsets (0 without sharding info) and a tensor's shape is the extent of its chunks. The
chunks point at byte ranges inside the safetensors files (a :class:`PerRankChunk` whose
``raw`` is a contiguous tensor there), so the merge pipeline, inspect, verify and
``load_full_state_dict`` read the folder as a DCP folder, one chunk at a time. Headers are
parsed with fsdpckpt's bounded JSON reader; every declared size and offset is checked
against the file's real size before it is used.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.jsonio import loads_json
from fsdpckpt._io.rawio import ReadAt, pread_into
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp._perrank import PerRankChunk
from fsdpckpt.dcp.dtypes import DTYPES, DType
from fsdpckpt.dcp.metadata import DataFile, DcpMetadata, TensorEntry
from fsdpckpt.dcp.reader import DcpFolder, open_data_file
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, FsdpCkptError

__all__ = ["HfStorageFolder", "HfStoragePart", "SafetensorsHeader", "check_hf_files",
           "find_hf_storage", "hf_part_named", "parse_header", "read_hf_storage",
           "read_hf_storage_at"]

_SHARD_FILE = re.compile(r"^shard-(\d{5,9})-model-(\d{5,9})-of-(\d{5,9})\.safetensors$")
_MODEL_FILE = re.compile(r"^model-(\d{5,9})-of-(\d{5,9})\.safetensors$")
SHARDED_DIR = "sharded"
INDEX_FILE = "model.safetensors.index.json"
SHARDS_PART = "shard-*.safetensors"
MODEL_PART = "model-*.safetensors"
SHARDING_KEY = "DCP_SHARDING_INFO"
#: safetensors' own limit on a header (its Rust reader refuses larger ones).
MAX_HEADER = 100 * 2**20
_MAX_DIMS = 64  # torch's limit on a tensor's dims
_CODES: dict[str, DType] = {d.safetensors: d for d in DTYPES.values() if d.safetensors}
_CODES["F8_E8M0"] = DTYPES["float8_e8m0fnu"]


@dataclass(frozen=True)
class HfStoragePart:
    """The safetensors files of one ``HuggingFaceStorageWriter`` save in a folder.

    Attributes:
        name: how the part is shown: :data:`SHARDS_PART` or :data:`MODEL_PART`.
        files: the data files, sorted. index: the index file, when there is one.
        world_size: the ranks that wrote it, from the shard names (``sharded/``'s for a
            consolidated folder), or 0 when the names cannot tell.
        exact: whether every rank below ``world_size`` left a file (ranks with nothing to
            write leave none, so otherwise it is a lower bound).
    """

    name: str
    files: tuple[str, ...]
    index: str | None
    world_size: int
    exact: bool


@dataclass(frozen=True)
class HfStorageFolder(DcpFolder):
    """A ``HuggingFaceStorageWriter`` save read as a DCP folder (``path`` holds the files)."""

    world_size: int = 0
    world_size_exact: bool = False

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class SafetensorsHeader:
    """One safetensors file's header, checked against the file.

    Attributes:
        data_start: where the data section starts (8 + the header's length).
        tensors: ``{name: (dtype, shape, begin, end)}``, offsets relative to ``data_start``.
        offsets: ``{name: saved offsets}`` from ``DCP_SHARDING_INFO``, or None without it.
        data_size: the data section's length.
        metadata: the header's ``__metadata__`` object (``{}`` without one).
    """

    data_start: int
    tensors: dict[str, tuple[DType, tuple[int, ...], int, int]]
    offsets: dict[str, tuple[int, ...]] | None
    data_size: int
    metadata: dict[str, Any] = field(default_factory=dict)


def _shard_world(names: list[str]) -> tuple[int, bool]:
    ranks = {int(m.group(1)) for n in names if (m := _SHARD_FILE.match(n))}
    world = max(ranks, default=0)
    return world, bool(ranks) and len(ranks) == world


def _ints(value: Any, what: str, source: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CorruptCheckpointError(f"{source}: {what} is {str(value)[:80]}, not a list of at "
                                     f"most {_MAX_DIMS} non-negative integers; the header is "
                                     "damaged")
    return tuple(value)


def _header_json(fd: int | ReadAt, size: int, source: str) -> tuple[Any, int]:
    if size < 8:
        raise CorruptCheckpointError(f"{source}: {size} bytes, shorter than a safetensors "
                                     "header; the file is truncated")
    head = bytearray(8)
    pread_into(fd, memoryview(head), 0, source=source)
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, MAX_HEADER):
        raise CorruptCheckpointError(f"{source}: declares a {length}-byte header, but the file "
                                     f"holds {size} bytes; it is truncated or not safetensors")
    text = bytearray(length)
    pread_into(fd, memoryview(text), 8, source=source)
    return loads_json(bytes(text), source=source), 8 + length


def parse_header(fd: int | ReadAt, size: int, source: str) -> SafetensorsHeader:
    """Read and check the header of the safetensors file open as ``fd`` (``size`` bytes; a
    descriptor, or a remote file read by offset). The one safetensors header parser: torch's
    Hugging Face storage, and ``diff``'s safetensors side.

    Raises:
        CorruptCheckpointError: the header is not JSON, a field is malformed, a tensor's
            bytes do not match its shape and dtype or lie past the end of the file, two
            tensors share bytes, or the sharding info does not fit the tensors.
    """
    header, data_start = _header_json(fd, size, source)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{source}: the header is not a JSON object; the file is "
                                     "damaged or not safetensors")
    extra = header.pop("__metadata__", None) or {}
    if not isinstance(extra, dict):
        raise CorruptCheckpointError(f"{source}: '__metadata__' is not an object")
    data_size = size - data_start
    tensors: dict[str, tuple[DType, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        where = f"{source}: tensor '{name[:200]}'"
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            raise CorruptCheckpointError(f"{where}: no dtype; the header is damaged")
        dtype = _CODES.get(info["dtype"])
        if dtype is None:
            raise CorruptCheckpointError(f"{where}: unknown dtype {info['dtype'][:20]!r}")
        shape = _ints(info.get("shape"), "its shape", where)
        span = _ints(info.get("data_offsets"), "its data_offsets", where)
        if len(span) != 2 or not span[0] <= span[1] <= data_size:
            raise CorruptCheckpointError(f"{where}: data_offsets {list(span)} lie outside the "
                                         f"{data_size} data bytes; the file is truncated or "
                                         "its header is damaged")
        if span[1] - span[0] != math.prod(shape) * dtype.itemsize:
            raise CorruptCheckpointError(f"{where}: {dtype.name} {list(shape)} needs "
                                         f"{math.prod(shape) * dtype.itemsize} bytes, its "
                                         f"data_offsets give {span[1] - span[0]}")
        tensors[name] = (dtype, shape, span[0], span[1])
    ranges = sorted((b, e, n) for n, (_, _, b, e) in tensors.items() if e > b)
    for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
        if start_b < end_a:
            raise CorruptCheckpointError(f"{source}: tensors '{a[:200]}' and '{b[:200]}' share "
                                         f"bytes from {start_b}; the header is damaged")
    return SafetensorsHeader(data_start, tensors, _sharding(extra, tensors, source), data_size,
                             extra)


def _sharding(extra: dict[str, Any], tensors: dict[str, tuple[DType, tuple[int, ...], int, int]],
              source: str) -> dict[str, tuple[int, ...]] | None:
    text = extra.get(SHARDING_KEY)
    if text is None:
        return None
    info = loads_json(text, source=f"{source} ({SHARDING_KEY})") if isinstance(text, str) \
        else None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{source}: {SHARDING_KEY} is not a JSON object")
    offsets = {}
    for name, (_, shape, _, _) in tensors.items():
        entry = info.get(name)
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{source}: {SHARDING_KEY} has no saved_offsets for "
                                         f"tensor '{name[:200]}'; the header is damaged")
        found = _ints(entry.get("saved_offsets"), f"tensor '{name[:200]}''s saved_offsets",
                      source)
        if len(found) != len(shape):
            raise CorruptCheckpointError(f"{source}: tensor '{name[:200]}' has {len(shape)} "
                                         f"dims but saved_offsets {list(found)}")
        offsets[name] = found
    return offsets


def _read_header(folder: Place, name: str) -> tuple[SafetensorsHeader, int]:
    """The checked header of the file ``name`` of ``folder`` and the file's size; a remote
    file's by ranged reads of its first bytes (its size from the listing)."""
    opened = open_data_file(folder, name)
    try:
        return parse_header(opened, opened.size, str(folder / name)), opened.size
    finally:
        opened.close()


def find_hf_storage(folder: Place, names: list[str]) -> HfStoragePart | None:
    """The ``HuggingFaceStorageWriter`` save among ``names`` (the files of ``folder``), if any.

    Shard files (``shard-*-model-*-of-*.safetensors``) are one by their names. Whole files
    (``model-*-of-*.safetensors``, as any Hugging Face model folder has) are one only beside
    a ``sharded/`` folder of shard files (consolidation), or when the first one's header
    carries ``DCP_SHARDING_INFO`` (a save with ``save_distributed=False``).
    """
    shards = sorted(n for n in names if _SHARD_FILE.match(n))
    index = INDEX_FILE if INDEX_FILE in names else None
    if shards:
        return HfStoragePart(SHARDS_PART, tuple(shards), index, *_shard_world(shards))
    whole = sorted(n for n in names if _MODEL_FILE.match(n))
    if not whole:
        return None
    sharded = storage.names(folder / SHARDED_DIR)
    if any(_SHARD_FILE.match(n) for n in sharded):
        return HfStoragePart(MODEL_PART, tuple(whole), index, *_shard_world(sharded))
    try:
        header, _ = _read_header(folder, whole[0])
    except FsdpCkptError:
        return None  # not a save of this writer: nothing here says it is
    return HfStoragePart(MODEL_PART, tuple(whole), index, 1, False) \
        if header.offsets is not None else None


def hf_part_named(folder: Place, name: str) -> HfStoragePart | None:
    """The save that the layout part ``name`` of ``folder`` stands for, or None."""
    if name not in (SHARDS_PART, MODEL_PART) or not folder.is_dir():
        return None
    part = find_hf_storage(folder, storage.names(folder))
    return part if part and part.name == name else None


def _missing_file(part: HfStoragePart) -> str | None:
    """The first file the names of ``part`` say should be there and is not: a whole file
    ``i`` of ``N`` below ``N``, or a rank below the highest one with no file at all (every
    rank of an FSDP save has pieces to write). A missing last rank cannot be told from the
    names: the tensors would just look smaller, as they do to torch's reader."""
    if part.name == MODEL_PART:
        found = [m for n in part.files if (m := _MODEL_FILE.match(n))]
        total, width = int(found[0].group(2)), len(found[0].group(2))
        have = {int(m.group(1)) for m in found}
        # ``total`` comes from a name: only the first few absent numbers are looked for.
        for i in range(1, min(total, len(have) + 1) + 1):
            if i not in have:
                return f"model-{i:0{width}d}-of-{found[0].group(2)}.safetensors"
        return None
    shards = [m for n in part.files if (m := _SHARD_FILE.match(n))]
    ranks = {int(m.group(1)) for m in shards}
    for rank in range(1, len(ranks) + 1):
        if rank not in ranks:
            m = min(shards, key=lambda m: int(m.group(1)))
            return f"shard-{rank:0{len(m.group(1))}d}-model-{m.group(2)}-of-{m.group(3)}" \
                ".safetensors"
    return None


def read_hf_storage(folder: Place, part: HfStoragePart) -> HfStorageFolder:
    """Read every header of ``part`` (one file at a time) into one :class:`HfStorageFolder`.

    Raises:
        CheckpointNotFoundError, NotACheckpointError: a file is missing, or leads outside.
        CorruptCheckpointError: a header is damaged (:func:`parse_header`), or two files
            disagree on a tensor's dtype or dims.
    """
    missing = _missing_file(part)
    if missing:
        raise CheckpointNotFoundError(
            f"{folder / missing}: missing file of a HuggingFaceStorageWriter save (its siblings "
            "are here); copy it from the machine that wrote the checkpoint")
    entries: dict[str, tuple[DType, list[PerRankChunk]]] = {}
    files = []
    for name in part.files:
        header, size = _read_header(folder, name)
        files.append(DataFile(name, size))
        for key, (dtype, shape, begin, end) in header.tensors.items():
            offsets = header.offsets[key] if header.offsets is not None else (0,) * len(shape)
            known, chunks = entries.setdefault(key, (dtype, []))
            if known != dtype or (chunks and len(chunks[0].sizes) != len(shape)):
                raise CorruptCheckpointError(
                    f"{folder / name}: tensor '{key[:200]}' is {dtype.name} with {len(shape)} "
                    f"dims here but {known.name} with {len(chunks[0].sizes) if chunks else '?'}"
                    " in another file; the files come from different saves")
            start = header.data_start + begin
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            chunks.append(PerRankChunk(offsets, shape, name, start, end - begin, raw=RawTensor(
                start, end - begin, dtype, 0, shape, strides)))
    tensors = []
    for key, (dtype, chunks) in entries.items():
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks)
                      for d in range(len(chunks[0].sizes)))
        kept = [c for c in chunks if c.numel]
        if not kept:
            # A tensor without elements: one chunk, pointed at the file's 8 length bytes so
            # the structural checks see a real range; placing it reads nothing.
            kept = [PerRankChunk(chunks[0].offsets, chunks[0].sizes, chunks[0].file, 0, 8,
                                 raw=chunks[0].raw)]
        kept.sort(key=lambda c: c.offsets)
        tensors.append(TensorEntry(key, dtype, shape, tuple(kept), (key,)))
    return HfStorageFolder(folder, DcpMetadata(tuple(tensors), ()), tuple(files),
                           world_size=part.world_size, world_size_exact=part.exact)


def read_hf_storage_at(folder: Place) -> HfStorageFolder | None:
    """The ``HuggingFaceStorageWriter`` save in ``folder``, read; None when there is none."""
    part = find_hf_storage(folder, storage.names(folder)) if folder.is_dir() else None
    return read_hf_storage(folder, part) if part else None


def check_hf_files(path: Place, part: HfStoragePart) -> list[tuple[Place, str]]:
    """What is wrong with the files of the save ``part`` in ``path``: a header that does not
    parse, or data bytes no tensor owns (safetensors files hold no checksum, so this and
    the structure are what can be checked).

    Returns:
        ``(file, what is wrong)`` for each damaged file.
    """
    found: list[tuple[Place, str]] = []
    for file_name in part.files:
        try:
            header, _ = _read_header(path, file_name)
        except FsdpCkptError as exc:
            found.append((path / file_name, str(exc)))
            continue
        owned = sum(e - b for _, _, b, e in header.tensors.values())
        if owned != header.data_size:
            found.append((path / file_name, f"{header.data_size - owned} of its "
                          f"{header.data_size} data bytes belong to no tensor; the file was "
                          "changed after it was written, or its header is damaged"))
    return found
