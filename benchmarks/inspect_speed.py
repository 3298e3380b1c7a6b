"""Whole-process time of `fsdpckpt inspect` on a checkpoint with thousands of tensors.

Run by hand:  python benchmarks/inspect_speed.py [--tensors 4000] [--runs 5]

Builds a DCP folder whose .metadata describes N tensors, each split on dim 0
across 2 ranks as FSDP writes them, with sparse rank files of the right size
(inspect reads only metadata and file sizes). Then times, whole process:
  - `fsdpckpt inspect PATH` and `fsdpckpt inspect PATH --json`
  - anchors: `python -c "import torch"` and torch's own
    `FileSystemReader(PATH).read_metadata()` in a fresh process.
Target (issue 2): at most 1 s for inspect on this machine.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(path: Path, n: int, rows: int = 1024) -> None:
    """A DCP folder of ``n`` tensors (about ``rows`` x 64 fp32), each split on dim 0 across 2
    ranks; the rank files are sparse, of the sizes the metadata gives (inspect reads only
    those)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from fsdpckpt._torch import dcp_metadata

    entries, storage, planner, ends = {}, {}, {}, [0, 0]
    for i in range(n):
        name = f"model.layers.{i // 8}.mlp.w{i % 8}.weight"
        rows_i, cols = rows + (i % 3), 64
        half = (rows_i + 1) // 2
        chunks = []
        for rank, (start, size) in enumerate([(0, half), (half, rows_i - half)]):
            chunk = ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([size, cols]))
            chunks.append(chunk)
            length = size * cols * 4 + 1600
            storage[MetadataIndex(name, chunk.offsets)] = _StorageInfo(
                f"__{rank}_0.distcp", ends[rank], length)
            ends[rank] += length
        entries[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                              torch.Size([rows_i, cols]), chunks)
        planner[name] = tuple(name.split("."))
    md = dcp_metadata(entries, planner_data=planner, storage_data=storage, version="1.0.0")
    path.mkdir(parents=True, exist_ok=True)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    for rank, end in enumerate(ends):
        with open(path / f"__{rank}_0.distcp", "wb") as f:
            f.truncate(end)


def timed(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        build(path, args.tensors)
        meta_kb = (path / ".metadata").stat().st_size / 1024
        cli = [sys.executable, "-m", "fsdpckpt", "inspect", str(path)]
        results = {
            "fsdpckpt inspect": timed(cli, args.runs),
            "fsdpckpt inspect --json": timed(cli + ["--json"], args.runs),
            "python -c 'import torch'": timed([sys.executable, "-c", "import torch"], args.runs),
            "torch read_metadata": timed([sys.executable, "-c",
                                          "from torch.distributed.checkpoint import "
                                          "FileSystemReader as R; "
                                          f"R({str(path)!r}).read_metadata()"],
                                         args.runs),
            "python -c pass": timed([sys.executable, "-c", "pass"], args.runs),
        }
    anchor = results["python -c 'import torch'"]
    print(f"{args.tensors} tensors x 2 chunks, .metadata {meta_kb:.0f} KiB, "
          f"median of {args.runs} runs, whole process (cpus: {os.cpu_count()})")
    print(f"{'command':32} {'seconds':>8} {'vs import torch':>16}")
    for name, secs in results.items():
        print(f"{name:32} {secs:8.3f} {secs / anchor:15.2f}x")
    ok = results["fsdpckpt inspect"] <= 1.0
    print(f"target: fsdpckpt inspect <= 1.0 s: {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
