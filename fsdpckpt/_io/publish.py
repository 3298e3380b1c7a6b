"""One atomic publish: an output is built out of sight and appears whole, or not at all.

Every writer of fsdpckpt (a merge, ``convert``, an export, the LoRA writers, the training
:class:`~fsdpckpt.CheckpointManager`) publishes through here, for both kinds of place:

- local: the output is built in a hidden stage on the same file system (a folder made with
  SIGINT/SIGTERM held, :mod:`fsdpckpt._io.staging`, or files staged beside their targets),
  then renamed into place and the parent folder fsynced. On any error, Ctrl-C or SIGTERM
  the stage is removed and the place is left as it was. A stage that survived anyway
  (SIGKILL, a power cut) names its host and process, and the next publish into that
  folder removes it once that process is gone (:func:`clear_stale_stages`);
- on object storage (:mod:`fsdpckpt._io.publish_remote`): built locally, then uploaded, the
  commit file(s) last; what was uploaded is deleted on failure.

:func:`folder` (a whole folder, replaced) and :func:`files_into` (files into a folder,
other files kept) take either kind and decide rename or upload themselves; the callers
say what to build and what to check, never how it is published.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from fsdpckpt._io.durable import fsync_dir
from fsdpckpt._io.staging import make_stage, output_mode, signals_deferred
from fsdpckpt._io.storage import Place, is_remote
from fsdpckpt.errors import DiskFullError, OutputNotWritableError

__all__ = ["STAGING_PREFIX", "host", "clear_stale_stages", "stage_in", "rename_into", "beside",
           "new_folder", "folder", "files_into", "FilesTarget", "discard", "exchange", "swap_in",
           "remove_durably",
           "signals_deferred", "make_stage", "output_mode"]

log = logging.getLogger("fsdpckpt")

_T = TypeVar("_T")

#: Stages inside an output folder are ``{STAGING_PREFIX}{host}-{pid}-{random}``.
STAGING_PREFIX = ".fsdpckpt-tmp-"


def host() -> str:
    """This host's name as a stage name carries it ('-' separates the name's fields)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


_STAGE_NAME = re.compile(re.escape(STAGING_PREFIX)
                         + r"(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-[^-]*$")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, it is someone else's
        return True
    return True


def clear_stale_stages(output_dir: Path) -> list[Path]:
    """Remove the stages in ``output_dir`` that a merge on this host left behind when it
    died; return them.

    A folder is removed only when its name carries this host and a process id that no
    longer exists. A running merge's folder (its process is alive), another host's
    (shared file systems), and any folder named otherwise are kept.
    """
    removed: list[Path] = []
    here = host()
    try:
        candidates = [e for e in os.scandir(output_dir)
                      if e.name.startswith(STAGING_PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for entry in candidates:
        match = _STAGE_NAME.match(entry.name)
        if not match or match["host"] != here:
            continue
        pid = int(match["pid"])
        if pid <= 0 or pid == os.getpid() or _process_alive(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        log.warning("fsdpckpt: removed %s, left by an interrupted merge (process %d, no longer "
                    "running)", entry.path, pid)
        removed.append(Path(entry.path))
    return removed


def _not_writable(output_dir: Path, exc: OSError) -> OutputNotWritableError:
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in [output_dir, *output_dir.parents] if p.exists()
                        and not p.is_dir()), output_dir)
        why = f"{blocker} is a file, not a folder; choose another output folder"
    elif exc.errno == errno.EROFS:
        why = "the file system is read-only; choose an output folder on a writable one"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why = ("not allowed to write there; choose a folder you can write to, or change its "
               "permissions")
    else:
        why = f"{exc.strerror or exc}; choose another output folder"
    return OutputNotWritableError(exc.errno, f"{output_dir}: cannot write the output there: "
                                  f"{why}")


def _staging_error(output_dir: Path, created: Path | None, exc: OSError) -> OSError:
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    if exc.errno == errno.ENOSPC:
        return DiskFullError(errno.ENOSPC, f"{output_dir}: no space left on the device; "
                             "free some space or choose another output folder")
    return _not_writable(output_dir, exc)


@contextlib.contextmanager
def stage_in(output_dir: Path) -> Iterator[Path]:
    """A hidden stage inside ``output_dir`` (files in it are published by
    :func:`rename_into`), removed on exit whatever happens.

    ``output_dir`` (and missing parents) is created if needed, and removed again on
    failure if it was. Stale stages of dead processes are cleared first. That
    ``output_dir`` is not a file is the caller's check.

    Raises:
        OutputNotWritableError: ``output_dir`` cannot be created or written (a file is in
            the way); the message names ``output_dir`` (never the hidden folder) and says
            what to do.
        DiskFullError: no space even for the stage.
    """
    top = output_dir  # the outermost folder made here, removed on failure
    while not top.parent.exists():
        top = top.parent
    created = None if top.exists() else top
    stage: Path | None = None
    ok = False
    try:
        # Signals held while the folders are made and their names recorded: a Ctrl-C
        # cannot land between mkdtemp and `stage` being set, where nothing would remove it.
        with signals_deferred():
            try:
                output_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _staging_error(output_dir, created, exc) from None
        clear_stale_stages(output_dir)
        with signals_deferred():
            try:
                stage = make_stage(output_dir, f"{STAGING_PREFIX}{host()}-{os.getpid()}-")
            except OSError as exc:
                raise _staging_error(output_dir, created, exc) from None
        yield stage
        ok = True
    finally:
        with signals_deferred():  # a second Ctrl-C does not cut the cleanup short
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
            if created is not None and not ok:
                shutil.rmtree(created, ignore_errors=True)


def rename_into(staged: Iterable[Path], output_dir: Path) -> list[Path]:
    """Publish staged files: renamed into ``output_dir`` in this order (the commit file
    last), then the renames made durable; their final paths.

    Files over an earlier output: its commit file (a shard index) is removed, durably,
    before the first new file lands, so no crash leaves the old index naming new shards: the
    folder holds the old output whole, then none, then the new one whole."""
    staged = list(staged)
    if len(staged) > 1:
        remove_durably([output_dir / staged[-1].name])
    final = []
    for path in staged:
        target = output_dir / path.name
        os.replace(path, target)
        final.append(target)
    fsync_dir(output_dir)
    return final


def remove_durably(paths: Iterable[Path]) -> None:
    """Remove files (those missing are nothing to do), the removals made durable.

    Two moments of a publish use it: an earlier output's commit files (an index, a
    ``config.json``) before the first file of the new output lands, so no crash leaves an
    old commit file naming new files (the folder holds the old output whole, then none,
    then the new one); and the files the new output replaced, once it is committed."""
    folders = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        folders.append(path.parent)
    for folder in dict.fromkeys(folders):
        fsync_dir(folder)


def swap_in(new: Path, final: Path, prefix: str) -> None:
    """The folder ``new`` takes the name ``final``, the rename made durable. An existing
    ``final`` is swapped out in one step where the system can (:func:`exchange`): a crash
    leaves the old folder or the new one, never none and never a half-deleted one; elsewhere
    it is first taken out of sight (:func:`discard`, under ``prefix``). The old one is then
    removed."""
    if final.exists() and exchange(new, final):
        fsync_dir(final.parent)
        shutil.rmtree(new, ignore_errors=True)  # now the old folder
        return
    replaced = discard(final, prefix) if final.exists() else None
    os.rename(new, final)
    fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


@contextlib.contextmanager
def beside(targets: Sequence[Path]) -> Iterator[list[Path]]:
    """Each of ``targets`` staged beside it, as ``.{name}.tmp`` (the caller writes them in
    the block); on a clean exit each is renamed over its target, in order, and the folder
    fsynced. Whatever happens, no staged file is left, and on an error no target is touched.
    """
    staged = [path.with_name(f".{path.name}.tmp") for path in targets]
    try:
        yield staged
        for tmp, path in zip(staged, targets, strict=True):
            os.replace(tmp, path)
        for parent in dict.fromkeys(path.parent for path in targets):
            fsync_dir(parent)
    finally:
        with signals_deferred():
            for tmp in staged:
                tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """A hidden stage beside ``out`` (``.{name}.fsdpckpt-tmp-*``, the umask's mode: the folder
    itself is published) to build ``out`` in; on a clean exit it replaces ``out`` (an
    existing ``out`` is removed first) and the parent is fsynced. On any error, Ctrl-C or
    SIGTERM the stage is removed and ``out`` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage: Path | None = None
    try:
        with signals_deferred():  # no Ctrl-C between mkdtemp and `stage` being set
            stage = make_stage(out.parent, f".{out.name}.fsdpckpt-tmp-",
                               published_as_folder=True)
        yield stage
        swap_in(stage, out, f".{out.name}.fsdpckpt-tmp-")
        stage = None
    finally:
        if stage is not None:
            with signals_deferred():  # a second Ctrl-C does not cut the cleanup short
                shutil.rmtree(stage, ignore_errors=True)


def folder(out: Place, fill: Callable[[Path], _T], *, overwrite: bool,
           last: Sequence[str] = (), prepare: Callable[[Path], Any] | None = None) -> _T:
    """Publish the folder ``out`` as a whole: ``fill(stage)`` builds it, then it replaces
    ``out``; what ``fill`` returns.

    Local: ``prepare(out)`` first (the caller's checks: what it may replace), then
    :func:`new_folder`. On object storage: ``out`` must not be a file nor, without
    ``overwrite``, hold files; the folder is built locally as above and uploaded, the
    names in ``last`` at the end (:func:`~fsdpckpt._io.publish_remote.publish_folder`);
    files of ``out`` the build did not write are kept.
    """
    def local(target: Path) -> _T:
        if prepare is not None:
            prepare(target)
        with new_folder(target) as stage:
            return fill(stage)

    if is_remote(out):
        from fsdpckpt._io.publish_remote import publish_folder

        return publish_folder(cast(Any, out), local, overwrite=overwrite, last=last)[0]
    return local(cast(Path, out))


class FilesTarget(Protocol):
    """Where :func:`files_into` publishes: files built in ``workdir`` (a local folder,
    published there by :func:`rename_into`) appear in ``out``."""

    out: Place
    workdir: Path

    def publish(self, files: Sequence[Path]) -> list[Place]:
        """``files`` (in ``workdir``, already renamed into place there) as they are in
        ``out``: locally the same files; on object storage, uploaded in this order."""

    def drop(self, stale: Iterable[Any]) -> None:
        """Remove the earlier outputs in ``out`` that the published files replace."""


class _Local:
    def __init__(self, out: Path) -> None:
        self.out: Place = out
        self.workdir = out

    def publish(self, files: Sequence[Path]) -> list[Place]:
        return list(files)

    def drop(self, stale: Iterable[Any]) -> None:
        remove_durably(cast("Iterable[Path]", stale))


@contextlib.contextmanager
def files_into(out: Place, *, commit: str) -> Iterator[FilesTarget]:
    """Files published into the folder ``out``, other files there kept.

    Local: ``workdir`` is ``out`` itself; the caller stages there (:func:`stage_in`) and
    renames into place (:func:`rename_into`). On object storage: ``out`` must not be a
    file; ``workdir`` is a local temporary folder, removed at the end, and
    :meth:`FilesTarget.publish` uploads; if the block fails, what it uploaded is deleted
    (``commit`` names the file uploaded last, for the message when some cannot be).
    """
    if not is_remote(out):
        yield _Local(cast(Path, out))
        return
    from fsdpckpt._io.publish_remote import Uploads, check_remote_output, local_stage

    remote = cast(Any, out)
    check_remote_output(remote)
    with local_stage(remote) as local:
        uploads = Uploads(remote, commit)
        target = _Uploading(remote, local, uploads)
        try:
            yield target
        except BaseException as exc:
            uploads.failed(exc)
            raise
        uploads.done()


class _Uploading:
    def __init__(self, out: Any, workdir: Path, uploads: Any) -> None:
        self.out: Place = out
        self.workdir = workdir
        self._uploads = uploads

    def publish(self, files: Sequence[Path]) -> list[Place]:
        return list(self._uploads.publish(files))

    def drop(self, stale: Iterable[Any]) -> None:
        self._uploads.drop(stale)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` (two folders, or two files) in one atomic step: Linux's
    ``renameat2(RENAME_EXCHANGE)``, so a crash leaves one or the other under each name, never
    neither. False, with nothing changed, where the kernel, C library or file system has no
    such rename (the caller then replaces in two steps); the caller fsyncs the folder."""
    import ctypes
    import ctypes.util
    import errno

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not Linux, or a C library older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # no exchange here
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def discard(path: Path, prefix: str) -> Path:
    """Take the published folder ``path`` out of sight atomically: renamed into a new hidden
    folder ``{prefix}...`` beside it, the rename made durable; that folder, for the caller
    to remove (a crash before then leaves a hidden leftover, never a half-deleted output)."""
    with signals_deferred():
        doomed = make_stage(path.parent, prefix)
    os.rename(path, doomed / path.name)
    fsync_dir(path.parent)
    return doomed
