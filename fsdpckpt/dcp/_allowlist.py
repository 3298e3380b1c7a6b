"""The allowlists' tables: which pickled globals a file of each kind may name, and the
harmless stand-ins they resolve to.

:class:`~fsdpckpt.dcp._safe_pickle.RestrictedUnpickler` resolves globals only through one
of these tables. torch's names come from :mod:`fsdpckpt._torch` (the one place that knows
where torch keeps them), so a torch that moves a class is one edit there.
"""

from __future__ import annotations

import pickle
from typing import Any

from fsdpckpt import _torch
from fsdpckpt.dcp._graph import bounded_repr
from fsdpckpt.dcp.dtypes import DTYPES, DType

__all__ = ["Record", "METADATA_GLOBALS", "BUILTIN_GLOBALS", "STORAGE_INFO_KIND", "brief", "cap"]


class Record:
    """A stand-in for an instance of an allowed class: it only stores what the pickle gives it.

    ``kind`` (a class attribute, which no pickle can change) names the class it stands
    for; positional constructor arguments land in ``args`` and the pickled state (a
    dataclass's field dict, or whatever ``__getstate__`` gave) in ``state``, untouched:
    the reader checks it against its schema.
    """

    kind = "Record"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.kind} {brief(getattr(self, 'state', None), 200)}>"


def _record_class(kind: str) -> type[Record]:
    return type(kind, (Record,), {"kind": kind})


def _size(dims: Any = ()) -> tuple[int, ...]:
    dims = tuple(dims)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise pickle.UnpicklingError(f"torch.Size holds non-integers: {dims!r}")
    return dims


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a pickled path holds non-strings")
    return "/".join(parts).replace("//", "/")


def _identity_str(value: Any) -> str:
    return str(value)


def _torch_constants(names: tuple[str, ...]) -> dict[tuple[str, str], Any]:
    return {(_torch.TORCH_MODULE, n): n for n in names}


_HARMLESS_BUILTINS: dict[str, Any] = {
    "set": set,
    "frozenset": frozenset,
    "slice": slice,
    "complex": complex,
}

#: Harmless builtins any of our pickles may name. Pickle protocol 2 (torch.save's) names
#: them as Python 2 did, ``__builtin__.set``; later protocols say ``builtins.set``.
BUILTIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): dict,
    **{(module, name): value for module in ("builtins", "__builtin__")
       for name, value in _HARMLESS_BUILTINS.items()},
}

_DTYPE_GLOBALS: dict[tuple[str, str], DType] = {(_torch.TORCH_MODULE, name): d
                                                for name, d in DTYPES.items()}

#: What a DCP ``.metadata`` pickle written by torch 2.x may legitimately name.
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **BUILTIN_GLOBALS,
    **_DTYPE_GLOBALS,
    **{(_torch.DCP_METADATA_MODULE, c): _record_class(c) for c in _torch.DCP_METADATA_CLASSES},
    # torch < 2.3 pickled ShardedTensor's TensorProperties (and its enum) instead of DCP's.
    _torch.OLD_TENSOR_PROPERTIES: _record_class("TensorProperties"),
    _torch.MEM_FORMAT_ENCODING: int,
    _torch.OLD_MEM_FORMAT_ENCODING: int,
    _torch.STORAGE_INFO: _record_class(_torch.STORAGE_INFO[1]),
    _torch.TORCH_SIZE: _size,
    _torch.GET_LAYOUT: _identity_str,
    **_torch_constants(_torch.TORCH_CONSTANTS),
    **{
        (module, cls): _path
        for module in ("pathlib", "pathlib._local")
        for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                    "PureWindowsPath")
    },
}

#: The kind of the stand-in for torch's ``_StorageInfo`` (``storage_data``'s values).
STORAGE_INFO_KIND = _torch.STORAGE_INFO[1]


def cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(value: Any, limit: int = 80) -> str:
    """A bounded ``repr`` of an untrusted value, for messages (never raises): built in
    ``limit`` steps however deep or shared the value (:func:`fsdpckpt.dcp._graph.bounded_repr`)."""
    return bounded_repr(value, limit)
