"""Trainers that save model, optimizer and training state into one DCP folder.

- Lightning 2.6 (``FSDPStrategy`` with ``state_dict_type="sharded"``, Fabric's
  ``save``): a ``*.ckpt/`` folder, ``model.*`` and ``optimizer.*`` or ``optimizer_{i}.*``
  entries, and ``meta.pt`` beside ``.metadata`` (a ``torch.save`` of the loops, callbacks
  and LR schedulers' state; :mod:`fsdpckpt.dcp._sidefiles` decodes it through the allowlist).
- torchtune 0.6 (``DistributedCheckpointer``): ``dist_epoch_{N}/`` with ``model.*``,
  ``optimizer.*`` and the training state (``seed``, ``epochs_run``, ``dataloader.*``...).
- torchtitan 0.3 (``CheckpointManager``): ``step-{N}/`` with the model's keys at the top
  level beside ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*`` and ``train_state.*``.

Each such folder is one DCP folder read as three parts, the model, the optimizer and the
training state: a part is the folder's entries whose top-level key the trainer gives that
role. The part's name (``"lightning:model"``...) says which; :func:`select_part` cuts a
folder read whole down to it, so every verb that opens parts reads the model alone.

Lightning's own consolidation (``python -m lightning.fabric.utilities.consolidate_checkpoint``,
its ``_load_distributed_checkpoint``) is the whole DCP folder with ``meta.pt``'s entries put
at the top level over it (``checkpoint.update(meta)``): :func:`trainer_meta` reads those
entries and :func:`with_trainer_meta` puts them there the same way, for
``load_full_state_dict`` and ``diff``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._objects import to_torch
from fsdpckpt.dcp._sidefiles import read_state_file, state_kind
from fsdpckpt.dcp.reader import DcpFolder

__all__ = ["TRAINER_META", "ROLES", "trainer_of", "trainer_style", "select_part", "trainer_meta",
           "with_trainer_meta"]

#: Lightning's file of non-tensor state beside the DCP files of a sharded checkpoint.
TRAINER_META = "meta.pt"
#: The parts of a trainer's folder, in the order the layout lists them.
ROLES = ("model", "optimizer", "state")

_TORCHTUNE_DIR = re.compile(r"^dist_epoch_\d+$")
_TORCHTITAN_DIR = re.compile(r"^step-\d+$")
_OPTIMIZER_KEY = re.compile(r"^optimizer(_\d+)?$")
#: torchtitan's non-model entries; every other top-level key is a model weight.
_TORCHTITAN_STATE = ("lr_scheduler", "dataloader", "train_state")
_PART_NAME = re.compile(r"^(lightning|torchtune|torchtitan):(model|optimizer|state)$")


def trainer_style(root: Place, *, has_meta: bool) -> str | None:
    """Which trainer wrote the DCP folder ``root`` (which holds ``.metadata``), from its
    name alone, or None for a DCP folder of no known trainer.

    Args:
        root: the folder. has_meta: whether it holds Lightning's ``meta.pt``.
    """
    if has_meta:
        return "lightning"
    if _TORCHTUNE_DIR.match(root.name):
        return "torchtune"
    if _TORCHTITAN_DIR.match(root.name):
        return "torchtitan"
    return None


def trainer_of(root: Place) -> str | None:
    """:func:`trainer_style` of the DCP folder ``root``, asking the storage about ``meta.pt``.

    Example:
        >>> trainer_of(location("ckpts/epoch=0-step=3.ckpt"))
        'lightning'
    """
    return trainer_style(root, has_meta=(root / TRAINER_META).is_file())


def _role(style: str, key_path: tuple, name: str) -> str:
    """The role of an entry (its key path, its name) in a ``style`` folder."""
    # The first dotted segment: a key saved flat ("dataloader.dp_rank_0") has the role of
    # the same key saved nested.
    top = (str(key_path[0]) if key_path else name).split(".", 1)[0]
    if _OPTIMIZER_KEY.match(top):
        return "optimizer"
    if style == "torchtitan":
        return "state" if top in _TORCHTITAN_STATE else "model"
    return "model" if top == "model" else "state"


def select_part(folder: DcpFolder, path: Place, name: str) -> DcpFolder:
    """``folder`` (read whole from ``path``) cut down to the part ``name`` names; any other
    name leaves it whole.

    A folder whose own name is ``name`` is a DCP folder of its own, never a part of one.
    """
    match = _PART_NAME.match(name)
    if match is None or path.name == name:
        return folder
    style, role = match.groups()
    meta = folder.metadata
    tensors = tuple(t for t in meta.tensors if _role(style, t.key_path, t.name) == role)
    objects = tuple(o for o in meta.objects if _role(style, o.key_path, o.name) == role)
    return dataclasses.replace(folder, metadata=dataclasses.replace(
        meta, tensors=tensors, objects=objects))


def trainer_meta(root: Place) -> dict[Any, Any] | None:
    """The entries of Lightning's ``meta.pt`` in the folder ``root``, decoded through the
    allowlist (:func:`~fsdpckpt.dcp._sidefiles.read_state_file`: nothing is run; tensors in it
    become torch's, bit for bit), or None when ``root`` holds no ``meta.pt``.

    Raises:
        UnsafePickleError: it names a global outside the allowlist.
        NotACheckpointError: it is empty, damaged, nested too deep, or no dict.

    Example:
        >>> trainer_meta(location("ckpts/epoch=0-step=3.ckpt"))["global_step"]
        3
    """
    path = root / TRAINER_META
    if not path.is_file():
        return None
    return dict(to_torch(read_state_file(path, state_kind("trainer_meta"))))


def with_trainer_meta(state: dict[Any, Any], meta: dict[Any, Any]) -> dict[Any, Any]:
    """``state`` (a Lightning folder's DCP entries, nested) with ``meta``'s entries put at the
    top level over it, as Lightning's ``_load_distributed_checkpoint`` does
    (``checkpoint.update(meta)``: an entry of ``meta`` replaces a DCP entry of its name).

    Example:
        >>> with_trainer_meta({"model": {...}}, {"epoch": 1})
        {'model': {...}, 'epoch': 1}
    """
    state.update(meta)
    return state
