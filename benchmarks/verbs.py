"""load_full_state_dict and diff against their anchors (issue 21).

Run by hand (not in CI):

    python benchmarks/verbs.py                     # 12 layers of 4096x4096 fp32 (805 MB)
    python benchmarks/verbs.py --layers 24 --rounds 5

Builds a model folder with a real 2-rank FSDP2 run (as ``benchmarks/merge.py`` does), a
second copy of it (``cp -r``: the same bytes in other files) and its merged safetensors
file, then times whole processes, alternating cases in each round (median wall, peak RSS
from ``wait4``; page cache warm, ``sync`` untimed before each run):

- ``fsdpckpt.load_full_state_dict(DIR)`` against torch's own way to the same dict,
  ``dcp_to_torch_save(DIR, FILE)`` then ``torch.load(FILE)`` (the file in the same
  scratch folder, removed after). Target: no slower.
- ``fsdpckpt diff A B`` of the folder and its copy (every byte of both read and compared,
  every chunk checked against its CRC-32), and of the folder and its merged safetensors
  file, against reading both sides once: ``cat`` of both sides' data files into
  ``/dev/null`` in one process (the bytes only: no CRC, no comparison). Target: at most
  1.5x. A second anchor reads the same files in diff's read size and sums every byte with
  ``zlib.crc32`` on one thread (the check diff must do, which ``cat`` does not): on a
  machine whose CRC-32 runs at about 2 GB/s a core, that, not the read, is diff's floor.
  The ``import torch`` process alone is printed for reference (identical sides laid out
  alike are compared without torch; any other tile imports it).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge import build, run_usage

_LOAD = ("import sys, fsdpckpt\n"
         "fsdpckpt.load_full_state_dict(sys.argv[1])\n")
_TORCH = ("import sys, torch\n"
          "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
          "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
          "torch.load(sys.argv[2])\n")
# Reading both sides once with the check diff must do: every byte through memory in diff's
# read size (a tile of 2^19 fp32 elements) and through zlib.crc32, on one thread.
_READ_CRC = ("import sys, zlib\n"
             "buffer = memoryview(bytearray(2 * 2**20))\n"
             "for name in sys.argv[1:]:\n"
             "    with open(name, 'rb', buffering=0) as file:\n"
             "        crc = 0\n"
             "        while got := file.readinto(buffer):\n"
             "            crc = zlib.crc32(buffer[:got], crc)\n")


def _files(*folders: Path) -> list[str]:
    return [str(p) for folder in folders for p in sorted(folder.iterdir()) if p.is_file()]


def cases(work: Path) -> dict[str, list[str] | None]:
    py, dim0, copy, merged = sys.executable, work / "dim0", work / "copy", work / "merged"
    return {
        "load_full_state_dict": [py, "-c", _LOAD, str(dim0)],
        "dcp_to_torch_save + torch.load": [py, "-c", _TORCH, str(dim0), str(work / "out.pt")],
        "fsdpckpt diff DIR COPY": [py, "-m", "fsdpckpt", "diff", str(dim0), str(copy)],
        "cat DIR/* COPY/* > /dev/null": ["cat", *_files(dim0, copy)],
        "read + crc32 DIR/* COPY/* (python)": [py, "-c", _READ_CRC, *_files(dim0, copy)],
        "fsdpckpt diff DIR MERGED": [py, "-m", "fsdpckpt", "diff", str(dim0), str(merged)],
        "cat DIR/* MERGED/* > /dev/null": ["cat", *_files(dim0, merged)],
        "python -c 'import torch'": [py, "-c", "import torch"],
    }


def measure(work: Path, rounds: int) -> dict[str, dict[str, float]]:
    todo = cases(work)
    subprocess.run(["cat", *_files(work / "dim0", work / "copy", work / "merged")],
                   stdout=subprocess.DEVNULL, check=True)  # warm the page cache once
    times: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, cmd in todo.items():
            (work / "out.pt").unlink(missing_ok=True)
            os.sync()
            if cmd[0] == "cat":  # its output to /dev/null, not a pipe
                cmd = ["sh", "-c", 'exec cat "$@" > /dev/null', "cat", *cmd[1:]]
            wall, cpu, peak = run_usage(cmd)  # CPU time: less moved by a busy machine
            times.setdefault(name, []).append(wall)
            cpus.setdefault(name, []).append(cpu)
            peaks.setdefault(name, []).append(peak)
    (work / "out.pt").unlink(missing_ok=True)
    return {name: {"seconds": statistics.median(times[name]), "peak_mb": max(peaks[name]),
                   "cpu_seconds": statistics.median(cpus[name]), "runs": times[name]}
            for name in todo}


def report(results: dict[str, dict[str, float]], size_gb: float, rounds: int) -> None:
    print(f"\n{size_gb:.2f} GB model folder (2-rank FSDP2, fp32); whole processes, median "
          f"of {rounds}")
    print(f"{'case':34} {'wall s':>7} {'CPU s':>6} {'peak RSS MB':>12}  runs (wall s)")
    for name, r in results.items():
        runs = " ".join(f"{w:.2f}" for w in r["runs"])
        print(f"{name:34} {r['seconds']:7.2f} {r['cpu_seconds']:6.2f} {r['peak_mb']:12.0f}  "
              f"{runs}")
    s = {name: r["seconds"] for name, r in results.items()}
    print(f"targets: load_full_state_dict <= torch's way: "
          f"{s['load_full_state_dict'] / s['dcp_to_torch_save + torch.load']:.2f}x")
    for other in ("COPY", "MERGED"):
        diff, cat = s[f"fsdpckpt diff DIR {other}"], s[f"cat DIR/* {other}/* > /dev/null"]
        print(f"  diff DIR {other} <= 1.5x reading both (cat): {diff / cat:.2f}x")
    crc = s["read + crc32 DIR/* COPY/* (python)"]
    print(f"  diff DIR COPY against reading both with the CRC: "
          f"{s['fsdpckpt diff DIR COPY'] / crc:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description="load_full_state_dict and diff benchmark")
    parser.add_argument("--layers", type=int, default=12,
                        help="4096x4096 fp32 layers (64 MiB each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fsdpckpt-verbs-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cpus: {os.cpu_count()}, workdir: {work}")
    try:
        if not (work / "merged").exists():
            start = time.perf_counter()
            build(work / "dim0", args.layers)
            shutil.copytree(work / "dim0", work / "copy")
            subprocess.run([sys.executable, "-m", "fsdpckpt", "merge", str(work / "dim0"),
                            str(work / "merged"), "--quiet"], check=True)
            print(f"built the folders in {time.perf_counter() - start:.1f} s")
        size_gb = sum(p.stat().st_size for p in (work / "dim0").iterdir()) / 1e9
        report(measure(work, args.rounds), size_gb, args.rounds)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
