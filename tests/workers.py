"""Functions the multi-rank tests run on each rank (module level, so ranks can import them)."""

from __future__ import annotations

import random

import numpy as np
import torch

import fsdpckpt


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))


def wrap(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    if kind == "fsdp1-grad-op":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                    sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model


def _batch():
    # Draws on all three RNGs, so a resume that restored any of them wrongly diverges.
    scale = 1.0 + random.random()
    shift = float(np.random.rand())
    x = torch.randn(4, 8) * scale + shift
    return x, torch.randn(4, 3)


def _local(tree):
    """Sharded state as plain tensors: each rank's own shard (ShardedTensor / DTensor)."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_local(v) for v in tree]
    if hasattr(tree, "local_shards"):
        return tree.local_shards()[0].tensor.clone()
    if hasattr(tree, "to_local"):
        return tree.to_local().clone()
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def full_state(model, optimizer) -> tuple[dict, dict]:
    """Full parameters and this rank's shard of the optimizer state, as plain values."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        # torch 2.13 segfaults gathering a full FSDP1 state dict on CPU; summon instead.
        from fsdpckpt.merging._keys import clean_key

        with FSDP.summon_full_params(model, writeback=False):
            params = {clean_key(n): p.detach().clone() for n, p in model.named_parameters()}
        return params, _local(get_optimizer_state_dict(model, optimizer))
    params = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    return ({k: v.clone() for k, v in params.items()},
            _local(get_optimizer_state_dict(model, optimizer)))


def train(rank: int, world: int, kind: str, ckpt: str, steps: int, save_at: int | None,
          resume: bool) -> dict:
    """Train ``steps`` steps; save after step ``save_at`` and stop there, or resume from
    ``ckpt``."""
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    model = wrap(make_model(), kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    start, losses, info = 0, [], {}
    if resume:
        result = fsdpckpt.load_state(ckpt, model, optimizer, scheduler)
        start = result.step + 1
        info = {"restored": result.restored, "warnings": result.warnings}
    for step in range(start, steps):
        x, y = _batch()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        if step == save_at:
            fsdpckpt.save_state(ckpt, model, optimizer, scheduler, step=step)
            break
    params, optim = full_state(model, optimizer)
    return {"losses": losses, "params": params, "optim": optim, "lr": scheduler.get_last_lr(),
            **info}


def load_into(rank: int, world: int, kind: str, ckpt: str) -> dict:
    """Load ``ckpt`` into a fresh model, AdamW and StepLR of this kind; return the full states."""
    model = wrap(make_model(), kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    result = fsdpckpt.load_state(ckpt, model, optimizer, scheduler)
    params, optim = full_state(model, optimizer)
    return {"params": params, "optim": optim, "step": result.step, "warnings": result.warnings}


def _accelerator():
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    # Accelerate runs FSDP only for GPU kinds; this makes it run FSDP2 with gloo on the CPU.
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    return Accelerator(fsdp_plugin=plugin, cpu=True)


def accelerate_loads_ours(rank: int, world: int, ckpt: str) -> dict:
    """Save with fsdpckpt (FSDP2), then load with a fresh Accelerator's load_state."""
    steps = train(rank, world, "fsdp2", ckpt, steps=3, save_at=1, resume=False)
    accelerator = _accelerator()
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state(ckpt)
    params, optim = full_state(model, optimizer)
    return {"saved": steps, "params": params, "optim": optim, "sched": scheduler.state_dict()}


def we_load_accelerates(rank: int, world: int, ckpt: str) -> dict:
    """Train and save with Accelerate (FSDP2), then load with fsdpckpt.load_state."""
    accelerator = _accelerator()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for _ in range(2):
        x, y = _batch()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    saved_params, saved_optim = full_state(model, optimizer)
    saved_sched = scheduler.state_dict()
    accelerator.save_state(ckpt)
    accelerator.wait_for_everyone()  # save_state has no barrier after the per-rank files
    fresh = wrap(make_model(), "fsdp2")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    result = fsdpckpt.load_state(ckpt, fresh, fresh_opt, fresh_sched)
    params, optim = full_state(fresh, fresh_opt)
    return {"saved": (saved_params, saved_optim, saved_sched), "params": params, "optim": optim,
            "sched": fresh_sched.state_dict(), "restored": result.restored}


def async_save_while_training(rank: int, world: int, ckpt: str) -> dict:
    """Save asynchronously, keep training (FSDP collectives) while it writes, then wait."""
    model = wrap(make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = _batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    saved, _ = full_state(model, optimizer)
    handle = fsdpckpt.save_state(ckpt, model, optimizer, step=1, async_save=True)
    for _ in range(2):  # training goes on while the checkpoint is written
        x, y = _batch()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    handle.wait()
    return {"saved": saved, "done": handle.done()}


def save_forever(rank: int, world: int, root: str, log: str) -> None:
    """Train a small FSDP2 model and save every step through a CheckpointManager, until killed.

    After each save returns, rank 0 appends the step to ``log`` (fsynced): the steps the
    test can rely on being committed.
    """
    import os

    model = wrap(make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    manager = fsdpckpt.CheckpointManager(root, keep_last=3)
    last = manager.restore(model=model, optimizer=optimizer)
    step = 0 if last is None else last + 1  # a restored step 0 is resumed, not saved again
    with open(log, "a") as out:
        out.write("started\n")
        out.flush()
        while True:
            x, y = _batch()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.save(step, model=model, optimizer=optimizer)
            if rank == 0:
                out.write(f"{step}\n")
                out.flush()
                os.fsync(out.fileno())
            step += 1


def restore_latest(rank: int, world: int, root: str) -> int | None:
    model = wrap(make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    return fsdpckpt.CheckpointManager(root, keep_last=3).restore(model=model, optimizer=optimizer)


def save_into_a_full_disk(rank: int, world: int, ckpt: str, failing_rank: int) -> list:
    """save_state where one rank's disk is full when it writes its RNG file (cut at 4096
    bytes, then ENOSPC, as a full disk does); what each rank raised."""
    import errno
    from pathlib import Path

    from fsdpckpt.training import state

    if rank == failing_rank:
        def short_write(path, data, *, sync=True):
            Path(path).write_bytes(data[:4096])
            raise OSError(errno.ENOSPC, "No space left on device")

        state.put_bytes = short_write
    model = wrap(make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    try:
        fsdpckpt.save_state(ckpt, model, optimizer, step=1)
    except fsdpckpt.FsdpCkptError as exc:
        return [type(exc).__name__, str(exc)]
    return []


def save_like_verl_fsdp1(rank: int, world: int, ckpt: str, use_orig_params: bool) -> None:
    """An FSDP1 step saved as VeRL's ``FSDPCheckpointManager`` saves it: the model's
    SHARDED_STATE_DICT and ``optimizer.state_dict()`` (the rank's own flat-parameter state)
    with ``torch.save``, one file each per rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    model = FSDP(make_model(), device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(rank)
    x, y = _batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        torch.save(model.state_dict(), f"{ckpt}/model_world_size_{world}_rank_{rank}.pt")
    torch.save(optimizer.state_dict(), f"{ckpt}/optim_world_size_{world}_rank_{rank}.pt")


def run_example(rank: int, world: int, root: str, pretrained: str, run_dir: str,
                steps: int) -> list[float]:
    """docs/run_example.py's main on this rank: its losses; the final model in run_dir-final."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_example", f"{root}/docs/run_example.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(pretrained, run_dir, f"{run_dir}-final", total_steps=steps)
