"""A merge spread over the ranks of a process group: each rank writes its share of the files.

Every rank validates and plans the merge itself: the plan comes from metadata alone, so
all ranks hold the same :class:`~fsdpckpt.merging._jobs.MergeJob`. From it,
:func:`assign_files` splits the output files among the ranks, balanced by bytes. Then:

1. rank 0 creates the staging folder inside the output folder and sends its name to the
   others (the output folder must be on a file system every rank sees);
2. each rank writes its files into that folder (:func:`~fsdpckpt.merging.writer.write_plan`
   with ``only=``), exactly as the single-process merge would write them;
3. rank 0 writes the index files and commits (the renames); the others wait for it.

Every step ends with the ranks agreeing (:meth:`_Ranks.agree`): a failure on any rank,
an interrupt included, fails the merge on every rank, and rank 0 removes the staging
folder (and the output folder, if the merge created it), so nothing is left.

``torch.distributed`` is imported only here, and only when a merge is spread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from fsdpckpt._progress import ProgressFactory
from fsdpckpt.errors import REPORTED_BY_RANK, FsdpCkptError
from fsdpckpt.merging._jobs import MergeJob, MergeResult, StagedPlan, commit_job
from fsdpckpt.merging.plan import MergePlan
from fsdpckpt.merging.writer import sigterm_interrupts, staging, write_index, write_plan

__all__ = ["FileRef", "balance", "assign_files", "run_spread", "agree_on", "torchrun_group",
           "TORCHRUN_TIMEOUT"]

_T = TypeVar("_T")

#: How long a rank of ``torchrun ... fsdpckpt merge`` waits for the others at each step:
#: ranks that finish their share wait for the slowest one.
TORCHRUN_TIMEOUT = timedelta(hours=2)

#: Set once :func:`torchrun_group` has initialized a process group in this process: the
#: command line then ends it without C++ teardown (``fsdpckpt/__main__.py`` says why).
made_a_process_group = False

#: The groups :func:`torchrun_group` made and destroyed, kept from being freed (it says why).
_ENDED_GROUPS: list[Any] = []


@dataclass(frozen=True, order=True)
class FileRef:
    """One output file of a job: ``job.plans[plan].files[file]``."""

    plan: int
    file: int


def balance(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that writes each item, balancing the bytes per rank; deterministic.

    Greedy, largest first: items in decreasing size (ties in their order) each go to the
    rank with the fewest bytes so far (ties to the one with fewer items, then the lowest
    rank). Every rank computes the same answer from the same sizes.

    Args:
        sizes: the bytes of each item.
        world_size: the number of ranks (at least 1).

    Returns:
        ``ranks[i]``: the rank of item ``i``.

    Raises:
        ValueError: ``world_size`` is not positive.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    loads = [0] * world_size
    counts = [0] * world_size
    ranks = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], counts[r], r))
        ranks[i] = rank
        loads[rank] += sizes[i]
        counts[rank] += 1
    return ranks


def assign_files(plans: Sequence[MergePlan], world_size: int) -> list[list[FileRef]]:
    """Each rank's share of the output files of ``plans`` (by :func:`balance` of their
    tensor bytes), in plan and file order; ``shares[rank]`` may be empty."""
    refs = [FileRef(p, f) for p, plan in enumerate(plans) for f in range(len(plan.files))]
    sizes = [plans[r.plan].files[r.file].nbytes for r in refs]
    shares: list[list[FileRef]] = [[] for _ in range(world_size)]
    for ref, rank in zip(refs, balance(sizes, world_size)):
        shares[rank].append(ref)
    return shares


class _Ranks:
    """The process group, and the one rule: what fails on one rank fails on all."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise FsdpCkptError("process_group was given, but torch.distributed is not "
                                "initialized; call torch.distributed.init_process_group first "
                                "(or run under torchrun)")
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def agree(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` here and return its result, or raise on every rank if it failed on
        any. The failing rank raises its own error; the others say which rank failed."""
        return self._agree(fn, share=False)[0]

    def agree_all(self, fn: Callable[[], _T]) -> list[_T]:
        """:meth:`agree`, returning every rank's result (small, picklable values only)."""
        return self._agree(fn, share=True)[1]

    def _agree(self, fn: Callable[[], _T], *, share: bool) -> tuple[_T, list[Any]]:
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C too: the others must know
            error = exc
        message = None if error is None else (str(error) or type(error).__name__)
        reports: list[Any] = [None] * self.world
        self.dist.all_gather_object(reports, (message, result if share else None),
                                    group=self.group)
        if error is not None:
            same = [rank for rank, (text, _) in enumerate(reports)
                    if rank < self.rank and text == message]
            if same:  # every rank hit it (an existing output...): printed once, by the lowest
                setattr(error, REPORTED_BY_RANK, same[0])
            raise error
        failed = [(rank, text) for rank, (text, _) in enumerate(reports) if text]
        if failed:
            rank, text = failed[0]
            raise FsdpCkptError(f"rank {rank} failed, so rank {self.rank} stops too: {text}")
        return result, [value for _, value in reports]


def agree_on(group: Any, fn: Callable[[], _T]) -> _T:
    """``fn()`` on every rank of ``group``, its result here; if it raised on any rank,
    raise on every rank (the validate and plan stages of a spread merge)."""
    return _Ranks(group).agree(fn)


def run_spread(job: MergeJob, group: Any, progress: ProgressFactory | None = None
               ) -> list[MergeResult]:
    """The write and commit stages of ``job``, spread over the ranks of ``group``.

    Every rank of ``group`` must call this with the same job (the same checkpoint,
    output folder and options). Returns the same results on every rank.

    Raises:
        FsdpCkptError: another rank failed (the message names it and its error).
        Whatever writing raised on this rank (DiskFullError, OutputNotWritableError...).
    """
    ranks = _Ranks(group)
    plans = ranks.agree_all(lambda: _outline(job))
    different = [rank for rank, outline in enumerate(plans) if outline != plans[0]]
    if different:
        raise FsdpCkptError(f"rank {different[0]} planned other output files than rank 0; "
                            "every rank must call merge with the same checkpoint and options")
    mine = assign_files(job.plans, ranks.world)[ranks.rank]
    with sigterm_interrupts(), contextlib.ExitStack() as stack:
        def open_stage() -> str | None:
            if ranks.rank != 0:
                return None
            # Absolute: the other ranks may run in another working folder.
            return str(stack.enter_context(staging(job.output_dir)).absolute())

        stage = Path(str(ranks.agree_all(open_stage)[0]))
        written: list[Path] = []
        if ranks.rank != 0:  # rank 0's staging() removes the whole folder on failure
            stack.callback(_remove_on_error, written)

        def write() -> list[float]:
            if not stage.is_dir():
                raise FsdpCkptError(f"{job.output_dir}: rank 0's staging folder {stage} is not "
                                    f"there on rank {ranks.rank}; the output folder must be on "
                                    "a file system that every rank shares")
            return _write_share(job, mine, stage, written, progress)

        seconds = [max(t) for t in zip(*ranks.agree_all(write))]

        def commit() -> list[MergeResult] | None:
            if ranks.rank != 0:
                return None
            return commit_job(job, _staged(job, stage, seconds))

        results = ranks.agree_all(commit)[0]
        written.clear()  # committed: nothing of ours is left to remove
        return results or []  # rank 0's: agree_all raised if it had none


def _outline(job: MergeJob) -> str:
    # What must be equal on every rank for the shares to fit together: every file's name
    # and tensors (name, nesting, dtype, shape), the objects, the index; as a digest.
    outline = [(plan.format.name, plan.index_name, [o.name for o in plan.objects],
                [(f.name, [(t.spec.name, t.spec.key_path, t.spec.dtype.name, t.spec.shape)
                           for t in f.tensors]) for f in plan.files]) for plan in job.plans]
    return hashlib.sha256(repr(outline).encode()).hexdigest()


def _write_share(job: MergeJob, mine: Sequence[FileRef], stage: Path, written: list[Path],
                 progress: ProgressFactory | None) -> list[float]:
    # This rank's files of each plan; the seconds it spent on each plan.
    seconds = []
    for p, plan in enumerate(job.plans):
        names = {plan.files[r.file].name for r in mine if r.plan == p}
        start = time.perf_counter()
        if names:
            nbytes = sum(f.nbytes for f in plan.files if f.name in names)
            callback = progress(nbytes, len(names)) if progress else None
            # Recorded before writing, so a file half-written when an error strikes goes too.
            written.extend(stage / n for n in names)
            write_plan(plan, stage, progress=callback, only=names, index=False)
        seconds.append(time.perf_counter() - start)
    return seconds


def _staged(job: MergeJob, stage: Path, seconds: Sequence[float]) -> list[StagedPlan]:
    # Rank 0, once every rank has written its share: each plan's files, the index last.
    staged = []
    for plan, took in zip(job.plans, seconds):
        files = [stage / f.name for f in plan.files]
        index = write_index(plan, stage)
        staged.append(StagedPlan(plan, tuple(files + ([index] if index else [])), took))
    return staged


def _remove_on_error(written: list[Path]) -> None:
    for path in written:
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def torchrun_group() -> Iterator[Any]:
    """The process group of a command started by torchrun, or None in a single process.

    Under torchrun (``WORLD_SIZE`` > 1 in the environment, with ``RANK``, ``MASTER_ADDR``
    and ``MASTER_PORT``), a gloo group is initialized from the environment for the block
    and destroyed after it; a group already initialized is used as it is.

    Raises:
        FsdpCkptError: the environment says torchrun but the group cannot be formed.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    if world <= 1:
        yield None
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise FsdpCkptError(f"WORLD_SIZE is {world} but {', '.join(missing)} is not set; "
                            "start the command with torchrun, or unset WORLD_SIZE")
    global made_a_process_group
    dist.init_process_group("gloo", timeout=TORCHRUN_TIMEOUT)
    made_a_process_group = True
    group = dist.group.WORLD
    try:
        yield group
    finally:
        # Kept, never freed: freeing a gloo group right after a collective can deadlock on
        # torch 2.6 (~ProcessGroupGloo joins its worker threads holding the GIL while a
        # worker waits for the GIL to free the finished collective's tensors; about one
        # torchrun merge in four hung at exit). The command line ends with os._exit anyway.
        _ENDED_GROUPS.append(group)
        dist.destroy_process_group()
