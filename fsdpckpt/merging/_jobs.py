"""What flows between the merge's stages, and the commit that ends them.

The plan stage returns a :class:`MergeJob`, the write stage a :class:`StagedPlan` per plan,
and the commit stage a :class:`MergeResult` per plan. These types live here, below the
driver (:mod:`~fsdpckpt.merging.merger`) and below every output strategy (local, object
storage, spread over ranks), so that each strategy imports them and none imports the driver.
A :class:`MergeResult` is made in one place, :func:`merge_result`, whichever strategy
wrote the files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpckpt.merging._dtype_policy import KeptDtypes
from fsdpckpt.merging.plan import MergePlan
from fsdpckpt.merging.writer import commit

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

__all__ = ["MergeResult", "MergeJob", "StagedPlan", "merge_result", "commit_job"]


@dataclass(frozen=True)
class MergeResult:
    """What one merge wrote.

    Attributes:
        source: the DCP folder merged.
        files: the output files (for shards, the index last).
        tensors: tensors written. bytes: tensor bytes written.
        objects: names of the non-tensor entries kept. seconds: wall time.
        kept_dtype: the optimizer tensors that kept their stored dtype though a cast was
            asked (``--dtype`` casts the model, ``--optimizer-dtype`` the optimizer's
            moments; counters never), or None.
    """

    source: Path | RemotePath
    files: tuple[Path | RemotePath, ...]
    tensors: int
    bytes: int
    objects: tuple[str, ...]
    seconds: float
    kept_dtype: KeptDtypes | None = None

    @property
    def path(self) -> Path | RemotePath:
        """The file to load: the single output, or the shard index."""
        return self.files[-1]

    def to_json(self) -> dict[str, Any]:
        """One of the ``outputs`` ``fsdpckpt merge --json`` prints."""
        doc = {"source": str(self.source), "files": [str(f) for f in self.files],
               "tensors": self.tensors, "bytes": self.bytes, "objects": list(self.objects),
               "seconds": round(self.seconds, 3)}
        if self.kept_dtype:  # only where a cast left something as stored
            doc["kept_dtype"] = self.kept_dtype.to_json()
        return doc


@dataclass(frozen=True)
class MergeJob:
    """The plan stage's output: everything the write and commit stages do.

    Attributes:
        plans: one plan per DCP folder merged, in order.
        output_dir: the output folder (not a file; created by the write stage).
        replaced: earlier outputs of ours in another layout, removed at commit.
    """

    plans: tuple[MergePlan, ...]
    output_dir: Path
    replaced: tuple[Path, ...]


@dataclass(frozen=True)
class StagedPlan:
    """The write stage's output for one plan: its files in the staging folder, the index last."""

    plan: MergePlan
    files: tuple[Path, ...]
    seconds: float


def merge_result(plan: MergePlan, files: Sequence[Path | RemotePath], seconds: float
                 ) -> MergeResult:
    """The result of ``plan`` once its ``files`` (the index last) are in place."""
    return MergeResult(plan.folder.path, tuple(files), plan.num_tensors, plan.tensor_bytes,
                       tuple(o.name for o in plan.objects), seconds, plan.kept_dtype)


def commit_job(job: MergeJob, staged: Sequence[StagedPlan]) -> list[MergeResult]:
    """The commit stage: rename every staged file into place, then remove the earlier
    outputs the new ones replace (only now that they are in place)."""
    results = [merge_result(item.plan, commit(list(item.files), job.output_dir), item.seconds)
               for item in staged]
    for path in job.replaced:
        path.unlink(missing_ok=True)
    return results
