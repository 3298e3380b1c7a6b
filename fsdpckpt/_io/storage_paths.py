"""Where a path leads, for both kinds of place: the containment rule every reader and copier
applies before it opens a file that a checkpoint (or a model folder) names.

One rule: a path is inside a folder when, its links followed (:func:`~fsdpckpt._io.storage.
resolved`), it is that folder or lies under it (:func:`within`). :func:`inside` applies it
to a name a checkpoint gives (and refuses with the caller's reason); callers that judge a
path they listed themselves (export's side files, with a hub cache's second root) call
:func:`within` on resolved paths. Object stores have no links, and their paths refuse
``..``, so there only an absolute name can lead out.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import cast

from fsdpckpt._io.storage import Place, is_remote, resolved
from fsdpckpt.errors import NotACheckpointError

__all__ = ["within", "inside"]


def within(place: Place, folder: Place) -> bool:
    """Whether ``place`` is ``folder`` or lies under it, by their names (pass them through
    :func:`~fsdpckpt._io.storage.resolved` first to judge where links lead)."""
    if is_remote(place) or is_remote(folder):
        inner, outer = str(place).rstrip("/"), str(folder).rstrip("/")
        return inner == outer or inner.startswith(outer + "/")
    local, root = cast(Path, place), cast(Path, folder)
    return local == root or root in local.parents


def plain_name(folder: Place, relative: str) -> bool:
    """Whether ``relative`` is a plain name of an entry of the local folder ``folder``: no
    separator, not ``.`` or ``..``, no NUL. Such an entry that is not a symlink lies in the
    folder however the folder's own path resolves."""
    return not (is_remote(folder) or relative in ("", ".", "..") or "/" in relative or
                os.sep in relative or (os.altsep or "/") in relative or "\0" in relative)


def _plain_entry(folder: Place, relative: str) -> bool:
    """Whether ``folder / relative`` is a local entry of ``folder`` itself, no link: a plain
    name (no separator, not ``.`` or ``..``) that is not a symlink lies in the folder however
    the folder's own path resolves. One ``lstat``, where resolving both paths walks every
    component of each (a 4,096-rank folder's files are checked thousands of times)."""
    if not plain_name(folder, relative):
        return False
    try:
        return not stat.S_ISLNK(os.lstat(cast(Path, folder) / relative).st_mode)
    except (OSError, ValueError):  # missing, or a name no file system takes: judged below
        return False


def inside(folder: Place, relative: str, *, rule: str) -> Place:
    """``folder / relative``, checked to lead to a place under ``folder`` (``rule`` ends the
    refusal).

    A local symlink is followed only when it leads to a place inside the folder; an
    absolute path, a ``..`` that climbs out, a name that is the folder itself, or a link to
    a file elsewhere is refused.

    Raises:
        NotACheckpointError: the path leads outside ``folder``; the message says where.
    """
    if os.path.isabs(relative):
        raise NotACheckpointError(f"{folder}: names {relative!r}, outside the checkpoint "
                                  f"folder; {rule}")
    path = folder / relative
    if _plain_entry(folder, relative):
        return path
    root, real = resolved(folder), resolved(path)
    if real != root and within(real, root):
        return path
    link = not is_remote(path) and os.path.islink(cast(Path, path))
    how = f"a symlink to {real}" if link else f"resolves to {real}"
    fix = (f"; replace the link by the file itself (cp --remove-destination {real} {path})"
           if link else "; use an intact copy of the checkpoint")
    raise NotACheckpointError(f"{path}: {how}, outside the checkpoint folder {folder}; "
                              f"{rule}{fix}")
