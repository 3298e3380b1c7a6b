"""Many reads or writes at scattered offsets of one local file, in a few system calls.

A column-major chunk too large to hold is merged in square tiles, and each tile is a stored
column piece per output column read and an output row piece per row written: for a 2.4 GB
tensor in 16 MiB tiles, 300,000 ``pread`` and as many ``pwrite`` calls of 8 KiB. Each call
from Python takes the GIL back on return, so one thread cannot read while another writes
without waiting on it at every call (reads moved to the transpose thread that way measured
slower, not faster).

Linux's native AIO takes a batch of such calls in one ``io_submit``: up to 1,024 reads or
writes, each with its own buffer and file offset, with the GIL released for the whole
batch (ctypes releases it around every foreign call). On a page-cached file the kernel does
them then and there (buffered AIO is not asynchronous), so the batch is a way to make many
calls at once, not to leave them running: every event is reaped before a function here
returns or raises. Where AIO is missing (another system or CPU, numpy not installed, the
system's ``aio-max-nr`` spent, a sandbox that refuses the calls) the same functions loop
over :func:`~fsdpckpt._io.rawio.pread_into` and :func:`~fsdpckpt._io.rawio.pwrite_all`.

Either way a read or write that moves fewer bytes than asked is finished by those loops, so
every piece is whole or the call raises (the rule of :mod:`fsdpckpt._io.rawio`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
from typing import Any

from fsdpckpt._io.rawio import _WRITE_MAX, pread_into, pwrite_all

__all__ = ["available", "read_pieces", "write_pieces"]

#: The system call numbers of io_setup, io_destroy, io_submit, io_getevents, by CPU.
_CALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}
_READ, _WRITE = 0, 1  # IOCB_CMD_PREAD, IOCB_CMD_PWRITE
#: Events one context holds, and so the most calls one io_submit is given.
_DEPTH = 1024

_free: list[_Context] = []  # contexts not in use by a thread now
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "libc", "np", "calls", "iocb", "event"; "off" once refused


def _forget() -> None:
    # A forked child has no share of its parent's AIO contexts: it makes its own (and a lock
    # another thread of the parent held at the fork would never be let go).
    global _lock
    _free.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def available() -> bool:
    """Whether :func:`read_pieces` and :func:`write_pieces` batch their calls here (else they
    loop, one call a piece)."""
    if "off" in _state:
        return False
    if "np" in _state:
        return True
    calls = _CALLS.get(platform.machine())
    if calls is None or sys.byteorder != "little" or ctypes.sizeof(ctypes.c_long) != 8:
        return _off()
    try:
        import numpy as np

        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return _off()
    libc.syscall.restype = ctypes.c_long
    _state.update(libc=libc, calls=calls, iocb=np.dtype([
        ("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"),
        ("reqprio", "<i2"), ("fd", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"),
        ("offset", "<i8"), ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")]),
        event=np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")]))
    _state["np"] = np
    context = _context()
    if context is None:
        return False
    _release(context)
    return True


def _off() -> bool:
    _state["off"] = True
    return False


class _Context:
    """One AIO context with its control blocks and events, used by one thread at a time."""

    def __init__(self, handle: ctypes.c_ulong) -> None:
        np = _state["np"]
        self.handle = handle
        self.blocks = np.zeros(_DEPTH, _state["iocb"])
        self.events = np.zeros(_DEPTH, _state["event"])
        self.pointers = self.blocks.ctypes.data + 64 * np.arange(_DEPTH, dtype=np.uint64)


def _context() -> _Context | None:
    with _lock:
        if _free:
            return _free.pop()
    handle = ctypes.c_ulong(0)
    setup = _state["calls"][0]
    if _state["libc"].syscall(setup, _DEPTH, ctypes.byref(handle)) != 0:
        if ctypes.get_errno() not in (errno.EAGAIN, errno.ENOMEM):
            _off()  # ENOSYS, EPERM (a sandbox): for good; a shortage only for this call
        return None
    return _Context(handle)


def _release(context: _Context) -> None:
    with _lock:
        _free.append(context)


def _destroy(context: _Context) -> None:
    # io_destroy waits for whatever the context still has in flight: after it no call can
    # still touch a buffer its caller is about to free or reuse.
    _state["libc"].syscall(_state["calls"][1], context.handle)


def read_pieces(fd: int, buffer: memoryview, starts: Any, lengths: Any, offsets: Any, *,
                source: str) -> None:
    """Fill ``buffer[starts[i]:starts[i] + lengths[i]]`` with the bytes of the local
    descriptor ``fd`` at ``offsets[i]``, for every ``i``.

    Args:
        fd: an open local file.
        buffer: a writable buffer holding every piece.
        starts, lengths, offsets: equal-length sequences of ints (numpy arrays are fastest).
        source: how to name the file in errors.

    Raises:
        CorruptCheckpointError: the file ends before a piece does (naming ``source``).
        OSError: the system refuses a read.
    """
    _run(_READ, fd, buffer, starts, lengths, offsets, source)


def write_pieces(fd: int, buffer: memoryview, starts: Any, lengths: Any, offsets: Any) -> None:
    """Write ``buffer[starts[i]:starts[i] + lengths[i]]`` at ``offsets[i]`` of ``fd``, for
    every ``i`` (pieces that overlap in the file are written in no set order).

    Raises:
        OSError: the system refuses a write (a full disk...) or writes nothing.
    """
    _run(_WRITE, fd, buffer, starts, lengths, offsets, None)


def _finish(op: int, fd: int, view: memoryview, start: int, length: int, offset: int,
            source: str | None) -> None:
    piece = view[start:start + length]
    if op == _READ:
        pread_into(fd, piece, offset, source=source or "")
    else:
        pwrite_all(fd, piece, offset)


def _run(op: int, fd: int, buffer: memoryview, starts: Any, lengths: Any, offsets: Any,
         source: str | None) -> None:
    view = memoryview(buffer).cast("B")
    count = len(starts)
    if not (count == len(lengths) == len(offsets)):
        raise ValueError("starts, lengths and offsets differ in length")
    if op == _READ and view.readonly:  # the kernel would write into immutable bytes
        raise ValueError("read_pieces needs a writable buffer")
    if not count:
        return
    np: Any = _state.get("np") if available() else None
    if np is not None:
        starts, lengths, offsets = (np.asarray(starts, dtype=np.int64),
                                    np.asarray(lengths, dtype=np.int64),
                                    np.asarray(offsets, dtype=np.int64))
        low = min(int(starts.min()), int(lengths.min()), int(offsets.min()))
        ends = int((starts + lengths).max())
    else:
        low = min(min(starts), min(lengths), min(offsets))
        ends = max(int(a) + int(n) for a, n in zip(starts, lengths))
    # The kernel writes wherever it is told: every piece must lie inside the buffer.
    if low < 0 or ends > len(view):
        raise ValueError("a piece lies outside its buffer or before the file's start")
    if np is not None and op == _WRITE:
        # A piece larger than rawio's write cap goes out in capped calls, as pwrite_all
        # writes everything else (large writes measured slower: rawio._WRITE_MAX).
        large = lengths > _WRITE_MAX
        if large.any():
            for index in np.flatnonzero(large).tolist():
                _finish(op, fd, view, int(starts[index]), int(lengths[index]),
                        int(offsets[index]), source)
            starts, lengths, offsets = starts[~large], lengths[~large], offsets[~large]
            count = len(starts)
    # Taken only now, and given back or destroyed whatever happens from here: a context lost
    # to an error would hold its share of the system-wide aio-max-nr until the process ends.
    context = _context() if np is not None and count > 1 else None
    if context is None:
        for start, length, offset in zip(starts, lengths, offsets):
            _finish(op, fd, view, int(start), int(length), int(offset), source)
        return
    try:
        base = np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
        for first in range(0, count, _DEPTH):
            last = min(count, first + _DEPTH)
            _batch(context, op, fd, view, base, starts[first:last], lengths[first:last],
                   offsets[first:last], source)
    except BaseException:
        _destroy(context)  # Ctrl-C between a submit and its events: nothing left in flight
        raise
    _release(context)


def _batch(context: _Context, op: int, fd: int, view: memoryview, base: int, begins: Any,
           sizes: Any, places: Any, source: str | None) -> None:
    np, libc = _state["np"], _state["libc"]
    submit, getevents = _state["calls"][2:]
    count = len(begins)
    blocks = context.blocks[:count]
    blocks["data"] = np.arange(count, dtype=np.uint64)
    blocks["opcode"], blocks["fd"] = op, fd
    blocks["buf"] = base + begins
    blocks["nbytes"], blocks["offset"] = sizes, places
    results = np.full(count, -1, dtype=np.int64)
    sent = 0
    while sent < count:  # a refusal (EINVAL for this kind of file, EAGAIN...): the rest by hand
        took = libc.syscall(submit, context.handle, count - sent,
                            ctypes.c_void_p(context.pointers.ctypes.data + 8 * sent))
        if took <= 0:
            break
        sent += took
    _reap(context, results, sent, getevents)
    # Pieces never sent, refused, or short: finished one call at a time (EOF, ENOSPC... raise
    # there as they would without AIO).
    for index in np.nonzero(results != sizes)[0].tolist():
        done = max(0, int(results[index]))
        _finish(op, fd, view, int(begins[index]) + done, int(sizes[index]) - done,
                int(places[index]) + done, source)


def _reap(context: _Context, results: Any, count: int, getevents: int) -> None:
    libc, events = _state["libc"], context.events
    got = 0
    while got < count:
        found = libc.syscall(getevents, context.handle, count - got, count - got,
                             ctypes.c_void_p(events.ctypes.data + events.itemsize * got), None)
        if found < 0:
            if ctypes.get_errno() == errno.EINTR:
                continue
            raise OSError(ctypes.get_errno(), "io_getevents failed")
        got += found
    done = events[:count]
    results[done["data"].astype(_state["np"].intp)] = done["res"]
