"""The ranks' exchanges of a spread upload (:mod:`fsdpckpt._io.spread_remote`): bytes sent to
the rank that uploads their part, with every rank's status in the same exchange.

Every exchange is a :meth:`Ranks.round`, which every rank enters at the same point of the
protocol (entering the output, each ``open``, ``step``, ``finish``, the end of the block,
the commit). A round first gathers one small header from every rank (CPU int64 tensors): its
status (fine or failed), which point of the protocol it is at, and how many records and
bytes it sends to each rank. Then, every rank having the same headers, every rank decides
the same thing:

* a rank failed: its error message is gathered (bytes tensors) and every rank raises the
  same error: the failing rank its own, the others the same class and message where it is
  fsdpckpt's own (:func:`same_error`). A rank that fails between rounds (an error in
  ``write``, a failed part upload, Ctrl-C) enters one round, failed, from its exit path:
  whichever round the others are at, they learn it there. After that no rank exchanges
  again (:attr:`Ranks.failed`): every rank knows, so nobody waits for anybody.
* the ranks are at different points (one called ``step`` once more than another): every
  rank raises the same error saying so.
* else the records and bytes move, point to point (``isend``/``irecv``), each rank's
  outgoing bytes sent straight from the buffer it queued them in.

SIGINT and SIGTERM are held during a round (:func:`~fsdpckpt._io.staging.signals_deferred`)
so that Ctrl-C cannot leave one rank half through an exchange the others finish; they
act right after it. Without a process group (a single process) a round only decides.
"""

from __future__ import annotations

import contextlib
import errno as _errno
from collections.abc import Iterator
from typing import Any, cast

from fsdpckpt import errors
from fsdpckpt._io.staging import signals_deferred
from fsdpckpt.errors import REPORTED_BY_RANK, FsdpCkptError, OptionError

__all__ = ["Ranks", "Outbox", "same_error", "ENTER", "OPEN", "STEP", "FINISH", "ETAGS", "EXIT",
           "COMMIT", "CLEANUP"]

ENTER, OPEN, STEP, FINISH, ETAGS, EXIT, COMMIT, CLEANUP = range(8)
_POINTS = ("entering the output", "open()", "step()", "finish()", "finish()",
           "the end of the block", "the commit", "the cleanup")
_OK, _FAILED = 0, 1
_HEAD = 5  # status, point, check, errno, message length; then records, bytes per rank
_MESSAGE = 4000  # bytes of an error message that travel
_GLOO: dict[int, Any] = {}


def same_error(kind: str, message: str, rank: int, code: int = 0) -> BaseException:
    """The error rank ``rank`` met (class name ``kind``), as another rank raises it: the same
    class and message for fsdpckpt's own errors, else one naming the rank."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, FsdpCkptError) and cls is not FsdpCkptError:
        # RemoteStorageError takes the message alone, OutputNotWritableError an errno first.
        for args in ((message,), (code or _errno.EIO, message)):
            try:
                made = cls(*args)
            except TypeError:
                continue
            if str(made) == message:
                return made
    return FsdpCkptError(f"rank {rank} failed, so this rank stops too: {message}")


class Outbox:
    """What one rank sends in the next round: per destination rank, records
    ``(key, length)`` and their bytes, back to back in one growing buffer."""

    def __init__(self, world: int) -> None:
        self.records: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        self.data = [bytearray() for _ in range(world)]

    def add(self, dest: int, key: int, view: Any) -> None:
        self.records[dest].append((key, len(view)))
        self.data[dest] += view

    def clear(self) -> None:
        # New buffers, not emptied ones: a tensor made from the old one may still view it.
        self.records = [[] for _ in self.data]
        self.data = [bytearray() for _ in self.data]


class Ranks:
    """The ranks of ``group`` (None: the default group; no process group: one rank) at the
    rounds of one spread upload into ``where`` (named in the errors)."""

    def __init__(self, group: Any, where: str) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.group = _cpu_group(dist, group) if self.dist else None
        self.rank = self.dist.get_rank(self.group) if self.dist else 0
        self.world = self.dist.get_world_size(self.group) if self.dist else 1
        self.where = where
        self.failed = False  # a failure was exchanged: every rank knows, no more rounds
        self.broken = False  # a collective itself failed: the ranks cannot talk any more

    def round(self, point: int, check: int = 0, *, error: BaseException | None = None,
              send: Outbox | None = None) -> list[list[tuple[int, memoryview]]]:
        """Exchange at ``point`` (``check``: a number every rank must agree on there);
        ``error``: this rank failed. Returns, per source rank, the ``(key, bytes)`` it sent
        here.

        Raises:
            BaseException: a rank failed, or the ranks are at different points: the same
                error on every rank (``error`` itself on the rank it came from).
        """
        if self.failed:  # an error of a round was caught and the caller went on
            raise FsdpCkptError(f"{self.where}: {_POINTS[point]} after a failed exchange; "
                                "the ranks stopped, leave the block")
        with signals_deferred():
            try:
                return self._round(point, check, error, send)
            except BaseException:
                self.failed = True
                raise

    def _round(self, point: int, check: int, error: BaseException | None,
               send: Outbox | None) -> list[list[tuple[int, memoryview]]]:
        import torch

        world = self.world
        send = send or Outbox(world)
        message = b""
        if error is not None:
            text = str(error) or type(error).__name__
            message = f"{type(error).__name__}\0{text}".encode()[:_MESSAGE]
        head = torch.zeros(_HEAD + 2 * world, dtype=torch.int64)
        head[:_HEAD] = torch.tensor([_FAILED if error is not None else _OK, point, check,
                                     int(getattr(error, "errno", 0) or 0), len(message)])
        for dest in range(world):
            head[_HEAD + dest] = len(send.records[dest])
            head[_HEAD + world + dest] = len(send.data[dest])
        heads = self._gather(head)
        failed = [r for r in range(world) if heads[r][0] == _FAILED]
        if failed:
            texts = self._gather(_padded(message, max(int(h[4]) for h in heads)))
            first = failed[0]
            kind, _, text = bytes(texts[first][:int(heads[first][4])].tolist()
                                  ).decode(errors="replace").partition("\0")
            common = same_error(kind, text, first, int(heads[first][3]))
            if type(common) is FsdpCkptError:  # not fsdpckpt's own: say where, too
                common = FsdpCkptError(f"{self.where}: {common}")
            raise self._mine(error, common, first)
        points = {(int(h[1]), int(h[2])) for h in heads}
        if len(points) > 1:
            where = ", ".join(f"rank {r} at {_POINTS[int(h[1])]}" for r, h in enumerate(heads))
            raise FsdpCkptError(
                f"{self.where}: the ranks are out of step ({where}); every rank must open "
                "the same files (names and sizes) in the same order and call step() on each "
                "as many times")
        return list(self._move(heads, send))

    def _mine(self, error: BaseException | None, common: BaseException,
              first: int) -> BaseException:
        # The error this rank raises: its own when it is the one every rank reports (or a
        # Ctrl-C, never turned into another error), else the common one.
        if error is not None and (first == self.rank or isinstance(error, KeyboardInterrupt)):
            return error
        if first < self.rank:
            setattr(common, REPORTED_BY_RANK, first)  # printed once, by the lowest rank
        if error is not None:
            common.__cause__ = error
        return common

    def _gather(self, tensor: Any) -> list[Any]:
        if self.dist is None:
            return [tensor]
        out = [tensor.new_empty(tensor.shape) for _ in range(self.world)]
        with self._talking():
            self.dist.all_gather(out, tensor, group=self.group)
        return out

    @contextlib.contextmanager
    def _talking(self) -> Iterator[None]:
        # A collective that fails (a rank died, the group's timeout passed) ends the talk.
        try:
            yield
        except Exception as exc:
            self.broken = True
            raise FsdpCkptError(
                f"{self.where}: the ranks stopped answering each other ({exc}); a rank died or "
                "hangs: nothing of this output is kept") from exc
        except BaseException:
            self.broken = True
            raise

    def _move(self, heads: list[Any], send: Outbox) -> Iterator[list[tuple[int, memoryview]]]:
        import torch

        world, me = self.world, self.rank
        records_in = [int(heads[src][_HEAD + me]) for src in range(world)]
        bytes_in = [int(heads[src][_HEAD + world + me]) for src in range(world)]
        recs: list[Any] = [None] * world
        data: list[Any] = [None] * world
        works: list[Any] = []
        for peer in range(world):
            if peer == me:
                recs[peer] = torch.tensor(send.records[me], dtype=torch.int64).reshape(-1, 2)
                data[peer] = _tensor(send.data[me])
                continue
            if send.records[peer]:
                works.append(self._p2p("isend", torch.tensor(send.records[peer],
                                                             dtype=torch.int64), peer))
            if send.data[peer]:
                works.append(self._p2p("isend", _tensor(send.data[peer]), peer))
            recs[peer] = torch.empty((records_in[peer], 2), dtype=torch.int64)
            data[peer] = torch.empty(bytes_in[peer], dtype=torch.uint8)
            if records_in[peer]:
                works.append(self._p2p("irecv", recs[peer], peer))
            if bytes_in[peer]:
                works.append(self._p2p("irecv", data[peer], peer))
        with self._talking():
            for work in works:
                work.wait()
        send.clear()
        for src in range(world):
            view, at, items = memoryview(data[src].numpy()), 0, []
            for key, length in recs[src].tolist():
                items.append((key, view[at:at + length]))
                at += length
            yield items

    def _p2p(self, op: str, tensor: Any, peer: int) -> Any:
        dist = cast(Any, self.dist)
        with self._talking():
            if op == "isend":
                return dist.isend(tensor, group=self.group, group_dst=peer)
            return dist.irecv(tensor, group=self.group, group_src=peer)


def _tensor(buffer: bytearray) -> Any:
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else \
        torch.empty(0, dtype=torch.uint8)


def _padded(message: bytes, length: int) -> Any:
    import torch

    out = torch.zeros(length, dtype=torch.uint8)
    if message:
        out[:len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    return out


def _cpu_group(dist: Any, group: Any) -> Any:
    # The rounds move CPU tensors: a gloo group. A default group of NCCL alone gets a gloo
    # twin over every rank, made once (new_group is collective: every rank enters the
    # output at the same point, so every rank makes it there).
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise OptionError(f"group={group!r}: its backend ({dist.get_backend(group)}) cannot "
                          "move CPU tensors; pass a gloo group (dist.new_group(ranks, "
                          "backend='gloo'))")
    key = id(dist.group.WORLD)
    if key not in _GLOO:
        _GLOO[key] = dist.new_group(backend="gloo")
    return _GLOO[key]
