"""``load_pretrained``: Hugging Face weights into a sharded model, each rank reading its own bytes.

Accelerate's ``fsdp2_load_full_state_dict`` and transformers' ``fsdp_cpu_ram_efficient_loading``
have rank 0 read the whole model and broadcast it. Here every rank asks the model where its
own pieces lie (``get_model_state_dict``: a DTensor's box, a ShardedTensor's local shards, a
plain tensor whole) and reads exactly those elements from the weight files by offset, in
bounded boxes, straight into the pieces: no rank holds the whole model, nothing is broadcast.

Mechanism: :mod:`fsdpckpt.training._pretrained_source` finds and checks the files,
:mod:`fsdpckpt.training._pretrained_read` places the pieces and fills them,
:mod:`fsdpckpt.training._hf_names` maps the model's keys to the files' names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from fsdpckpt._io.rawio import reusing_scratch
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.storage import Place
from fsdpckpt.errors import OptionError, StateMismatchError
from fsdpckpt.training._buffers import recompute_buffers
from fsdpckpt.training._dist import everywhere
from fsdpckpt.training._hf_names import align_prefix, hf_name
from fsdpckpt.training._pretrained_model import ClassHints, class_hints, tied_keys
from fsdpckpt.training._pretrained_read import Piece, local_pieces, same_values
from fsdpckpt.training._pretrained_read import fill as fill_piece
from fsdpckpt.training._pretrained_source import OpenFiles, Stored, read_source, verify
from fsdpckpt.training._statecheck import Comparison, ShapeMismatch, mismatch_message
from fsdpckpt.training.state import LoadResult

__all__ = ["load_pretrained"]


@dataclass
class _Plan:
    """What this rank loads: each model key's source weight and its pieces here."""

    sources: dict[str, Stored] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    comparison: Comparison = field(default_factory=Comparison)


def load_pretrained(model: Any, source: str | os.PathLike[str] | RemotePath, *,
                    strict: bool = True, buffers: str = "init",
                    storage_options: dict[str, Any] | None = None) -> LoadResult:
    """Load Hugging Face weights into ``model``, every rank reading only its own shards' bytes.

    Call it on every rank, after wrapping (``fully_shard``, FSDP1, DDP, tensor parallel) and
    after ``model.to_empty(device=...)`` for a model built on the meta device. Each rank
    reads from the files exactly the elements of its own pieces, by offset, in boxes of at
    most 32 MB, cast to each parameter's dtype as ``Tensor.to`` casts: no rank holds the
    whole model and nothing is broadcast (an FSDP1 model's pieces then go in through
    ``set_model_state_dict``, which gathers one parameter at a time).

    Names: wrapper segments (FSDP, activation checkpointing, ``_orig_mod.``) are dropped; a
    PEFT model's base weights load from the plain model's names (``base_model.model.`` and
    ``.base_layer`` dropped) and its adapters keep their initialization (neither missing nor
    loaded). Tied weights (one parameter under two names, as ``tie_word_embeddings``
    makes them) load from whichever name the file holds; a file holding both with different
    values is refused (transformers would untie them, which a model already built tied
    cannot hold): build the model with ``tie_word_embeddings=False`` instead. As
    ``from_pretrained``, weights saved from the base model load into a model with a head and
    back (``base_model_prefix``), and the names its class ignores when missing or unexpected
    are ignored.

    Non-persistent buffers (a rotary embedding's ``inv_freq``: in no weight file) are set as
    the model's initialization gives them, as ``from_pretrained`` does (transformers'
    ``_init_weights`` of the Hugging Face model holding them, run on stand-ins): after
    ``to_empty()`` they would hold whatever memory held. A buffer nothing recomputes is
    refused before anything loads, unless ``buffers="keep"``.

    Files are checked before any parameter changes, on every rank, and every rank raises if
    one fails: a safetensors header strictly (a truncated or damaged file is refused), each
    ``.bin`` storage entry read against its zip CRC-32 (read through fsdpckpt's restricted
    unpickler, never ``torch.load``).

    Args:
        model: the model, wrapped or not, its parameters materialized.
        source: a Hugging Face model folder, or its ``model.safetensors``,
            ``pytorch_model.bin`` or ``*.index.json`` (sharded weights): a local path or a
            URL (``s3://bucket/models/llama``).
        strict: refuse, before any parameter changes, a model whose keys or shapes differ
            from the source (one :class:`StateMismatchError` listing them all); with False,
            load the keys that match and list the rest in the result.
        buffers: ``"init"`` (each non-persistent buffer as the model's initialization gives
            it; refused where none recomputes it) or ``"keep"`` (left as the model holds
            it: for a model built with its buffers, not on the meta device).
        storage_options: for URLs, the fsspec filesystem's options, as for ``save_state``.

    Returns:
        A :class:`LoadResult`: ``restored=("model",)``, and with ``strict=False`` the
        ``missing``, ``unexpected`` and ``mismatched`` names.

    Raises:
        StateMismatchError: with ``strict``, keys missing, unexpected or shaped differently;
            a non-persistent buffer nothing recomputes (with ``buffers="init"``).
        CorruptCheckpointError: a damaged or truncated file (ChecksumError: a ``.bin`` whose
            bytes fail their CRC-32); the message names the file.
        OptionError: parameters still on the meta device.

    Example:
        >>> with torch.device("meta"):
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> for layer in model.model.layers:
        ...     fully_shard(layer)
        >>> fully_shard(model)
        >>> model.to_empty(device="cuda")
        >>> fsdpckpt.load_pretrained(model, "s3://models/llama-3-8b")
    """
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    root = location(source, storage_options=storage_options)
    # Before torch is asked for the state dict: torch 2.6's get_model_state_dict of a model
    # on the meta device fails inside, without a process group, on a question of its own.
    on_meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if on_meta is not None:
        raise OptionError(f"model key '{hf_name(on_meta) or on_meta}' is on the meta device: "
                          "it has no memory to load into. Call model.to_empty(device=...) "
                          "after wrapping, then load_pretrained.")
    state = get_model_state_dict(model)
    # Tensors only: a module's extra state (``get_extra_state``) is no Hugging Face weight.
    names = {key: name for key, value in state.items()
             if isinstance(value, torch.Tensor) and (name := hf_name(key)) is not None}
    ties = tied_keys(model, state)
    with OpenFiles() as files, reusing_scratch():
        plan, recomputed = everywhere(lambda: (
            _check(root, state, names, ties, class_hints(model), files, strict),
            recompute_buffers(model, buffers, {k: tuple(v.shape) for k, v in state.items()
                                               if isinstance(v, torch.Tensor)})))
        everywhere(lambda: _fill(plan, files))
    if _is_fsdp1(model):
        # FSDP1's state-dict values are copies of its flat parameters' shards: set them.
        set_model_state_dict(model, {k: state[k] for k in plan.sources},
                             options=StateDictOptions(strict=False))
    recomputed.apply()
    found = plan.comparison
    return LoadResult(None, ("model",), (), missing=tuple(found.missing),
                      unexpected=tuple(found.unexpected),
                      mismatched=tuple(str(m) for m in found.mismatched))


def _check(root: Place, state: dict[str, Any], names: dict[str, str],
           ties: dict[str, list[str]], hints: ClassHints, files: OpenFiles,
           strict: bool) -> _Plan:
    """Read and check the source, match it to the model, check every byte this rank will
    read that records a checksum; raise before anything changes."""
    found = read_source(root)
    # Weights saved from the base model into one with a head, or the other way round.
    stored = {name: found[was] for name, was in
              align_prefix(found, names.values(), hints.prefix).items()}
    plan = _Plan()
    result = plan.comparison
    for key, name in names.items():
        group = [names[k] for k in ties.get(key, [key]) if k in names]
        # One value for every name of a tied parameter: the first the file holds.
        source = next((n for n in group if n in stored), None)
        if source is None:
            if not hints.ignores(name, hints.ignore_missing):
                result.missing.append(key)
            continue
        shape = tuple(state[key].shape)
        if stored[source].shape != shape:
            result.mismatched.append(ShapeMismatch(key, stored[source].shape, shape))
            continue
        plan.sources[key], plan.names[key] = stored[source], source
        plan.pieces[key] = local_pieces(key, state[key])
    wanted = set(names.values())
    result.unexpected.extend(n for n in stored if n not in wanted and
                             not hints.ignores(n, hints.ignore_unexpected))
    if strict and result:
        raise StateMismatchError(mismatch_message(root, result))
    for key, pieces in plan.pieces.items():
        if not any(t.numel() for t, _ in pieces):
            continue
        verify(files, plan.sources[key])
        own = stored.get(names[key])
        if own is not None and own is not plan.sources[key]:
            verify(files, own)
            if not same_values(pieces, own, plan.sources[key], files):
                raise StateMismatchError(
                    f"{root}: '{names[key]}' and '{plan.names[key]}' are tied in the model "
                    "(one parameter, or the config's tie_word_embeddings) but different "
                    "tensors in the file. Nothing was loaded. Build the model untied "
                    "(tie_word_embeddings=False) to load both.")
    return plan


def _fill(plan: _Plan, files: OpenFiles) -> None:
    for key, stored in plan.sources.items():
        for piece in plan.pieces[key]:
            fill_piece(piece, stored, files)


def _is_fsdp1(model: Any) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
