"""Walks over decoded pickle values: linear in the pickle's size, never recursive.

A pickle is a program for building a graph, not a tree: its memo (``BINGET``) lets a few
bytes reference one container again and again. 34 levels of ``{"a": d, "b": d}`` take
1,500 bytes and hold 2**34 paths; a walk that follows every path never ends, and a list
nested 200,000 deep takes 400 KB and ends any recursive walk in a RecursionError. Every
walk over a value decoded from a checkpoint goes through this module:

- :func:`measure` visits each container once (by identity) and gives the size of the tree
  a recursive consumer would see (each shared container counted once per reference) and
  its depth, refusing a value that contains itself, nests too deep, or expands to more
  nodes than :func:`node_budget` allows for the pickle's size. A value that passes can be
  encoded, compared and copied by recursive code in time linear in the pickle's size;
- :func:`tree_items` flattens a state dict into key paths, refusing a container reached
  by two key paths (a state dict's keys form a tree; tensors may be shared, containers are not);
- :func:`bounded_repr` shows a value in a bounded number of characters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from fsdpckpt.errors import NotACheckpointError

__all__ = ["Measure", "MAX_DEPTH", "node_budget", "measure", "tree_items", "bounded_repr"]

#: Deepest nesting of containers a decoded value may have. Honest ones (an optimizer's
#: param_groups, a step count) nest a few levels.
MAX_DEPTH = 40

_CONTAINERS = (dict, list, tuple, set, frozenset)


class Measure(NamedTuple):
    """The tree a recursive walk of a value sees: ``nodes`` (containers and leaves, each
    shared object counted once per reference) and ``depth`` (containers nested)."""

    nodes: int
    depth: int


def node_budget(pickle_bytes: int) -> int:
    """The most tree nodes a value decoded from ``pickle_bytes`` bytes of pickle may expand
    to. Each object of an honest pickle costs at least one opcode byte, and a shared one (a
    tensor tied to two keys, a ``betas`` tuple in every param group) costs two bytes per
    reference: eight nodes a byte leaves honest files far inside it, and a few hundred bytes
    of memo references far outside it."""
    return 1024 + 8 * max(0, pickle_bytes)


def _children(node: Any) -> Any:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    return node


def measure(value: Any, *, source: str, budget: int, max_depth: int = MAX_DEPTH) -> Measure:
    """Measure ``value`` by one post-order walk that visits each container once.

    Args:
        value: a decoded value; only dicts, lists, tuples, sets and frozensets are entered.
        source: what to name in errors (the file, and the key).
        budget: the most nodes the expanded tree may have (see :func:`node_budget`).
        max_depth: the deepest nesting allowed.

    Raises:
        NotACheckpointError: the value contains itself, nests deeper than ``max_depth``, or
            expands to more than ``budget`` nodes; one line naming ``source``.
    """
    if not isinstance(value, _CONTAINERS):
        return Measure(1, 0)
    done: dict[int, Measure] = {}
    active: set[int] = set()
    # (container, its children, index of the next child, nodes so far, deepest child)
    stack: list[tuple[Any, list[Any], int, int, int]] = []

    def enter(node: Any) -> None:
        if id(node) in active:
            raise NotACheckpointError(
                f"{source}: holds a value that contains itself; no "
                "state dict does, so the file is damaged or crafted"
            )
        if len(stack) >= max_depth:
            raise NotACheckpointError(
                f"{source}: holds values nested more than {max_depth} "
                "levels deep; no state dict does, so the file is "
                "damaged or crafted"
            )
        active.add(id(node))
        stack.append((node, list(_children(node)), 0, 1, 0))

    enter(value)
    while True:
        node, children, index, nodes, deepest = stack[-1]
        if index < len(children):
            child = children[index]
            stack[-1] = (node, children, index + 1, nodes, deepest)
            if not isinstance(child, _CONTAINERS):
                stack[-1] = (node, children, index + 1, nodes + 1, deepest)
            elif (known := done.get(id(child))) is not None:
                stack[-1] = (
                    node,
                    children,
                    index + 1,
                    nodes + known.nodes,
                    max(deepest, known.depth),
                )
            else:
                enter(child)
            if stack[-1][3] > budget:
                _too_large(source, budget)
            continue
        stack.pop()
        active.discard(id(node))
        result = Measure(nodes, deepest + 1)
        done[id(node)] = result
        if result.depth + len(stack) > max_depth:
            raise NotACheckpointError(
                f"{source}: holds values nested more than {max_depth} "
                "levels deep; no state dict does, so the file is "
                "damaged or crafted"
            )
        if not stack:
            return result
        parent, siblings, at, total, parent_deepest = stack[-1]
        stack[-1] = (parent, siblings, at, total + nodes, max(parent_deepest, result.depth))
        if total + nodes > budget:
            _too_large(source, budget)


def _too_large(source: str, budget: int) -> None:
    raise NotACheckpointError(
        f"{source}: holds containers that reference each other over and over (a shared-"
        f"reference graph that stands for more than {budget:,} values, from a small pickle); "
        "no state dict does, so the file is damaged or crafted"
    )


def tree_items(
    value: dict[Any, Any],
    *,
    is_branch: Callable[[Any], bool],
    source: str,
    max_depth: int = MAX_DEPTH,
) -> list[tuple[tuple[Any, ...], Any]]:
    """``(key path, leaf)`` for every leaf of the state dict ``value``, in order.

    Dicts are always branches (their keys become path parts, non-str/int keys as their
    ``str``); other values are branches where ``is_branch`` says so (their items indexed).
    Each branch is entered once: a branch reached by a second key path is refused, so the
    work is linear in the size of ``value``. Leaves may be shared.

    Raises:
        NotACheckpointError: a branch reached twice, or nesting deeper than ``max_depth``.
    """
    out: list[tuple[tuple[Any, ...], Any]] = []
    seen: dict[int, tuple[Any, ...]] = {}
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict) and not is_branch(node):
            out.append((path, node))
            continue
        if id(node) in seen:
            first, again = ".".join(map(str, seen[id(node)])), ".".join(map(str, path))
            raise NotACheckpointError(
                f"{source}: '{bounded_repr(again)[1:-1]}' is the same container as "
                f"'{bounded_repr(first)[1:-1]}'; a state dict's keys form a tree, so the "
                "file is damaged or crafted"
            )
        if len(path) >= max_depth:
            raise NotACheckpointError(
                f"{source}: the state dict nests more than {max_depth} "
                "levels deep; the file is damaged or crafted"
            )
        seen[id(node)] = path
        if isinstance(node, dict):
            items = [(k if isinstance(k, (str, int)) else str(k), v) for k, v in node.items()]
        else:
            items = list(enumerate(node))
        stack.extend(((*path, k), v) for k, v in reversed(items))
    return out


def is_leaf_list(value: Any) -> bool:
    """DCP's rule (``_traverse.traverse_state_dict``): a list is a leaf unless it holds a
    dict or a list that is not a leaf; dicts never are, and everything else always is.
    Each list is looked at once (memo by identity), without recursion."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    leaf: dict[int, bool] = {}
    stack: list[tuple[list[Any], bool]] = [(value, False)]
    while stack:
        node, expanded = stack.pop()
        inner = [v for v in node if isinstance(v, list)]
        if any(isinstance(v, dict) for v in node):
            leaf[id(node)] = False
        elif expanded:  # a list inside itself counts as a leaf here; measure() refuses it
            leaf[id(node)] = all(leaf.get(id(v), True) for v in inner)
        elif id(node) not in leaf:
            leaf[id(node)] = True
            stack.append((node, True))
            stack.extend((v, False) for v in inner if id(v) not in leaf)
    return leaf[id(value)]


_SCALARS = (bool, int, float, complex, type(None), str, bytes, bytearray)


def bounded_repr(value: Any, limit: int = 80) -> str:
    """A ``repr`` of an untrusted value in at most ``limit`` characters, built without
    recursion and stopping at the limit, so a shared or deep graph costs ``limit`` steps.
    Stand-ins with a ``kind`` show as ``<kind state>``; other objects by their type."""
    parts: list[str] = []
    length = 0
    # Work items: a str is emitted as is; anything else is rendered.
    stack: list[Any] = [_Value(value)]
    while stack and length <= limit:
        item = stack.pop()
        if isinstance(item, str):
            text = item
        else:
            text, more = _render(item.value, limit)
            stack.extend(reversed(more))
        parts.append(text)
        length += len(text)
    text = "".join(parts)
    return text if len(text) <= limit and not stack else text[: limit - 3] + "..."


class _Value:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _render(value: Any, limit: int) -> tuple[str, list[Any]]:
    """The text ``value`` starts with, and the work items that follow it."""
    if isinstance(value, _SCALARS):
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value.bit_length() > 4 * limit
        ):
            return f"<a {value.bit_length()}-bit integer>", []
        if isinstance(value, (str, bytes, bytearray)) and len(value) > limit:
            return repr(value[:limit]), []
        return repr(value), []
    if isinstance(value, type):
        return repr(value), []
    if isinstance(value, _CONTAINERS):
        if isinstance(value, dict):
            open_, close = "{", "}"
            items: list[Any] = []
            for key, item in value.items():
                items += [", " if items else "", _Value(key), ": ", _Value(item)]
                if len(items) > limit:
                    break
        else:
            open_, close = {list: ("[", "]"), tuple: ("(", ")")}.get(type(value), ("{", "}"))
            if isinstance(value, (set, frozenset)):
                open_ = f"{type(value).__name__}({{"
                close = "})"
            items = []
            for item in value:
                items += [", " if items else "", _Value(item)]
                if len(items) > limit:
                    break
            if isinstance(value, tuple) and len(value) == 1:
                items.append(",")
        return open_, [*items, close]
    kind = getattr(type(value), "kind", None)
    if isinstance(kind, str):
        return f"<{kind} ", [_Value(getattr(value, "state", None)), ">"]
    return f"<{type(value).__name__}>", []
