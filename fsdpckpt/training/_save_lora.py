"""``save_pretrained`` of a PEFT LoRA model: the adapter as PEFT writes it (``lora="adapter"``),
or the base model with the adapter fused in (``lora="fuse"``), as ``export-hf --lora`` does.

Names, the adapter file's contents and the fusion are export-hf's (:func:`~fsdpckpt.export.
_lora_keys.find_lora`, :meth:`~fsdpckpt.export._lora_keys.LoraLayout.adapter_file_name` /
``plain_name``, :func:`~fsdpckpt.export._lora_fuse.fuse_weight`). Fusing needs the whole
A and B factors of each module (small: rank ``r``); every rank gets them (:func:`gather_full`)
and fuses only its own box of each base weight, one window of rows at a time: the base weight
is never gathered.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from fsdpckpt.errors import MergePlanError
from fsdpckpt.export._lora_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraConfig,
    parse_lora_config,
)
from fsdpckpt.export._lora_fuse import LoraFuser, fuse_weight, pick_adapter
from fsdpckpt.export._lora_keys import LoraLayout, LoraModule, find_lora
from fsdpckpt.merging._keys import clean_key
from fsdpckpt.training._save_plan import SavedTensor, local_tensors, owned_boxes
from fsdpckpt.training._save_write import Elements, elements_of, plain_elements

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "Lora", "find_peft", "adapter_state",
           "fused_state", "gather_full"]

#: PEFT's EMBEDDING_LAYER_NAMES: an adapted one is saved whole in the adapter file.
_EMBEDDING_LAYERS = ("embed_tokens", "lm_head")

_Named = list[tuple[str, str, Any]]
_ElementsOf = dict[str, Callable[[SavedTensor], Elements]]


class Lora:
    """A PEFT model's LoRA structure: the layout by clean names, the stored key of each,
    the adapter saved, and its config (from the live ``peft_config``)."""

    def __init__(self, model: Any, state: Mapping[str, Any], layout: LoraLayout) -> None:
        self.layout = layout
        self.keys = {clean_key(k): k for k in state}
        active = getattr(model, "active_adapter", None)
        self.adapter = pick_adapter(layout, active if len(layout.adapters) > 1 and
                                    isinstance(active, str) else None)
        configs = getattr(model, "peft_config", None) or {}
        if self.adapter not in configs:
            raise MergePlanError(f"the model holds LoRA adapter '{self.adapter}' but no "
                                 "peft_config for it; save the PeftModel itself")
        doc = configs[self.adapter].to_dict()
        # As PEFT's save_pretrained: sets as lists (sorted, so every save says the same),
        # and the saved adapter is for inference.
        self.document = {k: sorted(v) if isinstance(v, set) else v for k, v in doc.items()}
        self.document["inference_mode"] = True
        self.config: LoraConfig = parse_lora_config(self.document, source="model.peft_config")

    @property
    def modules(self) -> list[LoraModule]:
        return [m for m in self.layout.modules if m.adapter == self.adapter]

    def config_bytes(self) -> bytes:
        """``adapter_config.json`` as PEFT writes it (indented, sorted keys)."""
        return json.dumps(self.document, indent=2, sort_keys=True, default=str).encode()


def find_peft(model: Any, state: Mapping[str, Any]) -> Lora | None:
    """The model's LoRA structure, or None when it has no LoRA adapter."""
    layout = find_lora(clean_key(k) for k in state)
    return Lora(model, state, layout) if layout.modules else None


def gather_full(state: Mapping[str, Any], keys: list[str], rank: int) -> dict[str, Any]:
    """Collective: the whole tensor of each of ``keys`` (small ones: LoRA factors), on
    every rank. Each box goes in once, by the rank that writes it, and the buffers are
    summed as integers of the same width, so the bits travel as they are (``-0.0`` too)."""
    import torch
    import torch.distributed as dist

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    full = {}
    for key in sorted(keys):  # the same order on every rank
        value = state[key]
        held = local_tensors(value)
        device = held[0].device if held else "cpu"
        buffer = torch.zeros(tuple(value.shape), dtype=value.dtype, device=device)
        for local, box in owned_boxes(key, value, rank):
            where = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
            buffer[where] = held[local].detach()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(buffer.view(ints[buffer.element_size()]))
        full[key] = buffer.cpu()
    return full


def adapter_state(lora: Lora, state: Mapping[str, Any]) -> _Named:
    """``(key, name in adapter_model.safetensors, value)`` of what PEFT's ``save_pretrained``
    saves, in state-dict order: the adapter's tensors, and the base weights of an adapted
    embedding layer (``save_embedding_layers="auto"``)."""
    embedding = {n for m in lora.modules if m.name.rsplit(".", 1)[-1] in _EMBEDDING_LAYERS
                 for n in (m.weight, m.bias) if n}
    named = []
    for name, key in lora.keys.items():
        saved = name if name in embedding else \
            lora.layout.adapter_file_name(name, lora.adapter)
        if saved is not None:
            named.append((key, saved, state[key]))
    return named


def fused_state(lora: Lora, state: Mapping[str, Any], full: Mapping[str, Any]
                ) -> tuple[_Named, _ElementsOf]:
    """The plain model's ``(key, name, value)`` in state-dict order, and how each
    tensor's elements are made: adapted weights and LoRA biases fused on this rank's boxes
    (:func:`fuse_weight`, in fp32, then cast), the others as they are."""
    factors = {name: full[lora.keys[name]] for m in lora.modules for name in m.adapter_keys}
    LoraFuser(lora.layout, lora.config, factors, adapter=lora.adapter)  # its checks: ranks...
    by_weight = {m.weight: m for m in lora.modules}
    by_bias = {m.bias: m for m in lora.modules if m.bias and m.lora_b_bias}
    named: _Named = []
    elements: _ElementsOf = {}
    for name, key in lora.keys.items():
        plain = lora.layout.plain_name(name, lora.adapter)
        if plain is None:  # an adapter tensor, or the original of a modules_to_save copy
            continue
        value = state[key]
        named.append((key, plain, value))
        module = by_weight.get(name) or by_bias.get(name)
        if module is None:
            elements[key] = partial(plain_elements, value)
            continue
        scaling = lora.config.scaling_of(module.name, factors[module.lora_a].shape[0])
        make = _fused_weight if name == module.weight else _fused_bias
        elements[key] = partial(make, value, module, factors, scaling, lora.config)
    return named, elements


def _fused_weight(value: Any, module: LoraModule, factors: Mapping[str, Any], scaling: float,
                  config: LoraConfig, saved: SavedTensor) -> Elements:
    import torch

    held, boxes = local_tensors(value), dict(saved.boxes)
    a, b = factors[module.lora_a], factors[module.lora_b]
    magnitude = factors[module.magnitude] if module.magnitude else None
    transposed = config.fan_in_fan_out or module.embedding  # rows index A's columns
    dtype = getattr(torch, saved.dtype.name)

    def elements(local: int, start: int, stop: int) -> Any:
        weight, box = held[local].detach(), boxes[local]
        cols = weight.shape[1]
        first, last = start // cols, -(-stop // cols)  # the rows this window touches
        rows = slice(box.offsets[0] + first, box.offsets[0] + last)
        columns = slice(box.offsets[1], box.offsets[1] + box.sizes[1])
        part_a, part_b = (a[:, rows], b[columns]) if transposed else (a[:, columns], b[rows])
        scale = None
        if magnitude is not None:  # DoRA normalizes whole output rows: they must be here
            whole = saved.shape[0 if config.fan_in_fan_out else 1]
            if box.sizes[0 if config.fan_in_fan_out else 1] != whole:
                raise MergePlanError(f"{saved.key}: DoRA fusion needs whole rows of the "
                                     "weight, but it is sharded across them; save with "
                                     "lora='adapter'")
            scale = magnitude[columns] if config.fan_in_fan_out else magnitude[rows]
        fused = fuse_weight(weight[first:last].to(part_a.device), part_a, part_b, scaling,
                            fan_in_fan_out=config.fan_in_fan_out, magnitude=scale,
                            embedding=module.embedding)
        skip = first * cols
        return fused.reshape(-1)[start - skip:stop - skip].to(dtype).cpu().contiguous()

    return elements


def _fused_bias(value: Any, module: LoraModule, factors: Mapping[str, Any], scaling: float,
                config: LoraConfig, saved: SavedTensor) -> Elements:
    import torch

    held, boxes = local_tensors(value), dict(saved.boxes)
    bias = factors[str(module.lora_b_bias)]
    dtype = getattr(torch, saved.dtype.name)

    def elements(local: int, start: int, stop: int) -> Any:
        at = boxes[local].offsets[0]
        mine = elements_of(held[local], start, stop).float().cpu()
        return (mine + bias[at + start:at + stop].float() * scaling).to(dtype).contiguous()

    return elements
