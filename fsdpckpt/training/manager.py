"""``CheckpointManager``: policy for a folder of checkpoints (commit, latest, retention).

Mechanism is :func:`fsdpckpt.save_state` / :func:`fsdpckpt.load_state`; this module
decides names and lifetimes. A checkpoint is written into ``root/.tmp-checkpoint_{step}``
and renamed to ``root/checkpoint_{step}`` only when every rank has finished, every file
is fsynced and the manifest is written; the parent folder is fsynced after the rename. So
a ``checkpoint_*`` folder is complete by construction, and a crash leaves at most a
``.tmp-*`` folder, which the next manager removes. Old checkpoints are deleted only after
the new one is committed, and an async save counts only once it has completed; a
checkpoint is deleted by first renaming it to a ``.tmp-*`` name, so a crash during the
deletion cannot leave a half-deleted folder that looks committed.

On object storage (``root`` a URL such as ``s3://bucket/run``) there is no rename: a
checkpoint is written in place into ``checkpoint_{step}`` by the protocol of
:mod:`fsdpckpt.training._remote` (intent marker first, manifest last), a folder counts as
committed exactly when its manifest exists, retention runs only after the new checkpoint
is committed and deletes a checkpoint's manifest before its data, and the leftovers of an
unfinished save are swept by the next manager (docs/remote-training.md).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, cast

from fsdpckpt._io.durable import fsync_dir
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt.errors import OptionError, ResumeWarning
from fsdpckpt.training import _remote
from fsdpckpt.training._dist import dist_or_none, everywhere, rank_world
from fsdpckpt.training.manifest import MANIFEST, manifest_digest
from fsdpckpt.training.state import AsyncSave, LoadResult, load_state, save_state

__all__ = ["CheckpointManager"]

log = logging.getLogger("fsdpckpt")
_COMMITTED = re.compile(r"^checkpoint_(\d+)$")
_TEMPORARY = ".tmp-checkpoint_"


def _from_rank_zero(value: Any) -> Any:
    dist = dist_or_none()
    if dist is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class CheckpointManager:
    """Saves ``root/checkpoint_{step}`` atomically, finds the newest, keeps a few.

    Args:
        root: the folder holding the checkpoints (created).
        keep_last: how many of the newest checkpoints to keep (None: all).
        keep_every: also keep every checkpoint whose step is a multiple of this.
        async_save: write in the background; the next :meth:`save` or :meth:`wait`
            completes and commits the previous one.
        digest: record each file's ``"sha256"`` (or ``"blake2b"``) in the manifest, as
            :func:`save_state` does; :attr:`last_digest` is then worth keeping elsewhere.
        storage_options: options for the fsspec filesystem when ``root`` is a URL
            (``s3://bucket/run``): endpoint, credentials.

    Example:
        >>> mgr = CheckpointManager("run/ckpts", keep_last=3)
        >>> start = (mgr.restore(model=model, optimizer=opt) or -1) + 1
        >>> for step in range(start, steps):
        ...     train_step()
        ...     mgr.save(step, model=model, optimizer=opt)
        >>> mgr.wait()  # with async_save=True: commits the last save
    """

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = 3,
                 keep_every: int | None = None, async_save: bool = False,
                 digest: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise OptionError("keep_last must be at least 1 (or None to keep all)")
        self.root: Path | RemotePath = location(root, storage_options=storage_options)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save, self.digest = async_save, digest
        #: On rank 0, the manifest digest of the last committed checkpoint
        #: (``fsdpckpt verify --expect-digest`` checks a checkpoint against it), else None.
        self.last_digest: str | None = None
        self._pending: tuple[int, AsyncSave] | None = None
        #: What the last :meth:`restore` loaded (its ``warnings`` included), or None.
        self.last_restore: LoadResult | None = None
        everywhere(self._clean_up_on_rank_zero)

    def _clean_up_on_rank_zero(self) -> None:
        rank, _world = rank_world()
        if rank != 0:
            return
        if isinstance(self.root, RemotePath):
            _remote.refresh(self.root)
            names = [p.name for p in self.root.iterdir() if _COMMITTED.match(p.name)]
            for swept in _remote.sweep(self.root, names):
                log.warning("fsdpckpt: removed %s, left by a save that did not finish", swept)
            return
        self._disk.mkdir(parents=True, exist_ok=True)
        for leftover in sorted(self._disk.glob(_TEMPORARY + "*")):
            final = self._disk / leftover.name.replace(_TEMPORARY, "checkpoint_", 1)
            if (leftover / MANIFEST).is_file() and _COMMITTED.match(final.name) and \
                    not final.exists():
                # Complete (the manifest is written last) but not renamed: a crash between
                # the two, e.g. while replacing the same step. Commit it now.
                log.warning("fsdpckpt: committing %s, complete but left unrenamed", leftover)
                os.rename(leftover, final)
                continue
            log.warning("fsdpckpt: removing %s, left by a save that did not finish", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        fsync_dir(self._disk)

    @property
    def _disk(self) -> Path:
        """``root`` on a local filesystem (only the local code paths ask)."""
        return cast(Path, self.root)

    def checkpoints(self) -> list[Any]:
        """The committed checkpoints (paths, or :class:`RemotePath` on object storage),
        oldest first."""
        if isinstance(self.root, RemotePath):
            _remote.refresh(self.root)  # another process may have committed or deleted
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else []:
            match = _COMMITTED.match(entry.name)
            if match and (entry / MANIFEST).is_file():
                found.append((int(match.group(1)), entry))
        return [path for _step, path in sorted(found)]

    def latest(self) -> Any:
        """The newest committed checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, **parts: Any) -> None:
        """Save ``parts`` (model=, optimizer=, scheduler=... as for save_state) as step ``step``."""
        self.wait()
        if isinstance(self.root, RemotePath):
            # In place: save_state uncommits an older copy of this step first (manifest
            # first), so re-saving a step leaves no committed copy of it until it commits.
            self._finish(step, save_state(self.root / f"checkpoint_{step}", step=step,
                                          async_save=self.async_save, manifest=True,
                                          digest=self.digest, **parts))
            return
        rank, _world = rank_world()
        temporary = self._disk / f"{_TEMPORARY}{step}"
        everywhere(lambda: shutil.rmtree(temporary) if rank == 0 and temporary.exists()
                   else None)
        self._finish(step, save_state(temporary, step=step, async_save=self.async_save,
                                      manifest=True, digest=self.digest, **parts))

    def _finish(self, step: int, handle: AsyncSave | None) -> None:
        if handle is None:
            self._commit(step)
        else:
            self._pending = (step, handle)

    def wait(self) -> None:
        """Complete and commit a pending async save (on every rank)."""
        if self._pending is not None:
            step, handle = self._pending
            self._pending = None
            handle.wait()
            self._commit(step)

    def restore(self, **parts: Any) -> int | None:
        """Load the newest checkpoint into ``parts``; return its step, or None if there is none.

        What :func:`load_state` reports is not dropped: each of its warnings (the RNG
        policy applied when the world size changed...) is issued as a
        :class:`~fsdpckpt.training.state.ResumeWarning` on the rank it concerns, and the whole
        :class:`~fsdpckpt.training.state.LoadResult` is kept in :attr:`last_restore`.

        Raises:
            the errors of :func:`load_state` (a model that does not match, a hostile file).
        """
        self.wait()
        newest = self.latest() if rank_world()[0] == 0 else None
        name = _from_rank_zero(newest.name if newest is not None else None)  # the same one
        if name is None:
            return None
        result = load_state(self.root / name, **parts)
        self.last_restore = result
        for message in result.warnings:
            warnings.warn(message, ResumeWarning, stacklevel=2)
        return result.step

    def _commit(self, step: int) -> None:
        everywhere(lambda: self._commit_on_rank_zero(step))

    def _commit_on_rank_zero(self, step: int) -> None:
        rank, _world = rank_world()
        if rank == 0 and isinstance(self.root, RemotePath):
            # save_state committed it (the manifest); only then does retention run.
            committed = self.root / f"checkpoint_{step}"
            _remote.refresh(self.root)
            self.last_digest = manifest_digest(committed)
            self._apply_retention(just_committed=committed)
        elif rank == 0:
            final = self._disk / f"checkpoint_{step}"
            replaced = None
            if final.exists():  # the same step saved again: the old copy goes only after
                replaced = self._uncommit(final)
            os.rename(self._disk / f"{_TEMPORARY}{step}", final)
            fsync_dir(self._disk)
            self.last_digest = manifest_digest(final)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._apply_retention(just_committed=final)

    def _apply_retention(self, *, just_committed: Any) -> None:
        committed = self.checkpoints()
        keep = set(committed[-self.keep_last:] if self.keep_last else committed)
        keep.add(just_committed)  # even when its step is lower than older ones (a rewind)
        if self.keep_every:
            keep |= {p for p in committed if int(p.name.split("_")[1]) % self.keep_every == 0}
        for path in committed:
            if path not in keep:
                self._delete(path)

    def _uncommit(self, path: Path) -> Path:
        # Atomically: a crash in the middle of rmtree must not leave a half-deleted folder
        # that still looks committed. The rename makes it a leftover, removed on next start.
        doomed = Path(tempfile.mkdtemp(prefix=f"{_TEMPORARY}deleting-{path.name}-",
                                       dir=self._disk))
        os.rename(path, doomed / path.name)
        fsync_dir(self._disk)
        return doomed

    def _delete(self, path: Any) -> None:
        if isinstance(path, RemotePath):
            _remote.delete(path)  # intent marker, manifest, data, marker
            return
        shutil.rmtree(self._uncommit(path), ignore_errors=True)
