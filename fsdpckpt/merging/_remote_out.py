"""Merged outputs on object storage: merged locally, then uploaded, the index last.

Object stores have no rename, so the local commit (stage, then rename into place) cannot
be done there. What they do give: an object becomes visible only once its upload is
complete (a multipart upload is invisible until its last part is in). So the commit
protocol for a remote output folder is:

1. Validate and plan as for a local merge, and check the remote folder for existing
   outputs (refused without ``overwrite``) before any byte is read or written.
2. Merge into a local temporary folder (``$TMPDIR``: it needs room for the output).
3. Upload the files one by one (each in parts), in the merge's order: shards first,
   the index last. A sharded output without its index is not a model to any loader,
   and a single-file output is whole the moment its one object appears.
4. Only then remove earlier outputs of ours that the new ones replace.

A failure (or Ctrl-C, SIGTERM) during the upload deletes the objects this merge already
uploaded, so nothing of it is left, and an earlier output is left as it was.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from fsdpckpt._io.remote import RemotePath
from fsdpckpt.errors import (
    FsdpCkptError,
    OutputExistsError,
    OutputNotWritableError,
    RemoteStorageError,
)
from fsdpckpt.merging._jobs import MergeResult

_T = TypeVar("_T")

__all__ = ["check_remote_output", "delete", "local_stage", "publish_folder", "upload",
           "upload_results"]


def check_remote_output(out: RemotePath) -> None:
    """Refuse an output that is an existing file (not a folder)."""
    if out.is_file():
        raise OutputNotWritableError(
            20, f"{out}: is a file, not a folder; pass a folder URL (e.g. {out}-merged/)")


@contextlib.contextmanager
def local_stage(out: RemotePath) -> Iterator[Path]:
    """A local temporary folder to merge into before the upload; removed at the end."""
    with tempfile.TemporaryDirectory(prefix="fsdpckpt-upload-") as tmp:
        yield Path(tmp) / out.name


def upload_results(results: list[MergeResult], out: RemotePath, stale: tuple[RemotePath, ...],
                   progress: Callable[[int], None] | None = None) -> list[MergeResult]:
    """Upload every result's files into ``out`` (the index of each last), then remove
    ``stale`` (earlier outputs the new ones replace). Returns the results, naming the
    uploaded objects.

    Raises:
        OutputNotWritableError: an upload failed; what this call uploaded is deleted.
    """
    uploaded: list[RemotePath] = []
    done = []
    try:
        for result in results:
            remote_files: list[Path | RemotePath] = []
            for local in (f for f in result.files if isinstance(f, Path)):
                remote_files.append(upload(local, out, uploaded))
                if progress:
                    progress(local.stat().st_size)
            done.append(replace(result, files=tuple(remote_files)))
    except BaseException as exc:
        # The index first: never seen without its shards.
        _undo(list(reversed(uploaded)), exc, "the index")
        raise
    new = {str(p) for p in uploaded}
    # An earlier index first, for the same reason; then the files it named.
    delete(sorted((p for p in stale if str(p) not in new),
                   key=lambda p: not p.name.endswith(".index.json")))
    out.forget_listings()
    return done


def publish_folder(out: RemotePath, build: Callable[[Path], _T], *, overwrite: bool,
                   last: Sequence[str] = ()) -> tuple[_T, Path]:
    """Build an output folder locally with ``build(folder)``, then upload every file in it
    into ``out`` (same relative names), the names in ``last`` at the end, in that order:
    the one a reader opens first (an export's ``config.json``, a DCP folder's ``.metadata``)
    appears only once everything it names is there.

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
    if not overwrite and (held := out.fs.find(out.path)):
        raise OutputExistsError(f"{out}: already holds files ({held[0].rsplit('/', 1)[-1]}...); "
                                "pass overwrite=True to replace them, or choose "
                                "another folder")
    uploaded: list[RemotePath] = []
    with local_stage(out) as local:
        result = build(local)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        order = [p for p in files if p.relative_to(local).as_posix() not in last] + \
            [local / name for name in last if (local / name).is_file()]
        try:
            for path in order:
                upload(path, out, uploaded, name=path.relative_to(local).as_posix())
        except BaseException as exc:
            _undo(list(reversed(uploaded)), exc, " and ".join(last) or "the last file")
            raise
        out.forget_listings()
        return result, local


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


def _undo(uploaded: list[RemotePath], exc: BaseException, commit: str) -> None:
    """Delete what a failed upload put there; when the store is unreachable, say what is
    left (never ``commit``, the file uploaded last, so nothing reads it as an output).

    Raises:
        RemoteStorageError: ``exc`` was a fault of the store and objects are left.
    """
    left = delete(uploaded)
    if left and isinstance(exc, RemoteStorageError):
        raise RemoteStorageError(
            f"{exc}. Left behind, as the store stopped answering: {len(left)} object(s) "
            f"uploaded before ({left[-1]}...), never {commit}, so nothing reads them as an "
            "output; delete them or run again with overwrite=True") from exc
