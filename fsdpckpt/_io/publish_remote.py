"""The publish of :mod:`fsdpckpt._io.publish` on object storage: built locally, uploaded,
the commit file(s) last, what was uploaded deleted on failure.

Object stores have no rename, so the local publish (stage, then rename into place) cannot
be done there. What they do give: an object becomes visible only once its upload is
complete (a multipart upload is invisible until its last part is in). So an output is
built in a local temporary folder (``$TMPDIR``: it needs room for the output), then
uploaded file by file, the file a reader opens first last (a shard index, a DCP folder's
``.metadata``, an export's ``config.json``): it appears only once everything it names is
there. An earlier output in the folder is uncommitted first (its commit file of the same
name deleted), so that its other files, replaced one by one, are never named by a commit
file beside files of the new one. A failure (or Ctrl-C, SIGTERM) during the upload deletes
the objects this publish already uploaded, so nothing of it is left; an earlier output the
upload did not replace a file of is left as it was.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from fsdpckpt._io.remote import RemotePath
from fsdpckpt._io.storage import refresh
from fsdpckpt.errors import (
    FsdpCkptError,
    OutputExistsError,
    OutputNotWritableError,
    RemoteStorageError,
)

_T = TypeVar("_T")

__all__ = ["check_remote_output", "refuse_held", "local_stage", "upload", "delete",
           "uncommit_replaced", "Uploads", "publish_folder"]


def check_remote_output(out: RemotePath) -> None:
    """Refuse an output that is an existing file (not a folder)."""
    if out.is_file():
        raise OutputNotWritableError(
            20, f"{out}: is a file, not a folder; pass a folder URL (e.g. {out}-merged/)")


def refuse_held(out: RemotePath) -> None:
    """Refuse an output folder that already holds files (``overwrite`` not given)."""
    if held := out.fs.find(out.path):
        raise OutputExistsError(f"{out}: already holds files ({held[0].rsplit('/', 1)[-1]}...); "
                                "pass overwrite=True to replace them, or choose "
                                "another folder")


@contextlib.contextmanager
def local_stage(out: RemotePath) -> Iterator[Path]:
    """A local temporary folder to build in before the upload (not yet made: a publish
    makes it); removed, with all it holds, at the end."""
    with tempfile.TemporaryDirectory(prefix="fsdpckpt-upload-") as tmp:
        yield Path(tmp) / out.name


def upload(local: Path, out: RemotePath, uploaded: list[RemotePath], *,
           name: str | None = None) -> RemotePath:
    """Upload ``local`` into ``out`` (as ``name``, by default its own name) and add it to
    ``uploaded`` (what a failure must delete).

    Raises:
        OutputNotWritableError: the upload failed; the message says what to check.
    """
    target = out / (name or local.name)
    try:
        _put(local, target)
    except RemoteStorageError:
        raise  # a fault of the store: its own line, naming the object and the fix
    except OSError as exc:
        raise OutputNotWritableError(
            5, f"{target}: upload failed ({exc}); check the URL, the credentials and that "
            "the bucket exists; nothing of this merge is left there") from None
    uploaded.append(target)
    return target


def _put(local: Path, target: RemotePath) -> None:
    """Upload one file; fsspec's backends upload large files in parts (multipart on S3),
    and the object appears only when the last part is in."""
    target.fs.put_file(str(local), target.path)


def uncommit_replaced(out: RemotePath, files: Sequence[str], commits: Sequence[str]) -> None:
    """Before ``files`` are uploaded into ``out`` (relative names), then ``commits`` (the
    files a reader opens first: an index, ``.metadata``, ``config.json``): where one of
    ``files`` replaces an object there by name, the earlier ``commits`` of the same names
    are deleted first. From then on the earlier output is not one, so a crash while its
    files are replaced one by one leaves no commit file naming old and new files mixed.
    Where no name is shared, the earlier output stays whole until the new commit file
    replaces its own (one PUT).

    Raises:
        RemoteStorageError: an earlier commit file could not be deleted (nothing uploaded).
    """
    if not files or not commits:
        return
    refresh(out)  # what another process wrote there since, too
    prefix = out.path + "/"
    held = {p[len(prefix):] for p in out.fs.find(out.path)}  # none there: an empty list
    doomed = [out / n for n in commits if n in held] if held & set(files) else []
    if doomed and (left := delete(doomed)):
        raise RemoteStorageError(f"{left[0]}: the earlier output's commit file could not be "
                                 "deleted before its files are replaced; nothing was "
                                 "uploaded; check the store and run again")


def delete(paths: list[RemotePath]) -> list[RemotePath]:
    """Delete these objects, in this order, ignoring any already gone; return those left.

    A fault of the store (it is down, or stalls) stops the deletion: each further request
    would cost its full timeout and fail the same way.
    """
    for done, path in enumerate(paths):
        try:
            path.fs.rm_file(path.path)
        except RemoteStorageError:
            return paths[done:]
        except (FileNotFoundError, OSError, FsdpCkptError):
            pass
    return []


def undo(uploaded: list[RemotePath], exc: BaseException, commit: str) -> None:
    """Delete what a failed upload put there, the last uploaded first; when the store is
    unreachable, say what is left (never ``commit``, the file uploaded last, so nothing
    reads it as an output).

    Raises:
        RemoteStorageError: ``exc`` was a fault of the store and objects are left.
    """
    left = delete(list(reversed(uploaded)))
    if left and isinstance(exc, RemoteStorageError):
        raise RemoteStorageError(
            f"{exc}. Left behind, as the store stopped answering: {len(left)} object(s) "
            f"uploaded before ({left[-1]}...), never {commit}, so nothing reads them as an "
            "output; delete them or run again with overwrite=True") from exc


class Uploads:
    """Files published into the folder ``out`` on object storage, one upload each: what
    :meth:`publish` uploaded is deleted again if the block it is used in fails."""

    def __init__(self, out: RemotePath, commit: str) -> None:
        self.out, self.commit = out, commit
        self.uploaded: list[RemotePath] = []

    def publish(self, files: Iterable[Path], names: Sequence[str] | None = None
                ) -> list[RemotePath]:
        """Upload ``files`` in this order (as ``names``, by default their own names)."""
        files = list(files)
        shown = list(names) if names else [p.name for p in files]
        uncommit_replaced(self.out, shown[:-1], shown[-1:])
        return [upload(path, self.out, self.uploaded, name=shown[i])
                for i, path in enumerate(files)]

    def drop(self, stale: Iterable[RemotePath]) -> None:
        """Delete the earlier outputs the new ones replace (those not just uploaded): an
        index first, never seen without its shards."""
        new = {str(p) for p in self.uploaded}
        delete(sorted((p for p in stale if str(p) not in new),
                      key=lambda p: not p.name.endswith(".index.json")))

    def failed(self, exc: BaseException) -> None:
        """Undo the uploads (:func:`undo`); the caller raises ``exc`` after."""
        uploaded, self.uploaded = self.uploaded, []
        undo(uploaded, exc, self.commit)

    def done(self) -> None:
        """Committed: nothing of this publish is removed any more."""
        self.uploaded = []
        self.out.forget_listings()


def publish_folder(out: RemotePath, build: Callable[[Path], _T], *, overwrite: bool,
                   last: Sequence[str] = ()) -> tuple[_T, Path]:
    """Build an output folder locally with ``build(folder)``, then upload every file in it
    into ``out`` (same relative names), the names in ``last`` at the end, in that order.

    Returns:
        ``(what build returned, the local folder it built)``; the caller names the uploaded
        objects as ``out / path.relative_to(folder)``. The local folder is gone on return.

    Raises:
        OutputExistsError: ``out`` already holds files and ``overwrite`` is False (checked
            before ``build`` runs). With ``overwrite``, files of the same names are replaced
            and no other file is touched.
        OutputNotWritableError: ``out`` is a file, or an upload failed; what this call
            uploaded is deleted.
    """
    check_remote_output(out)
    if not overwrite:
        refuse_held(out)
    with local_stage(out) as local:
        result = build(local)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        order = [p for p in files if p.relative_to(local).as_posix() not in last] + \
            [local / name for name in last if (local / name).is_file()]
        uploads = Uploads(out, " and ".join(last) or "the last file")
        try:
            uploads.publish(order, [p.relative_to(local).as_posix() for p in order])
        except BaseException as exc:
            uploads.failed(exc)
            raise
        uploads.done()
        return result, local
