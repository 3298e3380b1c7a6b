"""Drawing reports for people: byte sizes, aligned text tables, and the human form of
:class:`~fsdpckpt.inspection.report.InspectReport`,
:class:`~fsdpckpt.inspection.report.VerifyReport` and
:class:`~fsdpckpt.inspection.diff.DiffReport`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fsdpckpt._printable import human_bytes, printable
from fsdpckpt.dcp.checks import Problem
from fsdpckpt.dcp.layout import SideFile
from fsdpckpt.dcp.metadata import DataFile
from fsdpckpt.inspection._hf_files import HF_FILE_KINDS
from fsdpckpt.inspection.report import (
    AdapterReport,
    InspectReport,
    PartReport,
    TensorReport,
    VerifyReport,
)

if TYPE_CHECKING:  # the diff module pulls in the merge side; inspect need not load it
    from fsdpckpt.inspection.diff import DiffReport

__all__ = ["human_bytes", "table", "render_inspect", "render_verify", "render_diff"]



def _part_name(name: str) -> str:
    """A DCP folder's name with its slash; a set of per-rank files (``..._rank*.bin``) as is."""
    return _p(name) if "*" in name else _p(name) + "/"

def table(rows: Sequence[Sequence[Any]], *, header: Sequence[str] | None = None,
          indent: str = "  ", right: Sequence[int] = ()) -> list[str]:
    """Left-aligned columns (``right`` lists the columns to right-align)."""
    cells = [[str(c) for c in row] for row in ([header] if header else []) + list(rows)]
    if not cells:
        return []
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in
                 enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _size_range(sizes: Sequence[int]) -> str:
    """``"7.5 KiB"`` when all sizes print alike, else ``"7.5-7.7 KiB"`` (or ``"900 B-1.1 KiB"``)."""
    low, high = human_bytes(min(sizes)), human_bytes(max(sizes))
    if low == high:
        return low
    (low_value, low_unit), high_unit = low.split(" "), high.split(" ")[1]
    return f"{low_value}-{high}" if low_unit == high_unit else f"{low}-{high}"


def _files_summary(files: Sequence[DataFile], noun: str = "rank file") -> str:
    """One line for a part's data files: ``"8 rank files, 1.2 GiB, 150.0-160.0 MiB each"``."""
    if not files:
        return "  no data files"
    sizes = [f.size for f in files]
    line = f"  {_plural(len(files), noun)}, {human_bytes(sum(sizes))}"
    return line + (f", {_size_range(sizes)} each" if len(files) > 1 else "")


def _side_rows(side_files: Sequence[SideFile], summary: bool) -> list[list[str]]:
    """Rows for the side files; in a summary, the per-rank files of a kind become one row."""
    rows: list[list[str]] = []
    grouped: dict[str, list[SideFile]] = {}
    for f in side_files:
        if summary and f.rank is not None:
            grouped.setdefault(f.kind, []).append(f)
            continue
        rows.append([_p(f.kind), _p(f.name), f"rank {f.rank}" if f.rank is not None else "",
                     human_bytes(f.size)])
    for kind, files in grouped.items():
        files.sort(key=lambda f: f.rank or 0)
        names = _p(files[0].name) if len(files) == 1 else \
            f"{_p(files[0].name)} .. {_p(files[-1].name)}"
        rows.insert(0, [_p(kind), names, _plural(len(files), "rank"),
                        human_bytes(sum(f.size for f in files))])
    return rows


def _p(value: object) -> str:
    """``value`` as text with control and bidi characters escaped: every string that comes
    from a checkpoint (names, paths, messages) goes through here before it is shown."""
    return printable(str(value))


def _tensor_rows(tensor: TensorReport, chunks: bool) -> list[list[Any]]:
    rows: list[list[Any]] = [list(tensor.cells())]
    if chunks:
        rows += [[f"  @ {_shape(c.offsets)} size {_shape(c.sizes)}", "", "", "",
                  f"{_p(c.file)} +{c.offset}", human_bytes(c.length)] for c in tensor.chunks]
    return rows


def _part_lines(part: PartReport, *, chunks: bool, tensors: bool,
                whole: bool = False) -> list[str]:
    """A complete part's section: its dtypes, files, and (unless a summary) its tensors;
    ``whole``: a model file's, whose files hold whole tensors, not ranks' shards."""
    name = _p(part.name) if whole else _part_name(part.name)
    out = ["", f"{name} ({_p(part.kind)}): {part.num_tensors} tensors, "
               f"{human_bytes(part.tensor_bytes)} of tensor data; dtypes: "
           + (", ".join(f"{_p(k)} x{v}" for k, v in part.dtypes.items()) or "none")]
    if tensors:
        out += table([[_p(f.name), human_bytes(f.size)] for f in part.files], right=(1,))
    else:  # --summary: one line however many ranks
        out.append(_files_summary(part.files, "file" if whole else "rank file"))
    if tensors and part.tensors:
        out.append("")
        rows = [row for t in part.listed() for row in _tensor_rows(t, chunks)]
        out += table(rows, header=["name", "dtype", "shape", "chunks", "sharding", "bytes"],
                     right=(3, 5))
    if tensors and part.objects:
        out += ["", "  objects: " + ", ".join(_p(o.name) for o in part.objects)]
    return out


def _problem_lines(problems: Sequence[Problem]) -> list[str]:
    return [f"  {_p(p.path)}: {_p(p.message)}" for p in problems]


def _adapter_line(adapter: AdapterReport) -> str:
    # One line: what the fused weights depend on (rank, alpha, targets, the variants).
    targets = adapter.target_modules
    shown = ", ".join(targets) if isinstance(targets, tuple) else (targets or "none given")
    variants = [v for v, on in (("rsLoRA", adapter.use_rslora), ("DoRA", adapter.use_dora)) if on]
    return (f"LoRA adapter ({_p(adapter.file)}): r={adapter.r}, lora_alpha="
            f"{adapter.lora_alpha:g}, targets {_p(shown)}"
            + (f", {' + '.join(variants)}" if variants else "")
            + "; export it with export-hf --lora adapter or --lora fuse")


def render_inspect(report: InspectReport, *, chunks: bool = False, tensors: bool = True,
                   names: str | None = None) -> str:
    """The human form of what :func:`fsdpckpt.inspection.inspect.inspect_checkpoint` found.

    Every string from the checkpoint (tensor and file names, paths, problems) is shown
    with control and bidi characters escaped (:func:`fsdpckpt._printable.printable`), so a
    crafted name cannot forge lines or drive the terminal.

    Args:
        report: what to draw.
        chunks: also list every chunk of every tensor listed.
        tensors: list each part's files and tensors; False gives the summary
            (``--summary``): each part's rank files on one line, per-rank side files grouped.
        names: the pattern the report was filtered by, to say so when nothing matched.
    """
    style = {"dcp": "DCP folder", "accelerate": "Accelerate checkpoint",
             "hf-trainer": "HF Trainer checkpoint", "verl": "VeRL checkpoint",
             "hf-storage": "HuggingFaceStorageWriter save", "model-file": "model file",
             "model-folder": "model folder (merged or Hugging Face)",
             "lightning": "Lightning checkpoint", "torchtune": "torchtune checkpoint",
             "torchtitan": "torchtitan checkpoint"}[report.style]
    world = report.world_size if report.world_size_exact else f"at least {report.world_size}"
    whole = report.style in ("model-file", "model-folder")  # no ranks: every tensor whole
    # An unfinished save: said first; its world size is unknown where no rank's file is in.
    unfinished = "UNFINISHED save (it never completed), " if report.unfinished else ""
    known = not whole and (report.world_size or not report.unfinished)
    out = [f"{_p(report.path)}: {unfinished}{style}, "
           + (f"world size {world}, " if known else "") + human_bytes(report.bytes)]
    out += ["", "Parts:"]
    rows = []
    for part in report.parts:
        if not part.complete:
            rows.append([_p(part.kind), _part_name(part.name), "INCOMPLETE (no .metadata)", "",
                         ""])
            continue
        rows.append([_p(part.kind), _p(part.name) if whole else _part_name(part.name),
                     "rank-local state (not mergeable)" if part.rank_local else
                     f"{part.num_tensors} tensors, {part.num_objects} objects",
                     _plural(len(part.files), "file" if whole else "rank file"),
                     human_bytes(part.bytes)])
    out += table(rows, right=(4,))
    state = [f for f in report.side_files if f.kind not in HF_FILE_KINDS]
    hf_files = [f for f in report.side_files if f.kind in HF_FILE_KINDS]
    if state:
        out += ["", "Other state:"]
        out += table(_side_rows(state, summary=not tensors), right=(3,))
    if hf_files:
        out += ["", "Hugging Face files:"]
        out += table(_side_rows(hf_files, summary=False), right=(3,))
    if report.adapter is not None:
        out += ["", _adapter_line(report.adapter)]
    if report.other_files:
        out += ["", "Not recognized: " + ", ".join(map(_p, report.other_files))]
    for part in report.parts:
        if part.rank_local:
            out += ["", f"{_part_name(part.name)} ({_p(part.kind)}): {_p(part.rank_local)}"]
        elif part.complete:
            out += _part_lines(part, chunks=chunks, tensors=tensors, whole=whole)
    listed = [p for p in report.parts if p.tensors or p.objects]
    if names and tensors and not listed:
        out += ["", f"No tensor or object name matches {printable(repr(names))}. A pattern "
                "matches a name as stored (as listed here) or as merge writes it (without "
                "the part's top-level key, such as 'model.', and wrapper segments)."]
    if report.problems:
        out += ["", f"Problems ({len(report.problems)}):"]
        out += _problem_lines(report.problems)
    elif whole:
        out += ["", "Structure: OK (every header read, every file long enough)"]
    else:
        out += ["", "Structure: OK (every chunk present, every tensor fully covered)"]
    return "\n".join(out)


def render_verify(report: VerifyReport, path: str) -> str:
    """The human form of what :func:`fsdpckpt.inspection.verify.verify_checkpoint` found:
    each problem on a line, then the verdict, then the manifest's digest when there is one.

    ``path`` is the checkpoint as the user named it. Strings from the checkpoint are
    escaped as in :func:`render_inspect`.
    """
    out = [f"{_p(p.path)}: {_p(p.message)}" for p in report.problems]
    model = report.style in ("model-file", "model-folder")  # an export's or a merge's output
    how = "every byte checked against the manifest" if report.manifest else \
        "model files: structure checked, every tensor byte read, .bin data against its " \
        "zip CRC-32s" if model else \
        "no manifest: chunk headers and data checked against their own checksums"
    if report.unfinished and not report.ok:
        out.append(f"{_p(path)}: UNFINISHED (a save that never completed: not a checkpoint, "
                   "and nothing to repair; use an earlier one)")
    else:
        out.append(f"{_p(path)}: {'OK' if report.ok else 'DAMAGED'} ({how})")
    if report.unchecked:
        count = len(report.unchecked)
        fix = "structure checked and every byte read, but a changed byte cannot be seen; " \
            "diff it against its source checkpoint to check the values" if model else \
            "their structure was checked, not their data bytes; save with " \
            "fsdpckpt.save_state (a manifest) to have every byte checked"
        out.append(f"unchecked: {count} file{'s' * (count != 1)} record no checksums "
                   f"(safetensors): {fix}")
    if report.manifest_digest:
        files = f"files carry {report.digest}" if report.digest else \
            "files carry CRC-32 only: save with digest='sha256' to detect deliberate changes"
        out.append(f"manifest digest: {report.manifest_digest} ({files})")
    return "\n".join(out)


_SHOWN_NAMES = 20  # missing or unexpected names listed in full; the rest are counted


def _names_line(label: str, names: Sequence[str]) -> list[str]:
    if not names:
        return []
    shown = ", ".join(map(_p, names[:_SHOWN_NAMES]))
    more = f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else ""
    return [f"{label} ({len(names)}): {shown}{more}"]


def _float(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def render_diff(report: DiffReport) -> str:
    """The human form of what :func:`fsdpckpt.inspection.diff.diff` found: missing and
    unexpected names, a table of the tensors that differ, the objects that differ, and a
    summary line that starts with ``EQUAL`` or ``DIFFERENT`` (followed only by why names
    were not mapped to a Hugging Face folder's, where they were not). Names are escaped as in
    :func:`render_inspect`."""
    out = [f"A: {_p(report.a)}", f"B: {_p(report.b)}"]
    out += _names_line("missing (in A, not in B)", report.missing)
    out += _names_line("unexpected (in B, not in A)", report.unexpected)
    if report.names is not None and report.names.converted is not None:
        out.append(_p(report.names.said()))  # a checkpoint read under its export's names
    for tie in report.tied:  # an export's tied target: compared with what it is tied to
        side, other = tie.left_out_by.upper(), "B" if tie.left_out_by == "a" else "A"
        verdict = "equal" if all(t.equal for t in report.tensors if t.name == tie.name) \
            else "DIFFERENT"
        out.append(f"tied: {_p(tie.name)} is not in {side}, whose config ties it to "
                   f"{_p(tie.tied_to)}; {other}'s {_p(tie.name)} against {side}'s "
                   f"{_p(tie.tied_to)}: {verdict}")
    rows = []
    for t in report.differing:
        dtype = _p(t.dtype_a) if not t.dtype_differs else f"{_p(t.dtype_a)} -> {_p(t.dtype_b)}"
        shape = _shape(t.shape_a) if not t.shape_differs else \
            f"{_shape(t.shape_a)} -> {_shape(t.shape_b)}"
        rows.append([_p(t.name), dtype, shape, _float(t.max_abs), _float(t.max_rel),
                     f"{t.mismatched}/{t.numel}" if not t.shape_differs else "shape differs"])
    if rows:
        out += ["", f"Tensors that differ ({len(rows)}):"]
        out += table(rows, header=["name", "dtype", "shape", "max abs", "max rel",
                                   "mismatched"], right=(3, 4, 5))
    changed = [t for t in report.tensors if t.equal and t.dtype_differs]
    if changed:
        out += ["", f"Equal within the tolerance, dtype changed ({len(changed)}): "
                + ", ".join(f"{_p(t.name)} ({_p(t.dtype_a)} -> {_p(t.dtype_b)})"
                            for t in changed[:_SHOWN_NAMES])
                + (" ..." if len(changed) > _SHOWN_NAMES else "")]
    out += _names_line("objects that differ", [o.name for o in report.objects if not o.equal])
    identical = sum(t.identical for t in report.tensors)
    tolerance = f"atol {report.atol:g}, rtol {report.rtol:g}"
    if report.equal:
        out += ["", f"EQUAL: {_plural(len(report.tensors), 'tensor')} ({identical} "
                    f"bit-identical), {_plural(len(report.objects), 'object')} ({tolerance})"]
    else:
        wrong = sum(not o.equal for o in report.objects)
        out += ["", f"DIFFERENT: {len(report.differing)} of "
                    f"{_plural(len(report.tensors), 'tensor')} differ, {wrong} of "
                    f"{_plural(len(report.objects), 'object')}, {len(report.missing)} missing, "
                    f"{len(report.unexpected)} unexpected ({tolerance})"]
    if report.names is not None and report.names.converted is None:
        out.append(_p(report.names.said()))  # why names were not mapped: after the verdict
    return "\n".join(out).lstrip("\n")
