"""A merge spread over ranks into a folder on object storage.

The ranks need no shared file system: each writes its share of the output files (the same
:func:`~fsdpckpt.merging._distributed.assign_files` split as on a shared disk) into its own
local temporary folder and uploads them under their final names (where they replace an
earlier output's shards by name, its index deleted first); once every rank's uploads are
in, rank 0 writes and uploads each index, last, then removes the earlier outputs the new
ones replace (the protocol of :mod:`fsdpckpt.merging._remote_out`; the uploads are
:mod:`fsdpckpt._io.publish_remote`'s).

Every step ends with the ranks agreeing: a failure on any rank makes every rank delete
the objects it uploaded, so nothing of the merge is left and an earlier output stays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpckpt._io.publish_remote import (
    check_remote_output,
    delete,
    local_stage,
    uncommit_replaced,
    upload,
)
from fsdpckpt._progress import ProgressFactory
from fsdpckpt.errors import FsdpCkptError
from fsdpckpt.merging._distributed import _outline, _Ranks, _write_share, assign_files
from fsdpckpt.merging._jobs import MergeJob, MergeResult, merge_result
from fsdpckpt.merging._outputs import claim_outputs
from fsdpckpt.merging.writer import output_paths, sigterm_interrupts, write_index

if TYPE_CHECKING:
    from fsdpckpt._io.remote import RemotePath

__all__ = ["run_spread_remote"]


def run_spread_remote(out: RemotePath, plan: Callable[[Path], MergeJob], group: Any,
                      overwrite: bool, progress: ProgressFactory | None = None
                      ) -> list[MergeResult]:
    """Plan, write, upload and commit a merge into ``out``, spread over ``group``'s ranks.

    Every rank calls this with the same arguments; every rank returns rank 0's results.

    Raises:
        OutputExistsError: ``out`` holds an earlier output and ``overwrite`` is False.
        OutputNotWritableError: an upload failed (on any rank).
        FsdpCkptError: another rank failed (the message names it).
    """
    ranks = _Ranks(group)
    ranks.agree(lambda: check_remote_output(out))
    uploaded: list[RemotePath] = []
    with sigterm_interrupts(), local_stage(out) as local, contextlib.ExitStack() as stack:
        stack.callback(lambda: delete(list(reversed(uploaded))))  # disarmed once committed
        job = ranks.agree(lambda: plan(local))
        outlines = ranks.agree_all(lambda: _outline(job))
        if any(o != outlines[0] for o in outlines):
            raise FsdpCkptError("the ranks planned different output files; every rank must "
                                "call merge with the same checkpoint and options")
        stale = ranks.agree(lambda: claim_outputs(job.plans, out, overwrite=overwrite))
        mine = assign_files(job.plans, ranks.world)[ranks.rank]

        written: list[Path] = []

        def share() -> list[float]:
            local.mkdir(parents=True, exist_ok=True)
            return _write_share(job, mine, local, written, progress)

        seconds = [max(t) for t in zip(*ranks.agree_all(share))]

        def uncommit() -> None:
            # Once every share is written, before the first upload: an earlier index whose
            # shards the new ones replace by name goes, so it never names old and new
            # shards mixed (publish_remote's rule); without a shared name it stays until
            # the new index is in.
            if ranks.rank == 0:
                uncommit_replaced(out, [f.name for p in job.plans for f in p.files],
                                  [p.index_name for p in job.plans if p.index_name])

        ranks.agree(uncommit)

        def upload_share() -> None:
            for path in written:
                upload(path, out, uploaded)
                path.unlink()  # local disk holds this rank's share, and only until uploaded

        ranks.agree(upload_share)

        def commit() -> None:
            if ranks.rank != 0:
                return
            for plan_ in job.plans:
                index = write_index(plan_, local)
                if index is not None:
                    upload(index, out, uploaded)
            new = {str(u) for u in uploaded}
            delete(sorted((s for s in stale if str(s) not in new),
                           key=lambda s: not s.name.endswith(".index.json")))

        ranks.agree(commit)
        # Built on every rank from the plan (remote paths hold a client: not sent between ranks).
        results = [merge_result(plan_, output_paths(plan_, out), took)
                   for plan_, took in zip(job.plans, seconds)]
        uploaded.clear()  # committed: nothing of ours is left to remove
        out.forget_listings()
        return results

