"""JSON read from a file: every failure is one ValueError with a one-line message, nesting
is bounded, and ``loads_json`` turns the failure into fsdpckpt's error naming the file.

Specifies ``fsdpckpt._io.jsonio`` directly; the parsers that use it (manifest, safetensors
header, index files, encoded objects) have fuzz suites of their own.
"""

from __future__ import annotations

import pytest

from fsdpckpt._io.jsonio import MAX_JSON_DEPTH, loads_json, parse_json
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError


def _nested(depth: int, kind: str = "list") -> str:
    """A document nested ``depth`` levels deep: ``[[...]]`` or ``{"a": {"a": ...}}``."""
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


# --- what parses ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ('{"a": [1, 2.5, "x", null, true]}', {"a": [1, 2.5, "x", None, True]}),
    ("[]", []),
    ("7", 7),
    ('"text"', "text"),
])
def test_valid_json_parses_as_json_loads_parses_it(text, value):
    assert parse_json(text) == value


def test_json_s_own_nan_extension_parses_as_json_loads_parses_it():
    value = parse_json('{"a": NaN}')["a"]
    assert value != value


def test_bytes_in_utf8_parse_like_text():
    assert parse_json('{"poids": "é"}'.encode()) == {"poids": "é"}


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_nesting_up_to_the_limit_parses(kind):
    assert parse_json(_nested(MAX_JSON_DEPTH, kind)) is not None


# --- what is refused, always as one ValueError line -------------------------------------------

@pytest.mark.parametrize("text, words", [
    ("{", "not valid JSON: Expecting property name"),
    ("", "not valid JSON: Expecting value at line 1 column 1 (char 0)"),
    ("[1, 2,]", "not valid JSON"),
    ('"\xff"'.encode("latin1"), "not valid JSON"),  # bytes that are not UTF-8
    ("1" * 5000, "not valid JSON"),  # an integer longer than Python converts
    (_nested(MAX_JSON_DEPTH + 1), f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (_nested(MAX_JSON_DEPTH + 1, "dict"), f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (_nested(100_000), f"nested deeper than {MAX_JSON_DEPTH} levels"),  # json recurses
], ids=["unclosed", "empty", "trailing-comma", "bad-utf8", "huge-int", "deep-list",
        "deep-dict", "recursion-limit"])
def test_bad_json_is_one_value_error_line(text, words):
    with pytest.raises(ValueError) as caught:
        parse_json(text)
    assert type(caught.value) is ValueError  # not JSONDecodeError, RecursionError, ...
    message = str(caught.value)
    assert words in message and "\n" not in message and len(message) < 300


def test_a_refusal_is_raised_without_the_builtin_error_chained():
    with pytest.raises(ValueError) as caught:
        parse_json("{")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


# --- loads_json: fsdpckpt's error, naming the file -------------------------------------------

def test_loads_json_returns_the_parsed_document():
    assert loads_json('{"a": 1}', source="x.json") == {"a": 1}


def test_loads_json_names_the_file_and_says_why():
    with pytest.raises(CorruptCheckpointError) as caught:
        loads_json("[1,", source="the/index.json")
    message = str(caught.value)
    assert message.startswith("the/index.json: not valid JSON")
    assert "the file is damaged" in message and "\n" not in message


def test_loads_json_raises_the_error_class_asked_for():
    with pytest.raises(NotACheckpointError, match="the/x.json: nested deeper"):
        loads_json(_nested(MAX_JSON_DEPTH + 1), source="the/x.json", error=NotACheckpointError)


def test_loads_json_errors_are_still_value_errors():
    # Callers that catch ValueError (as for json.loads) keep working.
    with pytest.raises(ValueError):
        loads_json("nope", source="x")
