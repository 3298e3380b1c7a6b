"""Accelerate's layout of a training checkpoint: which file or folder holds what.

``pytorch_model_fsdp_{i}/`` and ``optimizer_{i}/`` (DCP folders), ``scheduler.bin``
(``scheduler_{i}.bin`` from the second on; HF Trainer's ``scheduler.pt`` is read too),
``scaler.pt``, ``random_states_{rank}.pkl``, ``custom_checkpoint_{i}.pkl``, and fsdpckpt's
``fsdpckpt.json``. Using Accelerate's names lets ``accelerator.load_state`` read what
fsdpckpt saves, and fsdpckpt read what Accelerate saves.

How a save into a folder commits depends on where the folder is: :func:`commits_by_marker`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp.layout import refuse_rank_file
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

__all__ = ["commits_by_marker", "model_folder", "optimizer_folder", "scheduler_file",
           "remove_stale_parts", "check_parts"]


def commits_by_marker(root: Place) -> bool:
    """Whether a save into ``root`` commits by its manifest appearing, under the intent
    marker of :mod:`fsdpckpt.training._remote` (docs/remote-training.md), rather than in a
    local folder it prepares and cleans up itself.

    Policy, so it is asked here, once for the package, of the storage seam's one capability
    that differs (:func:`~fsdpckpt._io.storage.commits_by_rename`): where a folder cannot
    be renamed into place (object storage), the manifest written last is the only commit
    there is. Such a save needs its manifest, starts with the intent marker, and a failed
    one is left for the sweep; a local save prepares its folder and removes what a failed
    one wrote.
    """
    return not storage.commits_by_rename(root)


def model_folder(root: Place, i: int) -> Any:
    return root / f"pytorch_model_fsdp_{i}"


def optimizer_folder(root: Place, i: int) -> Any:
    return root / f"optimizer_{i}"


def scheduler_file(root: Place, i: int, *, reading: bool = False) -> Any:
    name = "scheduler.bin" if i == 0 else f"scheduler_{i}.bin"
    if reading and i == 0 and not (root / name).exists() and (root / "scheduler.pt").exists():
        return root / "scheduler.pt"  # HF Trainer's name
    return root / name


_PART_PATTERNS = ("pytorch_model_fsdp_*", "optimizer_*", "random_states_*.pkl", "scheduler*.bin",
                  "scaler.pt", "custom_checkpoint_*.pkl", "dl_state_dict*.bin", "fsdpckpt.json")


def checkpoint_parts(root: Place) -> list[str]:
    """The names in ``root`` that are parts of a checkpoint (model and optimizer folders,
    side files, the manifest), sorted; none when it is no folder."""
    import fnmatch

    return [name for name in storage.names(root)
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in _PART_PATTERNS)]


def remove_stale_parts(root: Path) -> None:
    # Saving into a folder that holds an older checkpoint must not leave parts of the old
    # one beside the new (an optimizer saved then, and not now, would be loaded later).
    # A local folder only: a save that commits by a marker empties its folder first.
    for pattern in _PART_PATTERNS:
        for path in root.glob(pattern):
            storage.remove(path, strict=True)


def check_parts(root: Place, models: list, optimizers: list,
                schedulers: list) -> None:
    """Refuse a load before it starts when a part asked for is not in ``root``."""
    if root.is_file():
        refuse_rank_file(root)
        raise NotACheckpointError(f"{root}: is a file; pass the checkpoint folder save_state "
                                  "wrote.")
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such checkpoint folder; check the path.")
    problems = []
    for i in range(len(models)):
        if not (model_folder(root, i) / ".metadata").is_file():
            problems.append(f"{model_folder(root, i).name}/ (model {i})")
    for i in range(len(optimizers)):
        if not (optimizer_folder(root, i) / ".metadata").is_file():
            problems.append(f"{optimizer_folder(root, i).name}/ (optimizer {i})")
    for i in range(len(schedulers)):
        if not scheduler_file(root, i, reading=True).is_file():
            problems.append(f"{scheduler_file(root, i).name} (scheduler {i})")
    if problems:
        kind = "is not a checkpoint" if not any(root.iterdir()) or not any(
            (root / n).exists() for n in ("pytorch_model_fsdp_0", "optimizer_0")) else "lacks"
        message = (f"{root}: {kind}: missing " + ", ".join(problems) +
                   "; pass only the parts it was saved with, or the right folder")
        raise (NotACheckpointError if kind.startswith("is not") else CheckpointNotFoundError)(
            message)
