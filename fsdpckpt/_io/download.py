"""Remote files copied to local disk, for the readers that need a local file.

torch's memory-mapped loader and ``safetensors.safe_open`` read local files only; a remote
``.bin`` to diff or a file to convert is copied first, one bounded piece at a time, every
piece checked by :meth:`~fsdpckpt._io.remote.RemoteFile.read_at` (a short answer is an
error, never zeros).
"""

from __future__ import annotations

from pathlib import Path

from fsdpckpt._io.remote import _PIECE, RemotePath

__all__ = ["download"]


def download(path: RemotePath, target: Path) -> int:
    """Copy the remote file ``path`` to the new local file ``target``, one bounded piece
    at a time (for readers that need a local file: torch's memory-mapped loader,
    ``safetensors.safe_open``).

    Returns:
        The bytes copied (the size listed, every byte checked by :meth:`RemoteFile.read_at`).

    Raises:
        CheckpointNotFoundError: ``path`` is missing. CorruptCheckpointError: it is
            shorter than listed. OSError: ``target`` cannot be written (a full disk).
    """
    remote = path.open_file()
    piece = bytearray(min(_PIECE, remote.size))
    with open(target, "xb") as out:
        done = 0
        while done < remote.size:
            view = memoryview(piece)[:min(len(piece), remote.size - done)]
            remote.read_at(view, done)
            out.write(view)
            done += len(view)
    return done
