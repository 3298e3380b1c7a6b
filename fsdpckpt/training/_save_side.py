"""The files ``save_pretrained`` writes beside the weights: the config (from ``base`` as
export-hf finds it, or the model's own), generation config, tokenizer, processor and chat
template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from fsdpckpt.errors import CheckpointNotFoundError
from fsdpckpt.export._config import (
    CONFIG,
    GENERATION_CONFIG,
    config_bytes,
    find_side_files,
    read_config,
    strip_fsdp_prefix,
)

__all__ = ["Side", "side_files", "unwrapped", "peft_root", "training_config_files"]

#: Wrappers are a few deep (DDP, FSDP1, torch.compile); a longer chain is a cycle.
_DEPTH = 8


def _innermost(model: Any) -> Any:
    # Under DDP and FSDP1 (``.module``) and torch.compile (``._orig_mod``). FSDP1 forwards
    # unknown attributes to the module it wraps, so the wrapper itself seems to have a
    # config: it is looked through first.
    for _ in range(_DEPTH):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None or not callable(getattr(inner, "state_dict", None)):
            return model
        model = inner
    return model


def peft_root(model: Any) -> Any:
    """The PEFT model under DDP / FSDP1 / ``torch.compile`` wrappers, or None."""
    model = _innermost(model)
    return model if hasattr(model, "peft_config") else None


def unwrapped(model: Any) -> Any:
    """The model the user built (its class names the architecture): under DDP / FSDP1
    and ``torch.compile``, and the base model of a PEFT model."""
    model = _innermost(model)
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


@dataclass(frozen=True)
class Side:
    """The files beside the weights.

    Attributes:
        config: the config as read (``exported_config`` fixes it for the weights).
        config_from: where it came from. copied: ``(source path, name)`` of each file
            copied from ``base``. made: ``(name, bytes)`` of each file made from the model.
    """

    config: dict[str, Any]
    config_from: Any
    copied: tuple[tuple[Any, str], ...]
    made: tuple[tuple[str, bytes], ...]
    no_tokenizer: str | None = None  # one line, where no tokenizer is written


def _own_generation(inner: Any) -> list[tuple[str, bytes]]:
    # The model's generation config, as transformers' save_pretrained writes it: where the
    # model generates (can_generate()).
    generation = getattr(inner, "generation_config", None)
    can_generate = getattr(inner, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        return [(GENERATION_CONFIG, generation.to_json_string(use_diff=True).encode())]
    return []


def _own_config(inner: Any) -> dict[str, Any] | None:
    """The model's own Hugging Face config as a document, or None where it has none."""
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    doc = json.loads(config.to_json_string(use_diff=False))
    # As transformers' save_pretrained: the config names the class that is saved.
    doc["architectures"] = [strip_fsdp_prefix(type(inner).__name__)]
    return cast(dict[str, Any], doc)


def _model_side(model: Any, output: Any) -> Side:
    inner = unwrapped(model)
    doc = _own_config(inner)
    if doc is None:
        raise CheckpointNotFoundError(
            f"{output}: the model has no Hugging Face config (model.config) to write beside "
            "the weights; pass base= with the model folder the run started from")
    return Side(doc, output / CONFIG, (), tuple(_own_generation(inner)),
                "no tokenizer: without base= none is written; to include one, pass base= with "
                "the model folder the run started from")


def side_files(model: Any, base: Any, output: Any) -> Side:
    """From ``base`` (export-hf's :func:`~fsdpckpt.export._config.find_side_files`: config,
    generation config, tokenizer, processor, chat templates), else the model's own
    ``config`` (``to_json_string(use_diff=False)``, ``architectures`` its class) and
    generation config, without a tokenizer. Where ``base`` holds no generation config, the
    model's own is written (as transformers' ``save_pretrained``), else the one made from
    the config.

    Raises:
        CheckpointNotFoundError: no ``base`` and no config on the model; ``base`` lacks a
            config (one without a tokenizer gives none: :attr:`Side.no_tokenizer`).
    """
    if base is None:
        return _model_side(model, output)
    files = find_side_files(base, base)
    made = files.made
    if all(name != GENERATION_CONFIG for _, name in files.copied):  # the model's own first
        made = tuple(_own_generation(unwrapped(model))) or made
    return Side(read_config(files.config), files.config, files.copied, made,
                files.no_tokenizer)


def training_config_files(model: Any) -> list[tuple[str, bytes]]:
    """What ``save_state`` writes beside a Hugging Face model's checkpoint, as HF Trainer's
    checkpoints hold them: ``config.json`` (the model's own, ``architectures`` its class)
    and its generation config, so that ``export-hf`` of a run trained from a config needs
    no hand-made ``--base``. None for a model without a Hugging Face config."""
    inner = unwrapped(model)
    doc = _own_config(inner)
    return [] if doc is None else [(CONFIG, config_bytes(doc)), *_own_generation(inner)]
