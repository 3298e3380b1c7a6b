"""The errors fsdpckpt raises.

Every error is an :class:`FsdpCkptError` and also the builtin it most resembles,
so ``except FileNotFoundError`` keeps working for callers who never heard of
fsdpckpt. Messages name the path and say what to do about it.
"""

from __future__ import annotations

import pickle

__all__ = [
    "FsdpCkptError",
    "CheckpointNotFoundError",
    "NotACheckpointError",
    "UnsafePickleError",
    "CorruptCheckpointError",
    "DiskFullError",
    "ChecksumError",
    "RemoteStorageError",
    "RemoteTimeoutError",
]


class FsdpCkptError(Exception):
    """Base class of every error fsdpckpt raises on purpose."""


class CheckpointNotFoundError(FsdpCkptError, FileNotFoundError):
    """A path that should hold a checkpoint (or part of one) does not exist."""


class NotACheckpointError(FsdpCkptError, ValueError):
    """A path exists but is not a checkpoint fsdpckpt can read."""


class UnsafePickleError(FsdpCkptError, pickle.UnpicklingError):
    """A pickle asked for a global outside the allowlist; nothing was executed."""


class CorruptCheckpointError(FsdpCkptError, ValueError):
    """A checkpoint's files disagree with its metadata (truncated, missing, garbled)."""


class ChecksumError(CorruptCheckpointError):
    """Bytes read from a checkpoint do not match the checksum their writer recorded (a
    flipped bit, a bad disk, a faulty transfer); raised before any output is committed."""


class _MessageOnly(OSError):
    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]"
        return str(self.strerror)


class DiskFullError(FsdpCkptError, _MessageOnly):
    """The file system being written has not enough free space (``errno`` is ``ENOSPC``):
    a merge's output, or a ``save_state`` that ran out of space (the message names the
    path; nothing of that save is left that could pass for a checkpoint)."""


class RemoteStorageError(FsdpCkptError, OSError):
    """The object store failed a request (a connection closed or refused, a 5xx answer, a
    garbled reply) after the bounded retries; the message names the URL."""


class RemoteTimeoutError(RemoteStorageError, TimeoutError):
    """The object store did not answer within the connect or read timeout, after the
    bounded retries; the message names the URL and how to raise the timeouts."""


#: Set on an error that a lower rank of the same process group also raised, with the same
#: message: the command line prints each error once, by the lowest rank that has it.
REPORTED_BY_RANK = "fsdpckpt_reported_by_rank"
