"""Rebuilding nested state dicts from key paths, exactly as DCP does (without torch)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.dcp.metadata import KeyPath

__all__ = ["set_element", "unflatten"]


def _check_index(path: KeyPath, limit: int | None) -> None:
    for key in path[1:]:  # the root is a dict whatever its keys
        if type(key) is int and (key < 0 or (limit is not None and key >= limit)):
            raise NotACheckpointError(
                f"the key path {list(path)} holds the list index {key}, but there are only "
                f"{limit} entries; a list that long would be mostly holes, so the key paths "
                "are damaged or crafted")


def set_element(root: dict[Any, Any], path: KeyPath, value: Any, *,
                limit: int | None = None) -> None:
    """Put ``value`` at ``path`` in ``root``; int keys make lists (DCP's ``set_element``).

    Args:
        limit: refuse a list index at or past it (the number of entries being nested:
            no honest list is longer); negative indices are always refused.

    Raises:
        NotACheckpointError: an index is negative or not below ``limit``.
    """
    _check_index(path, limit)
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
    """Build the nested dict holding each ``(key_path, value)``.

    No list grows past the number of items: a larger index is refused.

    Raises:
        NotACheckpointError: a key path holds a negative index or one past the item count.
    """
    entries = list(items)
    root: dict[Any, Any] = {}
    for path, value in entries:
        set_element(root, path, value, limit=len(entries))
    return root
