"""A merge spread over ranks against the single-process merge, on one checkpoint.

Run by hand (not in CI):

    python benchmarks/merge_distributed.py                  # builds a 0.8 GB checkpoint
    python benchmarks/merge_distributed.py --layers 24      # 1.6 GB
    python benchmarks/merge_distributed.py --path DCP_DIR   # or an existing DCP folder

The model folder is written by a real 2-rank FSDP2 run (gloo, CPU; ``benchmarks/merge.py``'s
builder): N layers of 4096x4096 fp32. Then, alternating in each round, whole commands:
  - ``fsdpckpt merge DIR OUT --max-shard-size S``                       (1 process)
  - ``torchrun --standalone --nproc-per-node R -m fsdpckpt merge ...``  (R ranks)
Page cache warm (one untimed read first), ``sync`` (untimed) before each command. For
each it reports the median wall time of the whole command (Python and torch start-up,
the gloo rendezvous included) and of the merge stage alone (the ``seconds`` of ``--json``:
for a spread merge, the slowest rank's), the throughput per process, and the 1-rank over
R-rank ratio, measured in the same run. On a machine with fewer free cores than ranks the
ranks share them, and the ratio says more about the machine than about the merge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge import build  # the builder of benchmarks/merge.py, beside this file


def _command(src: Path, out: Path, ranks: int, shard: str) -> list[str]:
    merge = ["merge", str(src), str(out), "--max-shard-size", shard, "--json", "--quiet"]
    if ranks == 1:
        return [sys.executable, "-m", "fsdpckpt", *merge]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "-m", "fsdpckpt", *merge]


def _run(cmd: list[str]) -> tuple[float, float, int]:
    """Whole-command wall seconds, the merge stage's seconds, and the bytes merged."""
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {done.stderr[-2000:]}")
    outputs = json.loads(done.stdout)["outputs"]
    return wall, sum(o["seconds"] for o in outputs), sum(o["bytes"] for o in outputs)


def measure(src: Path, ranks: int, rounds: int, shard: str, scratch: Path
            ) -> dict[int, dict[str, float]]:
    subprocess.run(["cat"] + [str(p) for p in src.iterdir()], stdout=subprocess.DEVNULL,
                   check=True)  # warm the page cache once
    walls: dict[int, list[float]] = {1: [], ranks: []}
    stages: dict[int, list[float]] = {1: [], ranks: []}
    nbytes = 0
    for _ in range(rounds):
        for world in (1, ranks):
            out = scratch / "out"
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # no command pays for the write-back of the one before it
            wall, stage, nbytes = _run(_command(src, out, world, shard))
            walls[world].append(wall)
            stages[world].append(stage)
    shutil.rmtree(scratch / "out", ignore_errors=True)
    return {world: {"wall": statistics.median(walls[world]),
                    "stage": statistics.median(stages[world]), "bytes": nbytes}
            for world in walls}


def report(src: Path, ranks: int, shard: str, results: dict[int, dict[str, float]]) -> None:
    size = results[1]["bytes"]
    print(f"\n{size / 1e9:.2f} GB of tensors from {src}, --max-shard-size {shard}, "
          f"{os.cpu_count()} CPUs, median of the rounds")
    print(f"{'ranks':>5} {'wall s':>8} {'merge s':>8} {'GB/s (merge)':>13} "
          f"{'GB/s per process':>17}")
    for world, r in results.items():
        rate = size / r["stage"] / 1e9
        print(f"{world:5d} {r['wall']:8.2f} {r['stage']:8.2f} {rate:13.2f} "
              f"{rate / world:17.2f}")
    one, many = results[1], results[ranks]
    print(f"1 rank / {ranks} ranks: wall {one['wall'] / many['wall']:.2f}x, merge stage "
          f"{one['stage'] / many['stage']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description="fsdpckpt distributed merge benchmark")
    parser.add_argument("--path", type=Path, help="measure this DCP folder instead of building")
    parser.add_argument("--layers", type=int, default=12,
                        help="size to build, in 4096x4096 fp32 layers (64 MiB each)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-shard-size", default="200MB",
                        help="shard size: the files the ranks share")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fsdpckpt-bench-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = args.path
        if src is None:
            src = work / f"model_{args.layers}"
            if not (src / ".metadata").exists():
                start = time.perf_counter()
                build(src, args.layers)
                print(f"built {src} in {time.perf_counter() - start:.1f} s")
        results = measure(src, args.ranks, args.rounds, args.max_shard_size, work)
        report(src, args.ranks, args.max_shard_size, results)
        if args.json:
            args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
