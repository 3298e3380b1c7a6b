"""Unpickling with an allowlist, resolving torch's globals to light stand-ins.

Checkpoints come from elsewhere, and ``pickle.load`` on a file from elsewhere
runs whatever the file asks for. The unpickler here admits only the globals a
legitimate file of each kind contains, and maps each one to a harmless value of
fsdpckpt's own, so reading metadata never imports torch and never executes code
from the file. Anything else stops the load with :class:`UnsafePickleError`
naming the file and the global.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from .dtypes import DTYPES, DType
from .errors import CorruptCheckpointError, NotACheckpointError, UnsafePickleError

__all__ = [
    "Record",
    "RestrictedUnpickler",
    "safe_loads",
    "METADATA_GLOBALS",
    "BUILTIN_GLOBALS",
]


class Record:
    """A stand-in for an instance of an allowed class: it only stores what the pickle gives it.

    ``kind`` names the class it stands for; positional constructor arguments land
    in ``args`` and pickled state in ``state`` (a dict is also spread over attributes).
    """

    kind = "Record"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) form
        if isinstance(state, dict):
            for key, value in state.items():
                if isinstance(key, str) and not key.startswith("__"):
                    setattr(self, key, value)

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if k not in ("args", "state")}
        return f"<{self.kind} {fields or self.args}>"


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


def _torch_constants(names: list[str]) -> dict[tuple[str, str], Any]:
    return {("torch", n): n for n in names}


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

_DTYPE_GLOBALS: dict[tuple[str, str], DType] = {("torch", name): d for name, d in DTYPES.items()}

_DCP_CLASSES = [
    "Metadata",
    "TensorStorageMetadata",
    "TensorProperties",
    "ChunkStorageMetadata",
    "BytesStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
]

#: What a DCP ``.metadata`` pickle written by torch 2.x may legitimately name.
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **BUILTIN_GLOBALS,
    **_DTYPE_GLOBALS,
    **{("torch.distributed.checkpoint.metadata", c): _record_class(c) for c in _DCP_CLASSES},
    # Older torch kept TensorProperties beside ShardedTensor.
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): _record_class(
        "TensorProperties"
    ),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): int,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record_class("_StorageInfo"),
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _identity_str,
    **_torch_constants(
        ["strided", "sparse_coo", "sparse_csr", "_mkldnn", "contiguous_format", "channels_last",
         "preserve_format", "channels_last_3d"]
    ),
    **{
        (module, cls): _path
        for module in ("pathlib", "pathlib._local")
        for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                    "PureWindowsPath")
    },
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves globals only through ``allowed``.

    Args:
        file: a binary file object holding the pickle.
        allowed: ``(module, name) -> object`` for every global the pickle may name.
        source: what to call the file in error messages (usually its path).
        persistent_load: handler for persistent ids, or None to refuse them.
    """

    def __init__(
        self,
        file: Any,
        *,
        allowed: Mapping[tuple[str, str], Any],
        source: str,
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._source = source
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"{self._source}: refusing to load the global '{module}.{name}', which a file "
                "of this kind never contains; the file may be hostile. Nothing was executed. "
                "Only load it with plain pickle if you trust where it came from."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent ids are not allowed here")
        return self._persistent(pid)


def safe_loads(
    data: bytes,
    *,
    allowed: Mapping[tuple[str, str], Any],
    source: str,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data`` through :class:`RestrictedUnpickler`.

    Args:
        data: the pickle bytes.
        allowed: the allowlist, ``(module, name) -> stand-in``.
        source: the file's name for error messages.
        persistent_load: handler for persistent ids, if the format has them.

    Returns:
        The unpickled object, built from stand-ins.

    Raises:
        UnsafePickleError: the pickle names a global outside ``allowed``.
        NotACheckpointError: the bytes are not a valid pickle of this kind.

    Example:
        >>> safe_loads(pickle.dumps({"a": 1}), allowed=BUILTIN_GLOBALS, source="x")
        {'a': 1}
    """
    unpickler = RestrictedUnpickler(
        io.BytesIO(data), allowed=allowed, source=source, persistent_load=persistent_load
    )
    try:
        return unpickler.load()
    except (UnsafePickleError, CorruptCheckpointError):
        # A stand-in found the file damaged (a tensor outside its storage): its message
        # says more than "not a readable pickle" would.
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, ImportError, OverflowError, RecursionError,
            UnicodeDecodeError, MemoryError) as exc:
        raise NotACheckpointError(
            f"{source}: not a readable pickle of the expected kind ({type(exc).__name__}: {exc})"
        ) from exc
