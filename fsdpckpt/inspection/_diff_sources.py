"""The two sides of a diff: any state source, read as named tensors one bounded box at a time.

A source is a DCP folder (or the model or optimizer folder of a whole checkpoint), a
safetensors file or shard index, a ``.bin``/``.pt`` ``torch.save`` file or shard index,
or a folder holding a merged or Hugging Face model (``model.safetensors``,
``pytorch_model.bin``, or their index). Each is opened as a :class:`Source`: the names,
dtypes and shapes of its tensors (from metadata or headers alone), its non-tensor entries
by value, :meth:`Source.pieces`, where a tensor's elements are stored (for the sides read
by descriptor: DCP chunks, safetensors), and :meth:`Source.read`, which fills a caller's
buffer with one box of one tensor. A box (:func:`boxes`) is always a contiguous run of the
tensor's row-major elements, so both sides are read in the same pieces and nothing larger
is ever held.

Names follow the merge's rule (:mod:`fsdpckpt.merging._keys`), so a DCP folder and its
merged file name their entries alike: the top-level key every entry shares (Accelerate's
``model``) is dropped from nested key paths, and wrapper segments
(``_fsdp_wrapped_module.``...) are dropped everywhere unless ``keep_keys``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from fsdpckpt._io.rawio import ReadAt
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp._datafiles import OPEN_FILES, DataFiles
from fsdpckpt.dcp._objects import read_object, to_torch
from fsdpckpt.dcp.checks import require_whole
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import Chunk, KeyPath, ObjectEntry, TensorEntry
from fsdpckpt.dcp.parts import open_part
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.inspection._diff_tiles import Piece
from fsdpckpt.merging._copy import MemorySink, checked_source, locate_stored_chunk, place_chunk
from fsdpckpt.merging._keys import output_name, shares_top_key
from fsdpckpt.merging._runs import chunk_runs

__all__ = ["MERGED_FILES", "DcpSource", "Source", "TensorInfo", "bits",
           "same_bits", "same_bytes",
           "same_value"]

#: What a folder that is no checkpoint is read as, first found first (model, then optimizer).
#: PEFT's adapter file last: an adapter export (``export-hf --lora adapter``) is compared and
#: inspected as the model it holds.
MERGED_FILES = {
    "model": ("model.safetensors.index.json", "model.safetensors",
              "pytorch_model.bin.index.json", "pytorch_model.bin", "adapter_model.safetensors"),
    "optimizer": ("optimizer.safetensors.index.json", "optimizer.safetensors",
                  "optimizer.bin.index.json", "optimizer.bin"),
}
# safetensors refuses headers over 100 MB; so does this reader, before reading one.


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a source: its name as compared, dtype and shape."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Source:
    """One side of a diff. Subclasses fill :attr:`tensors` when opened.

    Attributes:
        path: what was read (a folder a whole checkpoint resolves to, or the file).
        kind: ``"dcp"``, ``"safetensors"`` or ``"torch"``.
        tensors: every tensor, by name, in the source's order.
    """

    path: Place
    kind: str
    tensors: dict[str, TensorInfo]

    def objects(self) -> dict[str, Any]:
        """The non-tensor entries by name, as plain values (tensors in them as torch's)."""
        raise NotImplementedError

    def object_names(self) -> list[str]:
        """The names of the non-tensor entries, without reading their values."""
        raise NotImplementedError

    def stored_name(self, name: str) -> str:
        """The name the entry compared as ``name`` has where it is stored (inspect's: a DCP
        folder's ``model.0.weight`` for ``0.weight``), which ``diff --name`` matches too."""
        return name

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        """Fill ``out`` with the row-major elements of the box ``offsets``/``sizes``
        (from :func:`boxes`) of tensor ``name``, in its own dtype."""
        raise NotImplementedError

    def pieces(self, name: str) -> list[Piece] | None:
        """Where the elements of tensor ``name`` are stored, as boxes each read by
        descriptor (:mod:`fsdpckpt.inspection._diff_tiles`); None for a source read only
        through :meth:`read`."""
        return None

    def close(self) -> None:
        """Close what the source opened."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _names(key_paths: Sequence[KeyPath], *, keep_keys: bool,
           source: Place) -> list[str]:
    strip = shares_top_key(key_paths)
    names = [output_name(p, strip_top=strip, clean=not keep_keys) for p in key_paths]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise NotACheckpointError(f"{source}: two entries are both named '{name}' once "
                                      "wrapper segments are dropped; pass keep_keys=True")
        seen.add(name)
    return names


class DcpSource(Source):
    """A checkpoint part read as a DCP folder (:func:`~fsdpckpt.dcp.parts.open_part`: a DCP
    folder, per-rank ``torch.save`` files, ``HuggingFaceStorageWriter`` safetensors):
    metadata read once, chunks placed box by box with the copy engine."""

    kind = "dcp"

    def __init__(self, path: Place, *, keep_keys: bool, name: str | None = None) -> None:
        """``path`` and ``name``: a :class:`~fsdpckpt.dcp.layout.DcpPart`'s (no ``name``:
        ``path`` is a DCP folder)."""
        self.path = path
        folder = open_part(path, path.name if name is None else name)
        require_whole(folder)  # declared sizes checked against the bytes before any read
        meta = folder.metadata
        entries = list(meta.tensors) + list(meta.objects)
        names = _names([e.key_path for e in entries], keep_keys=keep_keys, source=path)
        self._entries = dict(zip(names, entries))
        self.tensors = {n: TensorInfo(n, e.dtype, e.shape) for n, e in self._entries.items()
                        if isinstance(e, TensorEntry)}
        self._files = DataFiles(folder.path)
        self._raws: tuple[str, list[tuple[Chunk, RawTensor, int | ReadAt, str]]] | None = None
        self._pieces: tuple[str, list[Piece]] | None = None

    def object_names(self) -> list[str]:
        return [n for n, e in self._entries.items() if not isinstance(e, TensorEntry)]

    def stored_name(self, name: str) -> str:
        entry = self._entries.get(name)
        return name if entry is None else entry.name

    def objects(self) -> dict[str, Any]:
        found = {}
        # Its own entries (not object_names(), which a subclass may extend with others).
        for name in DcpSource.object_names(self):
            entry = cast(ObjectEntry, self._entries[name])
            if entry.file is None:
                raise NotACheckpointError(f"{self.path}: object '{entry.name}' has no storage "
                                          "entry in .metadata")
            value = read_object(self._files.open(entry.file).file, entry,
                                source=str(self.path / str(entry.file)))
            found[name] = to_torch(value)
        return found

    def _chunks(self, name: str) -> list[tuple[Chunk, RawTensor, int | ReadAt, str]]:
        """Each chunk of ``name`` with where its data is, located once per tensor."""
        if self._raws is not None and self._raws[0] == name:
            return self._raws[1]
        tensor = cast(TensorEntry, self._entries[name])  # a name from self.tensors
        # Every chunk's source is held until the tensor is compared: past the files DataFiles
        # keeps open, a held descriptor could be closed (and its number reused), so each is
        # read through a reader that reopens its file.
        crowded = len({chunk.file for chunk in tensor.chunks}) > OPEN_FILES
        located = []
        for chunk in tensor.chunks:
            raw, src, source = locate_stored_chunk(self._files, tensor, chunk, check_shape=True,
                                                   verify=False, held=crowded)
            located.append((chunk, raw, src, source))
        self._raws = (name, located)
        return located

    def pieces(self, name: str) -> list[Piece] | None:
        # Each chunk's bytes are summed as the tiles read them, in its storage order where
        # this side leads (read_tile); the reader finishes each check (finish_checks), so a
        # chunk is read once, not once to check it and once more to compare it (issue 21).
        # Kept for the next call with the same name (a reader taking box after box of one
        # tensor): each chunk's check then runs once, not once a box.
        if self._pieces is None or self._pieces[0] != name:
            self._pieces = (name, [
                Piece(chunk.offsets, chunk.sizes,
                      checked_source(self._files, chunk, raw, src, source),
                      raw.storage_start, raw.storage_offset, raw.stride, raw.dtype.itemsize,
                      source)
                for chunk, raw, src, source in self._chunks(name)])
        return self._pieces[1]

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
            # Boxes in any order: the chunk's storage is read whole against its CRC once.
            fd = checked_source(self._files, chunk, raw, fd, source, in_order=False)
            place_chunk(fd, sub_raw, sub, chunk_runs(sizes, sub), dtype, sink, 0, source=source)

    def close(self) -> None:
        self._files.close()


def bits(t: Any) -> Any:
    """A 1-D contiguous tensor's bytes, to compare bit for bit (NaN payloads, -0.0)."""
    import torch

    return t.view(torch.uint8)


def same_bytes(x: memoryview, y: memoryview) -> bool:
    """Whether two buffers hold the same bytes, without torch: with numpy, its
    ``array_equal`` (about 6 GB/s here), else Python's comparison (about 1 GB/s)."""
    try:
        import numpy
    except ImportError:  # optional: the same answer, slower
        return x.cast("B") == y.cast("B")
    return bool(numpy.array_equal(numpy.frombuffer(x, dtype=numpy.uint8),
                                  numpy.frombuffer(y, dtype=numpy.uint8)))


def same_bits(a: Any, b: Any) -> bool:
    """Whether two 1-D contiguous tensors of one dtype hold the same bytes.

    With numpy, :func:`same_bytes` over their bytes: ``torch.equal`` on CPU compares at
    about 0.3 GB/s, and made a diff of two identical checkpoints spend more time comparing
    than reading them (issue 21).
    """
    import torch

    try:
        import numpy  # noqa: F401  (whether the tensors have a numpy view)
    except ImportError:  # optional: torch gives the same answer, slower
        return bool(torch.equal(bits(a), bits(b)))
    return same_bytes(memoryview(bits(a).detach().numpy()), memoryview(bits(b).detach().numpy()))


def same_value(x: Any, y: Any) -> bool:
    """Whether two non-tensor entries hold the same value: containers of the same types,
    floats equal or both NaN, tensors of the same dtype and shape with the same bytes."""
    # A tensor in a value means torch was imported to build it: entries without tensors
    # (an optimizer's param_groups, a step) are compared without importing it.
    torch = sys.modules.get("torch")
    if torch is not None and (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and \
            x.dtype == y.dtype and x.shape == y.shape and \
            same_bits(x.reshape(-1).contiguous(), y.reshape(-1).contiguous())
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same_value(v, y[k]) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same_value(u, v) for u, v in zip(x, y))
    if isinstance(x, (float, complex)):
        return x == y or (x != x and y != y)  # NaN is the only x != x
    return bool(x == y)
