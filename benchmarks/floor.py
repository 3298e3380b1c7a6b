"""What one core of this machine can move, check and cast per second: the floor under every path.

Run by hand (not in CI):

    python benchmarks/floor.py                 # 256 MiB of float32, 5 rounds
    python benchmarks/floor.py --mib 1024 --rounds 3 --json

Each figure is the median of ``--rounds`` passes over the same buffer (or file, page cache
warm), one core, in this process, in the block sizes the merge uses (16 MiB reads, 1 MiB
checked blocks, 256 KiB cast pieces). What a merge does per byte is a sum of these steps,
so a path's time over its bytes divided by the sum of its steps' times says how far from
its floor it is:

  - ``copy``: a memory-to-memory copy (``memoryview`` slice assignment, a ``memcpy``);
  - ``crc32``: ``zlib.crc32`` over 1 MiB blocks (the check of every byte read), and the
    CRC-32 fsdpckpt uses (ISA-L's where ``isal`` is installed: ``fsdpckpt[fast]``);
  - ``read (page cache)``: ``os.preadv`` of a warm file into a reused buffer;
  - ``write (page cache)``: ``os.pwrite`` into a fresh file (no ``fsync``);
  - ``copy_file_range``: the kernel's file-to-file copy (the unchecked dim-0 merge);
  - ``fsync`` of what was written, apart (a durable copy pays it once);
  - ``bf16 cast (numpy)``: fsdpckpt's torch-free fp32 -> bf16 cast, per 256 KiB piece;
  - ``bf16 cast (torch)``: ``Tensor.copy_`` into a bfloat16 tensor, per 16 MiB block;
  - ``strided gather (torch)``: a column-major 4096x4096 float32 block made contiguous
    (what a transposed chunk costs before any byte is written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_BLOCK = 16 * 2**20
_CHECK = 2**20


def _rate(size: int, run: Callable[[], None], rounds: int) -> float:
    """Median GB/s (decimal) of ``run`` over ``size`` bytes."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


def measure(mib: int, rounds: int) -> dict[str, float]:
    """Every floor figure, in GB/s of the input bytes."""
    import torch

    from fsdpckpt._io.checksums import crc32 as fast_crc32
    from fsdpckpt.merging._casts import cast_block

    size = mib * 2**20
    source = bytearray(os.urandom(_BLOCK)) * (size // _BLOCK)
    target = bytearray(size)
    src, dst = memoryview(source), memoryview(target)
    half = bytearray(size // 2)
    figures: dict[str, float] = {}

    def copy() -> None:
        for at in range(0, size, _BLOCK):
            dst[at:at + _BLOCK] = src[at:at + _BLOCK]

    def crc() -> None:
        value = 0
        for at in range(0, size, _CHECK):
            value = zlib.crc32(src[at:at + _CHECK], value)

    def crc_fast() -> None:
        value = 0
        for at in range(0, size, _CHECK):
            value = fast_crc32(src[at:at + _CHECK], value)

    def cast_numpy() -> None:
        out = memoryview(half)
        for at in range(0, size, _BLOCK):
            cast_block("float32", "bfloat16", src[at:at + _BLOCK],
                       out[at // 2:(at + _BLOCK) // 2])

    floats = torch.frombuffer(source, dtype=torch.float32)
    halves = torch.frombuffer(half, dtype=torch.bfloat16)

    def cast_torch() -> None:
        step = _BLOCK // 4
        for at in range(0, floats.numel(), step):
            halves[at:at + step].copy_(floats[at:at + step])

    square = torch.frombuffer(source, dtype=torch.float32)[:4096 * 4096].view(4096, 4096)
    column_major = square.t()
    flat = torch.empty(4096, 4096)

    def gather() -> None:
        flat.copy_(column_major)

    torch.set_num_threads(1)
    figures["copy"] = _rate(size, copy, rounds)
    figures["crc32"] = _rate(size, crc, rounds)
    if fast_crc32 is not zlib.crc32:
        figures["crc32 (ISA-L, fsdpckpt's with [fast])"] = _rate(size, crc_fast, rounds)
    figures["bf16 cast (numpy)"] = _rate(size, cast_numpy, rounds)
    figures["bf16 cast (torch)"] = _rate(size, cast_torch, rounds)
    figures["strided gather (torch)"] = _rate(4096 * 4096 * 4, gather, rounds)
    figures.update(_files(src, size, rounds))
    return figures


def _files(src: memoryview, size: int, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as work:
        first, second = Path(work) / "a", Path(work) / "b"
        first.write_bytes(src)
        os.sync()
        buffer = memoryview(bytearray(_BLOCK))
        fd = os.open(first, os.O_RDONLY)

        def read() -> None:
            for at in range(0, size, _BLOCK):
                os.preadv(fd, [buffer], at)

        def write(call: int = _BLOCK) -> None:
            out = os.open(second, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                for at in range(0, size, call):
                    os.pwrite(out, src[at:at + call], at)
            finally:
                os.close(out)

        def kernel_copy() -> None:
            out = os.open(second, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                done = 0
                while done < size:
                    done += os.copy_file_range(fd, out, size - done, done, done)
            finally:
                os.close(out)

        def durable() -> None:
            write()
            out = os.open(second, os.O_WRONLY)
            start = time.perf_counter()
            os.fsync(out)
            os.close(out)
            fsyncs.append(time.perf_counter() - start)

        fsyncs: list[float] = []
        try:
            figures = {"read (page cache)": _rate(size, read, rounds),
                       "write (page cache)": _rate(size, write, rounds),
                       "write (page cache, 256 KiB calls as fsdpckpt's)":
                           _rate(size, lambda: write(256 * 2**10), rounds),
                       "copy_file_range": _rate(size, kernel_copy, rounds)}
            for _ in range(rounds):
                durable()
            figures["fsync"] = size / statistics.median(fsyncs) / 1e9
        finally:
            os.close(fd)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes per pass, in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args()
    figures = measure(max(16, args.mib // 16 * 16), args.rounds)
    if args.json:
        print(json.dumps(figures))
        return
    for name, rate in figures.items():
        print(f"{name:<24} {rate:6.2f} GB/s")


if __name__ == "__main__":
    main()
