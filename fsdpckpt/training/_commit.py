"""The end of a save: the manifest written last (rank 0, from every rank's checksums), and
the handle of an asynchronous save whose ``wait()`` does that once every part is written."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpckpt._io import storage
from fsdpckpt.training import _remote
from fsdpckpt.training._diskfull import raising_disk_full, removed_on_failure
from fsdpckpt.training._dist import dist_or_none, everywhere, rank_world
from fsdpckpt.training._layout import remove_stale_parts
from fsdpckpt.training.manifest import (
    MANIFEST,
    Archives,
    FileRecord,
    build_manifest,
    own_checksums,
    write_manifest,
)

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

__all__ = ["AsyncSave", "Finish"]

log = logging.getLogger("fsdpckpt")


class AsyncSave:
    """The handle :func:`save_state` returns with ``async_save=True``.

    The checkpoint is complete only once :meth:`wait` has returned on every rank.
    """

    def __init__(self, futures: list[tuple[Path | RemotePath, Any]], finish: Any) -> None:
        # Each part folder with its background write: a full disk names the part it hit.
        self._futures, self._finish, self._finished = futures, finish, False

    @property
    def manifest_digest(self) -> str | None:
        """The digest of the manifest written by :meth:`wait` (rank 0), else None."""
        return self._finish.digest

    def done(self) -> bool:
        """Whether every part has been written (no waiting); the manifest comes with wait()."""
        return all(f.done() for _, f in self._futures)

    def wait(self) -> None:
        """Block until every part is written; call it on every rank.

        Raises:
            DiskFullError: the disk filled; what the save wrote is removed, as by save_state.
        """
        root = self._finish.root

        def results() -> None:
            failure: BaseException | None = None
            for folder, future in self._futures:  # all end before anything is removed
                try:
                    with raising_disk_full(folder):
                        future.result()
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException too
                    failure = failure or exc
            if failure is not None:
                raise failure

        with removed_on_failure(root, remove_stale_parts, rank=rank_world()[0]):
            everywhere(results)
            if not self._finished:
                self._finish()
                self._finished = True


class Finish:
    """Completes a save on every rank: gathers the checksums, rank 0 writes the manifest."""

    def __init__(
        self,
        root: Path | RemotePath,
        records: dict[str, dict[str, FileRecord]],
        step: int | None,
        *,
        manifest: bool,
        digest: str | None,
        archives: dict[str, Archives] | None = None,
    ) -> None:
        self.root, self.records, self.step, self.manifest = root, records, step, manifest
        self.archives = archives or {}
        self.file_digest = digest
        self.digest: str | None = None  # the manifest's own, once written (rank 0)

    def __call__(self) -> None:
        dist = dist_or_none()
        rank, world = rank_world()
        files: dict[str, FileRecord] = {}
        chunks: dict[str, dict[str, str]] = {}
        if self.manifest:
            # Each rank reads the CRC-32s of its own chunks (their archives just written, in
            # its page cache) and sends rank 0 only what the manifest lists: a (size, CRC)
            # per file and 8 hex digits a chunk, not every write's pieces to every rank.
            files, chunks = everywhere(lambda: own_checksums(self.root, self.records,
                                                             self.archives))
        if dist and self.manifest:
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object((files, chunks), gathered, dst=0)
            if gathered is not None:
                for part_files, part_chunks in gathered:
                    files.update(part_files)
                    for folder, listed in part_chunks.items():
                        chunks.setdefault(folder, {}).update(listed)

        def on_rank_zero() -> None:
            if rank == 0 and self.manifest:
                storage.refresh(self.root)  # the other ranks' files, listed anew (remote)
                with raising_disk_full(self.root / MANIFEST):
                    self.digest = write_manifest(
                        self.root,
                        build_manifest(
                            files,
                            chunks,
                            world_size=world,
                            step=self.step,
                            digest=self.file_digest,
                        ),
                    )
                log.info(
                    "fsdpckpt: saved %s; manifest digest %s (keep it elsewhere; "
                    "`fsdpckpt verify --expect-digest` checks the checkpoint against it)",
                    self.root,
                    self.digest,
                )
                # Committed: the names made durable (local), the intent marker gone (remote).
                _after_manifest(self.root, [self.root / f for f in self.records if f])

        everywhere(on_rank_zero)


def _after_manifest(root: Path | RemotePath, parts: list[Path | RemotePath]) -> None:
    """The manifest is written (the commit): its names made durable (a local folder and
    its parts fsynced), then the intent marker removed (only a save to object storage
    wrote one, training/_remote.py)."""
    for folder in [root, *parts]:
        storage.sync_names(folder)
    _remote.end_save(root)
