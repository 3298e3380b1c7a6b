"""Non-tensor entries (step counters, param_groups, strings): read safely, kept losslessly.

DCP stores each one as a ``torch.save`` blob. They are read through the
allowlist (plain Python values only) and, for formats that only hold strings
(safetensors metadata), encoded as JSON that keeps tuples, non-string keys,
bytes and non-finite floats apart from their look-alikes.
"""

from __future__ import annotations

import base64
import json
import math
from typing import IO, Any

from .archive import read_archive_pickle
from .errors import NotACheckpointError
from .metadata import ObjectEntry
from .safe_pickle import BUILTIN_GLOBALS

__all__ = ["read_object", "encode_value", "decode_value", "dumps", "loads"]

# Python values pickled by torch.save (protocol 2) name at most these globals.
_OBJECT_GLOBALS = {**BUILTIN_GLOBALS, ("_codecs", "encode"): lambda s, enc="latin1": s.encode(enc)}


def read_object(file: IO[bytes], entry: ObjectEntry, *, source: str) -> Any:
    """Read the value of a non-tensor entry from its open data file, through the allowlist.

    Raises:
        UnsafePickleError: the blob names anything but plain Python values.
        NotACheckpointError / CorruptCheckpointError: the blob is not a torch.save archive.
    """

    def refuse_storage(_pid: Any) -> Any:
        raise NotACheckpointError(f"{source}: object '{entry.name}' holds a tensor, which "
                                  "fsdpckpt does not keep as an object")

    return read_archive_pickle(file, entry.offset, entry.length, source=source,
                               allowed=_OBJECT_GLOBALS, persistent=refuse_storage)


def encode_value(value: Any) -> Any:
    """A JSON-able form of ``value`` that :func:`decode_value` turns back into an equal value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"__set__": [encode_value(v) for v in value], "frozen": isinstance(value, frozenset)}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode_value(v) for k, v in value.items()}
        return {"__dict__": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    raise TypeError(f"cannot keep a {type(value).__name__} value")


def decode_value(data: Any) -> Any:
    """Invert :func:`encode_value`."""
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tuple__" in data:
        return tuple(decode_value(v) for v in data["__tuple__"])
    if "__float__" in data:
        return float(data["__float__"])
    if "__set__" in data:
        items = [decode_value(v) for v in data["__set__"]]
        return frozenset(items) if data.get("frozen") else set(items)
    if "__bytes__" in data:
        return base64.b64decode(data["__bytes__"])
    if "__dict__" in data:
        return {_hashable(decode_value(k)): decode_value(v) for k, v in data["__dict__"]}
    return {k: decode_value(v) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def dumps(value: Any) -> str:
    """``encode_value`` then compact JSON."""
    return json.dumps(encode_value(value), separators=(",", ":"), allow_nan=False)


def loads(text: str) -> Any:
    """Invert :func:`dumps`."""
    return decode_value(json.loads(text))
