"""What ``save_state``'s manifest costs at thousands of ranks (issue 32, goal 4).

Run by hand (not in CI):

    python benchmarks/save_manifest.py                      # 1,024 and 4,096 ranks
    python benchmarks/save_manifest.py --ranks 256 1024 --layers 4

After a save, each rank reads the CRC-32s of its own chunks from their archives' directories
and sends rank 0 a (size, CRC-32) per file and 8 hex digits a chunk; rank 0 writes the
manifest (``fsdpckpt.json``). This builds simulated checkpoints in Accelerate's layout over
N ranks (``benchmarks/_simulate.py`` with real ``torch.save`` archives; a Llama of
``--layers`` layers and small dimensions, so the chunk count, not the bytes, is what
grows), then times one rank's part (rank 1's), what it sends, and rank 0's
building of the whole document, against torch's ``read_metadata`` of the same folders (the
anchor: what a resume reads anyway), and compares the manifest's size with the
``.metadata`` files'. Goal (issue 32): linear in chunks, small beside ``.metadata``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import build_apart, run_usage

ROOT = Path(__file__).resolve().parent.parent
DIMS = {"hidden": 64, "intermediate": 128, "vocab": 1024, "kv": 32}

#: One rank's part (``own_checksums`` of the files rank ``r`` wrote: where its chunks lie
#: comes from DCP's write results in a save, from the .metadata here, untimed), then what
#: rank 0 does with every rank's parts (``build_manifest``, the JSON written).
_RANK = """
import json, pickle, sys, time
from pathlib import Path
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.training.manifest import build_manifest, own_checksums
root, rank, world, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
folders = ["pytorch_model_fsdp_0", "optimizer_0"]
metas = {f: read_dcp_folder(root / f).metadata for f in folders}
def archives_of(r):
    found = {}
    for f, meta in metas.items():
        for t in meta.tensors:
            for c in t.chunks:
                if c.file == f"__{r}_0.distcp":
                    found.setdefault(f, {}).setdefault(c.file, []).append((c.offset, c.length))
    return found
mine = archives_of(rank)
records = {f: {name: ((root / f / name).stat().st_size, 0, None) for name in files}
           for f, files in mine.items()}
start = time.perf_counter()
part = own_checksums(root, records, mine)
own = time.perf_counter() - start
sent = len(pickle.dumps(part))
counts = {f: {} for f in folders}
for f, meta in metas.items():
    for t in meta.tensors:
        for c in t.chunks:
            counts[f][c.file] = counts[f].get(c.file, 0) + 1
chunks = {f: {name: "0123abcd" * n for name, n in files.items()} for f, files in counts.items()}
files = {f"{f}/{name}": (1, 0, None) for f, names in counts.items() for name in names}
start = time.perf_counter()
text = json.dumps(build_manifest(files, chunks, world_size=world, step=1), indent=1)
zero = time.perf_counter() - start
Path(out).write_text(f"{own} {sent} {zero} {len(text)}")
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
            build_apart(ckpt, ranks, layers=args.layers, data=True, **DIMS)
            folders = [ckpt / "pytorch_model_fsdp_0", ckpt / "optimizer_0"]
            meta = sum((f / ".metadata").stat().st_size for f in folders)
            anchor = run_usage([sys.executable, "-c", _TORCH, *map(str, folders)], ROOT)
            size_file = work / "manifest-figures"
            run_usage([sys.executable, "-c", _RANK, str(ckpt), "1", str(ranks),
                       str(size_file)], ROOT)
            own, sent, zero, size = size_file.read_text().split()
            rows.append((ranks, meta, anchor[0], float(own), int(sent), float(zero), int(size)))
    print(f"\nthe manifest of a {args.layers}-layer Llama's checkpoint (model + AdamW)")
    print(f"| {'ranks':>5} | {'.metadata':>10} | {'torch read':>10} | {'one rank':>9} | "
          f"{'it sends':>9} | {'rank 0':>7} | {'manifest':>9} | {'x .metadata':>11} |")
    print(f"|{'-' * 7}|{'-' * 12}|{'-' * 12}|{'-' * 11}|{'-' * 11}|{'-' * 9}|{'-' * 11}|"
          f"{'-' * 13}|")
    for ranks, meta, torch_read, own, sent, zero, size in rows:
        print(f"| {ranks:5} | {meta / 1e6:7.1f} MB | {torch_read:9.2f}s | {own * 1e3:6.1f} ms | "
              f"{sent / 1e3:6.1f} kB | {zero:6.2f}s | {size / 1e6:6.1f} MB | "
              f"{size / meta:10.2f}x |")


if __name__ == "__main__":
    main()
