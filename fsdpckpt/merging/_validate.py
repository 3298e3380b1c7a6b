"""The validate stage of a merge: the options and the source, checked before anything is planned.

Input: what the caller passed to :func:`fsdpckpt.merge` (a checkpoint path, or a layout
already found, and the options). Output: a :class:`MergeRequest`, plain data: the
options parsed (the format resolved to its object, the dtype, the shard size), the
DCP folders to merge, each read once and structurally checked, with the kind of
state it holds, and the output folder, known not to be a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fsdpckpt._io.remote import RemotePath
from fsdpckpt.dcp.checks import require_whole
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.layout import CheckpointLayout, DcpPart, find_layout
from fsdpckpt.dcp.parts import open_part
from fsdpckpt.dcp.reader import DcpFolder
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    FsdpCkptError,
    MergePlanError,
    NotACheckpointError,
    OptionError,
    UnfinishedSaveError,
)
from fsdpckpt.formats import OutputFormat, get_format
from fsdpckpt.merging._dtype_policy import holds_optimizer
from fsdpckpt.merging.plan import parse_dtype, parse_size

__all__ = ["MergeOptions", "MergeSource", "MergeRequest", "validate_merge", "resolve_folders",
           "choose_parts"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class MergeOptions:
    """The options of a merge, parsed: what :func:`fsdpckpt.merging.plan.plan_merge` takes."""

    format: OutputFormat
    dtype: DType | None
    optimizer_dtype: DType | None
    max_shard_size: int | None
    clean_keys: bool
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    file_name: str | None
    overwrite: bool


@dataclass(frozen=True)
class MergeSource:
    """One DCP folder to merge, read and checked, and what it holds (``model`` or
    ``optimizer``: the stem of its output files)."""

    folder: DcpFolder
    kind: str


@dataclass(frozen=True)
class MergeRequest:
    """The validate stage's output: everything the plan stage reads."""

    sources: tuple[MergeSource, ...]
    output_dir: Path
    options: MergeOptions


def choose_parts(layout: CheckpointLayout, *, optimizer: bool = False,
                 model_index: int | None = None) -> list[DcpPart]:
    """:func:`resolve_folders` of a layout already found."""
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
            raise UnfinishedSaveError(f"{part.path}: no .metadata, so this save never finished; "
                                      "use an earlier checkpoint")
    return chosen


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
    return choose_parts(find_layout(checkpoint), optimizer=optimizer, model_index=model_index)


def _kind(part: DcpPart, folder: DcpFolder) -> str:
    keys = [t.key_path for t in folder.metadata.tensors]
    return "optimizer" if part.kind == "optimizer" or holds_optimizer(keys) else "model"


def _read_checked(part: DcpPart) -> MergeSource:
    folder = open_part(part.path, part.name)
    require_whole(folder)  # fail before writing, from metadata and file sizes alone
    return MergeSource(folder, _kind(part, folder))


def validate_merge(checkpoint: str | os.PathLike[str] | RemotePath | CheckpointLayout,
                   output_dir: str | os.PathLike[str], *, optimizer: bool = False,
                   model_index: int | None = None, format: str | OutputFormat = "safetensors",
                   dtype: Any = None, max_shard_size: str | int | None = None,
                   keep_keys: bool = False, include: Sequence[str] | str = (),
                   exclude: Sequence[str] | str = (), overwrite: bool = False,
                   file_name: str | None = None, optimizer_dtype: Any = None) -> MergeRequest:
    """The validate stage: parse the options, find and check the sources, check the output.

    Args:
        checkpoint: a path, or the :class:`CheckpointLayout` a caller already found (it
            is not read again). The rest: as for :func:`fsdpckpt.merge`.

    Returns:
        The :class:`MergeRequest`.

    Raises:
        MergePlanError: several options are wrong (the message lists every one); a single
            wrong option raises its own error (MergePlanError, NotACheckpointError,
            CheckpointNotFoundError).
        CorruptCheckpointError: a folder fails the structural checks.
        UnsafePickleError: a ``.metadata`` names what it may not.
        NotACheckpointError: ``output_dir`` is a file.
        OptionError: ``optimizer`` or ``optimizer_dtype`` given, and no optimizer to merge.
    """
    errors: list[Exception] = []

    def attempt(step: Callable[[], _T]) -> _T | None:  # every problem with the options, at once
        try:
            return step()
        except (MergePlanError, NotACheckpointError, CheckpointNotFoundError) as exc:
            errors.append(exc)
            return None

    found: list[CheckpointLayout] = []

    def layout() -> CheckpointLayout:
        found.append(checkpoint if isinstance(checkpoint, CheckpointLayout)
                     else find_layout(checkpoint))
        return found[-1]

    fmt = attempt(lambda: _format(format))
    export = attempt(lambda: parse_dtype(dtype))
    export_optimizer = attempt(lambda: parse_dtype(optimizer_dtype))
    limit = attempt(lambda: parse_size(max_shard_size)) if max_shard_size is not None else None
    parts = attempt(lambda: choose_parts(layout(), optimizer=optimizer, model_index=model_index))
    if len(errors) == 1:
        raise errors[0]
    if errors or fmt is None or parts is None:  # None only where an error was recorded
        raise MergePlanError("; ".join(map(str, errors)))
    sources = tuple(_read_checked(part) for part in parts)
    if (optimizer or export_optimizer) and not any(s.kind == "optimizer" for s in sources):
        # Asked for an optimizer there is not: refused, not a model merged in silence.
        raise _no_optimizer(sources[0].folder.path, optimizer, whole=found[0].style != "dcp")
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise NotACheckpointError(f"{out}: is a file; pass a folder for the output.")
    options = MergeOptions(fmt, export, export_optimizer, limit, not keep_keys, _globs(include),
                           _globs(exclude), file_name, overwrite)
    return MergeRequest(sources, out, options)


def _no_optimizer(model: Any, optimizer: bool, *, whole: bool) -> OptionError:
    """Why ``--optimizer``, or ``--optimizer-dtype`` without it, cannot apply to a merge of
    the model folder ``model`` alone (``whole``: of a checkpoint folder holding it), and what
    to pass: the checkpoint folder, when ``model``'s parent is one with an optimizer."""
    if whole:  # only --optimizer-dtype: a checkpoint without --optimizer merges its model
        return OptionError(f"--optimizer-dtype casts an optimizer's moments, but only the "
                           f"model ({model}) is merged; add --optimizer to merge the "
                           "optimizer too")
    try:
        optimizers = [p.path.name for p in find_layout(model.parent).parts
                      if p.kind == "optimizer"]
    except (FsdpCkptError, OSError):  # no checkpoint around it: nothing to point to
        optimizers = []
    asked = "--optimizer" if optimizer else "--optimizer-dtype"
    if optimizers:
        what = f"its {optimizers[0]}/" if len(optimizers) == 1 else "its optimizer"
        where = f"pass {model.parent} (the checkpoint folder) to merge {what} too"
    else:
        where = f"leave out {asked} to merge the model"
    return OptionError(f"{model}: is a model folder, with no optimizer in it, so {asked} "
                       f"cannot apply; {where}")


def _format(format: str | OutputFormat) -> OutputFormat:
    if isinstance(format, OutputFormat):
        return format
    try:
        return get_format(format)
    except ValueError as exc:
        raise MergePlanError(str(exc)) from None


def _globs(patterns: Sequence[str] | str) -> tuple[str, ...]:
    return (patterns,) if isinstance(patterns, str) else tuple(patterns)
