"""Every merge path side by side: plain, --dtype bf16, dim-1 chunks, non-contiguous chunks.

Run by hand (not in CI):

    python benchmarks/merge_paths.py                 # 24 layers of 4096x4096 fp32 (1.6 GB)
    python benchmarks/merge_paths.py --layers 48 --rounds 5
    python benchmarks/merge_paths.py --before /work/main --cases transposed,big  # vs a tree

Model folders of the same bytes (N layers of 4096x4096 fp32):
  - dim0: written by a real 2-rank FSDP2 run (each weight split on dim 0), as FSDP saves;
  - dim1: each weight in two dim-1 chunks, as tensor parallelism saves;
  - grid: each weight in a 2x2 grid of chunks (dim 0 and dim 1);
  - transposed: each weight in two dim-0 chunks stored column-major (a transposed view
    that torch.save kept with its strides);
  - permuted: N 3-D weights of 1024x16x1024 fp32 (the same bytes), each in two dim-0 chunks
    stored in another dim order (a view of a contiguous (16, 512, 1024) tensor);
  - big_plain, big_transposed: one square tensor of --big GB, whole, row-major and
    column-major (the plain merge of the same bytes is the second's anchor, and a durable
    copy of big_plain their "x cp+sync").
Each merge is a whole `fsdpckpt merge` process; tools alternate within each round; median
wall time, CPU time (user + system, all threads) and peak RSS from wait4. Page cache warm,
`sync` (untimed) before each run. The anchor is the plain merge of the dim0 folder, measured
in the same run. With ``--before TREE`` each merge also runs with the fsdpckpt of another
checkout (``PYTHONPATH=TREE``, run from there), alternated with this one's, each tree's rows
against its own anchors. Targets (issue 8): peak RSS <= 300 MB on every path; `--dtype bf16`
<= 1.5x the plain merge.
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
from merge import build, run_usage

ROOT = Path(__file__).resolve().parent.parent


def _build_layouts(work: Path, layers: int, big_gb: float) -> None:
    # In a child: the measuring process must not hold torch (its peak would leak into
    # the children's ru_maxrss).
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
from chunked import split, write_dcp
from pathlib import Path
g = torch.Generator().manual_seed(0)
work = Path({str(work)!r})

def permuted(tensor):  # dim-0 chunks, each stored as a view of its (16, rows, 1024) permute
    return [(o, p.permute(1, 0, 2).contiguous().permute(1, 0, 2)) for o, p in split([0])(tensor)]

for name, layout, shape in [("dim1", split([1]), (4096, 4096)),
                            ("grid", split([0, 1]), (4096, 4096)),
                            ("transposed", split([0], transpose=True), (4096, 4096)),
                            ("permuted", permuted, (1024, 16, 1024))]:
    if not (work / name / ".metadata").exists():
        write_dcp(work / name, {{f"{{i}}.weight": (torch.randn(*shape, generator=g), layout)
                                for i in range({layers})}})
side = int(({big_gb} * 1e9 / 4) ** 0.5)
if not (work / "big_transposed" / ".metadata").exists():
    big = torch.randn(side, side, generator=g)
    write_dcp(work / "big_plain", {{"w": (big, split([]))}})
    write_dcp(work / "big_transposed", {{"w": (big, split([], transpose=True))}})
"""
    subprocess.run([sys.executable, "-c", code], check=True)


#: The CLI in a process that imported torch first, as a training script calling merge() is.
_WITH_TORCH = ("import sys, torch\nfrom fsdpckpt.__main__ import run\n"
               "sys.argv[0] = 'fsdpckpt'\nrun()")


def _merge(src: Path, out: Path, *extra: str, tree: Path = ROOT, torch: bool = False
           ) -> list[str]:
    # Run from the tree (python -m puts the working folder first on sys.path).
    how = ["-c", _WITH_TORCH] if torch else ["-m", "fsdpckpt"]
    return ["env", "-C", str(tree), f"PYTHONPATH={tree}", sys.executable, *how,
            "merge", str(src), str(out), "--quiet", *extra]


_ANCHORS = ("merge (dim0, plain)", "merge (one big tensor, plain)")
_TORCH = ", torch imported"


def _anchor(name: str, tree: str) -> str:
    # The big tensor against the plain merge of the same bytes (in a process that holds
    # torch too, where this one does), the rest against dim0's.
    if "big" not in name:
        return _ANCHORS[0] + tree
    return _ANCHORS[1].replace(")", _TORCH + ")" if _TORCH in name else ")") + tree
BEFORE = " [before]"


def measure(work: Path, rounds: int, only: list[str] | None = None,
            before: Path | None = None) -> dict[str, dict[str, float]]:
    out = work / "out"
    cases = {
        "merge (dim0, plain)": _merge(work / "dim0", out),
        "merge --dtype bf16 (dim0)": _merge(work / "dim0", out, "--dtype", "bf16"),
        "merge --dtype fp16 (dim0)": _merge(work / "dim0", out, "--dtype", "fp16"),
        "merge (dim1 chunks)": _merge(work / "dim1", out),
        "merge --dtype bf16 (dim1 chunks)": _merge(work / "dim1", out, "--dtype", "bf16"),
        "merge --dtype fp16 (dim1 chunks)": _merge(work / "dim1", out, "--dtype", "fp16"),
        "merge (2-D grid chunks)": _merge(work / "grid", out),
        "merge (transposed chunks)": _merge(work / "transposed", out),
        "merge --dtype bf16 (transposed)": _merge(work / "transposed", out, "--dtype", "bf16"),
        "merge --dtype fp16 (transposed)": _merge(work / "transposed", out, "--dtype", "fp16"),
        "merge (3-D chunks stored permuted)": _merge(work / "permuted", out),
        "merge --dtype bf16 (permuted)": _merge(work / "permuted", out, "--dtype", "bf16"),
        "cp -r (dim0, the I/O floor)": ["cp", "-r", str(work / "dim0"), str(out / "copy")],
        "cp -r && sync (a durable copy)": ["sh", "-c", f"cp -r '{work / 'dim0'}' "
                                           f"'{out / 'copy'}' && sync"],
        "cp -r && sync (one big tensor)": ["sh", "-c", f"cp -r '{work / 'big_plain'}' "
                                           f"'{out / 'copy'}' && sync"],
        "merge (one big tensor, plain)": _merge(work / "big_plain", out),
        "merge (one big tensor, column-major)": _merge(work / "big_transposed", out),
        f"merge (one big tensor, plain{_TORCH})": _merge(work / "big_plain", out, torch=True),
        f"merge (one big tensor, column-major{_TORCH})": _merge(work / "big_transposed", out,
                                                               torch=True),
    }
    if only:
        cases = {name: cmd for name, cmd in cases.items()
                 if name in _ANCHORS or name.startswith("cp") and "big" not in name
                 or any(word in name for word in only)
                 or (_TORCH in name and "big" in only)}
    if before is not None:
        for name, cmd in list(cases.items()):
            if name.startswith("merge"):
                at = cmd.index(sys.executable)
                cases[name + BEFORE] = ["env", "-C", str(before), f"PYTHONPATH={before}",
                                        *cmd[at:]]
    # Warm the page cache once.
    for folder in ("dim0", "dim1", "grid", "transposed", "permuted", "big_plain",
                   "big_transposed"):
        subprocess.run(["cat", *map(str, (work / folder).iterdir())], stdout=subprocess.DEVNULL,
                       check=True)
    times: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    for turn in range(rounds):
        # Alternate the order each round: a busy spell then falls on every case alike.
        for name, cmd in (list(cases.items()) if turn % 2 == 0 else
                          list(reversed(cases.items()))):
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            os.sync()
            wall, cpu, peak = run_usage(cmd)
            times.setdefault(name, []).append(wall)
            cpus.setdefault(name, []).append(cpu)
            peaks.setdefault(name, []).append(peak)
    shutil.rmtree(out, ignore_errors=True)
    return {name: {"seconds": statistics.median(times[name]), "peak_mb": max(peaks[name]),
                   "cpu": statistics.median(cpus[name]), "runs": times[name]}
            for name in cases}


def report(results: dict[str, dict[str, float]], size_gb: float) -> None:
    durable = results["cp -r && sync (a durable copy)"]["seconds"]
    # The big tensor's rows against a durable copy of its own folder, where it was measured.
    durable_big = results.get("cp -r && sync (one big tensor)", {}).get("seconds", durable)
    print(f"\n{size_gb:.1f} GB of fp32 weights per folder; whole process, median wall and CPU")
    print(f"{'case':47} {'wall s':>7} {'cpu s':>6} {'x plain':>8} {'x cp+sync':>10} "
          f"{'peak RSS MB':>12}")
    for name, r in results.items():
        tree = BEFORE if name.endswith(BEFORE) else ""
        anchor = results[_anchor(name, tree)]["seconds"]
        copy = durable_big if "big" in name else durable
        print(f"{name:47} {r['seconds']:7.2f} {r['cpu']:6.2f} {r['seconds'] / anchor:8.2f} "
              f"{r['seconds'] / copy:10.2f} {r['peak_mb']:12.0f}")
    anchor = results[_ANCHORS[0]]["seconds"]
    worst = max(r["peak_mb"] for n, r in results.items()
                if n.startswith("merge") and not n.endswith(BEFORE))
    bf16 = results.get("merge --dtype bf16 (dim0)", {}).get("seconds", float("nan")) / anchor
    big = results.get("merge (one big tensor, column-major)", {}).get("seconds", float("nan")) \
        / results[_ANCHORS[1]]["seconds"]
    big_copy = results.get("merge (one big tensor, column-major)", {}).get(
        "seconds", float("nan")) / durable_big
    torch_big = results.get(f"merge (one big tensor, column-major{_TORCH})", {}).get(
        "seconds", float("nan")) / results.get(_anchor(_TORCH + "big", ""), {}).get(
        "seconds", float("nan"))
    print(f"targets: every path <= 1.5x plain (--dtype bf16: {bf16:.2f}x; the big column-major "
          f"tensor: {big:.2f}x its plain merge, {big_copy:.2f}x a durable copy of it, "
          f"{torch_big:.2f}x with torch imported); "
          f"plain <= 1.3x cp+sync: {anchor / durable:.2f}x; "
          f"peak RSS <= 300 MB on every path: {worst:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description="fsdpckpt merge paths benchmark")
    parser.add_argument("--layers", type=int, default=24,
                        help="4096x4096 fp32 layers (64 MiB each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big", type=float, default=1.0,
                        help="GB of the one big tensor, stored plain and column-major")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    parser.add_argument("--cases", help="comma-separated words: only the cases whose name "
                        "holds one (the anchors always run), e.g. transposed,big")
    parser.add_argument("--before", type=Path, help="another checkout of fsdpckpt whose "
                        "merges run beside this one's (before/after in one run)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fsdpckpt-paths-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cpus: {os.cpu_count()}, workdir: {work}")
    try:
        if not (work / "permuted" / ".metadata").exists():
            start = time.perf_counter()
            if not (work / "dim0" / ".metadata").exists():
                build(work / "dim0", args.layers)
            _build_layouts(work, args.layers, args.big)  # those still missing
            print(f"built the folders in {time.perf_counter() - start:.1f} s")
        size_gb = sum(p.stat().st_size for p in (work / "dim0").iterdir()) / 1e9
        only = args.cases.split(",") if args.cases else None
        results = measure(work, args.rounds, only, args.before)
        report(results, size_gb)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
