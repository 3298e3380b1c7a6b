"""One seam over the two kinds of place a checkpoint lives in: a local folder and an object store.

Readers and writers take a :data:`Place` (a :class:`~pathlib.Path` or a
:class:`~fsdpckpt._io.remote.RemotePath`, as :func:`~fsdpckpt._io.remote.location` makes
them) and never ask which kind they were given: they list, stat, open for ranged reads,
read whole, write whole and remove through the functions here, which answer for both.
The kinds differ underneath (a local folder is read through descriptors with ``pread``,
an object store by ranged GETs from one cached listing per folder; a local write is
fsynced, a remote one is a single PUT that appears whole), not in what callers see.

What the kinds can do differs in one way that callers must plan for, a policy rather than a
mechanism: a local folder can be published whole by a rename, object storage cannot
(:func:`commits_by_rename`); the module that owns that policy asks once. The rules on where
a path leads (links, containment) are :mod:`fsdpckpt._io.storage_paths`.

Example::

    from fsdpckpt._io import storage

    for entry in storage.entries(folder):
        if entry.is_file and entry.name.endswith(".distcp"):
            with storage.open_file(entry.path) as file:
                head = bytearray(8)
                file.read_at(memoryview(head), 0)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeAlias, cast

from fsdpckpt._io.durable import fsync_dir, write_bytes
from fsdpckpt._io.rawio import pread_into
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

try:
    import resource as _resource
except ImportError:  # not on Windows
    _resource = None  # type: ignore[assignment]

__all__ = ["Place", "OpenFile", "LocalFile", "Entry", "Closeable", "is_remote",
           "commits_by_rename", "open_file", "opened", "descriptor", "prefetch", "local_file",
           "names", "entries", "size", "present_size", "walk", "resolved", "free_space",
           "read_bytes", "put_bytes", "sync_names", "remove", "refresh"]

#: A local folder or file, or one on object storage.
Place: TypeAlias = "Path | RemotePath"


class OpenFile(Protocol):
    """A file opened for reads by offset: :class:`LocalFile` or a remote file."""

    size: int

    def read_at(self, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` from ``offset``, or raise CorruptCheckpointError."""

    def file(self) -> BinaryIO:
        """A seekable file object over the same bytes (owned by this object)."""

    def close(self) -> None:
        """Release the file."""


def _remote_type() -> type:
    # Imported on first use: remote.py pulls in the prefetcher and fsspec's guards, which a
    # local-only run never needs.
    from fsdpckpt._io.remote import RemotePath
    return RemotePath


def is_remote(place: object) -> bool:
    """Whether ``place`` is on object storage: for ``fsdpckpt._io``, whose functions answer
    for both kinds; code outside it asks :func:`commits_by_rename` instead."""
    return isinstance(place, _remote_type())


def commits_by_rename(place: Place) -> bool:
    """Whether a folder written at ``place`` can be made to appear whole by renaming a
    finished one into place (a local file system), or must be committed where it is written.

    Object storage has no rename and no way to make a folder appear at once: a save there
    commits by its manifest, written last under an intent marker (training's
    ``_remote`` protocol, docs/remote-training.md). The one capability a caller's policy
    depends on; asked by :func:`fsdpckpt._io.publish_folders.commits` and by training's
    ``commits_by_marker``.
    """
    return not is_remote(place)


class Closeable(Protocol):
    """Something to close when done (a prefetcher)."""

    def close(self) -> None:
        """Release it."""


class LocalFile:
    """A local regular file opened for reads by offset; what ``RemoteFile`` is remotely.

    ``handle`` is its descriptor, for code that reads ranges with
    :func:`~fsdpckpt._io.rawio.pread_into` or copies in the kernel.
    """

    def __init__(self, path: Path | str, fd: int, size: int | None = None) -> None:
        self.path, self.handle = path, fd
        self.size = os.fstat(fd).st_size if size is None else size
        self._file: BinaryIO | None = None

    def read_at(self, view: memoryview, offset: int) -> None:
        pread_into(self.handle, view, offset, source=str(self.path))

    def file(self) -> BinaryIO:
        if self._file is None:
            self._file = os.fdopen(self.handle, "rb", closefd=False)
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.handle >= 0:
            os.close(self.handle)
            self.handle = -1


def open_file(path: Place) -> OpenFile:
    """Open the file ``path`` for reads by offset; the caller closes it (or use :func:`opened`).

    A local path is opened as it resolves, never following a link after the check that it
    is a regular file; a remote one takes its size from the folder's listing.

    Raises:
        CheckpointNotFoundError: no such file.
        NotACheckpointError: it is a folder or another non-regular file.
    """
    if is_remote(path):
        return cast("OpenFile", cast("RemotePath", path).open_file())
    return cast(LocalFile, _open_local(cast(Path, path), follow=True))


def open_unless_link(path: Path | str) -> LocalFile | None:
    """:func:`open_file` of a local path, or None where its last part is a symlink (the
    caller judges where it leads before it opens it)."""
    return _open_local(path, follow=False)


def _open_local(local: Path | str, *, follow: bool) -> LocalFile | None:
    # Not following a link at the end, and not waiting on a FIFO: the descriptor's own
    # fstat then says what was opened. A path ending in a link is opened as it resolves.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        try:
            fd = os.open(local, flags)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            if not follow:
                return None
            fd = os.open(os.path.realpath(local), flags)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{local}: no such file") from None
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            raise
        raise OSError(errno.EMFILE, "this process has as many files open as it may (ulimit -n "
                      f"{_open_files_limit()}), so it cannot open more; raise the limit "
                      "(ulimit -n 65536) or open fewer files beside fsdpckpt's",
                      str(local)) from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise NotACheckpointError(f"{local}: not a regular file")
    try:
        return LocalFile(local, fd, status.st_size)
    except BaseException:
        os.close(fd)
        raise


def _open_files_limit() -> str:
    # Imported before it is needed: at the limit, importing it would need a file too.
    return "?" if _resource is None else str(_resource.getrlimit(_resource.RLIMIT_NOFILE)[0])


@contextlib.contextmanager
def opened(path: Place) -> Iterator[OpenFile]:
    """:func:`open_file` as a context manager."""
    file = open_file(path)
    try:
        yield file
    finally:
        file.close()


def descriptor(file: OpenFile) -> int | OpenFile:
    """What offset reads (:func:`~fsdpckpt._io.rawio.pread_into`) and kernel copies take:
    a local file's descriptor, or the remote file itself (read by offset)."""
    return file.handle if isinstance(file, LocalFile) else file


def prefetch(folder: Place, ranges: Iterable[tuple[OpenFile, int, int]]) -> Closeable | None:
    """Announce the ranges (``(file, offset, length)``, in reading order) of files in
    ``folder`` about to be read: on object storage they are fetched ahead, in parallel and
    bounded (:mod:`fsdpckpt._io.prefetch`); a local folder reads as fast without, and
    never consumes ``ranges`` (so a generator of files to open opens none).

    Returns:
        What to close when the reads are done (None: nothing).
    """
    if not is_remote(folder):
        return None
    from fsdpckpt._io.remote import RemoteFile
    from fsdpckpt._io.remote import prefetch as remote_prefetch
    return remote_prefetch((cast(RemoteFile, f), o, n) for f, o, n in ranges)


def local_file(file: Place, scratch: Callable[[], Path]) -> Path:
    """``file`` as a local path, for readers that need one (torch's memory-mapped loader):
    a local file itself; a remote one copied into the new empty folder ``scratch()`` gives,
    one bounded piece at a time (:func:`~fsdpckpt._io.download.download`)."""
    if not is_remote(file):
        return cast(Path, file)
    from fsdpckpt._io.download import download
    remote = cast("RemotePath", file)
    target = scratch() / remote.name
    download(remote, target)
    return target


class Entry:
    """One entry of a folder, as listed (links not followed).

    A plain class whose path is made when asked for: a 4,096-rank folder lists thousands.
    """

    __slots__ = ("name", "_folder", "_path", "is_dir", "is_file", "is_link", "size")

    def __init__(self, name: str, folder: Place | None, is_dir: bool, is_file: bool,
                 is_link: bool, size: int, *, path: Place | None = None) -> None:
        self.name, self._folder, self._path = name, folder, path
        self.is_dir, self.is_file, self.is_link, self.size = is_dir, is_file, is_link, size

    @property
    def path(self) -> Place:
        if self._path is None:
            self._path = cast(Place, self._folder) / self.name
        return self._path


def entries(folder: Place) -> list[Entry]:
    """The entries of ``folder``, sorted by name; none when it is no folder.

    A local symlink is listed as a link (``is_dir`` and ``is_file`` False); object stores
    have none.
    """
    if is_remote(folder):
        found = []
        for path in cast("RemotePath", folder).iterdir():
            is_dir = path.is_dir()
            found.append(Entry(path.name, None, is_dir, not is_dir, False,
                               0 if is_dir else path.stat().st_size, path=path))
        return found
    local = cast(Path, folder)
    try:
        scan = list(os.scandir(local))
    except (FileNotFoundError, NotADirectoryError):
        return []
    listed = []
    for item in scan:
        link = item.is_symlink()
        is_file = not link and item.is_file(follow_symlinks=False)
        listed.append(Entry(item.name, local, not link and item.is_dir(follow_symlinks=False),
                            is_file, link,
                            item.stat(follow_symlinks=False).st_size if is_file else 0))
    listed.sort(key=attrgetter("name"))
    return listed


def names(folder: Place) -> list[str]:
    """The names in ``folder``, sorted; none when it is no folder."""
    if is_remote(folder):
        return sorted(p.name for p in cast("RemotePath", folder).iterdir())
    try:
        return sorted(os.listdir(cast(Path, folder)))
    except (FileNotFoundError, NotADirectoryError):
        return []


def size(file: Place) -> int:
    """The size of ``file`` in bytes (remote: from the listing; local: ``stat``, links followed).

    Raises:
        CheckpointNotFoundError: no such file.
    """
    if is_remote(file):
        return int(cast("RemotePath", file).stat().st_size)
    try:
        return os.stat(cast(Path, file)).st_size
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{file}: no such file") from None


def present_size(file: Place) -> int:
    """The bytes of ``file`` that hold data, not holes: a local file's size less its holes
    (``lseek`` ``SEEK_DATA``/``SEEK_HOLE``), so a 1 GiB file made by ``truncate`` holds 0.
    Holes rather than ``st_blocks``: a compressing file system (ZFS, btrfs) allocates fewer
    blocks than an honest file's size. Where the file system cannot tell, no holes; object
    stores have none: the size.

    Raises:
        CheckpointNotFoundError: no such file.
    """
    total = size(file)
    if is_remote(file) or not hasattr(os, "SEEK_HOLE"):
        return total
    try:
        fd = os.open(cast(Path, file), os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{file}: no such file") from None
    present, at = 0, 0
    try:
        while at < total:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: nothing but a hole to the end
                    raise
                break
            at = os.lseek(fd, start, os.SEEK_HOLE)
            present += at - start
    except OSError:
        return total  # a file system without SEEK_DATA: taken as all data
    finally:
        os.close(fd)
    return present


def walk(root: Place) -> tuple[list[str], list[str]]:
    """Every file under ``root`` (relative names, sorted) and every local symlink to a folder
    (not followed); object stores have no links, and are read in one recursive listing."""
    if is_remote(root):
        remote = cast("RemotePath", root)
        prefix = remote.path.rstrip("/") + "/"
        keys = remote.fs.find(remote.path)
        return sorted(k[len(prefix):] for k in keys
                      if k.startswith(prefix) and not k.endswith("/")), []
    local = cast(Path, root)
    found, linked = [], []
    for dirpath, dirs, files in os.walk(local):
        for name in files:
            found.append(os.path.relpath(os.path.join(dirpath, name), local))
        linked += [os.path.relpath(os.path.join(dirpath, d), local) for d in dirs
                   if os.path.islink(os.path.join(dirpath, d))]
    return sorted(found), sorted(linked)


def resolved(place: Place) -> Place:
    """``place`` with its links followed (a local path, made absolute); an object store has
    no links, so a remote place is itself."""
    if is_remote(place):
        return place
    return cast(Path, place).resolve()


def free_space(place: Place) -> int | None:
    """The bytes free to an unprivileged writer on the file system holding ``place`` (or its
    nearest existing parent); None where that is not known: an object store has no such
    limit, and a local ``statvfs`` may fail."""
    if is_remote(place):
        return None
    folder = cast(Path, place)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        found = os.statvfs(folder)
    except OSError:
        return None
    return found.f_bavail * found.f_frsize


def read_bytes(file: Place) -> bytes:
    """All the bytes of ``file``."""
    return file.read_bytes()


def put_bytes(file: Place, data: bytes, *, sync: bool = True,
              atomic: bool = False) -> tuple[int, int]:
    """Write ``data`` as the whole of ``file``; ``(size, crc32)``.

    Remote: one PUT, so the object appears whole or not at all, and a reader sees the old
    object or the new. Local: written and (unless ``sync=False``) fsynced in place, which a
    reader may catch half-written; with ``atomic=True`` (a file that others read while it is
    replaced, a manifest) written beside it as ``<name>.tmp`` and renamed over it instead.
    """
    if is_remote(file):
        from fsdpckpt._io.checksums import crc32

        remote = cast("RemotePath", file)
        remote.fs.pipe_file(remote.path, data)
        return len(data), crc32(data)
    local = cast(Path, file)
    if not atomic:
        return write_bytes(local, data, sync=sync)
    tmp = local.with_name(local.name + ".tmp")
    written = write_bytes(tmp, data, sync=sync)
    os.replace(tmp, local)
    return written


def sync_names(folder: Place) -> None:
    """Make the names in ``folder`` (new files, renames) durable: a local folder is
    fsynced; an object store has nothing to do (an object is durable once its PUT returned)."""
    if not is_remote(folder):
        fsync_dir(cast(Path, folder))


def remove_file(file: Place) -> None:
    """Delete one file (gone already: nothing to do); one request on object storage."""
    with contextlib.suppress(FileNotFoundError):
        if is_remote(file):
            cast("RemotePath", file).fs.rm_file(cast("RemotePath", file).path)
        else:
            cast(Path, file).unlink()


def remove(place: Place, *, strict: bool = False) -> None:
    """Delete a file or a folder and everything under it.

    By default a cleanup: gone already is nothing to do, and a local file that will not go
    is left. ``strict=True`` for a deletion the user asked for, whose failure they must hear
    of: any failure raises, a missing place included.
    """
    if is_remote(place):
        remote = cast("RemotePath", place)
        if strict:
            remote.fs.rm(remote.path, recursive=True)
        for _attempt in range(2):
            # A store with real folders (SeaweedFS) may keep a folder whose files were
            # deleted in the same batch: a second pass, after a fresh look, deletes it.
            remote.fs.invalidate_cache()
            if not remote.fs.exists(remote.path):
                return
            with contextlib.suppress(FileNotFoundError):
                remote.fs.rm(remote.path, recursive=True)
        return
    local = cast(Path, place)
    if local.is_dir() and not local.is_symlink():
        shutil.rmtree(local, ignore_errors=not strict)
        return
    with contextlib.suppress(*(() if strict else (FileNotFoundError,))):
        local.unlink()


def refresh(place: Place) -> None:
    """Forget cached listings (fsdpckpt's and the fsspec client's) after this process or
    another changed the store; a local folder caches nothing."""
    if is_remote(place):
        remote = cast("RemotePath", place)
        remote.forget_listings()
        remote.fs.invalidate_cache()
