"""What ``--html`` costs: ``inspect --html`` of a simulated 1,024-rank 70B checkpoint against
``inspect`` itself, and ``diff --html`` of two 1.6 GB checkpoints against ``diff``.

Run by hand (not in CI):

    python benchmarks/reports.py                  # 1,024 ranks; two 1.6 GB checkpoints
    python benchmarks/reports.py --ranks 256 --diff-gb 0.4 --rounds 3

Times whole processes (``fsdpckpt ...``), each figure the median of --rounds, the ratios
against the command without ``--html`` measured in the same run, and the page's size. The
inspect checkpoint is ``benchmarks/_simulate.py``'s (Accelerate's layout of Llama-3-70B with
its AdamW state: metadata from torch's own classes, sparse rank files); the diff pair are
two DCP folders of random fp32 tensors written by ``save_state``, the second with half its
layers changed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def timed(cmd: list[str], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)}: {done.stderr}")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pair(work: Path, gigabytes: float) -> tuple[Path, Path]:
    code = f"""
import torch, fsdpckpt
from pathlib import Path
work, rows = Path({str(work)!r}), int({gigabytes} * 2**30 / 4 / 4096 / 16)
torch.manual_seed(0)
with torch.no_grad():
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, rows, bias=False) for _ in range(16)])
    fsdpckpt.save_state(work / "a", model)
    for layer in model[::2]:  # half the layers move a little
        layer.weight += 1e-3 * torch.randn_like(layer.weight)
    fsdpckpt.save_state(work / "b", model)
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return work / "a", work / "b"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--diff-gb", type=float, default=1.6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "fsdpckpt"]
    with tempfile.TemporaryDirectory(prefix="fsdpckpt-reports-") as tmp:
        work = Path(tmp)
        from _simulate import build

        ckpt = build(work / "ckpt", args.ranks)
        page = work / "inspect.html"
        plain = timed([*cli, "inspect", str(ckpt), "--summary"], args.rounds)
        html = timed([*cli, "inspect", str(ckpt), "--summary", "--html", str(page)], args.rounds)
        size = page.stat().st_size
        print(f"inspect, {args.ranks} ranks, 70B with AdamW: {plain:.2f} s; with --html "
              f"{html:.2f} s ({html / plain:.2f}x); page {size / 2**20:.2f} MiB")
        a, b = _pair(work, args.diff_gb)
        page = work / "diff.html"
        plain = timed([*cli, "diff", str(a), str(b), "-q"], args.rounds)
        html = timed([*cli, "diff", str(a), str(b), "-q", "--html", str(page)], args.rounds)
        print(f"diff, two {args.diff_gb} GB checkpoints: {plain:.2f} s; with --html "
              f"{html:.2f} s ({html / plain:.2f}x); page {page.stat().st_size / 2**10:.0f} KiB")


if __name__ == "__main__":
    main()
