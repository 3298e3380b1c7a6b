"""The distributed helpers of the training side: the process group (or none), rank and world
size, the rule "if one rank fails, every rank raises", and how DCP is called with or without
a process group.

Everything here works without ``torch.distributed`` initialized: a single process is
rank 0 of a world of 1, and DCP is called with ``no_dist=True``.
"""

from __future__ import annotations

import warnings
from typing import Any

from fsdpckpt import _torch
from fsdpckpt.errors import FsdpCkptError

__all__ = ["dist_or_none", "rank_world", "async_group", "everywhere", "dcp_call"]


def dist_or_none() -> Any:
    """``torch.distributed`` when a process group is initialized, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without a process group."""
    dist = dist_or_none()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


_ASYNC_GROUPS: dict[str, Any] = {}


def async_group(part: str) -> Any:
    """The gloo process group the background saves of ``part`` (a folder name) run on."""
    # One group per folder: the background saves of model and optimizer run at the same
    # time, and their collectives must not interleave on a shared group. Groups are made
    # on the first async save, which every rank makes in the same order (new_group is
    # collective), and kept for the next ones.
    if part not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[part] = dist_or_none().new_group(backend="gloo")
    return _ASYNC_GROUPS[part]


def everywhere(fn: Any) -> Any:
    """Run ``fn`` on this rank and agree: if it failed on any rank, raise on every rank.

    Replaces a bare barrier after rank-local work (rank 0 writing a file, each rank
    reading its own): without it, the other ranks would wait at the barrier until the
    process group times out.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        error = exc
    dist = dist_or_none()
    if dist is not None:
        rank, world = rank_world()
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, None if error is None else f"rank {rank}: {error}")
        failed = [r for r in reports if r]
        if error is None and failed:
            raise FsdpCkptError(f"another rank failed, so this one stops too: {failed[0]}")
    if error is not None:
        raise error
    return result


# torch 2.13 warns on every single-process DCP call, even with no_dist=True, which is how
# we say that we mean it. Exactly that notice is silenced, and only around our own calls.
_SINGLE_PROCESS_NOTICE = (r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
                          r"assuming the intent is to (save|load) in a single process")


def dcp_call(fn: Any, state: dict[str, Any], **kwargs: Any) -> Any:
    """Call ``dcp.save``, ``dcp.load`` or ``dcp.async_save``; without a process group, in
    a single process (``no_dist=True``) and without torch's notice that it assumes so.

    An async save warns again from torch's writer thread, outside this call: that one
    is left alone, since filtering it would mean changing the filters for every thread.
    """
    if dist_or_none() is not None:
        return fn(state, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE, category=UserWarning)
        if not _torch.takes_no_dist(fn):  # torch 2.6: no process group means one process
            return fn(state, **kwargs)
        return fn(state, no_dist=True, **kwargs)
