"""Where a DCP folder's files are, checked: nothing outside the folder is ever read.

Every reader asks :func:`data_file_path` (or :func:`path_inside`) before it sizes or opens
a file a checkpoint names, locally or on object storage.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast, overload

from fsdpckpt._io import storage, storage_paths
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

__all__ = ["METADATA_FILE", "data_file_path", "open_data_file", "path_inside"]

METADATA_FILE = ".metadata"

_ONLY_INSIDE = "fsdpckpt reads a checkpoint's data files only from inside its folder"


@overload
def path_inside(folder: Path, relative: str) -> Path: ...
@overload
def path_inside(folder: RemotePath, relative: str) -> RemotePath: ...
@overload
def path_inside(folder: Place, relative: str) -> Place: ...


def path_inside(folder: Place, relative: str) -> Place:
    """``folder / relative``, checked to stay inside ``folder`` once symlinks are followed.

    This is the one rule every reader applies before it opens or sizes a data file:
    the file must lie inside the checkpoint folder. A symlink is followed only when
    it leads to a place inside the folder; an absolute path, a ``..`` that climbs
    out, or a symlink to a file elsewhere is refused, so a checkpoint can never make
    fsdpckpt read (or merge, or load) a file that is not part of it.

    Raises:
        NotACheckpointError: the path leads outside ``folder``; the message says where.
    """
    return storage_paths.inside(folder, relative, rule=_ONLY_INSIDE)


@overload
def data_file_path(folder: Path, name: str) -> Path: ...
@overload
def data_file_path(folder: RemotePath, name: str) -> RemotePath: ...
@overload
def data_file_path(folder: Place, name: str) -> Place: ...


def data_file_path(folder: Place, name: str) -> Place:
    """The path of the data file ``name`` of the DCP folder ``folder``, checked.

    DCP's ``FileSystemWriter`` names data files by plain file names (``__0_0.distcp``);
    a ``.metadata`` naming a path (``/elsewhere/x``, ``../x``, ``sub/x``) is damaged or
    crafted and refused. The file itself must then pass :func:`path_inside`.

    Raises:
        NotACheckpointError: ``name`` is not a plain file name, or leads outside.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or \
            "\\" in name or "\0" in name:
        raise NotACheckpointError(f"{folder / METADATA_FILE}: names the data file {name!r}, a "
                                  "path that may lead outside the checkpoint folder where DCP "
                                  f"writes plain names (__0_0.distcp); {_ONLY_INSIDE}, so this "
                                  ".metadata is damaged or crafted: use an intact copy")
    return path_inside(folder, name)


def open_data_file(folder: Place, name: str) -> storage.OpenFile:
    """Open the data file ``name`` of ``folder`` for reads by offset (by
    :func:`data_file_path`'s rule); the caller closes it.

    A local file is opened as it resolves, so no link is followed after the check.

    Raises:
        NotACheckpointError: the name or the file leads outside the folder, or it is
            not a regular file.
        CheckpointNotFoundError: the file is missing.
    """
    if storage_paths.plain_name(folder, name):
        # A plain name opened without following a link at its end is the folder's own
        # file: no lstat first (a 4,096-chunk tensor opens 4,096 files). A link is judged
        # by where it leads, below. A string path: a Path per file costs as much as the open.
        found = _opened(lambda: storage.open_unless_link(f"{folder}{os.sep}{name}"),
                        lambda: folder / name)
        if found is not None:
            return found
    path = data_file_path(folder, name)
    return cast(storage.OpenFile, _opened(lambda: storage.open_file(path), lambda: path))


def _opened(open_it: Callable[[], storage.OpenFile | None],
            path: Callable[[], Place]) -> storage.OpenFile | None:
    """``open_it()``, its refusals said as a data file's (``path()`` made only for them)."""
    try:
        return open_it()
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{path()}: missing data file; copy it from the machine "
                                      "that wrote the checkpoint") from None
    except NotACheckpointError:
        raise NotACheckpointError(f"{path()}: not a regular file; a data file must be one") \
            from None
