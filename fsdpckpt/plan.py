"""Planning a merge from metadata alone: what goes in which output file, and where.

:func:`plan_merge` names every output tensor, picks its dtype, assigns it to a
file (HF-style shards when a size limit is given) and validates everything a
user could get wrong, raising once with every problem, before a byte is
written. :func:`chunk_runs` says where a chunk's elements land in its tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .dtypes import DType
from .errors import FsdpCkptError
from .formats import TensorSpec, get_format
from .keys import output_name, select, shares_top_key
from .metadata import Chunk, ObjectEntry, TensorEntry
from .reader import DcpFolder

__all__ = ["MergePlanError", "PlannedTensor", "PlannedObject", "PlannedFile", "MergePlan",
           "plan_merge", "chunk_runs", "parse_size"]


class MergePlanError(FsdpCkptError, ValueError):
    """The merge as asked cannot be done; the message lists every reason."""


@dataclass(frozen=True)
class PlannedTensor:
    """An output tensor and the stored tensor it comes from."""

    spec: TensorSpec
    source: TensorEntry


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
        format: the output format name.
        files: the output files; objects are written into the first.
        objects: the non-tensor entries kept.
        nested: whether key paths must be kept to rebuild the nesting (optimizer state).
        index_name: the HF index file (``model.safetensors.index.json``) when sharded.
    """

    folder: DcpFolder
    format: str
    files: tuple[PlannedFile, ...]
    objects: tuple[PlannedObject, ...]
    nested: bool
    index_name: str | None

    @property
    def tensor_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def num_tensors(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    def index(self) -> dict:
        """The HF index document (``metadata.total_size`` and ``weight_map``)."""
        return {"metadata": {"total_size": self.tensor_bytes},
                "weight_map": {t.spec.name: f.name for f in self.files for t in f.tensors}}


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as transformers reads them; ``GiB`` binary)."""
    if isinstance(text, int):
        return text
    value = text.strip().upper().replace(" ", "")
    number = value.rstrip("KMGTIB")
    unit = value[len(number):]
    try:
        size = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise MergePlanError(f"cannot read the size {text!r}; write it like 5GB, 500MB or 2GiB") \
            from None
    if size <= 0:
        raise MergePlanError(f"the size {text!r} must be positive")
    return size


def chunk_runs(shape: Sequence[int], chunk: Chunk) -> tuple[int, list[int]]:
    """Where a chunk's elements land in its row-major tensor.

    Returns:
        ``(run, starts)``: the chunk, read in row-major order, is ``len(starts)``
        runs of ``run`` consecutive elements; run ``i`` starts at element
        ``starts[i]`` of the tensor. One run means a single contiguous copy.
    """
    ndim = len(shape)
    if ndim == 0:
        return 1, [0]
    stride = [math.prod(shape[d + 1:]) for d in range(ndim)]
    k = ndim - 1  # the outermost dim of the contiguous run: all dims after it are whole
    while k > 0 and chunk.sizes[k] == shape[k]:
        k -= 1
    run = math.prod(chunk.sizes[k:])
    base = sum(o * s for o, s in zip(chunk.offsets, stride))
    starts = [base]
    for d in range(k - 1, -1, -1):  # each outer dim repeats the runs found so far
        starts = [s + i * stride[d] for i in range(chunk.sizes[d]) for s in starts]
    return run, sorted(starts) if run else []


def _shard(tensors: list[PlannedTensor], limit: int | None) -> list[list[PlannedTensor]]:
    # transformers' rule: fill shards in order; a tensor that would overflow starts a new one.
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if limit is not None and shards[-1] and size + tensor.spec.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.spec.nbytes
    return shards


def _iter_duplicates(names: Sequence[str]) -> Iterator[str]:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            yield name
        seen.add(name)


def plan_merge(folder: DcpFolder, *, format: str = "safetensors", dtype: DType | None = None,
               clean_keys: bool = True, include: Sequence[str] = (),
               exclude: Sequence[str] = (), max_shard_size: int | None = None,
               stem: str = "model", file_name: str | None = None) -> MergePlan:
    """Plan the merge of ``folder`` into one file, or HF-style shards.

    Args:
        folder: the DCP folder to merge.
        format: ``"safetensors"`` or ``"bin"``.
        dtype: convert floating-point tensors to this dtype; others keep theirs.
        clean_keys: drop wrapper segments (``_fsdp_wrapped_module.``...) from names.
        include, exclude: glob filters on output names.
        max_shard_size: split into files of at most this many bytes of tensor data.
        stem: base of the file names (``model`` gives ``model.safetensors``,
            ``model-00001-of-00002.safetensors``).
        file_name: the single file's name, overriding the stem's.

    Returns:
        The :class:`MergePlan`.

    Raises:
        MergePlanError: listing every problem (colliding names, nothing selected,
            dtypes the format cannot hold, an unknown format).
    """
    try:
        fmt = get_format(format)
    except ValueError as exc:
        raise MergePlanError(str(exc)) from None
    meta = folder.metadata
    entries = list(meta.tensors) + list(meta.objects)
    strip = shares_top_key([e.key_path for e in entries])
    names = [output_name(e.key_path, strip_top=strip, clean=clean_keys) for e in entries]
    problems = [f"two entries would both be named '{n}'; pass --keep-keys to keep the stored "
                "names" for n in dict.fromkeys(_iter_duplicates(names))]
    tensors, objects = [], []
    for entry, name in zip(entries, names):
        if not select(name, include=include, exclude=exclude):
            continue
        key_path = tuple(entry.key_path[1:] if strip else entry.key_path)
        if isinstance(entry, ObjectEntry):
            objects.append(PlannedObject(name, entry, key_path))
            continue
        out = dtype if dtype is not None and entry.dtype.is_floating else entry.dtype
        if fmt.name == "safetensors" and out.safetensors is None:
            problems.append(f"tensor '{entry.name}' is {out.name}, which safetensors cannot "
                            "hold; use --format bin")
        tensors.append(PlannedTensor(TensorSpec(name, key_path, out, entry.shape), entry))
    if not tensors and not problems:
        problems.append(f"no tensor left to merge in {folder.path}"
                        + (" after --include/--exclude" if include or exclude else ""))
    if problems:
        raise MergePlanError(f"cannot merge {folder.path}: " + "; ".join(problems))
    nested = any(len(t.spec.key_path) > 1 for t in tensors) or \
        any(len(o.key_path) > 1 for o in objects)
    shards = _shard(tensors, max_shard_size)
    suffix = {"safetensors": "safetensors", "bin": "bin"}[fmt.name]
    if fmt.name == "bin" and stem == "model":
        stem = "pytorch_model"  # HF's name for torch.save weights
    if len(shards) == 1 and max_shard_size is None:
        files = (PlannedFile(file_name or f"{stem}.{suffix}", tuple(shards[0])),)
        index_name = None
    else:
        files = tuple(PlannedFile(f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}", tuple(s))
                      for i, s in enumerate(shards, 1))
        index_name = f"{stem}.{suffix}.index.json"
    return MergePlan(folder, fmt.name, files, tuple(objects), nested, index_name)
