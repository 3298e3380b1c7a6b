"""A complete training loop that saves with fsdpckpt and resumes exactly.

Run it in one process:           python docs/training_example.py /tmp/run
or on 2 ranks with FSDP2:        torchrun --nproc-per-node 2 docs/training_example.py /tmp/run
Run it again with the same folder and it resumes from the newest checkpoint.
"""

import os
import sys
from pathlib import Path

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

    start = 0
    checkpoints = sorted(Path(run_dir).glob("step_*"), key=lambda p: int(p.name[5:]))
    if checkpoints:
        result = fsdpckpt.load_state(checkpoints[-1], model, optimizer, scheduler)
        start = result.step + 1
        print(f"resumed from {checkpoints[-1]} at step {start}; restored {result.restored}")

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
            fsdpckpt.save_state(f"{run_dir}/step_{step}", model, optimizer, scheduler, step=step)
    return losses


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "run"))
