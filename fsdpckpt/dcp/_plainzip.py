"""The usual ``torch.save`` archive read without ``zipfile``'s per-archive cost.

A tensor saved in 4,096 chunks is 4,096 archives, each opened to find its storage entry
and CRC-32: ``zipfile.ZipFile`` spent about 60 us on each (its central-directory parse
and its entry reader, through a window over the file), more than copying a 256 KiB
chunk costs. :func:`plain_archive` reads the archive as ``torch.save`` writes it, the
plain case only, with a few ``struct`` calls: the end records in the archive's last bytes
(zip64's, which torch.save always writes, then the plain one, no comment), a central
directory of exactly the declared entries filling
exactly the bytes it declares, ASCII names without NUL, no extra fields or comments, no
name twice. Anything else returns None, and the caller opens the archive with
``zipfile`` as before: so whatever is odd, damaged or crafted gets ``zipfile``'s reading
and the same refusals. :meth:`PlainArchive.read` likewise hands an entry whose bytes do
not read back plainly (a local header that differs, a short file, a CRC-32 that fails)
to ``zipfile``, which raises what it always raised.

It offers the part of ``zipfile.ZipFile`` the chunk reader uses (``infolist``,
``getinfo``, ``read``), with the same fields on each entry.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import IO, Any

__all__ = ["PlainArchive", "plain_archive"]

_END = struct.Struct("<4sHHHHIIH")  # signature, disks, entries here, entries, size, offset, comment
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # zipfile's structCentralDir
_LOCAL = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader
_ZIP64_LOCATOR = b"PK\x06\x07"
_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, disks
_END64 = struct.Struct("<4sQ2H2L4Q")  # zipfile's structEndArchive64
#: The archive's last bytes that hold its end records: zip64's, its locator, the plain one.
_TAIL = _END64.size + _LOCATOR.size + _END.size
#: Flags zipfile reads differently (encrypted, compressed patched data, strong encryption).
_ODD_FLAGS = 0x1 | 0x20 | 0x40
_MAX_ZIP_VERSION = 63  # zipfile's MAX_EXTRACT_VERSION: newer ones it refuses


class _Entry:
    """The fields of a ``zipfile.ZipInfo`` that readers of chunk archives use."""

    __slots__ = ("filename", "orig_filename", "header_offset", "file_size", "compress_size",
                 "CRC", "compress_type", "flag_bits", "extract_version", "raw_name")

    def __init__(self, raw_name: bytes, fields: tuple[Any, ...]) -> None:
        self.raw_name = raw_name
        self.filename = self.orig_filename = raw_name.decode("ascii")
        (self.extract_version, self.flag_bits, self.compress_type, self.CRC,
         self.compress_size, self.file_size, self.header_offset) = fields


class PlainArchive:
    """A plain ``torch.save`` archive at ``start`` (``length`` bytes) of ``file``."""

    def __init__(self, file: IO[bytes], start: int, length: int,
                 entries: dict[str, _Entry], fallback: Callable[[], zipfile.ZipFile]) -> None:
        self._file, self._start, self._length = file, start, length
        self._entries, self._fallback = entries, fallback
        self._zip: zipfile.ZipFile | None = None

    def infolist(self) -> list[Any]:
        return list(self._entries.values())

    def getinfo(self, name: str) -> Any:
        return self._entries[name]  # KeyError, as zipfile's

    def read(self, info: Any) -> bytes:
        """The bytes of the stored entry ``info``, checked against its CRC-32; ``zipfile``
        reads (and refuses) any entry whose bytes are not plainly where the directory says."""
        at = self._start + info.header_offset
        # Never a byte past the window, whatever the directory says (open_archive's checks
        # refuse such an entry first; this class keeps the rule on its own too).
        inside = info.header_offset >= 0 and at + _LOCAL.size <= self._start + self._length
        header = _read(self._file, at, _LOCAL.size) if inside else b""
        if len(header) == _LOCAL.size:
            fields = _LOCAL.unpack(header)
            name_len, extra_len = fields[10], fields[11]
            data_start = at + _LOCAL.size + name_len + extra_len
            if fields[0] == b"PK\x03\x04" and not info.flag_bits & _ODD_FLAGS and \
                    info.compress_type == zipfile.ZIP_STORED and \
                    info.file_size == info.compress_size and \
                    data_start + info.file_size <= self._start + self._length and \
                    _read(self._file, at + _LOCAL.size, name_len) == info.raw_name:
                data = _read(self._file, data_start, info.file_size)
                if len(data) == info.file_size and zlib.crc32(data) == info.CRC:
                    return data
        return self._zipfile().read(info.filename)

    def _zipfile(self) -> zipfile.ZipFile:
        if self._zip is None:
            self._zip = self._fallback()
        return self._zip

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None

    def __enter__(self) -> PlainArchive:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _read(file: IO[bytes], offset: int, count: int) -> bytes:
    """Up to ``count`` bytes of ``file`` from ``offset``; fewer only at its end."""
    file.seek(offset)
    parts, got = [], 0
    while got < count:
        part = file.read(count - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def plain_archive(file: IO[bytes], start: int, length: int, max_entries: int,
                  fallback: Callable[[], zipfile.ZipFile]) -> PlainArchive | None:
    """The archive at ``start`` (``length`` bytes) of ``file`` when it is plain, its entries
    from its central directory; None when ``zipfile`` must read it (see the module's text).
    ``fallback`` opens it with ``zipfile``, for an entry that does not read back plainly.

    Reads the end record and the central directory: nothing is allocated or looped by a
    declared number before that number is checked against the bytes present.
    """
    if start < 0 or length < _END.size:
        return None
    tail_size = min(length, _TAIL)
    tail = _read(file, start + length - tail_size, tail_size)
    if len(tail) < tail_size:
        return None
    signature, disk, cd_disk, here, count, size, offset, comment = _END.unpack(tail[-_END.size:])
    if signature != b"PK\x05\x06" or comment:
        return None
    directory_end = length - _END.size
    if tail[-_END.size - _LOCATOR.size:-_END.size][:4] == _ZIP64_LOCATOR:
        # torch.save ends every archive with zip64's records: zipfile then takes the counts
        # and the directory's place from the zip64 end record just before the locator.
        if tail_size < _TAIL:
            return None
        locator = _LOCATOR.unpack(tail[_END64.size:_END64.size + _LOCATOR.size])
        record = _END64.unpack(tail[:_END64.size])
        if locator[1] != 0 or locator[3] > 1 or record[0] != b"PK\x06\x06":
            return None
        disk, cd_disk, here, count, size, offset = record[4:]
        directory_end = length - _TAIL
    if disk or cd_disk or here != count or not 0 < count <= max_entries or \
            count * _CENTRAL.size > size or offset + size != directory_end:
        return None
    directory = _read(file, start + offset, size)
    if len(directory) != size:
        return None
    entries: dict[str, _Entry] = {}
    at = 0
    for _ in range(count):
        if at + _CENTRAL.size > size:
            return None
        fields = _CENTRAL.unpack_from(directory, at)
        name_len, extra_len, comment_len = fields[12], fields[13], fields[14]
        name = directory[at + _CENTRAL.size:at + _CENTRAL.size + name_len]
        at += _CENTRAL.size + name_len
        if fields[0] != b"PK\x01\x02" or extra_len or comment_len or len(name) != name_len \
                or not name.isascii() or b"\0" in name or fields[3] > _MAX_ZIP_VERSION \
                or 0xFFFFFFFF in (fields[10], fields[11], fields[18]):
            return None
        entry = _Entry(name, (fields[3], fields[5], fields[6], fields[9], fields[10],
                              fields[11], fields[18]))
        if entry.filename in entries:
            return None
        entries[entry.filename] = entry
    return PlainArchive(file, start, length, entries, fallback) if at == size else None
