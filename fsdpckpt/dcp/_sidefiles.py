"""The files saved beside a checkpoint's DCP folders, decoded by the one reader ``load_state`` uses.

``scheduler.bin`` (``scheduler_{i}.bin``, HF Trainer's ``scheduler.pt``), ``scaler.pt``,
``custom_checkpoint_{i}.pkl``, a dataloader's ``dl_state_dict*.bin`` and Lightning's
``meta.pt`` are ``torch.save``
archives of a ``state_dict()``: :func:`read_state_file` decodes them through the allowlist
of non-tensor entries (plain Python values and tensors, :mod:`fsdpckpt.dcp._objects`), never
``torch.load``. RNG files are decoded by :mod:`fsdpckpt.dcp._rngfile`.
``fsdpckpt.load_state`` reads every one of them this way; :func:`check_side_files` runs the
same readers for ``inspect`` and ``verify``, so a side file that a full disk left empty or
cut short is reported before a resume trips over it. Files fsdpckpt never loads
(Accelerate's ``sampler.bin``, HF Trainer's ``training_args.bin``, VeRL's extra state)
pickle objects of their own classes: their archive is checked (its directory, and each
entry's CRC-32), not unpickled. Stray temporary files (``fsdpckpt.json.tmp``...) are named:
a save that did not finish left them.
"""

from __future__ import annotations

import zipfile
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._archive import read_archive_with_tensors
from fsdpckpt.dcp._objects import _OBJECT_GLOBALS, TensorValue, check_plain_value
from fsdpckpt.dcp._rngfile import open_side_file, read_rng_archive, rng_fields, side_file_size
from fsdpckpt.dcp._ziparchive import open_archive, read_entry
from fsdpckpt.dcp.checks import Problem
from fsdpckpt.errors import (
    ChecksumError,
    FsdpCkptError,
    NotACheckpointError,
    UnsafePickleError,
)

__all__ = ["read_state_file", "check_side_files", "stray_temporaries", "state_kind",
           "MAX_CHECKED_BYTES"]

#: Side files up to this size are decoded whole by ``inspect`` and ``verify`` (a scheduler's
#: or scaler's state is a few KB); a larger one (a custom state holding weights) has its
#: archive's directory checked only, so checking stays bounded in memory.
MAX_CHECKED_BYTES = 64 * 2**20

#: What each kind of side file holds, in messages.
_STATE_KINDS = {
    "scheduler": "scheduler state",
    "scaler": "scaler state",
    "custom": "custom checkpoint state",
    "dataloader": "dataloader state",
    # Lightning's meta.pt: plain dicts and lists (loops, callbacks, LR schedulers).
    "trainer_meta": "Lightning trainer state",
}


def state_kind(kind: str) -> str:
    """What a side file of ``kind`` (a :class:`~fsdpckpt.dcp.layout.SideFile`'s) holds, in
    messages: ``"Lightning trainer state"`` for ``"trainer_meta"``."""
    return _STATE_KINDS.get(kind, kind.replace("_", " "))


#: Side files fsdpckpt never loads: their archive is checked, not unpickled.
_ARCHIVE_KINDS = ("sampler", "training_args", "extra_state")


def _size(path: Place, what: str) -> int:
    size = side_file_size(path, what)
    if size == 0:
        raise NotACheckpointError(
            f"{path}: is empty (0 bytes), not a {what} file: the save "
            "that wrote it did not finish (a full disk?); use an earlier "
            "checkpoint, or delete the file to resume without it"
        )
    return size


def _one_line(path: Place, what: str, exc: Exception) -> FsdpCkptError:
    text = " ".join(str(exc).split())
    if isinstance(exc, UnsafePickleError):
        return exc if text == str(exc) else UnsafePickleError(text)
    if isinstance(exc, ChecksumError):  # damage, said as such (the bytes are not the saved ones)
        return exc if text == str(exc) else ChecksumError(text)
    if isinstance(exc, FsdpCkptError):  # the archive reader's too: one class, as for RNG files
        return NotACheckpointError(text)
    return NotACheckpointError(
        f"{path}: not a readable {what} file ({type(exc).__name__}: {text[:200]}); it is "
        "damaged (cut short by a full disk?) or not a torch.save file. Use an earlier "
        "checkpoint, or delete the file to resume without it"
    )


def read_state_file(path: Place, what: str = "state") -> Any:
    """Decode a ``torch.save`` of a state dict (scheduler, scaler, custom state), never
    running anything from it.

    Tensors in it become :class:`~fsdpckpt.dcp._objects.TensorValue`
    (:func:`~fsdpckpt.dcp._objects.to_torch` makes them real).

    Args:
        path: the file, local or remote.
        what: what it holds, for messages (``"scheduler state"``); unless ``"state"``, the
            value must be a dict, as every ``state_dict()`` is.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        UnsafePickleError: the pickle names a global outside the allowlist (nothing ran).
        NotACheckpointError: the file is empty, cut short, damaged, or holds no state dict;
            one line naming it.
    """
    size = _size(path, what)
    try:
        with open_side_file(path) as file:
            value = read_archive_with_tensors(
                file, 0, size, source=str(path), allowed=_OBJECT_GLOBALS, make_tensor=TensorValue
            )
        check_plain_value(value, source=str(path), size=size)
    except Exception as exc:  # noqa: BLE001 - any failure on damaged bytes is one line
        raise _one_line(path, what, exc) from None
    if what != "state" and not isinstance(value, dict):  # a state_dict() is always a dict
        raise NotACheckpointError(
            f"{path}: holds a {type(value).__name__}, not a {what}; the "
            "file is damaged or not the one saved with this checkpoint"
        )
    return value


def _check_archive(path: Place, what: str) -> None:
    """The archive of a file fsdpckpt never loads: its directory, and (up to
    :data:`MAX_CHECKED_BYTES`) every entry against its CRC-32."""
    size = _size(path, what)
    try:
        with open_side_file(path) as file, open_archive(file, 0, size, str(path)) as archive:
            if size <= MAX_CHECKED_BYTES:
                for info in archive.infolist():
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise NotACheckpointError(
                            f"{path}: the archive entry {info.filename[:80]!r} is compressed, "
                            "which torch.save never writes"
                        )
                    read_entry(archive, info, source=str(path), start=0)
    except Exception as exc:  # noqa: BLE001 - one line
        raise _one_line(path, what, exc) from None


def _check_one(path: Place, kind: str) -> None:
    if kind == "rng" and _size(path, "RNG state"):
        rng_fields(read_rng_archive(path), path, build=False)
    elif kind in _STATE_KINDS and _size(path, _STATE_KINDS[kind]) <= MAX_CHECKED_BYTES:
        read_state_file(path, _STATE_KINDS[kind])
    elif kind in _STATE_KINDS or kind in _ARCHIVE_KINDS:
        _check_archive(path, state_kind(kind))


def check_side_files(root: Place, files: Any) -> list[Problem]:
    """Decode each side file as ``load_state`` would; one :class:`Problem` per file that fails.

    Args:
        root: the checkpoint folder.
        files: its :class:`~fsdpckpt.dcp.layout.SideFile` entries.
    """
    import warnings

    problems = []
    for side in files:
        path = root / side.name
        try:
            with warnings.catch_warnings():  # "numpy is not installed": a load's concern
                warnings.simplefilter("ignore")
                _check_one(path, side.kind)
        except FsdpCkptError as exc:
            message = str(exc)
            prefix = f"{path}: "
            problems.append(
                Problem(
                    str(path), message[len(prefix) :] if message.startswith(prefix) else message
                )
            )
    return problems


def stray_temporaries(root: Place, other_files: tuple[str, ...]) -> list[Problem]:
    """The temporary files (``*.tmp``) among ``other_files``: a save that did not finish."""
    return [
        Problem(
            str(root / name),
            "stray temporary file: a save that did not finish left "
            "it (a full disk, a crash), so this folder is not a committed checkpoint; "
            "use an earlier checkpoint, or save again",
        )
        for name in other_files
        if name.endswith(".tmp") or name.endswith(".tmp/")
    ]
