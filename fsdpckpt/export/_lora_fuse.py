"""LoRA fusion, PEFT's ``merge_and_unload`` one tensor at a time: the one mechanism behind
:func:`fsdpckpt.export.lora.fused_tensors`, :func:`~fsdpckpt.export.lora.fuse_into` and
``export_hf(lora="fuse")``.

:class:`LoraFuser` holds only the adapter tensors (small); :func:`fused_from` streams a
checkpoint's base tensors through it, one in memory at a time. Where the fused tensors go
(a merge plan's files) is :mod:`fsdpckpt.export._fuse_hf`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from fsdpckpt._io import storage
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError, OptionError
from fsdpckpt.export._lora_config import (
    ADAPTER_CONFIG,
    LoraConfig,
    parse_lora_config,
    read_lora_config,
)
from fsdpckpt.export._lora_keys import LoraLayout, LoraModule
from fsdpckpt.export._lora_read import ModelSource

__all__ = ["LoraFuser", "check_module", "fuse_weight", "find_adapter_config",
           "adapter_config_places", "checked_dtype", "computed_names", "fused_from", "load",
           "one_thread", "pick_adapter", "torch_dtype"]

#: A path argument: local, or a URL / :class:`RemotePath` on object storage.
_Where: TypeAlias = str | os.PathLike[str] | RemotePath
_Config: TypeAlias = _Where | Mapping[str, Any]


def checked_dtype(dtype: str | None) -> Any:
    """The merge's reading of a dtype name (:func:`~fsdpckpt.merging.plan.parse_dtype`, a
    :class:`~fsdpckpt.dcp.dtypes.DType`; None stays None), worded for these functions;
    without importing torch.

    Raises:
        OptionError: not bf16, fp16 or fp32 (or their long names).
    """
    if dtype is None:
        return None
    from fsdpckpt.errors import MergePlanError
    from fsdpckpt.merging.plan import parse_dtype

    try:
        return parse_dtype(dtype)
    except MergePlanError:
        raise OptionError(f"dtype={dtype!r}: use one of bf16, fp16, fp32") from None


def torch_dtype(dtype: str | None) -> Any:
    """:func:`checked_dtype` as a ``torch.dtype``."""
    found = checked_dtype(dtype)
    if found is None:
        return None
    import torch

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
    import torch

    w = weight.float()
    transposed = fan_in_fan_out or embedding
    # PEFT's ops, in its order and dtype (get_delta_weight, then W + delta): in place in the
    # product's memory where that changes no bit (an element-wise op gives the same values
    # into any buffer), two tensors the weight's size fewer to allocate and fault in.
    delta = (lora_b.float() @ lora_a.float()).mul_(scaling)
    delta = delta.T if transposed else delta
    if magnitude is None:
        return torch.add(w, delta, out=delta) if not transposed else w + delta
    # DoRA: the norm of each output row of W + delta, in the (out x in) orientation.
    rows = (w + delta).T if fan_in_fan_out else w + delta
    norm = torch.linalg.norm(rows, dim=1)
    factor = (magnitude.float() / norm).view(-1, 1)
    return (factor.T if fan_in_fan_out else factor) * (w + delta)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch's ops on one thread within the block (the caller's count restored after).

    A fusion's ops are a thin matmul and element-wise passes over memory, a few
    milliseconds a weight on one core. On two threads, while the other core reads, checks
    CRCs or is another process's, each op waits for a second thread that is not running:
    10-40 ms an op measured on a busy two-core machine, against 0.5 ms on one. The bits
    are the same either way (tests/test_lora_fast.py compares them).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class _Adapter:
    module: LoraModule
    a: Any
    b: Any
    magnitude: Any
    b_bias: Any
    scaling: float


def check_module(module: LoraModule, config: LoraConfig, a_shape: tuple[int, ...],
                 b_shape: tuple[int, ...]) -> int:
    """Check one adapted module against the adapter config from its A and B shapes alone;
    returns its rank.

    Raises:
        NotACheckpointError: the rank disagrees with the config (``r``, ``rank_pattern``), or
            the config says DoRA and the module has no magnitude.
    """
    rank = a_shape[0]
    expected = config.rank_of(module.name)
    if rank != expected or b_shape[-1] != rank:
        raise NotACheckpointError(
            f"{module.lora_a}: rank {rank} but the adapter config gives {module.name} "
            f"r={expected} (field 'r' or 'rank_pattern'); pass the adapter_config.json "
            "of this run")
    if config.use_dora and module.magnitude is None:
        raise NotACheckpointError(f"{module.stored}: the config says use_dora but the "
                                  "checkpoint holds no lora_magnitude_vector for it")
    return rank


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
        self.adapter = pick_adapter(layout, adapter)
        self.dtype = torch_dtype(dtype)
        self._adapters: dict[str, _Adapter] = {}
        for module in layout.modules:
            if module.adapter != self.adapter:
                continue
            a, b = adapter_tensors[module.lora_a], adapter_tensors[module.lora_b]
            rank = check_module(module, config, tuple(a.shape), tuple(b.shape))
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
            with one_thread():
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


def pick_adapter(layout: LoraLayout, adapter: str | None,
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
                                  "tensors); export it with lora=None")
    if len(layout.adapters) > 1:
        raise NotACheckpointError(f"{at}the checkpoint holds adapters "
                                  f"{', '.join(layout.adapters)}; name the one to use "
                                  "(adapter=...)")
    return layout.adapters[0]


def adapter_config_places(checkpoint: Place) -> list[Place]:
    """Where a run leaves ``adapter_config.json`` for the checkpoint ``checkpoint``: its folder
    and that folder's two parents (HF Trainer's and Accelerate's output folders), nearest first.
    """
    here = storage.resolved(checkpoint)  # a local link followed (object stores have none)
    here = here if here.is_dir() else here.parent
    # The root's parent (a bucket's too) is itself: each place once.
    return list(dict.fromkeys([here, here.parent, here.parent.parent]))


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
    places = adapter_config_places(location(checkpoint, storage_options=storage_options))
    if base is not None:
        places.append(location(base, storage_options=storage_options))
    for place in places:
        if (place / ADAPTER_CONFIG).is_file():
            return read_lora_config(place / ADAPTER_CONFIG)
    looked = ", ".join(str(p) for p in places)
    raise CheckpointNotFoundError(f"{checkpoint}: no {ADAPTER_CONFIG} found (looked in {looked});"
                                  " pass the one the run's PEFT model wrote with "
                                  "lora_config=...")


def load(source: ModelSource, keys: set[str]) -> dict[str, Any]:
    return dict(source.read(lambda n: n in keys))


def computed_names(layout: LoraLayout, adapter: str) -> frozenset[str]:
    """The stored names whose fused tensor :class:`LoraFuser` computes (``adapter``'s base
    weights, and the base biases its ``lora_B`` biases add to); every other tensor the
    fused model holds is the stored one, renamed (cast at most)."""
    found = set()
    for module in layout.modules:
        if module.adapter == adapter:
            found.add(module.weight)
            if module.lora_b_bias is not None and module.bias is not None:
                found.add(module.bias)
    return frozenset(found)


def fused_from(source: ModelSource, layout: LoraLayout, config: LoraConfig, *,
               adapter: str | None, dtype: str | None,
               only: Collection[str] | None = None) -> Iterator[tuple[str, Any]]:
    """The plain model's ``(name, tensor)`` pairs of ``source`` with the adapter fused in,
    in stored order, one at a time: memory holds the adapters and one base tensor.
    ``only``: the stored names to read (by default every one the fused model holds)."""
    # The fuser holds the adapters' own tensors; modules_to_save copies (an lm_head's may be
    # gigabytes) are read, one at a time, with the base tensors.
    held = {k for m in layout.modules for k in m.adapter_keys}
    fuser = LoraFuser(layout, config, load(source, held), adapter=adapter, dtype=dtype)
    kept = {n for n in source.names if layout.plain_name(n, fuser.adapter) is not None
            and (only is None or n in only)}
    for name, tensor in source.read(kept.__contains__):
        out = fuser(name, tensor)
        if out is not None:
            yield out
