"""Opening the zip archive ``torch.save`` writes, refusing what it never writes.

``zipfile`` reports damage with a dozen builtin exceptions (BadZipFile, EOFError,
NotImplementedError, UnicodeDecodeError, OverflowError and OSError from seeks, ...).
Every zip operation on checkpoint bytes goes through this module, which turns each of
them into one :class:`CorruptCheckpointError` naming the file (``source``) and the byte
range of the archive or entry, so damage is always one line, never a traceback.
"""

from __future__ import annotations

import lzma
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import IO, Any

from fsdpckpt._io.rawio import SizedReader
from fsdpckpt._printable import printable
from fsdpckpt.dcp._plainzip import _TAIL, end_records, plain_archive
from fsdpckpt.errors import (
    ChecksumError,
    CorruptCheckpointError,
    FsdpCkptError,
    NotACheckpointError,
)

__all__ = ["CHUNK_ENTRIES", "CHUNK_PICKLE_BYTES", "SliceFile", "entry_info", "open_archive",
           "read_entry", "zip_errors"]

class SliceFile(SizedReader):
    """A read-only, seekable view of ``length`` bytes of ``file`` starting at ``start``."""

    def __init__(self, file: IO[bytes], start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def _extent(self) -> int:
        return self._length

    def readinto(self, buffer: Any) -> int:
        """Fill ``buffer`` from the window; short only at the window's or the file's real end.

        The underlying ``read`` may return fewer bytes than asked (a pipe, a network file
        system, a signal); it is called again until the count is reached or it returns
        nothing, so a short result here always means end of data.
        """
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._length - self._pos))
        done = 0
        if count == 0:  # nothing to read: no seek either (the offset may be past any file)
            return 0
        self._file.seek(self._start + self._pos)
        while done < count:
            data = self._file.read(count - done)
            if not data:
                break
            view[done:done + len(data)] = data
            done += len(data)
        self._pos += done
        return done


# What zipfile (and the file under it) raises on damaged or crafted bytes. zlib/LZMA
# errors cannot happen while compressed entries are refused, but are listed in case.
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError,
               RuntimeError, UnicodeDecodeError, OverflowError, OSError, ValueError,
               struct.error, zlib.error, lzma.LZMAError, KeyError, IndexError, RecursionError)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return printable(lines[0][:200] if lines else "") or type(exc).__name__


class zip_errors:  # a class named as the function it replaces: ``with zip_errors(...)``
    """Turn zipfile's and the file's failures inside the block into one error.

    A class, not a generator: it wraps every chunk archive's reads (a tensor in 4,096
    chunks enters it 16,000 times), and ``where`` may be a callable that makes the text
    only when there is an error to name.

    Args:
        source: how to name the file (and tensor) in the message.
        where: the byte range read, e.g. "the archive at offset 0 (length 2665)".

    Raises:
        ChecksumError: an entry's bytes do not match the CRC-32 its zip directory records
            (zipfile checks it as it reads an entry).
        CorruptCheckpointError: naming ``source`` and ``where``; fsdpckpt's own errors
            pass through unchanged.
    """

    __slots__ = ("_source", "_where")

    def __init__(self, source: str, where: str | Callable[[], str]) -> None:
        self._source, self._where = source, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 _tb: object) -> None:
        if exc is None or isinstance(exc, FsdpCkptError) or not isinstance(exc, _ZIP_ERRORS):
            return  # passes through unchanged
        source, where = self._source, self._where
        where = where if isinstance(where, str) else where()
        if isinstance(exc, zipfile.BadZipFile) and str(exc).startswith("Bad CRC-32"):
            # zipfile checks an entry's CRC-32 as it reads it: the bytes changed after writing.
            raise ChecksumError(
                f"{source}: {where}: {_first_line(exc)}: the file changed after it was written "
                "(a flipped bit, a bad disk or a faulty transfer); restore the file from a good "
                "copy.") from exc
        raise _damaged(source, where, exc) from exc


def _damaged(source: str, where: str, exc: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: {where} is not a torch.save archive that can be read "
        f"({type(exc).__name__}: {_first_line(exc)}); the file is damaged or was "
        "overwritten.")


#: Entries a chunk's archive may hold: torch.save writes about seven (data.pkl, byteorder,
#: version, .format_version, .storage_alignment, .data/serialization_id, data/0).
CHUNK_ENTRIES = 32
#: Bytes a chunk's ``data.pkl`` may have: it names one tensor (a few hundred bytes).
CHUNK_PICKLE_BYTES = 1 << 16
_EOCD = struct.Struct("<4s4xHHII")  # signature, ..., entries here, entries, cd size, cd offset
_MAX_ZIP_VERSION = 63  # the newest zip version Python's zipfile reads


def _declared_entries(file: IO[bytes], start: int, length: int) -> int | None:
    """The entry count the end-of-central-directory record declares, read before any parse.

    None when the record is not the plain 22 bytes at the very end (a comment, zip64):
    the count is then checked after parsing.
    """
    if length < 22:
        return None
    file.seek(start + length - 22)
    record = file.read(22)
    if len(record) < 22 or record[:4] != b"PK\x05\x06" or record[-2:] != b"\0\0":
        return None
    entries = _EOCD.unpack(record[:20])[2]
    return None if entries == 0xFFFF else entries


_LOCAL = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader
_DESCRIPTOR = struct.Struct("<4sLLL")  # signature, CRC-32, sizes: what torch.save writes
_DESCRIPTOR64 = struct.Struct("<4sLQQ")  # the same for an entry of zip64 sizes
_ZIP64 = 0xFFFFFFFF  # a size or offset whose value is in the entry's zip64 extra field


def _named(name: object) -> str:
    """An entry's name for a message: escaped, at most 200 characters (a zip name may hold
    64 KiB)."""
    text = str(name)
    return printable(text if len(text) <= 200 else text[:197] + "...")


class _TwoWays(Exception):
    """Why an archive can be read two ways: open_archive words the refusal."""


def _two_ways(source: str, where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: {where} {why}, which torch.save never writes: it can be read two ways "
        "(torch's reader and Python's zipfile would take different bytes from it), so it is "
        "refused; the file is damaged or crafted, restore it from a good copy.")


def _check_entries(archive: Any, file: IO[bytes], start: int, length: int,
                   ends: tuple[int, int, int], source: str, where: str) -> None:
    """Refuse what torch.save never writes, before any entry is decompressed or read.

    Compressed or encrypted entries (a zip bomb needs compression), zip versions
    zipfile cannot read, and entries that reach outside the archive's byte range or
    share bytes with another are all damage or crafting; refusing them here keeps
    every read bounded by the archive's own bytes.

    And what can be read two ways (issue 42): the entries the end records declare, no
    more (``zipfile`` reads the directory's bytes, torch's reader its count); every name
    once, ASCII without NUL (``zipfile`` cuts a name at a NUL; torch's reader matches names
    ignoring case, and takes one of a name listed twice where ``zipfile`` takes the last),
    all in the folder of the first (torch's reader looks every name up there); every local
    header agreeing with its directory record; and the entries, each with its data
    descriptor, filling the bytes from the archive's first byte to its directory, so that
    no byte of the range lies outside the one reading (no bytes before the archive, no
    second archive inside it).
    """
    count, directory, _ = ends
    infos = archive.infolist()
    if len(infos) != count:
        raise _TwoWays(f"lists {len(infos)} entries in a directory its end record says holds "
                       f"{count}")
    names: set[str] = set()
    prefix = None
    spans = []
    for info in infos:
        why = None
        name = info.orig_filename
        folder = name.split("/", 1)[0] + "/" if "/" in name else None
        prefix = prefix or folder
        if info.compress_type != zipfile.ZIP_STORED:
            why = f"is compressed (method {info.compress_type}), which torch.save never does"
        elif info.flag_bits & 0x1:
            why = "is encrypted, which torch.save never does"
        elif info.extract_version > _MAX_ZIP_VERSION:
            why = f"needs zip version {info.extract_version / 10:.1f}, which nothing here reads"
        elif info.header_offset < 0 or info.header_offset + 30 + info.file_size > length:
            why = f"lies outside the archive's {length} bytes"
        if why:
            raise CorruptCheckpointError(f"{source}: {where}: the entry "
                                         f"'{_named(name)}' {why}; the file is "
                                         "damaged or crafted.")
        if prefix is None:
            # Not read two ways: torch's reader finds no record in it at all.
            raise NotACheckpointError(f"{source}: {where}: not a readable torch.save file: its "
                                      f"entry '{_named(name)}' lies in no folder, where "
                                      "torch.save puts every entry; it is not a torch.save "
                                      "file, or it is damaged")
        if not name.isascii() or "\0" in name or folder is None or folder != prefix:
            raise _TwoWays(f"has an entry named '{_named(name)}' (not ASCII, holding a NUL, "
                           f"or outside the folder '{_named(prefix)}' of its first entry)")
        if name.lower() in names:
            raise _TwoWays(f"lists the entry '{_named(name)}' twice")
        names.add(name.lower())
        spans.append((info.header_offset, info.header_offset + 30 + len(name)
                      + info.file_size, name, info))
    spans.sort(key=lambda span: span[:2])
    for (_, end, first, _), (begin, _, second, _) in zip(spans, spans[1:]):
        if begin < end:
            raise CorruptCheckpointError(
                f"{source}: {where}: the entries '{printable(first)}' and "
                f"'{printable(second)}' share bytes; the file is damaged or crafted.")
    reached = 0
    for begin, _, name, info in spans:
        if begin != reached:
            raise _TwoWays(f"holds bytes {reached}-{begin} that belong to no entry (before "
                           f"'{_named(name)}')")
        reached = _local_entry_end(file, start, directory, info, name)
    if reached != directory:
        raise _TwoWays(f"holds bytes {reached}-{directory} that belong to no entry (before its "
                       "central directory)")


def _local_entry_end(file: IO[bytes], start: int, directory: int, info: Any, name: str) -> int:
    """Where the entry ``info`` (its local header, name, extra field, data and data
    descriptor) ends in its archive, its local header checked against ``info``."""
    at = info.header_offset
    raw = name.encode("ascii")
    if at + _LOCAL.size + len(raw) > directory:
        raise _TwoWays(f"has a local header of '{_named(name)}' that runs into its directory")
    file.seek(start + at)
    header = file.read(_LOCAL.size + len(raw))
    if len(header) != _LOCAL.size + len(raw):
        raise EOFError(f"the header of '{name}' is cut short")
    # Its CRC-32 (here or in the descriptor) is read by neither reader: a wrong one in the
    # directory is refused as a ChecksumError when the entry is read.
    (signature, _, _, flags, method, _, _, _, packed, size, name_len,
     extra_len) = _LOCAL.unpack_from(header)
    later = flags & 0x8  # sizes and CRC-32 in a data descriptor after the data
    if signature != b"PK\x03\x04" or header[_LOCAL.size:] != raw or name_len != len(raw) or \
            flags != info.flag_bits or method != info.compress_type or \
            (packed, size) not in ((info.compress_size, info.file_size),
                                   (0, 0) if later else (), (_ZIP64, _ZIP64)):
        raise _TwoWays(f"has a local header of '{_named(name)}' that disagrees with its "
                       "directory record")
    end = at + _LOCAL.size + name_len + extra_len + info.compress_size
    if not later:
        return end
    file.seek(start + end)
    tail = file.read(min(_DESCRIPTOR64.size, max(0, directory - end)))
    # The 16-byte form where the sizes fit it, the 24-byte one (zip64) where they do not:
    # both match the same bytes only for an empty entry followed by zeros, which no header
    # or directory begins with (the next check would refuse that).
    for form in (_DESCRIPTOR, _DESCRIPTOR64):
        if len(tail) >= form.size and form.unpack_from(tail)[::2] == \
                (b"PK\x07\x08", info.compress_size) and \
                form.unpack_from(tail)[3] == info.file_size:
            return end + form.size
    raise _TwoWays(f"has a data descriptor after '{_named(name)}' that disagrees with its "
                   "directory record")


def _end_records(file: IO[bytes], start: int, length: int) -> tuple[int, int, int]:
    """:func:`~fsdpckpt.dcp._plainzip.end_records` of the archive, read from its last bytes."""
    size = min(length, _TAIL)
    file.seek(start + length - size)
    tail = file.read(size)
    ends = end_records(tail, length)
    if isinstance(ends, str):
        if b"PK\x05\x06" not in tail:  # no zip at all: damage, said as zipfile says it
            raise zipfile.BadZipFile("File is not a zip file")
        raise _TwoWays(ends)
    return ends


def open_archive(file: IO[bytes], start: int, length: int, source: str,
                 max_entries: int | None = None, *, plain: bool = False) -> Any:
    """Open the ``torch.save`` archive at ``start``, checked as :func:`_check_entries` says:
    the one way every archive fsdpckpt reads is opened, whichever parser reads it, so that
    both accept and refuse the same archives, and the bytes they read are torch's.

    Args:
        file, start, length: where the archive lies: it must fill exactly these bytes.
        source: how to name the file (and tensor) in messages.
        max_entries: refuse an archive with more entries (checked from the end record
            before the central directory is parsed).
        plain: with ``max_entries``, read an archive laid out as ``torch.save`` writes it
            by :func:`~fsdpckpt.dcp._plainzip.plain_archive` (``infolist``, ``getinfo`` and
            ``read`` only), a ``zipfile.ZipFile`` any other.

    Raises:
        CorruptCheckpointError: naming ``source`` and the byte range, for any bytes that
            are not such an archive, or that can be read two ways.
    """
    def where() -> str:  # made only for a message
        return f"the archive at offset {start} (length {length})"

    def with_zipfile() -> zipfile.ZipFile:
        return zipfile.ZipFile(SliceFile(file, start, length))

    if not (start >= 0 and length >= 0):
        raise CorruptCheckpointError(f"{source}: {where()} is not a byte range of a file; the "
                                     "metadata is damaged.")
    try:
        with zip_errors(source, where):
            if max_entries is not None:
                declared = _declared_entries(file, start, length)
                if declared is not None and declared > max_entries:
                    raise _too_many(source, where(), declared, max_entries)
            # A plain archive's reader took its end records through the same rule.
            archive: Any = plain_archive(file, start, length, max_entries, with_zipfile) \
                if plain and max_entries is not None else None
            if archive is not None:
                ends = archive.ends
            else:
                ends = _end_records(file, start, length)
                if max_entries is not None and ends[0] > max_entries:
                    raise _too_many(source, where(), ends[0], max_entries)
                archive = with_zipfile()
        try:
            with zip_errors(source, where):
                _check_entries(archive, file, start, length, ends, source, where())
        except BaseException:
            archive.close()
            raise
    except _TwoWays as exc:
        raise _two_ways(source, where(), str(exc)) from None
    return archive


def _too_many(source: str, where: str, declared: int, most: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: {where} declares {declared} entries where torch.save writes a handful (at "
        f"most {most} accepted); the file is damaged or crafted.")


def entry_info(archive: Any, suffix: str, source: str,
               max_bytes: int | None = None) -> zipfile.ZipInfo:
    """The archive's entry ``suffix`` (``"/data.pkl"``) in the folder of its first entry,
    where torch's reader looks it up; no larger than ``max_bytes`` if given."""
    names = archive.namelist()
    name = names[0].split("/", 1)[0] + suffix if names else suffix
    if name in names:
        info = archive.getinfo(name)
        if max_bytes is not None and info.file_size > max_bytes:
            raise CorruptCheckpointError(
                f"{source}: the archive's '{_named(info.filename)}' has {info.file_size} "
                "bytes "
                f"where torch.save writes a few hundred (at most {max_bytes} accepted); "
                "the file is damaged or crafted.")
        return info
    raise CorruptCheckpointError(f"{source}: the archive has no '*{suffix}' entry.")


def read_entry(archive: zipfile.ZipFile, info: zipfile.ZipInfo, *, source: str,
               start: int) -> bytes:
    """The bytes of one (stored, bounded) entry of the archive at ``start``, CRC checked.

    Raises:
        CorruptCheckpointError: naming the entry and its byte range, when its local header
            disagrees with the directory, its bytes are cut short, or its CRC-32 fails.
    """
    def where() -> str:
        begin = start + info.header_offset
        return (f"its entry '{_named(info.filename)}' (bytes {begin}-"
                f"{begin + 30 + len(info.filename) + info.file_size})")

    with zip_errors(source, where):
        return archive.read(info)
