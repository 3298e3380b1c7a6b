"""Fuzzing convert's input: whatever the file, only fsdpckpt's errors come out.

Seeded hypothesis searches with a bounded budget over ``convert`` (and
``load_full_state_dict``, which reads the same files): damaged copies of a real merged
safetensors file, safetensors headers built from odd values (dtypes that are not
strings, negative or overlapping offsets, bad shapes, fsdpckpt metadata of the wrong
shape or nested deep), and shard indexes of every JSON shape.

A longer run by hand: see tests/fuzzing.py.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdpckpt import convert, load_full_state_dict, merge
from fsdpckpt.errors import FsdpCkptError, NotACheckpointError

from conftest import DCP_FOLDERS
from fuzzing import damaged, fuzz_settings

_FUZZ = fuzz_settings(0.5, minimum=20)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One scratch folder the examples write into."""
    return tmp_path_factory.mktemp("fuzz-convert")


def _real_safetensors() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        merge(DCP_FOLDERS["fsdp2-optimizer"], tmp)  # tensors, key paths and objects
        return (Path(tmp) / "model.safetensors").read_bytes() if \
            (Path(tmp) / "model.safetensors").exists() else \
            next(Path(tmp).glob("*.safetensors")).read_bytes()


_REAL = _real_safetensors()


def _convert(scratch: Path, name: str, data: bytes) -> None:
    source = scratch / name
    source.write_bytes(data)
    for call in (lambda: convert(source, scratch / "out", overwrite=True),
                 lambda: load_full_state_dict(source)):
        try:
            call()
        except FsdpCkptError as exc:
            message = str(exc)
            assert "\n" not in message and name in message, message


def _safetensors(header: object, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


# -- damaged real files -------------------------------------------------------------------

def _damaged() -> st.SearchStrategy[bytes]:
    header_end = 8 + struct.unpack_from("<Q", _REAL)[0]

    def mostly_in_the_header(data: bytearray) -> st.SearchStrategy[int]:  # where parsing is
        return st.one_of(st.integers(0, min(header_end, len(data)) - 1),
                         st.integers(0, len(data) - 1))

    return damaged(_REAL, steps=4, kinds=("flip", "byte", "cut", "insert", "drop"),
                   where=mostly_in_the_header, values=st.sampled_from(b'{}[]",:0-9e\\\x00\xff'))


@_FUZZ
@given(data=_damaged())
def test_damaged_real_safetensors_raise_only_fsdpckpt_errors(scratch, data):
    _convert(scratch, "damaged.safetensors", data)


# -- headers built from odd values ----------------------------------------------------------

_ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                 st.text(max_size=6), st.sampled_from(["F32", "BF16", "I64", "x", ""]),
                 st.lists(st.integers(-2, 2**40), max_size=3), st.just({}), st.just([]))
_DEEP = st.integers(1, 5000).map(lambda n: "[" * n + "]" * n)
_JSON_TEXT = st.one_of(_DEEP, st.just("{"), st.just('{"a": 5}'), st.just("[1, 2]"),
                       st.just('{"a": ["model", 1, null]}'), st.just('{"a": []}'),
                       st.just('{"x": {"__tensor__": 5}}'), st.just("1" * 5000),
                       _DEEP.map(lambda d: '{"x": ' + d + "}"))


@st.composite
def _header(draw) -> bytes:
    header: dict = {}
    for index in range(draw(st.integers(0, 3))):
        entry = {"dtype": draw(st.one_of(st.sampled_from(["F32", "F16", "I8"]), _ODD)),
                 "shape": draw(st.one_of(st.lists(st.integers(-1, 4), max_size=2), _ODD)),
                 "data_offsets": draw(st.one_of(st.tuples(st.integers(-4, 40),
                                                          st.integers(-4, 40)).map(list), _ODD))}
        header[f"t{index}"] = draw(st.one_of(st.just(entry), _ODD))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(
            st.dictionaries(st.sampled_from(["fsdpckpt.key_paths", "fsdpckpt.objects",
                                             "format"]), _JSON_TEXT, max_size=2),
            _ODD))
    body = json.dumps(header).encode()
    data = draw(st.binary(max_size=40))
    return _safetensors(body, data)


@_FUZZ
@given(data=_header())
def test_odd_safetensors_headers_raise_only_fsdpckpt_errors(scratch, data):
    _convert(scratch, "odd.safetensors", data)


# -- shard indexes ------------------------------------------------------------------------

@_FUZZ
@given(text=st.one_of(_JSON_TEXT, _JSON_TEXT.map(lambda t: '{"weight_map": ' + t + "}"),
                      st.binary(max_size=32).map(lambda b: b.decode("latin1"))))
def test_odd_shard_indexes_raise_only_fsdpckpt_errors(scratch, text):
    _convert(scratch, "odd.safetensors.index.json", text.encode("utf-8", "surrogatepass"))


# -- the escapes found before, one test each ------------------------------------------------

_ONE = {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}


@pytest.mark.parametrize("key, text", [
    ("fsdpckpt.key_paths", "[1, 2]"),                  # was AttributeError
    ("fsdpckpt.key_paths", '{"t": 5}'),                # was TypeError
    ("fsdpckpt.key_paths", "[" * 100_000),             # was RecursionError
    ("fsdpckpt.objects", '{"x":' + "[" * 900 + "]" * 900 + "}"),  # was RecursionError
])
def test_garbled_fsdpckpt_metadata_is_one_corrupt_error(tmp_path, key, text):
    path = tmp_path / "m.safetensors"
    path.write_bytes(_safetensors({"__metadata__": {key: text}, **_ONE}, b"\0" * 4))
    with pytest.raises(FsdpCkptError, match="m.safetensors"):
        convert(path, tmp_path / "out")
    with pytest.raises(FsdpCkptError, match="m.safetensors"):
        load_full_state_dict(path)


def test_a_deeply_nested_shard_index_is_not_a_shard_index(tmp_path):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text('{"weight_map": ' + "[" * 100_000)
    with pytest.raises(NotACheckpointError, match="model.safetensors.index.json"):
        convert(path, tmp_path / "out")
    with pytest.raises(NotACheckpointError, match="model.safetensors.index.json"):
        load_full_state_dict(path)
