"""Running a function on 2 real ranks (gloo, CPU) from a test.

A forkserver with torch preloaded starts each rank in about 2 s (spawn takes
~10 s; plain fork can deadlock once the parent has run OpenMP code). Ranks
meet through a rendezvous file in a fresh temporary folder, so tests never
fight over ports, and every collective has a timeout, so a rank that skips
one fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CONTEXT = None
#: Each rank's process group, kept from being freed until the process ends (_worker says why).
_KEPT: list = []


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # Every rank imports these; preloaded, the fork has them (a name that fails to
        # import is skipped by the forkserver, and the rank imports it as before).
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp",
                                         "torch.distributed.checkpoint", "numpy", "pytest",
                                         "fsdpckpt.training.manager", "fsdpckpt.training.state",
                                         "fsdpckpt.inspection.verify", "fsspec", "s3fs"])
    return _CONTEXT


def _worker(fn, rank, world_size, rendezvous, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        try:
            # Plain pickle bytes: tensors sent as they are would travel as shared-memory
            # handles that die with this process before the parent reads them.
            queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            # Kept, never freed: on torch 2.6 freeing a gloo group right after a collective
            # can deadlock (~ProcessGroupGloo joins a worker thread that waits for the GIL),
            # and with it the queue's feeder thread: the result never reached the parent.
            _KEPT.append(dist.group.WORLD)
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2,
              timeout: float = 180) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be a module-level function of an importable module, and its
    arguments and result picklable. Raises RuntimeError with the failing rank's
    traceback if any rank fails or the ranks do not finish within ``timeout``.
    """
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, rendezvous, args, queue))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        results: dict[int, Any] = {}
        errors = []
        try:
            for _ in procs:
                rank, ok, value = queue.get(timeout=timeout)
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    errors.append(f"rank {rank}:\n{value}")
        except Exception as exc:  # noqa: BLE001 - queue.Empty: a rank hung or died
            errors.append(f"ranks did not finish in {timeout} s ({exc!r})")
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if errors:
        if any(_NO_CPU_FSDP2 in e for e in errors):
            import pytest
            import torch

            pytest.skip(f"FSDP2 (fully_shard) cannot run on CPU with torch {torch.__version__} "
                        "(its CPU stream lacks record_event): docs/torch-versions.md")
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


#: What torch 2.6's fully_shard raises on CPU: the test's FSDP2 ranks cannot run there.
_NO_CPU_FSDP2 = "'Stream' object has no attribute 'record_event'"


def start_ranks(fn: Callable[..., Any], *args: Any, rendezvous_dir: str,
                world_size: int = 2) -> list[Any]:
    """Start ``fn(rank, world_size, *args)`` on ranks and return the processes, unwaited.

    For tests that kill ranks: the caller owns the processes (and ``rendezvous_dir``).
    """
    ctx = _context()
    queue = ctx.Queue()
    rendezvous = os.path.join(rendezvous_dir, "rendezvous")
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, rendezvous, args, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.keep_alive = queue  # the queue must outlive the start of every rank
        proc.start()
    return procs
