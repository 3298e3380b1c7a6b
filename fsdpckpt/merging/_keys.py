"""Output names for merged tensors: wrapper cleanup and name filters. Pure functions."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from fsdpckpt.dcp.metadata import KeyPath

__all__ = ["WRAPPER_SEGMENTS", "clean_key", "output_name", "select", "shares_top_key"]

#: Name segments that wrappers insert: FSDP1, activation checkpointing, torch.compile.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
_WRAPPERS = re.compile(r"(^|\.)(?:" + "|".join(WRAPPER_SEGMENTS) + r")(?=\.|$)")


def clean_key(name: str) -> str:
    """Drop wrapper segments at any depth: ``a._fsdp_wrapped_module.b`` -> ``a.b``.

    Example:
        >>> clean_key("_orig_mod.layers.0._checkpoint_wrapped_module.mlp.weight")
        'layers.0.mlp.weight'
    """
    return _WRAPPERS.sub("", name).lstrip(".")


def shares_top_key(key_paths: Sequence[KeyPath]) -> bool:
    """Whether every entry sits under one top-level key (``{"model": {...}}``), which
    Accelerate's merge drops."""
    firsts = {path[0] for path in key_paths if path}
    return len(firsts) == 1 and all(len(p) > 1 for p in key_paths)


def output_name(key_path: KeyPath, *, strip_top: bool, clean: bool = True) -> str:
    """The merged name of an entry: its key path joined with dots, less the shared top
    key when ``strip_top``, less wrapper segments when ``clean``."""
    name = ".".join(str(k) for k in (key_path[1:] if strip_top else key_path))
    return clean_key(name) if clean else name


def select(name: str, *, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> bool:
    """Whether ``name`` passes the ``--include`` globs (any; all pass when none) and no
    ``--exclude`` glob."""
    include, exclude = list(include), list(exclude)
    if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)
