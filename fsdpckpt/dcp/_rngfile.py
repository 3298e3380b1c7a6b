"""Decoding RNG state files exactly: never numpy's unpickling, never ``torch.load``.

``random_states_{rank}.pkl`` (Accelerate) and ``rng_state_{rank}.pth`` (HF Trainer)
are ``torch.save`` archives of a dict holding python's, numpy's and torch's RNG
states. numpy's state holds an ``ndarray``, and letting numpy unpickle it lets a
file choose the array's dtype: an object dtype over raw bytes makes numpy
dereference them as pointers and the process dies. So the archive is read by
fsdpckpt's own restricted unpickler (:func:`fsdpckpt.dcp._archive.read_archive_with_tensors`),
numpy's globals resolve to stand-ins that only record their arguments, and the
records are checked against the one shape RNG state has before anything real is
built from them: numpy's key array with :func:`numpy.frombuffer`, torch's byte
tensors from their storage bytes. Anything else is refused with one line naming
the file and the field.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from fsdpckpt._io import storage, storage_paths
from fsdpckpt._io.storage import Place
from fsdpckpt.dcp._archive import is_plain_int, read_archive_with_tensors
from fsdpckpt.dcp._graph import bounded_repr
from fsdpckpt.dcp._objects import TensorValue, latin1_bytes, to_torch
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS
from fsdpckpt.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    FsdpCkptError,
    NotACheckpointError,
    UnsafePickleError,
)

__all__ = ["read_rng_archive", "rng_fields", "MAX_RNG_FILE_BYTES", "side_file_size",
           "open_side_file"]

#: A real RNG file is about 14 KB (a few more per GPU); anything far larger is not one,
#: and is refused before a byte of it is decoded.
MAX_RNG_FILE_BYTES = 16 * 2**20

_MAX_ENTRIES = 4096             # an RNG archive has ~7, plus one per GPU state
_MT_WORDS = 624                 # Mersenne Twister state words (python's and numpy's)
_TORCH_CPU_STATE_BYTES = 5056   # torch.get_rng_state() on CPU
_CUDA_STATE_BYTES = (8, 16)     # seed, or seed and Philox offset (torch accepts both)

# HF Trainer's rng_state_{rank}.pth names the same states differently.
_TRAINER_KEYS = {"python": "random_state", "numpy": "numpy_random_seed",
                 "cpu": "torch_manual_seed", "cuda": "torch_cuda_manual_seed"}

# States of other accelerators, kept (checked) but not applied by fsdpckpt: Accelerate's
# names, then HF Trainer's.
_DEVICE_KEYS = frozenset(
    [f"torch_{d}_manual_seed" for d in ("xpu", "mlu", "sdaa", "musa", "hpu", "neuron")]
    + ["xm_seed", "xla", "npu", "hpu", "mlu", "musa", "xpu", "mps", "sdaa", "neuron"])


class _Bad(Exception):
    """A field holds something RNG state never does; ``str`` says what."""


class _Global:
    """The stand-in for one allowlisted global: calling it records, setting state on it fails.

    A fresh set of these is made for every file, and pickle's BUILD on one raises
    instead of writing into it, so one file can never change how another is read.
    """

    __slots__ = ("_name", "_call")

    def __init__(self, name: str, call: Callable[..., Any] | None = None) -> None:
        self._name, self._call = name, call

    def __call__(self, *args: Any) -> Any:
        if self._call is None:
            raise pickle.UnpicklingError(f"the pickle calls '{self._name}', which an RNG file "
                                         "never does")
        return self._call(*args)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"the pickle sets state on the global '{self._name}'")


class _Built:
    """What a numpy constructor stand-in returns: its arguments, then the state BUILD gives once."""

    __slots__ = ("kind", "args", "state", "_built")

    def __init__(self, kind: str, args: tuple[Any, ...]) -> None:
        self.kind, self.args, self.state, self._built = kind, args, None, False

    def __setstate__(self, state: Any) -> None:
        if self._built:
            raise pickle.UnpicklingError(f"the pickle sets a numpy {self.kind}'s state twice")
        self.state, self._built = state, True


def _stand_ins() -> dict[tuple[str, str], Any]:
    """The globals an RNG file may name, as fresh stand-ins for this one file."""
    ndarray = _Global("numpy.ndarray")
    reconstruct = _Global("numpy._core.multiarray._reconstruct",
                          lambda *args: _Built("ndarray", args)
                          if args and args[0] is ndarray else _refuse_reconstruct())
    dtype = _Global("numpy.dtype", lambda *args: _Built("dtype", args))
    encode = _Global("codecs.encode", latin1_bytes)
    return {
        **BUILTIN_GLOBALS,
        ("numpy", "ndarray"): ndarray,
        ("numpy", "dtype"): dtype,
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,
        ("codecs", "encode"): encode,
        ("_codecs", "encode"): encode,
    }


def _refuse_reconstruct() -> Any:
    raise pickle.UnpicklingError("numpy's _reconstruct is asked to build something other than "
                                 "an ndarray")


def _one_line(exc: FsdpCkptError) -> FsdpCkptError:
    """``exc`` as one line: a damaged file can put newlines into the text it quotes."""
    text = " ".join(str(exc).split())
    return exc if text == str(exc) else type(exc)(text)


def side_file_size(path: Place, what: str) -> int:
    """The size of the side file ``path`` (``what`` it holds, for messages), local or remote;
    the first question every side-file reader asks, so it is where a link out of the
    checkpoint folder is refused whoever named the file (the layout refuses it first).

    Raises:
        CheckpointNotFoundError: it does not exist.
        NotACheckpointError: it cannot be read, or it is a link leading out of its folder.
    """
    storage_paths.inside(path.parent, path.name, rule="fsdpckpt reads a checkpoint's side "
                         "files only from inside its folder")
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such {what} file") from None
    except OSError as exc:
        raise NotACheckpointError(f"{path}: cannot read the {what} file ({exc})") from None


@contextlib.contextmanager
def open_side_file(path: Place) -> Iterator[BinaryIO]:
    """``path`` opened for reading, as a context manager: a remote file (buffered, ranged
    reads) reads as a local one, so both go through the same bounded parse."""
    with storage.opened(path) as opened:
        yield opened.file()


def read_rng_archive(path: Place) -> dict[Any, Any]:
    """Decode an RNG file's ``torch.save`` archive into plain values and stand-in records.

    Tensors become :class:`~fsdpckpt.dcp._objects.TensorValue`; numpy's arrays and dtypes
    become unchecked records that :func:`rng_fields` checks and turns into real values.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        UnsafePickleError: the pickle names a global outside the RNG allowlist.
        NotACheckpointError: the file is not such an archive of a dict (one line).
    """
    size = side_file_size(path, "RNG state")
    if size > MAX_RNG_FILE_BYTES:
        raise NotACheckpointError(
            f"{path}: {size} bytes, far more than RNG state ever takes "
            f"({MAX_RNG_FILE_BYTES} at most); it is not an RNG state file. Delete it to "
            "resume without it.")
    try:
        with open_side_file(path) as file:
            _check_entries(file, size, path)
            state = read_archive_with_tensors(file, 0, size, source=str(path),
                                              allowed=_stand_ins(), make_tensor=TensorValue)
    except UnsafePickleError as exc:
        raise _one_line(exc) from None
    except FsdpCkptError as exc:  # the archive reader's CorruptCheckpointError too: one class
        # ... but a checksum that fails is damage, said as such (as for every other file).
        raise _one_line(exc if isinstance(exc, ChecksumError) else
                        NotACheckpointError(str(exc))) from None
    except Exception as exc:  # noqa: BLE001 - any parser failure on damaged bytes is one line
        detail = " ".join(str(exc).split())[:200]
        raise NotACheckpointError(
            f"{path}: not a readable RNG state file ({type(exc).__name__}: {detail}); it is "
            "damaged or not a torch.save file. Delete it to resume without it.") from None
    if not isinstance(state, dict):
        raise NotACheckpointError(f"{path}: holds a {type(state).__name__}, not RNG state")
    return state


def _check_entries(file: Any, size: int, path: Place) -> None:
    """Refuse archives that would make reading them cost more than their bytes.

    ``torch.save`` stores every entry uncompressed, and an RNG file has a handful;
    a compressed ``data.pkl`` could inflate far beyond the file (a zip bomb).
    """
    with zipfile.ZipFile(file) as archive:
        entries = archive.infolist()
        if len(entries) > _MAX_ENTRIES:
            raise NotACheckpointError(f"{path}: holds {len(entries)} archive entries, far more "
                                      "than RNG state ever has; it is not an RNG state file")
        for info in entries:
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > size:
                raise NotACheckpointError(
                    f"{path}: the archive entry {_show(info.filename)} is compressed or larger "
                    "than the file, which torch.save never writes; it is not an RNG state file")


def rng_fields(state: dict[Any, Any], path: Place, *,
               build: bool = True) -> dict[str, Any]:
    """Check every field of a decoded RNG file and build the real values, under Accelerate's keys.

    With ``build=False`` (``inspect`` and ``verify``, which never import torch) every field
    is checked the same way and torch's states stay
    :class:`~fsdpckpt.dcp._objects.TensorValue`.

    Returns:
        ``{"step", "random_state", "numpy_random_seed", "torch_manual_seed",
        "torch_cuda_manual_seed", ...}`` (those present): python's state as
        :func:`random.setstate` takes it, numpy's as :func:`numpy.random.set_state`
        takes it (left out, with a warning, when numpy is not installed), torch's as
        uint8 tensors.

    Raises:
        NotACheckpointError: one line naming ``path`` and the first field that is wrong.
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = _TRAINER_KEYS.get(key, key) if isinstance(key, str) else key
        check = _CHECKS.get(name) or (_device_state if name in _DEVICE_KEYS else None)
        if check is None:
            raise NotACheckpointError(f"{path}: the key {_show(key)} is not part of RNG state; "
                                      "the file is damaged or not an RNG state file")
        if name in out:
            raise NotACheckpointError(f"{path}: the key {_show(key)} repeats a state given "
                                      "under another name")
        try:
            out[name] = check(value)
        except _Bad as exc:
            raise NotACheckpointError(f"{path}: field {_show(key)}: {exc}; the file is damaged or "
                                      "not an RNG state file. Delete it to resume without it.") \
                from None
    if build:
        out = {name: to_torch(value) for name, value in out.items()}
    if "numpy_random_seed" in out and out["numpy_random_seed"] is None:
        del out["numpy_random_seed"]
        warnings.warn(f"{path}: numpy is not installed, so its RNG state was not restored",
                      stacklevel=3)
    return out


def _show(key: Any) -> str:
    return bounded_repr(key)


def _int_in(value: Any, low: int, high: int, what: str) -> int:
    if not is_plain_int(value) or not low <= value <= high:
        raise _Bad(f"{what} must be an integer from {low} to {high}, not {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if is_plain_int(value):
        return repr(value) if abs(value) < 10**30 else f"a {value.bit_length()}-bit integer"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _step(value: Any) -> int:
    return _int_in(value, 0, 2**63 - 1, "the step")


def _python_state(value: Any) -> tuple[Any, ...]:
    # random.getstate(): (3, 624 state words and the position, gauss_next)
    if not isinstance(value, tuple) or len(value) != 3:
        raise _Bad(f"python's state is a tuple of 3 items, not {_describe(value)}")
    _int_in(value[0], 3, 3, "the version")
    words = value[1]
    if not isinstance(words, tuple) or len(words) != _MT_WORDS + 1:
        raise _Bad(f"python's state holds {_MT_WORDS + 1} integers, not {_describe(words)}")
    for index, word in enumerate(words[:_MT_WORDS]):
        _int_in(word, 0, 2**32 - 1, f"state word {index}")
    _int_in(words[_MT_WORDS], 0, _MT_WORDS, "the position")
    if value[2] is not None:
        _float(value[2], "the cached gaussian")
    return value


def _float(value: Any, what: str) -> float:
    if not isinstance(value, float) or not math.isfinite(value):
        raise _Bad(f"{what} must be a finite float, not {_describe(value)}")
    return value


def _numpy_state(value: Any) -> tuple[Any, ...] | None:
    # np.random.get_state(): ("MT19937", uint32 key of 624, pos, has_gauss, cached_gaussian)
    if not isinstance(value, tuple) or len(value) != 5:
        raise _Bad(f"numpy's state is a tuple of 5 items, not {_describe(value)}")
    if value[0] != "MT19937":
        raise _Bad(f"numpy's generator must be 'MT19937', not {_show(value[0])}")
    key = _key_bytes(value[1])
    pos = _int_in(value[2], 0, _MT_WORDS, "the position")
    has_gauss = _int_in(value[3], 0, 1, "has_gauss")
    cached = _float(value[4], "the cached gaussian")
    try:
        import numpy
    except ImportError:  # checked all the same, but there is no numpy RNG to restore
        return None
    return ("MT19937", numpy.frombuffer(key, dtype="<u4").copy(), pos, has_gauss, cached)


def _key_bytes(record: Any) -> bytes:
    """The 2496 raw bytes of numpy's key, from the records of ``_reconstruct`` and its BUILD."""
    wrong = _Bad(f"numpy's key must be a 1-d C-order little-endian uint32 array of {_MT_WORDS} "
                 "elements")
    if not (isinstance(record, _Built) and record.kind == "ndarray"):
        raise wrong
    # _reconstruct(ndarray, (0,), b"b"), then BUILD (version, shape, dtype, fortran, bytes)
    if not (_same(record.args[1:], ((0,), b"b")) and _same(record.args[1], (0,))
            and isinstance(record.state, tuple) and len(record.state) == 5):
        raise wrong
    version, shape, dtype, fortran, raw = record.state
    if not (is_plain_int(version) and version == 1 and shape == (_MT_WORDS,)
            and isinstance(shape, tuple) and is_plain_int(shape[0]) and fortran is False):
        raise wrong
    _check_uint32(dtype, wrong)
    if not isinstance(raw, bytes) or len(raw) != _MT_WORDS * 4:
        raise _Bad(f"numpy's key must hold {_MT_WORDS * 4} bytes, not "
                   f"{len(raw) if isinstance(raw, bytes) else _describe(raw)}")
    return raw


def _check_uint32(dtype: Any, wrong: _Bad) -> None:
    # numpy.dtype("u4", False, True), then BUILD (3, "<", None, None, None, -1, -1, 0)
    if not (isinstance(dtype, _Built) and dtype.kind == "dtype"
            and _same(dtype.args, ("u4", False, True))
            and _same(dtype.state, (3, "<", None, None, None, -1, -1, 0))):
        raise wrong


def _same(got: Any, expected: tuple[Any, ...]) -> bool:
    """Equal item for item and type for type (so True is not 1 and 1.0 is not 1)."""
    return isinstance(got, tuple) and len(got) == len(expected) and all(
        type(a) is type(b) and a == b for a, b in zip(got, expected))


def _byte_tensor(value: Any, sizes: tuple[int, ...] | None, what: str) -> Any:
    """A decoded uint8 tensor, checked to be exactly a whole 1-d byte storage."""
    if not (isinstance(value, TensorValue) and value.dtype.name == "uint8"
            and len(value.shape) == 1 and value.stride == (1,) and value.storage_offset == 0
            and value.shape[0] == len(value.storage)):
        raise _Bad(f"{what} must be a 1-d uint8 tensor over its whole storage")
    if sizes is not None and value.shape[0] not in sizes:
        raise _Bad(f"{what} must hold {' or '.join(map(str, sizes))} bytes, not {value.shape[0]}")
    return value


def _torch_state(value: Any) -> Any:
    return _byte_tensor(value, (_TORCH_CPU_STATE_BYTES,), "torch's CPU state")


def _cuda_state(value: Any) -> Any:
    # torch.cuda.get_rng_state_all() (a list, empty without GPUs) or get_rng_state()
    if isinstance(value, (list, tuple)):
        return [_byte_tensor(v, _CUDA_STATE_BYTES, f"GPU {i}'s state")
                for i, v in enumerate(value)]
    return _byte_tensor(value, _CUDA_STATE_BYTES, "the GPU state")


def _device_state(value: Any) -> Any:
    # Other accelerators: a seed (torch_xla), a byte tensor, or a list of them per device.
    if is_plain_int(value):
        return _int_in(value, 0, 2**64 - 1, "the seed")
    if isinstance(value, (list, tuple)):
        return [_byte_tensor(v, None, f"device {i}'s state") for i, v in enumerate(value)]
    return _byte_tensor(value, None, "the device state")


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "step": _step,
    "random_state": _python_state,
    "numpy_random_seed": _numpy_state,
    "torch_manual_seed": _torch_state,
    "torch_cuda_manual_seed": _cuda_state,
}
