"""What ``progress`` means across the API: a factory of byte-count callbacks.

A long operation (``merge``, ``verify_checkpoint``) first works out how much it will read
or write, then calls ``progress(total_bytes, files)`` once, before the first byte, and
gives the callback that returns the byte counts as they are done. A total known up front
is what lets a bar show a percentage and an ETA; the CLI's ``_progress`` makes tqdm bars
this way.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ProgressCallback", "ProgressFactory", "start_progress"]

#: Given the bytes done since its last call.
ProgressCallback = Callable[[int], None]

#: Called once with ``(total_bytes, files)``; returns the callback for that run.
ProgressFactory = Callable[[int, int], ProgressCallback]


def start_progress(progress: ProgressFactory | None, total_bytes: int,
                   files: int) -> ProgressCallback | None:
    """The callback for one run: ``progress(total_bytes, files)``, or None without a factory."""
    return progress(total_bytes, files) if progress is not None else None
