"""Differential fuzzing of fsdpckpt's two pickle readers against torch's reading.

``.metadata`` is read by pickle's C unpickler (``fast_loads``), every other pickle by the
pure-Python one (``safe_loads``); torch reads ``.metadata`` with a plain ``pickle.load`` of
the file. Real ``.metadata`` files from ``fixtures/`` and real side-file pickles are
damaged byte by byte and opcode by opcode (frames of any length anywhere, memo and stack
opcodes spliced in), and for every input:

- both of fsdpckpt's readers accept it or refuse it, and refuse it with the same error;
- what they accept, pickle's C reader reading the same bytes from a file (torch's way) and
  from memory builds too, object for object, through the same stand-ins.

Seeded and bounded (``tests/fuzzing.py``); a longer run by hand:
``FSDPCKPT_FUZZ_EXAMPLES=20000 python -m pytest tests/test_fuzz_pickle_readers.py``.
Inputs a long run found are kept in :data:`FOUND` and replayed every time.
"""

from __future__ import annotations

import io
import math
import pickle
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdpckpt.dcp._allowlist import METADATA_GLOBALS, Record, _SealedValue
from fsdpckpt.dcp._fast_pickle import fast_loads
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS, safe_loads
from fsdpckpt.errors import FsdpCkptError

from conftest import FIXTURES
from fuzzing import damaged, fuzz_settings

_METADATA = [p.read_bytes() for p in sorted(FIXTURES.glob("**/.metadata"))
             if p.stat().st_size < 200_000]


def _side_pickles() -> list[bytes]:
    """The data.pkl of each scheduler file in the fixtures (plain values, protocol 2)."""
    found = []
    for path in sorted(FIXTURES.glob("**/scheduler*.bin"))[:3]:
        with zipfile.ZipFile(path) as archive:
            found += [archive.read(n) for n in archive.namelist() if n.endswith("/data.pkl")]
    return found


_SIDE = _side_pickles()

#: Opcodes spliced in whole: the memo, the stack, frames, marks, tuples, STOP.
_OPCODES = [b"\x94", b"0", b"1", b"2", b"(", b"\x85", b"\x86", b"t", b")", b"N", b".",
            b"h\x00", b"h\x01", b"j\x02\x00\x00\x00", b"q\x03", b"e", b"s", b"u", b"a",
            b"\x8c\x03abc", b"K\x07", b"\x88", b"}", b"]", b"\x8f", b"\x90", b"\x91"]


@st.composite
def _framed(draw: st.DrawFn, source: bytes) -> bytes:
    """``source`` damaged, with frames and opcodes put anywhere."""
    data = bytearray(draw(damaged(source, steps=4)))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        if draw(st.booleans()):
            length = draw(st.integers(0, max(0, len(data) - at)))
            data[at:at] = b"\x95" + length.to_bytes(8, "little")
        else:
            data[at:at] = draw(st.sampled_from(_OPCODES))
    return bytes(data)


def _norm(value: Any, seen: dict[int, int] | None = None, depth: int = 0) -> Any:
    """A value built from stand-ins, as plain comparable data (shared objects as refs)."""
    seen = {} if seen is None else seen
    if depth > 200:
        return ("deep",)
    if isinstance(value, (str, bytes, int, bool, type(None), complex)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value)
    if id(value) in seen:
        return ("ref", seen[id(value)])
    seen[id(value)] = len(seen)
    down = depth + 1
    if isinstance(value, Record):
        return (type(value).kind, _norm(getattr(value, "args", None), seen, down),
                _norm(getattr(value, "state", None), seen, down))
    if isinstance(value, (_SealedValue, type)):
        return ("global", repr(value))
    if isinstance(value, dict):
        return ("dict", [(_norm(k, seen, down), _norm(v, seen, down)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_norm(v, seen, down) for v in value])
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, sorted(repr(_norm(v, seen, down)) for v in value))
    return ("other", type(value).__name__)


def _outcome(loads: Any, data: bytes, allowed: Mapping[tuple[str, str], Any]) -> Any:
    try:
        return ("ok", _norm(loads(data, allowed=allowed, source="x")))
    except FsdpCkptError as exc:
        return ("refused", type(exc).__name__)


class _TorchWay(pickle.Unpickler):
    """pickle's C unpickler as torch's ``read_metadata`` runs it, globals from ``allowed``."""

    def __init__(self, file: Any, allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        return self._allowed[(module, name)]


def _read_by_torch(data: bytes, allowed: Mapping[tuple[str, str], Any]) -> Any:
    with tempfile.TemporaryFile() as file:
        file.write(data)
        file.seek(0)
        from_file = _norm(_TorchWay(file, allowed).load())
    from_memory = _norm(_TorchWay(io.BytesIO(data), allowed).load())
    return from_file, from_memory


def _agree(data: bytes, allowed: Mapping[tuple[str, str], Any], *, c_too: bool) -> None:
    pure = _outcome(safe_loads, data, allowed)
    if c_too:
        fast = _outcome(fast_loads, data, allowed)
        assert fast == pure, _shown(data, fast, pure)
    if pure[0] == "ok":
        from_file, from_memory = _read_by_torch(data, allowed)
        assert from_file == pure[1] == from_memory, _shown(data, from_file, pure[1])


def _shown(data: bytes, *outcomes: Any) -> str:
    """A short account of a disagreement (the input whole only in ``FSDPCKPT_FUZZ_DUMP``)."""
    import os

    dump = os.environ.get("FSDPCKPT_FUZZ_DUMP")
    if dump:
        with open(dump, "ab") as file:
            file.write(repr(data).encode() + b"\n")
    return f"{len(data)} bytes {data[:60]!r}...: " + " vs ".join(
        repr(o)[:200] for o in outcomes)


#: Inputs long runs found where the readers disagreed (each fixed since), cut down to what
#: made them disagree.
FOUND: list[bytes] = [
    # NEWOBJ's arguments a list: the C reader takes a tuple only, the pure one any iterable.
    b"\x80\x04\x8c\x05torch\x8c\x04Size\x93]\x81.",
    b"\x80\x04\x8c\x05torch\x8c\x04Size\x93]R.",
    # An integer as text with a leading zero: 8 to the C reader, refused by the pure one.
    b"I010\n.",
    b"F1_0.5\n.",
    # SETITEM aimed at a string: "not readable" to one, "unsafe" to the other.
    b"\x80\x04\x8c\x01aNNs.",
]


@pytest.mark.parametrize("data", FOUND)
def test_what_long_runs_found_reads_alike(data):
    _agree(data, METADATA_GLOBALS, c_too=True)


@fuzz_settings()
@given(data=st.sampled_from(_METADATA).flatmap(_framed))
def test_damaged_metadata_reads_alike_in_every_reader(data):
    _agree(data, METADATA_GLOBALS, c_too=True)


@fuzz_settings(0.5)
@given(data=st.sampled_from(_SIDE).flatmap(_framed))
def test_damaged_side_file_pickles_read_alike(data):
    _agree(data, BUILTIN_GLOBALS, c_too=False)


@fuzz_settings(0.5)
@given(data=st.binary(max_size=48).map(lambda b: b"\x80\x04" + b)
       | st.lists(st.sampled_from(_OPCODES), max_size=24).map(lambda ops: b"".join(ops)))
def test_short_opcode_soups_read_alike(data):
    _agree(data, METADATA_GLOBALS, c_too=True)
