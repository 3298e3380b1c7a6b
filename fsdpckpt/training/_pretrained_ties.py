"""Which keys of a model's state dict are one weight under several names (tied weights).

Two ways say so, and either suffices: the model shares one parameter under both names (what
``named_parameters(remove_duplicate=False)`` shows, FSDP2 and FSDP1 keep it), and a
Hugging Face model's config (``tie_word_embeddings``: its output embeddings are its input
embeddings). The config is asked too because ``to_empty()`` of a plain module built on the
meta device gives each name its own parameter until ``tie_weights()`` is called.
"""

from __future__ import annotations

from typing import Any

from fsdpckpt.merging._keys import clean_key

__all__ = ["tied_keys"]


def tied_keys(model: Any, state: dict[str, Any]) -> dict[str, list[str]]:
    """Each key of ``state`` (``get_model_state_dict(model)``) that is a tied weight -> all
    the keys of its weight, in the model's order (input embeddings before output ones)."""
    groups: list[list[str]] = []
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = _state_key(model, name)
        if key in state:
            by_param.setdefault(id(param), []).append(key)
    groups += [g for g in by_param.values() if len(g) > 1]
    groups += _config_ties(model, state)
    tied: dict[str, list[str]] = {}
    for group in groups:
        merged = list(dict.fromkeys(k for key in group for k in tied.get(key, [key])))
        for key in merged:
            tied[key] = merged
    return tied


def _state_key(model: Any, name: str) -> str:
    # As get_model_state_dict names it: wrapper segments and DDP's ``module.`` dropped.
    from torch.nn.parallel import DistributedDataParallel

    key = clean_key(name)
    return key.removeprefix("module.") if isinstance(model, DistributedDataParallel) else key


def _config_ties(model: Any, state: dict[str, Any]) -> list[list[str]]:
    """``[input embeddings' key, output embeddings' key]`` of each Hugging Face model inside
    ``model`` whose config ties them."""
    found = []
    names = {id(m): n for n, m in model.named_modules()}
    for module in model.modules():
        config = getattr(module, "config", None)
        inputs = getattr(module, "get_input_embeddings", None)
        outputs = getattr(module, "get_output_embeddings", None)
        if not (getattr(config, "tie_word_embeddings", False) is True and callable(inputs)
                and callable(outputs)):
            continue
        try:
            pair = [inputs(), outputs()]
        except (AttributeError, NotImplementedError):
            continue
        keys = [_state_key(model, f"{names[id(m)]}.weight".lstrip("."))
                for m in pair if m is not None and id(m) in names]
        if len(keys) == 2 and all(k in state for k in keys) and keys[0] != keys[1]:
            found.append(keys)
    return found
