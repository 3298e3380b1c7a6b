"""What one rank of a large run spends on metadata when it resumes (issue 32, goal 3).

Run by hand (not in CI):

    python benchmarks/resume.py --ranks 1024 --rank 517 --workdir /tmp/sim

One process plays rank ``--rank`` of ``--ranks`` through torch's fake process group
(``torch.testing._internal.distributed.fake_pg``): its model and AdamW state are DTensors
holding that rank's dim-0 slice of a Llama-3-70B-shaped model (empty: no bytes touched),
and the checkpoint is the simulated one ``benchmarks/scale.py`` builds (Accelerate's
layout, ``.metadata`` from torch's own classes, sparse data files). Each side runs as a
whole process, up to the first data read, model and optimizer folders both:

  - torch (the anchor): ``FileSystemReader.read_metadata`` (plain pickle), then what
    ``dcp.load`` does with it before reading: ``set_up_planner``,
    ``set_up_storage_reader``, ``create_local_plan``;
  - fsdpckpt: what ``load_state`` does before its first data read: the allowlisted parse
    into torch's ``Metadata`` (``safe_storage_reader``), the model and optimizer compared
    with the checkpoint, the local plan made to know which archives to check, then the
    same ``dcp.load`` steps through that reader.
Goal (issue 32): fsdpckpt at most 1.1x the anchor's time on each rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import build_apart

ROOT = Path(__file__).resolve().parent.parent

_RANK = """
import sys, time
sys.path.insert(0, {bench!r})
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from _simulate import LLAMA_70B, shapes
rank, world, ckpt, side = {rank}, {world}, {ckpt!r}, {side!r}
dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
mesh = init_device_mesh("cpu", (world,))
def sliced(shape):
    per = -(-shape[0] // world)
    rows = max(0, min(per, shape[0] - rank * per))
    local = torch.empty((rows,) + tuple(shape[1:]))
    stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=stride)
params = list(shapes(**LLAMA_70B))
model = {{"model": {{name: sliced(shape) for name, shape in params}}}}
state = {{name: {{"step": torch.tensor(3.0), "exp_avg": sliced(shape),
                  "exp_avg_sq": sliced(shape)}} for name, shape in params}}
groups = [{{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
            "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
            "differentiable": False, "fused": None, "initial_lr": 0.001,
            "params": [name for name, _ in params]}}]
optim = {{"optimizer": {{"state": state, "param_groups": groups}}}}
folders = [(ckpt + "/pytorch_model_fsdp_0", model), (ckpt + "/optimizer_0", optim)]
start = time.perf_counter()
if side == "torch":
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    for folder, sd in folders:
        reader = FileSystemReader(folder)
        md = reader.read_metadata()
        planner = DefaultLoadPlanner()
        planner.set_up_planner(sd, md, False)
        reader.set_up_storage_reader(md, False)
        plan = planner.create_local_plan()
else:
    from fsdpckpt.dcp.reader import shared_parses
    from fsdpckpt.training._dcp_io import safe_load_planner, safe_storage_reader
    from fsdpckpt.training._statecheck import compare, flatten
    from pathlib import Path
    folders = [(Path(folder), sd) for folder, sd in folders]
    with shared_parses():
        readers = [safe_storage_reader(folder) for folder, _ in folders]
        compare(folders[0][0], model["model"], "model")
        compare(folders[1][0], flatten(optim["optimizer"]), "optimizer")
        for reader, (folder, sd) in zip(readers, folders):
            for _ in range(2):  # the archives to check, then dcp.load's own plan
                md = reader.read_metadata()
                planner = safe_load_planner()
                planner.set_up_planner(sd, md, False)
                reader.set_up_storage_reader(md, False)
                plan = planner.create_local_plan()
print(time.perf_counter() - start, len(plan.items))
"""


def run(code: str) -> tuple[float, float, float]:
    """Wall seconds of the whole process, of its metadata steps alone, and its peak RSS (MB)."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out,
                                stderr=subprocess.PIPE, cwd=ROOT)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(proc.stderr.read().decode()[-3000:] if proc.stderr else "")
        out.seek(0)
        steps = float(out.read().split()[0])
    return wall, steps, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=517)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workdir", type=Path, required=True,
                        help="where the simulated checkpoint is (built there once)")
    args = parser.parse_args()
    ckpt = args.workdir / f"llama70b-{args.ranks}"
    build_apart(ckpt, args.ranks)
    results: dict[str, list[tuple[float, float, float]]] = {"torch": [], "fsdpckpt": []}
    for _ in range(args.rounds):
        for side in results:
            code = _RANK.format(bench=str(Path(__file__).resolve().parent), rank=args.rank,
                                world=args.ranks, ckpt=str(ckpt), side=side)
            results[side].append(run(code))
    medians = {side: tuple(sorted(r[i] for r in runs)[len(runs) // 2] for i in range(3))
               for side, runs in results.items()}
    anchor = medians["torch"]
    print(f"\nrank {args.rank} of {args.ranks} resuming, up to its first data read "
          f"(medians of {args.rounds})")
    print(f"| {'side':9} | {'metadata steps':>14} | {'x torch':>7} | {'whole process':>13} | "
          f"{'peak RSS':>9} | {'x torch':>7} |")
    print(f"|{'-' * 11}|{'-' * 16}|{'-' * 9}|{'-' * 15}|{'-' * 11}|{'-' * 9}|")
    for side, (wall, steps, peak) in medians.items():
        print(f"| {side:9} | {steps:13.2f}s | {steps / anchor[1]:6.2f}x | {wall:12.2f}s | "
              f"{peak:6.0f} MB | {peak / anchor[2]:6.2f}x |")


if __name__ == "__main__":
    main()
