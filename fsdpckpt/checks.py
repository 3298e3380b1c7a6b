"""Structural checks of a DCP folder, from its metadata and file sizes alone.

They answer "is this folder whole?" without reading tensor data: every chunk
has a storage entry inside a file that exists and is long enough, and the
chunks of each tensor tile it exactly (no gap, no overlap). Problems are
collected, never raised, so a user sees all of them.

A rank with no data file is not a problem by itself: with
``FileSystemWriter(single_file_per_rank=False)`` each rank writes one file per
item (``__{rank}_0.distcp``, ``__{rank}_1.distcp``...) and a rank with nothing
to write writes none. ``.metadata`` names every file a load needs, and each of
those is checked. It does not record the world size, which
:func:`known_world_size` therefore gives as a lower bound when the files
cannot tell it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .metadata import Chunk, TensorEntry
from .reader import DcpFolder

__all__ = ["Problem", "check_folder", "check_tensor_chunks", "known_world_size"]

_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        path: the file or folder concerned.
        message: what is wrong, naming the entry where there is one.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _overlaps(a: Chunk, b: Chunk) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def check_tensor_chunks(tensor: TensorEntry) -> list[str]:
    """Say how the chunks of ``tensor`` fail to tile its shape exactly (empty if they do)."""
    shape, found = tensor.shape, []
    if not tensor.chunks:
        return ["has no chunks"]
    for chunk in tensor.chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            found.append(f"chunk at {list(chunk.offsets)} has {len(chunk.sizes)} dims, "
                         f"the tensor has {len(shape)}")
        elif any(o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape)):
            found.append(f"chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} reaches "
                         f"outside the shape {list(shape)}")
    if found:
        return found
    chunks = sorted(tensor.chunks, key=lambda c: c.offsets)
    # Sorted by offsets, an overlapping pair is usually adjacent; the full scan
    # only runs for the rare tensor whose chunk volumes do not add up.
    total = sum(c.numel for c in chunks)
    pairs = zip(chunks, chunks[1:]) if total == tensor.numel else (
        (a, b) for i, a in enumerate(chunks) for b in chunks[i + 1:])
    for a, b in pairs:
        if a.numel and b.numel and _overlaps(a, b):
            found.append(f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap")
            break
    if not found and total < tensor.numel:
        found.append(f"chunks cover {total} of {tensor.numel} elements: there is a gap")
    elif not found and total > tensor.numel:
        found.append(f"chunks hold {total} elements for a tensor of {tensor.numel}: they overlap")
    return found


def check_folder(folder: DcpFolder) -> list[Problem]:
    """Check a DCP folder's structure against its files.

    Args:
        folder: the folder, as :func:`fsdpckpt.reader.read_dcp_folder` read it.

    Returns:
        Every problem found, in a stable order; empty when the folder is whole.
    """
    problems: list[Problem] = []
    missing: dict[str, list[str]] = {}
    sizes = folder.file_sizes
    base = str(folder.path)

    def check_location(what: str, file: str | None, offset: int, length: int) -> None:
        if file is None:
            problems.append(Problem(base, f"{what} has no storage entry in .metadata"))
        elif file not in sizes:
            missing.setdefault(file, []).append(what)
        elif offset < 0 or length <= 0 or offset + length > sizes[file]:
            problems.append(Problem(
                f"{base}/{file}",
                f"{what} lies at bytes {offset}..{offset + length}, past the end of the file "
                f"({sizes[file]} bytes): the file is truncated"))

    for tensor in folder.metadata.tensors:
        for message in check_tensor_chunks(tensor):
            problems.append(Problem(base, f"tensor '{tensor.name}': {message}"))
        for chunk in tensor.chunks:
            check_location(f"tensor '{tensor.name}' chunk at {list(chunk.offsets)}",
                           chunk.file, chunk.offset, chunk.length)
    for obj in folder.metadata.objects:
        check_location(f"object '{obj.name}'", obj.file, obj.offset, obj.length)

    for file, needers in sorted(missing.items()):
        more = f" and {len(needers) - 1} more" if len(needers) > 1 else ""
        problems.append(Problem(f"{base}/{file}", f"missing file, needed by {needers[0]}{more}; "
                                "copy it from the machine that wrote the checkpoint"))
    return problems


def known_world_size(folder: DcpFolder) -> tuple[int, bool]:
    """The world size that wrote ``folder``, and whether it is exact or only a lower bound.

    ``.metadata`` does not record the world size; the rank file names show it. With
    torch's default (``single_file_per_rank=True``, one writer thread) every rank writes
    exactly ``__{rank}_0.distcp``, even with nothing to write, so ranks ``0..N-1`` each
    with that one file give exactly ``N``. Any other pattern (a rank without a file,
    ``__{rank}_1.distcp`` and beyond) may come from ``single_file_per_rank=False``,
    where ranks with nothing to write, the last ones included, write no file: then
    ``N`` is a lower bound.

    Returns:
        ``(world_size, exact)``; ``(0, False)`` for a folder with no rank files.
    """
    names = {f.name for f in folder.files} | set(folder.metadata.referenced_files)
    found = [(int(m.group(1)), int(m.group(2))) for m in map(_RANK_FILE.match, names) if m]
    if not found:
        return 0, False
    ranks = {rank for rank, _ in found}
    world = max(ranks) + 1
    one_file_per_rank = all(index == 0 for _, index in found) and len(ranks) == world
    return world, one_file_per_rank
