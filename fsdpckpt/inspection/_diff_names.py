"""A checkpoint against its export when export-hf renamed or cut its tensors, for ``diff``.

``export-hf`` writes the names ``save_pretrained`` writes: fused MoE experts cut per expert
(``mlp.experts.gate_up_proj`` into ``block_sparse_moe.experts.N.w1.weight``...), LLaVA's
``model.language_model.*`` as ``language_model.model.*``, a torchtune or torchtitan run's
names as Hugging Face's with q's and k's rows reordered by heads. Compared by name, such an
export is all missing and unexpected. So where one side is a Hugging Face folder (its weight
file has a ``config.json`` beside it) whose names are not all the other side's, the other
side is read as export-hf would write it, by export-hf's own plan and no second table: a
trainer's names and row order by :func:`~fsdpckpt.export._trainer_names.trainer_names`, the
hub's names by :func:`~fsdpckpt.training._save_moe.hub_layout` (the config's model class on
the meta device and transformers' conversion mapping, each written tensor a box of one
stored tensor, :class:`fsdpckpt.export._moe.Piece`). :class:`ConvertedSource` is that side
under the written names: each tensor's pieces are the stored pieces' parts inside its box
(rows reordered as runs of rows a fixed step apart), so the comparison reads it box by box,
bit for bit, as any side. Where the names cannot be mapped (transformers not installed, a
class not built, names that are not the class's) the sides are compared as stored, and
:class:`NameMap` says why.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdpckpt._io.rawio import scratch
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import ExportMismatchError
from fsdpckpt.export._keycheck import check_declared_sizes
from fsdpckpt.export._moe import Piece as Box
from fsdpckpt.export._trainer_names import trainer_names
from fsdpckpt.inspection._diff_sources import Source, TensorInfo
from fsdpckpt.inspection._diff_tied import side_config
from fsdpckpt.inspection._diff_tiles import Piece, finish_checks, read_tile
from fsdpckpt.training._save_moe import hub_layout

__all__ = ["NameMap", "ConvertedSource", "mapped_sides"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class NameMap:
    """How one side's names were matched to a Hugging Face folder's.

    Attributes:
        side: ``"a"`` or ``"b"``: the side read under the folder's names (the checkpoint).
        converted: how, as one phrase (the trainer's converter, or ``save_pretrained``'s
            names); None when the names were compared as stored.
        renamed: tensors compared under another name than stored, whole.
        cut: tensors compared as a part of a stored one (a fused expert's).
        reordered: tensors compared with their rows reordered (q and k by heads).
        not_mapped: why the names were compared as stored; None when mapped.
    """

    side: str
    converted: str | None
    renamed: int = 0
    cut: int = 0
    reordered: int = 0
    not_mapped: str | None = None

    def said(self) -> str:
        """The report's ``names:`` line."""
        side, other = self.side.upper(), "B" if self.side == "a" else "A"
        if self.converted is None:
            return (f"names: {side}'s names not mapped to {other}'s ({self.not_mapped}); "
                    "compared as stored")
        return (f"names: {side} read as export-hf writes it, {self.converted}: "
                f"{self.renamed} renamed, {self.cut} cut from a stored tensor, "
                f"{self.reordered} with rows reordered")

    def to_json(self) -> dict[str, Any]:
        return {"side": self.side, "converted": self.converted, "renamed": self.renamed,
                "cut": self.cut, "reordered": self.reordered, "not_mapped": self.not_mapped}


@dataclass(frozen=True)
class _Target:
    # A written tensor: the box of a stored one it is (``box.source``), and the stored rows
    # in the order its rows are (q and k of a trainer's run; the box is then whole).
    box: Box
    rows: tuple[int, ...] | None


def _dims(box: Box) -> list[int | None]:
    # The stored dim of each written dim: the written tensor is the box's row-major elements
    # (export._moe), its shape the box's sizes with unit dims dropped or added.
    stored = [d for d, n in enumerate(box.sizes) if n != 1]
    found: list[int | None] = []
    for n in box.shape:
        found.append(stored.pop(0) if n != 1 and stored else None)
    return found


def _overlap(offsets: Sequence[int], sizes: Sequence[int], at: Sequence[int],
             extent: Sequence[int]) -> tuple[list[int], list[int]] | None:
    low = [max(a, b) for a, b in zip(offsets, at)]
    high = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, at, extent)]
    return None if any(h <= lo for lo, h in zip(low, high)) else (low, high)


def _in_box(piece: Piece, box: Box) -> Iterator[Piece]:
    """The part of a stored piece inside ``box``, in the written tensor's dims."""
    found = _overlap(piece.offsets, piece.sizes, box.offsets, box.sizes)
    if found is None:
        return
    low, high = found
    start = piece.storage_offset + sum((lo - o) * st for lo, o, st in
                                       zip(low, piece.offsets, piece.stride))
    dims = _dims(box)
    yield Piece(tuple(0 if d is None else low[d] - box.offsets[d] for d in dims),
                tuple(1 if d is None else high[d] - low[d] for d in dims),
                piece.src, piece.storage_start, start,
                tuple(1 if d is None else piece.stride[d] for d in dims), piece.itemsize,
                piece.source)


def _runs(rows: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """``rows`` (written row -> stored row) as runs (first written row, first stored row,
    step, count) of written rows whose stored rows are ``step`` apart: a trainer's q or k
    is two such runs a head (the stored rows of even, then odd, rotary pairs)."""
    runs = []
    i = 0
    while i < len(rows):
        step = rows[i + 1] - rows[i] if i + 1 < len(rows) else 1
        count = 1
        if step > 0:
            while i + count < len(rows) and rows[i + count] - rows[i + count - 1] == step:
                count += 1
        runs.append((i, rows[i], step if count > 1 else 1, count))
        i += count
    return runs


def _reordered(piece: Piece, runs: Sequence[tuple[int, int, int, int]]) -> Iterator[Piece]:
    """A piece of a stored tensor (rows as stored) as the pieces of the written one."""
    first, held = piece.offsets[0], piece.sizes[0]
    for out, stored, step, count in runs:
        low = max(0, -(-(first - stored) // step))
        high = min(count, (first + held - 1 - stored) // step + 1)
        if low >= high:
            continue
        skip = (stored + low * step - first) * piece.stride[0]
        yield Piece((out + low,) + piece.offsets[1:], (high - low,) + piece.sizes[1:],
                    piece.src, piece.storage_start, piece.storage_offset + skip,
                    (piece.stride[0] * step,) + piece.stride[1:], piece.itemsize,
                    piece.source)


class ConvertedSource(Source):
    """A side read under the names export-hf writes it under: each tensor a box of a
    stored one, rows reordered where the trainer's converter reorders them. It reads
    through the side it wraps (which the caller closes)."""

    def __init__(self, inner: Source, targets: Mapping[str, _Target]) -> None:
        self.inner = inner
        self.path = inner.path
        self.kind = inner.kind
        self._targets = dict(targets)
        self.tensors = {name: TensorInfo(name, inner.tensors[t.box.source].dtype, t.box.shape)
                        for name, t in targets.items()}

    def object_names(self) -> list[str]:
        return self.inner.object_names()

    def objects(self) -> dict[str, Any]:
        return self.inner.objects()

    def pieces(self, name: str) -> list[Piece] | None:
        target = self._targets[name]
        stored = self.inner.pieces(target.box.source)
        if stored is None:
            return None
        found = [p for piece in stored for p in _in_box(piece, target.box)]
        if target.rows is None:
            return found
        runs = _runs(target.rows)
        return [p for piece in found for p in _reordered(piece, runs)]

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
             out: memoryview) -> None:
        itemsize = self.tensors[name].dtype.itemsize
        pieces = self.pieces(name)
        if pieces is not None:
            _read_pieces(pieces, offsets, sizes, out, itemsize)
            return
        # A side read only by boxes (torch.save files): any box of a stored tensor, row by
        # row where rows are reordered.
        target = self._targets[name]
        if target.rows is None:
            self.inner.read(target.box.source, *_stored_box(target.box, offsets, sizes), out)
            return
        width = math.prod(sizes[1:]) * itemsize
        for i in range(sizes[0]):
            row = (target.rows[offsets[0] + i],) + offsets[1:]
            self.inner.read(target.box.source, *_stored_box(target.box, row, (1,) + sizes[1:]),
                            out[i * width:(i + 1) * width])


def _stored_box(box: Box, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[Shape, Shape]:
    # A box of the written tensor as the box of the stored one (same row-major order).
    low, extent = list(box.offsets), list(box.sizes)
    for i, d in enumerate(_dims(box)):
        if d is not None:
            low[d] += offsets[i]
            extent[d] = sizes[i]
    return tuple(low), tuple(extent)


def _read_pieces(pieces: Sequence[Piece], offsets: Sequence[int], sizes: Sequence[int],
                 out: memoryview, itemsize: int) -> None:
    """Fill ``out`` with the row-major elements of a box, from the pieces that hold it,
    byte for byte (any dtype), one piece's part at a time."""
    import torch

    count = math.prod(sizes)
    if not count:
        return
    box = torch.frombuffer(out, dtype=torch.uint8, count=count * itemsize) \
        .view(*sizes, itemsize)
    for piece in pieces:
        found = _overlap(piece.offsets, piece.sizes, offsets, sizes)
        if found is None:
            continue
        low, high = found
        part = [h - lo for lo, h in zip(low, high)]
        nbytes = math.prod(part) * itemsize
        buffer = scratch(nbytes, "diff-names")
        strides = read_tile(piece, low, part, buffer)
        tile = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).as_strided(
            (*part, itemsize), tuple(s * itemsize for s in strides) + (1,))
        box[tuple(slice(lo - o, h - o) for lo, h, o in zip(low, high, offsets))].copy_(tile)
    finish_checks(pieces)  # the whole of each piece's entry, the first time


def _tails(names: Iterable[str]) -> set[str]:
    # A tensor's own module and parameter: the last two segments of its name.
    return {".".join(name.split(".")[-2:]) for name in names}


def _plan(stored: Mapping[str, Shape], written: Iterable[str], config: dict[str, Any],
          config_file: Place, side: str) -> tuple[dict[str, _Target] | None, NameMap]:
    """The tensors export-hf writes for a checkpoint of these names and shapes with this
    config (the folder holds ``written``), each as a :class:`_Target`; None, and why, where
    it writes them as stored or does not know."""
    try:
        trainer = trainer_names(stored, config, config_file)
    except ExportMismatchError as exc:
        return None, NameMap(side, None, not_mapped=str(exc))
    if trainer is not None:
        targets = {trainer.hub[k]: _Target(Box(trainer.hub[k], k, (0,) * len(v), v, v, True),
                                           trainer.rows.get(trainer.hub[k]))
                   for k, v in stored.items()}
        return targets, _counted(side, trainer.said(), targets)
    # save_pretrained's names move a tensor (LLaVA's prefixes) or cut a fused one (experts),
    # and keep the rest (embeddings, attention, norms) as the model names them: two sides
    # with no name ending alike are two models, and building the config's class to find
    # that out took 27 s (import transformers, the class on the meta device).
    if not _tails(stored) & _tails(written):
        return None, NameMap(side, None, not_mapped="no name ends as one on the other side "
                             "does: another model's")
    try:  # the class is built per layer and expert: bounded by the keys first, as export-hf
        check_declared_sizes(config, dict(stored), config_file)
    except ExportMismatchError as exc:
        return None, NameMap(side, None, not_mapped=str(exc))
    try:
        hub = hub_layout(config, stored)
    except Exception as exc:  # noqa: BLE001  transformers' own failure: compared as stored
        return None, NameMap(side, None, not_mapped=f"the model class was not built: "
                             f"{type(exc).__name__}: {str(exc)[:200]}")
    if hub.pieces is None or hub.as_stored:
        return None, NameMap(side, None, not_mapped=hub.as_stored or "unknown")
    targets = {p.name: _Target(p, None) for found in hub.pieces.values() for p in found}
    for name in hub.tied or {}:  # left out of the plan; compared where the folder has it
        if name in stored and name not in targets:
            targets[name] = _Target(Box(name, name, (0,) * len(stored[name]), stored[name],
                                        stored[name], True), None)
    if all(t.box.whole and t.box.name == t.box.source for t in targets.values()):
        return None, NameMap(side, None, not_mapped="the checkpoint already holds the "
                             "names export-hf writes for its config")
    return targets, _counted(side, "under the names save_pretrained writes (transformers' "
                             "conversion mapping)", targets)


def _counted(side: str, how: str, targets: Mapping[str, _Target]) -> NameMap:
    moved = [t for t in targets.values() if t.box.whole and t.box.name != t.box.source]
    return NameMap(side, how, len(moved), sum(not t.box.whole for t in targets.values()),
                   sum(t.rows is not None for t in targets.values()))


def mapped_sides(left: Source, right: Source) -> tuple[Source, Source, NameMap | None]:
    """``(left, right)``, with a checkpoint side read under the names of a Hugging Face
    folder on the other side (:class:`ConvertedSource`) where export-hf would write it
    under them; and how names were matched (None where both sides' names were compared as
    they are because the folder's names are all the other side's).

    Example:
        >>> a, b, names = mapped_sides(checkpoint_side, export_side)
        >>> names.converted
        "under the names save_pretrained writes (transformers' conversion mapping)"
    """
    for folder, other, side in ((right, left, "a"), (left, right, "b")):
        found = side_config(folder)
        if found is None or not other.tensors or set(folder.tensors) <= set(other.tensors):
            continue
        stored = {name: info.shape for name, info in other.tensors.items()}
        targets, names = _plan(stored, folder.tensors, found[1], found[0], side)
        if targets is None:
            return left, right, names
        converted = ConvertedSource(other, targets)
        return (converted, right, names) if side == "a" else (left, converted, names)
    return left, right, None
