"""The manifest (``fsdpckpt.json``): every file of a checkpoint with its size and CRC-32,
and the CRC-32 of every tensor chunk's data.

File checksums are computed while DCP writes (a stream that checksums what passes through
it), chunk checksums are the CRC-32 that ``torch.save`` already stores in each chunk's zip
directory, so writing a manifest costs no second read of the data. Tools that do not know
the file (Accelerate, DCP) ignore it.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import IO, Any

from .archive import _open_archive
from .durable import write_bytes
from .errors import CorruptCheckpointError
from .rawio import pread_into, scratch
from .reader import is_dcp_folder, read_dcp_folder

__all__ = ["MANIFEST", "checksum_writer", "chunk_crcs", "data_entry_crc", "build_manifest", "write_manifest",
           "read_manifest", "file_crc", "crc32_range"]

MANIFEST = "fsdpckpt.json"


class _CrcStream:
    """A write-only stream proxy that keeps the size and CRC-32 of what is written."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream, self.crc, self.size = stream, 0, 0

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        view = memoryview(data).cast("B")
        count = len(view) if written is None else written
        self.crc = zlib.crc32(view[:count], self.crc)
        self.size += count
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def checksum_writer(path: str | os.PathLike[str], record: dict[str, tuple[int, int]]) -> Any:
    """A DCP ``FileSystemWriter`` for ``path`` that records ``{file name: (size, crc32)}``."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _ChecksumFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str):  # type: ignore[override]
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                proxy = _CrcStream(stream)
                yield proxy
            # DCP writes .metadata as .metadata.tmp, then renames it.
            record[Path(path).name.removesuffix(".tmp")] = (proxy.size, proxy.crc)

    writer = FileSystemWriter(path)
    writer.fs = _ChecksumFileSystem()
    return writer


def crc32_range(fd: int, start: int, count: int, progress: Any = None,
                block: int = 16 * 2**20, *, source: str = "a file") -> int:
    """CRC-32 of ``count`` bytes at ``start`` of the open file ``fd``, read in blocks.

    Raises:
        CorruptCheckpointError: the file ends before ``start + count``.
    """
    crc = 0
    buffer = scratch(min(count, block), "crc") if count > 0 else memoryview(b"")
    while count > 0:
        data = buffer[:min(count, len(buffer))]
        pread_into(fd, data, start, source=source)
        crc = zlib.crc32(data, crc)
        start, count = start + len(data), count - len(data)
        if progress:
            progress(len(data))
    return crc


def file_crc(path: Path, progress: Any = None) -> int:
    """CRC-32 of a whole file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return crc32_range(fd, 0, os.fstat(fd).st_size, progress, source=str(path))
    finally:
        os.close(fd)


def data_entry_crc(handle: IO[bytes], start: int, length: int, *, source: str) -> int:
    """The CRC-32 a chunk's zip directory stores for its data entry (no data is read)."""
    with _open_archive(handle, start, length, source) as archive:
        data = [i for i in archive.infolist() if "/data/" in i.filename]
    if len(data) != 1:
        raise CorruptCheckpointError(f"{source}: expected one data entry, found {len(data)}")
    return data[0].CRC


def chunk_crcs(folder: Path) -> list[dict[str, Any]]:
    """Each tensor chunk of a DCP folder with the CRC-32 its zip directory stores for its data."""
    meta = read_dcp_folder(folder).metadata
    out: list[dict[str, Any]] = []
    handles: dict[str, IO[bytes]] = {}
    try:
        for tensor in meta.tensors:
            for chunk in tensor.chunks:
                if chunk.file is None:
                    continue
                handle = handles.get(chunk.file) or handles.setdefault(
                    chunk.file, open(folder / chunk.file, "rb"))
                source = f"{folder / chunk.file} (tensor '{tensor.name}')"
                out.append({"tensor": tensor.name, "offsets": list(chunk.offsets),
                            "file": chunk.file,
                            "crc32": data_entry_crc(handle, chunk.offset, chunk.length,
                                                    source=source)})
    finally:
        for handle in handles.values():
            handle.close()
    return out


def build_manifest(root: Path, files: dict[str, tuple[int, int]], *, world_size: int,
                   step: int | None) -> dict[str, Any]:
    """The manifest document for the checkpoint at ``root``; ``files`` maps relative paths
    to ``(size, crc32)`` as recorded while writing."""
    import torch

    from . import __version__

    chunks = {p.name: chunk_crcs(p) for p in sorted(root.iterdir())
              if p.is_dir() and is_dcp_folder(p)}
    return {
        "format": "fsdpckpt-manifest", "version": 1, "fsdpckpt": __version__,
        "torch": torch.__version__.split("+")[0], "world_size": world_size, "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": {name: {"size": size, "crc32": crc} for name, (size, crc) in sorted(files.items())},
        "chunks": chunks,
    }


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Write ``fsdpckpt.json`` atomically and durably."""
    tmp = root / (MANIFEST + ".tmp")
    write_bytes(tmp, (json.dumps(manifest, indent=1) + "\n").encode())
    os.replace(tmp, root / MANIFEST)


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest at ``root``, or None when there is none."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: not a readable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "fsdpckpt-manifest":
        raise CorruptCheckpointError(f"{path}: not an fsdpckpt manifest")
    return manifest
