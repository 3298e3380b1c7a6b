"""Checksums of files as they are written, at almost no cost beyond what torch already pays.

A manifest needs each file's CRC-32. Computing it over every byte as DCP writes costs about
40% of a save here (zlib's CRC runs at 2.5-4 GB/s, the save itself at page-cache speed).
But ``torch.save`` already computes the CRC-32 of every record it writes and stores it in
the archive's zip directory, and it writes each tensor's data in one ``write`` call. So
:class:`ChecksumStream` computes the CRC of small writes only, and leaves each large write
as a hole (offset, length); once the file is complete, each hole takes the CRC torch stored
for the record that occupies exactly those bytes, and the pieces are joined with
:func:`crc32_combine`, which needs only their CRCs and lengths. A hole no record matches
(something other than torch.save wrote a large block) is read back and checksummed, so the
result is always the CRC-32 of the whole file, as ``zlib.crc32`` of its bytes would give.

A cryptographic digest cannot be assembled this way: with ``digest=`` every byte is hashed
as it is written.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from typing import IO, Any

from fsdpckpt._io.rawio import ReadAt, pread_into, scratch
from fsdpckpt.errors import OptionError

try:  # ISA-L's CRC-32: the same sums as zlib's, 4-5x as fast (10 GB/s a core here, 2.1)
    from isal.isal_zlib import crc32
except ImportError:  # an optional speed-up (fsdpckpt[fast])
    from zlib import crc32

__all__ = ["DIGESTS", "ChecksumStream", "Pieces", "crc32", "crc32_combine", "crc32_range",
           "file_checksums", "new_digest", "resolve_pieces"]

#: The cryptographic digests a manifest can carry per file (``save_state(digest=...)``).
DIGESTS = ("sha256", "blake2b")

#: A file's CRC-32 as written: ``[offset, length, crc32 or None for a hole]`` per piece.
Pieces = list[list[Any]]

_HOLE = 1 << 20  # writes this large are left to torch's own CRC (tensor data)
_POLY = 0xEDB88320  # CRC-32 (reflected), as zlib


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial (reflected bit order), as zlib's."""
    product, bit = 0, 1 << 31
    while True:
        if a & bit:
            product ^= b
            if a & (bit - 1) == 0:
                return product
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..63
for _ in range(63):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len(B)``
    (zlib's ``crc32_combine``, which Python's zlib module does not expose)."""
    power, k, n = 1 << 31, 3, length2  # x^(8 * length2): 2^3 bits per byte
    while n:
        if n & 1:
            power = _multmodp(_X2N[k & 63], power)
        n, k = n >> 1, k + 1
    return _multmodp(power, crc1) ^ crc2


def new_digest(name: str | None) -> Any:
    """A fresh hashlib object for the digest ``name`` (one of :data:`DIGESTS`), or None."""
    if name is None:
        return None
    if name not in DIGESTS:
        raise OptionError(f"unknown digest {name!r}: use one of {', '.join(DIGESTS)} (or None "
                         "for CRC-32 only)")
    return hashlib.new(name)


class ChecksumStream:
    """A write-only stream proxy that records the size, the CRC-32 pieces and (optionally)
    a digest of what is written, for a file written from its start in order."""

    def __init__(self, stream: IO[bytes], digest: str | None) -> None:
        self._stream, self.size = stream, 0
        self.pieces: Pieces = []
        self.hasher = new_digest(digest)

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        view = memoryview(data).cast("B")
        count = len(view) if written is None else written
        view = view[:count]
        if self.hasher is not None:
            self.hasher.update(view)
        if count >= _HOLE:
            self.pieces.append([self.size, count, None])
        elif self.pieces and self.pieces[-1][2] is not None:  # extend the run of small writes
            self.pieces[-1][1] += count
            self.pieces[-1][2] = crc32(view, self.pieces[-1][2])
        else:
            self.pieces.append([self.size, count, crc32(view)])
        self.size += count
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def resolve_pieces(pieces: Pieces, known: Mapping[tuple[int, int], int],
                   read_back: Callable[[int, int], int]) -> int:
    """The CRC-32 of a whole file from its pieces.

    Args:
        pieces: as :class:`ChecksumStream` recorded them.
        known: ``{(offset, length): crc32}`` of the records torch's zip directories give.
        read_back: computes the CRC-32 of ``(offset, length)`` of the file, for a hole
            that no known record covers exactly.
    """
    crc = 0
    for offset, length, piece in pieces:
        if piece is None:
            piece = known.get((offset, length))
            if piece is None:
                piece = read_back(offset, length)
        crc = crc32_combine(crc, piece, length)
    return crc


def crc32_range(fd: int | ReadAt, start: int, count: int, progress: Any = None,
                block: int = 16 * 2**20, *, source: str = "a file", hasher: Any = None,
                crc: int = 0) -> int:
    """CRC-32 of ``count`` bytes at ``start`` of the open file ``fd`` (a descriptor, or
    anything read by offset: a remote file, a decoder), read in blocks, continuing ``crc``;
    the same bytes also go into ``hasher`` (a hashlib object) when one is given.

    Raises:
        CorruptCheckpointError: the file ends before ``start + count``.
    """
    buffer = scratch(min(count, block), "crc") if count > 0 else memoryview(b"")
    while count > 0:
        data = buffer[:min(count, len(buffer))]
        pread_into(fd, data, start, source=source)
        crc = crc32(data, crc)
        if hasher is not None:
            hasher.update(data)
        start, count = start + len(data), count - len(data)
        if progress:
            progress(len(data))
    return crc


def file_checksums(path: str | os.PathLike[str], progress: Any = None,
                   digest: str | None = None) -> tuple[int, int, str | None]:
    """``(size, crc32, hex digest or None)`` of a whole file, in one read."""
    hasher = new_digest(digest)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        crc = crc32_range(fd, 0, size, progress, source=str(path), hasher=hasher)
    finally:
        os.close(fd)
    return size, crc, hasher.hexdigest() if hasher is not None else None
