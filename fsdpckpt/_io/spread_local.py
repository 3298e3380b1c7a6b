"""The spread-file protocol of :mod:`fsdpckpt._io.spread` on a file system every rank sees.

Rank 0 makes one hidden stage inside the output folder (:func:`~fsdpckpt._io.publish.
stage_in`: stale stages of dead processes cleared, the folder it had to create removed again
on failure) and tells the other ranks its name; every rank opens the same staged files,
sized up front, and ``pwrite``\\ s its own byte ranges straight into them (no byte goes
through another rank); each rank fsyncs what it wrote before the ranks agree. When every
rank finished, rank 0 renames the files into the output folder, the commit file last, and
fsyncs it; otherwise it removes the stage, and every rank raises.

The ranks talk only at fixed points (:class:`Exchange`): the stage's name, the end of each
file and the end of the block. A rank that fails skips to the end of the block and reports
there; the others learn it at their next point, whichever it is, and stop talking from then
on, so every rank makes the same number of exchanges whatever failed where. Only error
messages, a folder name and byte counts travel, never file data.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from fsdpckpt._io.durable import fsync_dir, write_bytes
from fsdpckpt._io.publish import STAGING_PREFIX, stage_in
from fsdpckpt._io.rawio import pwrite_all
from fsdpckpt._io.spread_rounds import same_error
from fsdpckpt._io.staging import output_mode
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import (
    REPORTED_BY_RANK,
    DiskFullError,
    FsdpCkptError,
    OutputExistsError,
    OutputNotWritableError,
)

__all__ = ["Exchange", "local_spread_folder"]

_T = TypeVar("_T")


class Exchange:
    """The ranks of ``group`` (or a single process) at the fixed points where they agree.

    :meth:`agree` runs a step on every rank and returns every rank's small result, or
    raises on every rank the error a rank met (the failing rank its own, the others
    :func:`~fsdpckpt._io.spread_rounds.same_error`'s copy). Once a failure was exchanged
    (:attr:`failed`), no rank exchanges again: every rank knows.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.group = group
        self.rank = self.dist.get_rank(group) if self.dist else 0
        self.world = self.dist.get_world_size(group) if self.dist else 1
        self.failed = False

    def agree(self, fn: Callable[[], _T]) -> list[_T]:
        """``fn()`` here; every rank's result (picklable, small), or the error on every rank."""
        try:
            result = fn()
        except BaseException as exc:
            self.report(exc)
            raise
        reports = self._gather(None, result)
        failed = [(rank, error) for rank, (error, _) in enumerate(reports) if error]
        if failed:
            rank, (kind, message, code) = failed[0]
            raise self.fail(same_error(kind, message, rank, code or 0), rank)
        return [value for _, value in reports]

    def fail(self, error: BaseException, rank: int | None = None) -> BaseException:
        """``error``, known to every rank already (no further exchange); ``rank``: the
        rank whose error it repeats."""
        self.failed = True
        if rank is not None and rank < self.rank:  # printed once, by the lowest rank
            setattr(error, REPORTED_BY_RANK, rank)
        return error

    def report(self, exc: BaseException) -> None:
        """This rank failed with ``exc``: tell the others at this point, unless every rank
        knows already."""
        if self.failed:
            return
        self.failed = True
        code = getattr(exc, "errno", None)
        self._gather((type(exc).__name__, str(exc) or type(exc).__name__,
                      code if isinstance(code, int) else None), None)

    def _gather(self, error: tuple[str, str, int | None] | None, result: Any) -> list[Any]:
        if self.dist is None:
            return [(error, result)]
        reports: list[Any] = [None] * self.world
        self.dist.all_gather_object(reports, (error, result), group=self.group)
        return reports


def _holds_files(out: Path) -> str | None:
    # An entry of the output folder other than a stage (ours, or one left by a dead rank).
    if not out.is_dir():
        return None
    return next((e.name for e in os.scandir(out) if not e.name.startswith(STAGING_PREFIX)), None)


class _File:
    """One staged file, open on this rank for its own byte ranges."""

    def __init__(self, exchange: Exchange, path: Path, size: int) -> None:
        self._exchange, self.path, self.size = exchange, path, size
        self.written = 0
        fd = os.open(path, os.O_RDWR | os.O_CREAT, output_mode("file"))
        try:
            # Sized on every rank (an extension never drops another rank's bytes); space
            # reserved first, so a full disk fails here rather than mid-write.
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise DiskFullError(errno.ENOSPC, f"{path.parent.parent}: no space left "
                                        f"for {path.name} ({size} bytes); free some space or "
                                        "choose another output folder") from None
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def write(self, offset: int, data: Any) -> None:
        view = memoryview(data.numpy() if hasattr(data, "numpy") else data).cast("B")
        if offset < 0 or offset + len(view) > self.size:
            raise FsdpCkptError(f"{self.path.name}: bytes {offset}..{offset + len(view)} "
                                f"lie outside the file's {self.size}; the plan is wrong")
        if self._fd is None:
            raise FsdpCkptError(f"{self.path.name}: written after finish()")
        pwrite_all(self._fd, view, offset)
        self.written += len(view)

    def step(self) -> None:
        """Nothing to move on a shared file system: every rank wrote its bytes in place."""

    def finish(self) -> None:
        def done() -> int:
            fd, self._fd = self._fd, None
            if fd is not None:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return self.written

        total = sum(self._exchange.agree(done))
        if total != self.size:  # the same numbers on every rank: each raises this
            raise self._exchange.fail(FsdpCkptError(
                f"{self.path.name}: the ranks wrote {total} bytes of its {self.size}; the "
                "ranks' shards do not cover it"))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Target:
    def __init__(self, exchange: Exchange, stage: Path) -> None:
        self._exchange, self.stage = exchange, stage
        self.names: list[str] = []  # every file, in the order made: rank 0 publishes them
        self.opened: list[_File] = []

    def _path(self, name: str) -> Path:
        path = self.stage / name
        path.parent.mkdir(parents=True, exist_ok=True)  # additional_chat_templates/...
        return path

    def open(self, name: str, size: int) -> _File:
        if name in self.names:
            raise FsdpCkptError(f"{name}: opened twice in one output")
        self.names.append(name)
        file = _File(self._exchange, self._path(name), size)
        self.opened.append(file)
        return file

    def put(self, name: str, data: bytes) -> None:
        if self._exchange.rank != 0:
            raise FsdpCkptError(f"{name}: put on rank {self._exchange.rank}; only rank 0 "
                                "writes the small files")
        if name in self.names:
            raise FsdpCkptError(f"{name}: written twice in one output")
        self.names.append(name)
        write_bytes(self._path(name), data)

    def close(self) -> None:
        for file in self.opened:
            file.close()


def _publish(stage: Path, out: Path, names: list[str], commit: str) -> None:
    # Rank 0: every staged file renamed into ``out`` (folders made as needed), the commit
    # file last, each folder fsynced once its names are in.
    order = [n for n in names if n != commit] + [n for n in names if n == commit]
    folders: dict[Path, None] = {}
    for name in order:
        target = out / name
        if target.parent != out:
            target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage / name, target)
        folders[target.parent] = None
    for folder in reversed(folders):
        fsync_dir(folder)
    fsync_dir(out)


@contextlib.contextmanager
def local_spread_folder(out: Place, *, overwrite: bool, commit: str,
                        group: Any = None) -> Iterator[_Target]:
    """:func:`fsdpckpt._io.spread.spread_folder` on a file system every rank shares.

    Raises:
        OutputExistsError: ``out`` holds files and ``overwrite`` is False (on every rank,
            before anything is written).
        OutputNotWritableError: ``out`` is a file or cannot be written; rank 0's stage is
            not seen by another rank (the folder is not on a shared file system).
        DiskFullError: no room for a file.
        FsdpCkptError: another rank failed (its error, where it is fsdpckpt's own).
    """
    out = cast(Path, out)  # spread_folder sends only local folders here
    exchange = Exchange(group)
    with contextlib.ExitStack() as stack:
        def open_stage() -> str | None:
            if exchange.rank != 0:
                return None
            if out.exists() and not out.is_dir():
                raise OutputNotWritableError(errno.ENOTDIR, f"{out}: is a file, not a folder; "
                                             "choose an output folder")
            held = None if overwrite else _holds_files(out)
            if held is not None:
                raise OutputExistsError(f"{out}: already holds files ({held}...); pass "
                                        "overwrite=True to replace them, or choose another "
                                        "folder")
            # Absolute: the other ranks may run in another working folder.
            return str(stack.enter_context(stage_in(out)).absolute())

        stage = Path(str(exchange.agree(open_stage)[0]))

        def seen() -> None:
            if not stage.is_dir():
                raise OutputNotWritableError(
                    errno.ENOENT, f"{out}: rank 0's stage {stage} is not there on rank "
                    f"{exchange.rank}; the output folder must be on a file system every "
                    "rank shares")

        exchange.agree(seen)
        target = _Target(exchange, stage)
        try:
            yield target
            target.close()
            exchange.agree(lambda: None)  # every rank finished its block
            exchange.agree(lambda: _publish(stage, out, target.names, commit)
                           if exchange.rank == 0 else None)
        except BaseException as exc:
            target.close()
            exchange.report(exc)
            raise
