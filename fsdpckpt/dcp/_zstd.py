"""Reading DCP entries written through ``FileSystemWriter(_extensions=[ZStandard()])``.

Such a writer records ``transform_descriptors=["stream.zstd/1"]`` in each entry's storage
info and writes, at the entry's byte range, a zstd stream whose decoded bytes are the
``torch.save`` archive an uncompressed folder would hold there. :class:`ZstdEntry` is a
read-only, seekable file over those decoded bytes, so the archive readers
(:mod:`fsdpckpt.dcp._archive`) and the chunk-placing engine work on it unchanged, while
memory stays bounded: the first and last :data:`_EDGE` decoded bytes are kept (where a
zip's headers, pickle and directory lie), everything else is decoded again, in blocks,
when it is read. Reads in increasing order (the engine's) cost one more decoding pass.

The decoded size is bounded before anything depends on it: decoding stops, with one
error, as soon as it passes what the metadata declares for the entry (a chunk's bytes
plus an archive's overhead), so a decompression bomb costs no more than that much work.
The ``zstandard`` package is an optional extra (``pip install 'fsdpckpt[zstd]'``).
"""

from __future__ import annotations

import io
import os
from typing import IO, Any, cast

from fsdpckpt._io.rawio import ReadAt, ReadAtFile, SizedReader
from fsdpckpt.dcp.metadata import Chunk, TensorEntry
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError

__all__ = ["ZSTD_DESCRIPTOR", "ARCHIVE_SLACK", "MAX_RATIO", "OBJECT_LIMIT", "ZstdEntry",
           "check_transforms", "chunk_limit", "open_entry", "require_zstandard"]

ZSTD_DESCRIPTOR = "stream.zstd"
#: Decoded bytes an archive may hold beyond its tensor's own: torch.save's pickle (at most
#: 64 KiB accepted), a few small entries, alignment and the zip directory.
ARCHIVE_SLACK = 1 << 20
#: Decoded bytes a non-tensor entry (param_groups, a step) may have; the metadata declares
#: no size for them, and honest ones are a few kilobytes.
OBJECT_LIMIT = 256 << 20
#: Decoded bytes kept from each end of an entry.
_EDGE = 1 << 16
#: The most bytes a zstd stream can decode to per byte of it: a block of at most 128 KiB
#: takes a 3-byte header and, repeating one byte, one byte more.
MAX_RATIO = (128 << 10) // 4
_BLOCK = 1 << 20


def check_transforms(value: Any) -> tuple[str, ...]:
    """The transforms of one storage entry, checked: none, or zstd as torch 2.13 writes it.

    Raises:
        ValueError: naming what is wrong (the reader adds the file and the entry).
    """
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(type(v) is str for v in value):
        raise ValueError(f"transform_descriptors is {type(value).__name__}, not a list of "
                         "strings")
    found = tuple(value)
    if not found:
        return ()
    name, _, version = found[0].partition("/")
    if len(found) != 1 or name != ZSTD_DESCRIPTOR or version.partition(".")[0] != "1":
        shown = ", ".join(repr(v[:60]) for v in found[:4])
        raise ValueError(f"is stored with the transforms [{shown}], of which fsdpckpt reads "
                         f"only '{ZSTD_DESCRIPTOR}/1' (FileSystemWriter's ZStandard extension)")
    return found


def require_zstandard(source: str) -> Any:
    """The ``zstandard`` module, or one error saying which extra installs it."""
    try:
        import zstandard
    except ImportError:
        raise NotACheckpointError(
            f"{source}: stored zstd-compressed (FileSystemWriter's ZStandard extension), which "
            "needs the zstandard package: pip install 'fsdpckpt[zstd]'") from None
    return zstandard


class ZstdEntry(SizedReader):
    """The decoded bytes of the zstd stream at ``start`` (``length`` bytes) of ``fd``.

    Decoding once at construction finds the decoded size (refused past ``limit``) and keeps
    both ends; :meth:`readinto` serves other ranges by decoding from the nearest point
    before them (the current decoder, or the start).

    Raises:
        NotACheckpointError: ``zstandard`` is not installed.
        CorruptCheckpointError: the stream is damaged, or decodes to more than ``limit``.
    """

    def __init__(self, fd: int | ReadAt, start: int, length: int, *, limit: int,
                 source: str) -> None:
        super().__init__()
        self._zstd = require_zstandard(source)
        self._fd, self._start, self._length, self._source = fd, start, length, source
        self._limit = limit
        self._pos = 0
        self._decoder: Any = None
        self._decoded = 0  # position of the live decoder in the decoded bytes
        head, tail, self.size = bytearray(), bytearray(), 0
        for block in self._blocks():
            if len(head) < _EDGE:
                head += block[:_EDGE - len(head)]
            tail += block
            del tail[:max(0, len(tail) - _EDGE)]
            self.size += len(block)
        self._head, self._tail = bytes(head), bytes(tail)
        self._decoder = None

    # -- decoding -----------------------------------------------------------------------

    def _fail(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self._source}: the zstd stream at offset {self._start} (length {self._length}) "
            f"{why}; the file is damaged: use an intact copy")

    def _restart(self) -> None:
        source = _Window(self._fd, self._start, self._length)
        self._decoder = self._zstd.ZstdDecompressor().stream_reader(
            source, read_size=_BLOCK, read_across_frames=True, closefd=False)
        self._decoded = 0

    def _read_block(self, count: int) -> bytes:
        try:
            block = self._decoder.read(count)
        except self._zstd.ZstdError as exc:
            raise self._fail(f"does not decode ({str(exc)[:120]})") from None
        self._decoded += len(block)
        if self._decoded > self._limit:
            raise self._fail(f"decodes to more than the {self._limit} bytes its entry declares "
                             "(a decompression bomb, or damage)")
        return bytes(block)

    def _blocks(self) -> Any:
        self._restart()
        while True:
            block = self._read_block(_BLOCK)
            if not block:
                return
            yield block

    # -- the file interface -------------------------------------------------------------

    def _extent(self) -> int:
        return self.size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self.size - self._pos))
        if count == 0:
            return 0
        begin, end = self._pos, self._pos + count
        if end <= len(self._head):
            view[:count] = self._head[begin:end]
        elif begin >= self.size - len(self._tail):
            at = begin - (self.size - len(self._tail))
            view[:count] = self._tail[at:at + count]
        else:
            self._decode_into(view[:count], begin)
        self._pos = end
        return count

    def _decode_into(self, view: memoryview, begin: int) -> None:
        if self._decoder is None or self._decoded > begin:
            self._restart()
        while self._decoded < begin:  # skip forward, in bounded blocks
            if not self._read_block(min(_BLOCK, begin - self._decoded)):
                raise self._fail("ends early")
        done = 0
        while done < len(view):
            block = self._read_block(len(view) - done)
            if not block:
                raise self._fail("ends early")
            view[done:done + len(block)] = block
            done += len(block)

    def read_at(self, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` with the decoded bytes from ``offset``."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.seek(offset)
        if self.readinto(view) != len(view):
            raise self._fail(f"ends before byte {offset + len(view)} of its decoded bytes")


class _Window(io.RawIOBase):
    """``length`` bytes of ``fd`` from ``start``, read by offset (no shared position): with
    ``pread`` from a descriptor, or with ``read_at`` from a remote file (checked whole)."""

    def __init__(self, fd: int | ReadAt, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._length - self._pos))
        if count == 0:
            return 0
        if isinstance(self._fd, int):
            got = os.preadv(self._fd, [view[:count]], self._start + self._pos)
        else:
            self._fd.read_at(view[:count], self._start + self._pos)
            got = count
        self._pos += got
        return got


def open_entry(file: IO[bytes], offset: int, length: int, transforms: tuple[str, ...], *,
               limit: int, source: str,
               reader: int | ReadAt | None = None) -> tuple[IO[bytes], int, int]:
    """Where an entry's archive can be read: ``(handle, start, length)``.

    An untransformed entry is ``file`` itself at its range; a compressed one is a
    :class:`ZstdEntry` over its decoded bytes, from 0 (``transforms`` is what
    :func:`check_transforms` accepted), read by offset from ``reader`` (default: ``file``'s
    descriptor, or a remote file itself).
    """
    if not transforms:
        return file, offset, length
    if reader is None:
        reader = file if isinstance(file, ReadAtFile) else file.fileno()
    entry = ZstdEntry(reader, offset, length, limit=limit, source=source)
    return cast(IO[bytes], entry), 0, entry.size


def chunk_limit(tensor: TensorEntry, chunk: Chunk) -> int:
    """The most decoded bytes a compressed chunk's archive may have: its elements, as the
    metadata declares them, plus an archive's overhead."""
    return chunk.numel * tensor.dtype.itemsize + ARCHIVE_SLACK
