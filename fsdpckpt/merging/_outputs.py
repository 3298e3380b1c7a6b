"""The output side of the plan stage: which files a merge will write and which it replaces.

Input: the :class:`MergePlan` of every folder merged, the output folder and ``overwrite``.
Output: the earlier outputs of ours that the commit stage removes once the new files are
in place (:func:`claim_outputs`). It reads the output folder's listing (and an earlier
index, bounded), never the sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fsdpckpt.errors import MergePlanError, NotACheckpointError, OutputExistsError
from fsdpckpt.formats._shards import read_shard_index
from fsdpckpt.merging.plan import MergePlan
from fsdpckpt.merging.writer import output_paths

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath
    from fsdpckpt.formats import OutputFormat

__all__ = ["claim_outputs", "earlier_files", "earlier_outputs"]

#: A local folder or one on object storage: the checks below ask both the same questions.
_P = TypeVar("_P", "Path", "RemotePath")


def claim_outputs(plans: Sequence[MergePlan], out: _P, *, overwrite: bool) -> tuple[_P, ...]:
    """Check that the plans may write into ``out``; return the earlier outputs to remove.

    An earlier merge of ours in another layout (one file against shards, or more shards)
    would sit beside the new one, and loaders prefer the single file: it counts as an
    existing output, and is replaced with it.

    Raises:
        MergePlanError: two plans would write one file.
        OutputExistsError: an output exists (or an earlier one would be replaced) and
            ``overwrite`` is False.
    """
    targets = [p for plan in plans for p in output_paths(plan, out)]
    if len(set(targets)) != len(targets):
        raise MergePlanError(f"two merged parts would both write {targets[0].name}; "
                             "leave out file_name=, which names the one file of a single "
                             "part's merge")
    stale = sorted({p for plan in plans for p in earlier_outputs(plan, out)} - set(targets),
                   key=str)
    existing = [str(p) for p in targets if p.exists()] + [str(p) for p in stale]
    if existing and not overwrite:
        # The parameter, and the flag beside it: tests/test_export_hf.py pins "--overwrite" on
        # this error from export_hf; the command line says the flag alone (_cli_common.FLAGS).
        raise OutputExistsError(f"{existing[0]}: already exists"
                                + (f" (and {len(existing) - 1} more)" if len(existing) > 1 else "")
                                + "; pass overwrite=True (--overwrite) to replace it, or "
                                "choose another folder")
    return tuple(stale)


def earlier_outputs(plan: MergePlan, out: _P) -> list[_P]:
    """The files in ``out`` that an earlier merge under this plan's stem wrote.

    Those are the single file (``model.safetensors``, or the plan's own file name), the
    index (``model.safetensors.index.json``), and the shards that index names, when they
    carry our shard names (``model-00001-of-00003.safetensors``). Files that merely look
    alike (``model-v2-of-llama.safetensors``) are not ours and never touched.
    """
    if not out.is_dir():
        return []
    own = out / plan.files[0].name
    found = earlier_files(out, plan.format, plan.stem)
    if plan.index_name is None and own.is_file() and own not in found:
        found.insert(0, own)
    return found


def earlier_files(out: _P, fmt: OutputFormat, stem: str) -> list[_P]:
    """The files of an earlier output of ``fmt`` under ``stem`` in ``out``: its single file,
    its index and the shards the index names with our shard names."""
    if not out.is_dir():
        return []
    found = [out / fmt.single_file_name(stem)]
    found = [p for p in found if p.is_file()]
    index = out / fmt.index_file_name(stem)
    if index.is_file():
        found.append(index)
        found += [out / n for n in _index_files(index) if fmt.is_shard_file_name(stem, n)
                  and (out / n).is_file()]
    return found


def _index_files(index: Path | RemotePath) -> list[str]:
    # A damaged or foreign index (one naming a file outside the folder included) names
    # nothing we may delete; the index itself is still ours.
    try:
        return sorted(read_shard_index(index).names)
    except (NotACheckpointError, OSError):
        return []
