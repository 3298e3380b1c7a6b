"""``save_pretrained``: a sharded model, from training code, to a folder ``from_pretrained``
loads as it is, every rank writing only its own shards' bytes.

What is written is what ``fsdpckpt export-hf`` writes for a ``save_state`` of the same model,
byte for byte: the same files (one ``model.safetensors``, or shards and their index, split
by ``max_shard_size``), the same headers and offsets, the same cast, the names transformers'
own ``save_pretrained`` writes (MoE experts per expert, :mod:`fsdpckpt.training._save_moe`),
tied targets left out as the config says, and the config (``architectures`` without
FSDP2's prefix, the dtype field), generation config, tokenizer and chat template beside
them (export-hf's own functions plan all of it: :mod:`fsdpckpt.training._save_plan`).

No rank gathers: each computes, from its shards' placements alone, which boxes of which
tensors it writes (a replicated value by one rank only), and writes them at their offsets
of the shared files (:mod:`fsdpckpt.training._save_write`) through the spread-file protocol
(:mod:`fsdpckpt._io.spread`): staged, committed by rank 0 once every rank finished, nothing
visible if any rank failed, and then every rank raises.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fsdpckpt._io import storage
from fsdpckpt._io.remote import RemotePath, location
from fsdpckpt._io.spread import spread_folder
from fsdpckpt._io.spread_local import Exchange
from fsdpckpt.errors import ExportMismatchError, MergePlanError, NotACheckpointError
from fsdpckpt.export._config import (
    CONFIG,
    config_bytes,
    exported_config,
    side_file_bytes,
    strip_fsdp_prefix,
)
from fsdpckpt.export._model import tied_without_transformers
from fsdpckpt.export.hf import ExportResult
from fsdpckpt.export.lora import AdapterExport
from fsdpckpt.merging._keys import clean_key
from fsdpckpt.merging._outputs import earlier_outputs
from fsdpckpt.merging.writer import output_paths, sigterm_interrupts
from fsdpckpt.training._save_lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    Lora,
    adapter_state,
    find_peft,
    fused_state,
    gather_full,
)
from fsdpckpt.training._save_moe import hub_layout
from fsdpckpt.training._save_plan import (
    SavedTensor,
    SavePlan,
    dcp_order,
    held_chunks,
    local_tensors,
    plan_save,
)
from fsdpckpt.training._save_side import Side, peft_root, side_files, unwrapped
from fsdpckpt.training._save_write import Elements, plain_elements, write_weights

__all__ = ["save_pretrained", "ExportResult"]


def _tied_differ(pairs: dict[str, str], names: dict[str, Any]) -> list[str]:
    # Each tied (target, source) pair whose local shards differ here; every rank tells.
    import torch

    differ = []
    for target, source in sorted(pairs.items()):
        if target in names and source in names:
            mine = local_tensors(names[target])
            theirs = local_tensors(names[source])
            if len(mine) != len(theirs) or not all(
                    a.shape == b.shape and torch.equal(a, b) for a, b in zip(mine, theirs)):
                differ.append(target)
    return differ


def _outline(plan: SavePlan) -> str:
    # What every rank must have planned alike: the files, their sizes and headers.
    text = repr([(f.name, f.size, f.header) for f in plan.files] + [plan.index])
    return hashlib.sha256(text.encode()).hexdigest()



def save_pretrained(model: Any, output: str | os.PathLike[str] | RemotePath, *,
                    base: str | os.PathLike[str] | RemotePath | None = None,
                    dtype: str | Any | None = None, max_shard_size: str | int = "5GB",
                    overwrite: bool = False, lora: str | None = None,
                    storage_options: dict[str, Any] | None = None
                    ) -> ExportResult | AdapterExport:
    """Save a model as a Hugging Face folder, every rank writing only its own shards.

    Call it on every rank (no gather: rank 0 never holds more than its own shards). The
    folder is what ``fsdpckpt export-hf`` makes of a ``save_state`` of the same model, byte
    for byte; ``AutoModelForCausalLM.from_pretrained(output)`` loads it as it is.

    Args:
        model: FSDP2 (``fully_shard``, 1-D or 2-D meshes, tensor-parallel ``Shard`` too),
            FSDP1, DDP or a plain module; a PEFT model under any of them.
        output: the output folder: local (on a file system every rank sees) or a URL
            (``s3://bucket/run/final``).
        base: the Hugging Face model folder the run started from: config, generation
            config, tokenizer and chat template come from there. Default: the model's own
            ``model.config`` (and generation config), without a tokenizer.
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` (or a ``torch.dtype``): cast floating-point
            weights exactly as ``Tensor.to`` does; the config says so too. Default: as held.
        max_shard_size: the largest safetensors file (``"5GB"``, decimal as Hugging Face);
            a model that fits is one ``model.safetensors`` without an index.
        overwrite: replace an earlier output in ``output`` (its weights, config and
            tokenizer files; the other files there are kept). Without it a folder that
            holds files is refused before anything is written.
        lora: for a PEFT LoRA model, required there: ``"adapter"`` writes the adapter as
            PEFT's ``save_pretrained`` does (``adapter_model.safetensors`` and
            ``adapter_config.json``, for ``PeftModel.from_pretrained(base_model, output)``;
            returns an :class:`~fsdpckpt.export.lora.AdapterExport`); ``"fuse"`` writes the
            base model with the adapter fused in (``W + scaling * B @ A`` in fp32, then
            cast, as ``merge_and_unload``), as ``export-hf --lora fuse`` does.
        storage_options: fsspec options for an ``output`` or ``base`` on object storage.

    Returns:
        The :class:`~fsdpckpt.export.hf.ExportResult`, the same on every rank (``source`` is
        the output folder: no checkpoint was read; ``model_class`` the model's class;
        ``names_as_stored`` why the names are not the hub's, as export-hf's).

    Raises:
        OutputExistsError: ``output`` holds files and ``overwrite`` is False.
        CheckpointNotFoundError: no config (the model has none and no ``base``), or
            ``base`` lacks its config (one without a tokenizer gives an export without:
            the result's ``no_tokenizer`` says so).
        NotACheckpointError: a PEFT model without ``lora=``, or ``lora=`` without one.
        ExportMismatchError: the config ties two weights the model holds with other values.
        MergePlanError: an unknown ``dtype``, ``max_shard_size`` or ``lora``.
        DiskFullError, OutputNotWritableError: the output cannot be written.
        FsdpCkptError: another rank failed (the same error where it is fsdpckpt's own).

    Example:
        >>> fsdpckpt.save_pretrained(model, "final", base="llama-3.2-1b", dtype="bf16")
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    start = time.perf_counter()
    exchange = Exchange()
    state: dict[str, Any] = dict(get_model_state_dict(model))  # collective for FSDP1: first
    out = location(output, storage_options=storage_options)
    base_at = location(base, storage_options=storage_options) if base is not None else None
    with sigterm_interrupts():
        found: list[Lora | None] = []
        exchange.agree(lambda: found.append(_check_lora(model, state, lora, out)))
        peft = found[0]
        factors = gather_full(state, [peft.keys[n] for m in peft.modules
                                      for n in m.adapter_keys], exchange.rank) \
            if peft is not None and lora == "fuse" else {}
        # The keys in the order export-hf finds them in a save_state of this model: every
        # rank's list of the chunks it holds (metadata: keys, offsets, sizes) travels.
        order = dcp_order(exchange.agree(lambda: held_chunks(state)))
        state = {key: state[key] for key in order if key in state} | state
        held: list[_Prepared] = []  # this rank's plan; only its digest travels

        def prepare() -> tuple[str, list[str]]:
            held.append(_prepare(model, state, out, base_at, peft, factors,
                                 rank=exchange.rank, dtype=dtype,
                                 max_shard_size=max_shard_size, overwrite=overwrite))
            return _outline(held[0].plan), held[0].differ

        reports = exchange.agree(prepare)
        ready = held[0]
        _refuse_disagreement(reports, ready)
        with spread_folder(out, overwrite=overwrite, commit=ready.made[-1][0]) as target:
            write_weights(target, ready.plan, exchange.rank, ready.elements)
            if exchange.rank == 0:
                for source, name in ready.side.copied if ready.side else ():
                    target.put(name, side_file_bytes(source))
                for name, data in ready.made:  # the config last
                    target.put(name, data)
        # Only now that the new files are in place: an earlier output in another layout,
        # its index first (never seen without its shards).
        exchange.agree(lambda: _remove(ready.stale))
    return _result(ready, out, model, time.perf_counter() - start)


def _check_lora(model: Any, state: dict[str, Any], lora: str | None, out: Any) -> Lora | None:
    # export-hf's rule, in the library's words: a PEFT model says what to do with its adapter.
    if lora not in (None, "adapter", "fuse"):
        raise MergePlanError(f"lora={lora!r}: use 'adapter' (write the LoRA adapter) or "
                             "'fuse' (fuse it into the base weights)")
    peft = find_peft(peft_root(model), state)
    if peft is None and lora is not None:
        raise NotACheckpointError(f"{out}: lora={lora!r}, but the model holds no LoRA adapter "
                                  "(no lora_A/lora_B tensors); save it with lora=None")
    if peft is not None and lora is None:
        raise NotACheckpointError(f"{out}: the model is a PEFT model with LoRA adapters; pass "
                                  "lora='adapter' (write the LoRA adapter) or lora='fuse' "
                                  "(fuse it into the base weights)")
    if peft is not None and lora == "adapter" and \
            peft.document.get("bias", "none") not in ("none", None):
        raise NotACheckpointError(f"adapter config field 'bias' is {peft.document['bias']!r}: "
                                  "the trained base biases are not exported as adapter weights "
                                  "yet; fuse instead (lora='fuse')")
    return peft


@dataclass(frozen=True)
class _Prepared:
    """One rank's plan: the weights, the side files (None for an adapter), the files made
    (the commit file last), tied pairs and those whose values differ here, each tensor's
    elements, (rank 0, with ``overwrite``) the earlier outputs to remove, and why the
    names are not the hub's (export-hf's ``names_as_stored``)."""

    plan: SavePlan
    side: Side | None
    made: list[tuple[str, bytes]]
    tied: dict[str, str]
    differ: list[str]
    elements: dict[str, Callable[[SavedTensor], Elements]]
    stale: list[Any]
    peft: Lora | None
    as_stored: str | None


def _prepare(model: Any, state: dict[str, Any], out: Any, base: Any, peft: Lora | None,
             factors: dict[str, Any], *, rank: int, dtype: Any, max_shard_size: str | int,
             overwrite: bool) -> _Prepared:
    if peft is not None and not factors:  # lora="adapter": PEFT's one file, its config
        plan = plan_save(adapter_state(peft, state), rank=rank, dtype=dtype,
                         max_shard_size=None, out=out, stem=ADAPTER_WEIGHTS.split(".")[0])
        return _Prepared(plan, None, [(ADAPTER_CONFIG, peft.config_bytes())], {}, [],
                         _as_held(state), [], peft, None)
    if peft is not None:
        named, elements = fused_state(peft, state, factors)
    else:
        # Named as export-hf names a save_state's keys: wrapper segments dropped.
        named = [(key, clean_key(key), value) for key, value in state.items()]
        elements = _as_held(state)
    side = side_files(model, base, out)
    # The config's dtype is the plan's (the first plan costs metadata only); with it, the
    # names and tied keys export-hf finds for the config's model class (transformers'
    # hub names: MoE experts per expert, _save_moe); without the class, tied targets
    # follow the config alone, as export-hf decides them then.
    dtype_name = plan_save(named, rank=rank, dtype=dtype, max_shard_size=max_shard_size,
                           out=out).dtype_name
    hub = hub_layout(exported_config(side.config, dtype_name),
                     {name: tuple(value.shape) for _, name, value in named})
    tied = hub.tied if hub.tied is not None else \
        tied_without_transformers(side.config, {name for _, name, _ in named})
    plan = plan_save(named, rank=rank, dtype=dtype, max_shard_size=max_shard_size, out=out,
                     skip=tied.__contains__, pieces=hub.pieces)
    stale: list[Any] = []
    if rank == 0 and overwrite:  # an earlier output of ours in another layout
        new = {str(p) for p in output_paths(plan.merge, out)}
        stale = [p for p in earlier_outputs(plan.merge, out) if str(p) not in new]
    made = [*side.made, (CONFIG, config_bytes(exported_config(side.config, plan.dtype_name)))]
    differ = _tied_differ(tied, {n: v for _, n, v in named}) if peft is None else []
    return _Prepared(plan, side, made, tied, differ, elements, stale, peft, hub.as_stored)


def _as_held(state: dict[str, Any]) -> dict[str, Callable[[SavedTensor], Elements]]:
    # Every tensor's elements as the model holds them (cast only).
    return {key: partial(plain_elements, value) for key, value in state.items()}


def _refuse_disagreement(reports: list[tuple[str, list[str]]], ready: _Prepared) -> None:
    # From what every rank reported, so every rank raises the same error or none.
    if any(outline != reports[0][0] for outline, _ in reports):
        raise MergePlanError("the ranks planned different files; call save_pretrained on "
                             "every rank with the same model and arguments")
    differ = sorted({t for _, found in reports for t in found})
    if differ and ready.side is not None:
        raise ExportMismatchError(
            f"{differ[0]} and {ready.tied[differ[0]]} differ, but {ready.side.config_from} "
            f"ties them (tie_word_embeddings), so {differ[0]} would not be written and the "
            "model would change; tie them in the model, or pass base= with a config that "
            "does not")


def _remove(stale: list[Any]) -> None:
    for path in sorted(stale, key=lambda p: not p.name.endswith(".index.json")):
        storage.remove(path)


def _result(ready: _Prepared, out: Any, model: Any, seconds: float
            ) -> ExportResult | AdapterExport:
    plan = ready.plan
    names = [f.name for f in plan.files] + ([plan.index[0]] if plan.index else [])
    if ready.side is None and ready.peft is not None:
        return AdapterExport(out, (*names, ADAPTER_CONFIG), plan.num_tensors,
                             ready.peft.adapter, len(ready.peft.modules))
    copied = [name for _, name in ready.side.copied] if ready.side else []
    others = copied + [name for name, _ in ready.made]
    return ExportResult(out, out, tuple(out / n for n in names), tuple(out / n for n in others),
                        plan.num_tensors, plan.tensor_bytes, plan.dtype_name,
                        tuple(sorted(ready.tied.items())),
                        ready.side.config_from if ready.side else out / CONFIG,
                        strip_fsdp_prefix(type(unwrapped(model)).__name__), seconds, None,
                        ready.as_stored,
                        no_tokenizer=ready.side.no_tokenizer if ready.side else None)
