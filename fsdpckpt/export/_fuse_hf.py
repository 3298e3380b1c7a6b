"""The weights of ``export-hf --lora fuse``: the base model with a LoRA adapter fused in.

The merge pipeline copies stored bytes; fusing computes ``W + scaling * (B @ A)`` per layer,
so these weights come from :func:`fsdpckpt.export.lora.fused_tensors` (one base tensor in
memory at a time, fused in fp32, then cast) and are written in place into
``model.safetensors`` (or shards and their index, split as a merge splits them) laid out
from the metadata first. Everything else in the export (the
config and tokenizer files, the key check against the model class, tied weights, staging
and commit) is :func:`fsdpckpt.export.hf.export_hf`'s.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpckpt._io.remote import RemotePath
from fsdpckpt.export._lora_keys import LoraLayout
from fsdpckpt.export._lora_read import ModelSource, open_model_source
from fsdpckpt.export._lora_write import fused_specs, write_sharded
from fsdpckpt.export.lora import _pick_adapter, _torch_dtype, find_lora, fused_tensors

__all__ = ["FusedWeights", "plan_fused"]


@dataclass(frozen=True)
class FusedWeights:
    """The fused model's tensors, known from the metadata before any is read.

    Attributes:
        shapes: each plain (Hugging Face) name's shape. dtype: the exported dtype of most
            floating-point bytes (what the config will say). nbytes: each tensor's bytes.
    """

    checkpoint: str | os.PathLike[str] | RemotePath
    source: ModelSource
    layout: LoraLayout
    adapter: str
    shapes: dict[str, tuple[int, ...]]
    nbytes: dict[str, int]
    dtype: str

    def write(self, folder: Path, *, dtype: str | None, exclude: set[str], limit: int | None,
              lora_config: Any, base: Any) -> tuple[list[Path], int]:
        """Write the fused tensors but ``exclude`` (tied targets) into ``folder``, split into
        shards of at most ``limit`` bytes as a merge splits them.

        Returns:
            The files written (the index last, when sharded) and how many tensors.
        """
        tensors = fused_tensors(self.checkpoint, lora_config=lora_config, base=base,
                                dtype=dtype, adapter=self.adapter)
        return write_sharded(self.source, self.layout, self.adapter, folder, dtype, tensors,
                             exclude=frozenset(exclude), limit=limit)


def plan_fused(checkpoint: str | os.PathLike[str] | RemotePath, *, dtype: str | None,
               adapter: str | None = None) -> FusedWeights:
    """What the fused export will hold, from the checkpoint's metadata alone.

    Raises:
        NotACheckpointError: the checkpoint holds no LoRA adapter (or several, and none
            is named); ValueError for an unknown ``dtype``.
    """
    _torch_dtype(dtype)  # a wrong name fails before anything is read or written
    source = open_model_source(checkpoint)
    layout = find_lora(source.names)
    name = _pick_adapter(layout, adapter, source.path)
    specs = fused_specs(source, layout, name, dtype)
    sizes: Counter[str] = Counter()
    for spec in specs:
        if spec.dtype.is_floating:
            sizes[spec.dtype.name] += spec.nbytes
    exported = sizes.most_common(1)[0][0] if sizes else "float32"
    return FusedWeights(checkpoint, source, layout, name,
                        {s.name: tuple(s.shape) for s in specs},
                        {s.name: s.nbytes for s in specs}, exported)
