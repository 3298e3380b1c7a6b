"""``list_checkpoints``: the checkpoints of a run's folder, with their step, state, time and size.

A run leaves its checkpoints side by side: a :class:`~fsdpckpt.CheckpointManager` root
(``checkpoint_3/``, and ``.tmp-checkpoint_7/`` while a save runs or after one was killed),
an HF Trainer output folder (``checkpoint-500/``, ``tmp-checkpoint-1000/``), Accelerate's
``checkpoints/checkpoint_2/``, torchtitan's ``step-100/``, torchtune's ``epoch_0/``,
VeRL's ``global_step_10/``, Lightning's ``*.ckpt/``. Each is told apart by what it holds,
never trusted by name alone: a manifest (``fsdpckpt.json``, written last) makes it
committed; every DCP folder with its ``.metadata`` makes it complete; a staging name, an
intent marker without a manifest, or a DCP folder without ``.metadata`` makes it an
unfinished save. Nothing is unpickled: names, sizes and times only.

Contained: the walk stays inside the folder given (judged where it resolves, so the root
may itself be a link). A link in it is judged once by where it leads
(:func:`fsdpckpt._io.storage_paths.leads_out`): one inside (``latest -> checkpoint_3``) is
listed as what it leads to; one out of the root is never followed, sized or walked (a link
to ``/`` costs nothing), and when its name is a checkpoint's it is listed ``unreadable``,
its ``why`` naming where it leads; any other is left out.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from fsdpckpt._io import storage, storage_paths
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.storage import Place
from fsdpckpt._io.storage_tree import modified, tree_size
from fsdpckpt.dcp.layout import METADATA_FILE, STAGING, find_layout, unfinished_save
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    FsdpCkptError,
    NotACheckpointError,
    UnfinishedSaveError,
)

__all__ = ["CheckpointEntry", "CheckpointList", "STATES", "list_checkpoints"]

#: ``committed``: its manifest, written last, is there; ``complete``: every DCP folder has
#: its ``.metadata`` (no manifest: a trainer's own save); ``unfinished``: a save that did not
#: finish; ``unreadable``: named as a checkpoint, but not one fsdpckpt can read.
STATES = ("committed", "complete", "unfinished", "unreadable")

_MANIFEST = "fsdpckpt.json"
#: A checkpoint's folder name, with its step: the trainers' and CheckpointManager's.
_NAMED = re.compile(r"^\.?(?:tmp-)?(?:checkpoint|ckpt|step|global_step|epoch|dist_epoch)"
                    r"[-_]?(\d+)$")
#: Where Accelerate's automatic checkpoint naming puts them, under the project folder.
_NESTED = ("checkpoints",)


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint of a run.

    Attributes:
        name: its folder's name. path: the folder.
        step: the step its name carries, or None.
        state: one of :data:`STATES`. why: for ``unfinished`` and ``unreadable``, what
            says so (one line).
        modified: when it was last written (its manifest's time, else its folder's), as
            seconds since the epoch; None on object storage.
        bytes, files: what it holds, every file under it.
    """

    name: str
    path: Place
    step: int | None
    state: str
    modified: float | None
    bytes: int
    files: int
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        when = None if self.modified is None else \
            datetime.fromtimestamp(self.modified, timezone.utc).isoformat(timespec="seconds")
        return {"name": self.name, "path": str(self.path), "step": self.step,
                "state": self.state, "modified": when, "bytes": self.bytes,
                "files": self.files, "why": self.why}


@dataclass(frozen=True)
class CheckpointList:
    """What :func:`list_checkpoints` found: ``checkpoints`` oldest first (by step, then
    name); :attr:`latest` the newest one a load would take."""

    root: Place
    checkpoints: tuple[CheckpointEntry, ...]

    @property
    def latest(self) -> CheckpointEntry | None:
        """The newest committed or complete checkpoint, or None: the highest step, or where
        no name carries a step, the last written."""
        usable = [c for c in self.checkpoints if c.state in ("committed", "complete")]
        stepped = [c for c in usable if c.step is not None]
        if stepped:
            return stepped[-1]
        return max(usable, key=lambda c: c.modified or 0.0) if usable else None

    def to_json(self) -> dict[str, Any]:
        """The document ``fsdpckpt list --json`` prints."""
        return {"root": str(self.root), "checkpoints": [c.to_json() for c in self.checkpoints],
                "latest": str(self.latest.path) if self.latest else None}


def list_checkpoints(root: str | os.PathLike[str] | RemotePath, *,
                     storage_options: dict[str, Any] | None = None) -> CheckpointList:
    """The checkpoints in the run folder ``root`` (local, or a URL), oldest first.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist.
        NotACheckpointError: ``root`` is a file, or holds no checkpoint (the message says
            what names were looked for).
    """
    place = location(root, storage_options=storage_options)
    if not place.exists():
        raise CheckpointNotFoundError(f"{place}: no such folder; check the path.")
    if not place.is_dir():
        raise NotACheckpointError(f"{place}: is a file; pass the folder a run saves its "
                                  "checkpoints in.")
    if _holds_a_save(place):
        raise NotACheckpointError(
            f"{place}: is a checkpoint itself, not a folder of them; see what it holds with "
            f"fsdpckpt inspect {place}, or list the folder above it")
    found = _candidates(place)
    for nested in _NESTED:  # Accelerate's project folder: its checkpoints/ holds them
        if not found and storage_paths.leads_out(place, nested) is None and \
                (place / nested).is_dir():
            place = place / nested
            found = _candidates(place)
    if not found:
        raise NotACheckpointError(
            f"{place}: holds no checkpoint folder (checkpoint_N, checkpoint-N, step-N, "
            "global_step_N, epoch_N or *.ckpt, holding a DCP save); pass the folder a run "
            "saves its checkpoints in, or inspect a single checkpoint with fsdpckpt inspect")
    entries = [_refused(place, path, out) if out is not None else _entry(path)
               for path, out in found]
    entries.sort(key=lambda e: (e.step is None, e.step or 0, e.name))
    return CheckpointList(place, tuple(entries))


def _candidates(folder: Place) -> list[tuple[Place, Place | None]]:
    """The checkpoint folders in ``folder``, each with where it leads when it is a link out
    of ``folder`` (None for the others): such a link is judged here, once, not followed."""
    paths: list[tuple[Place, Place | None]] = []
    for entry in storage.entries(folder):
        named = bool(_NAMED.match(entry.name)) or entry.name.endswith(".ckpt")
        out = storage_paths.leads_out(folder, entry.name) if entry.is_link else None
        if out is not None:
            if named:  # said as refused; another name was never a checkpoint it could see
                paths.append((entry.path, out))
        elif (entry.is_dir or entry.is_link and entry.path.is_dir()) and \
                (named or _holds_a_save(entry.path)):
            paths.append((entry.path, None))
    return paths


def _refused(root: Place, path: Place, out: Place) -> CheckpointEntry:
    """A checkpoint name that is a link out of ``root``: listed, never followed."""
    match = _NAMED.match(path.name)
    why = storage_paths.link_refusal(
        path, out, root, "list reads only what is inside the folder it is given",
        what="the run folder", fix=f"see what it leads to with fsdpckpt inspect "
        f"{storage_paths.shown(out)}, or move that checkpoint into the run folder")
    return CheckpointEntry(path.name, path, int(match.group(1)) if match else None,
                           "unreadable", None, 0, 0, str(why))


def _holds_a_save(path: Place) -> bool:
    """Whether ``path`` holds a DCP save (finished or not) at its top or one level down."""
    names = storage.names(path)
    if METADATA_FILE in names or _MANIFEST in names or any(n.endswith(".distcp") for n in names):
        return True
    return any(n.startswith(("pytorch_model_fsdp", "optimizer_")) for n in names)


def _entry(path: Place) -> CheckpointEntry:
    match = _NAMED.match(path.name)
    step = int(match.group(1)) if match else None
    size, files = tree_size(path)
    state, why = _state(path)
    return CheckpointEntry(path.name, path, step, state, _modified(path), size, files, why)


def _state(path: Place) -> tuple[str, str | None]:
    if STAGING.match(path.name):
        return "unfinished", "a save's staging folder: renamed into place only once complete"
    if unfinished_save(path):
        return "unfinished", "its save's intent marker, and no manifest"
    if (path / _MANIFEST).is_file():
        return "committed", None
    try:
        layout = find_layout(path)
    except FsdpCkptError as exc:
        state = "unfinished" if isinstance(exc, UnfinishedSaveError) else "unreadable"
        return state, str(exc).split("\n", 1)[0][:300]
    missing = [p.name for p in layout.parts if not p.complete]
    if missing:
        return "unfinished", f"no .metadata in {', '.join(missing)} (DCP writes it last)"
    return "complete", None


def _modified(path: Place) -> float | None:
    manifest = path / _MANIFEST  # written last: the save's time
    return modified(manifest if manifest.is_file() else path)
