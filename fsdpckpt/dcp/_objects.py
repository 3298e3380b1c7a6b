"""Non-tensor entries (step counters, param_groups, strings): read safely, kept losslessly.

DCP stores each one as a ``torch.save`` blob. They are read through the
allowlist (plain Python values only, plus small tensors such as an optimizer's
tensor hyperparameters, decoded from the blob's own storages into
:class:`TensorValue`) and, for formats that only hold strings (safetensors
metadata), encoded as JSON that keeps tuples, sets, complex numbers, non-string
keys, bytes, non-finite floats and tensors apart from their look-alikes.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import zipfile
from dataclasses import dataclass
from typing import IO, Any

from fsdpckpt import _torch
from fsdpckpt.dcp._archive import check_view, read_archive_with_tensors
from fsdpckpt.dcp._checked import check_archive
from fsdpckpt.dcp._graph import MAX_DEPTH, measure, node_budget
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS, brief
from fsdpckpt.dcp._zstd import OBJECT_LIMIT, open_entry
from fsdpckpt.dcp.dtypes import DType, dtype_from_name
from fsdpckpt.dcp.metadata import ObjectEntry
from fsdpckpt.errors import (
    CorruptCheckpointError,
    FsdpCkptError,
    NotACheckpointError,
    UnsafePickleError,
)

__all__ = ["TensorValue", "DecodedObject", "latin1_bytes", "torch_load_allowlisted",
           "refused_load", "read_object", "encode_value", "decode_value", "dumps", "loads",
           "to_torch", "check_plain_value"]


@dataclass(frozen=True, eq=False)
class TensorValue:
    """A tensor inside a non-tensor entry, as torch.save stored it, without torch.

    Kept as its storage and view (not a copy in row-major order), so it is exactly
    what torch would rebuild and never larger than the bytes stored.

    Attributes:
        dtype: the element type.
        storage: the bytes of its whole storage.
        storage_offset: first element, in elements.
        shape: its shape.
        stride: its strides, in elements.
    """

    dtype: DType
    storage: bytes
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def to_torch(self) -> Any:
        """The real tensor: a copy of the storage viewed as torch.save's loader views it."""
        import torch

        dtype = _torch.dtype(self.dtype.name)
        flat = torch.frombuffer(bytearray(self.storage), dtype=torch.uint8).view(dtype) \
            if self.storage else torch.empty(0, dtype=dtype)
        return torch.as_strided(flat, self.shape, self.stride, self.storage_offset)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorValue):
            return NotImplemented
        return (self.dtype, self.storage, self.storage_offset, self.shape, self.stride) == \
            (other.dtype, other.storage, other.storage_offset, other.shape, other.stride)

    def __hash__(self) -> int:
        return hash((self.dtype.name, self.storage_offset, self.shape, self.stride))

    def __repr__(self) -> str:
        return f"TensorValue({self.dtype.name}, shape={list(self.shape)})"


def latin1_bytes(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it for ``bytes``: latin-1 only.

    Any other codec is refused: some are slow on long input, some are not text codecs,
    and none appears in a file pickle writes.
    """
    if not (isinstance(text, str) and encoding in ("latin1", "latin-1")):
        raise pickle.UnpicklingError(f"_codecs.encode with {type(text).__name__} text and "
                                     f"codec {brief(encoding)}; pickle only uses latin1 here")
    return text.encode("latin1")


latin1_bytes.makes_bytes = True  # type: ignore[attr-defined]  # for the shape walk: a key


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()`` as pickle protocol 2 writes ``b""``; never ``bytes(n)``, whose n is untrusted."""
    if args:
        raise pickle.UnpicklingError("bytes() called with arguments; pickle never does that")
    return b""


# Python values pickled by torch.save (protocol 2) name at most these globals.
_OBJECT_GLOBALS = {**BUILTIN_GLOBALS, ("_codecs", "encode"): latin1_bytes,
                   ("__builtin__", "bytes"): _empty_bytes, ("builtins", "bytes"): _empty_bytes}


@dataclass(frozen=True)
class DecodedObject(ObjectEntry):
    """A non-tensor entry already decoded (through the allowlist) from a pickle that held it
    inline, as a per-rank ``torch.save`` file does: :func:`read_object` gives ``value``."""

    value: Any = None


def read_object(file: IO[bytes], entry: ObjectEntry, *, source: str) -> Any:
    """Read the value of a non-tensor entry from its open data file, through the allowlist.

    Tensors inside it (an optimizer's ``lr=torch.tensor(1e-2)``) become
    :class:`TensorValue`; :func:`to_torch` turns them into real tensors.

    Raises:
        UnsafePickleError: the blob names anything but plain Python values and tensors.
        NotACheckpointError / CorruptCheckpointError: the blob is not a torch.save archive,
            or a tensor in it does not fit its storage.
    """
    if isinstance(entry, DecodedObject):
        return entry.value
    where = f"{source} (object '{entry.name}')"
    handle, start, length = open_entry(file, entry.offset, entry.length, entry.transforms,
                                       limit=OBJECT_LIMIT, source=where)
    value = read_archive_with_tensors(handle, start, length, source=where,
                                      allowed=_OBJECT_GLOBALS, make_tensor=TensorValue)
    check_plain_value(value, source=where, size=entry.length)
    return value


#: Deepest nesting of containers a non-tensor entry may have. Honest ones (an optimizer's
#: param_groups, a step count) nest a few levels; encoded to JSON each level may take two,
#: and JSON read back is capped at :data:`~fsdpckpt._io.jsonio.MAX_JSON_DEPTH`.
MAX_VALUE_DEPTH = MAX_DEPTH


def check_plain_value(value: Any, *, source: str, size: int) -> None:
    """Refuse a value no honest state dict holds: one that contains itself, containers
    nested deeper than :data:`MAX_VALUE_DEPTH`, or containers shared so often that the tree
    they stand for is far larger than the ``size`` bytes of pickle they came from. A pickle
    can build each from a few bytes, and every later recursive step (encoding,
    ``torch.save``, ``to_torch``, comparing) would end in a RecursionError or run for hours.
    Walked once, without recursion (:func:`fsdpckpt.dcp._graph.measure`).

    Raises:
        NotACheckpointError: naming ``source``.
    """
    measure(value, source=source, budget=node_budget(size), max_depth=MAX_VALUE_DEPTH)


def _pickle_size(path: Any) -> int:
    """The bytes of a ``torch.save`` file's pickle: its ``data.pkl`` (from the zip's
    directory), or the whole file in the legacy format."""
    try:
        with zipfile.ZipFile(path) as archive:
            sizes = [i.file_size for i in archive.infolist() if i.filename.endswith("data.pkl")]
    except (zipfile.BadZipFile, OSError, ValueError):
        sizes = []
    return sizes[0] if len(sizes) == 1 else os.path.getsize(path)


def torch_load_allowlisted(path: Any, *, mmap: bool = False) -> Any:
    """``torch.load`` of a ``.bin`` through torch's weights-only allowlist.

    Non-tensor entries a ``.bin`` merge keeps may hold set, frozenset, complex or slice
    values (as :data:`BUILTIN_GLOBALS` admits), which torch's allowlist refuses by
    default; those four harmless builtins are added, nothing else. torch does not check the
    CRC-32s its zip records: every entry is read against them first
    (:func:`fsdpckpt.dcp._checked.check_archive`).

    Raises:
        ChecksumError: an entry's bytes do not match their recorded CRC-32.
    """
    import torch

    with open(path, "rb") as file:
        check_archive(file, 0, os.fstat(file.fileno()).st_size, source=str(path))

    with torch.serialization.safe_globals([set, frozenset, complex, slice]):
        # safe: weights_only=True is torch's restricted unpickler; the globals added are
        # four builtin types that construct plain values and run no code.
        try:
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as exc:  # noqa: BLE001 - torch's many ways to fail, said as ours
            if isinstance(exc, (pickle.UnpicklingError, AttributeError)):
                # A dtype this torch lacks (float8_e8m0fnu on 2.6) is no unsafe global.
                for name in _torch.DTYPE_SINCE:
                    if name in str(exc):
                        _torch.dtype(name, what=str(path))  # raises where torch lacks it
            raise refused_load(path, exc, "torch.save") from None
    check_plain_value(value, source=str(path), size=_pickle_size(path))
    return value


def refused_load(path: Any, exc: BaseException, what: str) -> BaseException:
    """The error for a file ``torch.load(weights_only=True)`` would not load, in our words:
    torch's own advises ``weights_only=False``, which runs the file's code. The one
    translation of torch's loader's failures (``training/_rng.py`` words RNG and DCP entries
    with it). fsdpckpt's own errors (a checksum that fails before torch reads) and a real
    I/O error, which names its file, stay as they are; a Ctrl-C torch turned into its own
    error is a Ctrl-C again.

    ``what`` names the kind of file (``"torch.save"``, ``"RNG state"``...)."""
    import re

    if isinstance(exc, FsdpCkptError) or isinstance(exc, OSError) and exc.filename:
        return exc
    if isinstance(exc.__context__, KeyboardInterrupt):
        return KeyboardInterrupt()
    if isinstance(exc, pickle.UnpicklingError):
        found = re.search(r"GLOBAL ([\w.]{1,200})", str(exc))
        named = f"the global '{found.group(1)}'" if found else "an object outside the allowlist"
        return UnsafePickleError(f"{path}: refused to load {named}, which a {what} file never "
                                 "holds; the file may be hostile. Nothing was executed: nothing "
                                 "in it was run, nor any state changed. Delete the file, or use "
                                 "an intact copy.")
    detail = (str(exc).strip().splitlines() or [""])[0]
    detail = type(exc).__name__ if not detail or "weights_only" in detail else detail[:200]
    return NotACheckpointError(f"{path}: not a readable {what} file ({detail}); it is "
                               "truncated, damaged or not a torch.save file")


def to_torch(value: Any) -> Any:
    """``value`` with every :class:`TensorValue` in it (nested in containers) a torch tensor."""
    if isinstance(value, TensorValue):
        return value.to_torch()
    if isinstance(value, dict):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_torch(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_torch(v) for v in value)
    return value


def encode_value(value: Any) -> Any:
    """A JSON-able form of ``value`` that :func:`decode_value` turns back into an equal value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        # JSON (and Python's int parsing) stops at 4300 decimal digits; hex has no limit.
        return value if abs(value) < 2**63 else {"__int__": hex(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, complex):
        return {"__complex__": [encode_value(value.real), encode_value(value.imag)]}
    if isinstance(value, TensorValue):
        return {"__tensor__": {"dtype": value.dtype.name,
                               "storage": base64.b64encode(value.storage).decode(),
                               "offset": value.storage_offset, "shape": list(value.shape),
                               "stride": list(value.stride)}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"__set__": [encode_value(v) for v in value], "frozen": isinstance(value, frozenset)}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, slice):
        return {"__slice__": [encode_value(value.start), encode_value(value.stop),
                              encode_value(value.step)]}
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
    if "__complex__" in data:
        real, imag = (decode_value(v) for v in data["__complex__"])
        return complex(real, imag)
    if "__tensor__" in data:
        return _decode_tensor(data["__tensor__"])
    if "__set__" in data:
        items = [decode_value(v) for v in data["__set__"]]
        return frozenset(items) if data.get("frozen") else set(items)
    if "__bytes__" in data:
        return base64.b64decode(data["__bytes__"])
    if "__slice__" in data:
        return slice(*(decode_value(v) for v in data["__slice__"]))
    if "__int__" in data:
        return int(data["__int__"], 16)
    if "__dict__" in data:
        return {_hashable(decode_value(k)): decode_value(v) for k, v in data["__dict__"]}
    return {k: decode_value(v) for k, v in data.items()}


def _decode_tensor(doc: Any) -> TensorValue:
    # The JSON comes from a file: check it as strictly as a torch.save archive.
    where = "a tensor in the fsdpckpt.objects metadata"
    name = doc.get("dtype") if isinstance(doc, dict) else None
    dtype = dtype_from_name(name) if isinstance(name, str) and len(name) < 64 else None
    storage = doc.get("storage") if isinstance(doc, dict) else None
    if dtype is None or not isinstance(storage, str):
        raise CorruptCheckpointError(f"{where} has no known dtype or no storage: "
                                     f"{brief(doc, 200)}; the file is damaged or was not "
                                     "written by fsdpckpt.")
    try:
        data = base64.b64decode(storage, validate=True)
    except ValueError:
        raise CorruptCheckpointError(f"{where} has a storage that is not base64; the file "
                                     "is damaged.") from None
    if len(data) % dtype.itemsize:
        raise CorruptCheckpointError(f"{where} holds {len(data)} bytes, not a whole number of "
                                     f"{dtype.name} elements; the file is damaged.")
    offset, shape, stride = check_view(dtype, len(data), doc.get("offset"), doc.get("shape"),
                                       doc.get("stride"), source=where)
    return TensorValue(dtype, data, offset, shape, stride)


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def dumps(value: Any) -> str:
    """``encode_value`` then compact JSON."""
    return json.dumps(encode_value(value), separators=(",", ":"), allow_nan=False)


def loads(text: str) -> Any:
    """Invert :func:`dumps`.

    Raises:
        ValueError: ``text`` is not JSON or is nested too deep to decode (see
            :func:`fsdpckpt._io.jsonio.parse_json`); CorruptCheckpointError for a bad value.
    """
    from fsdpckpt._io.jsonio import parse_json

    data = parse_json(text)
    try:
        return decode_value(data)
    except FsdpCkptError:
        raise
    except (TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
        # A tagged form whose contents are not what encode_value writes: a damaged file.
        raise CorruptCheckpointError(f"a value in the fsdpckpt.objects metadata cannot be "
                                     f"decoded ({type(exc).__name__}: {str(exc)[:200]}); the "
                                     "file is damaged or was not written by fsdpckpt") from None
