"""Executing a merge plan: every output file written under a temporary name, then renamed.

Files are staged in a hidden folder inside the output folder (same file system,
so the final renames are atomic), space is reserved up front so a full disk
fails before the copy rather than in the middle, and on any error or Ctrl-C
the staging folder is removed, leaving the output folder as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .archive import locate_tensor
from .copy import place_chunk
from .durable import fsync_dir, write_bytes
from .rawio import pwrite_all, reusing_scratch
from .manifest import crc32_range
from .errors import CheckpointNotFoundError, FsdpCkptError, NotACheckpointError
from .formats import ObjectValue, get_format
from .objects import read_object
from .plan import MergePlan, PlannedFile, chunk_runs

__all__ = ["OutputExistsError", "DiskFullError", "write_plan", "output_paths", "staging", "commit"]

class OutputExistsError(FsdpCkptError, FileExistsError):
    """An output file is already there and ``overwrite`` was not given."""


class DiskFullError(FsdpCkptError, OSError):
    """The output's file system has not enough free space."""


def output_paths(plan: MergePlan, output_dir: Path) -> list[Path]:
    """Every file the plan writes into ``output_dir``."""
    names = [f.name for f in plan.files] + ([plan.index_name] if plan.index_name else [])
    return [output_dir / n for n in names]


@contextlib.contextmanager
def staging(output_dir: Path) -> Iterator[Path]:
    """A hidden folder inside ``output_dir`` that is removed on exit, whatever happens.

    ``output_dir`` (and missing parents) is created if needed, and removed again on
    failure if it was.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise NotACheckpointError(f"{output_dir}: is a file; pass a folder for the output.")
    created = output_dir  # the outermost folder this merge creates, removed on failure
    while not created.parent.exists():
        created = created.parent
    if created.exists():
        created = None  # type: ignore[assignment]
    output_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".fsdpckpt-tmp-", dir=output_dir))
    ok = False
    try:
        yield stage
        ok = True
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if created is not None and not ok:
            shutil.rmtree(created, ignore_errors=True)


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


def _start_writeback(fd: int, start: int, count: int) -> None:
    # Ask the kernel to start writing this tensor's pages now, while the next ones are
    # copied, so the final fsync has little left to wait for (and the page cache does
    # not fill up with the output). Linux starts writeback of dirty pages on DONTNEED.
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, count, os.POSIX_FADV_DONTNEED)


class _Sources:
    """Open data files of the merged folder, opened once each."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.fds = folder, {}  # type: ignore[var-annotated]

    def fd(self, name: str) -> int:
        if name not in self.fds:
            path = self.folder / name
            try:
                self.fds[name] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"{path}: missing data file; copy it from the machine that wrote the "
                    "checkpoint") from None
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _write_file(plan: MergePlan, file: PlannedFile, objects: list[ObjectValue], path: Path,
                sources: _Sources, progress: Callable[[int], None] | None) -> None:
    fmt = get_format(plan.format)
    layout = fmt.layout([t.spec for t in file.tensors], objects, nested=plan.nested)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _reserve(fd, layout.size, path)
        for offset, data in layout.fixed:
            pwrite_all(fd, data, offset)
        crcs = {}
        for planned in file.tensors:
            entry, start = planned.source, layout.starts[planned.spec.name]
            for chunk in entry.chunks:
                source = f"{plan.folder.path / str(chunk.file)} (tensor '{entry.name}' chunk at " \
                         f"{list(chunk.offsets)})"
                if chunk.file is None:
                    raise NotACheckpointError(f"{source}: the metadata has no storage entry")
                src = sources.fd(chunk.file)
                with os.fdopen(os.dup(src), "rb") as handle:
                    raw = locate_tensor(handle, chunk.offset, chunk.length, source=source)
                if raw.dtype.name != entry.dtype.name:
                    raise NotACheckpointError(f"{source}: holds {raw.dtype.name}, the metadata "
                                              f"says {entry.dtype.name}")
                place_chunk(src, raw, chunk, chunk_runs(entry.shape, chunk), planned.spec.dtype,
                            fd, start, source=source, progress=progress)
            if fmt.needs_crc:
                crcs[planned.spec.name] = crc32_range(fd, start, planned.spec.nbytes)
            _start_writeback(fd, start, planned.spec.nbytes)
        fmt.finish(fd, layout, crcs)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_objects(plan: MergePlan, sources: _Sources) -> list[ObjectValue]:
    values = []
    for obj in plan.objects:
        source = f"{plan.folder.path / str(obj.source.file)} (object '{obj.source.name}')"
        if obj.source.file is None:
            raise NotACheckpointError(f"{source}: the metadata has no storage entry")
        with os.fdopen(os.dup(sources.fd(obj.source.file)), "rb") as handle:
            values.append(ObjectValue(obj.name, obj.key_path,
                                      read_object(handle, obj.source, source=source)))
    return values


@reusing_scratch()  # one set of block buffers for the whole merge
def write_plan(plan: MergePlan, stage: Path, *,
               progress: Callable[[int], None] | None = None) -> list[Path]:
    """Write every file of ``plan`` into the folder ``stage``; return their paths.

    Raises:
        DiskFullError: the file system cannot hold the output.
        CorruptCheckpointError, CheckpointNotFoundError: a data file is damaged or missing.
    """
    free = shutil.disk_usage(stage).free
    sources = _Sources(plan.folder.path)
    try:
        objects = _read_objects(plan, sources)
        needed = plan.tensor_bytes + 2**20 * len(plan.files)
        if needed > free:
            raise DiskFullError(errno.ENOSPC, f"{stage.parent}: the merge needs about {needed} "
                                f"bytes, only {free} are free; free some space or choose "
                                "another output folder")
        written = []
        for i, file in enumerate(plan.files):
            path = stage / file.name
            _write_file(plan, file, objects if i == 0 else [], path, sources, progress)
            written.append(path)
        if plan.index_name:
            path = stage / plan.index_name
            write_bytes(path, (json.dumps(plan.index(), indent=2) + "\n").encode())
            written.append(path)
        return written
    finally:
        sources.close()


def commit(written: list[Path], output_dir: Path) -> list[Path]:
    """Rename staged files into ``output_dir`` (the index last) and make the renames durable."""
    final = []
    for path in written:
        target = output_dir / path.name
        os.replace(path, target)
        final.append(target)
    fsync_dir(output_dir)
    return final

