"""An output folder built by a writer that publishes its own files locally (an export:
staged and renamed into the folder, other files kept), published into either kind of place.

:func:`fsdpckpt._io.publish.folder` replaces a folder whole and :func:`~fsdpckpt._io.publish.
files_into` publishes flat files the caller names; an export does neither: locally it is
its own publish (into ``out`` itself), and on object storage what it built locally is
uploaded, nested files kept in their folders, the commit file last
(:func:`~fsdpckpt._io.publish_remote.publish_folder`). :func:`built_into` chooses, so the
writer never asks which kind of place it was given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from fsdpckpt._io.storage import Place, is_remote

__all__ = ["built_into"]

_T = TypeVar("_T")


def built_into(out: Place, build: Callable[[Path], _T], *, overwrite: bool,
               last: Sequence[str] = ()) -> tuple[_T, Callable[[Any], Any]]:
    """``build(folder)`` writes the output into a local folder and returns what it wrote;
    returns that, and where each local path it names is now (the folder itself is ``out``).

    Local: ``folder`` is ``out``, and the paths are where they are. On object storage:
    ``out`` must not be a file nor, without ``overwrite``, hold files (checked before
    ``build`` runs); ``folder`` is a local temporary one, uploaded file by file, the names
    in ``last`` at the end, and removed on return.

    Raises:
        OutputExistsError, OutputNotWritableError: on object storage, as
            :func:`~fsdpckpt._io.publish_remote.publish_folder` raises them.
    """
    if not is_remote(out):
        return build(cast(Path, out)), lambda path: path
    from fsdpckpt._io.publish_remote import publish_folder

    remote = cast(Any, out)
    result, local = publish_folder(remote, build, overwrite=overwrite, last=last)

    def placed(path: Any) -> Any:
        relative = Path(str(path)).relative_to(local)
        return remote if relative == Path(".") else remote / relative.as_posix()

    return result, placed
