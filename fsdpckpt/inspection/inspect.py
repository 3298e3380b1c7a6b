"""``inspect``: what a checkpoint holds and whether its structure is whole.

Reads ``.metadata`` (through the allowlist), file sizes and the small side files (each
decoded by the reader ``load_state`` uses, :mod:`fsdpckpt.dcp._sidefiles`), so it is fast
and never imports torch. :func:`inspect_checkpoint` returns an
:class:`~fsdpckpt.inspection.report.InspectReport`, whose ``to_json()`` is the document
``fsdpckpt inspect --json`` prints; :mod:`fsdpckpt._render` draws it for people.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._hfstorage import HfStorageFolder
from fsdpckpt.dcp._perrank import PerRankFolder, rank_set_files
from fsdpckpt.dcp._sidefiles import check_side_files, stray_temporaries
from fsdpckpt.dcp.checks import Problem, check_folder, known_world_size
from fsdpckpt.dcp.layout import DcpPart, find_layout
from fsdpckpt.dcp.metadata import TensorEntry
from fsdpckpt.dcp.parts import find_part, open_part
from fsdpckpt.dcp.reader import DcpFolder
from fsdpckpt.errors import FsdpCkptError, NotACheckpointError, RankLocalStateError
from fsdpckpt.inspection.report import AdapterReport, InspectReport, PartReport, TensorReport
from fsdpckpt.merging._keys import output_name, select, shares_top_key

__all__ = ["inspect_checkpoint", "sharding_of", "name_matcher", "model_files"]


def sharding_of(tensor: TensorEntry) -> str:
    """Describe how ``tensor`` is split, in words: ``"dim0 x2"``, ``"dim1 x2 uneven"``,
    ``"replicated"``.

    Chunks without elements do not count: a ``[2]`` tensor sharded over 8 ranks is stored
    as 2 chunks of one element and 6 empty ones, and is ``"dim0 x2"``. One that fits in
    the first rank's shard is sharded all the same, not replicated: a ``[1, 6]`` tensor over
    2 ranks is ``"dim0 x1 (1 empty)"``. A tensor without elements is ``"empty"``.
    """
    if not tensor.chunks:
        return "no chunks"
    chunks = [c for c in tensor.chunks if c.numel]
    if len(chunks) == 1 and len(tensor.chunks) > 1:
        # Its other chunks are empty shards: cut where their offsets differ from its own.
        cut = [d for d in range(len(tensor.shape))
               if len({c.offsets[d] for c in tensor.chunks if len(c.offsets) > d}) > 1]
        if cut:
            empty = len(tensor.chunks) - 1
            return ", ".join(f"dim{d} x1" for d in cut) + f" ({empty} empty)"
    if len(chunks) <= 1:
        return "replicated" if chunks else "empty"
    words = []
    for dim in range(len(tensor.shape)):
        cuts = {c.offsets[dim]: c.sizes[dim] for c in chunks if len(c.offsets) > dim}
        if len(cuts) > 1:
            uneven = " uneven" if len(set(cuts.values())) > 1 else ""
            words.append(f"dim{dim} x{len(cuts)}{uneven}")
    return ", ".join(words) or f"{len(chunks)} chunks"


def name_matcher(pattern: str | None) -> Callable[..., bool]:
    """A predicate for a tensor's names (``keep(name, *other_names)``: as stored, as merge
    writes it): glob when ``pattern`` has ``*?[``, else substring; None matches all. The
    rule is merge's (:func:`~fsdpckpt.merging._keys.select`): any name matching keeps it."""
    patterns = [pattern] if pattern else []
    return lambda name, *also: select(name, *also, include=patterns, substring=True)


def _tensor_report(tensor: TensorEntry) -> TensorReport:
    return TensorReport(name=tensor.name, dtype=tensor.dtype, shape=tensor.shape,
                        bytes=tensor.nbytes, sharding=sharding_of(tensor), chunks=tensor.chunks)


def _part_report(part: DcpPart, folder: DcpFolder | None,
                 keep: Callable[..., bool]) -> PartReport:
    if folder is None:
        return PartReport(part.name, part.kind, part.index, part.path, part.complete)
    meta = folder.metadata
    # The pattern may name a tensor as stored (listed here) or as merge writes it.
    entries = list(meta.tensors) + list(meta.objects)
    strip = shares_top_key([e.key_path for e in entries])
    kept = {e.name for e in entries
            if keep(e.name, output_name(e.key_path, strip_top=strip))}
    # A per-rank set has one file per rank, every rank included.
    world, exact = (len(folder.files), True) if isinstance(folder, PerRankFolder) \
        else (folder.world_size, folder.world_size_exact) \
        if isinstance(folder, HfStorageFolder) else known_world_size(folder)
    return PartReport(
        part.name, part.kind, part.index, part.path, part.complete,
        version=meta.version,
        world_size=world,
        world_size_exact=exact,
        bytes=folder.nbytes,
        tensor_bytes=sum(t.nbytes for t in meta.tensors),
        num_tensors=len(meta.tensors),
        num_objects=len(meta.objects),
        dtypes=dict(Counter(t.dtype.name for t in meta.tensors).most_common()),
        files=folder.files,
        tensors=tuple(_tensor_report(t) for t in meta.tensors if t.name in kept),
        objects=tuple(o for o in meta.objects if o.name in kept),
    )


def _rank_local_report(part: DcpPart, why: str) -> PartReport:
    """A per-rank optimizer part whose tensors are each rank's own: its files, and why."""
    rank_set = find_part(part.path, part.name).rank_set
    files = rank_set_files(part.path, rank_set) if rank_set is not None else ()
    return PartReport(part.name, part.kind, part.index, part.path, part.complete,
                      world_size=len(files), bytes=sum(f.size for f in files), files=files,
                      rank_local=why)


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


def model_files(place: Place) -> list[Place]:
    """The model files ``place`` stands for when it is no checkpoint but what ``diff`` also
    reads: a weight file or shard index itself, or a folder holding a merged or Hugging Face
    model (and no checkpoint: a checkpoint folder is inspected as one). A file of a
    checkpoint (a rank file, ``.metadata``, ``scheduler.bin``) is none: ``find_layout``
    then says to pass its folder."""
    from fsdpckpt.inspection._inspect_files import model_files_in

    if place.is_file():
        named = place.name.endswith((".safetensors", ".index.json"))
        return [place] if named or not _is_checkpoint(place.parent) else []
    if place.is_dir() and model_files_in(place) and not _is_checkpoint(place):
        return model_files_in(place)
    return []


def _is_checkpoint(folder: Place) -> bool:
    try:
        find_layout(folder)
    except NotACheckpointError:
        return False
    return True


def _adapter(folder: Place, others: tuple[str, ...], names: list[str],
             problems: list[Problem]) -> tuple[AdapterReport | None, tuple[str, ...]]:
    # A PEFT adapter config beside the parts (where save_state's callers write it), or, for a
    # checkpoint holding LoRA adapters, where the export finds it (the run's output folder,
    # where HF Trainer and PEFT's save_pretrained leave it): read as the LoRA export reads
    # it, so that a wrong field shows here as a problem.
    from fsdpckpt.export._lora_config import ADAPTER_CONFIG, read_lora_config
    from fsdpckpt.export._lora_fuse import adapter_config_places

    rest = tuple(n for n in others if n != ADAPTER_CONFIG)
    label, found = ADAPTER_CONFIG, folder / ADAPTER_CONFIG if ADAPTER_CONFIG in others else None
    if found is None and _holds_lora(names):
        for up, place in enumerate(adapter_config_places(folder)[1:], start=1):
            if (place / ADAPTER_CONFIG).is_file():
                label, found = "../" * up + ADAPTER_CONFIG, place / ADAPTER_CONFIG
                break
    if found is None:
        return None, rest
    try:
        config = read_lora_config(found)
    except FsdpCkptError as exc:
        problems.append(Problem(str(found), str(exc)))
        return None, rest
    return AdapterReport(label, config.r, config.lora_alpha, config.target_modules,
                         config.use_rslora, config.use_dora), rest


def _holds_lora(names: list[str]) -> bool:
    from fsdpckpt.export._lora_keys import find_lora

    try:
        return bool(find_lora(names).adapter_keys)
    except NotACheckpointError:  # half an adapter: still adapters, the export says what is wrong
        return True


def inspect_checkpoint(path: str | os.PathLike[str] | RemotePath, *,
                       names: str | None = None,
                       storage_options: dict[str, Any] | None = None) -> InspectReport:
    """Describe the checkpoint at ``path`` and check its structure.

    Args:
        path: a DCP folder, or a checkpoint folder in Accelerate's or HF Trainer's layout;
            or what ``diff`` reads besides: a ``.safetensors`` or ``.bin`` file, a shard
            index, a folder holding a merged or Hugging Face model (each tensor is whole in
            its file: no chunks, style ``"model-file"`` or ``"model-folder"``).
        names: keep only tensors and objects whose name matches (glob, or substring): the
            name as stored (``model.0.weight``, as listed) or as merge writes it
            (``0.weight``).
        storage_options: for URLs (``s3://``...): the fsspec filesystem's options
            (``{"endpoint_url": ..., "profile": ...}``); None: the backend's defaults
            (``AWS_*`` variables, ``~/.aws``...). See docs/remote.md.

    Returns:
        An :class:`~fsdpckpt.inspection.report.InspectReport`: ``path``, ``style``, ``ok``,
        ``world_size``, ``bytes``, ``parts`` (each with ``tensors`` and ``objects``),
        ``side_files``, ``other_files`` and ``problems``. Its ``to_json()`` is the document
        ``fsdpckpt inspect --json`` prints (``docs/cli.md``).

    Raises:
        CheckpointNotFoundError, NotACheckpointError, UnsafePickleError: the path is
        missing or not a checkpoint, or a ``.metadata`` is garbage or hostile.

    Example:
        >>> report = inspect_checkpoint("fixtures/fsdp2_accelerate")
        >>> report.ok, [p.name for p in report.parts]
        (True, ['pytorch_model_fsdp_0', 'optimizer_0'])
    """
    place = location(path, storage_options=storage_options)
    keep = name_matcher(names)
    files = model_files(place)
    if files:
        from fsdpckpt.inspection._inspect_files import inspect_model_files

        return inspect_model_files(place, files, keep)
    layout = find_layout(place)
    problems: list[Problem] = []
    parts = []
    model_names: list[str] = []
    for part in layout.parts:
        folder = None
        if part.complete:
            try:
                folder = open_part(part.path, part.name)
            except RankLocalStateError as exc:
                if part.kind != "optimizer":
                    raise
                # FSDP1's optimizer.state_dict() per rank (VeRL): resumable on the ranks that
                # wrote it, not mergeable; the model beside it is, so show the part, not fail.
                parts.append(_rank_local_report(part, str(exc)))
                continue
            problems.extend(check_folder(folder))
        else:
            problems.append(Problem(str(part.path), "no .metadata: this save never finished "
                                    "(DCP writes .metadata last); use an earlier checkpoint"))
        report = _part_report(part, folder, keep)
        if folder is not None and part.name == f"{layout.style}:{part.kind}" and \
                not report.num_tensors and not report.num_objects:
            continue  # a trainer's part its folder holds nothing of (Lightning's state: meta.pt)
        parts.append(report)
        if folder is not None and part.kind == "model":
            model_names.extend(t.name for t in folder.metadata.tensors)
    rng_ranks = [f.rank for f in layout.files_of("rng") if f.rank is not None]
    world = max([p.world_size for p in parts] + [r + 1 for r in rng_ranks] + [0])
    # Every rank writes its RNG file; without them a DCP folder may only give a lower bound.
    exact = bool(rng_ranks) or all(p.world_size_exact for p in parts)
    problems.extend(_missing_rng(str(layout.path), world if rng_ranks else 0, set(rng_ranks)))
    # Each side file decoded by the reader load_state uses: an empty or cut-short one fails here.
    problems.extend(check_side_files(layout.path, layout.side_files))
    problems.extend(stray_temporaries(layout.path, layout.other_files))
    adapter, others = _adapter(layout.path, layout.other_files, model_names, problems)
    # The config, tokenizer and processor a trainer saved into the checkpoint (HF Trainer).
    from fsdpckpt.inspection._hf_files import split_hf_files

    hf_files, others = split_hf_files(layout.path, others)
    return InspectReport(
        path=layout.path,
        style=layout.style,
        world_size=world,
        world_size_exact=exact,
        # Parts reading the same files (a trainer's model, optimizer and state) count once.
        bytes=sum({(p.path, p.files): p.bytes for p in parts}.values())
        + sum(f.size for f in layout.side_files + hf_files),
        parts=tuple(parts),
        side_files=layout.side_files + hf_files,
        other_files=others,
        problems=tuple(problems),
        adapter=adapter,
    )
