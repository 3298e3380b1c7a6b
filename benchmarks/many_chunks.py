"""One tensor in thousands of chunks merges about as fast as in two (issue 32, goal 6).

Run by hand (not in CI):

    python benchmarks/many_chunks.py                  # 1 GiB, 2 against 4,096 chunks
    python benchmarks/many_chunks.py --chunks 2 1024 4096 --rounds 5

Builds one DCP folder per chunk count holding a single float32 tensor of ``--gib`` GiB
(``[rows, 8192]``), dim-0 sharded as FSDP2 shards it over as many ranks as chunks, one rank
file each, real ``torch.save`` archives (``benchmarks/_simulate.py``). Then times
``fsdpckpt merge`` of each as a whole process, page cache warm, alternating the folders
each round; prints the median wall time of each against the 2-chunk folder's (the anchor,
measured in the same run). Goal (issue 32): 4,096 chunks at most 1.3x the anchor.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _simulate import _Folder
from scale import run_usage

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = 8192


def build(folder: Path, chunks: int, gib: float) -> None:
    rows = int(gib * 2**30) // (4 * COLUMNS)
    described = _Folder(chunks, data=True)
    described.sharded("model.weight", ("model", "weight"), (rows, COLUMNS))
    described.write(folder)


def main() -> None:
    if sys.argv[1:2] == ["--build"]:
        build(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4096])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        folders = {}
        for chunks in args.chunks:
            folder = work / f"tensor-{args.gib:g}gib-{chunks}"
            if not (folder / ".metadata").exists():
                start = time.perf_counter()
                # Apart: a child's peak RSS counts the memory of the process that started it.
                subprocess.run([sys.executable, __file__, "--build", str(folder), str(chunks),
                                str(args.gib)], check=True)
                print(f"built {folder} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
            folders[chunks] = folder
        walls: dict[int, list[float]] = {c: [] for c in folders}
        peaks: dict[int, list[float]] = {c: [] for c in folders}
        for _ in range(args.rounds + 1):  # the first round warms the page cache: not counted
            for chunks, folder in folders.items():
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                wall, peak = run_usage([sys.executable, "-m", "fsdpckpt", "merge", str(folder),
                                        str(out)], ROOT)
                walls[chunks].append(wall)
                peaks[chunks].append(peak)
        anchor = statistics.median(walls[min(folders)][1:])
        print(f"\nfsdpckpt merge of one {args.gib:g} GiB float32 tensor "
              f"(medians of {args.rounds})")
        print(f"| {'chunks':>6} | {'wall':>8} | {'x 2 chunks':>10} | {'peak RSS':>9} |")
        print(f"|{'-' * 8}|{'-' * 10}|{'-' * 12}|{'-' * 11}|")
        for chunks in folders:
            wall = statistics.median(walls[chunks][1:])
            peak = statistics.median(peaks[chunks][1:])
            print(f"| {chunks:6} | {wall:7.2f}s | {wall / anchor:9.2f}x | {peak:6.0f} MB |")


if __name__ == "__main__":
    main()
