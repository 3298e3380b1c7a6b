"""Parsing JSON that comes from a file, so that no input escapes as a builtin error.

``json.loads`` raises JSONDecodeError on bad text, UnicodeDecodeError on bad bytes,
ValueError on an integer of more than 4300 digits, and RecursionError on deeply nested
arrays; and a document nested just below the interpreter's limit parses, then makes any
recursive walk over it fail. :func:`parse_json` turns all of them into one ValueError with
a one-line message and refuses nesting deeper than any file fsdpckpt reads needs;
:func:`loads_json` raises fsdpckpt's error naming the file.
"""

from __future__ import annotations

import json
from typing import Any

from fsdpckpt.errors import CorruptCheckpointError, FsdpCkptError

__all__ = ["MAX_JSON_DEPTH", "loads_json", "parse_json"]

#: Deepest nesting accepted. fsdpckpt's own documents (indexes, key paths, encoded
#: objects, manifests) nest a few levels per level of the state dict.
MAX_JSON_DEPTH = 100


def _depth(value: Any) -> int:
    """The nesting depth of a parsed document, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in node)
    return deepest


def parse_json(text: str | bytes) -> Any:
    """``json.loads(text)``, whose every failure is a ValueError with a one-line message.

    Raises:
        ValueError: not JSON, not UTF-8, or nested deeper than :data:`MAX_JSON_DEPTH`.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg} at line {exc.lineno} column "
                         f"{exc.colno} (char {exc.pos})") from None
    except (ValueError, TypeError) as exc:  # bad UTF-8, an integer too long to convert
        lines = str(exc).splitlines() or [type(exc).__name__]
        raise ValueError(f"not valid JSON: {lines[0][:200]}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def loads_json(text: str | bytes, *, source: str,
               error: type[FsdpCkptError] = CorruptCheckpointError) -> Any:
    """:func:`parse_json`, raising ``error`` naming ``source`` (a file) instead.

    Raises:
        FsdpCkptError: ``error``: "{source}: ... (why); the file is damaged ...".
    """
    try:
        return parse_json(text)
    except ValueError as exc:
        raise error(f"{source}: {exc}; the file is damaged or was not written as JSON.") \
            from None
