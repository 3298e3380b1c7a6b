"""``fsdpckpt inspect --html``: a checkpoint at a glance, as one self-contained page.

Built from the :class:`~fsdpckpt.inspection.report.InspectReport` alone (what ``inspect``
and ``--json`` show), so the page says nothing the text output does not: bytes by part,
by rank file and by dtype; a shard map; the sharding kinds in the text output's words; every
problem in its words; the training-state files; each part's tensors by name, as the text
output's table has them, with a box to find one. For thousands of ranks and tensors it
aggregates: the shard map groups tensors by layer pattern
(``layers.{0-79}.mlp.up_proj.weight``) and ranks in bands of at most :data:`MAX_BANDS`
columns, and the table of tensors stops at :data:`MAX_TENSOR_ROWS`, so the page stays small.

Only the problems are flagged: rank files of one part differ in size by what DCP put in each
(an optimizer's param groups and step counters are stored once, on one rank), which needs
no action; a file shorter than what ``.metadata`` places in it is a problem ``inspect``
reports already (``the file is truncated``).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable

from fsdpckpt._printable import human_bytes
from fsdpckpt.dcp.metadata import rank_of_file
from fsdpckpt.inspection import _html as h
from fsdpckpt.inspection.report import InspectReport, PartReport

__all__ = ["inspect_html", "layer_pattern", "MAX_BANDS", "MAX_GROUPS", "MAX_TENSOR_ROWS"]

#: The most rank columns of a shard map: more ranks are shown in bands.
MAX_BANDS = 64
#: The most tensor groups a shard map shows (the rest summed in one row).
MAX_GROUPS = 120
#: The most tensors a part's table lists by name (150-300 bytes of page each: at most about
#: a megabyte a part); the rest are counted, and ``--json`` or ``--name`` shows them.
MAX_TENSOR_ROWS = 5000
#: Side files listed one by one up to this many; beyond, by kind.
MAX_SIDE_FILES = 64

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def layer_pattern(name: str) -> str:
    """``name`` with each numeric segment replaced by ``{}``: the key tensors are grouped by
    (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.{}.mlp.up_proj.weight``)."""
    return _NUMBER.sub("{}", name)


def _ranges(numbers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _groups(names: list[str]) -> tuple[list[str], list[int]]:
    """Group labels (numbers shown as ranges, ``layers.{0-79}.mlp.up_proj.weight``) and the
    group of each name, in the order groups are first seen."""
    keys: dict[str, int] = {}
    numbers: dict[str, list[list[int]]] = {}
    of = []
    for name in names:
        key = layer_pattern(name)
        found = [int(m.group()) for m in _NUMBER.finditer(name)]
        if key not in keys:
            keys[key] = len(keys)
            numbers[key] = [[] for _ in found]
        for slot, value in zip(numbers[key], found):
            slot.append(value)
        of.append(keys[key])
    labels = []
    for key in keys:
        pieces = key.split("{}")
        shown = [pieces[0]]
        for seen, piece in zip(numbers[key], pieces[1:]):
            shown += ["{" + _ranges(seen) + "}", piece]
        labels.append("".join(shown))
    return labels, of


def _bands(world: int) -> tuple[list[str], int]:
    per = max(1, -(-world // MAX_BANDS))
    labels = [f"r{r}" if per == 1 else f"r{r}-{min(r + per, world) - 1}"
              for r in range(0, world, per)]
    return labels, per


def _shard_map(part: PartReport) -> str:
    world = max(part.world_size, 1)
    columns, per = _bands(world)
    other = len(columns)
    band_of: dict[str | None, int] = {}
    labels, group_of = _groups([t.name for t in part.tensors])
    if len(labels) > MAX_GROUPS:
        labels = labels[:MAX_GROUPS - 1] + [f"{len(labels) - MAX_GROUPS + 1} more groups"]
        group_of = [min(g, MAX_GROUPS - 1) for g in group_of]
    cells: dict[tuple[int, int], float] = defaultdict(float)
    extra = False
    for tensor, group in zip(part.tensors, group_of):
        for chunk in tensor.chunks:  # the report's own chunks: no more than inspect made
            band = band_of.get(chunk.file)
            if band is None:
                rank = rank_of_file(chunk.file) if chunk.file else None
                band = other if rank is None or rank >= world else rank // per
                band_of[chunk.file] = band
            extra |= band == other
            cells[(group, band)] += chunk.length
    if extra:
        columns = [*columns, "other"]
    return h.heat_map(labels, columns, cells, human_bytes)


def _part(part: PartReport) -> str:
    if not part.complete:
        return h.section(f"{part.name}: not finished",
                         "<p class=problem>no .metadata: its save never finished</p>")
    files = [(f.name, float(f.size)) for f in part.files]
    sizes = sorted(v for _, v in files)
    kinds = Counter(t.sharding for t in part.tensors)
    kind_bytes: Counter[str] = Counter()
    for t in part.tensors:
        kind_bytes[t.sharding] += t.bytes
    sharding = h.sortable_table(
        [("sharding", False), ("tensors", True), ("bytes", True)],
        [[(k, k), (str(n), n), (human_bytes(kind_bytes[k]), kind_bytes[k])]
         for k, n in kinds.most_common()], kind=f"sharding:{part.name}")
    spread = (f"<p>{len(files)} rank files, {h.text(human_bytes(sizes[0]))} to "
              f"{h.text(human_bytes(sizes[-1]))} each, one column per file.</p>"
              if sizes else "")
    return h.section(
        f"{part.name} ({part.kind}): {part.num_tensors} tensors, world size "
        f"{part.world_size}{'' if part.world_size_exact else '+'}",
        f"<p>{h.text(human_bytes(part.bytes))} in {len(part.files)} files; tensors "
        f"{h.text(human_bytes(part.tensor_bytes))} unsharded.</p>",
        "<h3>Bytes by rank file</h3>", h.columns(files, human_bytes, kind=f"file:{part.name}"),
        spread, "<h3>Sharding</h3>", sharding,
        "<h3>Shard map (stored bytes, tensors by ranks)</h3>" if part.tensors else "",
        _shard_map(part) if part.tensors else "", _tensor_table(part))


def _tensor_table(part: PartReport) -> str:
    """The part's tensors, as the text output lists them (``PartReport.listed``), with a
    box that hides the rows whose name does not hold what is typed (``_html``'s script;
    ``#q=...`` fills it)."""
    if not part.tensors:
        return "" if not part.num_tensors else \
            "<h3>Tensors</h3><p>none of its tensors matches the name given (--name)</p>"
    listed = part.listed()[:MAX_TENSOR_ROWS]
    rows = []
    for t in listed:
        name, dtype, shape, count, sharding, size = t.cells()
        numel = 1
        for n in t.shape:
            numel *= n
        rows.append([(str(name), None), (str(dtype), None), (str(shape), numel),
                     (str(count), count if isinstance(count, int) else None),
                     (str(sharding), None), (str(size), t.bytes)])
    table = h.sortable_table(
        [("name", False), ("dtype", False), ("shape", False), ("chunks", True),
         ("sharding", False), ("bytes", True)], rows, kind=f"tensors:{part.name}")
    said = [f"{len(part.tensors):,} of {part.num_tensors:,} tensors match the name given "
            "(--name)." if len(part.tensors) < part.num_tensors else ""]
    if len(part.tensors) > len(listed):
        said.append(f"The first {len(listed):,} by name are listed; "
                    f"{len(part.tensors) - len(listed):,} more tensors are not: "
                    "<code>fsdpckpt inspect --json</code> lists them all, "
                    "<code>fsdpckpt inspect --name PATTERN --html FILE</code> makes a page of "
                    "those matching.")
    note = " ".join(x for x in said if x)
    return ("<h3>Tensors</h3>" + (f"<p>{note}</p>" if note else "")
            + h.find_box(f"tensors:{part.name}", table))


def _side_files(report: InspectReport) -> str:
    files = report.side_files
    if not files:
        return "<p>none</p>"
    if len(files) <= MAX_SIDE_FILES:
        return h.sortable_table(
            [("file", False), ("holds", False), ("rank", True), ("bytes", True)],
            [[(f.name, f.name), (f.kind, f.kind),
              ("" if f.rank is None else str(f.rank), f.rank),
              (human_bytes(f.size), f.size)] for f in files], kind="side-files")
    by_kind: dict[str, list[int]] = defaultdict(list)
    for f in files:
        by_kind[f.kind].append(f.size)
    return h.sortable_table(
        [("holds", False), ("files", True), ("bytes", True)],
        [[(k, k), (str(len(v)), len(v)), (human_bytes(sum(v)), sum(v))]
         for k, v in by_kind.items()], kind="side-files")


def inspect_html(report: InspectReport) -> str:
    """The page for ``report``."""
    verdict = ("<p class=ok>The structure is whole: no problems found.</p>" if report.ok else
               f"<p><b>{len(report.problems)} problem{'s' * (len(report.problems) != 1)}"
               "</b>: the checkpoint is not whole.</p>" + "".join(
                   f'<p class="problem" data-kind="problem">{h.text(p.path)}: '
                   f"{h.text(p.message)}</p>" for p in report.problems))
    parts = [p for p in report.parts if p.complete]
    dtype_bytes: Counter[str] = Counter()
    for part in parts:
        for t in part.tensors:
            dtype_bytes[t.dtype.name] += t.bytes
    body = [
        h.section("Verdict", verdict),
        h.section("Bytes by part", h.bars([(p.name, float(p.bytes)) for p in parts],
                                          human_bytes, kind="part")),
        h.section("Tensor bytes by dtype (unsharded)",
                  h.bars([(k, float(v)) for k, v in dtype_bytes.most_common()],
                         human_bytes, kind="dtype")),
        *(_part(p) for p in report.parts),
        h.section("Training state beside the model", _side_files(report)),
    ]
    if report.other_files:
        body.append(h.section("Other files", "<p>" + ", ".join(
            f"<code>{h.text(n)}</code>" for n in report.other_files) + "</p>"))
    return h.page(f"fsdpckpt inspect: {report.path}",
                  f"{report.style} checkpoint, world size {report.world_size}"
                  f"{'' if report.world_size_exact else '+'}, {human_bytes(report.bytes)}",
                  body)
