"""Rebuilding nested state dicts from key paths, exactly as DCP does (without torch)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fsdpckpt.dcp.metadata import KeyPath
from fsdpckpt.errors import NotACheckpointError

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
        slot = _slot(container, prev_key, path)
        if slot not in container if isinstance(container, dict) else container[slot] is None:
            container[slot] = {} if type(key) is str else []
        container = container[slot]
    container[_slot(container, path[-1], path)] = value


def _slot(container: Any, key: str | int, path: KeyPath) -> str | int:
    """``key``, checked to address ``container`` (a list grows to hold an int index).

    Raises:
        NotACheckpointError: a name used on a list, or anything used on a value: two key
            paths that cannot both hold (one runs through the other's value).
    """
    if isinstance(container, dict):
        return key
    if isinstance(container, list) and type(key) is int:
        while len(container) <= key:
            container.append(None)
        return key
    raise NotACheckpointError(
        f"the key path {list(path)} runs through another entry's value, or uses a name on a "
        "list: two key paths that cannot both hold, so they are damaged or crafted")


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
