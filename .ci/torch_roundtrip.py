"""A checkpoint written on one torch, read bit-exact on another: CI's proof across versions.

``python .ci/torch_roundtrip.py write OUT`` runs under the torch being proven (the declared
floor, the newest release). On 2 ranks (gloo, CPU) it trains a small mixed-dtype model one
step and saves model, optimizer and scheduler with ``fsdpckpt.save_state``: sharded with
FSDP1, and with FSDP2 where that torch runs it on CPU (not 2.6). Beside each checkpoint,
outside it, it stores the writer's own reading of it: ``dcp_to_torch_save`` of each DCP
folder, its tensors as ``reference.safetensors`` (a format no torch version changes) and its
other leaves as ``reference.json``.

``python .ci/torch_roundtrip.py check OUT`` runs under the main torch and requires, for each
checkpoint, that every verb reads what the writer read, byte for byte:
``fsdpckpt verify``; ``load_full_state_dict`` of each DCP folder; ``fsdpckpt merge``'s
``model.safetensors``; torch's own ``dcp_to_torch_save``; and ``load_state`` into the same
model, unsharded, in one process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

FOLDERS = ("pytorch_model_fsdp_0", "optimizer_0")


class Net(nn.Module):
    """Two dtypes of parameter (float32, bfloat16), a float16 and an int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8).to(torch.bfloat16)
        self.register_buffer("scale", torch.linspace(0.5, 2, 8, dtype=torch.float16))
        self.register_buffer("count", torch.arange(5, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.a(x)).to(torch.bfloat16)
        return self.b(hidden).float() * self.scale.float()


def _trained(kind: str) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model: nn.Module = Net()
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                         use_orig_params=True, device_id=torch.device("cpu"))
        FullyShardedDataParallel.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    else:
        from torch.distributed.fsdp import fully_shard  # torch 2.6 has it here too

        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    torch.manual_seed(1)
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _rank(rank: int, rendezvous: str, out: str, kind: str) -> None:
    import torch.distributed as dist

    import fsdpckpt

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    try:
        model, optimizer, scheduler = _trained(kind)
        fsdpckpt.save_state(Path(out) / kind / "checkpoint", model, optimizer, scheduler, step=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo may abort this process as it exits (torch 2.13 does, about one exit in six), so
    # success is this file, not the exit status.
    (Path(out) / f"{kind}.rank{rank}.done").write_text("ok")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as one level, keys joined by '/' (what differs is named)."""
    flat: dict[str, Any] = {}
    stack = [(prefix, value)]
    while stack:
        key, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{key}/{k}", v) for k, v in item.items())
        elif isinstance(item, (list, tuple)) and any(
                isinstance(v, (dict, list, tuple, torch.Tensor)) for v in item):
            stack.extend((f"{key}/{i}", v) for i, v in enumerate(item))
        else:
            flat[key] = list(item) if isinstance(item, tuple) else item
    return flat


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def _split(flat: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in flat.items() if k not in tensors}


def write(out: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out.mkdir(parents=True)
    kinds = ["fsdp1", "fsdp2"]
    if torch.__version__.startswith("2.6."):  # FSDP2's CPU stream lacks record_event there
        print(f"roundtrip: torch {torch.__version__} runs no FSDP2 on CPU; FSDP1 only")
        kinds.remove("fsdp2")
    context = mp.get_context("spawn")
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            procs = [context.Process(target=_rank, args=(r, f"{tmp}/rdv", str(out), kind))
                     for r in range(2)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(timeout=300)
                if proc.is_alive():
                    proc.kill()
        if not all((out / f"{kind}.rank{r}.done").is_file() for r in range(2)):
            sys.exit(f"roundtrip: the {kind} save on torch {torch.__version__} failed "
                     f"(exit codes {[p.exitcode for p in procs]})")
        for folder in FOLDERS:
            dcp_to_torch_save(out / kind / "checkpoint" / folder, out / kind / f"{folder}.pt")
            state = torch.load(out / kind / f"{folder}.pt", weights_only=True)
            (out / kind / f"{folder}.pt").unlink()
            tensors, others = _split(_flat(state))
            save_file(tensors, str(out / kind / f"{folder}.reference.safetensors"))
            (out / kind / f"{folder}.reference.json").write_text(json.dumps(others, indent=1))
        (out / kind / "torch.txt").write_text(torch.__version__)
        print(f"roundtrip: torch {torch.__version__} wrote {out / kind}")


def _same(got: dict[str, Any], tensors: dict[str, torch.Tensor], others: dict[str, Any],
          what: str) -> None:
    got_tensors, got_others = _split(got)
    if got_tensors.keys() != tensors.keys():
        sys.exit(f"roundtrip: {what}: tensor keys differ: "
                 f"{sorted(got_tensors.keys() ^ tensors.keys())}")
    for key, expected in tensors.items():
        value = got_tensors[key]
        if (value.dtype != expected.dtype or value.shape != expected.shape
                or value.reshape(-1).view(torch.uint8).tolist()
                != expected.reshape(-1).view(torch.uint8).tolist()):
            sys.exit(f"roundtrip: {what}: {key} differs from the writer's reading")
    if json.loads(json.dumps(got_others)) != others:
        sys.exit(f"roundtrip: {what}: non-tensor entries differ: {got_others} != {others}")


def check(out: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import fsdpckpt

    kinds = sorted(p.name for p in out.iterdir() if (p / "torch.txt").is_file())
    if not kinds:
        sys.exit(f"roundtrip: {out} holds no checkpoint to check")
    for kind in kinds:
        refs = out / kind
        root = refs / "checkpoint"
        writer = (refs / "torch.txt").read_text()
        verb = [sys.executable, "-m", "fsdpckpt"]
        subprocess.run([*verb, "verify", str(root)], check=True, stdout=subprocess.DEVNULL)
        merged = Path(tempfile.mkdtemp()) / "merged"
        subprocess.run([*verb, "merge", str(root), str(merged)], check=True,
                       stdout=subprocess.DEVNULL)
        torch_read = "dcp_to_torch_save"
        for folder in FOLDERS:
            tensors = load_file(str(refs / f"{folder}.reference.safetensors"))
            others = json.loads((refs / f"{folder}.reference.json").read_text())
            _same(_flat(fsdpckpt.load_full_state_dict(root / folder)), tensors, others,
                  f"load_full_state_dict of {writer}'s {kind}/{folder}")
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    dcp_to_torch_save(root / folder, f"{tmp}/full.pt")
                except (Exception, CheckpointException) as exc:  # a BaseException
                    if _release(writer) <= _release(torch.__version__):
                        raise
                    # torch reads no newer torch's metadata (2.15 pickles TensorProperties
                    # with strides; 2.13's __setstate__ takes 5 fields): fsdpckpt does, above.
                    print(f"roundtrip: torch {torch.__version__}'s own dcp_to_torch_save "
                          f"cannot read torch {writer}'s {kind}/{folder} "
                          f"({type(exc).__name__}); fsdpckpt reads it")
                    torch_read = "not torch's dcp_to_torch_save"
                    continue
                _same(_flat(torch.load(f"{tmp}/full.pt", weights_only=True)), tensors, others,
                      f"torch {torch.__version__}'s dcp_to_torch_save of {writer}'s "
                      f"{kind}/{folder}")
        model_tensors = load_file(str(refs / "pytorch_model_fsdp_0.reference.safetensors"))
        as_merged = {k.removeprefix("/model/"): v for k, v in model_tensors.items()}
        _same(load_file(str(merged / "model.safetensors")), as_merged, {},
              f"merge of {writer}'s {kind}")
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        fsdpckpt.load_state(root, model, optimizer, scheduler)
        _same(dict(model.state_dict()), as_merged, {}, f"load_state of {writer}'s {kind}")
        optimizer_tensors = load_file(str(refs / "optimizer_0.reference.safetensors"))
        for name, param in model.named_parameters():
            for field, value in optimizer.state[param].items():
                saved = optimizer_tensors[f"/optimizer/state/{name}/{field}"]
                _same({field: value}, {field: saved}, {},
                      f"load_state of {writer}'s {kind}: the optimizer's {name}")
        if scheduler.last_epoch != 1:
            sys.exit(f"roundtrip: load_state of {writer}'s {kind}: scheduler at "
                     f"{scheduler.last_epoch}, saved at 1")
        print(f"roundtrip: torch {torch.__version__} read torch {writer}'s {kind} checkpoint "
              f"bit-exact ({len(model_tensors)} model tensors; verify, load_full_state_dict, "
              f"merge, load_state; {torch_read})")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        sys.exit("usage: torch_roundtrip.py write|check FOLDER")
    (write if sys.argv[1] == "write" else check)(Path(sys.argv[2]))
