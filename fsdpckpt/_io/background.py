"""Named background threads that work beside the main one: the CRC-32 of what was just read
(:mod:`fsdpckpt.dcp._checked`), the transposes of a column-major chunk
(:mod:`fsdpckpt.merging._transpose`), the start of the kernel's writeback of what was
written (:class:`fsdpckpt._io.durable.Writeback`).

Each name is one thread, so what is submitted under a name runs in order. The work handed to
them releases the GIL for most of its time (``zlib.crc32``, numpy's copies), so on two cores
it runs while the main thread reads or writes. Two names, not one shared thread: a pass that
checks a 2.4 GB entry must not hold up the transposes queued behind it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from fsdpckpt._io.rawio import keep_scratch

__all__ = ["alternate", "drain", "submit"]

T = TypeVar("T")

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def _forget_pools() -> None:
    # A forked child has the parent's pool objects but not their threads: work submitted to
    # them would wait forever. The child makes its own on first use.
    global _LOCK
    _POOLS.clear()
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def submit(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Run ``fn(*args, **kwargs)`` on the thread called ``name`` (made on first use), after
    what was submitted to it before; here and now where thread pools take no more work
    (atexit handlers run after the interpreter shut them down: a merge run from one).

    Returns:
        The future of its result; its exception is raised by ``result()``.
    """
    with _LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(1, thread_name_prefix=f"fsdpckpt-{name}",
                                                     initializer=keep_scratch)
    try:
        return pool.submit(fn, *args, **kwargs)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - handed to result(), as a pool does
            done.set_exception(error)
        return done


def drain(name: str) -> None:
    """Wait until everything submitted to the thread ``name`` so far has run: a job whose
    future was never kept (Ctrl-C between ``submit`` returning and its result being stored)
    included, since the thread runs its jobs in order."""
    wait([submit(name, _nothing)])


def _nothing() -> None:
    return None


def alternate(turns: int, read: Callable[[int], None], work: Callable[[int], None],
              write: Callable[[int], None], *, name: str) -> None:
    """Run ``turns`` turns of read, work, write: each turn read here, worked on the thread
    ``name``, then written here while the next turn is read and worked on. Two sets of
    buffers take turns (``turn % 2``): a turn's read waits for nothing, since the work of
    the turn two before was done before that turn was written.

    The work of one turn (a cast, 0.5-1.2 s of one core for 1.6 GB) then runs on the other
    core while this one reads and writes, not between them.

    Args:
        turns: how many.
        read, work, write: called with the turn's number.
        name: the thread :func:`submit` runs ``work`` on.

    Raises:
        Whatever a call raises; no work is left running into a buffer after this returns
        or raises.
    """
    running: Future[None] | None = None
    try:
        for turn in range(turns):
            read(turn)
            before, running = running, submit(name, work, turn)
            if before is not None:
                before.result()
                write(turn - 1)
        if running is not None:
            running.result()
            write(turns - 1)
    finally:
        if running is not None:
            drain(name)
