"""Save and load time: fsdpckpt against raw DCP and Accelerate, on one 2-rank FSDP2 model.

Run by hand (not in CI):  python benchmarks/save_load.py [--layers 16] [--rounds 3] [--dir D]

``--dir /dev/shm`` writes to memory: without the virtual disk's noise, what is left is
each tool's own CPU cost, which is what a 5% target can be judged on.

A 2-rank FSDP2 run (gloo, CPU) holds N layers of 2048x2048 fp32 (16 MiB each;
16 layers = 256 MiB of parameters, plus AdamW state after one step). In the same
processes, alternating tools each round, it times (barrier to barrier):
  - raw DCP: dcp.save / dcp.load of {"model": get_model_state_dict(...)} and
    {"optimizer": get_optimizer_state_dict(...)}, set_*_state_dict after loading
  - fsdpckpt.save_state / fsdpckpt.load_state (same parts, plus RNG files and the
    manifest of CRC-32s), save_state(manifest=False), and save_state(digest="sha256")
    and (digest="blake2b"), which hash every byte written
  - Accelerate's save_state / load_state (FSDP2, SHARDED_STATE_DICT)
  - the blocking time of fsdpckpt.save_state(async_save=True) against a
    synchronous save, and the time until its wait() returns.
Ratios are against raw DCP in the same run. Targets: the default save within 5% of raw DCP
(issues 4 and 9); the digests' cost measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta

DIM = 2048


def _ranks(rank: int, world: int, layers: int, rounds: int, work: str, rendezvous: str,
           port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import fsdpckpt

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=10))
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"), cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)  # FSDP2 under the hood
    model(torch.randn(2, DIM)).sum().backward()
    optimizer.step()

    def raw_save(path):
        dcp.save({"model": get_model_state_dict(model)},
                 checkpoint_id=f"{path}/pytorch_model_fsdp_0")
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=f"{path}/optimizer_0")

    def raw_load(path):
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=f"{path}/pytorch_model_fsdp_0")
        set_model_state_dict(model, state["model"])
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=f"{path}/optimizer_0")
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    tools = {
        "raw dcp": (raw_save, raw_load),
        "fsdpckpt": (lambda p: fsdpckpt.save_state(p, model, optimizer),
                     lambda p: fsdpckpt.load_state(p, model, optimizer)),
        "fsdpckpt manifest=False": (
            lambda p: fsdpckpt.save_state(p, model, optimizer, manifest=False),
            lambda p: fsdpckpt.load_state(p, model, optimizer)),
        "fsdpckpt digest=sha256": (
            lambda p: fsdpckpt.save_state(p, model, optimizer, digest="sha256"), None),
        "fsdpckpt digest=blake2b": (
            lambda p: fsdpckpt.save_state(p, model, optimizer, digest="blake2b"), None),
        "accelerate": (accelerator.save_state, accelerator.load_state),
    }
    times: dict[str, list[float]] = {}

    def timed(label, fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.setdefault(label, []).append(time.perf_counter() - start)

    for r in range(rounds):
        for name, (save, load) in tools.items():
            path = f"{work}/{name.replace(' ', '_').replace('=', '_')}_{r}"
            timed(f"{name} save", lambda save=save, path=path: save(path))
            if load is not None:
                timed(f"{name} load", lambda load=load, path=path: load(path))
        path = f"{work}/async_{r}"
        dist.barrier()
        start = time.perf_counter()
        handle = fsdpckpt.save_state(path, model, optimizer, async_save=True)
        times.setdefault("fsdpckpt async save: blocking", []).append(time.perf_counter() - start)
        handle.wait()
        times.setdefault("fsdpckpt async save: until wait() returns", []).append(
            time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            for entry in os.listdir(work):
                shutil.rmtree(f"{work}/{entry}", ignore_errors=True)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters()) * 4 / 2**20  # DTensor: global
        print(f"2-rank FSDP2, {layers} x {DIM}x{DIM} fp32 = {params:.0f} MiB of parameters "
              f"(+ AdamW state), median of {rounds} rounds, barrier to barrier")
        raw = {k: statistics.median(times[f"raw dcp {k}"]) for k in ("save", "load")}
        print(f"{'what':44} {'seconds':>8} {'vs raw dcp':>11}")
        for label, values in times.items():
            kind = "save" if "save" in label else "load"
            print(f"{label:44} {statistics.median(values):8.3f} "
                  f"{statistics.median(values) / raw[kind]:10.2f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="fsdpckpt save/load benchmark")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None,
                        help="where to write (default: the system's temporary folder)")
    args = parser.parse_args()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        os.makedirs(f"{tmp}/work")
        mp.start_processes(_ranks, args=(2, args.layers, args.rounds, f"{tmp}/work",
                                         f"{tmp}/rdzv", port), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
