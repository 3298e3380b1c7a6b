"""The plan stage of a merge: what goes in which output file, and where, from metadata alone.

Input: a :class:`DcpFolder` (metadata read, never its data) and the options.
Output: a :class:`MergePlan`, plain data holding everything the writer needs: the
resolved :class:`OutputFormat` object, the file-name stem, every output file's name
and tensors, and for each tensor the chunk runs that say where its stored chunks'
elements land (:func:`chunk_runs`). :func:`plan_merge` validates everything a user
could get wrong, raising once with every problem, before a byte is written.

A planned tensor comes either from stored chunks (a merge: copied, cast on the way) or
from a fuser (:func:`computed_plan`: LoRA fusion, each tensor computed in turn from the
stored ones); the writer, the commit and the result are the same for both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.metadata import DcpMetadata, KeyPath, ObjectEntry, TensorEntry
from fsdpckpt.dcp.reader import DcpFolder, read_dcp_folder
from fsdpckpt.errors import MergePlanError
from fsdpckpt.formats import FORMATS, OutputFormat, TensorSpec, get_format
from fsdpckpt.formats._shards import index_document
from fsdpckpt.formats.safetensors import RESERVED_NAME
from fsdpckpt.merging._dtype_policy import DtypePolicy, KeptDtypes, holds_optimizer
from fsdpckpt.merging._keys import clean_key, no_match_hint, output_name, select, shares_top_key
from fsdpckpt.merging._parse import parse_dtype, parse_size
from fsdpckpt.merging._runs import Runs, RunStarts, chunk_runs

_T = TypeVar("_T")

__all__ = ["MergePlanError", "PlannedTensor", "PlannedObject", "PlannedFile", "MergePlan",
           "plan_merge", "chunk_runs", "RunStarts", "parse_size", "parse_dtype", "RESERVED_NAME",
           "split_shards", "TensorStream", "computed_plan", "no_metadata"]

#: A fuser, for the writer: called once, it yields each planned tensor that has no stored
#: chunks as ``(name, torch.Tensor)`` in plan order, each computed when it is reached and
#: not kept (names the plan does not hold are skipped); the others are copied.
TensorStream = Callable[[], Iterable[tuple[str, Any]]]


@dataclass(frozen=True)
class PlannedTensor:
    """An output tensor, the stored tensor it comes from, and where each of the stored
    tensor's chunks lands in it (``runs[i]`` is :func:`chunk_runs` of ``source.chunks[i]``)."""

    spec: TensorSpec
    source: TensorEntry
    runs: tuple[Runs, ...] = field(compare=False, repr=False)


@dataclass(frozen=True)
class PlannedObject:
    """A non-tensor entry kept in the output, with its output name and key path."""

    name: str
    source: ObjectEntry
    key_path: tuple


@dataclass(frozen=True)
class PlannedFile:
    """One output file: its name and its tensors, in state-dict order."""

    name: str
    tensors: tuple[PlannedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.spec.nbytes for t in self.tensors)


@dataclass(frozen=True)
class MergePlan:
    """Everything a merge will write, computed from metadata alone.

    Attributes:
        folder: the DCP folder merged.
        format: the output format, resolved: it lays out and finishes each file.
        files: the output files; objects are written into the first.
        objects: the non-tensor entries kept.
        nested: whether key paths must be kept to rebuild the nesting (optimizer state).
        index_name: the HF index file (``model.safetensors.index.json``) when sharded.
        stem: the base of the file names (``model``, ``pytorch_model``, ``optimizer``):
            the single file is ``{stem}.{suffix}``, shards ``{stem}-00001-of-00002.{suffix}``.
        fuser: None when every tensor is copied from its stored chunks; otherwise the
            tensors without stored chunks come from it, computed one at a time
            (:func:`computed_plan`).
        kept_dtype: the optimizer tensors that kept their stored dtype though a cast was
            asked (:mod:`~fsdpckpt.merging._dtype_policy`), or None.
    """

    folder: DcpFolder
    format: OutputFormat
    files: tuple[PlannedFile, ...]
    objects: tuple[PlannedObject, ...]
    nested: bool
    index_name: str | None
    stem: str = "model"
    fuser: TensorStream | None = field(default=None, compare=False, repr=False)
    kept_dtype: KeptDtypes | None = None

    @property
    def suffix(self) -> str:
        """The file name suffix of the format (``safetensors`` or ``bin``)."""
        return self.format.suffix

    @property
    def tensor_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def num_tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    def index(self) -> dict:
        """The HF index document (``metadata.total_size`` and ``weight_map``)."""
        return index_document((f.name, (t.spec for t in f.tensors)) for f in self.files)


def split_shards(items: Sequence[_T], nbytes: Callable[[_T], int],
                 limit: int | None) -> list[list[_T]]:
    """transformers' rule: fill shards in order; an item that would overflow ``limit``
    bytes starts a new one (an item larger than ``limit`` is a shard of its own)."""
    shards: list[list[_T]] = [[]]
    size = 0
    for item in items:
        n = nbytes(item)
        if limit is not None and shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def _shard(tensors: list[PlannedTensor], limit: int | None) -> list[list[PlannedTensor]]:
    return split_shards(tensors, lambda t: t.spec.nbytes, limit)


def _iter_duplicates(names: Sequence[str]) -> Iterator[str]:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            yield name
        seen.add(name)


def _output_key_path(key_path: KeyPath, *, strip: bool, clean: bool) -> KeyPath:
    # The nesting the output keeps (a .bin's dicts, the safetensors key paths): wrapper
    # segments go from it exactly as they go from the flat name, or the two would disagree.
    path = tuple(key_path[1:] if strip else key_path)
    if not clean:
        return path
    cleaned = tuple(clean_key(k) if isinstance(k, str) else k for k in path)
    return tuple(k for k in cleaned if k != "") or path


_SHOWN = 5  # conflicts named in full; the rest are counted


def _nesting_conflicts(entries: Sequence[tuple[str, KeyPath]]) -> list[str]:
    """Why the key paths cannot all be nested into one state dict (empty when they can).

    A path that is a leaf and also the parent of another (``a`` and ``a.b``) would lose
    one of the two, as would two entries with one path; a parent whose children mix list
    indices and keys cannot be built at all (DCP's own ``set_element`` fails on it).
    """
    leaves: dict[KeyPath, str] = {}
    parents: dict[KeyPath, str] = {}
    child_kind: dict[KeyPath, tuple[type, str]] = {}
    found: list[str] = []
    for name, path in entries:
        bad = [k for k in path[1:] if type(k) is int and not 0 <= k < len(entries)]
        if bad:
            # An index is a list position: past the number of entries, the list would be
            # mostly holes (and a huge index would fill memory with them).
            found.append(f"'{name}' has the list index {bad[0]} in its key path "
                         f"{list(path)}, but there are only {len(entries)} entries; the "
                         "metadata is damaged or crafted")
            continue
        if path in leaves:
            found.append(f"'{leaves[path]}' and '{name}' both have the key path {list(path)}")
        leaves.setdefault(path, name)
        for depth in range(1, len(path)):  # the root is a dict whatever its keys
            parents.setdefault(path[:depth], name)
            kind = int if type(path[depth]) is int else str
            first_kind, first = child_kind.setdefault(path[:depth], (kind, name))
            if first_kind is not kind:
                found.append(f"'{first}' and '{name}' put both a list index and a key under "
                             f"{list(path[:depth])}")
    for path, name in leaves.items():
        if path in parents:
            found.append(f"'{name}' and '{parents[path]}' conflict: '{name}' is a value and "
                         f"also the parent of '{parents[path]}', so the output could keep only "
                         "one of them")
    found = list(dict.fromkeys(found))
    if len(found) > _SHOWN:
        found = found[:_SHOWN] + [f"{len(found) - _SHOWN} more such conflicts"]
    return found


def plan_merge(folder: DcpFolder | str | os.PathLike[str], *,
               format: str | OutputFormat = "safetensors",
               dtype: DType | str | None = None, clean_keys: bool = True,
               include: Sequence[str] | str = (), exclude: Sequence[str] | str = (),
               max_shard_size: int | str | None = None, stem: str = "model",
               file_name: str | None = None, optimizer_dtype: DType | str | None = None,
               kind: str | None = None) -> MergePlan:
    """Plan the merge of ``folder`` into one file, or HF-style shards.

    Everything a user could get wrong is checked here, from metadata alone, so a
    merge that cannot produce a correct file fails before a byte is written.

    Args:
        folder: the DCP folder to merge: a :class:`DcpFolder`, or its path (str or
            PathLike), which is read with :func:`fsdpckpt.dcp.reader.read_dcp_folder`.
        format: ``"safetensors"`` or ``"bin"``, or an :class:`OutputFormat`.
        dtype: convert the model's floating-point tensors to this dtype; others keep
            theirs. A :class:`DType`, a ``torch.dtype`` or a word: ``"bf16"``, ``"fp16"``,
            ``"fp32"``, ``"bfloat16"``, ``"torch.float16"``...
        optimizer_dtype: the same for an optimizer's moments (``exp_avg``...), which
            ``dtype`` leaves as stored; step counters and 0-dimensional scalars are never
            cast (:mod:`fsdpckpt.merging._dtype_policy`).
        clean_keys: drop wrapper segments (``_fsdp_wrapped_module.``...) from names
            and from the nesting kept in the output.
        include, exclude: glob filters (one string or several), each matched against an
            entry's output name and its stored name (:func:`~fsdpckpt.merging._keys.select`).
        max_shard_size: split into files of at most this many bytes of tensor data:
            an int, or a string such as ``"5GB"`` (decimal) or ``"2GiB"`` (binary).
            When everything fits in one file, that file is ``{stem}.{suffix}`` with no
            index, as Hugging Face writes it.
        stem: what is merged, the base of the file names (``model`` gives
            ``model.safetensors``, ``model-00001-of-00002.safetensors``); the format
            may rename it (:meth:`OutputFormat.file_stem`: ``pytorch_model.bin``).
        file_name: the single file's name, overriding the stem's.
        kind: what ``folder`` holds, ``"model"`` or ``"optimizer"``; None: an optimizer
            when every entry is under the key ``optimizer``, else a model.

    Returns:
        The :class:`MergePlan`.

    Raises:
        MergePlanError: listing every problem (colliding names, names that would nest
            into each other, a tensor named ``__metadata__`` in safetensors, nothing
            selected, dtypes the format cannot hold, an unknown format, dtype or size).
        CheckpointNotFoundError, NotACheckpointError, UnsafePickleError: ``folder`` is a
            path that is not a readable DCP folder.
    """
    try:
        fmt = format if isinstance(format, OutputFormat) else get_format(format)
    except ValueError as exc:
        raise MergePlanError(str(exc)) from None
    if not isinstance(folder, DcpFolder):
        folder = read_dcp_folder(folder)
    policy = DtypePolicy(parse_dtype(dtype), parse_dtype(optimizer_dtype))
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    include = [include] if isinstance(include, str) else list(include)
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    meta = folder.metadata
    entries = list(meta.tensors) + list(meta.objects)
    if kind is None:
        kind = "optimizer" if holds_optimizer([e.key_path for e in entries]) else "model"
    strip = shares_top_key([e.key_path for e in entries])
    names = [output_name(e.key_path, strip_top=strip, clean=clean_keys) for e in entries]
    problems = [f"two entries would both be named '{n}'; pass --keep-keys to keep the stored "
                "names" for n in dict.fromkeys(_iter_duplicates(names))]
    tensors, objects = [], []
    uncoded: dict[DType, list[str]] = {}  # dtype -> tensors the format cannot hold
    kept = []  # (name, shape, dtype) of the optimizer tensors a cast asked for left alone
    for entry, name in zip(entries, names):
        if not select(name, entry.name, include=include, exclude=exclude):  # either name
            continue
        key_path = _output_key_path(entry.key_path, strip=strip, clean=clean_keys)
        if isinstance(entry, ObjectEntry):
            objects.append(PlannedObject(name, entry, key_path))
            continue
        out = policy.planned(kind, name, entry.shape, entry.dtype)
        if policy.kept(kind, entry.dtype, out):
            kept.append((name, entry.shape, entry.dtype))
        if not fmt.can_hold(out):
            uncoded.setdefault(out, []).append(entry.name)
        refused = fmt.name_problem(entry.name, name)
        if refused:
            problems.append(refused)
        runs = tuple(chunk_runs(entry.shape, chunk) for chunk in entry.chunks)
        tensors.append(PlannedTensor(TensorSpec(name, key_path, out, entry.shape), entry, runs))
    if uncoded:
        problems.append(_uncoded_problem(fmt, uncoded))
    if not problems:  # names collide already: their nesting would only say it again
        problems += _nesting_conflicts([(t.spec.name, t.spec.key_path) for t in tensors] +
                                       [(o.name, o.key_path) for o in objects])
    if not tensors and not problems:
        problems.append(f"no tensor left to merge in {folder.path}"
                        + (_selection_hint(entries, names) if include or exclude else ""))
    if problems:
        raise MergePlanError(f"cannot merge {folder.path}: " + "; ".join(problems))
    nested = any(len(t.spec.key_path) > 1 for t in tensors) or \
        any(len(o.key_path) > 1 for o in objects)
    stem = fmt.file_stem(stem)
    files, index_name = _files(fmt, stem, _shard(tensors, limit), file_name)
    return MergePlan(folder, fmt, files, tuple(objects), nested, index_name, stem,
                     kept_dtype=KeptDtypes.of(kept))


def _selection_hint(entries: Sequence[Any], names: list[str]) -> str:
    """What to try when --include/--exclude left no tensor: a few of the names there are,
    as merge writes them and as stored (either is matched)."""
    found = [(n, e.name) for e, n in zip(entries, names) if not isinstance(e, ObjectEntry)]
    hint = no_match_hint(found)
    if not found:
        return f" after --include/--exclude ({hint})"
    return (f" after --include/--exclude; {hint}: pass globs that match some of them "
            f"(--include '{found[0][0].rsplit('.', 1)[0]}.*')")


def _files(fmt: OutputFormat, stem: str, shards: list[list[PlannedTensor]],
           file_name: str | None) -> tuple[tuple[PlannedFile, ...], str | None]:
    # The output files of ``shards`` and the index's name (None: one file, no index).
    if len(shards) == 1:  # as huggingface_hub: what fits in one shard is one unindexed file
        return (PlannedFile(file_name or fmt.single_file_name(stem), tuple(shards[0])),), None
    return (tuple(PlannedFile(fmt.shard_file_name(stem, i, len(shards)), tuple(s))
                  for i, s in enumerate(shards, 1)), fmt.index_file_name(stem))


def no_metadata(path: Any) -> DcpFolder:
    """The source of a :func:`computed_plan` that is no DCP folder (a merged ``.safetensors``
    a fuser reads): its path, no metadata and no data files of its own."""
    return DcpFolder(path, DcpMetadata((), ()), ())


def computed_plan(folder: DcpFolder, specs: Sequence[TensorSpec], fuser: TensorStream, *,
                  max_shard_size: int | None = None, stem: str = "model",
                  copied: Mapping[str, TensorEntry] | None = None) -> MergePlan:
    """A plan whose tensors are computed by ``fuser`` rather than copied from stored chunks:
    ``specs`` (plain names, in the order ``fuser`` yields them; their shapes and dtypes
    known from the metadata) laid out into safetensors files split as :func:`plan_merge`
    splits them. The tensors have no stored chunks; ``folder`` is what the fuser reads.
    ``copied``: the names (of ``specs``) whose tensor is rather a stored tensor of
    ``folder`` (with chunks), copied as a merge copies it (cast to the spec's dtype).
    """
    fmt = get_format("safetensors")
    copied = copied or {}
    tensors = [PlannedTensor(s, copied[s.name], tuple(chunk_runs(copied[s.name].shape, c)
                                                       for c in copied[s.name].chunks))
               if s.name in copied else
               PlannedTensor(s, TensorEntry(s.name, s.dtype, tuple(s.shape), (), s.key_path), ())
               for s in specs]
    stem = fmt.file_stem(stem)
    files, index_name = _files(fmt, stem, _shard(tensors, max_shard_size), None)
    return MergePlan(folder, fmt, files, (), False, index_name, stem, fuser)


def _uncoded_problem(fmt: OutputFormat, uncoded: dict[DType, list[str]]) -> str:
    # One clause for them all (a dtype matrix would repeat it per tensor), naming the
    # formats that can hold every one of them.
    kinds = ", ".join(f"{dtype.name} ('{found[0]}'" + (f" and {len(found) - 1} more" if
                      len(found) > 1 else "") + ")" for dtype, found in uncoded.items())
    others = [f"--format {name}" for name, cls in FORMATS.items()
              if all(cls().can_hold(dtype) for dtype in uncoded)]
    return (f"{fmt.name} has no code for {kinds}; "
            + (f"use {' or '.join(others)}, or " if others else "")
            + "leave them out with --exclude")
