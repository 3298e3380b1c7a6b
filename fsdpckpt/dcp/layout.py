"""Finding the parts of a checkpoint folder (Accelerate's, HF Trainer's, or a trainer's
single DCP folder: Lightning's ``*.ckpt/``, torchtune's ``dist_epoch_N/``, torchtitan's
``step-N/``, read as model, optimizer and training state; :mod:`fsdpckpt.dcp._trainers`).

Accelerate's ``save_state`` writes ``pytorch_model_fsdp_{i}/`` and
``optimizer_{i}/`` (DCP folders) beside per-rank ``random_states_{rank}.pkl``
and shared ``scheduler.bin``, ``sampler.bin``, ``scaler.pt``... HF Trainer
writes ``rng_state_{rank}.pth``, ``scheduler.pt`` and ``trainer_state.json``.
This module only names what is there; it opens no file. A checkpoint on object
storage (a URL) is named the same way, from its listing.

Contained (docs/reliability.md): a link is judged once, by where it leads from where the
folder resolves; one out of it is never followed, and refuses the checkpoint when the layout
reads its name (:func:`refuse_links_out`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from fsdpckpt._io import storage, storage_paths
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._hfstorage import find_hf_storage
from fsdpckpt.dcp._layout_errors import (
    STAGING,
    natural_key,
    rank_file_refusal,
    refuse_model_folder,
    several_checkpoints,
)
from fsdpckpt.dcp._layout_names import (
    _CHECKPOINT_DIR,
    _MANIFEST,
    _MODEL_DIR,
    _OPTIMIZER_DIR,
    _SIDE_FILES,
    DATALOADER_STATE,
    INCOMPLETE,
    VERL_HF_DIR,
)
from fsdpckpt.dcp._perrank import find_rank_sets
from fsdpckpt.dcp._trainers import ROLES, TRAINER_META, trainer_of
from fsdpckpt.dcp.reader import METADATA_FILE
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    NotACheckpointError,
    RemoteStorageError,
    UnfinishedSaveError,
)

__all__ = ["DATALOADER_STATE", "INCOMPLETE", "CheckpointLayout", "DcpPart", "SideFile",
           "find_layout", "natural_key", "one_checkpoint", "refuse_links_out", "refuse_rank_file",
           "refuse_unfinished_save", "unfinished_save", "STAGING", "VERL_HF_DIR"]

#: What a refused link is told (storage_paths.link_refusal says where it leads).
_CONTAINED = ("fsdpckpt reads a checkpoint's part folders and side files only from inside "
              "its folder")


@dataclass(frozen=True)
class DcpPart:
    """A DCP folder inside a checkpoint.

    Attributes:
        name: folder name, e.g. ``"pytorch_model_fsdp_0"``; for a part of a trainer's
            folder, the trainer and the part (``"lightning:model"``).
        kind: ``"model"``, ``"optimizer"``, ``"state"`` (a trainer's training state) or
            ``"dcp"`` (any other DCP folder).
        index: the number Accelerate gives it (``optimizer_1`` is 1), or None.
        path: the folder.
        complete: whether it holds ``.metadata`` (DCP writes it last).
    """

    name: str
    kind: str
    index: int | None
    path: Place
    complete: bool


@dataclass(frozen=True)
class SideFile:
    """A file saved beside the DCP folders (RNG state, scheduler, sampler...).

    Attributes:
        name: file name. kind: what it holds (``"rng"``, ``"scheduler"``...).
        rank: the rank it belongs to, for per-rank files. size: bytes.
    """

    name: str
    kind: str
    rank: int | None
    size: int


@dataclass(frozen=True)
class CheckpointLayout:
    """What a checkpoint path holds.

    Attributes:
        path: the path given.
        style: ``"dcp"`` (a single DCP folder), ``"accelerate"``, ``"hf-trainer"``,
            ``"verl"``, ``"hf-storage"`` (torch's ``HuggingFaceStorageWriter``),
            ``"lightning"``, ``"torchtune"`` or ``"torchtitan"``.
        parts: the DCP folders (or sets of per-rank files), models first, then
            optimizers, then others.
        side_files: the recognized files beside them.
        other_files: names of anything else in the folder.
    """

    path: Place
    style: str
    parts: tuple[DcpPart, ...]
    side_files: tuple[SideFile, ...]
    other_files: tuple[str, ...]

    def files_of(self, kind: str) -> list[SideFile]:
        return [f for f in self.side_files if f.kind == kind]


class _Entry:
    """One entry of a folder as the layout sees it: a link that stays inside is what it
    leads to (a linked model folder is a model folder); one out (``out``) is never followed."""

    def __init__(self, entry: storage.Entry, folder: Place) -> None:
        self.path, self.name, self._entry = entry.path, entry.name, entry
        self.out = storage_paths.leads_out(folder, entry.name) if entry.is_link else None

    def is_dir(self) -> bool:
        return self._entry.is_dir or (self._entry.is_link and self.out is None and
                                      self.path.is_dir())

    def size(self) -> int:
        if self.out is not None:
            return 0  # never followed: the layout refuses it where it would read it
        return storage.size(self.path) if self._entry.is_link else self._entry.size


def _scan(folder: Place) -> list[_Entry]:
    """The entries of ``folder``, sorted by name, each link judged."""
    return [_Entry(e, folder) for e in storage.entries(folder)]


def _read_by_name(name: str) -> bool:
    """Whether the layout reads an entry called ``name``: a part folder, a nested
    checkpoint, a side file, Lightning's ``meta.pt``."""
    return bool(_MODEL_DIR.match(name) or _OPTIMIZER_DIR.match(name) or
                _CHECKPOINT_DIR.match(name) or name in (METADATA_FILE, TRAINER_META) or
                any(pattern.match(name) for pattern, _kind in _SIDE_FILES))


def _refuse_out(root: Place, links: Iterable[tuple[str, Place | None]]) -> None:
    for name, out in links:
        if out is not None and _read_by_name(name):
            raise storage_paths.link_refusal(root / name, out, root, _CONTAINED)


def refuse_links_out(root: Place) -> None:
    """Refuse ``root`` when a part folder, nested checkpoint or side file in it is a link
    leading out (as :func:`find_layout` does, for readers that open them by name).

    Raises:
        NotACheckpointError: one line naming the link and where it leads.
    """
    _refuse_out(root, storage_paths.links_out(root))


def _classify_dir(path: Place) -> DcpPart | None:
    name = path.name
    complete = (path / METADATA_FILE).is_file()
    if match := _MODEL_DIR.match(name):
        return DcpPart(name, "model", int(match.group(2)), path, complete)
    if match := _OPTIMIZER_DIR.match(name):
        return DcpPart(name, "optimizer", int(match.group(1)), path, complete)
    if complete or any(e.name.endswith(".distcp") for e in _scan(path)):
        return DcpPart(name, "dcp", None, path, complete)
    return None


def _holds_checkpoint(path: Place) -> bool:
    try:
        return any(e.is_dir() and (_MODEL_DIR.match(e.name) or _OPTIMIZER_DIR.match(e.name))
                   for e in _scan(path))
    except RemoteStorageError:
        raise
    except OSError:
        return False


def unfinished_save(folder: Place) -> bool:
    """Whether ``folder`` is what a ``save_state`` that did not finish left: its intent
    marker and no manifest (the commit; training/_remote.py).

    Asked of any folder, not only of one on object storage, where such saves commit: no
    local save writes the marker (it renames a finished folder into place), so a local
    folder holding it is a copy of a remote save cut short, as unfinished as the original.
    """
    return (folder / INCOMPLETE).is_file() and not (folder / _MANIFEST).is_file()


def refuse_unfinished_save(root: Place) -> None:
    """Refuse a checkpoint folder, or a DCP folder inside one, that a save did not finish:
    the one refusal of ``load_state``, the readers and the CLI.

    Raises:
        NotACheckpointError: it holds ``.fsdpckpt-incomplete`` and no ``fsdpckpt.json``.
    """
    folders = [root]
    if _MODEL_DIR.match(root.name) or _OPTIMIZER_DIR.match(root.name):
        folders.append(root.parent)  # a DCP folder of a checkpoint: its save's marker
    for folder in folders:
        if unfinished_save(folder):
            raise UnfinishedSaveError(
                f"{folder}: a save into it did not finish (it holds {INCOMPLETE} and no "
                f"{_MANIFEST}), so it is not a checkpoint; use an earlier one. On object "
                "storage the next CheckpointManager on its parent deletes it")


def _is_finished(path: Place) -> bool:
    """Whether a checkpoint folder's save finished: every DCP folder in it has ``.metadata``."""
    if unfinished_save(path):
        return False
    if (path / METADATA_FILE).is_file():
        return True
    try:
        dirs = [e for e in _scan(path) if e.is_dir() and
                (_MODEL_DIR.match(e.name) or _OPTIMIZER_DIR.match(e.name))]
    except RemoteStorageError:
        raise
    except OSError:
        return False
    return bool(dirs) and all((e.path / METADATA_FILE).is_file() for e in dirs)


def _several_checkpoints(root: Place, names: list[str]) -> NotACheckpointError:
    finished = [n for n in names if not STAGING.match(n) and _is_finished(root / n)]
    return several_checkpoints(root, names, finished)


def refuse_rank_file(path: Place, *, whole: bool = True, fix: str = "") -> None:
    """Refuse ``path`` when it is one file of a sharded checkpoint, given where a whole
    checkpoint or a full file is wanted: every verb asks this before it reads a file.

    A ``*.distcp`` file, a per-rank ``torch.save`` file (Accelerate's ``use_dcp=False``,
    VeRL: :func:`~fsdpckpt.dcp._perrank.find_rank_sets`), any file in a folder holding
    ``.metadata``: by names and one stat, before torch takes it for a damaged archive.

    Args:
        whole: name the whole checkpoint folder to pass (an Accelerate checkpoint above
            ``pytorch_model_fsdp_0/``), not the DCP folder itself (``merge-weights`` wants
            the DCP folder). fix: the advice instead of "pass the folder: ..." (``{folder}``
            is replaced by that folder).

    Raises:
        NotACheckpointError: one line naming the file and the folder to pass.
    """
    folder, name = path.parent, path.name
    if name.endswith(".distcp") or find_rank_sets([name]):
        what = "a rank file"
    elif name == METADATA_FILE:
        what = "the metadata file"
    elif not name.endswith((".safetensors", ".index.json")) and \
            (folder / METADATA_FILE).is_file():  # full weights are never kept in a DCP folder
        what = "a file"
    else:
        return
    target = folder.parent if whole and (_MODEL_DIR.match(folder.name) or
                                         _OPTIMIZER_DIR.match(folder.name)) else folder
    raise rank_file_refusal(path, what, folder, target, fix.replace("{folder}", str(target)))


def one_checkpoint(path: str | os.PathLike[str] | Place) -> Place | None:
    """The checkpoint a run folder stands for when it holds exactly one, whose save
    finished, and no unfinished save (``run/`` holding ``step-2/`` alone: ``run/step-2``);
    else None, and every verb says what ``path`` is as before. What ``list`` and
    CheckpointManager read is the run folder itself, never this."""
    try:
        find_layout(path)
    except CheckpointNotFoundError:
        return None  # said by the verb, with whatever else it finds wrong
    except NotACheckpointError as exc:
        root = location(path)
        # Beside an unfinished save the refusal stands: it says what the save left.
        if len(exc.checkpoints) == 1 and _is_finished(root / exc.checkpoints[0]) and \
                not any(STAGING.match(name) for name in storage.names(root)):
            return root / exc.checkpoints[0]
    return None


def _side_file(entry: _Entry) -> SideFile | None:
    for pattern, kind in _SIDE_FILES:
        if match := pattern.match(entry.name):
            digits = [g for g in match.groups() if g and g.isdigit()]
            rank = int(digits[0]) if digits and kind == "rng" else None
            if kind == "dataloader" and match.group("rank"):  # Accelerate's own name: shared
                rank = int(match.group("rank"))
            return SideFile(entry.name, kind, rank, entry.size())
    return None


def find_layout(path: str | os.PathLike[str] | Place) -> CheckpointLayout:
    """Name the parts of the checkpoint at ``path``.

    Args:
        path: a single DCP folder, or a checkpoint folder in Accelerate's or HF Trainer's layout;
            local, or a URL on object storage (``s3://bucket/run/checkpoint-100``).

    Returns:
        The :class:`CheckpointLayout`.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        NotACheckpointError: ``path`` is a file, an empty folder, or holds no checkpoint;
            for a folder of checkpoints the message lists them.
    """
    root = location(path)
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such file or folder; check the path.")
    if not root.is_dir():
        refuse_rank_file(root)
        raise NotACheckpointError(
            f"{root}: is a file, not a checkpoint folder; pass the folder that holds "
            ".metadata or pytorch_model_fsdp_0/.")
    refuse_unfinished_save(root)
    if (root / METADATA_FILE).is_file():
        if trainer := trainer_of(root):
            return _trainer_layout(root, trainer)
        return CheckpointLayout(root, "dcp", (DcpPart(root.name, "dcp", None, root, True),), (), ())

    entries = _scan(root)
    if not entries:
        raise NotACheckpointError(f"{root}: the folder is empty; pass a checkpoint folder.")
    _refuse_out(root, [(e.name, e.out) for e in entries])
    parts, side, other, nested = [], [], [], []
    for entry in entries:
        if entry.is_dir():
            part = _classify_dir(entry.path)
            if part and part.kind == "dcp" and part.complete and trainer_of(entry.path):
                nested.append(entry.name)  # a trainer's save is a whole checkpoint
            elif part:
                parts.append(part)
            elif _CHECKPOINT_DIR.match(entry.name) or (entry.path / METADATA_FILE).exists():
                nested.append(entry.name)
            else:
                other.append(entry.name + "/")
        elif entry.name.endswith(".distcp"):
            other.append(entry.name)
        elif found := _side_file(entry):
            side.append(found)
        else:
            other.append(entry.name)
    # A sub-folder that is itself a whole checkpoint makes this a folder of checkpoints,
    # whatever the names: list them all rather than treat one DCP folder as the checkpoint.
    nested += [e.name for e in entries if e.is_dir() and _holds_checkpoint(e.path)]
    if len(parts) > 1 and all(p.kind == "dcp" for p in parts):
        # Several DCP folders beside no model or optimizer folder: each one is a checkpoint
        # (a Lightning ckpts/ of *.ckpt/ folders, a torchtune output of epoch_N/ folders).
        nested += [p.name for p in parts]
    if nested:
        nested = list(set(nested) | {p.name for p in parts if p.kind == "dcp"})
        parts = []
    # Per-rank torch.save files (Accelerate use_dcp=False, VeRL): one part per set, read by
    # dcp/_perrank.py as a DCP folder.
    rank_sets = [] if nested else find_rank_sets(other)
    style = "verl" if any(r.style == "verl" for r in rank_sets) else None
    for rank_set in rank_sets:
        parts.append(DcpPart(rank_set.name, rank_set.kind, rank_set.index, root, True))
        other = [n for n in other if n not in rank_set.files.values()]
    if style == "verl" and VERL_HF_DIR in other:
        # VeRL's copy of the model's config and tokenizer, which export-hf takes as its base.
        hf_dir = root / VERL_HF_DIR.rstrip("/")
        side.append(SideFile(VERL_HF_DIR, "hf_config", None,
                             sum(e.size() for e in _scan(hf_dir) if not e.is_dir())))
        other.remove(VERL_HF_DIR)
    # Safetensors files of torch's HuggingFaceStorageWriter: one part, read by
    # dcp/_hfstorage.py as a DCP folder.
    saved = None if nested or parts else find_hf_storage(root, other)
    if saved:
        parts.append(DcpPart(saved.name, "model", None, root, True))
        other = [n for n in other if n not in saved.files and n != saved.index]
        style = "hf-storage"
    if not parts:
        if nested:
            raise _several_checkpoints(root, nested)
        if any(name.endswith(".distcp") for name in other):
            raise UnfinishedSaveError(
                f"{root}: has .distcp data files but no .metadata, so the save never finished "
                "(DCP writes .metadata last); use an earlier checkpoint.")
        refuse_model_folder(root, other)
        raise NotACheckpointError(
            f"{root}: no checkpoint here (no .metadata, no pytorch_model_fsdp_0/ or "
            "optimizer_0/); pass a DCP folder or an Accelerate checkpoint folder.")
    order = {"model": 0, "optimizer": 1, "state": 2, "dcp": 3}
    parts.sort(key=lambda p: (order[p.kind], p.index if p.index is not None else -1, p.name))
    hf = any(f.name in ("trainer_state.json", "scheduler.pt") or f.name.startswith("rng_state")
             for f in side)
    return CheckpointLayout(root, style or ("hf-trainer" if hf else "accelerate"), tuple(parts),
                            tuple(side), tuple(other))


def _trainer_layout(root: Place, trainer: str) -> CheckpointLayout:
    """A trainer's single DCP folder: its model, optimizer and training state as three parts
    of the one folder, Lightning's ``meta.pt`` as a side file."""
    parts = tuple(DcpPart(f"{trainer}:{role}", role, None, root, True) for role in ROLES)
    side, other = [], []
    entries = _scan(root)
    _refuse_out(root, [(e.name, e.out) for e in entries])
    for entry in entries:
        if entry.name == TRAINER_META and not entry.is_dir():
            side.append(SideFile(entry.name, "trainer_meta", None, entry.size()))
        elif entry.name != METADATA_FILE and not entry.name.endswith(".distcp"):
            other.append(entry.name + "/" if entry.is_dir() else entry.name)
    return CheckpointLayout(root, trainer, parts, tuple(side), tuple(other))
