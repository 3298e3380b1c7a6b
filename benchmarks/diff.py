"""diff speed and peak memory against the plain merge of the same checkpoint.

Run by hand (not in CI):

    python benchmarks/diff.py              # 256 MiB: an 8192x8192 fp32 tensor
    python benchmarks/diff.py --rows 16384 # 512 MiB

Writes DCP folders of one tensor in several layouts (dim-0 shards as FSDP writes them, dim-1
shards, a 3x3 grid, transposed chunks) with tests/chunked.py, a safetensors reference and a
``.bin``; then times, as whole processes, ``fsdpckpt merge`` of the dim-0 folder (the anchor)
and ``fsdpckpt diff`` of each layout against the safetensors file, taking wall time and peak
RSS (wait4). Each figure is the median of --rounds; the ratio is against the merge measured
in the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(path: Path, rows: int) -> None:
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
from pathlib import Path
from chunked import split, write_dcp
from safetensors.torch import save_file
root = Path({str(path)!r})
value = torch.randn({rows}, 8192, generator=torch.Generator().manual_seed(0))
layouts = {{"dim0": split([0]), "dim1": split([1]), "grid": split([0, 1], parts=3),
            "transposed": split([0], transpose=True)}}
for name, layout in layouts.items():
    write_dcp(root / name, {{"w": (value, layout)}})
save_file({{"w": value}}, str(root / "ref.safetensors"))
torch.save({{"w": value}}, root / "ref.bin")
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def measure(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one fsdpckpt command run as a process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fsdpckpt", *args],
                            stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"fsdpckpt {' '.join(args)} failed")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, opts.rows)
        ref = str(root / "ref.safetensors")
        cases = {"merge dim0 (anchor)": None,
                 **{f"diff {n} vs safetensors": [str(root / n), ref]
                    for n in ("dim0", "dim1", "grid", "transposed")},
                 "diff .bin vs safetensors": [str(root / "ref.bin"), ref]}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(opts.rounds):
            for name, args in cases.items():
                if args is None:
                    out = root / "merged"
                    shutil.rmtree(out, ignore_errors=True)
                    results[name].append(measure(["merge", str(root / "dim0"), str(out)]))
                else:
                    results[name].append(measure(["diff", *args]))
        size = opts.rows * 8192 * 4 / 2**20
        anchor = statistics.median(w for w, _ in results["merge dim0 (anchor)"])
        print(f"one {opts.rows}x8192 fp32 tensor ({size:.0f} MiB), median of {opts.rounds}")
        print(f"| {'command':<28} | wall s | x merge | peak RSS MiB |")
        print(f"|{'-' * 30}|--------|---------|--------------|")
        for name, runs in results.items():
            wall = statistics.median(w for w, _ in runs)
            rss = statistics.median(r for _, r in runs)
            print(f"| {name:<28} | {wall:6.2f} | {wall / anchor:7.2f} | {rss:12.0f} |")


if __name__ == "__main__":
    main()
