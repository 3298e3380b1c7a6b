"""Where a path leads, for both kinds of place: the containment rule every reader and copier
applies before it opens a file that a checkpoint (or a model folder) names.

One rule: a path is inside a folder when, its links followed (:func:`~fsdpckpt._io.storage.
resolved`), it is that folder or lies under it (:func:`within`). :func:`inside` applies it
to a name a checkpoint gives (and refuses with the caller's reason); :func:`leads_out` is
the same judgement without the refusal, for a caller that lists a folder and decides per
entry (the layout's part folders and side files, ``list``'s walk: docs/reliability.md,
"Contained"); :func:`link_refusal` is the one way a link out is said. Callers that judge a
path they listed themselves (export's side files, with a hub cache's second root) call
:func:`within` on :func:`real` paths. Object stores have no links, and their paths refuse
``..``, so there only an absolute name can lead out.

A link is judged by where it leads, resolved once; it is never followed a step at a time.
A link that cannot be resolved (a loop) leads nowhere inside.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import cast

from fsdpckpt._io.storage import Place, is_remote, resolved
from fsdpckpt.errors import NotACheckpointError

__all__ = ["within", "inside", "leads_out", "links_out", "link_refusal", "real", "shown"]

#: The most characters of a path a refusal quotes: a link's target is the checkpoint's
#: text, up to PATH_MAX (4,096) long.
_SHOWN = 300


def shown(place: Place | str) -> str:
    """``place`` as a message quotes it: at most a few hundred characters."""
    text = str(place)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def real(place: Place) -> Place | None:
    """Where ``place`` leads, its links followed (:func:`~fsdpckpt._io.storage.resolved`);
    None when it cannot be resolved (a link loop: no place at all)."""
    try:
        return resolved(place)
    except (OSError, RuntimeError, ValueError):  # RuntimeError: pathlib's "Symlink loop"
        return None


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


def leads_out(folder: Place, relative: str) -> Place | None:
    """Where ``folder / relative`` leads when that is not inside ``folder`` (its links
    followed; the folder itself counts as outside: a link to it is a loop), else None.

    A plain entry that is no link costs one ``lstat``; only a link (or a name with
    separators) is resolved, once, with the folder. An unresolvable link (a loop) leads
    out: the path itself is returned.
    """
    if _plain_entry(folder, relative):
        return None
    path = folder / relative
    root, target = real(folder), real(path)
    if target is None or root is None:
        return path
    return None if target != root and within(target, root) else target


def links_out(folder: Place) -> list[tuple[str, Place]]:
    """The entries of ``folder`` that are links leading out of it, as (name, where each
    leads), sorted by name; none on object storage, which has no links (and costs no
    request here), or when ``folder`` is no local folder."""
    if is_remote(folder):
        return []
    try:
        with os.scandir(cast(Path, folder)) as scan:
            linked = sorted(item.name for item in scan if item.is_symlink())
    except OSError:
        return []
    judged = [(name, leads_out(folder, name)) for name in linked]
    return [(name, out) for name, out in judged if out is not None]


def link_refusal(path: Place, target: Place, folder: Place, rule: str, *,
                 what: str = "the checkpoint folder",
                 fix: str | None = None) -> NotACheckpointError:
    """The one line that refuses ``path``, which leads to ``target`` outside ``folder``
    (``what`` it is, for the message), ``rule`` saying what fsdpckpt reads, and what to do
    (``fix``, else a copy in place of the link)."""
    link = not is_remote(path) and os.path.islink(cast(Path, path))
    how = (f"a symlink to {shown(target)}" if target != path else "a symlink loop") \
        if link else f"resolves to {shown(target)}"
    if fix is not None:
        pass
    elif not link:
        fix = "use an intact copy of the checkpoint"
    elif target == path:
        fix = f"remove the link ({shown(path)})"
    elif os.path.isdir(cast(Path, target)):
        fix = (f"replace the link by a copy of the folder (rm {shown(path)} && cp -r "
               f"{shown(target)} {shown(path)}), or pass the folder it leads to itself")
    else:
        fix = (f"replace the link by the file itself (cp --remove-destination "
               f"{shown(target)} {shown(path)})")
    return NotACheckpointError(f"{shown(path)}: {how}, outside {what} {shown(folder)}; "
                               f"{rule}; {fix}")


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
        raise NotACheckpointError(f"{shown(folder)}: names {shown(repr(relative))}, outside "
                                  f"the checkpoint folder; {rule}")
    target = leads_out(folder, relative)
    if target is None:
        return folder / relative
    raise link_refusal(folder / relative, target, folder, rule)
