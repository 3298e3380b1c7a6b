"""The names ``save_pretrained`` writes, and the box of a stored tensor each one is.

transformers 5 holds some weights under other names (and shapes) than the hub files it
reads and writes: a Mixtral layer's experts are one fused ``mlp.experts.gate_up_proj``
(``[experts, 2 * intermediate, hidden]``) in memory, but ``save_pretrained`` writes
``block_sparse_moe.experts.N.w1.weight`` and ``w3`` (and ``w2`` from ``down_proj``); Qwen
MoE writes ``mlp.experts.N.gate_proj.weight``...; LLaVA holds ``model.language_model.*``
and writes ``language_model.model.*``. The rules are transformers' own checkpoint-conversion
mapping (``conversion_mapping.py``), never a table kept here: :func:`saved_layout` runs
transformers' ``revert_weight_conversion`` (what ``save_pretrained`` runs) over the meta
device's state dict of the config's model class, with copies made by ``contiguous()``
kept as views, so each tensor it gives back is a view of one model key, whose storage
offset, shape and strides say which box of that key it is. A conversion that computes
rather than cuts (a concatenation on save, an interleave) is not a box: then the names are
written as stored, and the export says so.

:func:`hub_names` turns a checkpoint's names into what the export writes: a key under its
in-memory name (a transformers 5 run) is cut into its hub pieces, a key already under its
hub name (a transformers 4 run's per-expert names) is written as it is, and whatever the
checkpoint holds, the result must be exactly the hub's names. :func:`hub_plan` plans the
writing: renames only keep the merge's copying plan, renamed; cuts become a computed plan
(:func:`~fsdpckpt.merging.plan.computed_plan`) whose tensors are read box by box from the
stored chunks (:func:`~fsdpckpt.export._tied.read_box`), so memory holds one output
tensor (one expert's matrix), never a layer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fsdpckpt import _torch
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.export._keycheck import key_problems
from fsdpckpt.export._tied import read_box
from fsdpckpt.formats import TensorSpec
from fsdpckpt.merging._jobs import MergeJob
from fsdpckpt.merging._outputs import claim_outputs
from fsdpckpt.merging.plan import MergePlan, PlannedFile, PlannedTensor, computed_plan

__all__ = ["Piece", "HubNames", "saved_layout", "hub_names", "hub_plan"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """One tensor the export writes, and the box of a stored tensor it is.

    Attributes:
        name: its name in the written files (the hub's). source: the key it is cut from.
        offsets, sizes: the box of ``source`` (row-major, as ``source``'s dims).
        shape: its shape as written (the box without the dims a split drops).
        whole: the box is all of ``source``: a rename at most.
    """

    name: str
    source: str
    offsets: Shape
    sizes: Shape
    shape: Shape
    whole: bool


def _whole(name: str, source: str, shape: Shape) -> Piece:
    return Piece(name, source, (0,) * len(shape), tuple(shape), tuple(shape), True)


def _box(name: str, source: str, root: Shape, offset: int, shape: Shape,
         stride: Shape) -> Piece | None:
    # The view (offset, shape, stride) of a row-major tensor of shape ``root`` as a box of it,
    # its elements in the box's row-major order; None when it is no such box (a transpose).
    strides = [math.prod(root[d + 1:]) for d in range(len(root))]
    if math.prod(shape) == 0:
        return Piece(name, source, (0,) * len(root), (0,) * len(root), shape, False)
    offsets = [(offset // s) % n if n else 0 for s, n in zip(strides, root)]
    if sum(o * s for o, s in zip(offsets, strides)) != offset:
        return None
    sizes = [1] * len(root)
    dim = 0  # each dim of the view, in order, is a later dim of the root with its stride
    for size, step in zip(shape, stride):
        if size == 1:
            continue
        while dim < len(root) and (root[dim] == 1 or strides[dim] != step):
            dim += 1
        if dim == len(root) or offsets[dim] + size > root[dim]:
            return None
        sizes[dim] = size
        dim += 1
    whole = tuple(sizes) == tuple(root)
    return Piece(name, source, tuple(offsets), tuple(sizes), tuple(shape), whole)


def saved_layout(torch: Any, model: Any) -> dict[str, tuple[Piece, ...]] | str:
    """What ``save_pretrained`` writes for each key of ``model``'s state dict: the pieces it
    is cut into (one whole piece, perhaps renamed, for most keys), by transformers' own
    ``revert_weight_conversion``, run on meta tensors.

    Args:
        torch: the torch module. model: the config's model class, built on the meta device.

    Returns:
        Key -> its pieces; or, where transformers' conversion is not a cut of one key (it
        computes new values), why, as one phrase for the user.
    """
    from transformers.core_model_loading import revert_weight_conversion

    class KeepViews(torch.overrides.TorchFunctionMode):
        # transformers makes each cut contiguous (a copy); on the meta device a copy has no
        # values to differ, and a view keeps the box it was cut as.
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func is torch.Tensor.contiguous:
                return args[0]
            return func(*args, **(kwargs or {}))

    keys: dict[int, str] = {}
    state: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        state[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
        keys[id(state[key])] = key
    try:
        with KeepViews():
            saved = revert_weight_conversion(model, dict(state))
    except Exception as exc:  # noqa: BLE001  any failure: names as stored, and why
        return f"transformers' conversion of {type(model).__name__} failed on meta tensors " \
               f"({type(exc).__name__}: {str(exc)[:200]})"
    pieces: dict[str, list[Piece]] = {}
    for name, tensor in saved.items():
        root = tensor if id(tensor) in keys else tensor._base
        source = keys.get(id(root)) if root is not None else None
        piece = None if source is None else _box(
            name, source, tuple(root.shape), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()))
        if piece is None:
            return f"transformers writes {name} computed from the model's weights, not " \
                   "as a part of one of them"
        pieces.setdefault(piece.source, []).append(piece)
    for key, value in state.items():  # a key the conversion dropped is written as it is
        pieces.setdefault(key, [_whole(key, key, tuple(value.shape))])
    return {key: tuple(found) for key, found in pieces.items()}


@dataclass(frozen=True)
class HubNames:
    """What the export of a checkpoint writes, under the hub's names.

    Attributes:
        pieces: each tensor to write, in stored order, cut from the stored name it names.
        tied: tied target -> the key it is tied to, both as the checkpoint names them
            (targets the checkpoint holds only).
        problems: what the checkpoint lacks or has too many of (empty when it matches).
    """

    pieces: tuple[Piece, ...]
    tied: dict[str, str]
    problems: list[str]


def hub_names(stored: Mapping[str, Shape], shapes: Mapping[str, Shape],
              tied: Mapping[str, str],
              layout: Mapping[str, tuple[Piece, ...]] | None) -> HubNames:
    """Match a checkpoint's names to the model's, in either naming, and name what to write.

    Args:
        stored: the checkpoint's names and shapes, as merge names them.
        shapes: the model's state dict (in-memory names) and shapes.
        tied: the model's tied targets -> their sources (in-memory names).
        layout: :func:`saved_layout` of the model; None writes every name as stored.

    Returns:
        The :class:`HubNames`: a name the model holds in memory is cut into its hub pieces;
        a hub piece's name is taken as that piece; anything else is a problem.
    """
    layout = layout if layout is not None else {k: (_whole(k, k, v),) for k, v in shapes.items()}
    by_hub = {p.name: p for found in layout.values() for p in found}

    def as_stored(key: str) -> str | None:
        # A model key as the checkpoint names it: in memory, or as its one whole piece.
        if key in stored:
            return key
        found = layout.get(key, ())
        return found[0].name if len(found) == 1 and found[0].whole and \
            found[0].name in stored else None

    ties = {as_stored(t): as_stored(s) or s for t, s in tied.items()}
    ties_found = {t: s for t, s in ties.items() if t is not None}
    # Keys whose hub pieces the checkpoint holds (a transformers 4 run) are expected as
    # those pieces; every other key under its in-memory name.
    cut = {by_hub[n].source for n in stored if n in by_hub and n not in shapes}
    wanted: dict[str, Shape | None] = {}
    for key, shape in shapes.items():
        if key in tied:
            continue
        if key in cut:
            wanted.update((p.name, p.shape) for p in layout.get(key, ()))
        else:
            wanted[key] = tuple(shape)
    held = {n: tuple(s) for n, s in stored.items() if n not in ties_found}
    problems = key_problems(held, wanted)
    pieces: list[Piece] = []
    for name, shape in held.items():
        if name in shapes and name not in cut:
            pieces += layout.get(name, (_whole(name, name, shape),))
        else:  # a hub piece as it is (or a name the problems already list)
            pieces.append(_whole(name, name, shape))
    return HubNames(tuple(pieces), ties_found, problems)


def hub_plan(job: MergeJob, pieces: Iterable[Piece], *, overwrite: bool,
             max_shard_size: int | None = None) -> MergeJob:
    """``job`` (the export's plan, tied targets already left out) writing ``pieces`` instead
    of its tensors as named: a copying plan renamed when every piece is a whole stored
    tensor, else a computed plan reading each piece's box; a computed plan (LoRA fusion)
    cutting each piece from the tensor its fuser yields. Split into shards of at most
    ``max_shard_size`` bytes as a merge splits them; the earlier outputs it replaces
    claimed again for its own files.

    Raises:
        CorruptCheckpointError, NotACheckpointError, ChecksumError: when written, a chunk's
            data is damaged or missing.
    """
    (plan,) = job.plans
    planned = {t.spec.name: t for f in plan.files for t in f.tensors}
    chosen = [p for p in pieces if p.source in planned]
    if plan.fuser is None and all(p.whole for p in chosen):  # the same files, renamed
        renamed = {p.source: p.name for p in chosen}
        files = tuple(PlannedFile(f.name, tuple(_renamed(t, renamed[t.spec.name])
                                                for t in f.tensors)) for f in plan.files)
        return dataclasses.replace(job, plans=(dataclasses.replace(plan, files=files),))
    specs = [TensorSpec(p.name, (p.name,), planned[p.source].spec.dtype, p.shape)
             for p in chosen]
    fuser = plan.fuser
    # A fused plan copies some tensors from their stored chunks (plan.computed_plan): their
    # pieces are cut from the stored chunks too, the computed tensors' from the fuser's.
    stored = [p for p in chosen if planned[p.source].source.chunks]
    made = [p for p in chosen if not planned[p.source].source.chunks]
    stream = (lambda: _cut(plan, planned, chosen)) if fuser is None else \
        (lambda: itertools.chain(_cut(plan, planned, stored), _cut_computed(fuser(), made)))
    computed = computed_plan(plan.folder, specs, stream, max_shard_size=max_shard_size)
    return MergeJob((computed,), job.output_dir,
                    claim_outputs((computed,), job.output_dir, overwrite=overwrite))


def _renamed(tensor: PlannedTensor, name: str) -> PlannedTensor:
    spec = dataclasses.replace(tensor.spec, name=name, key_path=(name,))
    return dataclasses.replace(tensor, spec=spec)


def _cut(plan: MergePlan, planned: Mapping[str, PlannedTensor],
         pieces: list[Piece]) -> Iterator[tuple[str, Any]]:
    # Each piece's box read from the stored chunks (only the chunks' parts inside it), cast
    # as the merge casts (Tensor.to of the stored values), one piece in memory at a time.
    import torch

    files = DataFiles(plan.folder.path)
    try:
        for piece in pieces:
            tensor = planned[piece.source]
            entry, out = tensor.source, tensor.spec.dtype
            memory = bytearray(math.prod(piece.sizes) * entry.dtype.itemsize)
            read_box(files, entry, piece.offsets, piece.sizes, memoryview(memory))
            stored = _torch.dtype(entry.dtype.name)
            value = torch.frombuffer(memory, dtype=stored) if memory else \
                torch.empty(0, dtype=stored)
            yield piece.name, value.view(piece.shape).to(_torch.dtype(out.name))
    finally:
        files.close()


def _cut_computed(tensors: Iterable[tuple[str, Any]],
                  pieces: list[Piece]) -> Iterator[tuple[str, Any]]:
    # Each computed tensor (whole, by in-memory name) cut into its pieces as views: the
    # tensor is held once, while its pieces are written.
    by_source: dict[str, list[Piece]] = {}
    for piece in pieces:
        by_source.setdefault(piece.source, []).append(piece)
    for name, tensor in tensors:
        for piece in by_source.get(name, ()):
            box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))
            yield piece.name, tensor[box].reshape(piece.shape)
