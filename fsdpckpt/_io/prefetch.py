"""Reading remote chunks ahead of their reader: parallel ranged GETs, bounded bytes in flight.

A merge or a verify knows, before it starts, every chunk it will read and in what order
(``(file, offset, length)`` of each chunk's archive). Read one after another, each chunk
costs a round trip for its zip header and one per 32 MiB of data, and the output waits on
every one. :class:`Prefetcher` instead cuts the announced ranges into pieces and fetches
them on a few threads, in the order they will be read, while the reader works; reads
then come from memory.

What is held is bounded: pieces are started only while the bytes started and not yet
dropped stay under ``budget`` (default 96 MiB), and a piece is dropped as soon as the
reader has moved past it. Small neighbouring chunks of one file share a piece (one
request for many small tensors); a large chunk is cut into its head (its zip header and
first data), its tail (the zip directory, read first by the zip reader) and the pieces
between, fetched head and tail first.

Correctness never depends on the prefetch: a read no piece covers (a chunk read out of
order, an object entry, a piece not started yet) is fetched directly, exactly as without
a prefetcher, and a piece whose fetch failed raises its error only when, and where, the
reader asks for its bytes, so a failing range surfaces once, as the direct read would.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["Prefetcher", "BUDGET", "PIECE", "WORKERS"]

#: The most bytes fetched ahead and held at once.
BUDGET = 96 << 20
#: Pieces are at most this large (one ranged GET each).
PIECE = 8 << 20
#: Ranged GETs at once.
WORKERS = 8
#: A large chunk's tail piece: its zip directory and the last of its data.
_TAIL = 1 << 20

#: ``fetch(key, start, end)`` -> the bytes, or raises as a direct read would.
Fetch = Callable[[Any, int, int], bytes]
#: ``direct(key, view, offset)`` fills ``view`` without the prefetch (a read no piece covers).
Direct = Callable[[Any, memoryview, int], None]


@dataclass(eq=False)
class _Piece:
    key: Any  # which file
    start: int
    end: int
    first: int  # the first and last announced range (in read order) it serves
    last: int
    whole: bool  # holds whole ranges (small ones), not a part of a cut one
    middle: int = 0  # n > 0: the n-th piece between a cut range's head and tail
    future: Future[bytes] | None = None
    dropped: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start


class Prefetcher:
    """Fetches announced byte ranges ahead of their reader (see the module's docstring).

    Args:
        ranges: ``(key, offset, length)`` of each range, in the order they will be read;
            ``key`` names a file for ``fetch``.
        fetch: ``fetch(key, start, end)`` returns those bytes (one request) or raises.
        direct: ``direct(key, view, offset)`` fills ``view`` for reads no piece covers.
        budget, piece, workers: bytes held at most, piece size, requests at once (None:
            :data:`BUDGET`, :data:`PIECE`, :data:`WORKERS`).
    """

    def __init__(self, ranges: Iterable[tuple[Any, int, int]], fetch: Fetch, direct: Direct, *,
                 budget: int | None = None, piece: int | None = None,
                 workers: int | None = None) -> None:
        # The module's limits are read now, not at import: a test may shrink them.
        budget = BUDGET if budget is None else budget
        piece = PIECE if piece is None else piece
        self._fetch, self._direct, self._budget, self._piece = fetch, direct, budget, piece
        self._order = _cut(list(ranges), piece, budget)  # fetch order
        self._by_key: dict[Any, tuple[list[int], list[_Piece]]] = {}
        for p in sorted(self._order, key=lambda p: p.start):
            starts, pieces = self._by_key.setdefault(p.key, ([], []))
            starts.append(p.start)
            pieces.append(p)
        self._lock = threading.Lock()
        self._next = 0  # the next piece of _order to start
        self._held = 0  # bytes of pieces started and not dropped
        self._live: list[_Piece] = []  # started and not dropped, in fetch order
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=WORKERS if workers is None else workers,
            thread_name_prefix="fsdpckpt-prefetch")
        with self._lock:
            self._advance()

    @property
    def held(self) -> int:
        """Bytes fetched or being fetched ahead and not yet dropped (at most the budget)."""
        return self._held

    # -- the reader's side -------------------------------------------------------------------
    def read(self, key: Any, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes of ``key`` at ``offset``: from pieces where they
        cover it, the rest by ``direct``.

        Raises:
            whatever ``fetch`` raised for a piece holding bytes asked, or ``direct`` raises.
        """
        done, count = 0, len(view)
        while done < count:
            at = offset + done
            found, upto = self._covering(key, at, offset + count)
            if found is None:
                self._direct(key, view[done:done + upto - at], at)
            else:
                future, start = found
                data = future.result()
                view[done:done + upto - at] = memoryview(data)[at - start:upto - start]
            done += upto - at

    def covers(self, key: Any, offset: int, count: int) -> bool:
        """Whether the whole range lies in one started piece (reading it costs no request)."""
        found, upto = self._covering(key, offset, offset + count, touch=False)
        return found is not None and upto == offset + count

    def close(self) -> None:
        """Stop fetching and drop every piece (fetches under way finish unseen)."""
        with self._lock:
            self._next = len(self._order)
            for p in self._live:
                self._drop(p)
            self._live = []
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- inside ------------------------------------------------------------------------------
    def _covering(self, key: Any, at: int, end: int, *,
                  touch: bool = True) -> tuple[tuple[Future[bytes], int] | None, int]:
        """The fetch and start of the started piece holding byte ``at``, and where its part
        of ``[at, end)`` ends; or None and where the run no started piece covers ends."""
        starts, pieces = self._by_key.get(key, ([], []))
        i = bisect.bisect_right(starts, at)
        with self._lock:
            best = None
            j = i - 1
            # Pieces are at most ``_piece`` long: one starting earlier cannot hold ``at``.
            while j >= 0 and starts[j] > at - self._piece:
                p = pieces[j]
                if p.end > at and p.future is not None and not p.dropped and \
                        (best is None or p.first < best.first):
                    best = p
                j -= 1
            if best is not None and best.future is not None:
                if touch:
                    self._touch(best)
                return (best.future, best.start), min(best.end, end)
            k = i
            while k < len(starts) and starts[k] < end:
                p = pieces[k]
                if p.future is not None and not p.dropped:
                    return None, starts[k]
                k += 1
            return None, end

    def _touch(self, piece: _Piece) -> None:
        """The reader is at ``piece``: drop the pieces behind it. Caller holds the lock."""
        keep = []
        for p in self._live:
            # Behind: every range it serves comes before this one; or, inside one cut
            # range, the head and the middle pieces before this middle one (the tail,
            # which the zip reader read first, lies after it and stays).
            behind = p.last < piece.first or (
                piece.middle > 0 and p.first == piece.first and p.key == piece.key
                and p.end <= piece.start)
            if behind:
                self._drop(p)
            else:
                keep.append(p)
        self._live = keep
        # Pieces not started that serve only ranges the reader has passed: never fetched.
        while self._next < len(self._order) and self._order[self._next].last < piece.first:
            self._next += 1
        self._advance()

    def _drop(self, piece: _Piece) -> None:
        """Let go of ``piece``'s bytes (a fetch under way ends unseen). Caller holds the lock."""
        piece.dropped, piece.future = True, None
        self._held -= piece.size

    def _advance(self) -> None:
        """Start pieces in fetch order while the budget allows. Caller holds the lock."""
        while self._pool is not None and self._next < len(self._order):
            p = self._order[self._next]
            if self._live and self._held + p.size > self._budget:
                return
            self._next += 1
            self._held += p.size
            self._live.append(p)
            p.future = self._pool.submit(self._fetch, p.key, p.start, p.end)


def _cut(ranges: list[tuple[Any, int, int]], piece: int, budget: int) -> list[_Piece]:
    """The pieces that fetch ``ranges``, in fetch order."""
    out: list[_Piece] = []
    # Small chunks join the open piece of their file when they follow it there: ranks'
    # files alternate in a merge's order, so "the piece just before" would rarely be
    # the same file. Every file may have a piece open at once, so a joined piece is kept
    # small enough that one per file fits the budget a few times over.
    files = len({key for key, _, _ in ranges})
    join = min(piece, max(64 << 10, budget // (4 * max(1, files))))
    open_piece: dict[Any, _Piece] = {}
    for index, (key, offset, length) in enumerate(ranges):
        end = offset + length
        if length <= 0:
            continue
        last = open_piece.get(key)
        if last is not None and last.end == offset and end - last.start <= join:
            last.end, last.last = end, index  # one request for both chunks
            continue
        if length <= piece:
            out.append(_Piece(key, offset, end, index, index, True))
            open_piece[key] = out[-1]
            continue
        open_piece.pop(key, None)
        # Head and tail first: the zip reader reads the directory at the end, then the
        # header at the start, before any data.
        tail = min(_TAIL, piece, length - piece)
        out.append(_Piece(key, offset, offset + piece, index, index, False))
        out.append(_Piece(key, end - tail, end, index, index, False))
        at, middle = offset + piece, 1
        while at < end - tail:
            step = min(piece, end - tail - at)
            out.append(_Piece(key, at, at + step, index, index, False, middle))
            at, middle = at + step, middle + 1
    return out
