"""Drawing reports for people: byte sizes and aligned text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdpckpt._printable import printable

__all__ = ["human_bytes", "table", "render_inspect"]


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


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


def _files_summary(files: Sequence[dict[str, Any]]) -> str:
    """One line for a part's data files: ``"8 rank files, 1.2 GiB, 150.0-160.0 MiB each"``."""
    if not files:
        return "  no data files"
    sizes = [f["size"] for f in files]
    line = f"  {_plural(len(files), 'rank file')}, {human_bytes(sum(sizes))}"
    return line + (f", {_size_range(sizes)} each" if len(files) > 1 else "")


def _side_rows(side_files: Sequence[dict[str, Any]], summary: bool) -> list[list[str]]:
    """Rows for the side files; in a summary, the per-rank files of a kind become one row."""
    rows: list[list[str]] = []
    grouped: dict[Any, list[dict[str, Any]]] = {}
    for f in side_files:
        if summary and f["rank"] is not None:
            grouped.setdefault(f["kind"], []).append(f)
            continue
        rows.append([f["kind"], f["name"], f"rank {f['rank']}" if f["rank"] is not None else "",
                     human_bytes(f["size"])])
    for kind, files in grouped.items():
        files.sort(key=lambda f: f["rank"])
        names = files[0]["name"] if len(files) == 1 else \
            f"{files[0]['name']} .. {files[-1]['name']}"
        rows.insert(0, [kind, names, _plural(len(files), "rank"),
                        human_bytes(sum(f["size"] for f in files))])
    return rows


def _escaped(value: Any) -> Any:
    """``value`` with every string in it (names, paths, messages) made printable."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escaped(v) for v in value]
    return value


def render_inspect(doc: dict[str, Any], *, chunks: bool = False, tensors: bool = True,
                   names: str | None = None) -> str:
    """The human form of :func:`fsdpckpt.inspection.inspect.inspect_checkpoint`'s document.

    Every string from the checkpoint (tensor and file names, paths, problems) is shown
    with control and bidi characters escaped (:func:`fsdpckpt._printable.printable`), so a
    crafted name cannot forge lines or drive the terminal.
    """
    doc = _escaped(doc)
    style = {"dcp": "DCP folder", "accelerate": "Accelerate checkpoint",
             "hf-trainer": "HF Trainer checkpoint"}[doc["style"]]
    world = doc["world_size"] if doc.get("world_size_exact", True) else \
        f"at least {doc['world_size']}"
    out = [f"{doc['path']}: {style}, world size {world}, "
           f"{human_bytes(doc['bytes'])}"]
    out += ["", "Parts:"]
    rows = []
    for part in doc["parts"]:
        if "num_tensors" not in part:
            rows.append([part["kind"], part["name"] + "/", "INCOMPLETE (no .metadata)", "", ""])
            continue
        rows.append([part["kind"], part["name"] + "/",
                     f"{part['num_tensors']} tensors, {part['num_objects']} objects",
                     _plural(len(part["files"]), "rank file"), human_bytes(part["bytes"])])
    out += table(rows, right=(4,))
    if doc["side_files"]:
        out += ["", "Other state:"]
        out += table(_side_rows(doc["side_files"], summary=not tensors), right=(3,))
    if doc["other_files"]:
        out += ["", "Not recognized: " + ", ".join(doc["other_files"])]
    for part in doc["parts"]:
        if "num_tensors" not in part:
            continue
        out += ["", f"{part['name']}/ ({part['kind']}): {part['num_tensors']} tensors, "
                    f"{human_bytes(part['tensor_bytes'])} of tensor data; dtypes: "
                + (", ".join(f"{k} x{v}" for k, v in part["dtypes"].items()) or "none")]
        if tensors:
            out += table([[f["name"], human_bytes(f["size"])] for f in part["files"]], right=(1,))
        else:  # --summary: one line however many ranks
            out.append(_files_summary(part["files"]))
        if tensors and part["tensors"]:
            out.append("")
            rows = []
            for t in part["tensors"]:
                rows.append([t["name"], t["dtype"], _shape(t["shape"]), len(t["chunks"]),
                             t["sharding"], human_bytes(t["bytes"])])
                if chunks:
                    rows += [[f"  @ {_shape(c['offsets'])} size {_shape(c['sizes'])}", "", "",
                              "", f"{c['file']} +{c['offset']}", human_bytes(c["length"])]
                             for c in t["chunks"]]
            out += table(rows, header=["name", "dtype", "shape", "chunks", "sharding", "bytes"],
                         right=(3, 5))
        if tensors and part["objects"]:
            out += ["", "  objects: " + ", ".join(o["name"] for o in part["objects"])]
    listed = [p for p in doc["parts"] if p.get("tensors") or p.get("objects")]
    if names and tensors and not listed:
        out += ["", f"No tensor or object name matches {printable(repr(names))}."]
    if doc["problems"]:
        out += ["", f"Problems ({len(doc['problems'])}):"]
        out += [f"  {p['path']}: {p['message']}" for p in doc["problems"]]
    else:
        out += ["", "Structure: OK (every chunk present, every tensor fully covered)"]
    return "\n".join(out)
