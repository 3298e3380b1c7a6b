"""Training checkpoints on object storage (``s3://``...): the commit protocol's mechanics.

Object stores have no rename, so a checkpoint cannot be staged under one name and renamed
into place. Instead (docs/remote-training.md):

1. before anything of the checkpoint folder is touched, rank 0 writes the *intent marker*
   ``.fsdpckpt-incomplete`` into it, then deletes whatever the folder held (an older
   copy's manifest first, so it stops counting as committed before its files go);
2. every rank writes its data (DCP through fsspec, side files as single PUTs);
3. rank 0 writes the manifest ``fsdpckpt.json`` last, in one PUT: that object appearing
   is the commit; then it deletes the intent marker.

A folder is committed exactly when its manifest exists. A folder holding the intent
marker and no manifest is the leftover of a save (or a deletion) that did not finish:
nothing reads it as a checkpoint (:func:`fsdpckpt.dcp.layout.refuse_unfinished_save`), and
:func:`sweep` deletes it. Deleting a checkpoint runs the same steps backwards: marker,
manifest, data, marker last.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.remote import RemotePath
from fsdpckpt._io.storage import Place, put_bytes, refresh
from fsdpckpt.dcp.layout import INCOMPLETE  # the intent marker: written first, removed last

__all__ = ["INCOMPLETE", "begin_save", "end_save", "delete", "sweep", "MarkerCommits"]

log = logging.getLogger("fsdpckpt")

_MANIFEST = "fsdpckpt.json"  # training.manifest.MANIFEST; not imported: manifest imports us
_MARKER_TEXT = b"a save or a deletion of this checkpoint has not finished\n"

#: Delete a file or a folder and everything under it (gone already: nothing to do): the
#: seam's own, named here so that a test can cut a deletion short between two removals.
_remove = storage.remove


def _clear(folder: RemotePath, keep: str | None) -> None:
    """Delete the folder's contents, the manifest first, ``keep`` (a name) not at all."""
    refresh(folder)
    entries = folder.iterdir()
    for entry in sorted(entries, key=lambda p: p.name != _MANIFEST):
        if entry.name != keep:
            _remove(entry)
    refresh(folder)


def begin_save(folder: RemotePath) -> None:
    """Step 1 of a save into ``folder`` (rank 0): intent marker, then an empty folder."""
    put_bytes(folder / INCOMPLETE, _MARKER_TEXT)
    _clear(folder, keep=INCOMPLETE)


def end_save(folder: Place) -> None:
    """After the manifest is written (rank 0): the intent marker goes."""
    _remove(folder / INCOMPLETE)
    refresh(folder)


def delete(folder: RemotePath) -> None:
    """Delete a checkpoint so that no crash leaves a half-deleted one that looks whole."""
    put_bytes(folder / INCOMPLETE, _MARKER_TEXT)
    _clear(folder, keep=INCOMPLETE)
    _remove(folder)  # only the marker is left: it goes last, with the folder
    refresh(folder)


def sweep(root: RemotePath, names: list[str]) -> list[RemotePath]:
    """Delete the leftovers among ``root``'s folders ``names``; return those deleted.

    A folder holding both the marker and the manifest was committed and only lost its
    marker's removal: the marker goes, the checkpoint stays.
    """
    swept = []
    for name in names:
        folder = root / name
        if not (folder / INCOMPLETE).is_file():
            continue
        if (folder / _MANIFEST).is_file():
            end_save(folder)
            continue
        _clear(folder, keep=INCOMPLETE)
        _remove(folder)  # the marker last, with the folder
        swept.append(folder)
    refresh(root)
    return swept


class MarkerCommits:
    """The checkpoint folders ``{final}{key}`` of ``root`` committed in place by this
    protocol: the :class:`~fsdpckpt._io.publish_folders.Commits` of an object store."""

    def __init__(self, root: RemotePath, final: str) -> None:
        self.root, self.final = root, final

    def writing(self, key: int) -> RemotePath:
        # In place: save_state uncommits an older copy of this key first (manifest first),
        # so re-saving leaves no committed copy of it until it commits.
        return self.root / f"{self.final}{key}"

    def start(self, key: int) -> None:
        """Nothing: :func:`begin_save` clears the folder once the intent marker is in."""

    def commit(self, key: int) -> RemotePath:
        # save_state committed it (the manifest); the listings are made fresh.
        refresh(self.root)
        return self.root / f"{self.final}{key}"

    def recover(self, complete: Callable[[Any], bool], final: re.Pattern[str]) -> None:
        refresh(self.root)
        names = [p.name for p in self.root.iterdir() if final.match(p.name)]
        for swept in sweep(self.root, names):
            log.warning("fsdpckpt: removed %s, left by a save that did not finish", swept)

    def delete(self, path: Any) -> None:
        delete(path)  # intent marker, manifest, data, marker

    def refresh(self) -> None:
        refresh(self.root)
