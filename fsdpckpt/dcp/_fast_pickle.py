"""A large ``.metadata`` unpickled at C speed, through the same allowlist.

A 1,024-rank checkpoint's ``.metadata`` is hundreds of MB and tens of millions of opcodes:
pickle's pure-Python unpickler (:class:`~fsdpckpt.dcp._safe_pickle.RestrictedUnpickler`)
takes minutes over it. Here pickle's C unpickler does the work, under the same rules:

- globals resolve only through the allowlist (``find_class``), whose values are all
  sealed (:class:`~fsdpckpt.dcp._allowlist.Sealed`): a BUILD, SETITEM(S), APPEND(S) or
  ADDITEMS aimed at one of them is refused by the value itself, so no pickle changes how a
  later file is read;
- before the C unpickler sees a byte, :func:`scan` walks the opcodes once (a regular
  expression runs the common ones in C; the few that carry a length or a memo index are
  checked here). The C unpickler grows its memo array to the largest index a PUT names and
  allocates a BYTEARRAY8 before reading it, so 9 bytes could ask for gigabytes: a PUT
  index beyond the pickle's own size, or a length beyond the bytes left, is refused
  first. Anything the scan cannot walk (an unknown opcode, a cut argument, no STOP) is not
  a readable pickle, refused before the C unpickler runs.

The walk and the C unpickler read opcodes alike: FRAME only announces how many bytes
follow, and each opcode's argument has the length pickle's own reader gives it.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from typing import Any

from fsdpckpt.dcp._allowlist import _Refusal
from fsdpckpt.dcp._safe_pickle import refusal, refuse_global, unreadable
from fsdpckpt.errors import FsdpCkptError

__all__ = ["fast_loads", "scan"]


def _one_of(opcodes: bytes) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in opcodes) + b"]"


# Opcodes by the shape of their argument (pickletools' table); STOP, the PUTs and the
# length-prefixed ones are left to _walk_special.
_NO_ARGUMENT = b"()012NQRabd}el]ostu)" + bytes([0x81, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8F,
                                                 0x90, 0x91, 0x92, 0x93, 0x94, 0x97, 0x98])
_ONE_BYTE = b"Khq" + bytes([0x80, 0x82])  # BININT1, BINGET, BINPUT (<= 255), PROTO, EXT1
_TWO_BYTES = b"M" + bytes([0x83])  # BININT2, EXT2
_FOUR_BYTES = b"Jj" + bytes([0x84])  # BININT, LONG_BINGET, EXT4
_EIGHT_BYTES = b"G" + bytes([0x95])  # BINFLOAT, FRAME
_ONE_LINE = b"ILFSVgP"  # INT, LONG, FLOAT, STRING, UNICODE, GET, PERSID
_TWO_LINES = b"ci"  # GLOBAL, INST


def _counted(opcode: int, lengths: range) -> bytes:
    """``opcode``, a one-byte length n, then n bytes: one alternative per length."""
    return re.escape(bytes([opcode])) + b"(?:" + b"|".join(
        re.escape(bytes([n])) + (b".{%d}" % n if n else b"") for n in lengths) + b")"


# LONG1 of up to 9 bytes (every int64 offset) and SHORT_BINUNICODE (names) in the
# expression; longer LONG1s, and the other counted opcodes, walked below.
_LONG1 = _counted(0x8A, range(10))
_SHORT_UNICODE = _counted(0x8C, range(256))

#: As many ordinary opcodes as follow, in one C-level match (possessive: no backtracking
#: state is kept, however many opcodes it runs over).
_ORDINARY = re.compile(b"(?:" + b"|".join([
    _one_of(_NO_ARGUMENT),
    _one_of(_ONE_BYTE) + b".",
    _one_of(_TWO_BYTES) + b".{2}",
    _one_of(_FOUR_BYTES) + b".{4}",
    _one_of(_EIGHT_BYTES) + b".{8}",
    _LONG1,
    _one_of(_ONE_LINE) + b"[^\n]*\n",
    _one_of(_TWO_LINES) + b"[^\n]*\n[^\n]*\n",
    _SHORT_UNICODE,
]) + b")*+", re.DOTALL)

_STOP = ord(".")
_LENGTH_BYTES = {
    0x8C: 1, ord("U"): 1, ord("C"): 1, 0x8A: 1,  # SHORT_BINUNICODE/BINSTRING/BINBYTES, LONG1
    ord("X"): 4, ord("T"): 4, ord("B"): 4, 0x8B: 4,  # BINUNICODE, BINSTRING, BINBYTES, LONG4
    0x8D: 8, 0x8E: 8, 0x96: 8,  # BINUNICODE8, BINBYTES8, BYTEARRAY8
}
_LONG_BINPUT, _PUT = ord("r"), ord("p")


class _Unwalkable(Exception):
    """What stops the walk; said as "not a readable pickle" at the byte it names."""

    def __init__(self, where: int, message: str) -> None:
        super().__init__(message)
        self.where = where


def scan(data: bytes) -> int:
    """Walk ``data``'s opcodes up to STOP; return STOP's offset.

    Raises:
        _Unwalkable: an opcode pickle does not know, an argument cut short, a length past
            the end, a memo index beyond ``len(data)``, or no STOP.
    """
    size = len(data)
    match = _ORDINARY.match
    pos = 0
    while True:
        pos = match(data, pos).end()  # type: ignore[union-attr]  # "*+" always matches
        if pos >= size:
            raise _Unwalkable(pos, "the pickle ends before its STOP opcode")
        opcode = data[pos]
        if opcode == _STOP:
            return pos
        width = _LENGTH_BYTES.get(opcode)
        if width is not None:
            if pos + 1 + width > size:
                raise _Unwalkable(pos, f"opcode {opcode:#x}'s length is cut short")
            length = int.from_bytes(data[pos + 1:pos + 1 + width], "little",
                                    signed=width == 4 and opcode in (ord("T"), 0x8B))
            end = pos + 1 + width + length
            if length < 0 or end > size:
                raise _Unwalkable(pos, f"opcode {opcode:#x} declares {length} bytes, "
                                       f"{max(0, size - pos - 1 - width)} present")
            pos = end
        elif opcode == _LONG_BINPUT:
            if pos + 5 > size:
                raise _Unwalkable(pos, "LONG_BINPUT's index is cut short")
            _memo_index(int.from_bytes(data[pos + 1:pos + 5], "little"), pos, size)
            pos += 5
        elif opcode == _PUT:
            end = data.find(b"\n", pos + 1)
            if end < 0:
                raise _Unwalkable(pos, "PUT's index has no end of line")
            try:
                index = int(data[pos + 1:end])
            except ValueError:
                raise _Unwalkable(pos, "PUT's index is not a number") from None
            _memo_index(index, pos, size)
            pos = end + 1
        else:
            raise _Unwalkable(pos, f"no pickle opcode or a cut argument: {data[pos:pos + 1]!r}")


def _memo_index(index: int, pos: int, size: int) -> None:
    # An honest pickle numbers its memo from 0, at least one opcode per entry: an index
    # beyond the pickle's size is one pickle's C unpickler would grow its memo array to.
    if not 0 <= index <= size:
        raise _Unwalkable(pos, f"a memo index of {index} in a pickle of {size} bytes")


class _Unpickler(pickle.Unpickler):
    """pickle's C unpickler, globals from the allowlist only, no persistent ids."""

    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], source: str):
        self.file = io.BytesIO(data)
        super().__init__(self.file)
        self._allowed = allowed
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            refuse_global(self._source, module, name)


def fast_loads(data: bytes, *, allowed: Mapping[tuple[str, str], Any], source: str) -> Any:
    """Unpickle ``data`` at C speed through ``allowed``, whose values must all be sealed.

    The same refusals as :func:`fsdpckpt.dcp._safe_pickle.safe_loads`, raised as the same
    errors: :class:`~fsdpckpt.errors.UnsafePickleError` for a global outside ``allowed`` or
    a state-setting opcode aimed at one inside it, :class:`~fsdpckpt.errors.NotACheckpointError`
    for bytes that are not a readable pickle.
    """
    try:
        scan(data)
    except _Unwalkable as exc:
        raise unreadable(source, exc.where, len(data), exc) from None
    unpickler = _Unpickler(data, allowed, source)
    try:
        return unpickler.load()
    except _Refusal as exc:
        raise refusal(source, exc.what, exc.opcode) from None
    except FsdpCkptError:
        raise
    except Exception as exc:  # the C unpickler's and the stand-ins' many ways to fail
        # Where the reader got to (the C unpickler reads a frame at a time).
        raise unreadable(source, unpickler.file.tell(), len(data), exc) from exc
