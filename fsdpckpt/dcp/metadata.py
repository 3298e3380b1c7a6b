"""The data model of a DCP checkpoint folder: plain frozen values, no I/O.

A DCP folder is a ``.metadata`` pickle plus ``__{rank}_{n}.distcp`` data files.
:mod:`fsdpckpt.dcp._safe_pickle` turns the pickle into these values and
:mod:`fsdpckpt.dcp.reader` adds what the file system says; everything else in
fsdpckpt (inspect, checks, merge planning) works on them alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from fsdpckpt.dcp.dtypes import DType

__all__ = [
    "Chunk",
    "TensorEntry",
    "ObjectEntry",
    "DcpMetadata",
    "DataFile",
    "KeyPath",
    "rank_of_file",
    "rank_file_parts",
]

#: The nested key path of an entry, e.g. ``("optimizer", "state", "0.weight", "exp_avg")``.
KeyPath = tuple[str | int, ...]

# Rank and index of at most 9 digits: longer numbers are no rank file DCP writes, and
# converting them would cost time quadratic in their length.
_RANK_FILE = re.compile(r"^__(\d{1,9})_(\d{1,9})\.distcp$")


def rank_file_parts(name: str) -> tuple[int, int] | None:
    """``(rank, n)`` of a DCP data file ``__{rank}_{n}.distcp``, or None for other names."""
    match = _RANK_FILE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def rank_of_file(name: str) -> int | None:
    """Return the rank that wrote ``__{rank}_{n}.distcp``, or None for other names."""
    parts = rank_file_parts(name)
    return parts[0] if parts else None


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor and where its bytes live.

    Attributes:
        offsets: where the chunk starts in the global tensor, one entry per dim.
        sizes: the chunk's shape.
        file: the data file holding it, relative to the folder; None when the
            metadata has no storage entry for the chunk (a broken checkpoint).
        offset: byte offset of the chunk's ``torch.save`` archive in ``file``.
        length: byte length of that archive.
        transforms: the stream transforms its bytes went through (``("stream.zstd/1",)``
            for a zstd-compressed folder), in the order to undo them; empty for none.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None
    offset: int
    length: int
    transforms: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the state dict, as the metadata describes it.

    Attributes:
        name: the fully qualified name as stored, e.g. ``"model.layers.0.weight"``.
        dtype: its element type.
        shape: its global (unsharded) shape.
        chunks: the stored chunks, in metadata order.
        key_path: the nested keys it came from in the saved state dict.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    key_path: KeyPath

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ObjectEntry:
    """A non-tensor entry (an int, a string, param_groups...), stored as a ``torch.save`` blob.

    Attributes:
        name: the fully qualified name as stored.
        file: the data file holding it, or None when the storage entry is missing.
        offset: byte offset of the blob in ``file``.
        length: byte length of the blob.
        key_path: the nested keys it came from.
        transforms: as for :class:`Chunk`.
    """

    name: str
    file: str | None
    offset: int
    length: int
    key_path: KeyPath
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpMetadata:
    """Everything a ``.metadata`` file says, as plain values.

    Attributes:
        tensors: every tensor entry, in the order the metadata lists them.
        objects: every non-tensor entry.
        version: the metadata format version (``"1.0.0"`` in torch 2.4+), or None.
    """

    tensors: tuple[TensorEntry, ...]
    objects: tuple[ObjectEntry, ...]
    version: str | None = None

    @property
    def referenced_files(self) -> frozenset[str]:
        """Every data file some chunk or object points at."""
        files = {c.file for t in self.tensors for c in t.chunks}
        files.update(o.file for o in self.objects)
        files.discard(None)
        return frozenset(files)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DataFile:
    """A data file present in a DCP folder.

    Attributes:
        name: file name relative to the folder, e.g. ``"__0_0.distcp"``.
        size: size in bytes.
    """

    name: str
    size: int

    @property
    def rank(self) -> int | None:
        return rank_of_file(self.name)
