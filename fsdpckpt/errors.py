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
    "RankLocalStateError",
    "UnfinishedSaveError",
    "UnsafePickleError",
    "CorruptCheckpointError",
    "DiskFullError",
    "ChecksumError",
    "RemoteStorageError",
    "RemoteTimeoutError",
    "OptionError",
    "MergePlanError",
    "OutputExistsError",
    "OutputNotWritableError",
    "ExportMismatchError",
    "DiffOptionError",
    "StateMismatchError",
    "TorchTooOldError",
    "ResumeWarning",
    "Terminated",
]


class FsdpCkptError(Exception):
    """Base class of every error fsdpckpt raises on purpose."""


class CheckpointNotFoundError(FsdpCkptError, FileNotFoundError):
    """A path that should hold a checkpoint (or part of one) does not exist."""


class NotACheckpointError(FsdpCkptError, ValueError):
    """A path exists but is not a checkpoint fsdpckpt can read.

    Attributes:
        checkpoints: for a folder that holds several checkpoints (``checkpoint-500/``,
            ``checkpoint-1000/``...), their names, oldest first, as the message lists them;
            empty otherwise. Every verb refuses such a folder with the same message.
    """

    checkpoints: tuple[str, ...] = ()


class RankLocalStateError(NotACheckpointError):
    """Every rank stores a tensor whole, each with its own bytes (FSDP1's per-rank optimizer
    state of flat parameters, as VeRL saves it): a valid save for the ranks that wrote it,
    which nothing can merge into one tensor. ``merge --optimizer`` refuses it by name;
    ``inspect`` and ``verify`` show such a part as rank-local instead of failing."""


class UnfinishedSaveError(NotACheckpointError):
    """A folder a save began and never finished: data files and no ``.metadata``, a save's
    intent marker and no manifest, or only a save's staging folders. Not a checkpoint; use
    an earlier one."""


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


class OptionError(FsdpCkptError, ValueError):
    """An argument that cannot be used: a value out of range, a name fsdpckpt does not
    know, options that contradict each other. The message names the parameter
    (``keep_last``, ``digest=``) and says what it accepts."""


class MergePlanError(FsdpCkptError, ValueError):
    """The merge as asked cannot be done; the message lists every reason."""


class OutputExistsError(FsdpCkptError, FileExistsError):
    """An output file is already there and ``overwrite`` was not given."""


class OutputNotWritableError(FsdpCkptError, _MessageOnly):
    """The output folder cannot be created or written (read-only, no permission, a file
    in the way); ``errno`` says why."""


class ExportMismatchError(FsdpCkptError, ValueError):
    """The checkpoint's tensors do not match what the config's model class expects."""


class DiffOptionError(OptionError):
    """A :func:`~fsdpckpt.diff` option that cannot be used: a tolerance that is negative or
    not a number."""


class StateMismatchError(FsdpCkptError, KeyError):
    """A model does not match the checkpoint (missing, unexpected or differently shaped keys)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class TorchTooOldError(FsdpCkptError, RuntimeError):
    """What was asked needs something the installed torch lacks (a dtype, a DCP feature);
    the message names the torch release that has it and what works without it."""


class ResumeWarning(UserWarning):
    """Something a resume did that the caller should know, e.g. the RNG policy applied
    because the world size changed. :meth:`CheckpointManager.restore` warns with it; the
    same messages are in :attr:`LoadResult.warnings`."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during a merge. A :class:`KeyboardInterrupt`, so it unwinds (and
    cleans up) exactly as Ctrl-C does, and ``except Exception`` cannot swallow it."""

    def __str__(self) -> str:
        return "interrupted by SIGTERM"


def interruption(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM) that ``exc`` stands for: ``exc`` itself, or one Python
    wrapped in another exception. Python 3.11 turns an exception raised in a class's
    ``__set_name__`` into a ``RuntimeError`` caused by it, so a Ctrl-C that lands while an
    import builds a class (``platform.uname_result``'s ``cached_property``) arrives as a
    RuntimeError. The chain is followed a few links only: an interruption is near the top.
    """
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


#: Set on an error that a lower rank of the same process group also raised, with the same
#: message: the command line prints each error once, by the lowest rank that has it.
REPORTED_BY_RANK = "fsdpckpt_reported_by_rank"
