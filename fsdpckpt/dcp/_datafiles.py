"""The data files of one DCP folder, each opened once, read two ways.

Copy code reads with ``pread`` and ``copy_file_range`` at explicit offsets and wants
a descriptor; the zip reader (:mod:`fsdpckpt.dcp._archive`) seeks and reads a file
object. :class:`DataFiles` opens each ``.distcp`` file once, from inside its folder
only (:func:`fsdpckpt.dcp.reader.open_data_file`), and hands out a :class:`DataFile`
that is both: one buffered file object over one descriptor. Sharing is safe because
the descriptor users never move the file position (every read names its offset) and
the file object's users always seek before they read.

A folder on object storage (a :class:`~fsdpckpt._io.remote.RemotePath`) hands out the
same pair: a buffered file object for the archive reader, and a
:class:`~fsdpckpt._io.remote.RemoteFile` in place of the descriptor, which every
offset read (:func:`~fsdpckpt._io.rawio.pread_into`) accepts. There, a reader that
knows which chunks come next says so (:meth:`DataFiles.prefetch`), and their bytes are
fetched ahead, in parallel and bounded (:mod:`fsdpckpt._io.prefetch`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fsdpckpt._io.prefetch import Prefetcher
from fsdpckpt._io.rawio import ReadAt
from fsdpckpt._io.remote import RemoteFile, RemotePath, prefetch
from fsdpckpt.dcp.reader import data_file_path, open_data_file
from fsdpckpt.errors import FsdpCkptError

__all__ = ["DataFile", "DataFiles"]


@dataclass(frozen=True)
class DataFile:
    """One open data file.

    Attributes:
        path: where it is (for messages).
        file: a buffered, read-only file object, for code that seeks and reads.
    """

    path: Path | RemotePath
    file: BinaryIO
    remote: RemoteFile | None = None

    @property
    def fd(self) -> int | ReadAt:
        """The descriptor under :attr:`file`, for ``pread``/``copy_file_range`` at offsets;
        for a remote file, the :class:`~fsdpckpt._io.remote.RemoteFile` read by offset."""
        return self.remote if self.remote is not None else self.file.fileno()


class DataFiles:
    """The data files of the DCP folder ``folder``, each opened on first use and kept open.

    Use as a context manager (or call :meth:`close`): every file opened is closed at
    its end.

    Raises (from :meth:`open`):
        NotACheckpointError: the name or the file leads outside the folder, or it is not
            a regular file.
        CheckpointNotFoundError: the file is missing.
    """

    def __init__(self, folder: Path | RemotePath) -> None:
        self.folder = folder
        self._open: dict[str, DataFile] = {}
        self._ahead: Prefetcher | None = None
        #: The entries already read whole against their CRC-32 (:mod:`fsdpckpt.dcp._checked`),
        #: so a reader that takes many boxes of one entry checks it once.
        self.checked: set[object] = set()

    def open(self, name: str) -> DataFile:
        """The data file ``name`` (as the metadata names it), opened once."""
        found = self._open.get(name)
        if found is not None:
            return found
        if isinstance(self.folder, RemotePath):
            remote = data_file_path(self.folder, name).open_file()
            found = self._open[name] = DataFile(remote.path, remote.file(), remote)
        else:
            fd = open_data_file(self.folder, name)
            try:
                file = os.fdopen(fd, "rb")  # owns fd from here: closing it closes fd
            except BaseException:
                os.close(fd)
                raise
            found = self._open[name] = DataFile(self.folder / name, file)
        return found

    def prefetch(self, ranges: Iterable[tuple[str | None, int, int]]) -> None:
        """Announce the byte ranges (``(file name, offset, length)`` of each chunk's
        archive) about to be read, in their order: on object storage they are fetched
        ahead, in parallel, with bounded bytes in flight; a local folder ignores this.

        A file that cannot be opened is left out here: reading it raises, in its place.
        """
        if not isinstance(self.folder, RemotePath):
            return
        wanted = []
        for name, offset, length in ranges:
            try:
                remote = self.open(name).remote if name is not None else None
            except FsdpCkptError:
                continue
            if remote is not None:
                wanted.append((remote, offset, length))
        if self._ahead is not None:
            self._ahead.close()
        self._ahead = prefetch(wanted)

    def close(self) -> None:
        """Close every file opened; the object can be used again afterwards."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        files, self._open = list(self._open.values()), {}
        for data_file in files:
            if data_file.remote is not None:
                data_file.remote.close()
            else:
                data_file.file.close()

    def __enter__(self) -> DataFiles:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
