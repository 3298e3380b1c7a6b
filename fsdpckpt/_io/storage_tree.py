"""What a folder holds, for both kinds of place: its bytes and files, and when it was written.

For listings of whole checkpoints (``fsdpckpt list``): one walk of a local folder, one
recursive listing of a remote one (``du``), never a request per file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

from fsdpckpt._io.storage import Place, is_remote

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

__all__ = ["modified", "tree_size"]


def tree_size(folder: Place) -> tuple[int, int]:
    """Bytes and files under ``folder`` (links under it not followed). ``folder`` itself is
    walked where it resolves, so a caller judges it first (``list`` never hands it a link
    out of the run folder: :func:`fsdpckpt._io.storage_paths.leads_out`)."""
    if is_remote(folder):
        remote = cast("RemotePath", folder)
        sizes = remote.fs.du(remote.path, total=False)
        return sum(int(s) for s in sizes.values()), len(sizes)
    total, count = 0, 0
    for dirpath, _dirs, names in os.walk(cast(Path, folder)):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
                count += 1
            except OSError:
                continue  # removed while listed (a save finishing, a retention)
    return total, count


def modified(place: Place) -> float | None:
    """When ``place`` was last written (seconds since the epoch); None on object storage,
    whose folders have no time of their own, or when it is gone."""
    if is_remote(place):
        return None
    try:
        return cast(Path, place).stat().st_mtime
    except OSError:
        return None
