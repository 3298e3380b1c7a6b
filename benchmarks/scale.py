"""A large run's checkpoint read at scale, against torch's own metadata reader (issue 32).

Run by hand (not in CI):

    python benchmarks/scale.py                       # 64 and 256 simulated ranks
    python benchmarks/scale.py --ranks 1024 --rounds 1
    python benchmarks/scale.py --ranks 256 --before ../fsdpckpt-main   # against another tree

Builds simulated checkpoints of a Llama-3-70B-shaped model in Accelerate's layout (fp32
weights and AdamW state, FSDP2 dim-0 shards over N ranks), with ``.metadata`` pickled from
torch's own dataclasses exactly as ``FileSystemWriter`` writes it and sparse rank files
(``benchmarks/_simulate.py``; no training). Then times whole processes, each its median
wall time and peak RSS (``wait4``), page cache warm:

  - the anchor: torch's ``FileSystemReader.read_metadata()`` of both folders (plain pickle,
    no checks), ``import torch`` included;
  - ``fsdpckpt inspect`` (text and ``--json``);
  - ``verify`` and ``diff`` (the model folder against itself), each up to the first data file
    it opens;
  - merge planning of the model folder and of the optimizer folder (``plan_merge``: read,
    checked, every tensor planned; what ``merge`` does before its first data read);
  - ``load_full_state_dict`` planning (read, checked: ``require_whole``).
Goal (issue 32): every row at most 1.0x the anchor's time and peak memory.

With ``--all-goals``, the same run then measures issue 32's other goals, each against its
own anchor, on the checkpoints built here: resuming one rank (``resume.py``, goal 3), the
manifest a save gathers (``save_manifest.py``, goal 4), a folder of many rank files under
``ulimit -n 56`` (``tests/test_many_files.py``, goal 5) and a tensor in 4,096 chunks
(``many_chunks.py``, goal 6):

    python benchmarks/scale.py --ranks 1024 --rounds 1 --all-goals --workdir /tmp/sim
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent


#: The measured processes keep their compiled bytecode, as an installed package does: with
#: ``PYTHONDONTWRITEBYTECODE`` set (some machines set it) every run would compile every
#: module again, a constant that makes each ratio look smaller than a user's.
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_usage(cmd: list[str], cwd: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one whole process (bytecode kept: see ``_ENV``)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd,
                            env=_ENV)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def build_apart(ckpt: Path, ranks: int, **options: Any) -> None:
    """:func:`_simulate.build` of ``ckpt`` (unless built before) in a process of its own: a
    child's peak RSS counts the memory of the process it was started from (Linux keeps the
    parent's high-water mark across the exec), so building here would inflate every figure
    measured after."""
    if (ckpt / "optimizer_0" / ".metadata").exists():
        return
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import json, sys\nsys.path.insert(0, sys.argv[1])\n"
                    "from _simulate import build\n"
                    "build(__import__('pathlib').Path(sys.argv[2]), int(sys.argv[3]), "
                    "**json.loads(sys.argv[4]))",
                    str(Path(__file__).resolve().parent), str(ckpt), str(ranks),
                    json.dumps(options)], check=True)
    print(f"built {ckpt} in {time.perf_counter() - start:.0f} s", file=sys.stderr)


#: Ends the process at the first data file a verb opens: what it does before reading data.
_FIRST_READ = ("import sys\nimport fsdpckpt\nfrom fsdpckpt.dcp import _datafiles\n"
               "_datafiles.open_data_file = lambda *_: sys.exit(0)\n")


def commands(ckpt: Path) -> dict[str, list[str]]:
    py = sys.executable
    model, optim = ckpt / "pytorch_model_fsdp_0", ckpt / "optimizer_0"
    return {
        "torch read_metadata (both)": [
            py, "-c", "import sys\nfrom torch.distributed.checkpoint import FileSystemReader\n"
            "for f in sys.argv[1:]: FileSystemReader(f).read_metadata()", str(model), str(optim)],
        "inspect": [py, "-m", "fsdpckpt", "inspect", str(ckpt)],
        "inspect --json": [py, "-m", "fsdpckpt", "inspect", str(ckpt), "--json"],
        "merge planning (model)": [
            py, "-c", "import sys\nfrom fsdpckpt.merging.plan import plan_merge\n"
            "plan_merge(sys.argv[1])", str(model)],
        "merge --optimizer planning": [
            py, "-c", "import sys\nfrom fsdpckpt.merging.plan import plan_merge\n"
            "plan_merge(sys.argv[1], clean_keys=False)", str(optim)],
        "verify up to its first data read": [
            py, "-c", _FIRST_READ + "fsdpckpt.verify_checkpoint(sys.argv[1])", str(ckpt)],
        "diff planning (model against itself)": [
            py, "-c", _FIRST_READ + "fsdpckpt.diff(sys.argv[1], sys.argv[1])", str(model)],
        "load_full_state_dict planning (both)": [
            py, "-c", "import sys\nfrom fsdpckpt.dcp.checks import require_whole\n"
            "from fsdpckpt.dcp.reader import read_dcp_folder\n"
            "for f in sys.argv[1:]: require_whole(read_dcp_folder(f))", str(model), str(optim)],
    }


def measure(ckpt: Path, rounds: int, trees: dict[str, Path]) -> list[tuple[str, str, float, float]]:
    """``(tree, command, median wall, median peak MB)``: each round runs every command of
    every tree in turn (alternated, so a slow spell hits them alike)."""
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for tree, cwd in trees.items():
            for name, cmd in commands(ckpt).items():
                if tree != "this" and name.startswith("torch"):
                    continue
                runs.setdefault((tree, name), []).append(run_usage(cmd, cwd))
    return [(tree, name, statistics.median(w for w, _ in got),
             statistics.median(m for _, m in got)) for (tree, name), got in runs.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than 70B's 80")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout, measured alternately against this one")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the simulated checkpoints here (built once)")
    parser.add_argument("--all-goals", action="store_true",
                        help="then resume, save, many files and many chunks (goals 3-6)")
    args = parser.parse_args()
    trees = {"this": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        for ranks in args.ranks:
            ckpt = work / f"llama70b-{ranks}"
            build_apart(ckpt, ranks, layers=args.layers)
            sizes = [(ckpt / p / ".metadata").stat().st_size
                     for p in ("pytorch_model_fsdp_0", "optimizer_0")]
            rows = measure(ckpt, args.rounds, trees)
            anchor = next((w, m) for t, n, w, m in rows if n.startswith("torch"))
            print(f"\n{ranks} ranks, .metadata {sizes[0] / 1e6:.0f} MB + {sizes[1] / 1e6:.0f} MB "
                  f"(medians of {args.rounds})")
            print(f"| {'tree':6} | {'command':38} | {'wall':>8} | {'x torch':>7} | "
                  f"{'peak RSS':>9} | {'x torch':>7} |")
            print(f"|{'-' * 8}|{'-' * 40}|{'-' * 10}|{'-' * 9}|{'-' * 11}|{'-' * 9}|")
            for tree, name, wall, peak in rows:
                print(f"| {tree:6} | {name:38} | {wall:7.2f}s | {wall / anchor[0]:6.2f}x | "
                      f"{peak:6.0f} MB | {peak / anchor[1]:6.2f}x |")
        if args.all_goals:
            other_goals(work, args.ranks, args.rounds)


def other_goals(work: Path, ranks: list[int], rounds: int) -> None:
    """Goals 3-6 of issue 32, each script printing its own table (see the module's text)."""
    here, py = Path(__file__).resolve().parent, sys.executable
    resume_ranks = min(ranks, key=lambda r: abs(r - 1024))
    steps = [
        [py, str(here / "resume.py"), "--ranks", str(resume_ranks), "--rank",
         str(resume_ranks // 2 + 5), "--rounds", str(rounds), "--workdir", str(work)],
        [py, str(here / "save_manifest.py"), "--ranks", *map(str, ranks), "--workdir",
         str(work)],
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" /
                                                                 "test_many_files.py")],
        [py, str(here / "many_chunks.py"), "--rounds", str(max(rounds, 5)), "--workdir",
         str(work)],
    ]
    for cmd in steps:
        sys.stdout.flush()
        subprocess.run(cmd, check=True, cwd=ROOT, env=_ENV)


if __name__ == "__main__":
    main()
