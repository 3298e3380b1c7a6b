"""The whole life of a run: start from Hugging Face weights, train with checkpoints, resume,
and write a model that transformers' from_pretrained loads.

Run it in one process:     python docs/run_example.py PRETRAINED RUN_DIR FINAL
or on 2 ranks with FSDP2:  torchrun --nproc-per-node 2 docs/run_example.py PRETRAINED RUN_DIR FINAL
Run it again with the same run folder and it resumes from the newest complete checkpoint.
"""

import os
import sys

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import fsdpckpt


def build(pretrained: str) -> LlamaForCausalLM:
    """The model, sharded before any weight exists: no rank ever holds the whole of it."""
    config = LlamaConfig.from_pretrained(pretrained)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device="cpu")  # memory for this rank's shards, holding garbage so far
    model.tie_weights()  # to_empty gives each module its own tensor: tie them again
    # Buffers no checkpoint holds (the rotary frequencies): load_pretrained sets them as
    # from_pretrained does, but a resume (restore) leaves them as the model holds them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model


def data(vocab_size: int, rank: int) -> StatefulDataLoader:
    """This rank's batches of token ids (random ones here: your dataset in a real run)."""
    tokens = torch.randint(0, vocab_size, (64, 16), generator=torch.Generator().manual_seed(rank))
    return StatefulDataLoader(tokens, batch_size=4, shuffle=True,
                              generator=torch.Generator().manual_seed(rank))


def main(pretrained: str, run_dir: str, final: str, total_steps: int = 6,
         save_every: int = 2) -> list[float]:
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build(pretrained)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = data(model.config.vocab_size, rank)
    parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "dataloader": loader}

    manager = fsdpckpt.CheckpointManager(run_dir, keep_last=2)
    last = manager.restore(**parts)  # the newest complete checkpoint, or None
    if last is None:
        # A fresh run starts from the pretrained weights: each rank reads its own shards.
        fsdpckpt.load_pretrained(model, pretrained)
    start = 0 if last is None else last + 1

    losses = []
    batches = iter(loader)
    for step in range(start, total_steps):
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % save_every == 0:
            manager.save(step, **parts)  # the loader's position too: the resume sees new data
    manager.wait()
    # The model people run: Hugging Face names, config and tokenizer from the pretrained
    # folder; every rank writes its own shards' bytes, nothing is gathered.
    fsdpckpt.save_pretrained(model, final, base=pretrained, overwrite=True)
    return losses


if __name__ == "__main__":
    print(main(*(sys.argv[1:4] or ["tiny-llama", "llama-run", "tiny-llama-tuned"])))
