"""``inspect``: what a checkpoint holds and whether its structure is whole, as one JSON-able dict.

Reads only ``.metadata`` (through the allowlist) and file sizes, so it is fast
and never imports torch. :func:`inspect_checkpoint` returns the document that
``fsdpckpt inspect --json`` prints; :mod:`fsdpckpt._render` draws it for people.
"""

from __future__ import annotations

import fnmatch
import os
from collections import Counter
from typing import Any

from fsdpckpt.dcp.checks import Problem, check_folder, known_world_size
from fsdpckpt.dcp.layout import DcpPart, find_layout
from fsdpckpt.dcp.metadata import TensorEntry
from fsdpckpt.dcp.reader import DcpFolder, read_dcp_folder

__all__ = ["inspect_checkpoint", "sharding_of", "name_matcher"]


def sharding_of(tensor: TensorEntry) -> str:
    """Describe how ``tensor`` is split, in words: ``"dim0 x2"``, ``"dim1 x2 uneven"``,
    ``"replicated"``.

    Chunks without elements do not count: a ``[2]`` tensor sharded over 8 ranks is stored
    as 2 chunks of one element and 6 empty ones, and is ``"dim0 x2"``. A tensor without
    elements is ``"empty"``.
    """
    if not tensor.chunks:
        return "no chunks"
    chunks = [c for c in tensor.chunks if c.numel]
    if len(chunks) <= 1:
        return "replicated" if chunks else "empty"
    words = []
    for dim in range(len(tensor.shape)):
        cuts = {c.offsets[dim]: c.sizes[dim] for c in chunks if len(c.offsets) > dim}
        if len(cuts) > 1:
            uneven = " uneven" if len(set(cuts.values())) > 1 else ""
            words.append(f"dim{dim} x{len(cuts)}{uneven}")
    return ", ".join(words) or f"{len(chunks)} chunks"


def name_matcher(pattern: str | None):
    """A predicate for names: glob when ``pattern`` has ``*?[``, else substring; None matches
    all."""
    if not pattern:
        return lambda name: True
    if any(ch in pattern for ch in "*?["):
        return lambda name: fnmatch.fnmatchcase(name, pattern)
    return lambda name: pattern in name


def _tensor_doc(tensor: TensorEntry) -> dict[str, Any]:
    return {
        "name": tensor.name,
        "dtype": tensor.dtype.name,
        "shape": list(tensor.shape),
        "bytes": tensor.nbytes,
        "sharding": sharding_of(tensor),
        "chunks": [
            {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file,
             "offset": c.offset, "length": c.length}
            for c in tensor.chunks
        ],
    }


def _part_doc(part: DcpPart, folder: DcpFolder | None, keep) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": part.name, "kind": part.kind, "index": part.index, "path": str(part.path),
        "complete": part.complete,
    }
    if folder is None:
        return doc
    meta = folder.metadata
    world, exact = known_world_size(folder)
    doc.update({
        "version": meta.version,
        "world_size": world,
        "world_size_exact": exact,
        "bytes": folder.nbytes,
        "tensor_bytes": sum(t.nbytes for t in meta.tensors),
        "num_tensors": len(meta.tensors),
        "num_objects": len(meta.objects),
        "dtypes": dict(Counter(t.dtype.name for t in meta.tensors).most_common()),
        "files": [{"name": f.name, "size": f.size, "rank": f.rank} for f in folder.files],
        "tensors": [_tensor_doc(t) for t in meta.tensors if keep(t.name)],
        "objects": [
            {"name": o.name, "file": o.file, "offset": o.offset, "length": o.length,
             "key_path": list(o.key_path)}
            for o in meta.objects if keep(o.name)
        ],
    })
    return doc


_SHOWN_RANKS = 5  # missing ranks named in full; the rest are counted


def _missing_rng(path: str, world: int, present: set[int]) -> list[Problem]:
    """The ranks below ``world`` without an RNG file, found without looping over ``world``.

    ``world`` comes from file names (``__9999999_0.distcp``, ``random_states_10000000.pkl``),
    so it may be huge for a tiny folder: the work here is bounded by the files present.
    """
    have = sorted(r for r in present if r < world)
    missing_count = world - len(have)
    if not missing_count:
        return []
    named: list[int] = []
    rank, ranks = 0, iter(have + [world])
    nxt = next(ranks)
    while len(named) < _SHOWN_RANKS and rank < world:
        if rank == nxt:
            nxt = next(ranks)
        else:
            named.append(rank)
        rank += 1
    problems = [Problem(path, f"no RNG state file for rank {r}") for r in named]
    if missing_count > len(named):
        problems.append(Problem(path, f"no RNG state file for {missing_count - len(named)} more "
                                f"ranks below {world}"))
    return problems


def inspect_checkpoint(path: str | os.PathLike[str], *, names: str | None = None) -> dict[str, Any]:
    """Describe the checkpoint at ``path`` and check its structure.

    Args:
        path: a DCP folder, or a checkpoint folder in Accelerate's or HF Trainer's layout.
        names: keep only tensors and objects whose name matches (glob, or substring).

    Returns:
        The JSON document described in ``docs/cli.md``: ``path``, ``style``, ``ok``,
        ``world_size``, ``bytes``, ``parts`` (each with ``tensors`` and ``objects``),
        ``side_files``, ``other_files`` and ``problems``.

    Raises:
        CheckpointNotFoundError, NotACheckpointError, UnsafePickleError: the path is
        missing or not a checkpoint, or a ``.metadata`` is garbage or hostile.

    Example:
        >>> doc = inspect_checkpoint("fixtures/fsdp2_accelerate")
        >>> doc["ok"], [p["name"] for p in doc["parts"]]
        (True, ['pytorch_model_fsdp_0', 'optimizer_0'])
    """
    layout = find_layout(path)
    keep = name_matcher(names)
    problems: list[Problem] = []
    parts = []
    for part in layout.parts:
        folder = None
        if part.complete:
            folder = read_dcp_folder(part.path)
            problems.extend(check_folder(folder))
        else:
            problems.append(Problem(str(part.path), "no .metadata: this save never finished "
                                    "(DCP writes .metadata last); use an earlier checkpoint"))
        parts.append(_part_doc(part, folder, keep))
    rng_ranks = [f.rank for f in layout.files_of("rng") if f.rank is not None]
    world = max([p.get("world_size", 0) for p in parts] + [r + 1 for r in rng_ranks] + [0])
    # Every rank writes its RNG file; without them a DCP folder may only give a lower bound.
    exact = bool(rng_ranks) or all(p.get("world_size_exact", True) for p in parts)
    problems.extend(_missing_rng(str(layout.path), world if rng_ranks else 0, set(rng_ranks)))
    return {
        "path": str(layout.path),
        "style": layout.style,
        "ok": not problems,
        "world_size": world,
        "world_size_exact": exact,
        "bytes": sum(p.get("bytes", 0) for p in parts) + sum(f.size for f in layout.side_files),
        "parts": parts,
        "side_files": [
            {"name": f.name, "kind": f.kind, "rank": f.rank, "size": f.size}
            for f in layout.side_files
        ],
        "other_files": list(layout.other_files),
        "problems": [{"path": p.path, "message": p.message} for p in problems],
    }
