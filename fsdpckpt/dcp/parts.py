"""One way to open any checkpoint part, whatever wrote it: every verb reads every layout.

A part (a :class:`~fsdpckpt.dcp.layout.DcpPart`: a folder and the name the layout gives
it) is stored one of three ways, and each is read into the same :class:`DcpFolder` model:

- a DCP folder (``.metadata`` and ``*.distcp``): :func:`~fsdpckpt.dcp.reader.read_dcp_folder`;
- per-rank ``torch.save`` files (Accelerate ``use_dcp=False``, VeRL), named by a pattern
  such as ``pytorch_model_fsdp_0_rank*.bin``: :mod:`fsdpckpt.dcp._perrank`;
- the safetensors files of torch's ``HuggingFaceStorageWriter`` (``shard-*.safetensors``
  or ``model-*.safetensors``): :mod:`fsdpckpt.dcp._hfstorage`.

Whatever reads tensors and objects from a DCP folder (:class:`~fsdpckpt.dcp._datafiles.DataFiles`
over ``folder.path``, the chunk and object readers) then reads all three alike; callers
open parts here, never one reader or another. A new layout is added here and in
:func:`~fsdpckpt.dcp.layout.find_layout`, and every verb reads it.

Example::

    from fsdpckpt.dcp.layout import find_layout
    from fsdpckpt.dcp.parts import open_part

    for part in find_layout("ckpt/checkpoint-100").parts:
        folder = open_part(part.path, part.name)
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._hfstorage import HfStoragePart, check_hf_files, hf_part_named, read_hf_storage
from fsdpckpt.dcp._perrank import PerRankSet, check_rank_files, rank_set_named, read_rank_set
from fsdpckpt.dcp._trainers import select_part
from fsdpckpt.dcp.reader import DcpFolder, read_dcp_folder

__all__ = ["PartStorage", "find_part", "open_part", "check_part_files"]


@dataclass(frozen=True)
class PartStorage:
    """How one part is stored.

    Attributes:
        kind: ``"dcp"`` (a DCP folder of its own), ``"per-rank"`` or ``"hf-storage"``.
        rank_set: the rank files, for ``"per-rank"``.
        hf: the safetensors files, for ``"hf-storage"``.
    """

    kind: str
    rank_set: PerRankSet | None = None
    hf: HfStoragePart | None = None


def find_part(path: Place, name: str) -> PartStorage:
    """How the part ``name`` of the folder ``path`` is stored. Parts stored in files beside
    others are named by a pattern (with ``*``); any other name is a DCP folder's."""
    if "*" in name:
        hf = hf_part_named(path, name)
        if hf is not None:
            return PartStorage("hf-storage", hf=hf)
        rank_set = rank_set_named(path, name)
        if rank_set is not None:
            return PartStorage("per-rank", rank_set=rank_set)
    return PartStorage("dcp")


def open_part(path: Place, name: str) -> DcpFolder:
    """The part ``name`` of ``path`` (a :class:`~fsdpckpt.dcp.layout.DcpPart`'s ``path``
    and ``name``) read as a DCP folder: its tensors' chunks and its objects, from metadata
    or headers alone.

    Raises:
        CheckpointNotFoundError: a file of the part is missing.
        NotACheckpointError, CorruptCheckpointError, UnsafePickleError: it cannot be read.
    """
    found = find_part(path, name)
    if found.hf is not None:
        return read_hf_storage(path, found.hf)
    if found.rank_set is not None:
        return read_rank_set(path, found.rank_set)
    # A trainer's folder holds model, optimizer and training state: the part is one of them.
    return select_part(read_dcp_folder(path), path, name)


def check_part_files(path: Place, name: str) -> list[tuple[Place, str]]:
    """What is wrong with the files of a part stored in files beside others (``[]`` for a
    DCP folder, whose chunks are checked one by one): every entry of every rank file read
    against its zip CRC-32; every safetensors header read again, and every data byte
    owned by a tensor.

    Returns:
        ``(file, what is wrong)`` for each damaged file.
    """
    found = find_part(path, name)
    if found.rank_set is not None:
        return check_rank_files(path, found.rank_set)
    if found.hf is not None:
        return check_hf_files(path, found.hf)
    return []
