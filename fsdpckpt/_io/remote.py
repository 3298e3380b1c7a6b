"""Checkpoints on object storage (``s3://``, ``gs://``, ``az://``...), read through fsspec.

A path argument is either local (a ``str``/``PathLike``; ``file://`` URLs too) or a URL
with a scheme fsspec knows. :func:`location` turns it into a :class:`pathlib.Path` or a
:class:`RemotePath`. A ``RemotePath`` answers the few questions the readers ask of a
path (``/``, ``name``, ``exists``, ``is_dir``, ``is_file``, ``stat().st_size``,
``iterdir``, ``read_bytes``) from one cached listing per folder, and opens files as
:class:`RemoteFile` (ranged reads by offset, the same ``read_at`` the local readers use
through :func:`fsdpckpt._io.rawio.pread_into`).

A ``RemotePath`` has no ``__fspath__`` on purpose: code that would hand it to ``open``
or ``os.stat`` fails loudly (TypeError) instead of reading a local file of that name.

Credentials and endpoints come from where fsspec's backends find them (``AWS_*``
environment variables and ``~/.aws``, ``AWS_ENDPOINT_URL``, gcloud's and Azure's
defaults), plus ``storage_options`` (``--storage-options JSON`` on the command line).
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from fsdpckpt._io.prefetch import Prefetcher
from fsdpckpt._io.rawio import SizedReader
from fsdpckpt._io.remote_errors import GuardedFS, bounded_options
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    RemoteStorageError,
)

__all__ = ["RemoteFile", "RemotePath", "is_url", "location", "prefetch", "require_fsspec"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: Ranged reads larger than this are split, so no single request holds more in memory.
_PIECE = 32 << 20
#: Buffer of the file object handed to the archive reader (zip headers are small).
_BLOCK = 256 << 10
_EXTRA = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
          "abfs": "adlfs", "abfss": "adlfs"}


def is_url(path: object) -> bool:
    """Whether ``path`` is a remote URL (``s3://...``); ``file://`` and plain paths are not."""
    if isinstance(path, RemotePath):
        return True
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match.group(1).lower() != "file"


def require_fsspec(url: str) -> Any:
    """The ``fsspec`` module, or one error naming the extra that installs it (and the backend)."""
    match = _URL.match(url)
    scheme = match.group(1).lower() if match else url
    backend = _EXTRA.get(scheme, "the fsspec backend for " + scheme + "://")
    try:
        import fsspec
    except ImportError:
        raise NotACheckpointError(
            f"{url}: reading {scheme}:// needs fsspec and {backend}: "
            "pip install 'fsdpckpt[remote]'") from None
    return fsspec


def location(path: str | os.PathLike[str] | RemotePath, *,
             storage_options: dict[str, Any] | None = None) -> Path | RemotePath:
    """``path`` as a local :class:`~pathlib.Path` or a :class:`RemotePath`.

    Args:
        path: a local path, a ``file://`` URL, or a remote URL (``s3://bucket/run/ckpt``).
        storage_options: options for the fsspec filesystem (``{"endpoint_url": ...}``,
            credentials, ``anon``...); None uses the backend's defaults (environment, config).

    Raises:
        NotACheckpointError: the scheme's package is not installed, or fsspec knows no
            such scheme; the message names the extra.
    """
    if isinstance(path, RemotePath):
        return path
    if isinstance(path, str) and path.lower().startswith("file://"):
        return Path(path[len("file://"):])
    if not is_url(path):
        return Path(path)
    url = str(path)
    fsspec = require_fsspec(url)
    scheme = url.split("://", 1)[0].lower()
    options = dict(storage_options or {})
    if scheme in ("s3", "s3a") and "endpoint_url" in options:
        # s3fs takes the endpoint inside client_kwargs; accept it at the top as users write it.
        options["client_kwargs"] = {**(options.get("client_kwargs") or {}),
                                    "endpoint_url": options.pop("endpoint_url")}
    options = bounded_options(scheme, options)  # timeouts and retries, the user's win
    retries = options.pop("retries", None) if scheme in ("s3", "s3a") else None
    try:
        fs, inner = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        backend = _EXTRA.get(scheme, f"the fsspec backend for {scheme}://")
        raise NotACheckpointError(f"{url}: reading {scheme}:// needs {backend} ({exc}): "
                                  "pip install 'fsdpckpt[remote]'") from None
    except ValueError as exc:
        raise NotACheckpointError(f"{url}: {exc}; pass a local path or a URL such as "
                                  "s3://bucket/folder") from None
    if retries is not None:
        fs.retries = retries  # s3fs's retry loop: a class attribute, not an option
    inner = inner.rstrip("/")
    return RemotePath(_Store(GuardedFS(fs, f"{scheme}://"), f"{scheme}://", inner), inner)


class _Store:
    """One filesystem and the folder listings read from it (each folder listed once)."""

    def __init__(self, fs: Any, prefix: str, root: str) -> None:
        self.fs, self.prefix, self.root = fs, prefix, root
        self._listings: dict[str, dict[str, dict[str, Any]]] = {}
        self._itself: dict[str, dict[str, Any]] = {}  # a file listed by its own name
        self._lock = threading.Lock()

    def listing(self, folder: str) -> dict[str, dict[str, Any]]:
        """``{name: info}`` of ``folder``'s entries (empty when it is no folder)."""
        with self._lock:
            found = self._listings.get(folder)
        if found is None:
            try:
                infos = self.fs.ls(folder, detail=True, refresh=True)
            except FileNotFoundError:
                infos = []
            except RemoteStorageError:
                raise
            except OSError as exc:
                raise CheckpointNotFoundError(f"{self.prefix}{folder}: cannot list it ({exc}); "
                                              "check the URL and the credentials") from None
            found = {}
            for info in infos:
                name = info["name"].rstrip("/").rsplit("/", 1)[-1]
                if info["name"].rstrip("/") != folder and name:
                    found[name] = info
                elif info.get("type") == "file":  # fsspec lists a file as itself
                    with self._lock:
                        self._itself[folder] = info
            with self._lock:
                self._listings[folder] = found
        return found

    def itself(self, path: str) -> dict[str, Any] | None:
        """The info of the file ``path`` when listing ``path`` gave the file itself."""
        with self._lock:
            return self._itself.get(path)

    def cached(self, folder: str) -> dict[str, dict[str, Any]] | None:
        """``folder``'s listing when it was read already, else None (nothing is asked)."""
        with self._lock:
            return self._listings.get(folder)

    def forget(self) -> None:
        """Drop the cached listings (after this process changed the folder)."""
        with self._lock:
            self._listings.clear()
            self._itself.clear()


@dataclass(frozen=True)
class _Stat:
    st_size: int


class RemotePath:
    """A file or folder on object storage; the subset of :class:`pathlib.Path` readers use."""

    def __init__(self, store: _Store, path: str) -> None:
        self._store, self.path = store, path

    # -- names -------------------------------------------------------------------------------
    def __str__(self) -> str:
        return self._store.prefix + self.path

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> RemotePath:
        parts = [p for p in str(name).split("/") if p not in ("", ".")]
        if ".." in parts:
            raise NotACheckpointError(f"{self}/{name}: a name with '..' leads outside the folder")
        return RemotePath(self._store, "/".join([self.path, *parts]))

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rfind("."):] if "." in name.lstrip(".") else ""

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self._store, self.path.rsplit("/", 1)[0]) if "/" in self.path else self

    @property
    def fs(self) -> Any:
        """The fsspec filesystem."""
        return self._store.fs

    # -- what is there -----------------------------------------------------------------------
    def _info(self) -> dict[str, Any] | None:
        if "/" not in self.path:  # a bucket: a folder when it can be listed
            return {"type": "directory", "size": 0} if self._store.listing(self.path) else None
        if self.path == self._store.root and self._store.cached(self.parent.path) is None:
            # The path the user named (a checkpoint's root, which the reader lists anyway):
            # its own listing says whether it is a folder, and its parent (a run folder of
            # a thousand checkpoints, a request per thousand entries) is never listed.
            if self._store.listing(self.path):
                return {"type": "directory", "size": 0}
            found = self._store.itself(self.path)
            if found is not None:
                return found
        return self._store.listing(self.parent.path).get(self.name)

    def exists(self) -> bool:
        return self._info() is not None

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") != "directory"

    def is_symlink(self) -> bool:
        return False  # object stores have no links

    def stat(self) -> _Stat:
        info = self._info()
        if info is None:
            raise CheckpointNotFoundError(f"{self}: no such file or folder; check the URL")
        return _Stat(int(info.get("size") or 0))

    def iterdir(self) -> list[RemotePath]:
        return [self / name for name in sorted(self._store.listing(self.path))]

    def glob(self, pattern: str) -> list[RemotePath]:
        """The entries of this folder whose names match ``pattern`` (no ``/``, no ``**``)."""
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    def read_bytes(self) -> bytes:
        size = self.stat().st_size
        data = bytearray(size)
        if size:
            self.open_file().read_at(memoryview(data), 0)
        return bytes(data)

    def open_file(self) -> RemoteFile:
        """The file, for reads by offset (its size from the listing)."""
        if not self.is_file():
            if self.exists():
                raise NotACheckpointError(f"{self}: is a folder, not a file")
            raise CheckpointNotFoundError(f"{self}: missing; check the URL")
        return RemoteFile(self, self.stat().st_size)

    def forget_listings(self) -> None:
        self._store.forget()


class RemoteFile:
    """A remote file read by offset: the ``read_at`` of :func:`fsdpckpt._io.rawio.pread_into`.

    Every read checks its range against the size listed before it asks, and checks that
    the store returned every byte asked for: a short answer is an error, never zeros.
    Reads come from a :class:`~fsdpckpt._io.prefetch.Prefetcher` where one (see
    :func:`prefetch`) holds their bytes.
    """

    def __init__(self, path: RemotePath, size: int) -> None:
        self.path, self.size = path, size
        self._file: _Stream | None = None
        self._prefetch: Prefetcher | None = None

    def read_at(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset``.

        Raises:
            CorruptCheckpointError: the range runs past the end of the file, or the store
                returned fewer bytes than asked.
            CheckpointNotFoundError: the file is gone.
        """
        count = len(view)
        if offset < 0 or offset + count > self.size:
            raise CorruptCheckpointError(
                f"{self.path}: ends at byte {self.size}, before the {count} bytes asked for at "
                f"{offset}; the file is truncated: copy it again")
        if self._prefetch is not None:
            self._prefetch.read(self, view, offset)
        else:
            self._read_direct(view, offset)

    def _read_direct(self, view: memoryview, offset: int) -> None:
        done, count = 0, len(view)
        while done < count:
            step = min(_PIECE, count - done)
            view[done:done + step] = self._get(offset + done, offset + done + step)
            done += step

    def _get(self, start: int, end: int) -> bytes:
        """Bytes ``start..end`` in one ranged request, checked to be all there."""
        try:
            data = self.path.fs.cat_file(self.path.path, start=start, end=end)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: missing; check the URL") from None
        except RemoteStorageError:
            raise
        except OSError as exc:
            raise CorruptCheckpointError(f"{self.path}: reading bytes {start}..{end} failed: "
                                         f"{exc}") from None
        if len(data) != end - start:
            raise CorruptCheckpointError(
                f"{self.path}: returned {len(data)} bytes for the {end - start} asked for at "
                f"{start}; the object changed or is truncated")
        return bytes(data)

    def file(self) -> BinaryIO:
        """A seekable file object over the same bytes (for the archive reader): small reads
        come from the prefetched pieces when they hold them, else from a readahead block."""
        if self._file is None:
            self._file = _Stream(self)
        return cast(BinaryIO, self._file)

    def close(self) -> None:
        self._file = None
        self._prefetch = None


class _Stream(SizedReader):
    """The file object of a :class:`RemoteFile`: exact reads, never past what is asked, so a
    zip reader confined to one chunk's archive (a ``SliceFile``) never reaches the next."""

    def __init__(self, remote: RemoteFile) -> None:
        super().__init__()
        self._remote, self._pos = remote, 0
        self._block, self._block_at = b"", 0

    def _extent(self) -> int:
        return self._remote.size

    def read_at(self, view: memoryview, offset: int) -> None:
        """The remote file's own ranged read (for readers that want a range, not a stream)."""
        self._remote.read_at(view, offset)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        remote, at = self._remote, self._pos
        count = max(0, min(len(view), remote.size - at))
        if count == 0:
            return 0
        ahead = remote._prefetch
        if ahead is not None and ahead.covers(remote, at, count):
            remote.read_at(view[:count], at)
        else:
            if not (self._block_at <= at and at + count <= self._block_at + len(self._block)):
                # Nothing holds these bytes: one request for a block (all of a file that fits
                # in one: a zip's directory, then its entries, seeking back, in one GET).
                first = 0 if remote.size <= _BLOCK else at
                end = min(remote.size, first + max(count, _BLOCK))
                self._block, self._block_at = remote._get(first, end), first
            start = at - self._block_at
            view[:count] = self._block[start:start + count]
        self._pos = at + count
        return count


def prefetch(ranges: Iterable[tuple[RemoteFile, int, int]], **limits: int | None) -> Prefetcher:
    """Fetch ``ranges`` (``(file, offset, length)``, in the order they will be read) ahead,
    in parallel and bounded (:class:`~fsdpckpt._io.prefetch.Prefetcher`); every file named
    reads through it until :meth:`~fsdpckpt._io.prefetch.Prefetcher.close`.

    Args:
        limits: ``budget``, ``piece``, ``workers`` of the prefetcher.
    """
    ranges = list(ranges)
    ahead = Prefetcher(ranges, lambda f, start, end: f._get(start, end),
                       lambda f, view, offset: f._read_direct(view, offset),
                       **limits)
    for remote, _, _ in ranges:
        remote._prefetch = ahead
    return ahead
