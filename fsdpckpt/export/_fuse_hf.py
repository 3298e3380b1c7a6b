"""The weights of ``export-hf --lora fuse`` and :func:`~fsdpckpt.export.lora.fuse_into`: the
base model with a LoRA adapter fused in, as a merge plan whose tensors come from a fuser.

The merge pipeline copies stored bytes; fusing computes ``W + scaling * (B @ A)`` per layer.
Fusion keeps every shape, so what the fused model holds (each plain name, its shape, its
dtype after the cast) is known from the metadata alone: :func:`plan_fused` finds it, and
:meth:`FusedWeights.plan` makes it a :class:`~fsdpckpt.merging.plan.MergePlan`
(:func:`~fsdpckpt.merging.plan.computed_plan`, split as a merge splits) whose tensors come
from :func:`~fsdpckpt.export._lora_fuse.fused_from`, one in memory at a time. The merge's
writer, commit and result do the rest, as for any merge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpckpt._io.remote import location
from fsdpckpt.dcp.dtypes import dtype_from_name
from fsdpckpt.dcp.metadata import TensorEntry
from fsdpckpt.dcp.reader import DcpFolder
from fsdpckpt.errors import CorruptCheckpointError
from fsdpckpt.export._lora_base import with_base
from fsdpckpt.export._lora_fuse import (
    checked_dtype,
    computed_names,
    find_adapter_config,
    fused_from,
    pick_adapter,
)
from fsdpckpt.export._lora_keys import LoraLayout, find_lora
from fsdpckpt.export._lora_read import ModelSource
from fsdpckpt.formats import TensorSpec
from fsdpckpt.merging._jobs import MergeJob
from fsdpckpt.merging._outputs import claim_outputs
from fsdpckpt.merging.plan import MergePlan, computed_plan, no_metadata, parse_dtype

__all__ = ["FusedWeights", "plan_fused"]


@dataclass(frozen=True)
class FusedWeights:
    """The fused model's tensors, known from the metadata before any is read.

    Attributes:
        specs: each plain (Hugging Face) name with its shape and exported dtype, in stored
            order. dtype: the exported dtype of most floating-point bytes (what the
            config will say). adapter: the adapter fused.
    """

    folder: DcpFolder
    source: ModelSource
    layout: LoraLayout
    adapter: str
    specs: tuple[TensorSpec, ...]
    dtype: str
    _cast: str | None
    _find_config: dict[str, Any]
    #: The plain names copied from their stored chunks (the fuser would only rename and
    #: cast them), each with its stored entry; the stored names the fuser reads (None: all).
    _copied: Mapping[str, TensorEntry] = field(default_factory=dict)
    _read: frozenset[str] | None = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: tuple(s.shape) for s in self.specs}

    def plan(self, *, exclude: Iterable[str] = (), max_shard_size: int | None = None
             ) -> MergePlan:
        """The merge plan of the fused tensors but ``exclude`` (tied targets), split into
        shards of at most ``max_shard_size`` bytes as a merge splits them."""
        left = frozenset(exclude)
        return computed_plan(self.folder, [s for s in self.specs if s.name not in left],
                             self._tensors, max_shard_size=max_shard_size, copied=self._copied)

    def job(self, output_dir: Path, *, exclude: Iterable[str] = (),
            max_shard_size: int | None = None, overwrite: bool) -> MergeJob:
        """The merge job writing :meth:`plan` into ``output_dir``: its outputs claimed there
        as a merge claims them (earlier outputs it replaces, removed at commit).

        Raises:
            OutputExistsError: an output exists and ``overwrite`` is False.
        """
        plan = self.plan(exclude=exclude, max_shard_size=max_shard_size)
        return MergeJob((plan,), output_dir, claim_outputs((plan,), output_dir,
                                                           overwrite=overwrite))

    def _tensors(self) -> Iterable[tuple[str, Any]]:
        # Called by the writer: the adapter config is looked for only now, as it always was
        # (before the writer copies anything); the fuser reads only what it computes.
        config = find_adapter_config(**self._find_config)
        return fused_from(self.source, self.layout, config, adapter=self.adapter,
                          dtype=self._cast, only=self._read)


def plan_fused(checkpoint: Any, source: ModelSource, *, dtype: str | None,
               folder: DcpFolder | None = None, adapter: str | None = None,
               lora_config: Any = None, base: Any = None,
               storage_options: dict[str, Any] | None = None) -> FusedWeights:
    """What the fused export of ``source`` (read from ``checkpoint``) will hold, from its
    metadata alone. ``folder``: the DCP folder ``source`` reads, as the merge found it
    (None: ``source`` is a merged file). The rest: as for :func:`~fsdpckpt.export.lora.
    fused_tensors`, whose adapter config lookup this defers to the write.

    Raises:
        NotACheckpointError: the checkpoint holds no LoRA adapter (or several, and none
            is named). OptionError: an unknown ``dtype``. CorruptCheckpointError: a stored
            dtype the output cannot hold.
    """
    checked_dtype(dtype)  # a wrong name fails before anything is read or written
    layout = find_lora(source.names)
    name = pick_adapter(layout, adapter, source.path)
    joined = with_base(source, layout, None if base is None else
                       location(base, storage_options=storage_options))
    if joined is not source:  # base weights from the base model's folder
        source, layout = joined, find_lora(joined.names)
    specs = _fused_specs(source, layout, name, dtype)
    computed = computed_names(layout, name)
    copied, read = {}, set()
    for stored in source.names:
        entry = source.stored_entry(stored)
        plain = layout.plain_name(stored, name)
        if stored not in computed and plain is not None and entry is not None and entry.chunks:
            copied[plain] = entry
        else:
            read.add(stored)
    sizes: Counter[str] = Counter()
    for spec in specs:
        if spec.dtype.is_floating:
            sizes[spec.dtype.name] += spec.nbytes
    exported = sizes.most_common(1)[0][0] if sizes else "float32"
    lookup = {"checkpoint": checkpoint, "lora_config": lora_config, "base": base,
              "storage_options": storage_options}
    return FusedWeights(folder or no_metadata(source.path), source, layout, name, tuple(specs),
                        exported, dtype, lookup, copied, frozenset(read))


def _fused_specs(source: ModelSource, layout: LoraLayout, adapter: str,
                 dtype: str | None) -> list[TensorSpec]:
    # Each plain name, in stored order, with its shape and its dtype after the cast to
    # ``dtype`` (floating-point tensors only).
    target = parse_dtype(dtype)
    specs = []
    for stored in source.names:
        plain = layout.plain_name(stored, adapter)
        if plain is None:
            continue
        stored_dtype = dtype_from_name(source.dtypes[stored])
        cast = target is not None and stored_dtype is not None and stored_dtype.is_floating
        found = target if cast else stored_dtype
        if found is None:
            raise CorruptCheckpointError(f"{stored}: dtype {source.dtypes[stored]} cannot be "
                                         "written")
        specs.append(TensorSpec(plain, (plain,), found, source.shapes[stored]))
    return specs
