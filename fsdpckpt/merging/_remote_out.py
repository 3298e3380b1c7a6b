"""Merged outputs on object storage: merged locally, then uploaded, the index last.

The mechanics are the publish helper's (:mod:`fsdpckpt._io.publish`,
:mod:`fsdpckpt._io.publish_remote`); what is the merge's own is the order and the
protocol for a remote output folder:

1. Validate and plan as for a local merge, and check the remote folder for existing
   outputs (refused without ``overwrite``) before any byte is read or written.
2. Merge into a local temporary folder (``$TMPDIR``: it needs room for the output).
3. Upload the files one by one (each in parts), in the merge's order: shards first,
   the index last. A sharded output without its index is not a model to any loader,
   and a single-file output is whole the moment its one object appears. An earlier
   index of the same name is deleted before the first shard, so it never names old and
   new shards mixed.
4. Only then remove earlier outputs of ours that the new ones replace.

A failure (or Ctrl-C, SIGTERM) during the upload deletes the objects this merge already
uploaded, so nothing of it is left; an earlier output whose files it did not replace is
left as it was.
:func:`publish_results` is that last step for either kind of output folder: locally the
files are already in place (renamed by the commit stage), remotely they are uploaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from fsdpckpt._io.publish import FilesTarget
from fsdpckpt._io.publish_remote import (
    check_remote_output,
    delete,
    local_stage,
    publish_folder,
    upload,
)
from fsdpckpt.merging._jobs import MergeResult

__all__ = ["check_remote_output", "delete", "local_stage", "publish_folder", "upload",
           "publish_results", "COMMIT"]

#: What a merge uploads last, for the message when a failed upload leaves objects behind.
COMMIT = "the index"


def publish_results(target: FilesTarget, results: Sequence[MergeResult],
                    stale: Iterable[Any]) -> list[MergeResult]:
    """Every result's files published into ``target.out`` (the index of each last), then
    ``stale`` removed (earlier outputs the new ones replace). Returns the results, naming
    the published files.

    Raises:
        OutputNotWritableError: an upload failed (what the block of
            :func:`~fsdpckpt._io.publish.files_into` uploaded is deleted).
    """
    # The commit stage named local files: those in place in the local folder.
    done = [replace(result, files=tuple(target.publish([cast(Path, f) for f in result.files])))
            for result in results]
    target.drop(stale)
    return done
