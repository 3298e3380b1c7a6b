"""The one checked read path: tensor bytes are checked against the CRC-32 their writer
recorded before anything made from them is committed.

Every chunk DCP writes is a complete ``torch.save`` zip archive, and so is a ``.bin`` or
``.pt`` file: the zip's central directory records the CRC-32 of each entry. Every reader
of tensor bytes in fsdpckpt (the merge and everything built on it, ``load_full_state_dict``,
``export-hf``, ``diff``, ``convert``'s ``.bin`` input, ``load_state``) reads through here:

- :class:`CheckedRead` wraps the source of one storage entry (a local descriptor, a remote
  file, the decoder of a compressed entry) and computes the CRC-32 incrementally over the
  bytes as the reader takes them, in order; :meth:`CheckedRead.finish` reads whatever the
  reader skipped or took out of order, and compares. A merge reads each chunk once, so the
  check costs a CRC over bytes already in memory, not a second read.
- :func:`verify_entry_once` checks a whole entry at once, once per entry for all the boxes
  read from it, for readers that take boxes of a tensor (the tied-weight check, ``diff``);
  :func:`verify_entry_beside` does it on the other core while the reader takes the boxes.
- :func:`check_archive` reads every entry of a whole archive against its CRC, for readers
  that hand the bytes to ``torch.load`` (which does not check them).

Formats that record no checksum (safetensors, torch's Hugging Face storage) cannot be
checked here; ``verify`` says so, and checks them against fsdpckpt's manifest when there is
one. :data:`ENABLED` switches the check off for measuring its cost (``benchmarks/checked.py``);
nothing else sets it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import IO, Any

from fsdpckpt._io import background
from fsdpckpt._io.checksums import crc32, crc32_range
from fsdpckpt._io.rawio import ReadAt, pread_into, pread_scattered, scratch
from fsdpckpt._printable import printable
from fsdpckpt.errors import ChecksumError

__all__ = [
    "ENABLED",
    "CheckedRead",
    "check_archive",
    "check_saved_file",
    "checksum_error",
    "read_checked",
    "verify_entry_beside",
    "verify_entry_once",
]

#: Whether tensor bytes are checked as they are read. On unless a benchmark measures the
#: cost of the check (switching it off gives up the guarantee).
ENABLED = True

_BLOCK = 16 * 2**20
_BESIDE_BLOCK = 256 * 2**10


def checksum_error(source: str, entry: str | None, expected: int, actual: int) -> ChecksumError:
    """The error for bytes that do not match their recorded CRC-32, naming what and the fix."""
    what = f"the entry '{printable(entry)}'" if entry else "its data"
    return ChecksumError(
        f"{source}: {what} does not match the CRC-32 its writer recorded (recorded "
        f"{expected:08x}, read {actual:08x}): the file changed after it was written (a "
        "flipped bit, a bad disk or a faulty transfer); restore the file from a good copy "
        "(`fsdpckpt verify` of the checkpoint lists every damaged chunk)."
    )


def verify_entry_once(
    done: set[Any],
    key: Any,
    src: int | ReadAt,
    start: int,
    nbytes: int,
    expected: int | None,
    *,
    source: str,
    entry: str | None = None,
) -> None:
    """Check the whole entry at once (a :class:`CheckedRead` finished before anything is
    read through it), unless ``key`` is already in ``done`` (the entries checked by one
    reader, kept with its open files); nothing when no CRC is recorded or checking is off.

    Raises:
        ChecksumError: naming ``source`` and ``entry``, when the CRC-32 differs.
    """
    if expected is None or not ENABLED or key in done:
        return
    CheckedRead(src, start, nbytes, expected, source=source, entry=entry).finish()
    done.add(key)


@contextlib.contextmanager
def verify_entry_beside(
    done: set[Any],
    key: Any,
    src: int,
    start: int,
    nbytes: int,
    expected: int | None,
    *,
    source: str,
    entry: str | None = None,
) -> Iterator[None]:
    """:func:`verify_entry_once` on the CRC thread while the block runs, for a reader that
    takes the entry out of storage order from a local descriptor (a column-major chunk's
    tiles): the whole-entry pass then costs the other core, not this one (issue 21). The
    check ends when the block does, and the caller commits nothing made from the bytes before
    that: they are checked before anything is published, not before they are read.

    Raises:
        ChecksumError: naming ``source`` and ``entry``, when the CRC-32 differs (at the end
            of the block, after what it raises itself).
    """
    if expected is None or not ENABLED or key in done:
        yield
        return
    # In blocks small enough to be checked while still in the cache, and taken from the heap:
    # a fresh 16 MiB mapping per entry cost its page faults again for every chunk.
    stopped = threading.Event()

    def stop_when_told(_: int) -> None:
        # After each block: a reader that failed (Ctrl-C, a full disk) waits for one block
        # of the pass, not for the rest of the whole storage's read.
        if stopped.is_set():
            raise _Stopped

    pending = _submit(crc32_range, src, start, nbytes, stop_when_told, block=_BESIDE_BLOCK,
                      source=source)
    try:
        yield
    except BaseException:
        stopped.set()
        wait([pending])  # the reader's own error wins; the descriptor outlives the pass
        raise
    crc = pending.result()
    if crc != expected:
        raise checksum_error(source, entry, expected, crc)
    done.add(key)


class _Stopped(Exception):
    """The whole-entry pass beside a reader that failed, stopped (never seen outside)."""


#: The last block of an entry is summed on the reader's thread up to this size.
_HERE = 256 * 2**10


class CheckedRead:
    """The source of one storage entry, read by offset, its CRC-32 computed as it is read.

    A read that continues where the checked bytes end extends the CRC with the bytes just
    read; :meth:`finish` reads the rest of the entry (all of it, if the reader began
    elsewhere) and compares with what the archive records.
    """

    def __init__(
        self,
        src: int | ReadAt,
        start: int,
        nbytes: int,
        expected: int,
        *,
        source: str,
        entry: str | None = None,
    ) -> None:
        self._src, self._end, self._expected = src, start + nbytes, expected
        self._start, self._at, self._crc = start, start, 0
        self._source, self._entry = source, entry
        self._pending: Future[int] | None = None

    @property
    def local(self) -> bool:
        """Whether the bytes come from a local file's descriptor."""
        return isinstance(self._src, int)

    @property
    def src(self) -> int | ReadAt:
        """What the bytes are read from (a descriptor, a remote file, a decoder)."""
        return self._src

    def read_at(self, view: memoryview, offset: int, *, later: bool = False) -> None:
        """Fill ``view`` with the bytes from ``offset``, extending the CRC where they continue
        the checked bytes.

        With ``later``, the CRC of these bytes is computed on the other core while the caller
        writes them out (the CRC releases the GIL), and the caller must leave ``view``
        as it is until its next call here (or :meth:`settle`, :meth:`finish`) returns: the
        reader reads the next block into another buffer, then this waits for the previous
        block's CRC. On two cores the check then costs about nothing beside the copy (issue 21).
        """
        pread_into(self._src, view, offset, source=self._source)
        self.settle()
        if offset <= self._at < offset + len(view) and self._at < self._end:
            take = view.cast("B")[self._at - offset : min(len(view), self._end - offset)]
            # The last block of a small entry is summed here: handing it to the CRC thread
            # costs about what it saves (the caller waits for it at finish, one write later),
            # and a tensor in thousands of small chunks paid that on every chunk.
            if later and not (self._at + len(take) == self._end and len(take) <= _HERE):
                self._pending = _submit(crc32, take, self._crc)
            else:
                self._crc = crc32(take, self._crc)
            self._at += len(take)

    def read_scattered(self, views: list[memoryview], offset: int, *,
                       later: bool = False) -> None:
        """Fill ``views``, in order, with the consecutive bytes from ``offset`` (a column-major
        chunk's stored columns, each put at its own place in a buffer), extending the CRC
        over them as :meth:`read_at` does, ``later`` included; from a local descriptor in one
        ``preadv`` per ``IOV_MAX`` views, from anything else one view at a time.
        """
        if not isinstance(self._src, int):
            for view in views:
                self.read_at(view, offset, later=later)
                offset += len(view)
            return
        pread_scattered(self._src, views, offset, source=self._source)
        self.settle()
        total = sum(map(len, views))
        if offset == self._at and self._at + total <= self._end:  # else finish() reads them
            if later:
                self._pending = _submit(_crc32_of, views, self._crc)
            else:
                self._crc = _crc32_of(views, self._crc)
            self._at += total

    def settle(self) -> None:
        """Wait for the CRC of the block last read with ``later``: its buffer is free after."""
        # Computed in the background, chained in order.
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._crc = pending.result()

    def finish(self) -> None:
        """Check the whole entry: the rest is read now if the reader did not take it in order.
        Once finished, it stays finished: reading on through it, or finishing again (several
        tensors a diff reads from one stored entry), checks nothing again.

        Raises:
            ChecksumError: naming the file and the entry, when the CRC-32 differs.
        """
        self.settle()
        crc = crc32_range(
            self._src, self._at, self._end - self._at, source=self._source, crc=self._crc
        )
        self._at, self._crc = self._end, crc
        if crc != self._expected:
            raise checksum_error(self._source, self._entry, self._expected, crc)


def read_checked(src: int | ReadAt, view: memoryview, offset: int, *, source: str) -> None:
    """Fill ``view`` with the bytes of ``src`` from ``offset``: through a
    :class:`CheckedRead`, its CRC-32 computed on the CRC thread while the caller goes on
    (``read_at(later=True)``: leave ``view`` as it is until the next read returns); from
    anything else (a source checked whole already), a plain read."""
    if isinstance(src, CheckedRead):
        src.read_at(view, offset, later=True)
    else:
        pread_into(src, view, offset, source=source)


def _crc32_of(views: list[memoryview], crc: int) -> int:
    for view in views:
        crc = crc32(view, crc)
    return crc


def _submit(fn: Callable[..., int], *args: Any, **kwargs: Any) -> Future[int]:
    """``fn`` on the CRC thread, after the CRCs submitted before it."""
    return background.submit("crc", fn, *args, **kwargs)


def check_saved_file(file: IO[bytes], *, source: str) -> None:
    """:func:`check_archive` over the whole of the ``torch.save`` file ``file`` (open for
    reading, seekable); its position is back at 0 after."""
    size = file.seek(0, 2)
    check_archive(file, 0, size, source=source)
    file.seek(0)


def check_archive(file: IO[bytes], start: int, length: int, *, source: str) -> None:
    """Read every entry of the ``torch.save`` archive at ``start`` against its CRC-32, in
    bounded blocks, before the bytes are handed to a reader that does not check them
    (``torch.load``), and walk its pickle as fsdpckpt's own readers do
    (:func:`fsdpckpt.dcp._safe_pickle.check_pickle`): torch's weights-only unpickler hashes
    keys as unguarded as pickle's. Bytes that are not a zip archive (the legacy format)
    record no CRC-32; their pickles are walked all the same.

    Raises:
        ChecksumError: an entry's bytes do not match its recorded CRC-32.
        CorruptCheckpointError: the archive is damaged.
        NotACheckpointError: its pickle holds what no checkpoint's does.
    """
    if not ENABLED:
        return
    from fsdpckpt.dcp._archive import entry_data_start
    from fsdpckpt.dcp._safe_pickle import check_legacy_pickles, check_pickle
    from fsdpckpt.dcp._ziparchive import entry_info, open_archive, zip_errors

    file.seek(start)
    if file.read(4) != b"PK\x03\x04":
        check_legacy_pickles(file, start, length, source=source)
        return
    where = f"the archive at offset {start} (length {length})"
    with open_archive(file, start, length, source) as archive:
        pkl = entry_info(archive, "/data.pkl", source).filename
        for info in archive.infolist():
            at = entry_data_start(file, start, length, info, source=source)
            kept = bytearray() if info.filename == pkl else None
            crc, left = 0, info.file_size
            buffer = scratch(min(left, _BLOCK), "crc") if left else memoryview(b"")
            with zip_errors(source, where):
                file.seek(at)
                while left:
                    block = buffer[: min(left, len(buffer))]
                    got = file.readinto(block)  # type: ignore[attr-defined]
                    if not got:
                        raise EOFError(f"the entry '{info.filename}' is cut short")
                    crc = crc32(block[:got], crc)
                    if kept is not None:
                        kept += block[:got]
                    left -= got
            if crc != info.CRC:
                raise checksum_error(source, info.filename, info.CRC, crc)
            if kept is not None:
                check_pickle(bytes(kept), source=f"{source} ({info.filename})",
                             persistent_ids=True)
