"""The spread-file protocol of :mod:`fsdpckpt._io.spread` on object storage (S3): every
rank uploads its own bytes, as parts of one multipart upload per file.

A file is cut into fixed parts (:func:`~fsdpckpt._io.multipart.part_size`; S3 wants 5 MiB
or more but for the last); part ``k`` (from 0) of the ``i``-th file opened is uploaded by
rank ``(i + k) % world``, as part number ``k + 1`` (so files of one part, smaller than a
part, are spread over the ranks too). :meth:`_File.write` copies the bytes of this rank's
own parts into their part's buffer and queues the bytes of the others' parts; at each
:meth:`_File.step` (every rank, after each window of a tensor) the queued bytes move to the
rank that owns their part (:class:`~fsdpckpt._io.spread_rounds.Ranks`), and each rank
uploads its parts that are complete (a few at once) and frees them. So a rank holds about
one window's share plus the parts it is filling, whatever the file's size, and no byte goes
through a rank other than the one that uploads it. :meth:`_File.finish` uploads the rest,
refuses a part some byte of which was never written (a byte written twice is refused when
it arrives), and sends the part ETags to rank 0.

Rank 0 starts every upload (:meth:`_Target.open`, its upload ID sent to the others) and
completes them all: the ETags it gathers are a few dozen bytes a part, and with one rank
making every object appear, none appears before every rank said it finished every part.
The commit, as :mod:`fsdpckpt._io.publish_remote`'s: the uploads are completed in the order
opened and the small files put (:meth:`_Target.put`) after them, the ``commit`` file (the
one a reader opens first) last, an earlier one of its name deleted first; each appears
whole or not at all.

A failure on any rank (an error, a failed upload, Ctrl-C) reaches every rank at its next
exchange; then rank 0 aborts the uploads not completed and deletes the objects already
written (as :func:`~fsdpckpt._io.publish_remote.undo`), the ranks meet once more so none
returns before that, and every rank raises the same error. A rank that dies is noticed when
an exchange fails; the others then abort every upload they know of (each knows every ID).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from typing import Any, cast

from fsdpckpt._io import multipart
from fsdpckpt._io.checksums import crc32
from fsdpckpt._io.publish_remote import (
    check_remote_output,
    delete,
    refuse_held,
    uncommit_replaced,
)
from fsdpckpt._io.remote import RemotePath
from fsdpckpt._io.spread_rounds import (
    CLEANUP,
    COMMIT,
    ENTER,
    ETAGS,
    EXIT,
    FINISH,
    OPEN,
    STEP,
    Outbox,
    Ranks,
)
from fsdpckpt._io.storage import Place, put_bytes
from fsdpckpt.errors import FsdpCkptError, RemoteStorageError

__all__ = ["remote_spread_folder"]


class _Part:
    """A part this rank uploads, while the ranks fill it: its bytes and which are written."""

    def __init__(self, start: int, length: int) -> None:
        self.start, self.length = start, length
        self.buffer = bytearray(length)
        self.spans: list[list[int]] = []  # written [start, end), sorted, touching ones merged
        self.filled = 0

    def take(self, at: int, view: memoryview) -> tuple[int, int] | None:
        """Copy ``view`` to file offset ``at``; the file range already written it overlaps."""
        lo, hi = at - self.start, at - self.start + len(view)
        i = bisect.bisect_right(self.spans, [lo, hi])
        if i and self.spans[i - 1][1] > lo:
            return at, self.start + min(hi, self.spans[i - 1][1])
        if i < len(self.spans) and self.spans[i][0] < hi:
            return self.start + self.spans[i][0], self.start + min(hi, self.spans[i][1])
        self.buffer[lo:hi] = view
        self.filled += hi - lo
        self.spans.insert(i, [lo, hi])
        for j in (i, i - 1):  # merge with the next span, then with the previous one
            if 0 <= j < len(self.spans) - 1 and self.spans[j][1] == self.spans[j + 1][0]:
                self.spans[j][1] = self.spans.pop(j + 1)[1]
        return None

    def gap(self) -> tuple[int, int]:
        """The first file range not written."""
        end = 0
        for lo, hi in self.spans:
            if lo > end:
                break
            end = hi
        nxt = next((lo for lo, _ in self.spans if lo > end), self.length)
        return self.start + end, self.start + nxt


class _File:
    """One file of the output, on this rank: the parts it owns and the bytes it sends."""

    def __init__(self, target: _Target, index: int, name: str, size: int,
                 upload: multipart.Upload) -> None:
        self.target, self.index, self.name, self.size = target, index, name, size
        self.upload = upload
        self.part = multipart.part_size(size)
        self.count = max(1, -(-size // self.part))  # an empty file: one empty part
        ranks = target.ranks
        self.mine = range((ranks.rank - index) % ranks.world, self.count, ranks.world)
        self.parts: dict[int, _Part] = {}
        self.etags: dict[int, str] = {}  # part number: ETag, of this rank's uploaded parts
        self.outbox = Outbox(ranks.world)
        self.finished = False

    def _url(self) -> str:
        return f"{self.target.out}/{self.name}"

    def write(self, offset: int, data: Any) -> None:
        view = memoryview(data.numpy() if hasattr(data, "numpy") else data).cast("B")
        end = offset + len(view)
        if self.finished:
            raise FsdpCkptError(f"{self._url()}: written after finish()")
        if offset < 0 or end > self.size:
            raise FsdpCkptError(f"{self._url()}: bytes {offset}..{end} lie outside the "
                                f"file's {self.size}; the plan is wrong")
        ranks, at = self.target.ranks, offset
        while at < end:
            k = at // self.part
            stop = min(end, (k + 1) * self.part)
            piece = view[at - offset:stop - offset]
            owner = (self.index + k) % ranks.world
            if owner == ranks.rank:
                self._take(k, at, piece)
            else:
                self.outbox.add(owner, at, piece)
            at = stop

    def _take(self, k: int, at: int, view: memoryview) -> None:
        overlap: tuple[int, int] | None = (at, at + len(view))  # the part is uploaded
        if k + 1 not in self.etags:
            part = self.parts.get(k)
            if part is None:  # the first bytes of this part: its buffer, a part's size
                part = self.parts[k] = self._part(k)
            overlap = part.take(at, view)
        if overlap is not None:
            raise FsdpCkptError(f"{self._url()}: bytes {overlap[0]}..{overlap[1]} written "
                                "twice; every byte of a file must be written by one rank, once")

    def _part(self, k: int) -> _Part:
        return _Part(k * self.part, min(self.part, self.size - k * self.part))

    def step(self) -> None:
        self._exchange(STEP)

    def _exchange(self, point: int) -> None:
        for items in self.target.ranks.round(point, self.index, send=self.outbox):
            for at, view in items:
                self._take(at // self.part, at, view)
        self._upload(lambda part: part.filled == part.length)

    def _upload(self, ready: Any) -> None:
        done = sorted(k for k, part in self.parts.items() if ready(part))
        for k in done:
            part = self.parts[k]
            if part.filled != part.length:
                lo, hi = part.gap()
                raise FsdpCkptError(f"{self._url()}: bytes {lo}..{hi} were never written; "
                                    "the ranks' shards do not cover the file")
        self.etags.update(self.upload.parts({k + 1: self.parts[k].buffer for k in done}))
        for k in done:
            del self.parts[k]  # its bytes are at the store: freed

    def finish(self) -> None:
        if self.finished:
            raise FsdpCkptError(f"{self._url()}: finish() called twice")
        self.finished = True
        self._exchange(FINISH)
        for k in self.mine:  # parts never touched: empty ones are uploaded, others refused
            if k + 1 not in self.etags and k not in self.parts:
                self.parts[k] = self._part(k)
        self._upload(lambda part: True)
        tags = Outbox(self.target.ranks.world)
        for number, etag in self.etags.items():
            tags.add(0, number, etag.encode())
        for items in self.target.ranks.round(ETAGS, self.index, send=tags):
            for number, view in items:
                self.target.etags[self.index][number] = bytes(view).decode()


class _Target:
    """The output ``out`` while the ranks write it; rank 0 holds what commits or undoes it."""

    def __init__(self, out: RemotePath, commit: str, ranks: Ranks) -> None:
        self.out, self.commit_name, self.ranks = out, commit, ranks
        self.names: list[str] = []
        self.files: list[_File] = []
        # Rank 0 only: every upload started, ETags per file, small files, objects written.
        self.uploads: list[multipart.Upload] = []
        self.etags: list[dict[int, str]] = []
        self.puts: dict[str, bytes] = {}
        self.written: list[RemotePath] = []

    def enter(self, overwrite: bool) -> None:
        error = None
        try:
            multipart.s3_client(self.out)
            if self.ranks.rank == 0:
                check_remote_output(self.out)
                if not overwrite:
                    refuse_held(self.out)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the round
            error = exc
        self.ranks.round(ENTER, error=error)

    def open(self, name: str, size: int) -> _File:
        if name in self.names:
            raise FsdpCkptError(f"{self.out}/{name}: opened twice in one output")
        self.names.append(name)
        path, error, upload = self.out / name, None, None
        ids = Outbox(self.ranks.world)
        if self.ranks.rank == 0:
            try:
                upload = multipart.Upload.start(path)
                self.uploads.append(upload)
                self.etags.append({})
                for dest in range(1, self.ranks.world):
                    ids.add(dest, 0, upload.upload_id.encode())
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the round
                error = exc
        check = crc32(f"{name}\0{size}".encode())
        got = self.ranks.round(OPEN, check, error=error, send=ids)
        if upload is None:
            upload = multipart.Upload(path, bytes(got[0][0][1]).decode())
        file = _File(self, len(self.files), name, size, upload)
        self.files.append(file)
        return file

    def put(self, name: str, data: bytes) -> None:
        if self.ranks.rank != 0:
            raise FsdpCkptError(f"{self.out}/{name}: put on rank {self.ranks.rank}; only "
                                "rank 0 writes the small files")
        if name in self.names:
            raise FsdpCkptError(f"{self.out}/{name}: written twice in one output")
        self.names.append(name)
        self.puts[name] = bytes(data)  # uploaded at the commit, after every file's parts

    # -- the end of the block ------------------------------------------------------------------
    def commit(self) -> None:
        """Every rank left the block: agree, rank 0 commits, every rank learns how it went."""
        unfinished = [f.name for f in self.files if not f.finished]
        self.ranks.round(EXIT, len(self.files), error=FsdpCkptError(
            f"{self.out}/{unfinished[0]}: finish() was never called on it; every rank calls "
            "it once the file is written") if unfinished else None)
        error = None
        if self.ranks.rank == 0:
            try:
                self._publish()
            except BaseException as exc:  # noqa: BLE001 - raised on every rank by the round
                error = exc
        self.ranks.round(COMMIT, error=error)
        self.out.forget_listings()

    def _publish(self) -> None:
        last = self.commit_name
        # An earlier output uncommitted first where the new files replace its own by name.
        uncommit_replaced(self.out, [n for n in self.names if n != last], [last])
        for file in sorted(self.files, key=lambda f: f.name == last):
            etags = self.etags[file.index]
            if sorted(etags) != list(range(1, file.count + 1)):
                raise FsdpCkptError(f"{self.out}/{file.name}: ETags of parts "
                                    f"{sorted(set(range(1, file.count + 1)) - set(etags))} "
                                    "never reached rank 0")
            if file.name == last:
                self._puts(skip=last)
            file.upload.complete(etags)
            self.written.append(file.upload.path)
        self._puts()

    def _puts(self, skip: str | None = None) -> None:
        for name in sorted(self.puts, key=lambda n: n == self.commit_name):
            if name != skip:
                put_bytes(self.out / name, self.puts.pop(name))
                self.written.append(self.out / name)

    def fail(self, exc: BaseException) -> BaseException:
        """This rank (or, learnt in a round, another) failed with ``exc``: tell the others
        unless they know, undo (rank 0), meet once more; the error to raise."""
        error = exc
        if not self.ranks.failed:
            try:
                self.ranks.round(EXIT, error=exc)
            except BaseException as common:  # noqa: BLE001 - the error every rank raises
                error = common
        note = None
        if self.ranks.rank == 0:
            note = self._undo(error)
        elif self.ranks.broken:
            # Rank 0 may be gone: every rank knows every upload's ID, so it aborts them.
            for file in self.files:
                with contextlib.suppress(Exception):
                    file.upload.abort()
        if not self.ranks.broken:
            # Once more, so that no rank returns before rank 0 undid the output, and every
            # rank says what was left if the store stopped answering.
            self.ranks.failed = False
            try:
                self.ranks.round(CLEANUP, error=note)
            except BaseException as left:  # noqa: BLE001 - rank 0's note, on every rank
                left.__cause__ = error
                return left
        return note or error

    def _undo(self, error: BaseException) -> RemoteStorageError | None:
        # Rank 0: every upload aborted, every object written deleted (the commit file last
        # of all, never left without the rest).
        left: list[str] = []
        for upload in self.uploads:
            if upload.path not in self.written:
                try:
                    upload.abort()
                except Exception:  # noqa: BLE001 - reported below, with the rest
                    left.append(f"{upload.path} (upload {upload.upload_id})")
        left += [str(p) for p in delete(list(reversed(self.written)))]
        if not left:
            return None
        return RemoteStorageError(
            f"{error}. Left behind, as the store stopped answering: {', '.join(left[:3])}"
            f"{'...' if len(left) > 3 else ''}; delete them (aws s3api "
            "abort-multipart-upload for an upload) or run again with overwrite=True")


@contextlib.contextmanager
def remote_spread_folder(out: Place, *, overwrite: bool, commit: str,
                         group: Any = None) -> Iterator[_Target]:
    """:func:`fsdpckpt._io.spread.spread_folder` on object storage (S3 and stores with its
    multipart API). Collective: every rank enters it with the same arguments.

    Args:
        out: the output folder, a :class:`~fsdpckpt._io.remote.RemotePath`.
        overwrite: replace files of the same names in an output that holds files (others
            are kept); without it such an output is refused before anything is uploaded.
        commit: the file a reader opens first (``config.json``): uploaded last.
        group: the process group (None: the default one; a single process without one).
            A group without gloo (NCCL alone) is twinned by a gloo group of every rank.

    Returns:
        The target (a :class:`~fsdpckpt._io.spread.SpreadTarget`) of the ``with`` block.

    Example::

        with remote_spread_folder(location("s3://b/out"), overwrite=False,
                                  commit="config.json") as target:
            f = target.open("model.safetensors", size)
            f.write(offset, my_bytes)  # this rank's ranges only
            f.step()                   # every rank, after each window
            f.finish()
            if rank == 0:
                target.put("config.json", config)

    Raises:
        OptionError: ``out`` is on a store without multipart uploads (gs://, az://).
        OutputExistsError: ``out`` holds files and ``overwrite`` is False (on every rank,
            before anything is written).
        OutputNotWritableError: ``out`` is a file, or the bucket is missing or refuses.
        RemoteStorageError: the store failed a request (after its bounded retries); nothing
            of the output is left (the message says what is, if the store stopped answering).
        FsdpCkptError: another rank failed (its error, where it is fsdpckpt's own).
    """
    remote = cast(RemotePath, out)
    ranks = Ranks(group, str(remote))
    target = _Target(remote, commit, ranks)
    target.enter(overwrite)
    try:
        yield target
        target.commit()
    except BaseException as exc:
        error = target.fail(exc)
        if error is exc:
            raise
        raise error from exc
