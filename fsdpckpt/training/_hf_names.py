"""Which Hugging Face weight a model's state-dict key holds. Pure functions, no torch.

A training model's keys are not the names of the weights in a Hugging Face folder: wrappers
add segments (FSDP1's ``_fsdp_wrapped_module``, activation checkpointing's
``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``), and a PEFT model adds
``base_model.model.`` before every name and ``.base_layer`` inside each adapted module,
beside adapter tensors the Hugging Face folder never holds. :func:`hf_name` undoes all of
that; ``load_pretrained`` reads by it, and a writer of Hugging Face folders names by it.
"""

from __future__ import annotations

from collections.abc import Iterable

from fsdpckpt.export._lora_keys import _ADAPTER, _ORIGINAL, PEFT_PREFIX
from fsdpckpt.merging._keys import clean_key

__all__ = ["hf_name", "align_prefix"]


def hf_name(model_key: str) -> str | None:
    """The name, in a Hugging Face weights file, of the tensor the model key holds.

    ``model_key`` is a key of the model's state dict (``get_model_state_dict`` strips DDP's
    ``module.`` and FSDP's prefixes; any wrapper segment left is dropped here). A PEFT
    model's base weights map to the plain model's names; its adapter tensors (LoRA A and B,
    DoRA magnitudes) are in no Hugging Face model file and map to None. Both copies of a
    ``modules_to_save`` module (``original_module`` and ``modules_to_save.<adapter>``) map
    to the module's own name, so several keys may name one weight.

    Example:
        >>> hf_name("base_model.model.model.layers.0.q_proj.base_layer.weight")
        'model.layers.0.q_proj.weight'
        >>> hf_name("base_model.model.model.layers.0.q_proj.lora_A.default.weight") is None
        True
    """
    name = clean_key(model_key).removeprefix(PEFT_PREFIX)
    adapter = _ADAPTER.match(name)
    if adapter is not None:
        if adapter["kind"] != "modules_to_save":
            return None
        name = f"{adapter['module']}{adapter['rest']}"
    else:
        original = _ORIGINAL.match(name)
        if original is not None:
            name = f"{original['module']}.{original['rest']}"
    return name.replace(".base_layer.", ".")


def align_prefix(stored: Iterable[str], wanted: Iterable[str], prefix: str) -> dict[str, str]:
    """The stored names renamed as ``from_pretrained`` renames them when a model and its
    weights differ by the base model's prefix (``model``, ``transformer``, ``bert``): weights
    saved from the base model (``layers.0...``) into a model with a head (``model.layers.0...``)
    gain it, weights saved with a head into the base model lose it.

    Args:
        stored: the names in the weight files. wanted: the names the model holds.
        prefix: the model class's ``base_model_prefix`` ("" for none).

    Returns:
        ``{name the model knows it by: stored name}``; every name as it is when neither
        applies.

    Example:
        >>> align_prefix(["layers.0.w"], ["model.layers.0.w", "lm_head.w"], "model")
        {'model.layers.0.w': 'layers.0.w'}
    """
    stored, wanted = list(stored), set(wanted)
    lead = f"{prefix}." if prefix else ""
    if lead and not any(n in wanted for n in stored):
        if any(n.startswith(lead) for n in wanted) and \
                not any(n.startswith(lead) for n in stored):
            return {lead + n: n for n in stored}
        if any(n.startswith(lead) for n in stored) and \
                not any(n.startswith(lead) for n in wanted):
            return {n.removeprefix(lead): n for n in stored}
    return {n: n for n in stored}
