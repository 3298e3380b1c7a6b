"""LoRA / PEFT adapters in an FSDP checkpoint: export them as PEFT writes them, or fuse them.

Entry points:

- :func:`find_lora` (names only): which modules carry adapters, the adapter names.
- :func:`export_adapter`: ``adapter_model.safetensors`` + ``adapter_config.json``, loadable
  by ``PeftModel.from_pretrained(base, OUTPUT)``.
- :class:`LoraFuser`: a per-tensor function ``(name, tensor) -> (name, tensor) | None`` for
  a writer that streams the base model (the HF export), holding only the small adapter
  tensors; :func:`fused_tensors` streams a checkpoint through it; :func:`fuse_into` writes
  the fused model as one ``model.safetensors``.

Fusion is PEFT's ``merge_and_unload``: ``W + scaling * (B @ A)`` (transposed with
``fan_in_fan_out``), ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA, per-module
``rank_pattern``/``alpha_pattern``), DoRA rows rescaled by ``m / ||W + delta||``; in fp32,
then cast to the requested dtype (the stored one by default).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from fsdpckpt._io.publish import beside, remove_durably
from fsdpckpt._io.remote import RemotePath, is_url, location
from fsdpckpt.errors import NotACheckpointError, OutputExistsError
from fsdpckpt.export._adapter_copy import copy_adapter, copyable
from fsdpckpt.export._config import CONFIG
from fsdpckpt.export._earlier import earlier_full_export
from fsdpckpt.export._fuse_hf import plan_fused
from fsdpckpt.export._lora_base import with_base
from fsdpckpt.export._lora_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraConfig,
    parse_lora_config,
    read_lora_config,
)
from fsdpckpt.export._lora_fuse import (
    LoraFuser,
    check_module,
    checked_dtype,
    find_adapter_config,
    fuse_weight,
    fused_from,
    pick_adapter,
    torch_dtype,
)
from fsdpckpt.export._lora_keys import PEFT_PREFIX, LoraLayout, LoraModule, find_lora
from fsdpckpt.export._lora_read import open_model_source

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "AdapterExport", "LoraConfig",
           "LoraFuser", "LoraLayout", "LoraModule", "export_adapter", "find_adapter_config",
           "find_lora", "fuse_into", "fuse_weight", "fused_tensors", "model_tensor_names",
           "parse_lora_config", "read_lora_config"]

#: A path argument: local, or a URL / :class:`RemotePath` on object storage.
_Where: TypeAlias = str | os.PathLike[str] | RemotePath
_Config: TypeAlias = _Where | Mapping[str, Any]

#: PEFT's EMBEDDING_LAYER_NAMES: adapted modules saved whole in the adapter file.
_EMBEDDING_LAYERS = ("embed_tokens", "lm_head")


def model_tensor_names(checkpoint: _Where, *, storage_options: dict[str, Any] | None = None,
                       model_index: int | None = None) -> tuple[str, ...]:
    """The model's tensor names in ``checkpoint``, as ``merge`` names them (what
    :func:`find_lora` takes), from the metadata alone: a DCP folder, a checkpoint folder
    in any layout merge reads, or a merged ``.safetensors`` file or index; local or a URL.

    Raises:
        CheckpointNotFoundError, NotACheckpointError, CorruptCheckpointError: as ``merge``.
    """
    return open_model_source(checkpoint, storage_options=storage_options,
                             model_index=model_index).names


def fused_tensors(checkpoint: _Where, *,
                  lora_config: _Config | None = None,
                  base: _Where | None = None,
                  dtype: str | None = None, adapter: str | None = None,
                  storage_options: dict[str, Any] | None = None
                  ) -> Iterator[tuple[str, Any]]:
    """The plain model's ``(name, tensor)`` pairs with the adapters fused in, one at a time.

    Memory holds the adapters and one base tensor. Arguments as :func:`export_adapter`.
    """
    source = open_model_source(checkpoint, storage_options=storage_options)
    layout = find_lora(source.names)
    joined = with_base(source, layout, None if base is None else
                       location(base, storage_options=storage_options))
    if joined is not source:  # base weights from the base model's folder
        source, layout = joined, find_lora(joined.names)
    config = find_adapter_config(checkpoint, lora_config=lora_config, base=base,
                                 storage_options=storage_options)
    yield from fused_from(source, layout, config, adapter=adapter, dtype=dtype)


@dataclass(frozen=True)
class AdapterExport:
    """What :func:`export_adapter` or :func:`fuse_into` wrote.

    Attributes:
        output: the folder. files: the files written. tensors: how many tensors.
        adapter: the adapter exported or fused. modules: how many modules carry it.
    """

    output: Path | RemotePath
    files: tuple[str, ...]
    tensors: int
    adapter: str
    modules: int

    def to_json(self) -> dict[str, Any]:
        """What ``fsdpckpt export-hf --lora adapter --json`` prints."""
        return {"output": str(self.output), "files": list(self.files), "tensors": self.tensors,
                "adapter": self.adapter, "modules": self.modules}


def _require_local(output: str | os.PathLike[str]) -> None:
    if is_url(output):
        raise NotACheckpointError(f"{output}: these write to a local folder; export to object "
                                  "storage with export_hf(..., lora=...)")


def _prepare_output(output: Path, names: list[str], overwrite: bool, *,
                    make: bool = True) -> None:
    # ``make``: create the folder now; else the stage that writes the weights makes it, and
    # removes it again if they fail (nothing left behind).
    if output.exists() and not output.is_dir():
        raise NotACheckpointError(f"{output}: is a file; pass a folder to write into")
    taken = [n for n in names if (output / n).exists()]
    if taken and not overwrite:

        raise OutputExistsError(f"{output / taken[0]}: already exists; pass overwrite=True "
                                "to replace it")
    if make:
        output.mkdir(parents=True, exist_ok=True)


def _save_safetensors(tensors: Mapping[str, Any], path: Path) -> None:
    # Staged beside the target and renamed: a crash leaves the old file or the new one.
    from safetensors.torch import save_file

    from fsdpckpt._io import publish

    with publish.beside([path]) as (staging,):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging),
                  metadata={"format": "pt"})


def export_adapter(checkpoint: _Where, output: str | os.PathLike[str],
                   *, lora_config: _Config | None = None,
                   base: _Where | None = None, dtype: str | None = None,
                   adapter: str | None = None, overwrite: bool = False,
                   storage_options: dict[str, Any] | None = None) -> AdapterExport:
    """Write a checkpoint's LoRA adapter as PEFT's ``save_pretrained`` does.

    Only the adapter tensors are read (they are small); the base weights are not.

    Args:
        checkpoint: a DCP folder, an Accelerate / HF Trainer checkpoint, or a merged
            ``.safetensors`` of a PEFT-wrapped model; local or a URL (``s3://...``).
        output: the local folder to write ``adapter_model.safetensors`` and
            ``adapter_config.json`` into (created); ``export_hf(lora="adapter")`` also
            writes to object storage.
        lora_config: the adapter config (a file, its folder, or a dict); by default found
            beside the checkpoint or in ``base``.
        base: the base model's folder, searched for ``adapter_config.json`` last.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``; by default as stored.
        adapter: which adapter (the only one by default).
        overwrite: replace existing files.
        storage_options: for URLs: the fsspec filesystem's options (docs/remote.md).

    Raises:
        NotACheckpointError: no LoRA adapter; a config field is wrong (named).
        CheckpointNotFoundError: no adapter config found.
        OutputExistsError: the files exist and ``overwrite`` is False.
    """
    checked_dtype(dtype)  # a wrong name fails before anything is read or written
    _require_local(output)
    source = open_model_source(checkpoint, storage_options=storage_options)
    layout = find_lora(source.names)
    name = pick_adapter(layout, adapter, source.path)
    config = find_adapter_config(checkpoint, lora_config=lora_config, base=base,
                                 storage_options=storage_options)
    bias = config.raw.get("bias", "none")
    if bias not in ("none", None):
        raise NotACheckpointError(f"adapter config field 'bias' is {bias!r}: the trained base "
                                  "biases are not exported as adapter weights yet; fuse instead "
                                  "(lora='fuse')")
    for module in layout.modules:  # every adapted module against the config, by shapes
        if module.adapter == name:
            check_module(module, config, source.shapes[module.lora_a],
                         source.shapes[module.lora_b])
    out = Path(output)
    # PEFT's save_embedding_layers="auto": an adapted embed_tokens / lm_head is saved with
    # its base weights, which PeftModel.from_pretrained then loads over the base model's.
    saved = {n: n for m in layout.modules if m.adapter == name
             and m.name.rsplit(".", 1)[-1] in _EMBEDDING_LAYERS for n in (m.weight, m.bias) if n}
    for stored in layout.adapter_keys:
        key = layout.adapter_file_name(stored, name)
        if key is not None:
            saved[stored] = key
    entries = copyable(source, saved, dtype)
    earlier = earlier_full_export(out)  # a full export's files: replaced by this one
    _prepare_output(out, [ADAPTER_WEIGHTS, ADAPTER_CONFIG, *(p.name for p in earlier)],
                    overwrite, make=False)
    # The earlier commit files first: never an old adapter_config.json (or a full export's
    # config.json) beside the new weights.
    remove_durably([out / ADAPTER_CONFIG, out / CONFIG])
    if entries is not None:  # from a DCP folder: copied as a merge copies, no torch
        written = copy_adapter(source, entries, dtype, out)
    else:  # every tensor read (small) before the folder is made
        tensors: dict[str, Any] = {}
        cast = torch_dtype(dtype)
        for stored, tensor in source.read(saved.__contains__):
            tensors[saved[stored]] = tensor.to(cast) if cast is not None else tensor
        out.mkdir(parents=True, exist_ok=True)
        _save_safetensors(tensors, out / ADAPTER_WEIGHTS)
        written = len(tensors)
    import json

    from fsdpckpt._io.durable import write_bytes

    with beside([out / ADAPTER_CONFIG]) as (staged,):  # renamed in whole, folder fsynced
        write_bytes(staged, (json.dumps(dict(config.raw), indent=2) + "\n").encode())
    remove_durably(earlier)
    count = sum(m.adapter == name for m in layout.modules)
    return AdapterExport(out, (ADAPTER_WEIGHTS, ADAPTER_CONFIG), written, name, count)


def fuse_into(checkpoint: _Where, output: str | os.PathLike[str],
              *, lora_config: _Config | None = None,
              base: _Where | None = None, dtype: str | None = None,
              adapter: str | None = None, overwrite: bool = False,
              storage_options: dict[str, Any] | None = None) -> AdapterExport:
    """Write the base model with the adapter fused in as ``OUTPUT/model.safetensors``.

    Streams: one base tensor at a time is read, fused and written at its place in the
    file (laid out from the metadata first), through the merge's writer and commit
    (:mod:`fsdpckpt.export._fuse_hf`), as ``export_hf(lora="fuse")`` writes its weights; for
    Hugging Face folders (config, tokenizer, shards) use that. Arguments and errors as
    :func:`export_adapter`.
    """
    from fsdpckpt.merging._jobs import MergeJob, commit_job
    from fsdpckpt.merging.merger import write_job
    from fsdpckpt.merging.writer import staging

    checked_dtype(dtype)  # a wrong name fails before anything is read or written
    _require_local(output)
    source = open_model_source(checkpoint, storage_options=storage_options)
    fused = plan_fused(checkpoint, source, dtype=dtype, adapter=adapter,
                       lora_config=lora_config, base=base, storage_options=storage_options)
    out = Path(output)
    _prepare_output(out, ["model.safetensors"], overwrite)
    job = MergeJob((fused.plan(),), out, ())  # one file: nothing of an earlier one replaced
    with staging(out) as stage:
        (result,) = commit_job(job, write_job(job, stage))
    return AdapterExport(out, ("model.safetensors",), result.tensors, fused.adapter,
                         sum(m.adapter == fused.adapter for m in fused.layout.modules))
