"""``diff``: compare two state sources tensor by tensor, streaming.

Each side is any source :func:`fsdpckpt.inspection._diff_files.open_source` reads (DCP
folders, whole checkpoints, safetensors and ``.bin`` files, Hugging Face folders), named
by the merge's rule so a checkpoint and its merged file line up. Tensors are read and
compared in tiles of at most :data:`BOX_ELEMENTS` elements, one tile per side at a time,
so memory stays flat whatever the model: where both sides say where their pieces are
stored (DCP chunks, safetensors), in tiles cut so that both read long contiguous runs
whatever their layouts (:mod:`fsdpckpt.inspection._diff_tiles`); otherwise (a ``.bin``
side) in row-major boxes through :meth:`Source.read`.

What counts as equal, per tensor (the rule of ``torch.allclose``, with NaN as ``equal_nan``):
``|a - b| <= atol + rtol * |b|`` at every position, where a NaN on both sides at the same
position is equal and equal infinities are equal. Shapes must match. With the default
exact comparison (``atol = rtol = 0``) dtypes must match too; with a tolerance, tensors of
different dtypes are compared by value (in float64, complex128 for complex) and the dtype
change is listed but allowed, which is how a ``--dtype bf16`` export is checked against its
fp32 source. Equal values are not always equal bits (``-0.0`` and ``0.0``, NaN payloads):
``identical`` says whether the bytes are the same too. Non-tensor entries are compared by
value (tensors in them byte for byte; NaN equals NaN).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from fsdpckpt._io.rawio import reusing_scratch, scratch
from fsdpckpt._progress import ProgressCallback, ProgressFactory, start_progress
from fsdpckpt.dcp._checked import CheckedRead
from fsdpckpt.errors import DiffOptionError
from fsdpckpt.inspection._diff_files import open_source
from fsdpckpt.inspection._diff_names import NameMap, mapped_sides
from fsdpckpt.inspection._diff_sources import (
    Source,
    TensorInfo,
    same_bytes,
    same_value,
)
from fsdpckpt.inspection._diff_tied import Tie, ties_left_out
from fsdpckpt.inspection._diff_tiles import (
    Piece,
    compressed,
    finish_checks,
    overlaps,
    read_tile,
    row_major,
    tile_sizes,
    tiles_of,
)
from fsdpckpt.inspection._diff_trainer import whole_trainer_sides
from fsdpckpt.inspection._diff_values import Accumulator
from fsdpckpt.merging._keys import no_match_hint, select
from fsdpckpt.merging._runs import boxes

__all__ = ["diff", "DiffReport", "TensorDiff", "ObjectDiff", "Tie", "NameMap",
           "DiffOptionError", "BOX_ELEMENTS"]

#: Elements of one tensor compared at a time. The comparison holds a few float64 copies of a
#: box per side: about 40 bytes an element, 20 MiB at this size.
BOX_ELEMENTS = 2**19


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor present on both sides compares.

    Attributes:
        name: its name, as compared.
        dtype_a, dtype_b: the dtype on each side (torch names).
        shape_a, shape_b: the shape on each side.
        equal: equal within the tolerance (see the module docstring).
        identical: same dtype, shape and bytes.
        max_abs: the largest ``|a - b|`` (0 when equal values; ``inf`` when a NaN faces a
            number or an infinity faces anything else); None when shapes differ or the dtypes
            cannot be compared by value (float4; the bytes differ).
        max_rel: the largest ``|a - b| / |b|`` (``inf`` where ``b`` is 0 and ``a`` is not).
        mismatched: elements outside the tolerance.
        numel: elements compared (0 when shapes differ).
        rel_change: ``||a - b|| / ||a||`` over the whole tensor, computed with ``norms``
            (``diff --html``); None otherwise, or when not comparable by value.
    """

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    equal: bool
    identical: bool
    max_abs: float | None
    max_rel: float | None
    mismatched: int
    numel: int
    rel_change: float | None = None

    @property
    def dtype_differs(self) -> bool:
        return self.dtype_a != self.dtype_b

    @property
    def shape_differs(self) -> bool:
        return self.shape_a != self.shape_b

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": [self.dtype_a, self.dtype_b],
                "shape": [list(self.shape_a), list(self.shape_b)], "equal": self.equal,
                "identical": self.identical, "max_abs": _number(self.max_abs),
                "max_rel": _number(self.max_rel), "mismatched": self.mismatched,
                "numel": self.numel, "rel_change": _number(self.rel_change)}


@dataclass(frozen=True)
class ObjectDiff:
    """A non-tensor entry present on both sides: whether the values are equal."""

    name: str
    equal: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "equal": self.equal}


@dataclass(frozen=True)
class DiffReport:
    """What :func:`diff` found.

    Attributes:
        a, b: the sources compared, as read (a whole checkpoint resolves to its folder).
        atol, rtol: the tolerance.
        missing: names in A and not in B. unexpected: names in B and not in A.
        tensors: every tensor on both sides, in A's order. objects: every non-tensor entry
            on both sides.
        tied: the tensors one side leaves out because its config ties them (an export's
            ``lm_head.weight``): not missing, but compared in ``tensors`` under their name
            with the tensor they are tied to, as a loader would see them.
        names: how a checkpoint side's names were matched to a Hugging Face folder's (read
            as export-hf writes it: renamed, cut, rows reordered), or why they were not;
            None when no folder's names needed it.
    """

    a: str
    b: str
    atol: float
    rtol: float
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    tensors: tuple[TensorDiff, ...]
    objects: tuple[ObjectDiff, ...] = field(default=())
    tied: tuple[Tie, ...] = field(default=())
    names: NameMap | None = None

    @property
    def equal(self) -> bool:
        """No missing or unexpected name, and every tensor and object equal."""
        return not self.missing and not self.unexpected and \
            all(t.equal for t in self.tensors) and all(o.equal for o in self.objects)

    @property
    def differing(self) -> tuple[TensorDiff, ...]:
        """The tensors that are not equal within the tolerance."""
        return tuple(t for t in self.tensors if not t.equal)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (schema in docs/cli.md)."""
        return {
            "a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol,
            "equal": self.equal, "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "tensors": [t.to_json() for t in self.tensors],
            "objects": [o.to_json() for o in self.objects],
            "tied": [t.to_json() for t in self.tied],
            "names": self.names.to_json() if self.names else None,
            "summary": {
                "tensors": len(self.tensors),
                "identical": sum(t.identical for t in self.tensors),
                "equal": sum(t.equal for t in self.tensors),
                "differing": len(self.differing),
                "shape_mismatches": sum(t.shape_differs for t in self.tensors),
                "dtype_mismatches": sum(t.dtype_differs for t in self.tensors),
                "objects": len(self.objects),
                "objects_differing": sum(not o.equal for o in self.objects),
                "tied": len(self.tied),
            },
        }


def _number(value: float | None) -> float | str | None:
    # JSON has no infinity or NaN: they are written as strings.
    if value is None or math.isfinite(value):
        return value
    return str(value)


def _tolerance(name: str, value: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DiffOptionError(f"{name} must be a number, not {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise DiffOptionError(f"{name} must be a finite number >= 0, not {value!r}")
    return number


def _compare_tensor(a: Source, b: Source, ta: TensorInfo, tb: TensorInfo, atol: float,
                    rtol: float, advance: ProgressCallback | None, norms: bool) -> TensorDiff:

    exact = atol == 0 and rtol == 0
    same_dtype = ta.dtype == tb.dtype
    if ta.shape != tb.shape:
        return TensorDiff(ta.name, ta.dtype.name, tb.dtype.name, ta.shape, tb.shape, False,
                          False, None, None, 0, 0)
    acc = Accumulator(norms)
    pieces_a, pieces_b = a.pieces(ta.name), b.pieces(tb.name)
    if pieces_a is not None and pieces_b is not None:
        _compare_tiles(pieces_a, pieces_b, ta, tb, acc, atol, rtol, advance)
    else:
        _compare_boxes(a, b, ta, tb, acc, atol, rtol, advance)
    equal = acc.mismatched == 0 and acc.comparable and (same_dtype or not exact)
    known = acc.comparable
    return TensorDiff(ta.name, ta.dtype.name, tb.dtype.name, ta.shape, tb.shape, equal,
                      acc.identical and same_dtype, acc.max_abs if known else None,
                      acc.max_rel if known else None, acc.mismatched, ta.numel,
                      acc.rel_change)


def _compare_tiles(pieces_a: list[Piece], pieces_b: list[Piece], ta: TensorInfo,
                   tb: TensorInfo, acc: Accumulator, atol: float, rtol: float,
                   advance: ProgressCallback | None) -> None:
    """Compare where both sides are stored by piece: each overlap of a piece of A with a
    piece of B in tiles that both read in long runs (:mod:`._diff_tiles`).

    Tiles laid out alike on both sides with the same bytes are equal whatever the dtype's
    rule, and are compared as bytes without torch: a diff of two identical
    checkpoints laid out alike never imports it (``import torch`` alone takes longer than
    reading 1.6 GB here). Any other tile is compared by :class:`Accumulator` (by numpy,
    without torch, for the dtypes numpy holds).
    """
    same_dtype = ta.dtype == tb.dtype
    per_tile = min(BOX_ELEMENTS, max(ta.numel, 1))
    # Two sets of buffers, one tile after the other: a tile's CRC (read_tile's ``later``)
    # runs on the other core while it is compared and the next tile is read into the others.
    buffers = [[scratch(per_tile * info.dtype.itemsize, f"diff-{side}{turn}")
                for side, info in (("a", ta), ("b", tb))] for turn in ("", "-2")]
    turn = 0
    for pa, pb, offsets, sizes in overlaps(pieces_a, pieces_b):
        tile = tile_sizes(sizes, pa.stride, pb.stride, BOX_ELEMENTS)
        # In the storage order of a compressed side if there is one (its reads then only
        # move forward), else of A.
        leading = pb if compressed(pb) and not compressed(pa) else pa
        for corner, part in tiles_of(offsets, sizes, tile, leading.stride):
            count = math.prod(part)
            buffer_a, buffer_b = buffers[turn % 2]
            turn += 1
            strides_a = read_tile(pa, corner, part, buffer_a, later=True)
            strides_b = read_tile(pb, corner, part, buffer_b, later=True)
            nbytes = count * ta.dtype.itemsize
            # Laid out alike in the two buffers: the same bytes are the same elements.
            if same_dtype and strides_a == strides_b and \
                    same_bytes(buffer_a[:nbytes], buffer_b[:nbytes]):
                # Put in row-major order only with norms: equal bytes need no values.
                acc.same(partial(row_major, buffer_a, ta.dtype, part, strides_a,
                                 "diff-a-rows"), ta.dtype.name, count)
            else:
                acc.add(row_major(buffer_a, ta.dtype, part, strides_a, "diff-a-rows"),
                        ta.dtype.name,
                        row_major(buffer_b, tb.dtype, part, strides_b, "diff-b-rows"),
                        tb.dtype.name, count, atol, rtol)
            if advance:
                advance(count * (ta.dtype.itemsize + tb.dtype.itemsize))
        for piece in (pa, pb):  # the next overlap may read other pieces into these buffers
            if isinstance(piece.src, CheckedRead):
                piece.src.settle()
    finish_checks([*pieces_a, *pieces_b])  # before anything is said of the tensor


def _compare_boxes(a: Source, b: Source, ta: TensorInfo, tb: TensorInfo, acc: Accumulator,
                   atol: float, rtol: float, advance: ProgressCallback | None) -> None:
    """Compare box by box in row-major order, through :meth:`Source.read`."""
    per_box = min(BOX_ELEMENTS, max(ta.numel, 1))
    buf_a = scratch(per_box * ta.dtype.itemsize, "diff-a")
    buf_b = scratch(per_box * tb.dtype.itemsize, "diff-b")
    for offsets, sizes in boxes(ta.shape, BOX_ELEMENTS):
        count = math.prod(sizes)
        view_a = buf_a[:count * ta.dtype.itemsize]
        view_b = buf_b[:count * tb.dtype.itemsize]
        a.read(ta.name, offsets, sizes, view_a)
        b.read(tb.name, offsets, sizes, view_b)
        acc.add(view_a, ta.dtype.name, view_b, tb.dtype.name, count, atol, rtol)
        if advance:
            advance(len(view_a) + len(view_b))


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, atol: float = 0.0,
         rtol: float = 0.0, names: Sequence[str] | str = (), optimizer: bool = False,
         model_index: int | None = None, keep_keys: bool = False,
         progress: ProgressFactory | None = None, norms: bool = False,
         storage_options: dict[str, Any] | None = None) -> DiffReport:
    """Compare two state sources tensor by tensor, streaming.

    Args:
        a, b: each a DCP folder, a whole checkpoint (its model folder; see ``optimizer``),
            a ``.safetensors`` or ``.bin``/``.pt`` file or shard index, or a folder holding
            one (``model.safetensors``, ``pytorch_model.bin`` or their index, as Hugging
            Face and ``fsdpckpt merge`` write them). A trainer's folder (Lightning's
            ``*.ckpt/``...) is its model (its optimizer with ``optimizer``), or, against a
            file holding its whole state (Lightning's ``consolidate_checkpoint`` output,
            ``dcp_to_torch_save``'s), the whole folder, with Lightning's ``meta.pt``
            entries at the top level as Lightning consolidates them.
        atol, rtol: the tolerance, as ``torch.allclose``: ``|a - b| <= atol + rtol * |b|``.
            Both 0 (the default) asks for equal values and equal dtypes.
        names: only compare entries whose name matches one of these (a glob such as
            ``'*.weight'``, or a substring such as ``'layers.0.'``): the name compared (as
            merge writes it, ``0.weight``) or as a side stores it (``model.0.weight``).
        optimizer: compare the optimizer state (``optimizer_0/``, ``optimizer.safetensors``)
            instead of the model.
        model_index: which model of a checkpoint holding several.
        keep_keys: compare names with wrapper segments (``_fsdp_wrapped_module.``...)
            kept; by default they are dropped on both sides, as merge drops them.
        progress: a factory of byte-count callbacks (:mod:`fsdpckpt._progress`).
        norms: also compute each tensor's ``rel_change``, ``||a - b|| / ||a||``, in the
            same single read of each side (what ``diff --html`` plots).
        storage_options: fsspec options for a side on object storage (``s3://...``; one
            value for both sides); None uses the environment's credentials and endpoint.

    Returns:
        The :class:`DiffReport`; ``report.equal`` is the verdict.

    Raises:
        DiffOptionError: a tolerance is negative or not finite; ``names`` match nothing.
        CheckpointNotFoundError, NotACheckpointError, CorruptCheckpointError,
            UnsafePickleError: a side cannot be read.

    Example:
        >>> report = diff("ckpt/pytorch_model_fsdp_0", "merged/model.safetensors")
        >>> report.equal
        True
    """
    atol, rtol = _tolerance("atol", atol), _tolerance("rtol", rtol)
    patterns = [names] if isinstance(names, str) else list(names)
    with open_source(a, optimizer=optimizer, model_index=model_index, keep_keys=keep_keys,
                     storage_options=storage_options) as left, \
            open_source(b, optimizer=optimizer, model_index=model_index, keep_keys=keep_keys,
                        storage_options=storage_options) as right, reusing_scratch(), \
            whole_trainer_sides(left, right, keep_keys=keep_keys) as (left, right):
        # A trainer's folder against its framework's whole consolidation: both whole; a
        # checkpoint against its export: read under the export's names (._diff_names).
        left, right, mapped = mapped_sides(left, right)

        def keep(name: str) -> bool:  # as compared, or as either side stores it (inspect's)
            return select(name, left.stored_name(name), right.stored_name(name),
                          include=patterns, substring=True)

        if patterns and not any(keep(n) for side in (left, right)
                                for n in [*side.tensors, *side.object_names()]):
            hint = no_match_hint([(n, left.stored_name(n)) for n in left.tensors])
            raise DiffOptionError(f"{left.path}: no name here or in {right.path} matches "
                                  f"{', '.join(map(repr, patterns))}; {hint}: pass a "
                                  "pattern that matches some of them")
        return replace(_diff(left, right, atol, rtol, keep, progress, norms), names=mapped)


def _diff(left: Source, right: Source, atol: float, rtol: float, keep: Any,
          progress: ProgressFactory | None, norms: bool) -> DiffReport:
    objects_a = [n for n in left.object_names() if keep(n)]
    objects_b = [n for n in right.object_names() if keep(n)]
    names_a = [n for n in left.tensors if keep(n)] + objects_a
    names_b = [n for n in right.tensors if keep(n)] + objects_b
    set_a, set_b = set(names_a), set(names_b)
    common = [n for n in names_a if n in set_b]
    pairs = [(left.tensors[n], right.tensors[n]) for n in common
             if n in left.tensors and n in right.tensors]
    # A target one side leaves out by its config's tie meets the tensor it is tied to there.
    tied = ties_left_out(left, [n for n in names_b if n in right.tensors], "a") + \
        ties_left_out(right, [n for n in names_a if n in left.tensors], "b")
    pairs += [(left.tensors[t.name], right.tensors[t.tied_to]) if t.left_out_by == "b" else
              (left.tensors[t.tied_to], right.tensors[t.name]) for t in tied]
    set_a |= {t.name for t in tied}
    set_b |= {t.name for t in tied}
    total = sum(x.numel * x.dtype.itemsize + y.numel * y.dtype.itemsize for x, y in pairs
                if x.shape == y.shape)
    advance = start_progress(progress, total, 2)
    tensors = []
    kinds = []  # a name that is a tensor on one side and an object on the other
    for name in common:
        if (name in left.tensors) != (name in right.tensors):
            kinds.append(name)
    for ta, tb in pairs:
        tensors.append(_compare_tensor(left, right, ta, tb, atol, rtol, advance, norms))
    for i, t in enumerate(tied, len(tensors) - len(tied)):  # named as the target
        tensors[i] = replace(tensors[i], name=t.name)
    values_a = left.objects() if objects_a else {}
    values_b = right.objects() if objects_b else {}
    objects = [ObjectDiff(n, same_value(values_a[n], values_b[n])) for n in objects_a
               if n in values_b]
    objects += [ObjectDiff(n, False) for n in kinds]
    return DiffReport(str(left.path), str(right.path), atol, rtol,
                      tuple(n for n in names_a if n not in set_b),
                      tuple(n for n in names_b if n not in set_a), tuple(tensors),
                      tuple(objects), tuple(tied))
