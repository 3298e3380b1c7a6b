"""DCP's storage reader and writer for a place: what ``dcp.load`` and ``dcp.save`` move
training state through.

torch reads and writes a local folder through ``FileSystemReader`` / ``FileSystemWriter``
and object storage through ``FsspecReader`` / ``FsspecWriter``. fsdpckpt customizes both
(the reader's metadata comes from its allowlisted parse, the writer records checksums while
it writes); the functions here pick torch's class for the kind of place, and hand a remote
one the fsspec client :func:`~fsdpckpt._io.remote.location` built (its credentials and
endpoint), so the training code makes one call for either.

Example::

    writer = dcp_writer(folder, lambda stream: Counting(stream),
                        lambda name, counted: sizes.update({name: counted.size}))
    dcp.save(state, storage_writer=writer)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from fsdpckpt._io.durable import fsync_file
from fsdpckpt._io.storage import Place, is_remote
from fsdpckpt._torch import (
    fsspec_filesystem_class,
    fsspec_reader_class,
    fsspec_writer,
    set_writer_filesystem,
)

__all__ = ["dcp_reader", "dcp_writer"]

_Proxy = TypeVar("_Proxy")


def _client(folder: Place) -> Any:
    """torch's fsspec ``FileSystem`` for DCP over the client ``folder`` was resolved with."""
    filesystem = fsspec_filesystem_class()()
    filesystem.fs = cast(Any, folder).fs  # the client location() built
    return filesystem


def dcp_reader(folder: Place, methods: type) -> Any:
    """A DCP storage reader for the folder ``folder``: torch's reader for its kind of place
    (``FileSystemReader``, or ``FsspecReader`` over fsdpckpt's client), with the methods of
    ``methods`` (a plain class, named as the reader's class) before torch's own."""
    base: Any
    if is_remote(folder):
        base = fsspec_reader_class()
    else:
        from torch.distributed.checkpoint import FileSystemReader as base
    cls = type(methods.__name__, (methods, base), {"__qualname__": methods.__qualname__})
    reader = cls(str(folder))
    if is_remote(folder):
        reader.fs = _client(folder)
    return reader


def dcp_writer(folder: str | os.PathLike[str] | Place, wrap: Callable[[Any], _Proxy],
               written: Callable[[str, _Proxy], None]) -> Any:
    """A DCP storage writer for the folder ``folder`` (torch's ``FileSystemWriter``, or
    ``FsspecWriter`` over fsdpckpt's client) whose every stream opened for writing is
    handed to DCP as ``wrap(stream)``; once the stream is closed, ``written(path, proxy)``
    (``path`` as DCP named it: ``.metadata`` is written as ``.metadata.tmp``, then renamed).
    """
    base: Any
    if is_remote(folder):
        base = fsspec_filesystem_class()
    else:
        from torch.distributed.checkpoint.filesystem import FileSystem as base

    class _WrappedStreams(base):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:  # as FileSystem's
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                proxy = wrap(stream)
                yield proxy
            if not is_remote(folder):
                # Durable once closed: torch's writer fsyncs its Python-buffered stream
                # without flushing it first, so the tail (all of a small .metadata) reached
                # the disk only at close, after the fsync. Before the rename that publishes it.
                fsync_file(path)
            written(str(path), proxy)

    filesystem = _WrappedStreams()
    if is_remote(folder):
        filesystem.fs = cast(Any, folder).fs  # the client location() built
        return fsspec_writer(str(folder), filesystem)

    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(cast("str | os.PathLike[str]", folder))
    set_writer_filesystem(writer, filesystem)
    return writer
