"""A ``.metadata`` read at C speed refuses what the pure-Python reader refuses.

pickle's C unpickler reads ``.metadata`` (``dcp/_fast_pickle.py``). The walk before it
must see the opcodes exactly where pickle does (or a PUT could hide from it), refuse every
memo index and length that would make the C unpickler allocate past the pickle's size, and
the sealed allowlist must refuse every state-setting opcode aimed at one of its values,
with the pure reader's message.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_safe_pickle import _ATTACKS, _all_snapshots, _global, _state_ops

from fsdpckpt.dcp._allowlist import METADATA_GLOBALS
from fsdpckpt.dcp._fast_pickle import _Unwalkable, fast_loads, scan
from fsdpckpt.dcp._safe_pickle import safe_loads
from fsdpckpt.dcp.reader import parse_metadata
from fsdpckpt.errors import NotACheckpointError, UnsafePickleError

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
    st.text(max_size=300) | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) |
    st.dictionaries(st.text(max_size=5), inner, max_size=4) |
    st.frozensets(st.integers(), max_size=3),
    max_leaves=20)


def _stop_offset(data: bytes) -> int:
    """Where pickle's own opcode reader finds STOP."""
    return [pos for op, _, pos in pickletools.genops(data)][-1]


@settings(max_examples=300, deadline=None)
@given(value=_VALUES, protocol=st.integers(0, 5))
def test_the_walk_finds_every_opcode_where_pickle_does(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    assert scan(data) == _stop_offset(data)
    assert _outcome(fast_loads, data) == _outcome(safe_loads, data)


def _outcome(loads, data):
    """What a reader makes of ``data``: its value, or the type of error it refuses it with."""
    try:
        return loads(data, allowed=METADATA_GLOBALS, source="x")
    except (NotACheckpointError, UnsafePickleError) as exc:
        return type(exc)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_end_in_a_checkpoint_error_or_a_value(data):
    with contextlib.suppress(NotACheckpointError, UnsafePickleError):
        fast_loads(b"\x80\x04" + data, allowed=METADATA_GLOBALS, source="x")


@pytest.mark.parametrize("data", [
    b"\x80\x04Nr\xff\xff\xff\x07.",  # LONG_BINPUT 0x07FFFFFF
    b"\x80\x02Np134217727\n.",  # PUT, as text
    b"(Np99999999999999999999\n.",  # protocol 0
    b"\x80\x04N\x94N\x94Nr\x40\x00\x00\x00.",  # 64 > the pickle's 15 bytes
])
def test_a_memo_index_past_the_pickle_is_refused_before_unpickling(data):
    with pytest.raises(_Unwalkable, match="memo index"):
        scan(data)
    with pytest.raises(NotACheckpointError, match="not a readable pickle"):
        parse_metadata(data, source="x")


@pytest.mark.parametrize("opcode", [b"\x96", b"\x8e", b"\x8d"])  # BYTEARRAY8, BINBYTES8...
def test_a_length_past_the_end_is_refused_before_unpickling(opcode):
    data = b"\x80\x05" + opcode + (1 << 40).to_bytes(8, "little") + b"abc."
    with pytest.raises(NotACheckpointError, match="declares 1099511627776 bytes, 4 present"):
        fast_loads(data, allowed=METADATA_GLOBALS, source="x")


@pytest.mark.parametrize("data", [b"\x80\x04N", b"\x80\x04J\x01", b"\x80\x04\xff.", b"\x80\x04c\n"])
def test_what_the_walk_cannot_walk_is_not_a_readable_pickle(data):
    with pytest.raises(NotACheckpointError, match="not a readable pickle"):
        fast_loads(data, allowed=METADATA_GLOBALS, source="x")


def test_a_put_hidden_in_a_string_is_a_string():
    # The bytes of a LONG_BINPUT inside a name: data, not an opcode, for pickle and the walk.
    name = "r\xff\xff\xff\x07"
    data = pickle.dumps({name: 1}, protocol=4)
    assert fast_loads(data, allowed=METADATA_GLOBALS, source="x") == {name: 1}


@pytest.mark.parametrize("key", sorted(METADATA_GLOBALS), ids=lambda k: f"{k[0]}.{k[1]}")
def test_state_setting_opcodes_on_a_sealed_global_are_refused_at_c_speed(key):
    before = _all_snapshots()
    for attack, ops in _ATTACKS.items():
        data = b"\x80\x02" + _global(*key) + ops() + pickle.STOP
        with pytest.raises(UnsafePickleError, match="refusing a pickle that changes") as caught:
            fast_loads(data, allowed=METADATA_GLOBALS, source="the/file")
        assert "\n" not in str(caught.value) and "the/file" in str(caught.value), attack
    assert _all_snapshots() == before


def test_build_on_a_size_is_refused_at_c_speed():
    data = (b"\x80\x02" + _global("torch", "Size") + _state_ops(((1, 2),)) + pickle.REDUCE +
            _state_ops({"x": 1}) + pickle.BUILD + pickle.STOP)
    with pytest.raises(UnsafePickleError, match="a tuple, which takes no state"):
        fast_loads(data, allowed=METADATA_GLOBALS, source="x")


def test_a_global_outside_the_allowlist_is_refused_at_c_speed(tmp_path):
    from conftest import hostile_pickle

    sentinel = tmp_path / "pwned"
    with pytest.raises(UnsafePickleError, match="refusing to load the global"):
        fast_loads(hostile_pickle(sentinel), allowed=METADATA_GLOBALS, source="x")
    assert not sentinel.exists()


def test_real_metadata_reads_the_same_through_either_reader():
    from fsdpckpt.dcp import _schema

    from conftest import DCP_FOLDERS

    for folder in DCP_FOLDERS.values():
        data = (folder / ".metadata").read_bytes()
        slow = safe_loads(data, allowed=METADATA_GLOBALS, source="x")
        fast = fast_loads(data, allowed=METADATA_GLOBALS, source="x")
        assert _schema._parse(slow, len(data)) == _schema._parse(fast, len(data))


def test_the_c_unpickler_is_given_no_file_object_it_could_be_made_to_seek():
    # The C reader reads from an in-memory copy: the walk saw exactly those bytes.
    from fsdpckpt.dcp import _fast_pickle

    unpickler = _fast_pickle._Unpickler(b"N.", METADATA_GLOBALS, "x")
    assert isinstance(unpickler.file, io.BytesIO)
