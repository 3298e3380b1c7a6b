"""Names from a checkpoint cannot forge lines or drive the terminal; an error is one capped line.

Tensor names, file names and paths may hold newlines, carriage returns, tabs, ESC
sequences, C1 controls or bidi overrides. Human output shows them escaped; ``--json``
keeps the exact strings; the CLI's error line is escaped and capped in length.
"""

from __future__ import annotations

import json

import pytest

from fsdpckpt._printable import MAX_ERROR_CHARS, cap_line, printable
from fsdpckpt.errors import CorruptCheckpointError

from conftest import assert_one_line_error, single_process
from conftest import run_cli as run

_EVIL = "w\n\r\t\x1b[2J\x9b31m\x7f\u202egpj.exe"
_SHOWN = "w\\n\\r\\t\\x1b[2J\\x9b31m\\x7f\\u202egpj.exe"
_RAW = ("\n", "\r", "\t", "\x1b", "\x9b", "\x7f", "\u202e")


def _no_raw_controls(text: str) -> bool:
    """Only the line breaks the report itself makes: no other control or bidi character."""
    return not any(c in text.replace("\n", "") for c in _RAW if c != "\n")


# --- the escaping itself -----------------------------------------------------------------

def test_printable_escapes_controls_line_breaks_and_bidi_overrides():
    assert printable(_EVIL) == _SHOWN


@pytest.mark.parametrize("text", ["model.layers.0.weight", "poids.é", "权重", "a b", "🙂", ""])
def test_printable_leaves_ordinary_names_unchanged(text):
    assert printable(text) == text


def test_a_long_line_is_cut_with_a_marker_saying_so():
    line = cap_line("x" * 10_000)
    assert len(line) <= MAX_ERROR_CHARS
    assert line.endswith("more characters; --debug shows all]") and "[cut:" in line


def test_a_short_line_is_kept_whole():
    assert cap_line("x" * 100) == "x" * 100


# --- human output of each command --------------------------------------------------------

@pytest.fixture
def evil_checkpoint(tmp_path):
    """A DCP folder (itself in a folder whose name has an ESC) with a tensor named _EVIL."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ck\x1b[31mpt"
    dcp.save({_EVIL: torch.arange(4.0), "ok": torch.zeros(2)}, checkpoint_id=folder,
             **single_process())
    return folder


def test_inspect_escapes_tensor_names_and_paths(evil_checkpoint):
    result = run("inspect", evil_checkpoint)
    assert result.exit_code == 0, result.output
    assert _SHOWN in result.stdout and "ck\\x1b[31mpt" in result.stdout
    assert _no_raw_controls(result.stdout)


def test_inspect_json_keeps_exact_names(evil_checkpoint):
    doc = json.loads(run("inspect", evil_checkpoint, "--json").stdout)
    names = {t["name"] for part in doc["parts"] for t in part["tensors"]}
    assert _EVIL in names


def test_inspect_lists_one_line_per_tensor_whatever_its_name(evil_checkpoint):
    out = run("inspect", evil_checkpoint).stdout
    assert sum("gpj.exe" in line for line in out.splitlines()) == 1


def test_verify_escapes_paths_and_problems(evil_checkpoint):
    data = evil_checkpoint / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[blob.index(b"data/0") + 80] ^= 0xFF  # a byte of a tensor's data
    data.write_bytes(bytes(blob))
    result = run("verify", evil_checkpoint)
    assert result.exit_code == 1
    assert "ck\\x1b[31mpt" in result.stdout and _no_raw_controls(result.stdout)
    assert_one_line_error(result, "ck\\x1b[31mpt")


def test_merge_report_escapes_paths(evil_checkpoint, tmp_path):
    result = run("merge", evil_checkpoint, tmp_path / "out\x1b]0;title\x07", "--quiet")
    assert result.exit_code == 0, result.output
    assert "out\\x1b]0;title\\x07" in result.stdout and _no_raw_controls(result.stdout)


def test_convert_report_escapes_paths(evil_checkpoint, tmp_path):
    assert run("merge", evil_checkpoint, tmp_path / "m", "--quiet").exit_code == 0
    result = run("convert", tmp_path / "m" / "model.safetensors", tmp_path / "d\u202eo")
    assert result.exit_code == 0, result.output
    assert "d\\u202eo" in result.stdout and _no_raw_controls(result.stdout)


# --- the error line ------------------------------------------------------------------------

def test_error_line_escapes_a_path_with_a_newline_and_escape_codes(tmp_path):
    missing = tmp_path / "no\nsuch\x1b[2J"
    result = run("inspect", missing)
    assert_one_line_error(result, "no\\nsuch\\x1b[2J")


def test_error_line_from_a_message_with_newlines_stays_one_line(monkeypatch):
    import fsdpckpt.inspection.inspect

    def boom(*_args, **_kwargs):
        raise CorruptCheckpointError("first\nsecond\r\x1b[1mthird")

    monkeypatch.setattr(fsdpckpt.inspection.inspect, "inspect_checkpoint", boom)
    assert_one_line_error(run("inspect", "x"), "first\\nsecond\\r\\x1b[1mthird")


def test_error_line_is_capped_and_says_how_to_see_all(monkeypatch):
    import fsdpckpt.inspection.inspect

    def boom(*_args, **_kwargs):
        raise CorruptCheckpointError("damaged: " + "n" * 50_000)

    monkeypatch.setattr(fsdpckpt.inspection.inspect, "inspect_checkpoint", boom)
    result = run("inspect", "x")
    assert_one_line_error(result, "--debug shows all")
    assert len(result.stderr.strip()) <= len("fsdpckpt: error: ") + MAX_ERROR_CHARS


def test_unexpected_errors_are_escaped_and_capped_too(monkeypatch):
    import fsdpckpt.inspection.inspect

    def boom(*_args, **_kwargs):
        raise RuntimeError("a\nb" * 5000)

    monkeypatch.setattr(fsdpckpt.inspection.inspect, "inspect_checkpoint", boom)
    result = run("inspect", "x")
    assert_one_line_error(result, "a\\nb")
    assert len(result.stderr.strip()) <= len("fsdpckpt: error: ") + MAX_ERROR_CHARS
