"""The pieces of fsdpckpt's HTML reports (``inspect --html``, ``diff --html``): one
self-contained page, inline CSS and SVG, a few lines of inline script, nothing fetched.

Every string from a checkpoint (tensor and file names, paths, problems) goes through
:func:`text`: HTML-escaped (``<``, ``&`` and both quotes), and with control and bidi
characters shown as escapes as the text output shows them, so a name such as
``<script>...`` is shown as text and never parsed as markup. Every number a chart or a table
shows carries its exact value in a ``data-value`` attribute, which the browser test
compares with the ``--json`` document.

The script sorts a table by a click on its header, hides the rows of a :func:`find_box`'s
table whose first cell does not hold what is typed in its box (any case; ``page.html#q=bias``
opens the page with ``bias`` typed in every box), and marks the page: ``data-ready="1"``
on ``<html>`` once it ran, ``data-error`` with the message if anything on the page threw.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from fsdpckpt._printable import printable

__all__ = ["text", "page", "bars", "columns", "heat_map", "lines", "sortable_table",
           "find_box", "section", "write_page", "COLORS"]

#: Colours of series (module kinds, dtypes): distinct, readable on white.
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
          "#e377c2", "#7f7f7f", "#bcbd22")

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#666;margin:0 0 12px;word-break:break-all}
.problem{background:#fdecea;border-left:4px solid #d62728;padding:6px 10px;margin:4px 0}
.ok{background:#e8f5e9;border-left:4px solid #2ca02c;padding:6px 10px}
.note{background:#fff8e1;border-left:4px solid #ff9800;padding:6px 10px;margin:4px 0}
table{border-collapse:collapse;margin:6px 0} th,td{padding:3px 8px;text-align:left;
border-bottom:1px solid #eee;font-variant-numeric:tabular-nums} td.n,th.n{text-align:right}
th.sort{cursor:pointer;user-select:none} th.sort:after{content:" \\2195";color:#aaa}
code{font-size:13px;word-break:break-all} input[type=search]{font:inherit;width:360px}
svg{display:block;margin:6px 0} .legend span{
margin-right:14px} .legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
"""

_SCRIPT = """
(function(){
var root=document.documentElement;
window.addEventListener("error",function(e){root.setAttribute("data-error",String(e.message));});
function key(cell){var v=cell.getAttribute("data-value");
  if(v===null)return cell.textContent;var n=Number(v);return isNaN(n)?(v==="inf"?Infinity:v):n;}
document.querySelectorAll("table.sortable").forEach(function(t){
  t.querySelectorAll("th.sort").forEach(function(th,col){th.addEventListener("click",function(){
    var body=t.tBodies[0],rows=Array.prototype.slice.call(body.rows);
    var down=th.getAttribute("data-down")!=="1";th.setAttribute("data-down",down?"1":"0");
    rows.sort(function(a,b){var x=key(a.cells[col]),y=key(b.cells[col]);
      return (x<y?-1:x>y?1:0)*(down?-1:1);});
    rows.forEach(function(r){body.appendChild(r);});});});});
var asked=/(?:^#|&)q=([^&]*)/.exec(location.hash),typed="";
try{typed=asked?decodeURIComponent(asked[1].replace(/\\+/g," ")):"";}catch(e){}
document.querySelectorAll("div.find").forEach(function(d){
  var box=d.querySelector("input"),rows=d.querySelector("tbody").rows,found=d.querySelector("span");
  function filter(){var s=box.value.toLowerCase(),n=0;
    for(var i=0;i<rows.length;i++){var hit=rows[i].cells[0].textContent.toLowerCase().indexOf(s)>=0;
      rows[i].hidden=!hit;n+=hit?1:0;}
    found.textContent=s?n+" of "+rows.length+" shown":"";}
  box.value=typed;box.addEventListener("input",filter);filter();});
root.setAttribute("data-ready","1");
})();
"""


def write_page(path: str, document: str, *, storage_options: dict | None = None) -> str:
    """Write ``document`` as the file ``path`` (replaced whole: written beside it and
    renamed; one PUT on object storage); the path as written.

    Raises:
        OutputNotWritableError: ``path`` is a folder, or cannot be written.
    """
    from fsdpckpt._io.remote import location
    from fsdpckpt._io.storage import put_bytes
    from fsdpckpt.errors import OutputNotWritableError

    place = location(path, storage_options=storage_options)
    if place.is_dir():
        raise OutputNotWritableError(21, f"{path}: is a folder; pass a file name for the "
                                     "report, such as report.html")
    try:
        put_bytes(place, document.encode("utf-8"), atomic=True)
    except OSError as exc:
        raise OutputNotWritableError(exc.errno or 5, f"{path}: cannot write the report "
                                     f"({exc.strerror or exc}); check the folder exists and "
                                     "is writable") from None
    return str(place)


def text(value: object) -> str:
    """A string from a checkpoint, safe as HTML text or attribute value."""
    return html.escape(printable(value), quote=True)


def number(value: float | None) -> str:
    """The ``data-value`` form of a number (as ``--json`` writes it: ``inf`` as text)."""
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value)


def page(title: str, subtitle: str, body: Sequence[str]) -> str:
    """The whole document."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
            f"<title>{text(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{text(title)}</h1><p class=\"sub\">{text(subtitle)}</p>"
            + "".join(body) + f"<script>{_SCRIPT}</script></body></html>\n")


def section(title: str, *parts: str) -> str:
    return f"<h2>{text(title)}</h2>" + "".join(parts)


def bars(items: Sequence[tuple[str, float]], fmt: Callable[[float], str], *, kind: str) -> str:
    """A horizontal bar chart: one bar per ``(label, value)``, its value shown by
    ``fmt(value)``; each bar's ``<g>`` carries ``data-kind``, ``data-label`` and
    ``data-value``."""
    if not items:
        return "<p>none</p>"
    top = max(v for _, v in items) or 1
    height, width = 20, 360
    rows = []
    for i, (label, value) in enumerate(items):
        w = max(1.0, width * value / top) if value else 0.0
        y = i * height
        rows.append(
            f'<g data-kind="{text(kind)}" data-label="{text(label)}" '
            f'data-value="{number(value)}"><title>{text(label)}: {text(fmt(value))}</title>'
            f'<text x="0" y="{y + 14}" font-size="12">{text(_short(label, 40))}</text>'
            f'<rect x="260" y="{y + 3}" width="{w:.1f}" height="14" fill="{COLORS[0]}"/>'
            f'<text x="{266 + w:.1f}" y="{y + 14}" font-size="12">'
            f"{text(fmt(value))}</text></g>")
    return (f'<svg width="{260 + width + 120}" height="{height * len(items) + 4}" '
            f'role="img">{"".join(rows)}</svg>')


def columns(items: Sequence[tuple[str, float]], fmt: Callable[[float], str], *,
            kind: str) -> str:
    """A column per ``(label, value)``, side by side, thin when there are many (a rank file
    each, for a thousand ranks); a column far from the others stands out."""
    if not items:
        return "<p>none</p>"
    top = max(v for _, v in items) or 1
    step = max(1, min(24, 960 // len(items)))
    height = 120
    out = []
    for i, (label, value) in enumerate(items):
        h = height * value / top
        out.append(f'<rect x="{i * step}" y="{height - h:.1f}" width="{max(step - 1, 1)}" '
                   f'height="{h:.1f}" fill="{COLORS[0]}" data-kind="{text(kind)}" '
                   f'data-label="{text(label)}" data-value="{number(value)}"><title>'
                   f"{text(label)}: {text(fmt(value))}</title></rect>")
    return (f'<svg width="{step * len(items) + 2}" height="{height + 2}" role="img">'
            f'{"".join(out)}</svg>')


def heat_map(rows: Sequence[str], columns: Sequence[str], cells: dict[tuple[int, int], float],
             fmt: Callable[[float], str]) -> str:
    """A grid: ``cells[(row, column)]`` its value (absent: none), darker for more."""
    top = max(cells.values(), default=0) or 1
    size, left, head = 12, 330, 70
    out = []
    for r, label in enumerate(rows):
        out.append(f'<text x="0" y="{head + r * size + 10}" font-size="11"><title>'
                   f"{text(label)}</title>{text(_short(label, 52))}</text>")
    for c, label in enumerate(columns):
        x = left + c * size + 9
        out.append(f'<text transform="translate({x},{head - 4}) rotate(-60)" font-size="10">'
                   f"{text(label)}</text>")
    for (r, c), value in sorted(cells.items()):
        shade = 0.15 + 0.85 * math.sqrt(value / top)
        out.append(f'<rect class="cell" x="{left + c * size}" y="{head + r * size}" '
                   f'width="{size - 1}" height="{size - 1}" fill="{_blue(shade)}" '
                   f'data-row="{r}" data-column="{c}" data-value="{number(value)}"><title>'
                   f"{text(rows[r])} / {text(columns[c])}: {text(fmt(value))}</title></rect>")
    return (f'<svg width="{left + size * len(columns) + 20}" '
            f'height="{head + size * len(rows) + 10}" role="img">{"".join(out)}</svg>')


def lines(series: dict[str, list[tuple[int, float]]], *, x_label: str, y_label: str) -> str:
    """A line chart: one line per series, points ``(x, y)``; the y axis is logarithmic
    when the values span more than two decades (relative changes often do)."""
    points = [(x, y) for pts in series.values() for x, y in pts if math.isfinite(y)]
    if not points:
        return "<p>no layered tensors to plot</p>"
    if len({x for x, _ in points}) < 3:  # too few layers for a line: one bar each
        return bars([(f"{name}, layer {x}", y) for name, pts in series.items()
                     for x, y in sorted(pts)], lambda v: f"{v:.4g}", kind=y_label)
    width, height, left, bottom = 760, 260, 60, 30
    xs = [x for x, _ in points]
    positive = [y for _, y in points if y > 0]
    log = bool(positive) and max(positive) / min(positive) > 100
    lo_x, hi_x = min(xs), max(max(xs), min(xs) + 1)

    def y_of(y: float) -> float:
        if log:
            lo, hi = math.log10(min(positive)), math.log10(max(positive))
            v = (math.log10(y) - lo) / ((hi - lo) or 1) if y > 0 else 0
        else:
            top = max(y for _, y in points) or 1
            v = y / top
        return 10 + (height - bottom - 10) * (1 - v)

    top_y = max(y for _, y in points)
    low_y = min(positive) if log else 0.0

    def x_of(x: float) -> float:
        return left + (width - left - 10) * (x - lo_x) / (hi_x - lo_x)

    out = [f'<line x1="{left}" y1="{height - bottom}" x2="{width}" y2="{height - bottom}" '
           'stroke="#999"/>', f'<line x1="{left}" y1="10" x2="{left}" y2="{height - bottom}" '
           'stroke="#999"/>',
           f'<text x="{width // 2}" y="{height - 4}" font-size="12">{text(x_label)}</text>',
           f'<text x="2" y="12" font-size="12">{text(y_label)}{" (log)" if log else ""}</text>',
           f'<text x="{left}" y="{height - bottom + 14}" font-size="11">{lo_x}</text>',
           f'<text x="2" y="{y_of(top_y) + 4:.1f}" font-size="11">{top_y:.3g}</text>',
           f'<text x="2" y="{y_of(low_y) + 4:.1f}" font-size="11">{low_y:.3g}</text>',
           f'<text x="{width - 20}" y="{height - bottom + 14}" font-size="11">{hi_x}</text>']
    legend = []
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        shown = [(x, y) for x, y in sorted(pts) if math.isfinite(y)]
        path = " ".join(f"{x_of(x):.1f},{y_of(y):.1f}" for x, y in shown)
        out.append(f'<g data-series="{text(name)}"><polyline fill="none" stroke="{color}" '
                   f'stroke-width="1.5" points="{path}"/>')
        out += [f'<circle cx="{x_of(x):.1f}" cy="{y_of(y):.1f}" r="2.5" fill="{color}" '
                f'data-x="{x}" data-value="{number(y)}"><title>{text(name)} {x}: {y:.3g}'
                "</title></circle>" for x, y in shown]
        out.append("</g>")
        legend.append(f'<span><i style="background:{color}"></i>{text(name)}</span>')
    return (f'<svg width="{width}" height="{height}" role="img">{"".join(out)}</svg>'
            f'<div class="legend">{"".join(legend)}</div>')


def sortable_table(header: Sequence[tuple[str, bool]], rows: Sequence[Sequence[tuple[str,
                   object]]], *, kind: str) -> str:
    """A table sorted by a click on a header; ``header`` is ``(title, numeric)`` per column,
    each cell ``(shown text, data-value or None)``."""
    head = "".join(f'<th class="sort{" n" if numeric else ""}">{text(title)}</th>'
                   for title, numeric in header)
    body = []
    for row in rows:
        cells = []
        for (shown, value), (_title, numeric) in zip(row, header):
            attr = "" if value is None else f' data-value="{text(number(value) if isinstance(value, float) else value)}"'  # noqa: E501
            cells.append(f'<td{" class=n" if numeric else ""}{attr}>{text(shown)}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<table class="sortable" data-kind="{text(kind)}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def find_box(kind: str, table: str) -> str:
    """``table`` (a :func:`sortable_table`) under a search box that hides the rows whose first
    cell does not hold what is typed."""
    return (f'<div class="find"><p><input type="search" placeholder="find by name" '
            f'aria-label="find by name" data-kind="find:{text(kind)}"> <span></span></p>'
            f"{table}</div>")


def _short(label: str, most: int) -> str:
    return label if len(label) <= most else label[: most // 2 - 1] + "…" + label[-most // 2:]


def _blue(shade: float) -> str:
    # From a pale blue (little) to a deep one (the most).
    low, high = (222, 235, 247), (8, 48, 107)
    r, g, b = (round(lo + (hi - lo) * shade) for lo, hi in zip(low, high))
    return f"rgb({r},{g},{b})"
