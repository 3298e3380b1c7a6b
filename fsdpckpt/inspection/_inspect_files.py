"""``inspect`` of what ``diff`` reads besides checkpoints: a ``.safetensors`` or ``.bin`` file,
a shard index, or a folder holding a merged or Hugging Face model.

Each file is opened by the reader ``diff`` uses (:func:`fsdpckpt.inspection._diff_files.
open_source`: safetensors headers parsed and checked, torch-free; ``torch.save`` files through
torch's weights-only loader), and drawn as one part per model file found: every tensor whole
in its file, so there are no chunks to tile and no world size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from fsdpckpt._io import storage
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp.metadata import DataFile, ObjectEntry
from fsdpckpt.inspection._diff_files import open_source
from fsdpckpt.inspection._diff_sources import MERGED_FILES
from fsdpckpt.inspection._hf_files import split_hf_files
from fsdpckpt.inspection.report import InspectReport, PartReport, TensorReport
from fsdpckpt.merging._convert_source import shards

__all__ = ["MODEL_FILE_STYLES", "model_files_in", "inspect_model_files"]

#: ``InspectReport.style`` of a report of model files, by what was given.
MODEL_FILE_STYLES = ("model-file", "model-folder")


def model_files_in(folder: Place) -> list[Place]:
    """The model files of a folder that holds a merged or Hugging Face model: the first of
    each kind's :data:`MERGED_FILES` (model, then optimizer) found; none for another folder."""
    found = []
    for names in MERGED_FILES.values():
        found += [folder / name for name in names if (folder / name).is_file()][:1]
    return found


def _kind(file: Place) -> str:
    return "optimizer" if file.name.startswith("optimizer") else "model"


def _part(file: Place, shown: str, keep: Callable[[str], bool]) -> PartReport:
    files = shards(file)
    with open_source(file, keep_keys=True) as source:  # names as stored, as inspect shows
        tensors = list(source.tensors.values())
        objects = source.object_names()
    data = tuple(DataFile(str(f.name), storage.size(f)) for f in files)
    return PartReport(
        shown, _kind(file), None, file, True,
        world_size=1,
        bytes=sum(f.size for f in data),
        tensor_bytes=sum(t.numel * t.dtype.itemsize for t in tensors),
        num_tensors=len(tensors),
        num_objects=len(objects),
        dtypes=dict(Counter(t.dtype.name for t in tensors).most_common()),
        files=data,
        tensors=tuple(TensorReport(t.name, t.dtype, t.shape, t.numel * t.dtype.itemsize,
                                   "whole", ()) for t in tensors if keep(t.name)),
        objects=tuple(ObjectEntry(n, files[0].name, 0, 0, (n,)) for n in objects if keep(n)),
    )


def inspect_model_files(path: Place, files: list[Place],
                        keep: Callable[[str], bool]) -> InspectReport:
    """The report of ``files`` (model files, from ``path``: one of them, or their folder).

    Args:
        path: what was given: a file, or the folder that holds ``files``.
        files: the model files to describe (a weight file or a shard index each).
        keep: which tensor and object names to list.

    Returns:
        An :class:`InspectReport` of style ``"model-file"`` or ``"model-folder"``, one part
        per file.

    Raises:
        CorruptCheckpointError, NotACheckpointError, CheckpointNotFoundError: a file cannot
            be read (a cut-short header, a shard the index names missing).

    Example:
        >>> inspect_model_files(Path("out"), [Path("out/model.safetensors")], lambda n: True)
    """
    parts = tuple(_part(f, f.name, keep) for f in files)
    # A model folder's config, tokenizer and processor (what export-hf copies), listed.
    hf_files = split_hf_files(path, [p.name for p in path.iterdir()])[0] \
        if path.is_dir() else ()
    return InspectReport(
        path=path, style=MODEL_FILE_STYLES[path.is_dir()], world_size=1, world_size_exact=True,
        bytes=sum(p.bytes for p in parts) + sum(f.size for f in hf_files), parts=parts,
        side_files=hf_files, other_files=(), problems=())
