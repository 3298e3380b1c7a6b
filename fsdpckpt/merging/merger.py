"""Merging a sharded checkpoint into one file (or HF-style shards): the public verbs.

:func:`merge` is fsdpckpt's own, with every option; :func:`merge_fsdp_weights`
has Accelerate's exact signature and output names, so switching is one word.
Both stream: tensor bytes go from the rank files to their final offsets without
the state dict ever being held in memory.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt._io.jsonio import parse_json
from fsdpckpt.dcp.checks import check_folder
from fsdpckpt.dcp.layout import DcpPart, find_layout
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from fsdpckpt.merging.plan import MergePlan, MergePlanError, parse_dtype, parse_size, plan_merge
from fsdpckpt.merging.writer import (
    OutputExistsError,
    commit,
    output_paths,
    sigterm_interrupts,
    staging,
    write_plan,
)

__all__ = ["merge", "merge_fsdp_weights", "MergeResult", "resolve_folders", "parse_dtype"]


@dataclass(frozen=True)
class MergeResult:
    """What one merge wrote.

    Attributes:
        source: the DCP folder merged.
        files: the output files (for shards, the index last).
        tensors: tensors written. bytes: tensor bytes written.
        objects: names of the non-tensor entries kept. seconds: wall time.
    """

    source: Path
    files: tuple[Path, ...]
    tensors: int
    bytes: int
    objects: tuple[str, ...]
    seconds: float

    @property
    def path(self) -> Path:
        """The file to load: the single output, or the shard index."""
        return self.files[-1]


def resolve_folders(checkpoint: str | os.PathLike[str], *, optimizer: bool = False,
                    model_index: int | None = None) -> list[DcpPart]:
    """The DCP folders a merge of ``checkpoint`` means.

    A DCP folder means itself. A whole checkpoint means its model folder (the one
    numbered ``model_index`` when there are several), plus its optimizer folder
    with ``optimizer=True``. A folder holding only an optimizer means that.

    Raises:
        NotACheckpointError: the choice is ambiguous or absent; the message lists
            the folders to pass.
    """
    layout = find_layout(checkpoint)
    if layout.style == "dcp":
        return list(layout.parts)
    incomplete = [p for p in layout.parts if not p.complete]
    models = [p for p in layout.parts if p.kind == "model"]
    optimizers = [p for p in layout.parts if p.kind == "optimizer"]
    choose = ", ".join(str(p.path) for p in layout.parts)
    if model_index is not None:
        models = [p for p in models if p.index == model_index]
        optimizers = [p for p in optimizers if p.index == model_index]
        if not models:
            raise NotACheckpointError(f"{layout.path}: no pytorch_model_fsdp_{model_index}/; "
                                      f"it holds {choose}")
    if len(models) > 1:
        raise NotACheckpointError(f"{layout.path}: holds {len(models)} models; choose one with "
                                  f"--model-index, or pass one of: {choose}")
    if not models and len(optimizers) == 1 and not optimizer:
        chosen = optimizers
    elif not models:
        raise NotACheckpointError(f"{layout.path}: has no model folder to merge; pass one of: "
                                  f"{choose}")
    else:
        chosen = models + (optimizers[:1] if optimizer else [])
        if optimizer and not optimizers:
            raise NotACheckpointError(f"{layout.path}: has no optimizer folder to merge")
    for part in chosen:
        if part in incomplete:
            raise NotACheckpointError(f"{part.path}: no .metadata, so this save never finished; "
                                      "use an earlier checkpoint")
    return chosen


def _stem(part: DcpPart, plan_keys: Sequence[tuple]) -> str:
    if part.kind == "optimizer" or (plan_keys and all(k and k[0] == "optimizer"
                                                      for k in plan_keys)):
        return "optimizer"
    return "model"


def merge(checkpoint: str | os.PathLike[str], output_dir: str | os.PathLike[str], *,
          optimizer: bool = False, model_index: int | None = None, format: str = "safetensors",
          dtype: str | None = None, max_shard_size: str | int | None = None,
          keep_keys: bool = False, include: Sequence[str] = (), exclude: Sequence[str] = (),
          overwrite: bool = False, file_name: str | None = None,
          progress: Callable[[int, int], Callable[[int], None]] | None = None,
          ) -> list[MergeResult]:
    """Merge a sharded checkpoint into single files in ``output_dir``.

    Args:
        checkpoint: a DCP folder, or a whole checkpoint folder (Accelerate's layout).
        output_dir: where to write; created if missing.
        optimizer: also merge the checkpoint's optimizer folder (to ``optimizer.*``).
        model_index: which model of a checkpoint with several (``pytorch_model_fsdp_{i}``).
        format: ``"safetensors"`` (default) or ``"bin"``.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: convert floating-point tensors.
        max_shard_size: e.g. ``"5GB"``: HF-style shards plus an index file (one file
            without an index when everything fits in one shard).
        keep_keys: keep wrapper segments such as ``_fsdp_wrapped_module.`` in names.
        include, exclude: glob filters on output names.
        overwrite: replace the output of an earlier merge into ``output_dir``: the
            files this merge writes, and the single file, index and shards an earlier
            one wrote under the same stem. Other files are never touched.
        file_name: the single output file's name, instead of ``model.safetensors``...
        progress: ``progress(total_bytes, files)`` returns a callback given byte counts.

    Returns:
        One :class:`MergeResult` per DCP folder merged.

    Raises:
        NotACheckpointError, CheckpointNotFoundError, UnsafePickleError: bad input.
        MergePlanError: the options cannot apply (the message lists every reason).
        OutputExistsError: an output file exists and ``overwrite`` is False.
        DiskFullError: not enough free space.

    Example:
        >>> fsdpckpt.merge("ckpt", "out", dtype="bf16", max_shard_size="5GB")
    """
    out = Path(output_dir)
    include = [include] if isinstance(include, str) else list(include)
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    errors: list[Exception] = []

    def attempt(step: Callable[[], Any]) -> Any:  # every problem with the options, at once
        try:
            return step()
        except (MergePlanError, NotACheckpointError, CheckpointNotFoundError) as exc:
            errors.append(exc)
            return None

    export = attempt(lambda: parse_dtype(dtype))
    limit = attempt(lambda: parse_size(max_shard_size)) if max_shard_size is not None else None
    parts = attempt(lambda: resolve_folders(checkpoint, optimizer=optimizer,
                                            model_index=model_index))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise MergePlanError("; ".join(map(str, errors)))
    plans: list[MergePlan] = []
    for part in parts or []:
        folder = read_dcp_folder(part.path)
        problems = check_folder(folder)
        if problems:  # fail before writing, from metadata and file sizes alone
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"{problems[0]}{more}; run `fsdpckpt inspect "
                                         f"{folder.path}` for the full list")
        keys = [t.key_path for t in folder.metadata.tensors]
        plans.append(plan_merge(folder, format=format, dtype=export, clean_keys=not keep_keys,
                                include=include, exclude=exclude, max_shard_size=limit,
                                stem=_stem(part, keys), file_name=file_name))
    targets = [p for plan in plans for p in output_paths(plan, out)]
    if len(set(targets)) != len(targets):
        raise MergePlanError(f"two merged parts would both write {targets[0].name}; "
                             "drop --file-name")
    # An earlier merge of ours in another layout (one file against shards, or more shards)
    # would sit beside the new one, and loaders prefer the single file: it counts as an
    # existing output, and is replaced with it.
    stale = sorted({p for plan in plans for p in _earlier_outputs(plan, out)} - set(targets))
    existing = [str(p) for p in targets if p.exists()] + [str(p) for p in stale]
    if existing and not overwrite:
        raise OutputExistsError(f"{existing[0]}: already exists"
                                + (f" (and {len(existing) - 1} more)" if len(existing) > 1 else "")
                                + "; pass overwrite=True (--overwrite) to replace it, or "
                                "choose another folder")
    if out.exists() and not out.is_dir():
        raise NotACheckpointError(f"{out}: is a file; pass a folder for the output.")
    results = []
    # SIGTERM (a job scheduler, `kill`) unwinds like Ctrl-C, so the staging folder goes too.
    with sigterm_interrupts(), staging(out) as stage:
        staged = []
        for plan in plans:
            start = time.perf_counter()
            callback = progress(plan.tensor_bytes, len(plan.files)) if progress else None
            written = write_plan(plan, stage, progress=callback)
            staged.append((plan, written, time.perf_counter() - start))
        for plan, written, seconds in staged:
            final = commit(written, out)
            results.append(MergeResult(plan.folder.path, tuple(final), plan.num_tensors,
                                       plan.tensor_bytes, tuple(o.name for o in plan.objects),
                                       seconds))
        for path in stale:  # only now that the new output is in place
            path.unlink(missing_ok=True)
    return results


_INDEX_LIMIT = 64 * 2**20  # an index of 64 MiB would list millions of tensors: not one of ours


def _earlier_outputs(plan: MergePlan, out: Path) -> list[Path]:
    """The files in ``out`` that an earlier merge under this plan's stem wrote.

    Those are the single file (``model.safetensors``, or the plan's own file name), the
    index (``model.safetensors.index.json``), and the shards that index names, when they
    carry our shard names (``model-00001-of-00003.safetensors``). Files that merely look
    alike (``model-v2-of-llama.safetensors``) are not ours and never touched.
    """
    if not out.is_dir():
        return []
    names = {f"{plan.stem}.{plan.suffix}"}
    if plan.index_name is None:
        names.add(plan.files[0].name)
    index = out / f"{plan.stem}.{plan.suffix}.index.json"
    found = [out / n for n in names if (out / n).is_file()]
    if index.is_file():
        found.append(index)
        shard = re.compile(rf"{re.escape(plan.stem)}-\d{{5,}}-of-\d{{5,}}\.{plan.suffix}")
        found += [out / n for n in _index_files(index) if shard.fullmatch(n) and
                  (out / n).is_file()]
    return found


def _index_files(index: Path) -> list[str]:
    # A damaged or foreign index names nothing we may delete; the index itself is still ours.
    try:
        if index.stat().st_size > _INDEX_LIMIT:
            return []
        weight_map = parse_json(index.read_bytes()).get("weight_map", {})
        return sorted({n for n in weight_map.values() if isinstance(n, str)})
    except (OSError, ValueError, AttributeError):  # parse_json's every failure is a ValueError
        return []


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False, *, overwrite: bool = True,
                       progress: Callable[[int, int], Callable[[int], None]] | None = None,
                       ) -> Path:
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

    Returns:
        The path of the merged file.

    Example:
        >>> merge_fsdp_weights("ckpt/pytorch_model_fsdp_0", "merged")
    """
    layout = find_layout(checkpoint_dir)
    if len(layout.parts) > 1:
        # Accelerate's command merges one DCP folder; guessing which would surprise.
        choices = " or ".join(str(p.path) for p in layout.parts)
        raise NotACheckpointError(f"{layout.path}: holds {len(layout.parts)} DCP folders; "
                                  f"pass one of them: {choices}")
    fmt = "safetensors" if safe_serialization else "bin"
    # No file name: the plan names it (model.safetensors, pytorch_model.bin, optimizer.*).
    (result,) = merge(checkpoint_dir, output_path, format=fmt, keep_keys=True,
                      overwrite=overwrite, progress=progress)
    if remove_checkpoint_dir:
        shutil.rmtree(result.source)
    return result.path
