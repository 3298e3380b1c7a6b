"""Fuzzing the metadata reader: whatever the bytes, only fsdpckpt's errors come out.

Two seeded hypothesis searches, each with a bounded budget so CI runs them in seconds:
byte flips, splices and truncations of the real ``.metadata`` files in ``fixtures/``, and
random pickles assembled from the pieces a hostile file could use (every allowlisted
global, values of every type, every state-setting and memo opcode). Whatever the input,
``read_dcp_folder`` returns or raises an :class:`FsdpCkptError`, and the module-level
stand-ins are unchanged afterwards.

A longer run by hand: see tests/fuzzing.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdpckpt.dcp._safe_pickle import METADATA_GLOBALS
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import FsdpCkptError

from conftest import FIXTURES
from fuzzing import damaged, fuzz_settings

_FUZZ = fuzz_settings()

_REAL = [p.read_bytes() for p in sorted(FIXTURES.glob("**/.metadata"))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """One scratch DCP folder whose ``.metadata`` each example overwrites."""
    return tmp_path_factory.mktemp("fuzz-metadata")


def _stand_ins() -> str:
    """Everything a pickle could change on the allowlisted globals and the dtypes."""
    return repr([(key, getattr(v, "__dict__", None), getattr(v, "__defaults__", None))
                 for key, v in METADATA_GLOBALS.items()] +
                [vars(d) for d in DTYPES.values()])


_BEFORE = _stand_ins()


def _read(folder: Path, data: bytes) -> None:
    (folder / ".metadata").write_bytes(data)
    try:
        read_dcp_folder(folder)
    except FsdpCkptError as exc:
        message = str(exc)
        assert "\n" not in message and str(folder) in message, message
    assert _stand_ins() == _BEFORE


# -- damaged real files -------------------------------------------------------------------

def _damaged_real() -> st.SearchStrategy[bytes]:
    return st.sampled_from(_REAL).flatmap(
        lambda data: damaged(data, kinds=("flip", "byte", "cut", "splice", "drop")))


@_FUZZ
@given(data=_damaged_real())
def test_damaged_real_metadata_raises_only_fsdpckpt_errors(folder, data):
    _read(folder, data)


# -- random pickles from allowlisted pieces ---------------------------------------------

def _global(key: tuple[str, str]) -> bytes:
    return b"c" + key[0].encode() + b"\n" + key[1].encode() + b"\n"


def _value(value) -> bytes:
    return pickle.dumps(value, protocol=4)[2:-1]  # no PROTO, no STOP; memo via MEMOIZE


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=8),
    st.sampled_from(["__0_0.distcp", "../x", "model.w", "float32", "latin1", "rot13"]),
    st.tuples(st.integers(-3, 2**64), st.integers(0, 9)), st.lists(st.integers(0, 9), max_size=3),
)
# BUILD's two forms of state: a dict, and (dict or None, slot dict).
_STATE = st.dictionaries(st.sampled_from(["safetensors", "itemsize", "kind", "name", "state",
                                          "offsets", "fqn", "__defaults__", "__class__"]),
                         _VALUES, max_size=3)
_VALUES = st.one_of(_VALUES, _STATE, st.tuples(st.one_of(st.none(), _STATE), _STATE))

_BARE_OPCODES = [pickle.MARK, pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3,
                 pickle.EMPTY_TUPLE, pickle.EMPTY_DICT, pickle.EMPTY_LIST, pickle.EMPTY_SET,
                 pickle.DICT, pickle.LIST, pickle.FROZENSET, pickle.REDUCE, pickle.NEWOBJ,
                 pickle.NEWOBJ_EX, pickle.OBJ, pickle.BUILD, pickle.SETITEM, pickle.SETITEMS,
                 pickle.APPEND, pickle.APPENDS, pickle.ADDITEMS, pickle.POP, pickle.POP_MARK,
                 pickle.DUP, pickle.MEMOIZE, pickle.STOP, pickle.NONE]


@st.composite
def _piece(draw) -> bytes:
    kind = draw(st.sampled_from(["global", "value", "opcode", "opcode", "memo", "build"]))
    if kind == "build":  # a state-setting opcode right on an allowlisted global
        return (_global(draw(st.sampled_from(sorted(METADATA_GLOBALS)))) +
                _value(draw(st.one_of(_STATE, st.tuples(st.none(), _STATE)))) + pickle.BUILD)
    if kind == "global":
        return _global(draw(st.sampled_from(sorted(METADATA_GLOBALS))))
    if kind == "value":
        return _value(draw(_VALUES))
    if kind == "opcode":
        return draw(st.sampled_from(_BARE_OPCODES))
    index = draw(st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)))
    opcode = draw(st.sampled_from([pickle.LONG_BINGET, pickle.LONG_BINPUT, pickle.BINGET,
                                   pickle.BINPUT]))
    size = 4 if opcode in (pickle.LONG_BINGET, pickle.LONG_BINPUT) else 1
    return opcode + (index % 256**size).to_bytes(size, "little")


@st.composite
def _assembled(draw) -> bytes:
    body = b"".join(draw(st.lists(_piece(), min_size=1, max_size=40)))
    return b"\x80\x04" + body + draw(st.sampled_from([pickle.STOP, b""]))


@_FUZZ
@given(data=_assembled())
def test_pickles_from_allowlisted_pieces_raise_only_fsdpckpt_errors(folder, data):
    _read(folder, data)


# -- real metadata with one field replaced ------------------------------------------------

def _real_metadata():
    from torch.distributed.checkpoint import FileSystemReader

    found = []
    for path in sorted(FIXTURES.glob("**/.metadata")):
        try:
            found.append(FileSystemReader(str(path.parent)).read_metadata())
        except AttributeError:  # a dtype newer than this torch (float8_e8m0fnu on 2.6)
            continue
    return found


def _sites(md) -> list[tuple[object, str]]:
    """Every ``(object, attribute)`` of ``md`` a damaged or crafted file could change."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sites = [(md, name) for name in ("state_dict_metadata", "planner_data", "storage_data",
                                     "storage_meta", "version")]
    for entry in md.state_dict_metadata.values():
        if isinstance(entry, BytesStorageMetadata):
            continue
        sites += [(entry, "properties"), (entry, "size"), (entry, "chunks"),
                  (entry.properties, "dtype")]
        sites += [(chunk, name) for chunk in entry.chunks for name in ("offsets", "sizes")]
    for index, info in md.storage_data.items():
        sites += [(index, "fqn"), (index, "offset"), (info, "relative_path"),
                  (info, "offset"), (info, "length")]
    sites += [(md.planner_data, key) for key in md.planner_data]
    return sites


def _odd_values():
    import pathlib

    import torch

    return [None, -1, 0, 2**63, 10**30, 1.5, float("nan"), "x", "12", b"x", True, (), (1,),
            (-1, 2), [0, 0], ("a", 1.5), {}, {"a": 1}, {1, 2}, 1 + 2j, torch.Size,
            torch.Size([3, -1]), torch.float32, torch.strided, pathlib.PurePosixPath("a")]


@_FUZZ
@given(choice=st.data())
def test_real_metadata_with_a_field_replaced_raises_only_fsdpckpt_errors(folder, choice):
    import copy

    md = copy.deepcopy(choice.draw(st.sampled_from(_REAL_METADATA)))
    sites = _sites(md)  # before any change, so each one stays reachable
    for _ in range(choice.draw(st.integers(1, 3))):
        target, name = choice.draw(st.sampled_from(sites))
        value = choice.draw(st.sampled_from(_ODD_VALUES))
        if isinstance(target, dict):
            target[name] = value
        else:
            object.__setattr__(target, name, value)  # frozen dataclasses too
    _read(folder, pickle.dumps(md, protocol=choice.draw(st.integers(2, 5))))


_REAL_METADATA = _real_metadata()
_ODD_VALUES = _odd_values()


@_FUZZ
@given(data=st.binary(max_size=64))
def test_arbitrary_short_bytes_raise_only_fsdpckpt_errors(folder, data):
    _read(folder, data)
