"""Output names for merged tensors: wrapper cleanup and name filters. Pure functions.

A tensor has two names: the one its checkpoint stores (``model.0.weight``, as ``inspect``
lists it: the part's top-level key and any wrapper segments) and the one ``merge`` writes
(``0.weight``). :func:`select` is the one name filter of every verb (inspect ``--name``,
merge ``--include``/``--exclude``, diff ``--name``): a pattern matches either name, so
what a user copies from one verb's output selects the same tensors in every other verb.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from fsdpckpt.dcp.metadata import KeyPath

__all__ = ["WRAPPER_SEGMENTS", "clean_key", "no_match_hint", "output_name", "select",
           "shares_top_key"]

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


def _matches(pattern: str, forms: Sequence[str], substring: bool) -> bool:
    # Without a wildcard, ``--name layers.0.`` is a substring; a glob matches whole names.
    if substring and not any(ch in pattern for ch in "*?["):
        return any(pattern in form for form in forms)
    return any(fnmatch.fnmatchcase(form, pattern) for form in forms)


def select(name: str, *also: str, include: Iterable[str] = (), exclude: Iterable[str] = (),
           substring: bool = False) -> bool:
    """Whether a tensor passes the ``include`` patterns (any; all pass when none) and no
    ``exclude`` pattern, each matched against every name the tensor goes by: ``name`` (its
    output name, as merge writes it) and ``also`` (its stored name, as inspect lists it).

    Patterns are globs, matched case-sensitively against whole names; with ``substring``
    (inspect's and diff's ``--name``) a pattern without ``*?[`` matches any name holding it.

    Example:
        >>> select("0.weight", "model.0.weight", include=["model.0.*"])
        True
        >>> select("0.weight", "model.0.weight", exclude=["0.*"])
        False
    """
    forms = (name, *(form for form in also if form != name))
    include, exclude = list(include), list(exclude)
    if include and not any(_matches(p, forms, substring) for p in include):
        return False
    return not any(_matches(p, forms, substring) for p in exclude)


def no_match_hint(names: Sequence[tuple[str, str]], shown: int = 4) -> str:
    """The names a user can pick from when a filter left no tensor: ``names`` holds each
    tensor's ``(output name, stored name)``; both forms are listed, as either is accepted.

    Example:
        >>> no_match_hint([("0.weight", "model.0.weight")])
        "its 1 tensor is named '0.weight' (stored as 'model.0.weight')"
    """
    if not names:
        return "it holds no tensor"

    def listed(forms: Sequence[str]) -> str:
        return ", ".join(f"'{n}'" for n in forms[:shown]) + (", ..." if len(forms) > shown else "")

    out, stored = [n for n, _ in names], [s for _, s in names]
    said = f"its {len(names)} tensors are named" if len(names) != 1 else "its 1 tensor is named"
    return f"{said} {listed(out)}" + (f" (stored as {listed(stored)})" if stored != out else "")
