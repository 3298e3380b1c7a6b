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
unfinished save are swept by the next manager (docs/remote-training.md). A step saved
again is written beside its committed copy as ``checkpoint_{step}.replacement`` and
switched in once committed, so the step has a committed copy at every moment.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterable
from typing import Any

from fsdpckpt._io.publish_folders import commits
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import OptionError, OutputExistsError, ResumeWarning
from fsdpckpt.training._dist import dist_or_none, everywhere, rank_world
from fsdpckpt.training._remote import REPLACEMENT, MarkerCommits
from fsdpckpt.training.manifest import MANIFEST, manifest_digest
from fsdpckpt.training.state import AsyncSave, LoadResult, load_state, save_state

__all__ = ["CheckpointManager"]

log = logging.getLogger("fsdpckpt")
# A step's folder; on object storage also a new copy of it not yet switched in (_remote.py).
_COMMITTED = re.compile(rf"^checkpoint_(\d+)({re.escape(REPLACEMENT)})?$")
_TEMPORARY = ".tmp-checkpoint_"


def _step_of(path: Any) -> int:
    match = _COMMITTED.match(path.name)
    return int(match.group(1)) if match else -1


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
        >>> last = mgr.restore(model=model, optimizer=opt)  # None on a fresh run
        >>> start = 0 if last is None else last + 1  # not `last or -1`: step 0 is a step
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
        self.root: Place = location(root, storage_options=storage_options)
        # How a checkpoint is committed (fsdpckpt/_io/publish_folders.py): locally written
        # as .tmp-checkpoint_{step} and renamed; on object storage in place, by the intent
        # marker and the manifest (training/_remote.py).
        self._commits = commits(self.root, hidden=_TEMPORARY, final="checkpoint_",
                                in_place=MarkerCommits)
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
        if rank_world()[0] == 0:
            self._commits.recover(lambda folder: (folder / MANIFEST).is_file(), _COMMITTED)

    def checkpoints(self) -> list[Any]:
        """The committed checkpoints (paths, or :class:`RemotePath` on object storage),
        oldest first."""
        self._commits.refresh()  # another process may have committed or deleted
        found: dict[int, Any] = {}
        for entry in self.root.iterdir() if self.root.is_dir() else []:
            match = _COMMITTED.match(entry.name)
            # A committed replacement counts while its step's own folder is not.
            if match and (entry / MANIFEST).is_file() and \
                    (not match.group(2) or int(match.group(1)) not in found):
                found[int(match.group(1))] = entry
        return [found[step] for step in sorted(found)]

    def latest(self) -> Any:
        """The newest committed checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, *, overwrite: bool = False, **parts: Any) -> None:
        """Save ``parts`` (model=, optimizer=, scheduler=, dataloader=... as for save_state) as
        step ``step``.

        A step saved before is refused (before anything is written), unless ``overwrite``:
        then the new copy replaces it once complete: the step has a committed copy, the old
        or the new, at every moment (docs/remote-training.md for object storage).

        Raises:
            OutputExistsError: ``step`` is committed already and ``overwrite`` is False.
        """
        self.wait()
        rank, _world = rank_world()

        def start() -> str | None:
            if rank != 0:
                return None
            committed = self.root / f"checkpoint_{step}"
            # A committed replacement (a switch a crash cut short) is that step saved too.
            if not overwrite and any((self.root / f"{committed.name}{suffix}" / MANIFEST)
                                     .is_file() for suffix in ("", REPLACEMENT)):
                raise OutputExistsError(
                    f"{committed}: step {step} is saved already; nothing was written. Save "
                    "another step, or pass overwrite=True to replace it.")
            return self._commits.start(step).name

        writing = self.root / _from_rank_zero(everywhere(start))  # the same on every rank
        self._finish(step, save_state(writing, step=step,
                                      async_save=self.async_save, manifest=True,
                                      digest=self.digest, overwrite=True, **parts))

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

    def restore(self, *, exclude: str | Iterable[str] | None = None,
                **parts: Any) -> int | None:
        """Load the newest checkpoint into ``parts``; return its step, or None if there is none.

        ``parts`` are those of :func:`load_state` (model=, optimizer=, scheduler=,
        dataloader=...). ``exclude`` leaves parts (``"optimizer"``, ``"dataloader"``...) or
        model keys (globs such as ``"lm_head.*"``) out, as for :func:`load_state`: to
        fine-tune from a run's checkpoint with a new optimizer or head, or on another world
        size with fresh dataloaders.

        What :func:`load_state` reports is not dropped: each of its warnings (the RNG
        policy applied when the world size changed...) is issued as a
        :class:`~fsdpckpt.training.state.ResumeWarning` on the rank it concerns (the RNG and
        dataloader policies on another world size), and the whole
        :class:`~fsdpckpt.training.state.LoadResult` is kept in :attr:`last_restore`.

        Raises:
            the errors of :func:`load_state` (a model that does not match, a hostile file).
        """
        self.wait()
        newest = self.latest() if rank_world()[0] == 0 else None
        name = _from_rank_zero(newest.name if newest is not None else None)  # the same one
        if name is None:
            return None
        result = load_state(self.root / name, exclude=exclude, **parts)
        self.last_restore = result
        for message in result.warnings:
            warnings.warn(message, ResumeWarning, stacklevel=2)
        return result.step

    def _commit(self, step: int) -> None:
        everywhere(lambda: self._commit_on_rank_zero(step))

    def _commit_on_rank_zero(self, step: int) -> None:
        if rank_world()[0] == 0:
            committed = self._commits.commit(step)
            self.last_digest = manifest_digest(committed)
            self._apply_retention(just_committed=committed)

    def _apply_retention(self, *, just_committed: Any) -> None:
        committed = self.checkpoints()
        keep = set(committed[-self.keep_last:] if self.keep_last else committed)
        keep.add(just_committed)  # even when its step is lower than older ones (a rewind)
        if self.keep_every:
            keep |= {p for p in committed if _step_of(p) % self.keep_every == 0}
        for path in committed:
            if path not in keep:
                self._commits.delete(path)
