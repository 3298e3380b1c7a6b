"""A complete training loop that saves with fsdpckpt's CheckpointManager and resumes exactly.

Run it in one process:           python docs/training_example.py /tmp/run
or on 2 ranks with FSDP2:        torchrun --nproc-per-node 2 docs/training_example.py /tmp/run
Run it again with the same folder and it resumes from the newest complete checkpoint.
"""

import os
import sys

import torch
import torch.distributed as dist

import fsdpckpt


def main(run_dir: str, total_steps: int = 6, save_every: int = 2) -> list[float]:
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")  # "nccl" on GPUs
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    # run_dir/checkpoint_{step}/, each committed only once complete; the 2 newest are kept.
    manager = fsdpckpt.CheckpointManager(run_dir, keep_last=2)
    last = manager.restore(**parts)  # the newest complete checkpoint, or None on a fresh run
    start = 0 if last is None else last + 1
    if last is not None:
        print(f"resumed from {manager.latest()} at step {start}")

    losses = []
    for step in range(start, total_steps):
        x = torch.randn(16, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % save_every == 0:
            manager.save(step, **parts)  # model, optimizer, scheduler and every rank's RNG
    manager.wait()  # with async_save=True: completes and commits the last save
    return losses


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "run"))
