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

from fsdpckpt._io import storage
from fsdpckpt._io.remote import RemotePath, is_url, location
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    NotACheckpointError,
    OptionError,
    OutputExistsError,
)
from fsdpckpt.export._lora_config import (
    ADAPTER_CONFIG,
    LoraConfig,
    parse_lora_config,
    read_lora_config,
)
from fsdpckpt.export._lora_keys import PEFT_PREFIX, LoraLayout, LoraModule, find_lora
from fsdpckpt.export._lora_read import ModelSource, open_model_source

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "AdapterExport", "LoraConfig",
           "LoraFuser", "LoraLayout", "LoraModule", "export_adapter", "find_adapter_config",
           "find_lora", "fuse_into", "fuse_weight", "fused_tensors", "parse_lora_config",
           "read_lora_config"]

#: A path argument: local, or a URL / :class:`RemotePath` on object storage.
_Where: TypeAlias = str | os.PathLike[str] | RemotePath
_Config: TypeAlias = _Where | Mapping[str, Any]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's EMBEDDING_LAYER_NAMES: adapted modules saved whole in the adapter file.
_EMBEDDING_LAYERS = ("embed_tokens", "lm_head")


def _torch_dtype(dtype: str | None) -> Any:
    # The merge's reading of a dtype name (plan.parse_dtype), worded for these functions.
    if dtype is None:
        return None
    import torch

    from fsdpckpt.errors import MergePlanError
    from fsdpckpt.merging.plan import parse_dtype

    try:
        found = parse_dtype(dtype)
    except MergePlanError:
        raise OptionError(f"dtype={dtype!r}: use one of bf16, fp16, fp32") from None
    return getattr(torch, str(found))


def fuse_weight(weight: Any, lora_a: Any, lora_b: Any, scaling: float, *,
                fan_in_fan_out: bool = False, magnitude: Any = None,
                embedding: bool = False) -> Any:
    """One base weight with its adapter fused in, as PEFT's ``merge`` computes it, in fp32.

    Args:
        weight: the base weight as stored (``out x in``; ``in x out`` with
            ``fan_in_fan_out``; ``vocab x dim`` for an embedding).
        lora_a, lora_b: A (``r x in``) and B (``out x r``); for an embedding PEFT's
            ``lora_embedding_A`` (``r x vocab``) and ``lora_embedding_B`` (``dim x r``).
        scaling: ``alpha / r`` or ``alpha / sqrt(r)``.
        fan_in_fan_out: the weight is stored transposed (GPT-2's Conv1D).
        magnitude: DoRA's magnitude vector (one per output row), or None.
        embedding: an ``nn.Embedding`` adapter (its delta is always transposed).

    Returns:
        The fused weight, float32, the shape of ``weight``.
    """
    w = weight.float()
    transposed = fan_in_fan_out or embedding
    delta = lora_b.float() @ lora_a.float()
    delta = (delta.T if transposed else delta) * scaling
    if magnitude is None:
        return w + delta
    # DoRA: the norm of each output row of W + delta, in the (out x in) orientation.
    rows = (w + delta).T if fan_in_fan_out else w + delta
    import torch

    norm = torch.linalg.norm(rows, dim=1)
    factor = (magnitude.float() / norm).view(-1, 1)
    return (factor.T if fan_in_fan_out else factor) * (w + delta)


@dataclass(frozen=True)
class _Adapter:
    module: LoraModule
    a: Any
    b: Any
    magnitude: Any
    b_bias: Any
    scaling: float


class LoraFuser:
    """Fuses adapters into base tensors one at a time: ``fuser(name, tensor)``.

    Holds only the adapter tensors (A, B, magnitudes: small). Called with each stored
    ``(name, tensor)`` of the checkpoint in turn, it returns the plain model's
    ``(name, tensor)`` (base weights fused, ``base_model.model.`` and ``.base_layer``
    dropped) or None for a tensor the fused model does not hold (the adapters themselves).

    Args:
        layout: :func:`find_lora` of the checkpoint's names.
        config: the adapter config.
        adapter_tensors: every name of ``layout.modules``' adapter keys, with its tensor.
        adapter: which adapter to fuse (the only one by default).
        dtype: cast every output tensor (``"bf16"``...); by default each keeps its dtype.

    Raises:
        NotACheckpointError: several adapters and none named; a rank that disagrees
            with the config; DoRA without a magnitude.
    """

    def __init__(self, layout: LoraLayout, config: LoraConfig,
                 adapter_tensors: Mapping[str, Any], *, adapter: str | None = None,
                 dtype: str | None = None) -> None:
        self.layout, self.config = layout, config
        self.adapter = _pick_adapter(layout, adapter)
        self.dtype = _torch_dtype(dtype)
        self._adapters: dict[str, _Adapter] = {}
        for module in layout.modules:
            if module.adapter != self.adapter:
                continue
            a, b = adapter_tensors[module.lora_a], adapter_tensors[module.lora_b]
            rank = a.shape[0]
            expected = config.rank_of(module.name)
            if rank != expected or b.shape[-1] != rank:
                raise NotACheckpointError(
                    f"{module.lora_a}: rank {rank} but the adapter config gives {module.name} "
                    f"r={expected} (field 'r' or 'rank_pattern'); pass the adapter_config.json "
                    "of this run")
            if config.use_dora and module.magnitude is None:
                raise NotACheckpointError(f"{module.stored}: the config says use_dora but the "
                                          "checkpoint holds no lora_magnitude_vector for it")
            self._adapters[module.weight] = _Adapter(
                module, a, b,
                adapter_tensors[module.magnitude] if module.magnitude else None,
                adapter_tensors[module.lora_b_bias] if module.lora_b_bias else None,
                config.scaling_of(module.name, rank))
        self._biases = {a.module.bias: a for a in self._adapters.values()
                        if a.b_bias is not None and a.module.bias is not None}

    def __call__(self, name: str, tensor: Any) -> tuple[str, Any] | None:
        plain = self.layout.plain_name(name, self.adapter)
        if plain is None:
            return None
        found = self._adapters.get(name)
        if found is not None:
            fused = fuse_weight(tensor, found.a, found.b, found.scaling,
                                fan_in_fan_out=self.config.fan_in_fan_out,
                                magnitude=found.magnitude, embedding=found.module.embedding)
            return plain, fused.to(self.dtype or tensor.dtype)
        lora_bias = self._biases.get(name)
        if lora_bias is not None:
            fused = tensor.float() + lora_bias.b_bias.float() * lora_bias.scaling
            return plain, fused.to(self.dtype or tensor.dtype)
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return plain, tensor


def _pick_adapter(layout: LoraLayout, adapter: str | None,
                  where: Path | RemotePath | None = None) -> str:
    """The adapter to export or fuse; errors name ``where`` (the checkpoint) when given."""
    at = f"{where}: " if where is not None else ""
    if adapter is not None:
        if adapter not in layout.adapters:
            raise NotACheckpointError(f"{at}adapter '{adapter}' is not in the checkpoint (it "
                                      f"holds {', '.join(layout.adapters) or 'no LoRA adapter'})")
        return adapter
    if not layout.adapters:
        raise NotACheckpointError(f"{at}the checkpoint holds no LoRA adapter (no lora_A/lora_B "
                                  "tensors); export it without --lora")
    if len(layout.adapters) > 1:
        raise NotACheckpointError(f"{at}the checkpoint holds adapters "
                                  f"{', '.join(layout.adapters)}; name the one to use "
                                  "(adapter=...)")
    return layout.adapters[0]


def find_adapter_config(checkpoint: _Where, *,
                        lora_config: _Config | None = None,
                        base: _Where | None = None,
                        storage_options: dict[str, Any] | None = None) -> LoraConfig:
    """The adapter config of a run: ``lora_config`` (a file, a folder or a dict) when
    given; else ``adapter_config.json`` in the checkpoint folder, its two parents (a
    Trainer or Accelerate output folder), or ``base``. Each may be local or a URL on object
    storage (``storage_options``: the fsspec filesystem's options, docs/remote.md).

    Raises:
        CheckpointNotFoundError: none found; the message lists where it looked.
    """
    if isinstance(lora_config, Mapping):
        return parse_lora_config(dict(lora_config), source="lora_config")
    if lora_config is not None:
        return read_lora_config(lora_config, storage_options=storage_options)
    path = location(checkpoint, storage_options=storage_options)
    here = storage.resolved(path)  # a local link followed (object stores have none)
    here = here if here.is_dir() else here.parent
    # The folder and its two parents; the root's parent (a bucket's too) is itself.
    places: list[Place] = list(dict.fromkeys([here, here.parent, here.parent.parent]))
    if base is not None:
        places.append(location(base, storage_options=storage_options))
    for place in places:
        if (place / ADAPTER_CONFIG).is_file():
            return read_lora_config(place / ADAPTER_CONFIG)
    looked = ", ".join(str(p) for p in places)
    raise CheckpointNotFoundError(f"{checkpoint}: no {ADAPTER_CONFIG} found (looked in {looked});"
                                  " pass the one the run's PEFT model wrote with --lora-config "
                                  "(or lora_config=)")


def _load(source: ModelSource, keys: set[str]) -> dict[str, Any]:
    return dict(source.read(lambda n: n in keys))


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
    config = find_adapter_config(checkpoint, lora_config=lora_config, base=base,
                                 storage_options=storage_options)
    fuser = LoraFuser(layout, config, _load(source, set(layout.adapter_keys)), adapter=adapter,
                      dtype=dtype)
    # Adapter tensors are already held; modules_to_save copies are read with the base.
    kept = {n for n in source.names if layout.plain_name(n, fuser.adapter) is not None}
    for name, tensor in source.read(kept.__contains__):
        out = fuser(name, tensor)
        if out is not None:
            yield out


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
                                  "storage with export_hf(..., lora=...) (export-hf --lora)")


def _prepare_output(output: Path, names: list[str], overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise NotACheckpointError(f"{output}: is a file; pass a folder to write into")
    taken = [n for n in names if (output / n).exists()]
    if taken and not overwrite:

        raise OutputExistsError(f"{output / taken[0]}: already exists; pass overwrite=True "
                                "to replace it")
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
    cast = _torch_dtype(dtype)  # a wrong name fails before anything is read or written
    _require_local(output)
    source = open_model_source(checkpoint, storage_options=storage_options)
    layout = find_lora(source.names)
    name = _pick_adapter(layout, adapter, source.path)
    config = find_adapter_config(checkpoint, lora_config=lora_config, base=base,
                                 storage_options=storage_options)
    bias = config.raw.get("bias", "none")
    if bias not in ("none", None):
        raise NotACheckpointError(f"adapter config field 'bias' is {bias!r}: the trained base "
                                  "biases are not exported as adapter weights yet; fuse instead "
                                  "(--lora fuse)")
    LoraFuser(layout, config, _load(source, set(layout.adapter_keys)), adapter=name)  # checks
    out = Path(output)
    _prepare_output(out, [ADAPTER_WEIGHTS, ADAPTER_CONFIG], overwrite)
    # PEFT's save_embedding_layers="auto": an adapted embed_tokens / lm_head is saved with
    # its base weights, which PeftModel.from_pretrained then loads over the base model's.
    saved = {n: n for m in layout.modules if m.adapter == name
             and m.name.rsplit(".", 1)[-1] in _EMBEDDING_LAYERS for n in (m.weight, m.bias) if n}
    for stored in layout.adapter_keys:
        key = layout.adapter_file_name(stored, name)
        if key is not None:
            saved[stored] = key
    tensors: dict[str, Any] = {}
    for stored, tensor in source.read(saved.__contains__):
        tensors[saved[stored]] = tensor.to(cast) if cast is not None else tensor
    _save_safetensors(tensors, out / ADAPTER_WEIGHTS)
    import json

    from fsdpckpt._io.durable import write_bytes

    write_bytes(out / ADAPTER_CONFIG, (json.dumps(dict(config.raw), indent=2) + "\n").encode())
    count = sum(m.adapter == name for m in layout.modules)
    return AdapterExport(out, (ADAPTER_WEIGHTS, ADAPTER_CONFIG), len(tensors), name, count)


def fuse_into(checkpoint: _Where, output: str | os.PathLike[str],
              *, lora_config: _Config | None = None,
              base: _Where | None = None, dtype: str | None = None,
              adapter: str | None = None, overwrite: bool = False,
              storage_options: dict[str, Any] | None = None) -> AdapterExport:
    """Write the base model with the adapter fused in as ``OUTPUT/model.safetensors``.

    Streams: one base tensor at a time is read, fused and written at its place in the
    file (laid out from the metadata first). For Hugging Face folders (config, tokenizer,
    shards) use the HF export with ``lora="fuse"``, which calls :class:`LoraFuser`.
    Arguments and errors as :func:`export_adapter`.
    """
    from fsdpckpt.export._lora_write import write_streaming

    _torch_dtype(dtype)  # a wrong name fails before anything is read or written
    _require_local(output)
    source = open_model_source(checkpoint, storage_options=storage_options)
    layout = find_lora(source.names)
    name = _pick_adapter(layout, adapter, source.path)
    out = Path(output)
    _prepare_output(out, ["model.safetensors"], overwrite)
    count = write_streaming(
        source, layout, name, out / "model.safetensors", dtype,
        fused_tensors(checkpoint, lora_config=lora_config, base=base, dtype=dtype,
                      adapter=name, storage_options=storage_options))
    return AdapterExport(out, ("model.safetensors",), count, name,
                         sum(m.adapter == name for m in layout.modules))

