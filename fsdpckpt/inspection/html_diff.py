"""``fsdpckpt diff --html``: what moved between two state sources, as one self-contained page.

Built from the :class:`~fsdpckpt.inspection.diff.DiffReport` alone, computed with ``norms``
(each tensor's ``||a - b|| / ||a||`` beside its largest ``|a - b|``, in the one streaming read
``diff`` makes of each side), so every figure on the page is in ``diff --json`` too:

- the verdict and the counts of the text output, names missing or unexpected;
- per layer, the relative change and the largest absolute difference, the layer index on x
  and one line per module kind (``q_proj``, ``up_proj``, ``input_layernorm``...);
- the tensors outside the layers (embeddings, head, final norm);
- a sortable table of the largest changes.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from fsdpckpt.inspection import _html as h
from fsdpckpt.inspection.diff import DiffReport, TensorDiff

__all__ = ["diff_html", "layer_and_kind", "MAX_ROWS"]

#: Rows of the table of largest changes (the --json document has every tensor).
MAX_ROWS = 200
#: Names listed as missing or unexpected before "... N more".
MAX_NAMES = 100

_LAYER = re.compile(r"(?:^|\.)(\d+)\.")
_PARAMS = {"weight", "bias"}


def layer_and_kind(name: str) -> tuple[int | None, str]:
    """The layer index of a tensor (its name's first numeric segment) and its module kind
    (the module's own name, with the parameter's when not ``weight``):
    ``model.layers.3.self_attn.q_proj.weight`` -> ``(3, "q_proj")``; ``lm_head.weight`` ->
    ``(None, "lm_head")``."""
    match = _LAYER.search(name)
    layer = int(match.group(1)) if match else None
    rest = name[match.end():] if match else name
    parts = [p for p in rest.split(".") if p and not p.isdigit()]
    if not parts:
        return layer, name
    param = parts[-1]
    if param in _PARAMS and len(parts) > 1:
        return layer, parts[-2] if param == "weight" else f"{parts[-2]}.{param}"
    return layer, param


def _value(t: TensorDiff) -> float:
    """Sort key of the table: the relative change, else the largest difference."""
    for v in (t.rel_change, t.max_abs):
        if v is not None:
            return v if not math.isnan(v) else math.inf
    return math.inf if not t.equal else 0.0


def _number(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _names(title: str, names: tuple[str, ...]) -> str:
    if not names:
        return ""
    shown = "".join(f"<li><code>{h.text(n)}</code></li>" for n in names[:MAX_NAMES])
    more = f"<li>... {len(names) - MAX_NAMES} more</li>" if len(names) > MAX_NAMES else ""
    return h.section(f"{title} ({len(names)})", f"<ul data-kind=\"{h.text(title)}\">{shown}"
                     f"{more}</ul>")


def _per_layer(tensors: tuple[TensorDiff, ...]) -> str:
    rel: dict[str, list[tuple[int, float]]] = defaultdict(list)
    absolute: dict[str, list[tuple[int, float]]] = defaultdict(list)
    outside = []
    for t in tensors:
        layer, kind = layer_and_kind(t.name)
        if layer is None:
            outside.append(t)
            continue
        if t.rel_change is not None:
            rel[kind].append((layer, t.rel_change))
        if t.max_abs is not None:
            absolute[kind].append((layer, t.max_abs))
    outer = [(t.name, t.rel_change) for t in outside if t.rel_change is not None]
    return "".join([
        "<h3>Relative change ||a - b|| / ||a||</h3>",
        h.lines(dict(rel), x_label="layer", y_label="relative change"),
        "<h3>Largest absolute difference max |a - b|</h3>",
        h.lines(dict(absolute), x_label="layer", y_label="max |a - b|"),
        "<h3>Outside the layers (relative change)</h3>",
        h.bars(outer, lambda v: f"{v:.4g}", kind="outside") if outer else "<p>none</p>",
    ])


def _table(tensors: tuple[TensorDiff, ...]) -> str:
    ranked = sorted(tensors, key=_value, reverse=True)[:MAX_ROWS]
    rows = [[(t.name, t.name),
             (t.dtype_a if not t.dtype_differs else f"{t.dtype_a} -> {t.dtype_b}", None),
             ("x".join(map(str, t.shape_a)) if not t.shape_differs else
              f"{list(t.shape_a)} -> {list(t.shape_b)}", None),
             (_number(t.rel_change), t.rel_change),
             (_number(t.max_abs), t.max_abs),
             (_number(t.max_rel), t.max_rel),
             (str(t.mismatched), t.mismatched),
             ("identical" if t.identical else "equal" if t.equal else "differs", None)]
            for t in ranked]
    header = [("tensor", False), ("dtype", False), ("shape", False),
              ("||a-b||/||a||", True), ("max |a-b|", True), ("max rel", True),
              ("mismatched", True), ("verdict", False)]
    note = (f"<p>The {MAX_ROWS} largest of {len(tensors)}; <code>--json</code> lists "
            "every tensor.</p>" if len(tensors) > MAX_ROWS else "")
    return note + h.sortable_table(header, rows, kind="tensors")


def diff_html(report: DiffReport) -> str:
    """The page for ``report`` (compute it with ``norms=True`` for the relative changes)."""
    summary = report.to_json()["summary"]
    counts = (f"{summary['tensors']} tensors compared: {summary['identical']} identical, "
              f"{summary['equal']} equal within the tolerance, {summary['differing']} "
              f"differing; {len(report.missing)} missing from B, {len(report.unexpected)} "
              f"unexpected in B; {summary['objects_differing']} of {summary['objects']} "
              "non-tensor entries differ.")
    verdict = (f'<p class="{"ok" if report.equal else "problem"}" data-kind="verdict">'
               f'{"Equal" if report.equal else "Different"}: {h.text(counts)}</p>')
    tolerance = (f"<p>Tolerance: atol {report.atol:g}, rtol {report.rtol:g}.</p>"
                 if report.atol or report.rtol else "")
    objects = [o.name for o in report.objects if not o.equal]
    body = [
        h.section("Verdict", verdict, tolerance),
        h.section("Per layer", _per_layer(report.tensors)),
        h.section("Largest changes", _table(report.tensors)),
        _names("Missing from B", report.missing),
        _names("Unexpected in B", report.unexpected),
        _names("Non-tensor entries that differ", tuple(objects)),
    ]
    if report.tied:
        body.append(h.section("Tied", "<ul>" + "".join(
            f"<li><code>{h.text(t.name)}</code> is tied to <code>{h.text(t.tied_to)}</code>"
            f" (left out by {h.text(t.left_out_by.upper())})</li>" for t in report.tied)
            + "</ul>"))
    return h.page("fsdpckpt diff", f"A: {report.a}   B: {report.b}", body)
