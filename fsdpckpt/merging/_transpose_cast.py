"""A column-major chunk held whole and cast (``--dtype``): cast in storage order, a group of
stored columns at a time, each group transposed while the next is read and cast.

Held whole (:func:`fsdpckpt.merging._transpose.place_column_major_whole`), a chunk is read
entire before its first band of output rows can be made (a band takes a piece of every
stored column), and then each band is transposed and cast on the transpose thread while this
one only writes: 1.6 GB of 32 MiB fp32 chunks took 1.56x the plain merge to bf16, 1.95x to
fp16. Here the cast comes first, on the stored columns as they are read (a cast goes element
by element, so its order changes no bit), and the groups are transposed into the made chunk
(whose output rows are the stored columns) while the next group is read:

- the transposes move the output's bytes (half the stored ones, to bf16 or fp16);
- the reads overlap the transposes, no longer waiting for them chunk by chunk;
- the cast, the costly step (fp16: 1.1 s of one core for 1.6 GB), is done by whichever
  thread is free: here, or on the transpose thread with the group's transpose where that
  thread has fewer than :data:`_QUEUE` groups waiting. The memory-bound transposes do not
  speed up on two cores (each runs at half speed beside the other), the cast does.

Measured in alternated whole merges (``benchmarks/merge_paths.py``, docs/benchmarks.md): bf16
1.61x the plain merge to 1.23x, fp16 2.01x to 1.42x, peak 91 MB to 76 MB.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fsdpckpt._io import background
from fsdpckpt._io.rawio import ReadAt, scratch
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp._checked import read_checked
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.merging import _casts
from fsdpckpt.merging._blocks import _UNSIGNED, column_pitch, transpose_tile
from fsdpckpt.merging._runs import Runs, row_starts
from fsdpckpt.merging._transpose import _row_pieces

__all__ = ["in_groups", "place_cast_in_groups"]

#: The most bytes of one group, stored or cast (the wider). Measured on 1.6 GB of 32 MiB
#: fp32 chunks: 1 MiB groups 1.95 s to bf16, 2 MiB 1.71 s, 4 MiB 1.54 s, 8 MiB 1.62 s.
_GROUP = 4 * 2**20
#: Groups in flight: read, cast, transposed (3 measured 1.52 s to bf16 against 1.54 s with 4).
_RING = 3
#: A group's cast is done here once this many groups wait for the transpose thread, on that
#: thread before: fp16 1.76 s with 2, 1.83 s with 3, 2.01 s with 1 (casting here whenever the
#: thread had any work left, it sat idle while this one cast).
_QUEUE = 2


def in_groups(raw: RawTensor, out: DType) -> bool:
    """Whether the column-major chunk ``raw``, held whole and cast to ``out``, is placed here:
    numpy does the transposes and one stored column fits a group (a few very tall columns
    gain nothing from groups and are held whole as they are)."""
    rows = raw.shape[0]
    return raw.dtype.name != out.name and _casts._numpy() is not None and \
        raw.dtype.itemsize in _UNSIGNED and out.itemsize in _UNSIGNED and \
        rows * max(raw.dtype.itemsize, out.itemsize) <= _GROUP


def place_cast_in_groups(src: int | ReadAt, raw: RawTensor, runs: Runs, out: DType,
                         write_pieces: Callable[[memoryview, Any, Any, Any], None],
                         tensor_start: int, *, source: str,
                         progress: Callable[[int], None] | None) -> None:
    """Place a column-major chunk held whole and cast (see :func:`in_groups`): its stored
    columns read in order a group at a time (through a
    :class:`~fsdpckpt.dcp._checked.CheckedRead`, the CRC-32 computed on the way), each group
    cast into its own buffer, its columns padded apart (:func:`column_pitch`), and transposed
    into the made chunk on the transpose thread while the next group is read; then the chunk
    is written.

    Args:
        As :func:`fsdpckpt.merging._transpose.place_column_major_whole`.
    """
    np = _casts._numpy()
    rows, cols = raw.shape
    in_size, out_size = raw.dtype.itemsize, out.itemsize
    pitch = column_pitch(rows, out_size)
    group = max(1, min(cols, _GROUP // (rows * max(in_size, out_size))))  # stored columns
    firsts = range(0, cols, group)
    ring = min(_RING, len(firsts))
    stored = [scratch(group * rows * in_size, f"group-{k}") for k in range(ring)]
    cast = [scratch(group * pitch * out_size, f"cast-group-{k}") for k in range(ring)]
    made = scratch(rows * cols * out_size, "made")
    element = np.dtype(_UNSIGNED[out_size])
    at = raw.storage_start + raw.storage_offset * in_size

    def cast_group(turn: int, with_torch: bool) -> bool:  # its buffers are the turn's own
        first, slot = firsts[turn], turn % ring
        width = min(group, cols - first)
        contiguous = scratch(width * rows * out_size, "cast")  # the calling thread's own
        if not _casts.cast_block(raw.dtype.name, out.name, stored[slot][:width * rows * in_size],
                                 contiguous, with_torch=with_torch):
            return False
        np.frombuffer(cast[slot], dtype=element, count=width * pitch).reshape(
            width, pitch)[:, :rows] = np.frombuffer(contiguous, dtype=element,
                                                    count=width * rows).reshape(width, rows)
        return True

    def make(turn: int, cast_too: bool, here: bool = False) -> bool:
        """Cast (if asked) and transpose the turn's group; False, with nothing made, where
        the cast needs torch and this is the transpose thread: torch is imported on this
        one only, whose kept buffers its first import gives back (_casts.import_torch)."""
        if cast_too and not cast_group(turn, with_torch=here):
            return False
        first = firsts[turn]
        transpose_tile(cast[turn % ring], pitch, min(group, cols - first), rows, out,
                       made[first * out_size:], row_pitch=cols)
        return True

    def settle(turn: int) -> None:  # here: the turn's group is made once this returns
        if settled[turn]:
            return
        job, cast_too = jobs[turn]
        if job.cancel() or not job.result():  # not started there, or its cast left for torch
            make(turn, cast_too, here=True)
        settled[turn] = True

    jobs: list[tuple[Future[bool], bool]] = []  # each group's, and whether it casts too
    settled: list[bool] = []
    submitted = 0
    try:
        for turn, first in enumerate(firsts):
            if turn >= ring:  # the group that last held these buffers is made
                settle(turn - ring)
            view = stored[turn % ring][:min(group, cols - first) * rows * in_size]
            read_checked(src, view, at + first * rows * in_size, source=source)
            waiting = sum(not job.done() for job, _ in jobs[-_QUEUE:]) if _QUEUE else 0
            beside = waiting < _QUEUE
            if not beside:
                cast_group(turn, with_torch=True)
            submitted = turn + 1  # before: a job whose future Ctrl-C keeps from the list
            jobs.append((background.submit("transpose", make, turn, beside), beside))
            settled.append(False)
        # The groups the transpose thread has not started are made here, from the last.
        for turn in reversed(range(len(jobs))):
            if not settled[turn] and not jobs[turn][0].cancel():
                break
            settle(turn)
        for turn in range(len(jobs)):
            settle(turn)
    finally:
        # No cast or transpose may still fill a buffer that is handed out again. (Not a
        # drain where every group is made: work of others may be queued on that thread.)
        if submitted > len(jobs) or not all(job.done() for job, _ in jobs):
            background.drain("transpose")
    write_pieces(made, *_row_pieces(row_starts(runs, cols, 0, rows), cols, 0, out_size,
                                    tensor_start))
    if progress:
        progress(len(made))
