"""Hidden staging folders that a signal cannot orphan, with the mode an output should have.

Every output fsdpckpt publishes is built in a hidden folder and renamed into place
(:mod:`fsdpckpt._io.publish`, the one publish helper, builds on what is here). A
Ctrl-C or SIGTERM that lands after the folder exists but before the code that removes it
on failure has its name would leave it behind (``OUT/.fsdpckpt-tmp-*``, mode 0700, and the
``OUT/`` a merge created). :func:`signals_deferred` closes that window: the signals are
held while the folder is made and its name recorded, and raised again right after, where
the cleanup is already armed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["signals_deferred", "make_stage", "output_mode"]

_HELD: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends; they are raised again (and act as
    usual: KeyboardInterrupt, or the handler in force) right after it.

    Python-level handlers are swapped, not the thread's signal mask: in a process with other
    threads (torch's, a progress bar's), the kernel may deliver the signal to any of them,
    and Python still raises it in the main thread. Only the main thread can set handlers,
    so elsewhere this does nothing; neither does it touch a handler set outside Python.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, _frame: Any) -> None:
        caught.append(signum)

    previous: dict[int, Any] = {}
    for signum in _HELD:
        handler = signal.getsignal(signum)
        if handler is not None:
            previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def output_mode(kind: str = "dir") -> int:
    """The mode a new folder (``"dir"``) or file (``"file"``) gets from the umask, as
    ``mkdir`` and ``open`` give it; a staged output is given it before it is published."""
    umask = _current_umask()
    return (0o777 if kind == "dir" else 0o666) & ~umask


def _current_umask() -> int:
    # /proc says it without changing it; os.umask() must set it to read it (racy).
    with contextlib.suppress(OSError, ValueError), \
            open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def make_stage(parent: Path, prefix: str, *, published_as_folder: bool = False) -> Path:
    """A new hidden folder in ``parent`` named ``prefix...``.

    Call it inside :func:`signals_deferred` and record the result for cleanup before the
    block ends. ``published_as_folder``: the folder itself becomes the output (renamed to
    its final name), so it gets the umask's mode instead of ``mkdtemp``'s 0700.
    """
    stage = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    if published_as_folder:
        os.chmod(stage, output_mode("dir") | stat.S_IRWXU)
    return stage
