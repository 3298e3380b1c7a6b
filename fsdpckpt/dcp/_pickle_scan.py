"""The opcode scan: where every opcode of a pickle is, at C speed, before anything reads it.

:func:`scan` finds every opcode of a pickle the way pickle's own reader does (a regular
expression runs the common ones in C; the few that carry a length, a memo index or a
frame are checked here) and refuses what readers would read two ways or allocate for
before reading: an argument that crosses a frame's end or a frame inside a frame (pickle's
C reader fed a ``BytesIO`` drops the rest of the frame, the one reading a file and the
pure-Python one read straight through), a memo index beyond the pickle's size (the C
unpickler grows its memo array to it) and a length beyond the bytes left (it allocates a
BYTEARRAY8 before reading it). Anything it cannot walk (an unknown opcode, a cut argument,
no STOP) is not a readable pickle. Every pickle fsdpckpt reads goes through it, then
through the shape walk of :mod:`fsdpckpt.dcp._pickle_walk`.
"""

from __future__ import annotations

import pickletools
import re

__all__ = ["_Unwalkable", "scan"]


class _Unwalkable(Exception):
    """What stops either walk; said as "not a readable pickle" at the byte it names, or,
    where an unpickler would refuse the pickle as unsafe, as that: ``refused``, a global
    ``(module, name)`` outside the allowlist; ``state``, ``(what, opcode)`` for a
    state-setting opcode aimed at what it may not change."""

    def __init__(self, where: int, message: str, *,
                 refused: tuple[str, str] | None = None,
                 state: tuple[str, str] | None = None) -> None:
        super().__init__(message)
        self.where = where
        self.refused = refused
        self.state = state


def _one_of(opcodes: bytes) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in opcodes) + b"]"


# Opcodes by the shape of their argument (pickletools' table); STOP, the PUTs and the
# length-prefixed ones are left to _walk_special.
_NO_ARGUMENT = b"()012NQRabd}el]ostu)" + bytes([0x81, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8F,
                                                 0x90, 0x91, 0x92, 0x93, 0x94, 0x97, 0x98])
_ONE_BYTE = b"Khq" + bytes([0x80, 0x82])  # BININT1, BINGET, BINPUT (<= 255), PROTO, EXT1
_TWO_BYTES = b"M" + bytes([0x83])  # BININT2, EXT2
_FOUR_BYTES = b"Jj" + bytes([0x84])  # BININT, LONG_BINGET, EXT4
_EIGHT_BYTES = b"G"  # BINFLOAT (FRAME is walked below: frames must tile the opcodes)
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
_LONG_BINPUT, _PUT, _FRAME = ord("r"), ord("p"), 0x95
#: Every opcode pickle knows (protocols 0 to 5).
_KNOWN = frozenset(op.code.encode("latin-1")[0] for op in pickletools.opcodes)


def scan(data: bytes) -> int:
    """Walk ``data``'s opcodes up to STOP; return STOP's offset.

    Frames must tile the opcodes: a FRAME only where no frame is open, and every opcode
    with its argument wholly inside the frame it starts in (or outside every frame).
    pickle's C unpickler fed from memory, its pure-Python one and torch's reads of a file
    then all see the same opcodes; where an argument crosses a frame's end they do not
    (the C unpickler reading a ``BytesIO`` drops the rest of the frame).

    Raises:
        _Unwalkable: an opcode pickle does not know, an argument cut short or crossing a
            frame's end, a frame inside a frame, a length past the end, a memo index
            beyond ``len(data)``, or no STOP.
    """
    size = len(data)
    match = _ORDINARY.match
    pos = 0
    limit = size  # the end of the open frame, or of the data
    while True:
        pos = match(data, pos, limit).end()  # type: ignore[union-attr]  # "*+" always matches
        if pos == limit and limit < size:
            limit = size  # the frame ends exactly at an opcode: closed
            continue
        if pos >= size:
            raise _Unwalkable(pos, "the pickle ends before its STOP opcode")
        opcode = data[pos]
        if opcode == _STOP:
            return pos
        if opcode == _FRAME:
            if limit < size:
                raise _Unwalkable(pos, "a frame begins inside another frame")
            if pos + 9 > size:
                raise _Unwalkable(pos, "FRAME's length is cut short")
            limit = pos + 9 + int.from_bytes(data[pos + 1:pos + 9], "little")
            if limit > size:
                raise _Unwalkable(pos, f"a frame of {limit - pos - 9} bytes, "
                                       f"{size - pos - 9} present")
            pos += 9
            continue
        width = _LENGTH_BYTES.get(opcode)
        if width is not None:
            if pos + 1 + width > limit:
                raise _Unwalkable(pos, f"opcode {opcode:#x}'s length is cut short"
                                       f"{_by_frame(limit, size)}")
            length = int.from_bytes(data[pos + 1:pos + 1 + width], "little",
                                    signed=width == 4 and opcode in (ord("T"), 0x8B))
            end = pos + 1 + width + length
            if length < 0 or end > limit:
                raise _Unwalkable(pos, f"opcode {opcode:#x} declares {length} bytes, "
                                       f"{max(0, limit - pos - 1 - width)} present"
                                       f"{_by_frame(limit, size)}")
            pos = end
        elif opcode == _LONG_BINPUT:
            if pos + 5 > limit:
                raise _Unwalkable(pos, f"LONG_BINPUT's index is cut short"
                                       f"{_by_frame(limit, size)}")
            _memo_index(int.from_bytes(data[pos + 1:pos + 5], "little"), pos, size)
            pos += 5
        elif opcode == _PUT:
            end = data.find(b"\n", pos + 1, limit)
            if end < 0:
                raise _Unwalkable(pos, f"PUT's index has no end of line{_by_frame(limit, size)}")
            try:
                index = int(data[pos + 1:end])
            except ValueError:
                raise _Unwalkable(pos, "PUT's index is not a number") from None
            _memo_index(index, pos, size)
            pos = end + 1
        elif opcode in _KNOWN:
            # Its argument runs past the frame's end, or the pickle's, where a reader
            # reading on would run out.
            raise _Unwalkable(limit, f"opcode {opcode:#04x}'s argument is cut short"
                                     f"{_by_frame(limit, size)}")
        else:
            raise _Unwalkable(pos, f"no pickle opcode: {data[pos:pos + 1]!r}")


def _by_frame(limit: int, size: int) -> str:
    return f" by the end of its frame at byte {limit}" if limit < size else ""


def _memo_index(index: int, pos: int, size: int) -> None:
    # An honest pickle numbers its memo from 0, at least one opcode per entry: an index
    # beyond the pickle's size is one pickle's C unpickler would grow its memo array to.
    if not 0 <= index <= size:
        raise _Unwalkable(pos, f"a memo index of {index} in a pickle of {size} bytes")
