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

Its entries pass the checks ``open_archive`` makes of any archive (stored, not encrypted,
a zip version zipfile reads, inside the archive, no two sharing bytes); one that does not
is left to ``zipfile`` and those checks, which refuse it as before. A directory equal to
one read before except in its CRC-32s is taken from that one (:class:`_Layout`): the
chunks of one tensor have such directories. :class:`EndsRead` reads an archive's first
and last bytes once, so the headers, pickle and directory come from two reads.

It offers the part of ``zipfile.ZipFile`` the chunk reader uses (``namelist``,
``infolist``, ``getinfo``, ``read``), with the same fields on each entry.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import IO, Any

__all__ = ["EndsRead", "PlainArchive", "end_records", "plain_archive"]

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

    def __init__(self, raw_name: bytes, fields: tuple[Any, ...], crc: int) -> None:
        """From the name, ``_CENTRAL``'s fields of its central directory record, and its
        CRC-32 (field 9, read apart: see :class:`_Layout`)."""
        self.raw_name, self.CRC = raw_name, crc
        self.filename = self.orig_filename = raw_name.decode("ascii")
        (self.extract_version, self.flag_bits, self.compress_type, self.compress_size,
         self.file_size, self.header_offset) = (
            fields[3], fields[5], fields[6], fields[10], fields[11], fields[18])


class _Layout:
    """A central directory read and accepted before, all but its CRC-32s.

    A tensor in 4,096 chunks is 4,096 archives whose directories differ only there (each
    chunk's bytes, and its serialization id, have their own CRC-32): a directory equal to
    this one around its CRC-32 fields passed every check this one passed (no check reads
    a CRC-32), so it is taken with its own CRC-32s, in two ``struct`` calls instead of a
    parse and checks per entry. Any other byte different: parsed afresh.
    """

    __slots__ = ("around", "parts", "crcs", "fields", "reach")

    def __init__(self, directory: bytes, starts: list[int],
                 fields: dict[str, tuple[bytes, tuple[Any, ...], int]], reach: int) -> None:
        around, crcs, prev = "<", "<", 0
        for start in starts:  # a central record's CRC-32 is its bytes 16-20
            around += f"{start + 16 - prev}s4x"
            crcs += f"{start + 16 - prev}xI"
            prev = start + 20
        self.around = struct.Struct(f"{around}{len(directory) - prev}s")
        self.crcs = struct.Struct(crcs)
        self.parts = self.around.unpack(directory)
        #: name -> (raw name, its record's fields, its index among the CRC-32s)
        self.fields = fields
        self.reach = reach  # where the last entry ends: the archive must be as long


#: Directories read before, by their size (a few: the chunks of a folder's tensors).
_LAYOUTS: dict[int, _Layout] = {}
_LAYOUTS_KEPT = 16


class PlainArchive:
    """A plain ``torch.save`` archive at ``start`` (``length`` bytes) of ``file``."""

    def __init__(self, file: IO[bytes] | int, start: int, length: int,
                 fields: dict[str, tuple[bytes, tuple[Any, ...], int]], crcs: tuple[int, ...],
                 fallback: Callable[[], zipfile.ZipFile],
                 ends: tuple[int, int, int]) -> None:
        self._file, self._start, self._length = file, start, length
        #: What :func:`end_records` read: the entry count, the directory's offset and size.
        self.ends = ends
        self._fields, self._crcs, self._fallback = fields, crcs, fallback
        self._entries: dict[str, _Entry] = {}  # made when asked for: a reader uses three
        self._zip: zipfile.ZipFile | None = None

    def namelist(self) -> list[str]:
        return list(self._fields)

    def infolist(self) -> list[Any]:
        return [self.getinfo(name) for name in self._fields]

    def getinfo(self, name: str) -> Any:
        found = self._entries.get(name)
        if found is None:
            raw_name, fields, index = self._fields[name]  # KeyError, as zipfile's
            found = self._entries[name] = _Entry(raw_name, fields, self._crcs[index])
        return found

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
                    data_start + info.file_size <= self._start + self._length:
                # The name and the data in one read: both lie between the header and the end.
                rest = _read(self._file, at + _LOCAL.size, data_start + info.file_size
                             - at - _LOCAL.size)
                data = rest[name_len + extra_len:]
                if rest[:name_len] == info.raw_name and len(data) == info.file_size and \
                        zlib.crc32(data) == info.CRC:
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


#: How much of each end of a chunk archive :class:`EndsRead` reads at once: its first bytes
#: hold the pickle, the byte order and the storage's local header, its last ones the central
#: directory and the end records (a chunk's archive has seven entries: about 600 bytes).
ENDS = 1024


class EndsRead:
    """``file`` (a file object, or a descriptor read by ``pread``) read through the first
    ``2 * ENDS`` and the last :data:`ENDS` bytes of the archive at ``start`` (``length``
    bytes), each read once: the headers, pickle and directory that locating a chunk's
    tensor reads come from them, two reads in place of a dozen seeks and reads (issue 32:
    a tensor in 4,096 chunks is 4,096 archives opened). A read that is not wholly inside
    what was read goes to ``file``; so do bytes past a short file's end (the window holds
    only the bytes the file gave). A file object for ``zipfile``: ``seek``, ``tell``, ``read``.
    """

    def __init__(self, file: IO[bytes] | int, start: int, length: int) -> None:
        self._file, self._pos = file, 0
        self._start, self._length = start, length
        self._windows: list[tuple[int, bytes]] | None = None  # read at the first read

    def _read_windows(self) -> list[tuple[int, bytes]]:
        file, start, length = self._file, self._start, self._length
        head = min(max(length, 0), 2 * ENDS)  # a small archive: read whole, once
        windows = [(start, _read(file, start, head))] if start >= 0 else []
        if start >= 0 and length > head:
            windows.append((start + length - ENDS, _read(file, start + length - ENDS, ENDS)))
        self._windows = windows
        return windows

    def _size(self) -> int:
        file = self._file
        return os.fstat(file).st_size if isinstance(file, int) else file.seek(0, 2)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._size() + offset if whence == 2 \
            else self._pos + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, count: int = -1) -> bytes:
        at = self._pos
        if count >= 0:
            windows = self._windows if self._windows is not None else self._read_windows()
            for begin, data in windows:
                if begin <= at and at + count <= begin + len(data):
                    self._pos += count
                    return data[at - begin:at - begin + count]
        got = _read(self._file, at, count if count >= 0 else max(0, self._size() - at))
        self._pos += len(got)
        return got


_BIG_READ = 1 << 20


def _read(file: IO[bytes] | int, offset: int, count: int) -> bytes:
    """Up to ``count`` bytes of ``file`` (a file object or a descriptor) from ``offset``;
    fewer only at its end."""
    if isinstance(file, int):
        if count > _BIG_READ:  # never a buffer larger than the bytes the file holds there
            count = max(0, min(count, os.fstat(file).st_size - offset))
        first = os.pread(file, count, offset)
    else:
        file.seek(offset)
        first = file.read(count)
    if len(first) >= count or not first:  # all of it (the usual case), or the file's end
        return first
    parts, got = [first], len(first)
    while got < count:
        if isinstance(file, int):
            part = os.pread(file, count - got, offset + got)
        else:
            part = file.read(count - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def end_records(tail: bytes, length: int) -> tuple[int, int, int] | str:
    """The entry count, offset and size of the central directory the end records declare,
    from ``tail``, the last ``min(length, _TAIL)`` bytes of an archive of ``length`` bytes;
    or why they can be read two ways (the text goes into open_archive's refusal).

    The one rule of where an archive's directory is, for both readings (issue 42). torch's
    reader (miniz) takes the end record it finds last, the zip64 end record where zip64's
    locator points, and the directory at its declared offset; Python's ``zipfile`` takes
    the zip64 record just before the locator, and the directory just before the end
    records, inferring prepended bytes (its ``concat``) where the declared offset differs.
    Accepted: only the layout where all of these are the same bytes, as ``torch.save``
    writes it: the plain end record the last 22 bytes (no comment, nothing after it), the
    zip64 records (if any) exactly before it and pointing at each other, and the directory
    ending exactly where they begin.
    """
    if len(tail) < _END.size or tail[-_END.size:][:4] != b"PK\x05\x06":
        return "has no zip end record as its last 22 bytes (cut short, or bytes after it)"
    _, disk, cd_disk, here, count, size, offset, comment = _END.unpack(tail[-_END.size:])
    if comment:
        return "ends in a zip comment"
    directory_end = length - _END.size
    if len(tail) >= _END.size + _LOCATOR.size and \
            tail[-_END.size - _LOCATOR.size:-_END.size][:4] == _ZIP64_LOCATOR:
        # torch.save ends every archive with zip64's records, which then give the counts
        # and the directory's place (to both readers, whatever the plain record says).
        if len(tail) < _TAIL:
            return "has a zip64 locator but no room for its record"
        _, locator_disk, at, disks = _LOCATOR.unpack(tail[_END64.size:_END64.size + _LOCATOR.size])
        record = _END64.unpack(tail[:_END64.size])
        if record[0] != b"PK\x06\x06" or at != length - _TAIL or record[1] != _END64.size - 12:
            return "has a zip64 locator that does not point at the zip64 record just before it"
        if locator_disk or disks != 1:
            return "spans several disks"
        disk, cd_disk, here, count, size, offset = record[4:]
        directory_end = length - _TAIL
    if disk or cd_disk or here != count:
        return "spans several disks"
    if offset + size != directory_end:
        return (f"declares its central directory at bytes {offset}-{offset + size}, not "
                f"where it ends, at byte {directory_end}: Python's zipfile reads another "
                "directory there (prepended or appended bytes) than torch's reader")
    if count * _CENTRAL.size > size or count == 0:
        return f"declares {count} entries in a central directory of {size} bytes"
    return count, offset, size


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
    ends = end_records(tail, length)
    if isinstance(ends, str):
        return None  # open_archive refuses it, saying why
    count, offset, size = ends
    declared = struct.unpack_from("<H", tail, len(tail) - 12)[0]
    if count > max_entries or 0xFFFF != declared > max_entries:
        # open_archive refuses what the plain record declares before it parses (even where
        # a zip64 record gives the counts): left to it, for that refusal.
        return None
    directory = _read(file, start + offset, size)
    if len(directory) != size:
        return None
    layout = _LAYOUTS.get(size)
    if layout is None or layout.reach > length or \
            layout.around.unpack_from(directory) != layout.parts:
        layout = _parse_directory(directory, count, length)
        if layout is None:
            return None
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        _LAYOUTS[size] = layout
    return PlainArchive(file, start, length, layout.fields, layout.crcs.unpack_from(directory),
                        fallback, ends)


def _parse_directory(directory: bytes, count: int, length: int) -> _Layout | None:
    """The ``count`` records of a central directory (exactly its bytes) of an archive of
    ``length`` bytes, checked; None where ``zipfile`` must read it."""
    size = len(directory)
    fields_of: dict[str, tuple[bytes, tuple[Any, ...], int]] = {}
    spans, starts = [], []
    at = 0
    unpack, central = _CENTRAL.unpack_from, _CENTRAL.size
    for index in range(count):
        if at + central > size:
            return None
        fields = unpack(directory, at)
        name_len, header_offset, file_size = fields[12], fields[18], fields[11]
        name = directory[at + central:at + central + name_len]
        starts.append(at)
        at += central + name_len
        # What open_archive's _check_entries refuses (compressed, encrypted, a newer zip,
        # outside the archive, overlapping) goes to zipfile, and so to that refusal. Fields:
        # 3 the zip version, 5 the flags, 6 the method (stored is 0), 13-14 extra, comment.
        if fields[0] != b"PK\x01\x02" or fields[13] or fields[14] or len(name) != name_len \
                or fields[3] > _MAX_ZIP_VERSION or fields[5] & _ODD_FLAGS or fields[6] \
                or header_offset + 30 + file_size > length or fields[10] == 0xFFFFFFFF \
                or file_size == 0xFFFFFFFF or header_offset == 0xFFFFFFFF \
                or not name.isascii() or b"\0" in name:
            return None
        text = name.decode("ascii")
        if text in fields_of:
            return None
        fields_of[text] = (name, fields, index)
        spans.append((header_offset, header_offset + 30 + name_len + file_size))
    spans.sort()
    for (_, end), (begin, _) in zip(spans, spans[1:]):
        if begin < end:
            return None
    if at != size:
        return None
    # The length the checks above asked of the archive: a later one must be as long.
    reach = max(fields[18] + 30 + fields[11] for _, fields, _ in fields_of.values())
    return _Layout(directory, starts, fields_of, reach)
