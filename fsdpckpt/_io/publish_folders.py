"""Folders published under a final name, one after another, in a root folder: the publish of
a folder that many processes write into (a training checkpoint, written by every rank).

Locally (:class:`RenameCommits`): a folder is written under a hidden name
(``root/{hidden}{key}``) and renamed to ``root/{final}{key}`` once complete; the root is
fsynced after the rename. So a folder under a final name is complete by construction, and
a crash leaves at most a hidden one, which :meth:`RenameCommits.recover` removes (or
renames into place, when the caller says it is complete). A folder is deleted, or replaced,
by first renaming it out of sight (:func:`~fsdpckpt._io.publish.discard`), so a crash
during the deletion cannot leave a half-deleted folder that looks committed.

On object storage there is no rename: the caller's policy commits in place (training's
intent marker and manifest, :mod:`fsdpckpt.training._remote`). :func:`commits` picks one or
the other for a root; the caller then asks both the same questions (:class:`Commits`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from fsdpckpt._io.durable import fsync_dir
from fsdpckpt._io.publish import discard, swap_in
from fsdpckpt._io.storage import Place, commits_by_rename

__all__ = ["Commits", "RenameCommits", "commits"]

log = logging.getLogger("fsdpckpt")

_C = TypeVar("_C", bound="Commits")


class Commits(Protocol):
    """How folders ``{final}{key}`` in a root are written, committed, recovered and deleted."""

    def start(self, key: int) -> Place:
        """Before the folder of ``key`` is written (one process): clear what is in the way;
        where it is written before it is committed."""

    def commit(self, key: int) -> Place:
        """Commit the written folder of ``key`` (one process); its final place."""

    def recover(self, complete: Callable[[Place], bool], final: re.Pattern[str]) -> None:
        """Clear what a process that died left (one process, at start)."""

    def delete(self, path: Any) -> None:
        """Delete a committed folder so that no crash leaves a half-deleted one."""

    def refresh(self) -> None:
        """Forget cached listings: another process may have committed or deleted."""


class RenameCommits:
    """:class:`Commits` on a local file system: written hidden, committed by a rename."""

    def __init__(self, root: Path, hidden: str, final: str) -> None:
        self.root, self.hidden, self.final = root, hidden, final

    def writing(self, key: int) -> Path:
        return self.root / f"{self.hidden}{key}"

    def start(self, key: int) -> Path:
        if self.writing(key).exists():
            shutil.rmtree(self.writing(key))
        return self.writing(key)

    def commit(self, key: int) -> Path:
        final = self.root / f"{self.final}{key}"
        # The same key published again: the old copy goes only once the new one is in.
        swap_in(self.writing(key), final, f"{self.hidden}deleting-{final.name}-")
        return final

    def recover(self, complete: Callable[[Place], bool], final: re.Pattern[str]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in sorted(self.root.glob(self.hidden + "*")):
            target = self.root / leftover.name.replace(self.hidden, self.final, 1)
            if complete(leftover) and final.match(target.name) and not target.exists():
                # Complete but not renamed: a crash between the two, e.g. while replacing
                # the same key. Commit it now.
                log.warning("fsdpckpt: committing %s, complete but left unrenamed", leftover)
                os.rename(leftover, target)
                continue
            log.warning("fsdpckpt: removing %s, left by a save that did not finish", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        fsync_dir(self.root)

    def delete(self, path: Any) -> None:
        shutil.rmtree(discard(path, f"{self.hidden}deleting-{path.name}-"), ignore_errors=True)

    def refresh(self) -> None:
        """A local folder caches nothing."""


def commits(root: Place, *, hidden: str, final: str,
            in_place: Callable[[Any, str], _C]) -> RenameCommits | _C:
    """The :class:`Commits` for folders ``{final}{key}`` in ``root``: by rename from
    ``{hidden}{key}`` on a local file system; on object storage, which has no rename,
    ``in_place(root, final)``, the caller's policy for committing a folder where it is."""
    if commits_by_rename(root):
        return RenameCommits(cast(Path, root), hidden, final)
    return in_place(root, final)
