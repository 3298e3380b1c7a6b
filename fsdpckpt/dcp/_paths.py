"""Where a DCP folder's files are, checked: nothing outside the folder is ever read.

Every reader asks :func:`data_file_path` (or :func:`path_inside`) before it sizes or opens
a file a checkpoint names, locally or on object storage.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import overload

from fsdpckpt._io.remote import RemotePath
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

__all__ = ["METADATA_FILE", "data_file_path", "open_data_file", "path_inside"]

METADATA_FILE = ".metadata"

_ONLY_INSIDE = "fsdpckpt reads a checkpoint's data files only from inside its folder"


@overload
def path_inside(folder: Path, relative: str) -> Path: ...
@overload
def path_inside(folder: RemotePath, relative: str) -> RemotePath: ...
@overload
def path_inside(folder: Path | RemotePath, relative: str) -> Path | RemotePath: ...


def path_inside(folder: Path | RemotePath, relative: str) -> Path | RemotePath:
    """``folder / relative``, checked to stay inside ``folder`` once symlinks are followed.

    This is the one rule every reader applies before it opens or sizes a data file:
    the file must lie inside the checkpoint folder. A symlink is followed only when
    it leads to a place inside the folder; an absolute path, a ``..`` that climbs
    out, or a symlink to a file elsewhere is refused, so a checkpoint can never make
    fsdpckpt read (or merge, or load) a file that is not part of it.

    Raises:
        NotACheckpointError: the path leads outside ``folder``; the message says where.
    """
    if isinstance(folder, RemotePath):  # object stores have no links; '/'-checks the name
        if relative.startswith("/"):
            raise NotACheckpointError(f"{folder}: names {relative!r}, outside the checkpoint "
                                      f"folder; {_ONLY_INSIDE}")
        return folder / relative
    path = folder / relative
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if os.path.isabs(relative) or os.path.commonpath([root, real]) != root or real == root:
        how = f"a symlink to {real}" if os.path.islink(path) else f"resolves to {real}"
        fix = (f"; replace the link by the file itself (cp --remove-destination {real} {path})"
               if os.path.islink(path) else "; use an intact copy of the checkpoint")
        raise NotACheckpointError(f"{path}: {how}, outside the checkpoint folder {folder}; "
                                  f"{_ONLY_INSIDE}{fix}")
    return path


@overload
def data_file_path(folder: Path, name: str) -> Path: ...
@overload
def data_file_path(folder: RemotePath, name: str) -> RemotePath: ...
@overload
def data_file_path(folder: Path | RemotePath, name: str) -> Path | RemotePath: ...


def data_file_path(folder: Path | RemotePath, name: str) -> Path | RemotePath:
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


def open_data_file(folder: Path, name: str) -> int:
    """Open the data file ``name`` of ``folder`` for reading (by :func:`data_file_path`'s rule).

    Returns:
        A file descriptor; the caller closes it.

    Raises:
        NotACheckpointError: the name or the file leads outside the folder, or it is
            not a regular file.
        CheckpointNotFoundError: the file is missing.
    """
    path = data_file_path(folder, name)
    real = os.path.realpath(path)  # opened as resolved, so no link is followed after the check
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise NotACheckpointError(f"{path}: not a regular file; a data file must be one")
        return os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing data file; copy it from the machine that "
                                      "wrote the checkpoint") from None
