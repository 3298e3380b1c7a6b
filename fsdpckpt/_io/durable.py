"""Writing so that a crash cannot undo it: fsync of files and of the folders that name them."""

from __future__ import annotations

import os
from pathlib import Path

from fsdpckpt._io.checksums import crc32

__all__ = ["fsync_dir", "write_bytes"]


def fsync_dir(path: Path) -> None:
    """Make the names in ``path`` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes, *, sync: bool = True) -> tuple[int, int]:
    """Write ``data`` (durably, with fsync, unless ``sync=False``); return ``(size, crc32)``."""
    with open(path, "wb") as handle:
        handle.write(data)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())
    return len(data), crc32(data)
