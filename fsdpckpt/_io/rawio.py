"""Reads and writes that finish: every call here loops until its whole range is done.

A single ``read``/``write`` system call may move fewer bytes than asked, and on
Linux one call never moves more than 2,147,479,552 bytes (``0x7ffff000``)
whatever the size asked for. Code that ignores the count returned writes zeros,
or stale bytes, silently past that point. Every byte fsdpckpt reads or writes by
offset goes through these functions, which keep calling until the range is
done, and fail loudly when the file ends or the system writes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from fsdpckpt.errors import CorruptCheckpointError

__all__ = ["ReadAt", "ReadAtFile", "SizedReader", "pread_into", "pread_scattered", "read_exact",
           "pwrite_all", "pwrite_gathered", "iov_max", "copy_range", "scratch", "reusing_scratch",
           "keep_scratch", "release_scratch"]

_BLOCK = 16 * 2**20
#: The most bytes one ``pwrite`` is given. Measured, not explained: 1.6 GB of column-major
#: chunks written in 2 MiB calls took 2.77 s, the same bands in 256 KiB calls 1.69 s
#: (alternated runs, the transpose thread busy beside; the plain merge writes 256 KiB
#: blocks). Alone, ``benchmarks/floor.py`` writes a new file as fast either way; the likely
#: cause is the kernel's page-cache allocation for large writes on fragmented memory.
_WRITE_MAX = 256 * 2**10
# copy_file_range is refused for these reasons (another file system, an old kernel,
# a special file); the block copy then does the job instead.
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF,
                       errno.EPERM}
_copy_file_range_works = hasattr(os, "copy_file_range")
#: Scratch buffers of this size or more ask for 2 MiB pages (transparent huge pages, where
#: the system grants them to memory that asks: "madvise" mode, the usual default). A
#: transpose jumps between columns a few KiB apart at every element, and with 4 KiB pages
#: nearly each jump missed the CPU's first-level TLB: a 2048 x 1024 float32 block read from
#: the page cache and transposed ran at 3.0 GB/s, 4.1 GB/s with 2 MiB pages; a merge of a
#: 2.4 GB column-major tensor took 2.38 s, 2.32 s with them (alternated runs, medians of 5).
_LARGE_PAGES = 2 * 2**20


_pool = threading.local()


def scratch(size: int, slot: str | None = None) -> memoryview:
    """A writable buffer of ``size`` bytes that goes back to the system when dropped.

    Large buffers come from their own anonymous mapping, not the heap: after glibc
    frees one large block it raises its mmap threshold and serves the next ones
    from the heap, which then fragments and grows (a 16 MiB tile loop peaked 70 MB
    higher that way); private, in 2 MiB pages where the system grants them
    (:data:`_LARGE_PAGES`). Inside :func:`reusing_scratch`, a named ``slot`` hands out the
    same buffer again (grown if needed): a fresh mapping costs a page fault per 4 KiB
    on first touch, which for a merge's hundreds of blocks was a third of its time.
    Contents are not cleared between uses.
    """
    buffers = getattr(_pool, "buffers", None)
    if slot is not None and buffers is not None:
        held = buffers.get(slot)
        if held is None or len(held) < size:
            held = buffers[slot] = scratch(size)
        return held[:size]
    if size < 2**20:
        return memoryview(bytearray(size))
    # Private: mmap.mmap(-1, n) alone maps shared memory (shmem), which the system backs
    # with large pages only where its shmem setting says so.
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= _LARGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a system without them: 4 KiB pages, as before
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(buffer)


@contextlib.contextmanager
def reusing_scratch() -> Iterator[None]:
    """Within this block, :func:`scratch` slots are reused; they are all freed at its end."""
    outer = getattr(_pool, "buffers", None)
    if outer is None:
        _pool.buffers = {}
    try:
        yield
    finally:
        if outer is None:
            _pool.buffers = None


def _truncated(source: str, end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: the file ends before byte {end}: it is truncated")


class ReadAt(Protocol):
    """A file read by offset that is not a local descriptor (a remote object, a decoder)."""

    def read_at(self, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` from ``offset``, or raise CorruptCheckpointError."""


@runtime_checkable
class ReadAtFile(Protocol):
    """A file object that also reads by offset (a remote file's stream): what reads a range
    of it needs no descriptor."""

    def read_at(self, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` from ``offset``, or raise CorruptCheckpointError."""


class SizedReader(io.RawIOBase):
    """A read-only, seekable raw file of known size: the position bookkeeping its three
    kinds share (a window of a file, a decoded zstd entry, a remote object's stream).
    A subclass gives :meth:`_extent` and ``readinto``; ``self._pos`` is where it reads."""

    _pos = 0

    def _extent(self) -> int:
        """The size ``SEEK_END`` counts from."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"invalid whence {whence}")
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._extent()}[whence]
        self._pos = max(0, base + pos)
        return self._pos


def release_scratch() -> None:
    """Give the buffers this thread's :func:`scratch` slots keep back to the system (the next
    call for a slot takes a new one): before a large import (torch: about 220 MB), so that
    the process does not hold both."""
    buffers = getattr(_pool, "buffers", None)
    if buffers:
        buffers.clear()


def keep_scratch() -> None:
    """Reuse :func:`scratch` slots on this thread for as long as it lives: a background
    thread's small work buffers (a cast's, at most a few hundred KiB), which would otherwise
    be mapped and faulted in again for every block it works on."""
    if getattr(_pool, "buffers", None) is None:
        _pool.buffers = {}


def pread_into(fd: int | ReadAt, view: memoryview, offset: int, *, source: str) -> None:
    """Fill all of ``view`` with the bytes of ``fd`` from ``offset``.

    ``fd`` is a local descriptor, or anything with ``read_at`` (a remote file).

    Raises:
        CorruptCheckpointError: the file ends first (naming ``source``).
    """
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if not isinstance(fd, int):
        fd.read_at(view, offset)
        return
    done, count = 0, len(view)
    while done < count:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise _truncated(source, offset + count)
        done += got


def pread_scattered(fd: int, views: list[memoryview], offset: int, *, source: str) -> None:
    """Fill ``views``, in order, with the consecutive bytes of the local descriptor ``fd`` from
    ``offset``: one ``preadv`` per ``IOV_MAX`` views (a column-major tile's whole stored
    columns, each put at its own place in the tile's buffer, in a few calls, not one each).

    Raises:
        CorruptCheckpointError: the file ends first (naming ``source``).
    """
    most = iov_max()
    views = [v for v in views if len(v)]
    first = 0  # the first view not yet filled
    while first < len(views):
        got = os.preadv(fd, views[first:first + most], offset)
        if got <= 0:
            raise _truncated(source, offset + sum(map(len, views[first:])))
        offset += got
        while got and got >= len(views[first]):  # whole views filled; a part view goes again
            got -= len(views[first])
            first += 1
        if got:
            views[first] = views[first][got:]


def iov_max() -> int:
    """The most buffers one ``preadv``/``pwritev`` takes (Linux: 1024)."""
    return getattr(os, "IOV_MAX", 1024)


def read_exact(fd: int | ReadAt, count: int, offset: int, *, source: str) -> bytearray:
    """``count`` bytes at ``offset`` of ``fd``, or a CorruptCheckpointError naming ``source``."""
    data = bytearray(count)
    pread_into(fd, memoryview(data), offset, source=source)
    return data


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``, however many calls it takes.

    Raises:
        OSError: the system refuses the write (full disk...) or writes nothing.
    """
    view = memoryview(data).cast("B")
    done, count = 0, len(view)
    while done < count:
        wrote = os.pwrite(fd, view[done:done + _WRITE_MAX], offset + done)
        if wrote <= 0:  # never returned for a real write; looping on it would never end
            raise OSError(errno.EIO, f"a write at byte {offset + done} wrote nothing")
        done += wrote


def pwrite_gathered(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Write ``views``, in order, as the consecutive bytes of ``fd`` from ``offset``: one
    ``pwritev`` per :func:`iov_max` views (a band of output rows whose pieces lie in several
    chunks' buffers, in a few calls, not one per piece), however many calls it takes.

    Raises:
        OSError: the system refuses the write (full disk...) or writes nothing.
    """
    most, first = iov_max(), 0  # views[first] is the first not yet written whole
    head: memoryview | None = None  # what is left of it, when a write ended inside it
    while first < len(views):
        batch = list(views[first:first + most])
        if head is not None:
            batch[0] = head
        count = sum(map(len, batch))
        wrote = os.pwritev(fd, batch, offset) if count else 0
        if wrote <= 0 < count:  # never returned for a real write; looping would never end
            raise OSError(errno.EIO, f"a write at byte {offset} wrote nothing")
        offset += wrote
        if wrote == count:  # the usual case: all of them
            first, head = first + len(batch), None
            continue
        for view in batch:  # a short write: the whole views, then what is left of one
            if wrote < len(view):
                head = view[wrote:]
                break
            wrote -= len(view)
            first += 1
            head = None


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, count: int, *,
               source: str, progress: Callable[[int], None] | None = None) -> None:
    """Copy ``count`` bytes between files: in the kernel where it can, else in 16 MiB blocks.

    Raises:
        CorruptCheckpointError: ``src`` ends before the range does.
    """
    global _copy_file_range_works
    end = src_offset + count
    while count > 0 and _copy_file_range_works:
        try:
            done = os.copy_file_range(src, dst, min(count, 2**30), src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in _NO_COPY_FILE_RANGE:
                raise
            _copy_file_range_works = False
            break
        if done <= 0:
            raise _truncated(source, end)
        src_offset, dst_offset, count = src_offset + done, dst_offset + done, count - done
        if progress:
            progress(done)
    if count <= 0:
        return
    buffer = scratch(min(count, _BLOCK), "copy")
    while count > 0:
        block = buffer[:min(count, len(buffer))]
        pread_into(src, block, src_offset, source=source)
        pwrite_all(dst, block, dst_offset)
        src_offset, dst_offset, count = (src_offset + len(block), dst_offset + len(block),
                                         count - len(block))
        if progress:
            progress(len(block))
