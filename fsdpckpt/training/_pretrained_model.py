"""What a model says about its weights beyond their names: which keys are one weight under
several names (tied weights), and what its Hugging Face class tells ``from_pretrained``
(:func:`class_hints`: the base model's prefix, the names to ignore when missing or
unexpected).

For ties, two ways say so, and either suffices: the model shares one parameter under both
names (what ``named_parameters(remove_duplicate=False)`` shows, FSDP2 and FSDP1 keep it), and a
Hugging Face model's config (``tie_word_embeddings``: its output embeddings are its input
embeddings). The config is asked too because ``to_empty()`` of a plain module built on the
meta device gives each name its own parameter until ``tie_weights()`` is called.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fsdpckpt.merging._keys import clean_key

__all__ = ["ClassHints", "class_hints", "tied_keys"]


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


@dataclass(frozen=True)
class ClassHints:
    """What the Hugging Face class inside a model tells ``from_pretrained``.

    Attributes:
        prefix: its ``base_model_prefix`` (``model``); "" for none.
        ignore_missing, ignore_unexpected: its ``_keys_to_ignore_on_load_missing`` /
            ``_unexpected`` regular expressions (``attn.bias``: old GPT-2 files hold a
            buffer the class no longer saves).
    """

    prefix: str = ""
    ignore_missing: tuple[str, ...] = ()
    ignore_unexpected: tuple[str, ...] = ()

    def ignores(self, name: str, patterns: tuple[str, ...]) -> bool:
        """Whether ``name`` matches one of ``patterns`` (as transformers, ``re.search``)."""
        return any(re.search(p, name) for p in patterns)


def class_hints(model: Any) -> ClassHints:
    """The :class:`ClassHints` of the outermost Hugging Face model inside ``model``
    (a module with a ``config`` and a string ``base_model_prefix``); empty without one."""
    for module in model.modules():
        prefix = getattr(type(module), "base_model_prefix", None)
        if isinstance(prefix, str) and getattr(module, "config", None) is not None:
            return ClassHints(prefix, _patterns(module, "_keys_to_ignore_on_load_missing"),
                              _patterns(module, "_keys_to_ignore_on_load_unexpected"))
    return ClassHints()


def _patterns(module: Any, name: str) -> tuple[str, ...]:
    found = getattr(module, name, None)  # a list on the class, a set on an instance
    return tuple(sorted(p for p in found if isinstance(p, str))) \
        if isinstance(found, (list, tuple, set, frozenset)) else ()
