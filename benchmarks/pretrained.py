"""Hugging Face weights into and out of a 2-rank FSDP2 model: fsdpckpt against the anchors.

Run by hand (not in CI):

    python benchmarks/pretrained.py                     # ~155 MB and ~620 MB models, 5 rounds
    python benchmarks/pretrained.py --quick             # the small model only
    python benchmarks/pretrained.py --json out.json --dir /dev/shm

For each size, a Llama with random weights (``transformers.LlamaConfig``, fp32, untied) is
written once as a Hugging Face folder (``save_pretrained(max_shard_size="200MB")``: the small
one a single ``model.safetensors``, the large one shards plus an index). Two ranks (gloo, CPU)
build the same model on the meta device, ``fully_shard`` each decoder layer and the root, and
``to_empty()`` it on the CPU. Then, tools alternating in each round, barrier to barrier:

load (the parameters zeroed, untimed, before each):
  - rank-0 read + broadcast (anchor): rank 0 reads every safetensors file whole, then
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (Accelerate's
    ``fsdp2_load_full_state_dict``, transformers' ``fsdp_cpu_ram_efficient_loading``)
  - torch DCP ``HuggingFaceStorageReader`` (anchor): ``dcp.load`` into the sharded state
    dict of ``get_model_state_dict``, then ``set_model_state_dict`` (torchtitan's initial load)
  - ``fsdpckpt.load_pretrained(model, folder)``, when this fsdpckpt has it
save (from the loaded model, into a fresh folder each time; ``sync`` untimed before each):
  - full gather + ``save_pretrained`` (anchor): ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)``, then rank 0 ``model.save_pretrained(out, state_dict=full)``
  - torch DCP ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``
    (anchor): ``dcp.save`` of the sharded state dict, consolidated into one file
  - ``fsdpckpt.save_pretrained(model, out)``, when this fsdpckpt has it

Each figure: the median wall time of the rounds, and each rank's peak RSS growth during the
call (the most over the rounds): the peak (``VmHWM``, reset through ``/proc/self/clear_refs``
before the call; a 2 ms sampler thread where the kernel refuses) less the RSS just before it,
after ``gc`` and ``malloc_trim``, the model's own memory already touched. MB = 2**20 bytes.
Ratios are against the faster anchor of the same side, measured in the same run. The first
round also checks the bytes: after each load, every rank's shards against the broadcast
anchor's; after each save, every tensor of the written files against the source folder's.
Targets (issue 19): fsdpckpt's growth <= 128 MB on every rank, and no slower than the faster
anchor.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

# name -> (LlamaConfig arguments); fp32, untied, random weights.
SIZES = {
    "small": dict(vocab_size=24576, hidden_size=512, intermediate_size=1536,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8),
    "large": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                  num_hidden_layers=7, num_attention_heads=16, num_key_value_heads=16),
}
SOURCE_SHARD = "200MB"
LOAD = ("rank-0 read + broadcast", "DCP HuggingFaceStorageReader", "fsdpckpt.load_pretrained")
SAVE = ("full gather + save_pretrained", "DCP HuggingFaceStorageWriter (consolidated)",
        "fsdpckpt.save_pretrained")
ANCHORS = set(LOAD[:2] + SAVE[:2])
_MB = 2**20


# ---- memory -------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Peak:
    """Peak RSS growth of this process over a window: VmHWM reset by clear_refs, else sampled."""

    def __init__(self) -> None:
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc: no malloc_trim, the baseline may include freed memory
            self._libc = None
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)  # freed arenas of an earlier tool would hide growth
        self._base = _status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            self._hwm = True
        except OSError:
            self._hwm = False
            self._sampled = self._base
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._sampled = max(self._sampled, _status_kb("VmRSS"))

    def stop(self) -> float:
        """MB of growth since start()."""
        if self._hwm:
            peak = _status_kb("VmHWM")
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            peak = max(self._sampled, _status_kb("VmRSS"))
        return (peak - self._base) * 1024 / _MB


# ---- the ranks -----------------------------------------------------------------------------

def _rank(rank: int, world: int, port: int, sizes: dict, rounds: int, work: str,
          result: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    import fsdpckpt

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    peak = Peak()

    def build(config: dict) -> torch.nn.Module:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                tie_word_embeddings=False, **config))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model.to_empty(device="cpu")

    def zero(model: torch.nn.Module) -> None:
        # Touches every page of the shards, so their first write is not counted as growth,
        # and makes a load that loads nothing visible to the check below.
        with torch.no_grad():
            for t in model.state_dict().values():
                t.to_local().zero_()

    def hashed(t: torch.Tensor) -> int:
        if t.numel() == 0:  # a rank's shard of a tensor smaller than the world
            return 0
        return int(torch.hash_tensor(t.contiguous()).reshape(1).view(torch.int64).item())

    def shard_digest(model: torch.nn.Module) -> list[int]:
        return [hashed(t.to_local()) for t in model.state_dict().values()]

    def file_digests(folder: Path) -> dict[str, int]:
        digests = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    digests[key] = hashed(f.get_tensor(key))
        return digests

    def broadcast(model, folder: Path) -> None:
        full: dict = {}
        if rank == 0:
            for path in sorted(folder.glob("*.safetensors")):
                full.update(load_file(str(path)))
        set_model_state_dict(model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def hf_reader(model, folder: Path) -> None:
        state = get_model_state_dict(model)
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
        set_model_state_dict(model, state)

    def gather_save(model, out: Path) -> None:
        full = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(str(out), state_dict=full)

    def hf_writer(model, out: Path) -> None:
        dcp.save(get_model_state_dict(model), storage_writer=dcp.HuggingFaceStorageWriter(
            str(out), save_distributed=True, enable_consolidation=True))

    loads = {LOAD[0]: broadcast, LOAD[1]: hf_reader}
    saves = {SAVE[0]: gather_save, SAVE[1]: hf_writer}
    if hasattr(fsdpckpt, "load_pretrained"):
        loads[LOAD[2]] = lambda model, folder: fsdpckpt.load_pretrained(model, str(folder))
    if hasattr(fsdpckpt, "save_pretrained"):
        saves[SAVE[2]] = lambda model, out: fsdpckpt.save_pretrained(model, str(out))

    def timed(fn, *args) -> tuple[float, float]:
        dist.barrier()
        peak.start()
        dist.barrier()
        start = time.perf_counter()
        fn(*args)
        dist.barrier()
        return time.perf_counter() - start, peak.stop()

    def all_ok(flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    report = []
    for name, (config, folder) in sizes.items():
        folder = Path(folder)
        model = build(config)
        runs: dict[str, list[tuple[float, float]]] = {}
        same: dict[str, bool] = {}
        reference = None
        for r in range(rounds):
            for label, fn in loads.items():
                zero(model)
                runs.setdefault(label, []).append(timed(fn, model, folder))
                if r == 0:
                    digest = shard_digest(model)
                    reference = reference or digest
                    same[label] = all_ok(digest == reference)
        source = file_digests(folder) if rank == 0 else {}
        for r in range(rounds):
            for label, fn in saves.items():
                out = Path(work) / f"{name}-{SAVE.index(label)}-{r}"
                if rank == 0:
                    os.sync()  # no save pays for the write-back of the one before it
                runs.setdefault(label, []).append(timed(fn, model, out))
                if r == 0:
                    same[label] = all_ok(rank != 0 or file_digests(out) == source)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(out, ignore_errors=True)
        # Every rank's growth, all rounds: [tool, round] on each rank, gathered.
        labels = list(runs)
        growth = torch.tensor([[g for _, g in runs[lb]] for lb in labels], dtype=torch.float64)
        every = [torch.zeros_like(growth) for _ in range(world)]
        dist.all_gather(every, growth)
        params = sum(p.numel() for p in model.parameters())  # DTensor: the global count
        report.append({
            "size": name, "config": config, "params": params, "bytes": params * 4,
            "source_files": len(list(folder.glob("*.safetensors"))),
            "tools": [{
                "name": lb, "side": "load" if lb in LOAD else "save", "anchor": lb in ANCHORS,
                "seconds": statistics.median(w for w, _ in runs[lb]),
                "runs_seconds": [w for w, _ in runs[lb]],
                "rss_growth_mb": [float(e[i].max()) for e in every],
                "same_bytes": same[lb],
            } for i, lb in enumerate(labels)],
        })
        del model
        gc.collect()
    if rank == 0:
        Path(result).write_text(json.dumps(report))
    dist.destroy_process_group()


# ---- the parent ----------------------------------------------------------------------------

def _write_sources(work: Path, names: list[str]) -> dict[str, tuple[dict, str]]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    sizes = {}
    for name in names:
        folder = work / f"source-{name}"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            tie_word_embeddings=False, **SIZES[name]))
        model.save_pretrained(str(folder), max_shard_size=SOURCE_SHARD)
        del model
        sizes[name] = (SIZES[name], str(folder))
    gc.collect()
    return sizes


def _table(doc: dict) -> str:
    lines = []
    for size in doc["sizes"]:
        lines.append(
            f"\nLlama {size['bytes'] / 1e6:.0f} MB fp32 ({size['params'] / 1e6:.1f} M params, "
            f"{size['source_files']} source file(s)), {doc['ranks']} ranks, gloo, CPU, "
            f"median of {doc['rounds']} rounds")
        lines.append(f"{'side':5} {'what':52} {'seconds':>8} {'x faster anchor':>16} "
                     f"{'RSS growth MB per rank':>23} {'bytes':>6}")
        for tool in size["tools"]:
            growth = " / ".join(f"{g:.0f}" for g in tool["rss_growth_mb"])
            name = tool["name"] + (" (anchor)" if tool["anchor"] else "")
            lines.append(f"{tool['side']:5} {name:52} {tool['seconds']:8.3f} "
                         f"{tool['ratio']:15.2f}x {growth:>23} "
                         f"{'same' if tool['same_bytes'] else 'DIFF':>6}")
        for tool in size["tools"]:
            if not tool["anchor"]:
                lines.append(
                    f"target, {tool['name']}: growth <= 128 MB on every rank: "
                    f"{'met' if max(tool['rss_growth_mb']) <= 128 else 'MISSED'}; "
                    f"no slower than the faster anchor: "
                    f"{'met' if tool['ratio'] <= 1.0 else 'MISSED'} ({tool['ratio']:.2f}x)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="load_pretrained / save_pretrained against rank-0 broadcast, full "
                    "gather and DCP's HuggingFace reader and writer (2 ranks, gloo, CPU)")
    parser.add_argument("--quick", action="store_true", help="the small model only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None,
                        help="where to write (default: the system's temporary folder)")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp
    import transformers

    names = ["small"] if args.quick else ["small", "large"]
    ranks = 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fsdpckpt-bench-pretrained-") as tmp:
        work = Path(tmp)
        sizes = _write_sources(work, names)
        os.makedirs(work / "out")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        result = work / "result.json"
        mp.start_processes(_rank, args=(ranks, port, sizes, args.rounds, str(work / "out"),
                                        str(result)), nprocs=ranks, start_method="spawn")
        report = json.loads(result.read_text())
    for size in report:
        for side in ("load", "save"):
            tools = [t for t in size["tools"] if t["side"] == side]
            fastest = min(t["seconds"] for t in tools if t["anchor"])
            for t in tools:
                t["ratio"] = t["seconds"] / fastest
    doc = {
        "benchmark": "pretrained", "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "ranks": ranks, "rounds": args.rounds, "dir": args.dir or tempfile.gettempdir(),
        "sizes": report, "total_seconds": time.perf_counter() - started,
    }
    print(_table(doc))
    print(f"\nwhole run: {doc['total_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    sys.exit(main())
