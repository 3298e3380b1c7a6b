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

Saving again a step that is committed (``CheckpointManager.save(step, overwrite=True)``)
keeps a committed copy of that step at every moment. The new copy is saved, by the steps
above, into ``checkpoint_N.replacement``; once it is committed, :func:`replace_with` makes
it ``checkpoint_N``: the old copy is uncommitted (from then on the replacement is the
step's committed copy), the replacement is copied into ``checkpoint_N`` on the server
(``CopyObject``: no byte comes back to this process) by the save protocol, its manifest
last, and the replacement is deleted. A crash at any request leaves a committed
``checkpoint_N``, a committed replacement, or both; the next manager finishes the switch
(:meth:`MarkerCommits.recover`), and until then :meth:`CheckpointManager.checkpoints`
counts a committed replacement as its step.
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

__all__ = ["INCOMPLETE", "REPLACEMENT", "begin_save", "end_save", "delete", "sweep",
           "replace_with", "MarkerCommits"]

log = logging.getLogger("fsdpckpt")

_MANIFEST = "fsdpckpt.json"  # training.manifest.MANIFEST; not imported: manifest imports us
_MARKER_TEXT = b"a save or a deletion of this checkpoint has not finished\n"
#: ``checkpoint_N{REPLACEMENT}``: a new copy of the committed step N, before it replaces it.
REPLACEMENT = ".replacement"

#: Delete a file or a folder and everything under it (gone already: nothing to do): the
#: seam's own, named here so that a test can cut a deletion short between two removals.
_remove = storage.remove


def _clear(folder: RemotePath, keep: str | None) -> None:
    """Delete the folder's contents, the manifest first, ``keep`` (a name) not at all: the
    rest in batches (one request per thousand objects), not a round of requests each."""
    refresh(folder)
    found = set(folder.fs.find(folder.path))
    manifest = (folder / _MANIFEST).path
    if manifest in found:
        _remove(folder / _MANIFEST)  # from here on the folder is not committed
    rest = sorted(found - {manifest, (folder / keep).path if keep else ""})
    if rest:
        folder.fs.rm(rest)
    refresh(folder)
    for entry in folder.iterdir():  # what is left: folders a store keeps once emptied
        if entry.name != keep:
            _remove(entry)
    refresh(folder)


def begin_save(folder: RemotePath) -> None:
    """Step 1 of a save into ``folder`` (rank 0): intent marker, then an empty folder."""
    put_bytes(folder / INCOMPLETE, _MARKER_TEXT)
    _clear(folder, keep=INCOMPLETE)


def end_save(folder: Place) -> None:
    """After the manifest is written (rank 0): the intent marker goes."""
    storage.remove_file(folder / INCOMPLETE)  # a local save writes none: nothing to do
    refresh(folder)


def delete(folder: RemotePath) -> None:
    """Delete a checkpoint so that no crash leaves a half-deleted one that looks whole."""
    put_bytes(folder / INCOMPLETE, _MARKER_TEXT)
    _clear(folder, keep=INCOMPLETE)
    _remove(folder)  # only the marker is left: it goes last, with the folder
    refresh(folder)


def _committed(folder: RemotePath) -> bool:
    return (folder / _MANIFEST).is_file()


def _copy_committed(source: RemotePath, target: RemotePath) -> None:
    """Copy the committed checkpoint ``source`` into ``target`` on the server, by the save
    protocol: intent marker, an emptied folder, every file, the manifest last, no marker."""
    begin_save(target)
    refresh(source)
    manifest = f"{source.path}/{_MANIFEST}"
    files = [f for f in sorted(source.fs.find(source.path))
             if f != manifest and f != f"{source.path}/{INCOMPLETE}"]
    # The data in one batch (the client copies them concurrently, each on the server),
    # then the manifest: the commit, alone and last.
    for batch in (files, [manifest]):
        if batch:
            source.fs.copy(batch, [(target / f[len(source.path) + 1:]).path for f in batch])
    end_save(target)


def replace_with(final: RemotePath, replacement: RemotePath) -> None:
    """The committed ``replacement`` becomes ``final`` (see the module's docstring); run
    again after a crash, it finishes what is left (a copy already whole is not redone)."""
    refresh(final)
    if _committed(final) and (final / _MANIFEST).read_bytes() == \
            (replacement / _MANIFEST).read_bytes():
        end_save(final)  # copied whole: at most the intent marker is left to remove
    else:
        _copy_committed(replacement, final)  # uncommits the old copy first (its manifest)
    delete(replacement)


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

    def _names(self, key: int) -> tuple[RemotePath, RemotePath]:
        final = self.root / f"{self.final}{key}"
        return final, final.parent / f"{final.name}{REPLACEMENT}"

    def start(self, key: int) -> RemotePath:
        """Where the save of ``key`` writes: in place (:func:`begin_save` clears the folder
        once the intent marker is in), or beside a committed copy of it."""
        refresh(self.root)
        final, replacement = self._names(key)
        if _committed(replacement):  # a switch that failed: finished before a new save
            replace_with(final, replacement)
        return replacement if _committed(final) else final

    def commit(self, key: int) -> RemotePath:
        # save_state committed it (the manifest); a replacement takes the final name.
        refresh(self.root)
        final, replacement = self._names(key)
        if _committed(replacement):
            replace_with(final, replacement)
        return final

    def recover(self, complete: Callable[[Any], bool], final: re.Pattern[str]) -> None:
        refresh(self.root)
        names = [p.name for p in self.root.iterdir() if final.match(p.name)]
        for name in names:
            replacement = self.root / name
            if name.endswith(REPLACEMENT) and _committed(replacement):
                log.warning("fsdpckpt: finishing the replacement of %s by %s, left by a save "
                            "that did not finish", name.removesuffix(REPLACEMENT), replacement)
                replace_with(self.root / name.removesuffix(REPLACEMENT), replacement)
        refresh(self.root)
        names = [p.name for p in self.root.iterdir() if final.match(p.name)]
        for swept in sweep(self.root, names):
            log.warning("fsdpckpt: removed %s, left by a save that did not finish", swept)

    def delete(self, path: Any) -> None:
        delete(path)  # intent marker, manifest, data, marker

    def refresh(self) -> None:
        refresh(self.root)
