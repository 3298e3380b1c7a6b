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
    root, real = resolved(folder), resolved(path)
    if real != root and within(real, root):
        return path
    link = not is_remote(path) and os.path.islink(cast(Path, path))
    how = f"a symlink to {real}" if link else f"resolves to {real}"
    fix = (f"; replace the link by the file itself (cp --remove-destination {real} {path})"
           if link else "; use an intact copy of the checkpoint")
    raise NotACheckpointError(f"{path}: {how}, outside the checkpoint folder {folder}; "
                              f"{rule}{fix}")
