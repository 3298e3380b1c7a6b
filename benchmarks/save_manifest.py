"""What ``save_state``'s manifest costs at thousands of ranks (issue 32, goal 4).

Run by hand (not in CI):

    python benchmarks/save_manifest.py                      # 1,024 and 4,096 ranks
    python benchmarks/save_manifest.py --ranks 256 1024 --layers 4

After a save, rank 0 builds the manifest (``fsdpckpt.json``): each file's size and CRC-32,
and the CRC-32 of every tensor chunk, read from each chunk's archive directory. This builds
simulated checkpoints in Accelerate's layout over N ranks (``benchmarks/_simulate.py`` with
real ``torch.save`` archives; a Llama of ``--layers`` layers and small dimensions, so the
chunk count, not the bytes, is what grows), then times ``build_manifest`` of each as a whole
process against torch's ``read_metadata`` of the same folders, and compares the manifest's
size with the ``.metadata`` files'. Goal (issue 32): linear in chunks, small beside
``.metadata``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import run_usage

ROOT = Path(__file__).resolve().parent.parent
DIMS = {"hidden": 64, "intermediate": 128, "vocab": 1024, "kv": 32}

_BUILD = """
import sys
sys.path.insert(0, {bench!r})
from pathlib import Path
from _simulate import build
build(Path({ckpt!r}), {ranks}, layers={layers}, data=True, **{dims!r})
"""
_MANIFEST = """
import json, sys
from pathlib import Path
from fsdpckpt.training.manifest import build_manifest
doc = build_manifest(Path(sys.argv[1]), {}, world_size=int(sys.argv[2]), step=1)
data = json.dumps(doc).encode()
Path(sys.argv[3]).write_text(str(len(data)))
"""
_TORCH = ("import sys\nfrom torch.distributed.checkpoint import FileSystemReader\n"
          "for f in sys.argv[1:]: FileSystemReader(f).read_metadata()")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        for ranks in args.ranks:
            ckpt = work / f"small-{args.layers}l-{ranks}"
            if not (ckpt / "optimizer_0" / ".metadata").exists():
                start = time.perf_counter()
                subprocess.run([sys.executable, "-c", _BUILD.format(
                    bench=str(Path(__file__).resolve().parent), ckpt=str(ckpt), ranks=ranks,
                    layers=args.layers, dims=DIMS)], check=True)
                print(f"built {ckpt} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
            folders = [ckpt / "pytorch_model_fsdp_0", ckpt / "optimizer_0"]
            meta = sum((f / ".metadata").stat().st_size for f in folders)
            anchor = run_usage([sys.executable, "-c", _TORCH, *map(str, folders)], ROOT)
            size_file = work / "manifest-size"
            built = run_usage([sys.executable, "-c", _MANIFEST, str(ckpt), str(ranks),
                               str(size_file)], ROOT)
            rows.append((ranks, meta, anchor, built, int(size_file.read_text())))
    print(f"\nbuild_manifest of a {args.layers}-layer Llama's checkpoint (model + AdamW)")
    print(f"| {'ranks':>5} | {'.metadata':>10} | {'torch read':>10} | {'manifest':>9} | "
          f"{'x torch':>7} | {'peak RSS':>9} | {'manifest size':>13} | {'x .metadata':>11} |")
    print(f"|{'-' * 7}|{'-' * 12}|{'-' * 12}|{'-' * 11}|{'-' * 9}|{'-' * 11}|{'-' * 15}|"
          f"{'-' * 13}|")
    for ranks, meta, (t_wall, _), (m_wall, m_peak), size in rows:
        print(f"| {ranks:5} | {meta / 1e6:7.1f} MB | {t_wall:9.2f}s | {m_wall:8.2f}s | "
              f"{m_wall / t_wall:6.2f}x | {m_peak:6.0f} MB | {size / 1e6:10.1f} MB | "
              f"{size / meta:10.2f}x |")


if __name__ == "__main__":
    main()
