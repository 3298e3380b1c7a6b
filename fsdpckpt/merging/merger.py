"""Merging a sharded checkpoint into one file (or HF-style shards): the public verbs.

:func:`merge` is fsdpckpt's own, with every option; :func:`merge_fsdp_weights`
has Accelerate's exact signature and output names, so switching is one word.
Both stream: tensor bytes go from the rank files to their final offsets without
the state dict ever being held in memory.

:func:`merge` is a driver over four one-way stages, each plain data in and out:

1. validate (:func:`~fsdpckpt.merging._validate.validate_merge`): options and sources
   -> :class:`~fsdpckpt.merging._validate.MergeRequest`;
2. plan (:func:`plan_job`): request -> :class:`MergeJob` (one
   :class:`~fsdpckpt.merging.plan.MergePlan` per folder, from metadata alone, and the
   earlier outputs it replaces);
3. write (:func:`write_job`): job -> a :class:`StagedPlan` per plan, in a staging folder;
4. commit (:func:`commit_job`): staged files -> their final names, one
   :class:`MergeResult` per folder.

The types between the stages, and the commit, are in :mod:`fsdpckpt.merging._jobs`, below
the output strategies; :func:`run_job` picks the strategy (local, object storage, spread
over ranks), once, for both verbs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fsdpckpt._io import storage
from fsdpckpt._io.publish import files_into
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
from fsdpckpt._progress import ProgressFactory
from fsdpckpt.dcp.layout import find_layout
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.merging._jobs import MergeJob, MergeResult, StagedPlan, commit_job
from fsdpckpt.merging._outputs import claim_outputs
from fsdpckpt.merging._remote_out import COMMIT, publish_results
from fsdpckpt.merging._validate import MergeRequest, resolve_folders, validate_merge
from fsdpckpt.merging.plan import parse_dtype, plan_merge
from fsdpckpt.merging.writer import sigterm_interrupts, staging, write_plan

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

# MergeResult, MergeJob, StagedPlan and commit_job live in merging/_jobs.py, below every
# output strategy; they are named here too, where they have always been imported from.
__all__ = ["merge", "merge_fsdp_weights", "MergeResult", "resolve_folders", "parse_dtype",
           "MergeJob", "StagedPlan", "plan_job", "write_job", "commit_job", "run_job"]


def plan_job(request: MergeRequest) -> MergeJob:
    """The plan stage: a :class:`MergePlan` per source, from metadata alone, and the
    output files claimed (:func:`~fsdpckpt.merging._outputs.claim_outputs`).

    Raises:
        MergePlanError: the options cannot apply to a folder, or two plans collide.
        OutputExistsError: an output exists and ``overwrite`` was not given.
    """
    opts = request.options
    plans = tuple(plan_merge(source.folder, format=opts.format, dtype=opts.dtype,
                             optimizer_dtype=opts.optimizer_dtype, kind=source.kind,
                             clean_keys=opts.clean_keys, include=opts.include,
                             exclude=opts.exclude, max_shard_size=opts.max_shard_size,
                             stem=source.kind, file_name=opts.file_name)
                  for source in request.sources)
    replaced = claim_outputs(plans, request.output_dir, overwrite=opts.overwrite)
    return MergeJob(plans, request.output_dir, replaced)


def write_job(job: MergeJob, stage: Path, progress: ProgressFactory | None = None
              ) -> list[StagedPlan]:
    """The write stage: every plan of ``job`` into the staging folder ``stage``.

    Raises:
        DiskFullError: the file system cannot hold the output.
        CorruptCheckpointError, CheckpointNotFoundError: a data file is damaged or missing.
    """
    staged = []
    for plan in job.plans:
        start = time.perf_counter()
        callback = progress(plan.tensor_bytes, len(plan.files)) if progress else None
        written = write_plan(plan, stage, progress=callback)
        staged.append(StagedPlan(plan, tuple(written), time.perf_counter() - start))
    return staged


def merge(checkpoint: str | os.PathLike[str], output_dir: str | os.PathLike[str], *,
          optimizer: bool = False, model_index: int | None = None, format: str = "safetensors",
          dtype: str | None = None, optimizer_dtype: str | None = None,
          max_shard_size: str | int | None = None, keep_keys: bool = False,
          include: Sequence[str] = (), exclude: Sequence[str] = (),
          overwrite: bool = False, file_name: str | None = None,
          progress: ProgressFactory | None = None, process_group: Any = None,
          storage_options: dict[str, Any] | None = None,
          ) -> list[MergeResult]:
    """Merge a sharded checkpoint into single files in ``output_dir``.

    Args:
        checkpoint: a DCP folder, or a whole checkpoint folder (Accelerate's layout).
        output_dir: where to write; created if missing.
        optimizer: also merge the checkpoint's optimizer folder (to ``optimizer.*``).
        model_index: which model of a checkpoint with several (``pytorch_model_fsdp_{i}``).
        format: ``"safetensors"`` (default) or ``"bin"``.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: convert the model's floating-point
            tensors. An optimizer's keep their stored dtype (a merged optimizer is one to
            resume from).
        optimizer_dtype: the same, for the optimizer's moments (``exp_avg``, ``exp_avg_sq``,
            momentum buffers). Step counters and 0-dimensional scalars are never cast: bf16
            holds integers exactly only up to 256. Each :class:`MergeResult`'s
            ``kept_dtype`` names what kept its dtype.
        max_shard_size: e.g. ``"5GB"``: HF-style shards plus an index file (one file
            without an index when everything fits in one shard).
        keep_keys: keep wrapper segments such as ``_fsdp_wrapped_module.`` in names.
        include, exclude: glob filters, each matched against the output name (``0.weight``)
            and the stored name (``model.0.weight``): either matching selects an entry.
        overwrite: replace the output of an earlier merge into ``output_dir``: the
            files this merge writes, and the single file, index and shards an earlier
            one wrote under the same stem. Other files are never touched.
        file_name: the single output file's name, instead of ``model.safetensors``...
        progress: ``progress(total_bytes, files)`` returns a callback given byte counts.
            Spread over ranks, each rank's is called with that rank's share.
        storage_options: for URLs (``s3://``...) in ``checkpoint`` or ``output_dir``: the
            fsspec filesystem's options; None: the backend's defaults (``AWS_*`` variables,
            ``~/.aws``...). A remote ``output_dir`` is merged in ``$TMPDIR`` and uploaded
            file by file, the index last (docs/remote.md).
        process_group: spread the merge over the ranks of this ``torch.distributed``
            group (``torch.distributed.group.WORLD`` for all; gloo works on CPU): every
            rank calls ``merge`` with the same arguments, writes its share of the output
            files (balanced by bytes) into a staging folder that ``output_dir`` must hold
            on a file system all ranks see, and rank 0 writes the index and commits. The
            output is byte for byte the single-process one; a failure on any rank fails
            every rank and leaves nothing. None (default): this process does it all.

    Returns:
        One :class:`MergeResult` per DCP folder merged (the same on every rank).

    Raises:
        NotACheckpointError, CheckpointNotFoundError, UnsafePickleError: bad input.
        MergePlanError: the options cannot apply (the message lists every reason).
        OptionError: ``optimizer`` or ``optimizer_dtype`` given, and no optimizer to merge
            (a model folder given alone: the message names the checkpoint folder to pass).
        OutputExistsError: an output file exists and ``overwrite`` is False.
        DiskFullError: not enough free space.
        FsdpCkptError: spread over ranks, another rank failed (the message names it).

    Example:
        >>> fsdpckpt.merge("ckpt", "out", dtype="bf16", max_shard_size="5GB")
    """
    def plan(into: Path) -> MergeJob:
        source = location(checkpoint, storage_options=storage_options)
        return plan_job(validate_merge(source, into, optimizer=optimizer,
                                       model_index=model_index, format=format, dtype=dtype,
                                       optimizer_dtype=optimizer_dtype,
                                       max_shard_size=max_shard_size, keep_keys=keep_keys,
                                       include=include, exclude=exclude, overwrite=overwrite,
                                       file_name=file_name))

    return run_job(location(output_dir, storage_options=storage_options), plan,
                   overwrite=overwrite, progress=progress, process_group=process_group)


def run_job(out: Place, plan: Callable[[Path], MergeJob], *, overwrite: bool,
            progress: ProgressFactory | None, process_group: Any = None) -> list[MergeResult]:
    """The write and commit stages of the job ``plan(folder)`` returns, for the output folder
    ``out``: the one place that chooses how the output is written.

    - one process: written into a staging folder, renamed in, then published into ``out``
      (:func:`fsdpckpt._io.publish.files_into`): locally that folder is inside ``out``
      and the renames are the publish; on object storage it is inside a local temporary
      folder, and the files are uploaded file by file, the index last (:mod:`._remote_out`);
    - spread over the ranks of ``process_group``, local (:mod:`._distributed`) or on object
      storage (:mod:`._distributed_remote`).

    ``plan`` is called with the folder the merge writes into: ``out`` itself, or the local
    one a remote output is merged in.
    """
    if process_group is not None:
        # Imported here: only a spread merge loads them (they import torch.distributed then).
        # The one choice of strategy by the kind of place: without a shared file system the
        # ranks upload their shares themselves, and there is no common stage to rename from.
        if storage.is_remote(out):
            from fsdpckpt.merging._distributed_remote import run_spread_remote

            return run_spread_remote(cast("RemotePath", out), plan, process_group, overwrite,
                                     progress)
        from fsdpckpt.merging._distributed import agree_on, run_spread

        return run_spread(agree_on(process_group, lambda: plan(cast(Path, out))),
                          process_group, progress)
    with files_into(out, commit=COMMIT) as target:
        job = plan(target.workdir)
        # Into another folder than the one planned (a remote output): claimed there, before
        # any byte is read. Locally the plan stage claimed the same files (the same answer).
        stale = claim_outputs(job.plans, cast(Any, out), overwrite=overwrite)
        # SIGTERM (a job scheduler, `kill`) unwinds like Ctrl-C, so the staging folder goes too.
        with sigterm_interrupts():
            with staging(job.output_dir) as stage:
                results = commit_job(job, write_job(job, stage, progress))
            return publish_results(target, results, stale)


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False, *, overwrite: bool = True,
                       progress: ProgressFactory | None = None,
                       storage_options: dict[str, Any] | None = None,
                       ) -> Path | RemotePath:
    """Accelerate's ``merge_fsdp_weights``, streaming and in constant memory.

    Writes ``{output_path}/model.safetensors`` (metadata ``{"format": "pt"}``) or, with
    ``safe_serialization=False``, ``{output_path}/pytorch_model.bin``; keys are the
    stored names less the single top-level key, exactly as Accelerate writes them.
    An optimizer folder is written as ``optimizer.safetensors`` (``optimizer.bin``):
    named for what it holds. Unlike Accelerate, an optimizer folder or non-tensor
    entries do not crash the safetensors output: they are kept in its metadata.

    As Accelerate does, an existing output is replaced; here atomically: the new file is
    written under a temporary name and renamed over the old one, which stays whole until
    then.

    Args:
        checkpoint_dir: the DCP folder (``pytorch_model_fsdp_0`` or ``optimizer_0``).
        output_path: the output folder.
        safe_serialization: safetensors (True) or a torch.save ``.bin`` (False).
        remove_checkpoint_dir: delete ``checkpoint_dir`` after a successful merge.
        overwrite: replace an existing output (default, as Accelerate); False refuses.
        progress: as for :func:`merge`.
        storage_options: as for :func:`merge` (either path may be a URL).

    Returns:
        The path of the merged file.

    Example:
        >>> merge_fsdp_weights("ckpt/pytorch_model_fsdp_0", "merged")
    """
    # Read once: the validate stage takes it as found.
    layout = find_layout(location(checkpoint_dir, storage_options=storage_options))
    if len(layout.parts) > 1:
        # Accelerate's command merges one DCP folder; guessing which would surprise.
        choices = " or ".join(str(p.path) for p in layout.parts)
        raise NotACheckpointError(f"{layout.path}: holds {len(layout.parts)} DCP folders; "
                                  f"pass one of them: {choices}")
    fmt = "safetensors" if safe_serialization else "bin"

    def plan(into: Path) -> MergeJob:
        # No file name: the format names it (model.safetensors, pytorch_model.bin, optimizer.*).
        return plan_job(validate_merge(layout, into, format=fmt, keep_keys=True,
                                       overwrite=overwrite))

    (result,) = run_job(location(output_path, storage_options=storage_options), plan,
                        overwrite=overwrite, progress=progress)
    if remove_checkpoint_dir:
        storage.remove(result.source, strict=True)
    return result.path
