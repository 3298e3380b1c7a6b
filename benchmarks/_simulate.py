"""Simulated checkpoints of a large FSDP2 run: metadata from torch's own classes, sparse data.

No training: the ``.metadata`` of each folder is ``pickle.dump`` of torch's
``Metadata``, built from ``TensorStorageMetadata``, ``ChunkStorageMetadata``,
``MetadataIndex`` and ``_StorageInfo`` exactly as ``FileSystemWriter.finish`` writes them
(rank 0 gathers every rank's plan and write results, so each rank's ``MetadataIndex`` names
its own copy of the key). The ``__{rank}_0.distcp`` files are sparse (``truncate``) to the
sizes the metadata gives: they cost no disk, and nothing that reads only metadata can tell.
With ``data=True`` they hold real ``torch.save`` archives instead, as DCP's writer appends
them (each tensor ``arange``-filled, so every chunk's bytes differ): small runs that read
data, where what counts is how many files and chunks there are, not how big.

Layout: Accelerate's ``save_state`` with ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_0/``
(keys ``model.<name>``) and, with ``optimizer=True``, ``optimizer_0/`` (AdamW:
``optimizer.state.<name>.exp_avg`` / ``exp_avg_sq`` sharded as their parameter,
``optimizer.state.<name>.step`` one replicated scalar kept by rank 0, and
``optimizer.param_groups.0.*`` as bytes entries).

Used by ``benchmarks/scale.py``; importable by tests at small sizes.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

#: Llama-3-70B: 80 layers, hidden 8192, intermediate 28672, vocab 128256, 8 kv heads of 128.
LLAMA_70B = {"layers": 80, "hidden": 8192, "intermediate": 28672, "vocab": 128256, "kv": 1024}

#: Bytes a chunk's torch.save archive adds to its data (about 1.5-2 KB in real folders).
ARCHIVE_OVERHEAD = 1600


def shapes(layers: int, hidden: int, intermediate: int, vocab: int,
           kv: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of a Llama's parameters, in ``state_dict`` order."""
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", (hidden, hidden)
        yield p + "self_attn.k_proj.weight", (kv, hidden)
        yield p + "self_attn.v_proj.weight", (kv, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, hidden)
        yield p + "mlp.gate_proj.weight", (intermediate, hidden)
        yield p + "mlp.up_proj.weight", (intermediate, hidden)
        yield p + "mlp.down_proj.weight", (hidden, intermediate)
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def dim0_split(rows: int, ranks: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 shards: ``(start, rows)`` per rank, ceil split, trailing ranks empty."""
    per = -(-rows // ranks)
    return [(min(r * per, rows), max(0, min(per, rows - r * per))) for r in range(ranks)]


class _Folder:
    """One DCP folder being described: entries, storage and each rank file's end."""

    def __init__(self, ranks: int, data: bool = False) -> None:
        import torch

        self.torch = torch
        self.ranks = ranks
        #: With data: each rank file's archives, in order (else the files stay sparse).
        self.blobs: list[list[bytes]] | None = [[] for _ in range(ranks)] if data else None
        self.entries: dict = {}
        self.storage: dict = {}
        self.planner: dict = {}
        self.ends = [0] * ranks
        self.files = [f"__{r}_0.distcp" for r in range(ranks)]

    def sharded(self, key: str, path: tuple, shape: tuple[int, ...], itemsize: int = 4) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        Size = self.torch.Size
        row = itemsize
        for d in shape[1:]:
            row *= d
        chunks = []
        full = None
        if self.blobs is not None:
            count = row // itemsize * shape[0]
            full = self.torch.arange(count, dtype=self.torch.float32).reshape(shape)
            self._seed += count
            full += self._seed
        for rank, (start, rows) in enumerate(dim0_split(shape[0], self.ranks)):
            offsets = (start,) + (0,) * (len(shape) - 1)
            chunks.append(ChunkStorageMetadata(Size(offsets), Size((rows,) + shape[1:])))
            length = rows * row + ARCHIVE_OVERHEAD
            if full is not None:
                length = self._archive(rank, full[start:start + rows].clone())
            # Each rank's write results travel on their own: a copy of the key per rank.
            own_key = (key + ".")[:-1]
            self.storage[MetadataIndex(own_key, Size(offsets))] = _StorageInfo(
                self.files[rank], self.ends[rank], length)
            self.ends[rank] += length
        self.entries[key] = TensorStorageMetadata(
            TensorProperties(dtype=self.torch.float32), Size(shape), chunks)
        self.planner[key] = path

    def scalar(self, key: str, path: tuple) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        Size = self.torch.Size
        chunk = ChunkStorageMetadata(Size(()), Size(()))
        length = 4 + ARCHIVE_OVERHEAD
        if self.blobs is not None:
            length = self._archive(0, self.torch.tensor(3.0))
        self.storage[MetadataIndex(key, Size(()))] = _StorageInfo(self.files[0], self.ends[0],
                                                                   length)
        self.ends[0] += length
        self.entries[key] = TensorStorageMetadata(TensorProperties(dtype=self.torch.float32),
                                                  Size(()), [chunk])
        self.planner[key] = path

    def blob(self, key: str, path: tuple) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        length = 600
        if self.blobs is not None:
            length = self._archive(0, 0.001)
        self.storage[MetadataIndex(key)] = _StorageInfo(self.files[0], self.ends[0], length)
        self.ends[0] += length
        self.entries[key] = BytesStorageMetadata()
        self.planner[key] = path

    _seed = 0

    def _archive(self, rank: int, value: object) -> int:
        """Append ``torch.save(value)`` to rank ``rank``'s file, as DCP's writer does; its
        length."""
        import io

        assert self.blobs is not None
        buffer = io.BytesIO()
        self.torch.save(value, buffer)
        self.blobs[rank].append(buffer.getvalue())
        return len(buffer.getvalue())

    def write(self, folder: Path) -> None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from fsdpckpt._torch import dcp_metadata

        folder.mkdir(parents=True, exist_ok=True)
        md = dcp_metadata(self.entries, planner_data=self.planner, storage_data=self.storage,
                          storage_meta=StorageMeta(checkpoint_id=str(folder), save_id="sim"),
                          version="1.0.0")
        with open(folder / ".metadata", "wb") as f:
            pickle.dump(md, f)  # as FileSystemWriter.finish: the default protocol
        for rank, (name, end) in enumerate(zip(self.files, self.ends)):
            with open(folder / name, "wb") as f:
                if self.blobs is not None:
                    f.writelines(self.blobs[rank])
                f.truncate(end)


def build(root: Path, ranks: int, *, optimizer: bool = True, layers: int | None = None,
          hidden: int | None = None, intermediate: int | None = None, vocab: int | None = None,
          kv: int | None = None, data: bool = False) -> Path:
    """Write Accelerate's sharded layout of a Llama (70B's shape unless told) over ``ranks``.

    With ``data``, the rank files hold real archives (keep the model small).

    Returns ``root``, holding ``pytorch_model_fsdp_0/`` and, with ``optimizer``,
    ``optimizer_0/``.
    """
    dims = dict(LLAMA_70B)
    dims.update({k: v for k, v in dict(layers=layers, hidden=hidden, intermediate=intermediate,
                                       vocab=vocab, kv=kv).items() if v is not None})
    params = list(shapes(**dims))
    model = _Folder(ranks, data)
    for name, shape in params:
        model.sharded(f"model.{name}", ("model", name), shape)
    model.write(root / "pytorch_model_fsdp_0")
    del model
    if optimizer:
        optim = _Folder(ranks, data)
        for name, shape in params:
            base = f"optimizer.state.{name}"
            optim.scalar(f"{base}.step", ("optimizer", "state", name, "step"))
            optim.sharded(f"{base}.exp_avg", ("optimizer", "state", name, "exp_avg"), shape)
            optim.sharded(f"{base}.exp_avg_sq", ("optimizer", "state", name, "exp_avg_sq"),
                          shape)
        for field in ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize",
                      "capturable", "differentiable", "fused", "initial_lr"):
            optim.blob(f"optimizer.param_groups.0.{field}",
                       ("optimizer", "param_groups", 0, field))
        optim.blob("optimizer.param_groups.0.params", ("optimizer", "param_groups", 0, "params"))
        optim.write(root / "optimizer_0")
    return root
