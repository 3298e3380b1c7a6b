"""``verify``: is every byte of a checkpoint what was written?

Structure first (as ``inspect`` checks it). Then, with a manifest, every file's size and
CRC-32, and for a file that fails, each chunk in it, to name the tensor; files the
manifest does not list are strays. Without a manifest (Accelerate or plain DCP wrote the
checkpoint), each chunk's archive header is decoded and checked against the metadata
(dtype, shape) and its data against the CRC-32 its zip directory stores. Data is read in
blocks; no tensor is ever held whole. What ``inspect`` reads besides checkpoints (an
export's or a merge's output, a weight file) is checked by
:mod:`fsdpckpt.inspection._verify_files`.
"""

from __future__ import annotations

import os
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.checksums import crc32_range, new_digest
from fsdpckpt._io.rawio import reusing_scratch
from fsdpckpt._io.remote import location
from fsdpckpt._io.storage import Place
from fsdpckpt._progress import ProgressCallback, ProgressFactory, start_progress
from fsdpckpt.dcp._archive import locate_tensor
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp._zstd import ZstdEntry, chunk_limit, open_entry
from fsdpckpt.dcp.checks import Problem
from fsdpckpt.dcp.layout import find_layout
from fsdpckpt.dcp.metadata import Chunk, DcpMetadata, TensorEntry
from fsdpckpt.dcp.parts import check_part_files, find_part
from fsdpckpt.dcp.reader import path_inside, read_dcp_folder, shared_parses
from fsdpckpt.errors import FsdpCkptError
from fsdpckpt.inspection.inspect import inspect_checkpoint, model_files
from fsdpckpt.inspection.report import VerifyReport
from fsdpckpt.training._dcp_io import stray_metadata_files
from fsdpckpt.training.manifest import (
    MANIFEST,
    data_entry_crc,
    listed_crcs,
    manifest_digest,
    read_manifest,
)

__all__ = ["verify_checkpoint"]

def _check_chunks(folder: Place, problems: list[Problem], *, only_files: set[str] | None,
                  listed: Any, progress: ProgressCallback | None) -> None:
    """Check each chunk's data (of ``only_files``, else all) against the CRCs the manifest
    ``listed`` for the folder (its ``chunks`` section's entry), or its zip's own CRC where it
    lists none."""
    read = read_dcp_folder(folder)
    meta, sizes = read.metadata, read.file_sizes
    expected = None
    if listed is not None:
        expected, disagree = listed_crcs(listed, meta)
        for file in disagree:
            if only_files is None or file in only_files:
                problems.append(Problem(str(folder / file), "the manifest lists another "
                                        "number of chunk checksums for it than its .metadata "
                                        "has chunks: one of them was changed"))
    with DataFiles(folder) as files:
        _check_each_chunk(folder, meta, files, problems, only_files=only_files,
                          expected=expected, progress=progress, sizes=sizes)


def _check_each_chunk(folder: Place, meta: DcpMetadata, files: DataFiles,
                      problems: list[Problem], *, only_files: set[str] | None,
                      expected: dict[tuple[str, tuple[int, ...]], int] | None,
                      progress: ProgressCallback | None, sizes: dict[str, int]) -> None:
    present = _present(folder, meta)
    # File by file, each from its start to its end: a folder of thousands of rank files is
    # read once through, each file opened once, however the tensors interleave them. Grouped
    # by file in the metadata's order, each file's chunks mostly come in offset order already
    # (DCP writes a rank's chunks in that order): sorting them costs about a pass.
    by_file: dict[str, list[tuple[TensorEntry, Chunk]]] = {}
    for tensor in meta.tensors:
        for chunk in tensor.chunks:
            # A chunk past its file's end is the structure check's one "truncated" problem
            # for that file, said there once, not again here for each chunk.
            if chunk.file in present and (only_files is None or chunk.file in only_files) \
                    and chunk.offset + chunk.length <= sizes.get(chunk.file, 0):
                by_file.setdefault(chunk.file, []).append((tensor, chunk))
    checked = []
    for name in sorted(by_file):
        in_file = by_file.pop(name)
        in_file.sort(key=_offset)
        checked += in_file
    # On object storage, the chunks' bytes are fetched ahead in this order (no-op locally).
    files.prefetch((chunk.file, chunk.offset, chunk.length) for _, chunk in checked)
    for tensor, chunk in checked:
        if chunk.file is not None:
            where = f"tensor '{tensor.name}' chunk at {list(chunk.offsets)}"
            path = folder / chunk.file
            try:
                data = files.open(chunk.file)
                handle, start, length = open_entry(data.file, chunk.offset, chunk.length,
                                                   chunk.transforms, source=where,
                                                   limit=chunk_limit(tensor, chunk))
                raw = locate_tensor(handle, start, length, source=where)
                stored = raw.crc32 if raw.crc32 is not None else \
                    data_entry_crc(handle, start, length, source=where)
                # By offset: a file, a remote object or the decoder of a compressed entry.
                actual = crc32_range(handle if isinstance(handle, ZstdEntry) else data.fd,
                                     raw.storage_start, raw.storage_nbytes, progress,
                                     source=where)
            except FsdpCkptError as exc:
                # The archive reader already names the chunk (``source=where``): say it once.
                message = str(exc)
                if not message.startswith(where):
                    message = f"{where}: {message}"
                problems.append(Problem(str(path), message))
                continue
            if raw.dtype.name != tensor.dtype.name or raw.shape != chunk.sizes:
                problems.append(Problem(str(path), f"{where}: holds {raw.dtype.name} "
                                        f"{list(raw.shape)}, the metadata says "
                                        f"{tensor.dtype.name} {list(chunk.sizes)}"))
            want = expected.get((tensor.name, chunk.offsets), stored) if expected else stored
            if actual != want:
                problems.append(Problem(str(path), f"{where}: data does not match its "
                                        "checksum (a changed byte)"))


def _offset(pair: tuple[TensorEntry, Chunk]) -> int:
    return pair[1].offset


def _chunk_bytes(folders: list[Place]) -> tuple[int, int]:
    """Bytes and data files that checking every chunk of ``folders`` reads, from the metadata:
    each chunk's data (DCP saves a chunk's own elements, no more)."""
    total, files = 0, 0
    for folder in folders:
        meta = read_dcp_folder(folder).metadata
        present = _present(folder, meta)
        files += len(present)
        for tensor in meta.tensors:
            for chunk in tensor.chunks:
                if chunk.file in present:
                    total += chunk.numel * tensor.dtype.itemsize
    return total, files


def _present(folder: Place, meta: DcpMetadata) -> set[str]:
    """The data files the chunks of ``meta`` name that are regular files in ``folder``: each
    looked at once, not once per chunk (a remote stat is a request)."""
    named = {chunk.file for tensor in meta.tensors for chunk in tensor.chunks}
    return {name for name in named if name is not None and (folder / name).is_file()}


def _checksums(file: Place, progress: ProgressCallback | None,
               digest: str | None) -> tuple[int, int, str | None]:
    """``(size, crc32, digest)`` of a whole file, local or remote (ranged reads in blocks)."""
    hasher = new_digest(digest)
    with storage.opened(file) as opened:
        crc = crc32_range(storage.descriptor(opened), 0, opened.size, progress, source=str(file),
                          hasher=hasher)
    return opened.size, crc, hasher.hexdigest() if hasher is not None else None


def _check_digest(root: Place, expect: str, problems: list[Problem]) -> str | None:
    """Compare the manifest's digest with ``expect``; return the digest (None: no manifest)."""
    want = expect if expect.startswith("sha256:") else "sha256:" + expect
    try:
        actual = manifest_digest(root)
    except FsdpCkptError as exc:
        problems.append(Problem(str(root / MANIFEST), f"{exc}; a digest to check "
                         "(expect_digest=, --expect-digest) needs a checkpoint saved with a "
                         "manifest"))
        return None
    if actual != want.lower():
        problems.append(Problem(str(root / MANIFEST), f"manifest digest is "
                         f"{actual}, not the expected {want}: this is not the checkpoint whose "
                         "digest you kept (or the manifest was changed)"))
    return actual


@reusing_scratch()  # one read buffer for every chunk and file checked
@shared_parses()  # each .metadata parsed once: for the structure, then for the chunks
def verify_checkpoint(path: str | os.PathLike[str], *,
                      progress: ProgressFactory | None = None,
                      expect_digest: str | None = None,
                      storage_options: dict[str, Any] | None = None) -> VerifyReport:
    """Check the structure and every byte of the checkpoint at ``path``.

    Args:
        path: a DCP folder, or a checkpoint folder in Accelerate's or HF Trainer's layout;
            or what ``inspect`` and ``diff`` read besides: the output folder of
            ``export-hf`` or ``merge`` (a Hugging Face model folder), a shard index, a
            ``.safetensors`` or ``.bin`` file. Those are checked as
            :mod:`fsdpckpt.inspection._verify_files` says: every file the folder needs
            present, headers strict, every tensor byte read, ``.bin`` data against its
            zip CRC-32s; safetensors files record no checksum and are listed in
            ``unchecked``.
        progress: a progress factory, as for :func:`fsdpckpt.merge` (see
            :mod:`fsdpckpt._progress`): ``progress(total_bytes, files)`` is called once,
            before any data is read, with the bytes verify will read (from the manifest's
            file sizes, or without one the metadata's chunk sizes) and the number of data
            files; the callback it returns is given byte counts as they are read.
        expect_digest: the manifest digest kept from the save (``"sha256:<hex>"``, as
            :func:`fsdpckpt.training.manifest.manifest_digest` gives it). Any difference is a
            problem. With a manifest saved with ``digest="sha256"``, this pins every byte
            of every file the manifest lists, and strays are reported besides.
        storage_options: for URLs (``s3://``...): the fsspec filesystem's options
            (``{"endpoint_url": ..., "profile": ...}``); None: the backend's defaults
            (``AWS_*`` variables, ``~/.aws``...). See docs/remote.md.

    Returns:
        A :class:`~fsdpckpt.inspection.report.VerifyReport`: ``path``, ``ok``, ``manifest``
        (whether one was checked against), ``manifest_digest``, ``digest`` (the file digest
        the manifest carries, or None), ``problems``, ``unchecked`` and ``style`` (as
        ``inspect`` names what it read: ``"accelerate"``, ``"model-folder"``...). Its
        ``to_json()`` is the document ``fsdpckpt verify --json`` prints.

    Example:
        >>> report = verify_checkpoint("ckpt/checkpoint_100")
        >>> report.ok
        True
    """
    root = location(path, storage_options=storage_options)
    problems: list[Problem] = []
    outputs = model_files(root)
    if outputs:  # an export's or a merge's output, a shard index, a weight file
        from fsdpckpt.inspection._inspect_files import MODEL_FILE_STYLES
        from fsdpckpt.inspection._verify_files import verify_model_files

        digest = _check_digest(root, expect_digest, problems) if expect_digest else None
        found, unchecked = verify_model_files(outputs, progress)
        return _report(root, problems + found, manifest=False, digest=digest,
                       file_digest=None, unchecked=unchecked,
                       style=MODEL_FILE_STYLES[root.is_dir()])
    layout = find_layout(root)
    try:
        problems += inspect_checkpoint(root).problems
    except FsdpCkptError as exc:
        problems.append(Problem(str(root), str(exc)))
    digest = _check_digest(root, expect_digest, problems) if expect_digest else None
    try:
        manifest = read_manifest(root) if layout.style != "dcp" else None
    except FsdpCkptError as exc:
        if not expect_digest:
            raise
        problems.append(Problem(str(root / MANIFEST), str(exc)))
        return _report(root, problems, manifest=True, digest=digest, file_digest=None,
                       style=layout.style, unfinished=_unfinished(layout))
    # Per-rank torch.save sets: every zip entry read against its CRC-32. HuggingFaceStorage
    # saves (no checksums): every header read again, and every data byte owned by a tensor.
    for part in layout.parts:
        problems += [Problem(str(where), why) for where, why in
                     check_part_files(part.path, part.name)]
    # Once each: a trainer's model, optimizer and state are parts of one folder.
    folders = list(dict.fromkeys(p.path for p in layout.parts
                                 if p.complete and find_part(p.path, p.name).kind == "dcp"))
    for folder in folders:  # never part of a committed checkpoint; load_state refuses them
        for stray in stray_metadata_files(folder):
            problems.append(Problem(str(stray), "stray rank-local DCP metadata "
                             "file: not part of a committed checkpoint, and torch's loader "
                             "would unpickle it without an allowlist; delete it"))
    if manifest is None:
        callback = start_progress(progress, *_chunk_bytes(folders)) if progress else None
        for folder in folders:
            _check_chunks(folder, problems, only_files=None, listed=None, progress=callback)
        # Safetensors record no checksum: without a manifest their data cannot be checked.
        unchecked = tuple(str(p.path / name) for p in layout.parts
                          if (hf := find_part(p.path, p.name).hf) is not None
                          for name in hf.files)
        return _report(root, problems, manifest=False, digest=digest, file_digest=None,
                       unchecked=unchecked, style=layout.style, unfinished=_unfinished(layout))

    file_digest = manifest.get("digest")  # schema-checked: None, or one of DIGESTS
    named = {p.path for p in problems}  # stray metadata files are named above already
    files, linked_folders = storage.walk(root)
    for name in files:
        if name != MANIFEST and name not in manifest["files"] and str(root / name) not in named:
            problems.append(Problem(str(root / name), "stray file: not in the "
                             "manifest, so not part of this checkpoint as it was written"))
    for name in linked_folders:  # fsdpckpt never writes links: someone added this one
        problems.append(Problem(str(root / name), "stray folder (a symlink to "
                         f"{os.path.realpath(str(root / name))}): not in the manifest, so not part "
                         "of this checkpoint as it was written"))
    listed_chunks = manifest.get("chunks", {})  # per folder; schema-checked
    listed = {name: (info["size"], info["crc32"], info.get(file_digest) if file_digest else None)
              for name, info in manifest["files"].items()}
    whole: list[tuple[Place, int, str | None]] = []
    for name, (want_size, want_crc, want_digest) in listed.items():
        file = root / name
        try:
            path_inside(root, name)  # a manifest may not send us outside the checkpoint
        except FsdpCkptError as exc:
            problems.append(Problem(str(file), str(exc)))
            continue
        if not file.is_file():
            problems.append(Problem(str(file), "missing file listed in the manifest"))
            continue
        size = file.stat().st_size
        if size != want_size:
            problems.append(Problem(str(file), f"size {size}, the manifest says "
                             f"{want_size}: the file is truncated or was changed"))
            continue
        whole.append((file, want_crc, want_digest))
    callback = start_progress(progress, sum(f.stat().st_size for f, *_ in whole),
                              len(whole)) if progress else None
    changed: list[Place] = []
    for file, want_crc, want_digest in whole:
        _size, crc, actual_digest = _checksums(file, callback, file_digest)
        if crc == want_crc and actual_digest != want_digest:
            # CRC-32 kept, digest not: a change made to look unchanged.
            problems.append(Problem(str(file), f"contents do not match the "
                             f"manifest's {file_digest} although the CRC-32 matches: the file "
                             "was changed deliberately; do not load it"))
        elif crc != want_crc:
            changed.append(file)
    # Naming the damaged tensors re-reads the changed data files (not in the bar's total):
    # one pass over each folder's chunks for all of its changed files, however many.
    in_folders: dict[Place, set[str]] = {}
    for file in changed:
        if (file.parent / ".metadata").is_file() and file.name.endswith(".distcp"):
            in_folders.setdefault(file.parent, set()).add(file.name)
    for folder, names in in_folders.items():
        _check_chunks(folder, problems, only_files=names,
                      listed=listed_chunks.get(folder.name), progress=None)
    named = {p.path for p in problems}
    for file in changed:
        if str(file) not in named:
            problems.append(Problem(str(file), "contents do not match the "
                             "manifest's checksum (a changed byte outside tensor data)"))
    return _report(root, problems, manifest=True, digest=digest, file_digest=file_digest,
                   style=layout.style, unfinished=_unfinished(layout))


def _unfinished(layout: Any) -> bool:
    return any(not p.complete for p in layout.parts)


def _report(root: Place, problems: list[Problem], *, manifest: bool, digest: str | None,
            file_digest: str | None, style: str,
            unchecked: tuple[str, ...] = (), unfinished: bool = False) -> VerifyReport:
    if manifest and digest is None:
        digest = manifest_digest(root)
    # Each problem once (a file may be reached twice), in the order first found.
    return VerifyReport(path=root, manifest=manifest, manifest_digest=digest,
                        digest=file_digest, problems=tuple(dict.fromkeys(problems)),
                        unchecked=unchecked, style=style, unfinished=unfinished)
