"""The data files of one DCP folder, each opened once, read two ways.

Copy code reads with ``pread`` and ``copy_file_range`` at explicit offsets and wants
a descriptor; the zip reader (:mod:`fsdpckpt.dcp._archive`) seeks and reads a file
object. :class:`DataFiles` opens each ``.distcp`` file once, from inside its folder
only (:func:`fsdpckpt.dcp.reader.open_data_file`), and hands out a :class:`DataFile`
that is both: one buffered file object over one descriptor. Sharing is safe because
the descriptor users never move the file position (every read names its offset) and
the file object's users always seek before they read.

Both kinds of place hand out the same pair (:mod:`fsdpckpt._io.storage`): a buffered
file object for the archive reader, and for offset reads a local descriptor or a remote
file read by offset (:func:`~fsdpckpt._io.rawio.pread_into` accepts either). A reader that
knows which chunks come next says so (:meth:`DataFiles.prefetch`): on object storage
their bytes are fetched ahead, in parallel and bounded; a local folder ignores it.

A run of thousands of ranks has thousands of data files, and a merge takes one chunk from
each for every tensor: keeping each open would need more descriptors than ``ulimit -n``
allows (often 1024). So at most :data:`OPEN_FILES` local files stay open; opening one more
closes the one least recently opened. That is safe for readers that use a file's
descriptor only until their next :meth:`DataFiles.open` of another file (one chunk at a
time). A reader that holds the sources of many chunks at once asks for
:meth:`DataFiles.reader`: it reopens its file when read, if it was closed meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import BinaryIO

from fsdpckpt._io import storage
from fsdpckpt._io.rawio import ReadAt
from fsdpckpt._io.storage import OpenFile, Place
from fsdpckpt.dcp.reader import open_data_file
from fsdpckpt.errors import FsdpCkptError

__all__ = ["OPEN_FILES", "DataFile", "DataFiles"]

#: The most local data files a :class:`DataFiles` keeps open at once: small beside any
#: ``ulimit -n``, and enough that reading the chunks of a few files in turn (FSDP1's
#: flat parameters, a tensor's chunks side by side) never reopens one.
OPEN_FILES = 16


class DataFile:
    """One open data file.

    Attributes:
        path: where it is (for messages).
        file: a buffered, read-only file object, for code that seeks and reads.
        opened: the file as :func:`fsdpckpt._io.storage.open_file` opened it.
    """

    __slots__ = ("_folder", "_name", "_file", "opened")

    def __init__(self, folder: Place, name: str, opened: OpenFile) -> None:
        # The path and the buffered file are made when asked for: a tensor in 4,096
        # chunks opens 4,096 files, most of them read only by offset.
        self._folder, self._name, self.opened = folder, name, opened
        self._file: BinaryIO | None = None

    @property
    def path(self) -> Place:
        return self._folder / self._name

    @property
    def file(self) -> BinaryIO:
        if self._file is None:
            self._file = self.opened.file()
        return self._file

    @property
    def fd(self) -> int | ReadAt:
        """The descriptor under :attr:`file`, for ``pread``/``copy_file_range`` at offsets;
        for a remote file, the file itself, read by offset."""
        return storage.descriptor(self.opened)


class DataFiles:
    """The data files of the DCP folder ``folder``, each opened on first use and kept open.

    Use as a context manager (or call :meth:`close`): every file opened is closed at
    its end.

    Raises (from :meth:`open`):
        NotACheckpointError: the name or the file leads outside the folder, or it is not
            a regular file.
        CheckpointNotFoundError: the file is missing.
    """

    def __init__(self, folder: Place, *, keep: int = OPEN_FILES) -> None:
        self.folder = folder
        self._open: dict[str, DataFile] = {}
        #: The open files that hold a descriptor, least recently opened first: only they
        #: count against ``keep`` (a remote file holds none, and its prefetcher may still be
        #: reading it).
        self._descriptors: dict[str, None] = {}
        self._keep = keep
        self._ahead: storage.Closeable | None = None
        #: The entries already read whole against their CRC-32 (:mod:`fsdpckpt.dcp._checked`),
        #: so a reader that takes many boxes of one entry checks it once.
        self.checked: set[object] = set()

    def open(self, name: str) -> DataFile:
        """The data file ``name`` (as the metadata names it), opened once."""
        found = self._open.get(name)
        if found is not None:
            if name in self._descriptors:  # now the most recent
                del self._descriptors[name]
                self._descriptors[name] = None
            return found
        while len(self._descriptors) >= self._keep:
            oldest = next(iter(self._descriptors))
            del self._descriptors[oldest]
            self._open.pop(oldest).opened.close()
        found = DataFile(self.folder, name, open_data_file(self.folder, name))
        self._open[name] = found
        if isinstance(found.fd, int):
            self._descriptors[name] = None
        return found

    def reader(self, name: str) -> int | ReadAt:
        """What reads the data file ``name`` by offset for as long as the caller holds it,
        however many other files are opened meanwhile: a remote file itself; locally, an
        object that reopens the file if it was closed (a held descriptor could be closed,
        and its number given to another file)."""
        data = self.open(name)
        return _Reopening(self, name) if isinstance(data.fd, int) else data.fd

    def prefetch(self, ranges: Iterable[tuple[str | None, int, int]]) -> None:
        """Announce the byte ranges (``(file name, offset, length)`` of each chunk's
        archive) about to be read, in their order: on object storage they are fetched
        ahead, in parallel, with bounded bytes in flight; a local folder ignores this.

        A file that cannot be opened is left out here: reading it raises, in its place.
        """
        if self._ahead is not None:
            self._ahead.close()
        self._ahead = storage.prefetch(self.folder, self._opened(ranges))

    def _opened(self, ranges: Iterable[tuple[str | None, int, int]]
                ) -> Iterator[tuple[OpenFile, int, int]]:
        for name, offset, length in ranges:
            if name is None:
                continue
            try:
                opened = self.open(name).opened
            except FsdpCkptError:
                continue
            yield opened, offset, length

    def close(self) -> None:
        """Close every file opened; the object can be used again afterwards."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        files, self._open = list(self._open.values()), {}
        self._descriptors = {}
        for data_file in files:
            data_file.opened.close()

    def __enter__(self) -> DataFiles:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class _Reopening:
    """A local data file read by offset through its :class:`DataFiles`, which opens it
    again if it was closed since (see :meth:`DataFiles.reader`)."""

    def __init__(self, files: DataFiles, name: str) -> None:
        self._files, self._name = files, name

    def read_at(self, view: memoryview, offset: int) -> None:
        self._files.open(self._name).opened.read_at(view, offset)
