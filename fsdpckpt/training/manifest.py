"""The manifest (``fsdpckpt.json``): every file of a checkpoint with its size and CRC-32
(and, on request, a cryptographic digest), the CRC-32 of every tensor chunk's data, and a
checksum of the manifest's own content.

File checksums are recorded while DCP writes (:mod:`fsdpckpt._io.checksums`: the CRC-32 of small
writes, and for tensor data the CRC-32 that ``torch.save`` already computed and stored in
each chunk's zip directory), so writing a manifest costs neither a second read of the data
nor a second CRC of it. Chunk checksums are those same stored CRCs. Tools that do not know
the file (Accelerate, DCP) ignore it.

What each check is for: CRC-32 catches accidents (a flipped bit, a truncated copy), and the
manifest's own ``checksum`` catches accidents in the manifest. Neither stops intent: anyone
who can change a file can recompute its CRC and the manifest's checksum. Against that, save
with ``digest="sha256"`` (each file's SHA-256 goes into the manifest), keep the manifest's
own digest (:func:`manifest_digest`, printed on save) somewhere the checkpoint's writers
cannot reach, and check it with ``fsdpckpt verify --expect-digest``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import IO, Any

from fsdpckpt._io import storage
from fsdpckpt._io.checksums import DIGESTS, ChecksumStream, Pieces, crc32_range, resolve_pieces
from fsdpckpt._io.dcp_storage import dcp_writer
from fsdpckpt._io.jsonio import parse_json
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.storage import Place
from fsdpckpt._torch import written_file_name
from fsdpckpt.dcp._archive import _open_archive, entry_data_start
from fsdpckpt.dcp._ziparchive import CHUNK_ENTRIES
from fsdpckpt.dcp.reader import read_whole
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["MANIFEST", "Archives", "FileRecord", "build_manifest", "checksum_writer",
           "data_entry_crc", "listed_crcs", "manifest_digest", "own_checksums",
           "parse_manifest", "read_manifest", "write_manifest"]

MANIFEST = "fsdpckpt.json"
#: 3: chunk CRC-32s as 8 hex digits a chunk per file (versions 1-2 listed each chunk as an
#: object naming its tensor: 2 GB of JSON for a 4,096-rank run); 2: the manifest checksums
#: itself; 1 (the first fsdpckpt releases) did not.
_VERSION = 3

#: What is recorded of each file while it is written: ``(size, crc32, hex digest or None)``;
#: for a DCP data file the CRC-32 is still in :data:`~fsdpckpt._io.checksums.Pieces`.
FileRecord = tuple[int, "int | Pieces", "str | None"]


#: Where the tensor chunks' archives lie in the data files one rank wrote of a DCP folder:
#: ``{file name: [(offset, length), ...]}``, from DCP's own write results.
Archives = dict[str, list[tuple[int, int]]]


def checksum_writer(path: str | os.PathLike[str] | RemotePath, record: dict[str, FileRecord],
                    digest: str | None = None, archives: Archives | None = None) -> Any:
    """A DCP storage writer for ``path`` that records ``{file name: FileRecord}``, and in
    ``archives`` where it wrote each tensor chunk: torch's ``FileSystemWriter``, or for a
    remote folder its ``FsspecWriter`` over the same client."""
    def written(name: str, proxy: ChecksumStream) -> None:
        # DCP writes .metadata under a temporary name, then renames it.
        hexdigest = proxy.hasher.hexdigest() if proxy.hasher is not None else None
        record[written_file_name(name)] = (proxy.size, proxy.pieces, hexdigest)

    writer = dcp_writer(path, lambda stream: ChecksumStream(stream, digest), written)
    if archives is not None:
        _keep_archives(writer, archives)
    return writer


def _keep_archives(writer: Any, archives: Archives) -> None:
    """Record from each write result of ``writer`` where a tensor chunk's archive went: the
    rank's own chunks, so that it reads their CRC-32s itself, not rank 0 everyone's."""
    write_data = writer.write_data

    def keeping(plan: Any, planner: Any) -> Any:
        future = write_data(plan, planner)

        def kept(done: Any) -> None:
            try:
                results = done.value()
            except Exception:  # noqa: BLE001 - the save itself reports its failure
                return
            for result in results:
                where = result.storage_data
                if result.index.offset is not None and hasattr(where, "relative_path"):
                    archives.setdefault(where.relative_path, []).append(
                        (where.offset, where.length))

        future.add_done_callback(kept)
        return future

    writer.write_data = keeping


def data_entry(handle: IO[bytes], start: int, length: int, *,
               source: str) -> tuple[int, int, int]:
    """``(crc32, data offset, data length)`` of a chunk's data entry, from its zip directory
    and local header (no data is read)."""
    # Read as the merge reads a chunk: torch.save's layout by a few struct calls, any other
    # by zipfile (a save of thousands of ranks reads millions of these on rank 0).
    with _open_archive(handle, start, length, source, max_entries=CHUNK_ENTRIES,
                       plain=True) as archive:
        data = [i for i in archive.infolist() if "/data/" in i.filename]
        if len(data) != 1:
            raise CorruptCheckpointError(f"{source}: expected one data entry, found "
                                         f"{len(data)}")
        offset = entry_data_start(handle, start, length, data[0], source=source)
    return data[0].CRC, offset, data[0].file_size


def data_entry_crc(handle: IO[bytes], start: int, length: int, *, source: str) -> int:
    """The CRC-32 a chunk's zip directory stores for its data entry (no data is read)."""
    return data_entry(handle, start, length, source=source)[0]


def own_checksums(root: Place, records: dict[str, dict[str, FileRecord]],
                  archives: dict[str, Archives]) -> tuple[dict[str, FileRecord],
                                                          dict[str, dict[str, str]]]:
    """This rank's part of the manifest, from what it wrote: each of its files with its whole
    CRC-32 (assembled from the pieces recorded while writing, and the CRC-32 each chunk's
    zip directory stores for its data), and the chunk CRC-32s of each data file it wrote,
    ``{folder: {file: hex}}``, 8 hex digits a chunk in archive order (as :func:`listed_crcs`
    reads them back). Reads only the directories of its own archives, just written.

    Args:
        records: ``{folder: {file: FileRecord}}`` as the writers recorded them ("" is the
            checkpoint's own folder).
        archives: ``{folder: Archives}``, where each tensor chunk this rank wrote lies.
    """
    files: dict[str, FileRecord] = {}
    chunks: dict[str, dict[str, str]] = {}
    for folder, entries in records.items():
        known: dict[str, dict[tuple[int, int], int]] = {}
        for file, spots in sorted(archives.get(folder, {}).items()):
            crcs = []
            path = root / folder / file
            with storage.opened(path) as opened:
                handle = opened.file()
                for offset, length in sorted(spots):  # the file from its start to its end
                    crc, data_start, size = data_entry(handle, offset, length,
                                                       source=f"{path} (at {offset})")
                    crcs.append(f"{crc:08x}")
                    known.setdefault(file, {})[(data_start, size)] = crc
            chunks.setdefault(folder, {})[file] = "".join(crcs)
        for name, (size, pieces, hexdigest) in entries.items():
            relative = f"{folder}/{name}" if folder else name
            files[relative] = (size, _file_crc(root, relative, pieces, {folder: known}),
                               hexdigest)
    return files, chunks


def listed_crcs(listed: Any, meta: Any) -> tuple[dict[tuple[str, tuple[int, ...]], int],
                                                 list[str]]:
    """What a manifest's ``chunks`` section for one DCP folder says each chunk's CRC-32 is,
    ``{(tensor, offsets): crc32}``, given the folder's metadata; and the files whose count of
    checksums differs from their chunks' (the manifest and ``.metadata`` disagree).

    Reads both layouts: version 3's ``{file: hex}`` (8 digits a chunk archive, in their
    order in the file; chunks that name one archive share its CRC-32) and
    versions 1-2's list of ``{"tensor", "offsets", "file", "crc32"}``.
    """
    if isinstance(listed, list):
        return {(c["tensor"], tuple(c["offsets"])): c["crc32"] for c in listed}, []
    # file -> archive offset -> the chunks stored there: one archive, one CRC-32, however
    # many chunks name it (a tensor's empty shards share one offset, so one storage entry).
    in_files: dict[str, dict[int, list[tuple[str, tuple[int, ...]]]]] = {}
    for tensor in meta.tensors:
        for chunk in tensor.chunks:
            if chunk.file is not None:
                in_files.setdefault(chunk.file, {}).setdefault(chunk.offset, []).append(
                    (tensor.name, chunk.offsets))
    crcs: dict[tuple[str, tuple[int, ...]], int] = {}
    disagree = []
    for file, digits in listed.items():
        archives = in_files.get(file, {})
        if len(digits) != 8 * len(archives):
            disagree.append(file)
            continue
        for i, offset in enumerate(sorted(archives)):
            crc = int(digits[8 * i:8 * i + 8], 16)
            for key in archives[offset]:
                crcs[key] = crc
    return crcs, disagree


def _file_crc(root: Place, name: str, crc: int | Pieces,
              records: dict[str, dict[str, dict[tuple[int, int], int]]]) -> int:
    """A file's CRC-32 from what was recorded while writing it."""
    if isinstance(crc, int):
        return crc
    folder, _, file = name.rpartition("/")

    def read_back(offset: int, length: int) -> int:
        with storage.opened(root / name) as file:
            return crc32_range(file, offset, length, source=str(root / name))

    return resolve_pieces(crc, records.get(folder, {}).get(file, {}), read_back)


def build_manifest(files: dict[str, FileRecord], chunks: dict[str, dict[str, str]], *,
                   world_size: int, step: int | None,
                   digest: str | None = None) -> dict[str, Any]:
    """The manifest document of a checkpoint, from every rank's :func:`own_checksums`
    merged: ``files`` maps relative paths to ``(size, crc32, digest)``, ``chunks`` each DCP
    folder to its files' chunk CRC-32s. ``digest`` names the digest each record carries
    (None: CRC-32 only)."""
    import torch

    from fsdpckpt._version import __version__

    entries: dict[str, dict[str, Any]] = {}
    for name, (size, crc, hexdigest) in sorted(files.items()):
        if not isinstance(crc, int):  # own_checksums resolves every one; a bug if not
            raise RuntimeError(f"no CRC-32 was assembled for {name}")
        entries[name] = {"size": size, "crc32": crc}
        if digest is not None:
            if hexdigest is None:  # every writer hashes when asked to; a bug if not
                raise RuntimeError(f"no {digest} was recorded for {name}")
            entries[name][digest] = hexdigest
    return {
        "format": "fsdpckpt-manifest", "version": _VERSION, "fsdpckpt": __version__,
        "torch": torch.__version__.split("+")[0], "world_size": world_size, "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "digest": digest, "files": entries,
        "chunks": {folder: dict(sorted(listed.items())) for folder, listed in
                   sorted(chunks.items())},
    }


def _content_checksum(document: dict[str, Any]) -> str:
    # The content, not the bytes: canonical JSON of every field but the checksum itself, so
    # any change to a name, size, CRC, step or world size changes it.
    content = {k: v for k, v in document.items() if k != "checksum"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def write_manifest(root: Place, manifest: dict[str, Any]) -> str:
    """Write ``fsdpckpt.json`` atomically and durably, with its own checksum.

    On object storage the manifest is one PUT, visible whole or not at all: the commit
    marker of the protocol in :mod:`fsdpckpt.training._remote`.

    Returns:
        the manifest's digest (``"sha256:<hex>"`` of the file), as :func:`manifest_digest`
        gives it: keep it elsewhere to check the checkpoint against it later.
    """
    document = dict(manifest, checksum=_content_checksum(manifest))
    data = (json.dumps(document, indent=1) + "\n").encode()
    storage.put_bytes(root / MANIFEST, data, atomic=True)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_digest(root: str | os.PathLike[str] | RemotePath) -> str:
    """The digest of the checkpoint's ``fsdpckpt.json`` as it is on disk: ``"sha256:<hex>"``.

    With a manifest saved with ``digest="sha256"``, this one string pins every byte of the
    checkpoint: ``fsdpckpt verify --expect-digest`` checks a checkpoint against it.

    Raises:
        CheckpointNotFoundError: the checkpoint has no manifest.
    """
    path = location(root) / MANIFEST
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: no manifest; only checkpoints saved by "
                                      "fsdpckpt (save_state, CheckpointManager) have one")
    return "sha256:" + hashlib.sha256(read_whole(path, CorruptCheckpointError)).hexdigest()


def read_manifest(root: Place) -> dict[str, Any] | None:
    """The manifest at ``root``, validated, or None when there is none.

    Raises:
        CorruptCheckpointError: the manifest is unreadable, does not follow the schema, or
            its content does not match its own checksum.
    """
    path = root / MANIFEST
    return parse_manifest(read_whole(path, CorruptCheckpointError), path) \
        if path.is_file() else None


def parse_manifest(data: bytes, path: Place) -> dict[str, Any]:
    """The manifest encoded in ``data`` (the bytes of ``path``), validated.

    Raises:
        CorruptCheckpointError: as for :func:`read_manifest`.
    """
    try:
        manifest = parse_json(data)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: not a readable manifest ({exc}); it cannot "
                                     "be trusted: delete it to verify without it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "fsdpckpt-manifest":
        raise CorruptCheckpointError(f"{path}: not an fsdpckpt manifest")
    problem = _schema_problem(manifest)
    if problem is not None:
        problem = f"malformed: {problem}"
    elif manifest["version"] >= 2 and manifest["checksum"] != _content_checksum(manifest):
        problem = "damaged: its content does not match its own checksum (a changed byte)"
    if problem is not None:
        raise CorruptCheckpointError(f"{path}: {problem}; the manifest cannot be trusted: "
                                     "restore it from a copy, or delete it to verify the "
                                     "checkpoint without it")
    return manifest


def _is_int(value: Any, low: int = 0, high: int = 2**63 - 1) -> bool:
    return type(value) is int and low <= value <= high


def _is_hex(value: Any, digits: int) -> bool:
    return isinstance(value, str) and len(value) == digits and \
        all(c in "0123456789abcdef" for c in value)


_DIGEST_HEX = {"sha256": 64, "blake2b": 128}
_CRCS = re.compile(r"(?:[0-9a-f]{8})*")  # a file's chunk CRC-32s (version 3), at C speed


def _schema_problem(doc: dict[str, Any]) -> str | None:
    """What is wrong with the decoded manifest ``doc``, or None: every field's type and range."""
    version = doc.get("version")
    if version is None:
        return "it has no version"
    if type(version) is not int or not 1 <= version <= _VERSION:
        return (f"version {version!r} is not one this fsdpckpt reads (1 to {_VERSION}); a "
                "newer fsdpckpt may have written it: upgrade fsdpckpt")
    if version >= 2 and not (isinstance(doc.get("checksum"), str)):
        return "it has no checksum of its own"
    if not _is_int(doc.get("world_size"), 1, 2**31):
        return f"world_size {doc.get('world_size')!r} is not a positive integer"
    if doc.get("step") is not None and not _is_int(doc.get("step")):
        return f"step {doc.get('step')!r} is not a non-negative integer"
    digest = doc.get("digest")
    if digest is not None and (not isinstance(digest, str) or digest not in _DIGEST_HEX):
        return f"digest {digest!r} is not one of {', '.join(DIGESTS)}"
    files = doc.get("files")
    if not isinstance(files, dict):
        return "'files' is not a mapping"
    for name, info in files.items():
        if not isinstance(name, str) or not isinstance(info, dict) or \
                not _is_int(info.get("size")) or \
                not _is_int(info.get("crc32"), 0, 2**32 - 1) or \
                (digest is not None and not _is_hex(info.get(digest), _DIGEST_HEX[digest])):
            return f"the entry for file {name!r} is malformed"
    chunks = doc.get("chunks", {})
    if not isinstance(chunks, dict):
        return "'chunks' is not a mapping"
    for folder, entries in chunks.items():
        if version >= 3:
            if not isinstance(entries, dict) or not all(
                    isinstance(file, str) and isinstance(digits, str) and
                    _CRCS.fullmatch(digits) for file, digits in entries.items()):
                return f"the chunk checksums of {folder!r} are not 8 hex digits a chunk"
            continue
        if not isinstance(entries, list):
            return f"the chunks of {folder!r} are not a list"
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("tensor"), str) or \
                    not isinstance(entry.get("file"), str) or \
                    not _is_int(entry.get("crc32"), 0, 2**32 - 1) or \
                    not isinstance(entry.get("offsets"), list) or \
                    not all(_is_int(o) for o in entry["offsets"]):
                return f"a chunk entry of {folder!r} is malformed"
    return None
