"""Rebuilding nested state dicts from key paths, exactly as DCP does (without torch)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .metadata import KeyPath

__all__ = ["set_element", "unflatten"]


def set_element(root: dict[Any, Any], path: KeyPath, value: Any) -> None:
    """Put ``value`` at ``path`` in ``root``; int keys make lists (DCP's ``set_element``)."""
    container: Any = root
    for prev_key, key in zip(path, path[1:]):
        default: Any = {} if type(key) is str else []
        if isinstance(container, Mapping):
            container = container.setdefault(prev_key, default)
        else:
            while len(container) <= prev_key:
                container.append(None)
            if container[prev_key] is None:
                container[prev_key] = default
            container = container[prev_key]
    key = path[-1]
    if type(key) is int:
        while len(container) <= key:
            container.append(None)
    container[key] = value


def unflatten(items: Iterable[tuple[KeyPath, Any]]) -> dict[Any, Any]:
    """Build the nested dict holding each ``(key_path, value)``."""
    root: dict[Any, Any] = {}
    for path, value in items:
        set_element(root, path, value)
    return root
