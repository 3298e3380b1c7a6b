"""The write and commit stages of a merge: every output file written under a temporary
name (:func:`write_plan`: a :class:`MergePlan` in, the staged paths out), then renamed
into place (:func:`commit`: staged paths in, final paths out).

Files are staged in a hidden folder inside the output folder (same file system,
so the final renames are atomic), space is reserved up front so a full disk
fails before the copy rather than in the middle, and on any error, Ctrl-C or
SIGTERM the staging folder is removed, leaving the output folder as it was. The
staging folder and the renames are the publish helper's (:mod:`fsdpckpt._io.publish`:
a folder that survived anyway, SIGKILL or a power cut, names its host and process,
and the next merge into that folder removes it once that process is gone).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fsdpckpt._io.checksums import crc32_range
from fsdpckpt._io.durable import Writeback, write_bytes
from fsdpckpt._io.publish import STAGING_PREFIX, clear_stale_stages, rename_into, stage_in
from fsdpckpt._io.rawio import pwrite_all, reusing_scratch
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp._objects import read_object
from fsdpckpt.errors import (
    CorruptCheckpointError,
    DiskFullError,
    NotACheckpointError,
    OutputExistsError,
    OutputNotWritableError,
    Terminated,
)
from fsdpckpt.formats import ObjectValue, TensorSpec
from fsdpckpt.formats._shards import index_bytes
from fsdpckpt.merging._rows import place_tensor
from fsdpckpt.merging.plan import MergePlan, PlannedFile, PlannedTensor

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

__all__ = ["OutputExistsError", "DiskFullError", "OutputNotWritableError", "Terminated",
           "write_plan", "write_index", "output_paths", "staging", "commit", "sigterm_interrupts",
           "STAGING_PREFIX", "clear_stale_stages"]

# Staging folders are ``{STAGING_PREFIX}{host}-{pid}-{random}`` inside the output folder:
# made, cleared when stale, and published by fsdpckpt/_io/publish.py.


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` instead of killing the process.

    The default action would end the process on the spot and leave the staging folder
    (the partial output) behind. The previous handler is restored on exit. A handler the
    application set itself (or SIG_IGN) is its choice and is left alone; so is every
    thread but the main one, which alone may set handlers.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    raised = False

    def handler(_signum: int, _frame: Any) -> None:
        nonlocal raised
        if not raised:  # once: a second SIGTERM must not break the cleanup it started
            raised = True
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: A local folder or one on object storage.
_P = TypeVar("_P", "Path", "RemotePath")


def output_paths(plan: MergePlan, output_dir: _P) -> list[_P]:
    """Every file the plan writes into ``output_dir``."""
    names = [f.name for f in plan.files] + ([plan.index_name] if plan.index_name else [])
    return [output_dir / n for n in names]


#: The merge's stage is the publish helper's (fsdpckpt/_io/publish.py), under the name
#: the pipeline's stages call it by.
staging = stage_in


def _reserve(fd: int, size: int, path: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskFullError(errno.ENOSPC, f"{path.parent}: no space left for {size} bytes; "
                                "free some space or choose another output folder") from None
        os.ftruncate(fd, size)  # the file system cannot reserve; writes will tell
    else:
        os.ftruncate(fd, size)


def _write_file(plan: MergePlan, file: PlannedFile, objects: list[ObjectValue], path: Path,
                sources: DataFiles, progress: Callable[[int], None] | None) -> None:
    fmt = plan.format
    layout = fmt.layout([t.spec for t in file.tensors], objects, nested=plan.nested)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _reserve(fd, layout.size, path)
        for offset, data in layout.fixed:
            pwrite_all(fd, data, offset)
        crcs = {}
        with Writeback(fd) as writeback:  # each tensor on its way to disk as it is written
            for planned in file.tensors:
                entry, start = planned.source, layout.starts[planned.spec.name]
                place_tensor(sources, entry, planned.runs, planned.spec.dtype, fd, start,
                             progress=progress, writeback=writeback)
                if fmt.needs_crc:
                    crcs[planned.spec.name] = crc32_range(fd, start, planned.spec.nbytes)
                writeback.hand_over(start, planned.spec.nbytes)
        fmt.finish(fd, layout, crcs)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_objects(plan: MergePlan, sources: DataFiles) -> list[ObjectValue]:
    values = []
    for obj in plan.objects:
        source = f"{plan.folder.path / str(obj.source.file)} (object '{obj.source.name}')"
        if obj.source.file is None:
            raise NotACheckpointError(f"{source}: the metadata has no storage entry")
        handle = sources.open(obj.source.file).file
        values.append(ObjectValue(obj.name, obj.key_path,
                                  read_object(handle, obj.source, source=source)))
    return values


@reusing_scratch()  # one set of block buffers for the whole merge
def write_plan(plan: MergePlan, stage: Path, *,
               progress: Callable[[int], None] | None = None,
               only: Collection[str] | None = None, index: bool = True) -> list[Path]:
    """The write stage: every file of ``plan`` (and its index) into the folder ``stage``.

    Each source data file is opened once for the whole plan.

    Args:
        only: write only the files of these names (a rank's share of a merge spread
            over ranks); None writes them all.
        index: also write the index (when the plan has one).

    Returns:
        The staged files' paths, the index last.

    Raises:
        DiskFullError: the file system cannot hold the output.
        CorruptCheckpointError, CheckpointNotFoundError: a data file is damaged or missing.
    """
    chosen = [(i, f) for i, f in enumerate(plan.files) if only is None or f.name in only]
    _check_space(stage, [f for _, f in chosen])
    if plan.fuser is not None:  # computed tensors: no stored chunk is copied
        written = _write_computed(plan, [f for _, f in chosen], stage, progress)
        index_path = write_index(plan, stage) if index else None
        return written + ([index_path] if index_path else [])
    sources = DataFiles(plan.folder.path)
    try:
        # The objects go into the first file, so only its writer reads them.
        objects = _read_objects(plan, sources) if chosen and chosen[0][0] == 0 else []
        # On object storage, the chunks' bytes are fetched ahead in this order (no-op locally).
        sources.prefetch((c.file, c.offset, c.length) for _, f in chosen for t in f.tensors
                         for c in t.source.chunks)
        written = []
        for i, file in chosen:
            path = stage / file.name
            _write_file(plan, file, objects if i == 0 else [], path, sources, progress)
            written.append(path)
        index_path = write_index(plan, stage) if index else None
        return written + ([index_path] if index_path else [])
    finally:
        sources.close()


def _check_space(stage: Path, files: list[PlannedFile]) -> None:
    free = shutil.disk_usage(stage).free
    needed = sum(f.nbytes for f in files) + 2**20 * len(files)
    if needed > free:
        raise DiskFullError(errno.ENOSPC, f"{stage.parent}: the merge needs about {needed} "
                            f"bytes, only {free} are free; free some space or choose "
                            "another output folder")


def _write_computed(plan: MergePlan, files: list[PlannedFile], stage: Path,
                    progress: Callable[[int], None] | None) -> list[Path]:
    # Every file laid out first (header and size, from the plan); then the tensors with
    # stored chunks are copied as a merge copies them, and each tensor the fuser yields is
    # written at its place as it comes and dropped, so memory holds one.
    assert plan.fuser is not None
    paths = [stage / f.name for f in files]
    where: dict[str, tuple[int, int, TensorSpec]] = {}  # name -> (fd, offset, spec)
    copies: list[tuple[int, int, PlannedTensor]] = []  # (fd, offset, tensor)
    with contextlib.ExitStack() as opened:
        fds, writebacks = [], {}
        for path, file in zip(paths, files, strict=True):
            specs = [t.spec for t in file.tensors]
            layout = plan.format.layout(specs, [], nested=plan.nested)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            opened.callback(os.close, fd)
            fds.append(fd)
            writebacks[fd] = opened.enter_context(Writeback(fd))  # waited for before the close
            _reserve(fd, layout.size, path)
            for offset, data in layout.fixed:
                pwrite_all(fd, data, offset)
            for t in file.tensors:
                if t.source.chunks:
                    copies.append((fd, layout.starts[t.spec.name], t))
                else:
                    where[t.spec.name] = (fd, layout.starts[t.spec.name], t.spec)
        tensors = plan.fuser()  # called first: what it looks up fails before any copy
        if copies:  # the stored ones first, by the merge's copy: no tensor of theirs in memory
            sources = opened.enter_context(DataFiles(plan.folder.path))
            sources.prefetch((c.file, c.offset, c.length) for _, _, t in copies
                             for c in t.source.chunks)
            for fd, start, t in copies:
                place_tensor(sources, t.source, t.runs, t.spec.dtype, fd, start,
                             progress=progress, writeback=writebacks[fd])
                writebacks[fd].hand_over(start, t.spec.nbytes)
        for name, tensor in tensors:
            if name not in where:  # not planned (a tied target), or another rank's share
                continue
            fd, offset, spec = where.pop(name)
            data = tensor.contiguous().view(-1).view(dtype=_uint8()).numpy()
            if tuple(tensor.shape) != tuple(spec.shape) or len(data) != spec.nbytes or \
                    str(tensor.dtype) != f"torch.{spec.dtype.name}":  # same size, other type
                raise CorruptCheckpointError(f"{name}: came out {tuple(tensor.shape)}, "
                                             f"{tensor.dtype}; the layout said {spec.shape}, "
                                             f"{spec.dtype.name}")
            pwrite_all(fd, memoryview(data), offset)
            writebacks[fd].hand_over(offset, spec.nbytes)
            if progress:
                progress(spec.nbytes)
        if where:
            raise CorruptCheckpointError(f"{next(iter(where))}: planned, but never computed "
                                         f"({len(where)} such tensors); the checkpoint changed "
                                         "while it was read")
        for fd in fds:
            os.fsync(fd)
    return paths


def _uint8() -> Any:
    import torch

    return torch.uint8


def write_index(plan: MergePlan, stage: Path) -> Path | None:
    """The plan's index file into ``stage``, fsynced; its path (None: the plan has none)."""
    if not plan.index_name:
        return None
    path = stage / plan.index_name
    write_bytes(path, index_bytes(plan.index()))
    return path


def commit(written: list[Path], output_dir: Path) -> list[Path]:
    """The commit stage: rename staged files into ``output_dir`` in order (the index last)
    and make the renames durable; return the final paths."""
    return rename_into(written, output_dir)
