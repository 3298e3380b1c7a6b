"""A full disk during ``save_state``: one :class:`~fsdpckpt.errors.DiskFullError` naming the
path, and nothing of the unfinished save left behind.

torch's DCP save wraps what went wrong in a ``CheckpointException`` (a ``BaseException``,
so ``except Exception`` misses it) whose text is a traceback per rank; on a full disk the
cause is an ``OSError(ENOSPC)`` or, from torch.save's C++ zip writer, a ``RuntimeError``
such as ``[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`` that
carries no errno at all. :func:`disk_full` finds either (the latter confirmed by the file
system having no space left) and names the folder or file being written.
:func:`removed_on_failure` removes the files a failed save wrote, so a full disk leaves
no folder that ``inspect``, ``verify`` or a resume could take for a checkpoint, and the
space they took is free again.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import DiskFullError
from fsdpckpt.training._layout import commits_by_marker

__all__ = ["disk_full", "raising_disk_full", "removed_on_failure"]

#: Below this much free space, a write that torch's zip writer could not finish is taken
#: for a full disk (the partial file it leaves has taken what was left).
_NEARLY_FULL = 1 << 20

#: What torch's C++ zip writer says when a write comes up short (no errno with it).
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, what it wraps (a ``CheckpointException``'s failures on every rank), and
    their causes, each once."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for failure in (getattr(current, "failures", None) or {}).values():
            cause = failure[0] if isinstance(failure, tuple) else failure  # (exc, traceback)
            if isinstance(cause, BaseException):
                stack.append(cause)
        stack += [c for c in (current.__cause__, current.__context__) if c is not None]


def _no_space_left(where: Place) -> bool:
    free = storage.free_space(where)  # None on object storage: no such limit there
    return free is not None and free < _NEARLY_FULL


def disk_full(exc: BaseException, where: Place) -> DiskFullError | None:
    """The :class:`DiskFullError` for ``exc`` raised while writing ``where``, or None when
    ``exc`` is not about a full disk."""
    for cause in _causes(exc):
        if isinstance(cause, DiskFullError):
            return cause
        full = (isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            isinstance(cause, RuntimeError)
            and any(t in str(cause) for t in _TORCH_WRITE_FAILURES)
            and _no_space_left(where)
        )
        if full:
            return DiskFullError(
                errno.ENOSPC,
                f"{where}: no space left on the device while "
                "saving; the save did not finish and the files it wrote were "
                "removed. Free space (or save elsewhere) and save again",
            )
    return None


@contextlib.contextmanager
def raising_disk_full(where: Place) -> Iterator[None]:
    """Within the block, a full disk raises :class:`DiskFullError` naming ``where``; any
    other failure passes unchanged."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = disk_full(exc, where)
        if error is None or error is exc:
            raise
        raise error from None


@contextlib.contextmanager
def removed_on_failure(root: Place, remove: Any, *, rank: int) -> Iterator[None]:
    """If the block fails (on every rank: the save's steps agree), rank 0 removes what the
    save wrote into ``root`` with ``remove(root)``, and the error goes on.

    A save that commits by a marker (object storage) is left as it is: its intent marker
    already says it is no checkpoint, and the CheckpointManager's sweep deletes it. A
    Ctrl-C is left alone too: the folder then holds no manifest, and the next save into it
    (or the CheckpointManager) clears it.
    """
    try:
        yield
    except BaseException as exc:
        if (
            rank == 0
            and not commits_by_marker(root)
            and not isinstance(exc, (KeyboardInterrupt, SystemExit))
        ):
            with contextlib.suppress(OSError):
                remove(root)
                for leftover in storage.entries(root):
                    if leftover.name.endswith(".tmp"):
                        storage.remove(leftover.path)
        raise
