"""The codec of non-tensor entries: every value kind a DCP object entry can hold survives
``dumps`` then ``loads`` (the JSON kept in safetensors metadata) equal and of the same type,
look-alikes stay apart, and what cannot be kept or is damaged is refused.

Specifies ``fsdpckpt.dcp._objects`` directly: ``encode_value``/``decode_value``,
``dumps``/``loads``, :class:`TensorValue` and ``to_torch``. Reading object entries from real
checkpoints, and merging them, is in ``test_objects.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fsdpckpt.dcp._objects import TensorValue, dumps, loads, to_torch
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.errors import CorruptCheckpointError

from deep_compare import same_value


def _round_trip(value):
    text = dumps(value)
    json.loads(text)  # plain, strict JSON: what any safetensors reader can hold
    assert "NaN" not in text and "Infinity" not in text
    return loads(text)


_VALUES = {
    "none": None,
    "true": True,
    "false": False,
    "int": 7,
    "negative int": -3,
    "int past int64": 2**100,
    "float": 0.1,
    "negative zero": -0.0,
    "inf": math.inf,
    "minus inf": -math.inf,
    "nan": math.nan,
    "complex": 1 - 2.5j,
    "complex of nan and inf": complex(math.nan, math.inf),
    "str": "poids.é 权重",
    "empty str": "",
    "bytes": b"\x00\xffabc",
    "empty bytes": b"",
    "tuple": (1, "a", None),
    "empty tuple": (),
    "list": [1, [2, [3]]],
    "set": {1, 2},
    "empty set": set(),
    "frozenset": frozenset({"a"}),
    "dict": {"lr": 0.01, "betas": (0.9, 0.99)},
    "empty dict": {},
    "int keys": {0: "a", 1: "b"},
    "int and str keys of one text": {1: "int", "1": "str"},
    "None, bool, float and tuple keys": {None: 1, True: 2, 2.5: 3, (1, 2): 4},
    "frozenset key": {frozenset({1}): 2},
}


@pytest.mark.parametrize("name", sorted(_VALUES))
def test_every_value_kind_round_trips_equal_and_of_the_same_type(name):
    value = _VALUES[name]
    assert same_value(_round_trip(value), value)


def test_a_value_nesting_every_kind_round_trips():
    value = {"all": [tuple(_VALUES.values()), {"inner": dict(_VALUES["dict"])}]}
    assert same_value(_round_trip(value), value)


@pytest.mark.parametrize("value", [
    {"__tuple__": [1]}, {"__float__": "inf"}, {"__complex__": [1, 2]}, {"__set__": []},
    {"__bytes__": ""}, {"__dict__": 1}, {"__tensor__": {}}, {"frozen": True, "__set__": [1]},
    {"a": {"__set__": [1]}},
], ids=lambda v: next(iter(v)))
def test_a_dict_that_looks_like_an_encoding_stays_a_dict(value):
    assert same_value(_round_trip(value), value)


def test_a_list_and_a_tuple_stay_apart():
    got = _round_trip({"l": [1, 2], "t": (1, 2)})
    assert type(got["l"]) is list and type(got["t"]) is tuple


def test_dict_order_is_kept():
    value = {"b": 1, "a": 2, 3: "c"}
    assert list(_round_trip(value)) == ["b", "a", 3]


# --- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [object(), print, bytearray(b"x"), [1, object()]],
                         ids=["object", "function", "bytearray", "nested"])
def test_a_value_of_another_type_cannot_be_kept(value):
    with pytest.raises(TypeError, match="cannot keep a"):
        dumps(value)


@pytest.mark.parametrize("text", ["{", "[" * 200 + "]" * 200, ""], ids=["bad", "deep", "empty"])
def test_text_that_is_not_json_is_a_value_error(text):
    with pytest.raises(ValueError):
        loads(text)


# --- tensors inside values ----------------------------------------------------------------------

def _bf16() -> TensorValue:
    return TensorValue(DTYPES["bfloat16"], bytes(range(12)), 1, (2, 2), (1, 2))


def test_json_form_of_a_tensor_value_is_lossless():
    value = _bf16()
    back = loads(dumps({"x": [value, (1 + 2j, {3})]}))
    assert back == {"x": [value, (1 + 2j, {3})]}
    assert torch.equal(back["x"][0].to_torch().view(torch.int16),
                       torch.frombuffer(bytearray(range(12)), dtype=torch.int16)
                       .as_strided((2, 2), (1, 2), 1))


def test_an_empty_tensor_value_round_trips_and_builds():
    value = TensorValue(DTYPES["float32"], b"", 0, (0, 3), (3, 1))
    assert _round_trip(value) == value
    assert value.to_torch().shape == (0, 3) and value.to_torch().dtype == torch.float32


def test_tensor_values_are_equal_by_every_field():
    value = _bf16()
    assert value == _bf16() and hash(value) == hash(_bf16())
    for other in (TensorValue(DTYPES["int16"], bytes(range(12)), 1, (2, 2), (1, 2)),
                  TensorValue(DTYPES["bfloat16"], bytes(12), 1, (2, 2), (1, 2)),
                  TensorValue(DTYPES["bfloat16"], bytes(range(12)), 0, (2, 2), (1, 2)),
                  TensorValue(DTYPES["bfloat16"], bytes(range(12)), 1, (2, 2), (2, 1))):
        assert value != other
    assert value != "TensorValue" and repr(value) == "TensorValue(bfloat16, shape=[2, 2])"


def test_to_torch_turns_every_nested_tensor_value_into_a_tensor_and_keeps_the_rest():
    value = {"a": [_bf16(), (_bf16(), "x")], "b": {1, 2}, "c": 3}
    got = to_torch(value)
    assert isinstance(got["a"][0], torch.Tensor) and isinstance(got["a"][1][0], torch.Tensor)
    assert type(got["a"][1]) is tuple and got["a"][1][1] == "x"
    assert got["b"] == {1, 2} and got["c"] == 3


def test_a_tensor_built_from_a_value_owns_its_bytes():
    value = _bf16()
    value.to_torch().view(torch.int16).fill_(0)
    assert value.storage == bytes(range(12))


def test_json_tensor_reaching_past_its_storage_is_refused():
    doc = {"x": {"__tensor__": {"dtype": "float32", "storage": "AAAAAA==", "offset": 1,
                                "shape": [4], "stride": [1]}}}
    with pytest.raises(CorruptCheckpointError, match="reaches past its storage"):
        loads(json.dumps(doc))


@pytest.mark.parametrize("doc", [
    {"dtype": "float99", "storage": "", "offset": 0, "shape": [0], "stride": [1]},
    {"dtype": "float32", "storage": 5, "offset": 0, "shape": [0], "stride": [1]},
    {"dtype": "float32", "storage": "not base64!", "offset": 0, "shape": [0], "stride": [1]},
    {"dtype": "float32", "storage": "AAAA", "offset": 0, "shape": [0], "stride": [1]},
    {"dtype": "float32", "storage": "AAAAAA==", "offset": -1, "shape": [1], "stride": [1]},
    "not a dict",
])
def test_a_damaged_json_tensor_is_corrupt(doc):
    with pytest.raises(CorruptCheckpointError):
        loads(json.dumps({"x": {"__tensor__": doc}}))


@pytest.mark.parametrize("value", [slice(1, 5, 2), slice(None), [slice(0, None, -1)],
                                   2**70, -(10**5000), {"big": 3**9000}],
                         ids=["slice", "slice(None)", "in a list", "2**70", "-10**5000",
                              "3**9000 in a dict"])
def test_slices_and_ints_of_any_size_round_trip(value):
    assert loads(dumps(value)) == value


@pytest.mark.parametrize("text", ['{"__slice__": [1, 2, 3, 4]}', '{"__slice__": 5}',
                                  '{"__int__": "zz"}', '{"__int__": 7}',
                                  '{"__complex__": ["a", 1]}', '{"__tuple__": 3}'])
def test_a_tagged_value_that_encode_never_writes_is_one_error(text):
    from fsdpckpt import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError, match="cannot be decoded"):
        loads(text)


def _nested(depth):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _cyclic():
    value: list = []
    value.append({"x": value})
    return value


@pytest.mark.parametrize("value, why", [(_nested(10_000), "nested more than"),
                                        (_cyclic(), "contains itself")])
def test_values_no_state_dict_holds_are_refused(value, why):
    from fsdpckpt import NotACheckpointError
    from fsdpckpt.dcp._objects import check_plain_value

    with pytest.raises(NotACheckpointError, match=why):
        check_plain_value(value, source="entry X", size=1000)


def test_honest_nesting_and_shared_values_pass():
    from fsdpckpt.dcp._objects import check_plain_value

    shared = [1, 2]
    check_plain_value({"param_groups": [{"params": shared, "betas": (0.9, 0.99)}],
                       "again": shared, "deep": _nested(30)}, source="entry X", size=1000)
