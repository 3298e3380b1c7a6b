"""What the manifest and its digests cost a save, against raw ``dcp.save``.

Run by hand (not in CI):

    python benchmarks/save_digest.py                       # 16 x 2048x2048 fp32 + AdamW
    python benchmarks/save_digest.py --rounds 15 --dir /dev/shm

One process, one plain model of N layers of 2048x2048 fp32 (16 MiB each) after one AdamW
step: 256 MiB of parameters, 768 MiB written per save. Tools alternate within each round,
each writing a fresh folder (removed untimed before the next); median and best of the rounds.
``--dir /dev/shm`` (the default when it exists) writes to memory, so what is left is each
tool's own cost, not the disk's noise, which on this machine moves a save by up to 40%.

  - raw DCP: ``dcp.save`` of ``{"model": ...}`` and ``{"optimizer": ...}`` (the anchor);
  - ``save_state`` (default: the manifest with every file's CRC-32 and a checksum of itself);
  - ``save_state(manifest=False)``;
  - ``save_state(digest="sha256")`` and ``digest="blake2b"`` (every byte hashed as written).

Targets (issue 9): the default within 5% of raw DCP; the digests' cost measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description="manifest and digest cost of a save")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # DCP's "assuming a single process" on every save

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import fsdpckpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False)
                                  for _ in range(args.layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()

    def raw(path: str) -> None:
        dcp.save({"model": get_model_state_dict(model)},
                 checkpoint_id=f"{path}/pytorch_model_fsdp_0")
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=f"{path}/optimizer_0")

    tools = {
        "raw dcp.save": raw,
        "save_state (manifest, CRC-32)": lambda p: fsdpckpt.save_state(p, model, optimizer),
        "save_state(manifest=False)": lambda p: fsdpckpt.save_state(p, model, optimizer,
                                                                    manifest=False),
        'save_state(digest="sha256")': lambda p: fsdpckpt.save_state(p, model, optimizer,
                                                                     digest="sha256"),
        'save_state(digest="blake2b")': lambda p: fsdpckpt.save_state(p, model, optimizer,
                                                                      digest="blake2b"),
    }
    times: dict[str, list[float]] = {name: [] for name in tools}
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for _ in range(args.rounds + 1):  # the first round warms up, untimed
            for name, save in tools.items():
                path = f"{work}/ckpt"
                shutil.rmtree(path, ignore_errors=True)
                start = time.perf_counter()
                save(path)
                times[name].append(time.perf_counter() - start)
    anchor = statistics.median(times["raw dcp.save"][1:])
    best = min(times["raw dcp.save"][1:])
    print(f"{args.layers} x 2048x2048 fp32 + AdamW, one process, writing to {args.dir or 'tmp'};"
          f" median and best of {args.rounds} rounds")
    print(f"{'what':32} {'median s':>9} {'vs raw':>7} {'best s':>8} {'vs raw':>7}")
    for name, values in times.items():
        median, low = statistics.median(values[1:]), min(values[1:])
        print(f"{name:32} {median:9.3f} {median / anchor:6.3f}x {low:8.3f} {low / best:6.3f}x")


if __name__ == "__main__":
    sys.exit(main())
