"""The allowlists' tables: which pickled globals a file of each kind may name, and the
harmless stand-ins they resolve to.

:class:`~fsdpckpt.dcp._safe_pickle.RestrictedUnpickler` resolves globals only through one
of these tables. torch's names come from :mod:`fsdpckpt._torch` (the one place that knows
where torch keeps them), so a torch that moves a class is one edit there.
"""

from __future__ import annotations

import pickle
from typing import Any, NoReturn, cast

from fsdpckpt import _torch
from fsdpckpt.dcp._graph import bounded_repr
from fsdpckpt.dcp.dtypes import DTYPES, DType
from fsdpckpt.errors import UnsafePickleError

__all__ = ["Record", "_Refusal", "Sealed", "Size", "DTypeGlobal", "METADATA_GLOBALS",
           "BUILTIN_GLOBALS", "STORAGE_INFO_KIND", "brief", "cap", "layout_name"]


class _Refusal(UnsafePickleError):
    """A state-setting opcode aimed at an allowlisted value, raised by the value itself.

    The value does not know the file; the unpickler that catches this says which file
    (:func:`fsdpckpt.dcp._safe_pickle.refusal`)."""

    def __init__(self, what: str, opcode: str) -> None:
        super().__init__(what, opcode)
        self.what, self.opcode = what, opcode


#: The method pickle's C unpickler calls on its target for each state-setting opcode.
_STATE_SETTERS = {"__setstate__": "BUILD", "__setitem__": "SETITEM(S)", "append": "APPEND",
                  "extend": "APPENDS", "add": "ADDITEMS"}


def _refusing(opcode: str) -> Any:
    """A method refusing ``opcode`` for the allowlisted global it is called on."""
    def refuse(self: Any, *_: Any, **__: Any) -> NoReturn:
        name = self.__qualname__ if isinstance(self, type) else self.name
        raise _Refusal(f"the allowlisted global '{name}'", opcode)
    return refuse


class Sealed(type):
    """The metaclass of every class an allowlist hands out: the class itself takes no state.

    pickle's C unpickler applies BUILD through ``__setstate__``, SETITEM(S) through
    ``__setitem__``, APPEND(S) through ``extend``/``append`` and ADDITEMS through ``add``,
    looked up on whatever object the opcode is aimed at. Aimed at an allowlisted class,
    these data descriptors of its metaclass (one per :data:`_STATE_SETTERS` entry, set
    below) answer first, ahead of the class's own methods, which its instances keep, and
    refuse: no pickle can write a stand-in class's ``__dict__`` or call ``setattr`` on it,
    which would change how every later file in the process is read. The pure-Python
    unpickler refuses the same opcodes before they get here.
    """


class _SealedValue:
    """An allowlisted value that is not a class (a dtype, a torch constant): takes no state
    (a refusing method per :data:`_STATE_SETTERS` entry, set below)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _on_the_class(refuse: Any) -> property:
    """``refuse`` bound to the class it is read from: on the metaclass a data descriptor
    (a property), so it wins over the class's own method of that name."""
    def bound(cls: type) -> Any:
        return refuse.__get__(cls)
    return property(bound)


for _method, _opcode in _STATE_SETTERS.items():
    setattr(Sealed, _method, _on_the_class(_refusing(_opcode)))
    setattr(_SealedValue, _method, _refusing(_opcode))
del _method, _opcode


class DTypeGlobal(_SealedValue):
    """What ``torch.float32`` (and every dtype) means in a ``.metadata``: the dtype, sealed.

    The shared :class:`~fsdpckpt.dcp.dtypes.DType` itself is never handed to an unpickler:
    pickle's C unpickler would write a BUILD's state straight into its ``__dict__``."""

    __slots__ = ("dtype",)

    def __init__(self, name: str, dtype: DType) -> None:
        super().__init__(name)
        self.dtype = dtype


class Record(metaclass=Sealed):
    """A stand-in for an instance of an allowed class: it only stores what the pickle gives it.

    ``kind`` (a class attribute, which no pickle can change) names the class it stands
    for; positional constructor arguments land in ``args`` and the pickled state (a
    dataclass's field dict, or whatever ``__getstate__`` gave) in ``state``, untouched:
    the reader checks it against its schema. A NEWOBJ calls no ``__init__``, so ``args``
    may be missing: read it with ``getattr``.
    """

    __slots__ = ("args", "state", "__weakref__")
    kind = "Record"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.kind} {brief(getattr(self, 'state', None), 200)}>"


class Size(tuple, metaclass=Sealed):
    """``torch.Size`` in a ``.metadata``: a tuple, built at C speed; the schema checks that it
    holds integers (:func:`fsdpckpt.dcp._schema._ints`). It takes no state."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> NoReturn:
        raise _Refusal("a tuple, which takes no state", "BUILD")


def _sealed_factory(name: str, make: Any) -> type:
    """A sealed class whose call returns ``make(*args)`` (a plain value, not an instance)."""
    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return make(*args, **kwargs)
    # ``makes``: what a call returns, for the shape walk (dcp/_pickle_walk.py).
    return Sealed(name, (), {"__new__": __new__, "__slots__": (), "makes": make})


def _record_class(kind: str) -> type[Record]:
    return cast("type[Record]", Sealed(kind, (Record,), {"kind": kind, "__slots__": ()}))


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a pickled path holds non-strings")
    return "/".join(parts).replace("//", "/")


#: The longest name ``_get_layout`` may be given: torch's longest layout name
#: (``torch.sparse_coo``...) with room to spare.
_LAYOUT_NAME = 64


def layout_name(name: Any) -> str:
    """What a pickled ``torch.serialization._get_layout(name)`` stands for: ``name``, which
    torch writes as a layout's name (``"torch.strided"``). Anything else is refused before
    it is turned into text: ``str()`` of a crafted value (a list whose elements are one
    shared list, level after level) is gigabytes from a few kilobytes of pickle."""
    if type(name) is not str or len(name) > _LAYOUT_NAME:
        raise pickle.UnpicklingError(f"a layout (torch.serialization._get_layout) given "
                                     f"{brief(name)}, not a layout's name")
    return name


def _torch_constants(names: tuple[str, ...]) -> dict[tuple[str, str], Any]:
    return {(_torch.TORCH_MODULE, n): _SealedValue(f"torch.{n}") for n in names}


#: Integers whose hash is themselves: no two of them collide.
_HASH_MODULUS = (1 << 61) - 1


def _hash_safe(value: Any) -> bool:
    """Whether ``value`` hashes in time linear in its length with no crafted collisions:
    a string, bytes, an integer below 2**61 - 1, a bool, None, or an object hashed by its
    identity (a record). Never a tuple (hashed recursively, unguarded) or a float."""
    kind = type(value)
    if kind is str or kind is bytes or kind is bool or value is None:
        return True
    if kind is int:
        return -_HASH_MODULUS < value < _HASH_MODULUS
    return kind.__hash__ is object.__hash__


def _hash_safe_items(items: Any, what: str) -> list[Any]:
    items = list(items)
    for item in items:
        if not _hash_safe(item):
            raise pickle.UnpicklingError(f"a {what} holds a {type(item).__name__}, which no "
                                         "checkpoint's sets or keys hold")
    return items


def _checked_set(*args: Any) -> set[Any]:
    """``set(items)`` (protocol 2's pickled set), its members checked before hashing."""
    return set(_hash_safe_items(args[0], "set")) if args else set()


def _checked_frozenset(*args: Any) -> frozenset[Any]:
    return frozenset(_hash_safe_items(args[0], "frozenset")) if args else frozenset()


def _checked_dict(*args: Any) -> dict[Any, Any]:
    """``OrderedDict(pairs)`` as a dict, its keys checked before hashing."""
    if not args:
        return {}
    source = args[0]
    if isinstance(source, dict):  # its keys were checked when it was built
        return dict(source)
    pairs = [tuple(pair) for pair in source]
    if any(len(pair) != 2 for pair in pairs):
        raise pickle.UnpicklingError("an OrderedDict's items are not pairs")
    _hash_safe_items((key for key, _ in pairs), "dict's keys")
    return dict(pairs)


# The builtins a pickle may call; those that hash what they are given check it first (the
# shape walk of _pickle_walk.py cannot see what a list holds when it is called).
_HARMLESS_BUILTINS: dict[str, Any] = {
    "set": _checked_set,
    "frozenset": _checked_frozenset,
    "slice": slice,
    "complex": complex,
}

#: Harmless builtins any of our pickles may name. Pickle protocol 2 (torch.save's) names
#: them as Python 2 did, ``__builtin__.set``; later protocols say ``builtins.set``.
BUILTIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): _checked_dict,
    **{(module, name): value for module in ("builtins", "__builtin__")
       for name, value in _HARMLESS_BUILTINS.items()},
}

_DTYPE_GLOBALS: dict[tuple[str, str], DTypeGlobal] = {
    (_torch.TORCH_MODULE, name): DTypeGlobal(f"torch.{name}", d) for name, d in DTYPES.items()}

#: The harmless builtins, sealed: each a class whose call returns the builtin's value.
_SEALED_BUILTINS: dict[tuple[str, str], Any] = {
    key: _sealed_factory(f"{key[0]}.{key[1]}", value) for key, value in BUILTIN_GLOBALS.items()}

#: What a DCP ``.metadata`` pickle written by torch 2.x may legitimately name.
#: Every value is sealed (its class's metaclass is :class:`Sealed`, or it is a
#: :class:`_SealedValue`), so pickle's C unpickler can be given this table too
#: (:mod:`fsdpckpt.dcp._fast_pickle`).
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **_SEALED_BUILTINS,
    **_DTYPE_GLOBALS,
    **{(_torch.DCP_METADATA_MODULE, c): _record_class(c) for c in _torch.DCP_METADATA_CLASSES},
    # torch < 2.3 pickled ShardedTensor's TensorProperties (and its enum) instead of DCP's.
    _torch.OLD_TENSOR_PROPERTIES: _record_class("TensorProperties"),
    _torch.MEM_FORMAT_ENCODING: _sealed_factory("_MEM_FORMAT_ENCODING", int),
    _torch.OLD_MEM_FORMAT_ENCODING: _sealed_factory("MEM_FORMAT_ENCODING", int),
    _torch.STORAGE_INFO: _record_class(_torch.STORAGE_INFO[1]),
    _torch.TORCH_SIZE: Size,
    _torch.GET_LAYOUT: _sealed_factory("_get_layout", layout_name),
    **_torch_constants(_torch.TORCH_CONSTANTS),
    **{
        (module, cls): _sealed_factory(cls, _path)
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
