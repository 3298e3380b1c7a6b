"""The cost of checking every byte: the checked merge side by side with an unchecked one.

Run by hand (not in CI):

    python benchmarks/checked.py                  # 8 layers of 4096x4096 fp32 (512 MiB)
    python benchmarks/checked.py --layers 24 --rounds 5

Every tensor byte a merge reads is checked against the CRC-32 its chunk's zip records
(``fsdpckpt/dcp/_checked.py``), as it is read. The check cannot ride on ``copy_file_range``
(the bytes must pass through memory to be summed), so the plain merge of FSDP's dim-0
shards moves from a kernel copy to read + CRC + write; a cast (``--dtype bf16``) reads
through memory anyway and only adds the CRC.

The same folder (a real 2-rank FSDP2 save, as ``benchmarks/merge.py`` builds it) is merged
by whole ``fsdpckpt merge`` processes, checked (the default) and unchecked (the child sets
``fsdpckpt.dcp._checked.ENABLED = False`` before running the command line: the switch
exists for this measurement only, and gives up the guarantee). Cases alternate within each
round; median wall time, peak RSS from ``wait4``; page cache warm, ``sync`` (untimed)
before each run. The anchor is the unchecked plain merge of the same run; ``cp -r`` is the
I/O floor. The CRC-32 speed of this machine's zlib is printed for reference.
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
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge import build, run_usage

_CHILD = (
    "import sys\n"
    "from fsdpckpt.dcp import _checked\n"
    "_checked.ENABLED = sys.argv.pop(1) == 'checked'\n"
    "from fsdpckpt.__main__ import run\n"
    "sys.argv[0] = 'fsdpckpt'\n"
    "run()\n"
)


def _merge(mode: str, src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", _CHILD, mode, "merge", str(src), str(out), "--quiet", *extra]


def measure(src: Path, work: Path, rounds: int) -> dict[str, dict]:
    out = work / "out"
    cases = {
        "merge (unchecked)": _merge("unchecked", src, out),
        "merge (checked, the default)": _merge("checked", src, out),
        "merge --dtype bf16 (unchecked)": _merge("unchecked", src, out, "--dtype", "bf16"),
        "merge --dtype bf16 (checked)": _merge("checked", src, out, "--dtype", "bf16"),
        "cp -r (the I/O floor)": ["cp", "-r", str(src), str(out / "copy")],
    }
    subprocess.run(["cat", *map(str, src.iterdir())], stdout=subprocess.DEVNULL, check=True)
    times: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, cmd in cases.items():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            os.sync()
            wall, cpu, peak = run_usage(cmd)  # CPU time: what the check costs, even under load
            times.setdefault(name, []).append(wall)
            cpus.setdefault(name, []).append(cpu)
            peaks.setdefault(name, []).append(peak)
    shutil.rmtree(out, ignore_errors=True)
    return {
        name: {
            "seconds": statistics.median(times[name]),
            "cpu_seconds": statistics.median(cpus[name]),
            "peak_mb": max(peaks[name]),
            "runs": times[name],
        }
        for name in cases
    }


def crc_speed(megabytes: int = 256) -> float:
    """GB/s of ``zlib.crc32`` over a buffer already in memory (best of three)."""
    data = os.urandom(1 << 20) * megabytes
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        zlib.crc32(data)
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def report(results: dict[str, dict], size_gb: float, crc_gbs: float) -> None:
    anchor = results["merge (unchecked)"]["seconds"]
    print(
        f"\n{size_gb:.2f} GB of fp32 weights; whole process, median wall; "
        f"zlib.crc32 here: {crc_gbs:.1f} GB/s"
    )
    cpu_anchor = results["merge (unchecked)"]["cpu_seconds"]
    print(
        f"{'case':32} {'wall s':>7} {'x unchecked':>12} {'CPU s':>6} {'x unchecked':>12} "
        f"{'peak RSS MB':>12}"
    )
    for name, r in results.items():
        print(
            f"{name:32} {r['seconds']:7.2f} {r['seconds'] / anchor:12.2f} "
            f"{r['cpu_seconds']:6.2f} {r['cpu_seconds'] / cpu_anchor:12.2f} "
            f"{r['peak_mb']:12.0f}"
        )
    plain = results["merge (checked, the default)"]["seconds"] / anchor
    bf16 = (
        results["merge --dtype bf16 (checked)"]["seconds"]
        / results["merge --dtype bf16 (unchecked)"]["seconds"]
    )
    print(f"checked / unchecked: plain merge {plain:.2f}x, --dtype bf16 {bf16:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description="the cost of checking every byte of a merge")
    parser.add_argument("--layers", type=int, default=8, help="4096x4096 fp32 layers (64 MiB each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fsdpckpt-checked-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cpus: {os.cpu_count()}, workdir: {work}")
    src = work / "dim0"
    try:
        if not (src / ".metadata").exists():
            start = time.perf_counter()
            build(src, args.layers)
            print(f"built the folder in {time.perf_counter() - start:.1f} s")
        size_gb = sum(p.stat().st_size for p in src.iterdir()) / 1e9
        results = measure(src, work, args.rounds)
        report(results, size_gb, crc_speed())
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
