"""Files written by every rank at once, each rank its own byte ranges: the seam under
``save_pretrained`` (issue 19), over a shared file system and over object storage.

Policy (which rank writes which bytes, what the files are) lives with the caller; this
module only moves bytes. The protocol:

* :func:`spread_folder` is entered on every rank with the same arguments. It yields a
  :class:`SpreadTarget`: a staged output folder nothing outside sees yet.
* Every rank opens the same files in the same order (:meth:`SpreadTarget.open`, with the
  file's final size) and writes only its own byte ranges (:meth:`SpreadFile.write`).
  Every rank calls :meth:`SpreadFile.step` the same number of times (after each window
  of a tensor, say): on object storage that is where bytes move to the rank that uploads
  their part; on a file system it does nothing. :meth:`SpreadFile.finish` (every rank)
  ends a file; a file some byte of which no rank wrote is refused.
* Rank 0 writes the small files (index, config) whole with :meth:`SpreadTarget.put`.
* Leaving the ``with`` block, the ranks agree: if every rank finished, rank 0 commits
  (local: rename into place; object storage: the ``commit`` file last) and every rank
  returns; if any rank failed, nothing is left and every rank raises the same error.

The local implementation is in :mod:`fsdpckpt._io.spread_local`, the one for object
storage in :mod:`fsdpckpt._io.spread_remote`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from fsdpckpt._io.storage import Place, commits_by_rename

__all__ = ["SpreadFile", "SpreadTarget", "spread_folder"]


class SpreadFile(Protocol):
    """One output file that every rank writes parts of."""

    def write(self, offset: int, data: Any) -> None:
        """Write ``data`` (bytes-like, or a contiguous CPU uint8 tensor) at ``offset``:
        bytes only this rank writes."""

    def step(self) -> None:
        """Collective: every rank calls it the same number of times for this file."""

    def finish(self) -> None:
        """Collective: the file is complete on every rank's side."""


class SpreadTarget(Protocol):
    """A staged output folder that every rank writes into."""

    def open(self, name: str, size: int) -> SpreadFile:
        """Collective: the file ``name`` of ``size`` bytes, in the staged folder."""

    def put(self, name: str, data: bytes) -> None:
        """Rank 0 only: a small file, whole."""


@contextmanager
def spread_folder(out: Place, *, overwrite: bool, commit: str,
                  group: Any = None) -> Iterator[SpreadTarget]:
    """Collective: a staged folder every rank writes into, published as ``out`` when every
    rank leaves the block without error, removed (and the error raised on every rank)
    otherwise.

    Args:
        out: the output folder, local (on a file system every rank sees) or a URL.
        overwrite: replace the files of an existing output; without it, an output that
            holds files is refused before anything is written.
        commit: the file a reader opens first (``config.json``): published last.
        group: the process group (None: the default one, or a single process).
    """
    opener: Any
    if commits_by_rename(out):
        from fsdpckpt._io.spread_local import local_spread_folder
        opener = local_spread_folder
    else:
        from fsdpckpt._io.spread_remote import remote_spread_folder
        opener = remote_spread_folder
    with opener(out, overwrite=overwrite, commit=commit, group=group) as target:
        yield target
