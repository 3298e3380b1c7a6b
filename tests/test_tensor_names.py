"""A tensor's two names (issue 43, point 3): stored (``model.0.weight``, as inspect lists it)
and output (``0.weight``, as merge writes it). Every verb's name patterns match either, so a
name copied from one verb's output selects the same tensors in every other verb."""

from __future__ import annotations

import json
import struct

import pytest

from conftest import FIXTURES, assert_one_line_error
from conftest import run_cli as run

CKPT = FIXTURES / "fsdp2_accelerate"


def _names_in(safetensors_file) -> list[str]:
    """The tensor names of a safetensors file, from its header."""
    with open(safetensors_file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sorted(n for n in header if n != "__metadata__")


def _merged(tmp_path, *flags, file="model.safetensors") -> list[str]:
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    result = run("merge", CKPT, out, "-q", *flags)
    assert result.exit_code == 0, result.output
    return _names_in(out / file)


def _inspected(*flags) -> dict[str, list[str]]:
    result = run("inspect", CKPT, "--json", *flags)
    assert result.exit_code == 0, result.output
    return {p["name"]: sorted(t["name"] for t in p["tensors"])
            for p in json.loads(result.stdout)["parts"]}


def test_merge_include_takes_the_stored_name_inspect_lists(tmp_path):
    assert _merged(tmp_path, "--include", "model.0.*") == \
        _merged(tmp_path, "--include", "0.*") == ["0.bias", "0.weight"]


def test_merge_exclude_takes_the_stored_name_inspect_lists(tmp_path):
    assert _merged(tmp_path, "--exclude", "model.0.*") == \
        _merged(tmp_path, "--exclude", "0.*") == ["2.bias", "2.weight"]


def test_merge_optimizer_include_takes_the_stored_names_of_both_parts(tmp_path):
    stored = _merged(tmp_path, "--optimizer", "--include", "model.0.*",
                     "--include", "optimizer.state.0.*", file="optimizer.safetensors")
    output = _merged(tmp_path, "--optimizer", "--include", "0.*", "--include", "state.0.*",
                     file="optimizer.safetensors")
    assert stored == output and output
    assert all(n.startswith("state.0.") for n in output)


def test_merge_optimizer_exclude_takes_the_stored_name(tmp_path):
    stored = _merged(tmp_path, "--optimizer", "--exclude", "optimizer.state.0.*",
                     file="optimizer.safetensors")
    assert stored == _merged(tmp_path, "--optimizer", "--exclude", "state.0.*",
                             file="optimizer.safetensors")
    assert stored and not any(n.startswith("state.0.") for n in stored)


def test_inspect_name_takes_the_output_name_merge_writes():
    assert _inspected("--name", "0.*") == _inspected("--name", "model.0.*") == \
        {"pytorch_model_fsdp_0": ["model.0.bias", "model.0.weight"], "optimizer_0": []}


def test_inspect_name_takes_the_output_name_of_an_optimizer_tensor():
    tensors = _inspected("--name", "state.0.weight.*")["optimizer_0"]
    assert tensors == _inspected("--name", "optimizer.state.0.weight.*")["optimizer_0"]
    assert tensors and all(n.startswith("optimizer.state.0.weight.") for n in tensors)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    out = tmp_path_factory.mktemp("merged")
    assert run("merge", CKPT, out, "-q", "--optimizer", "--overwrite").exit_code == 0
    return out


@pytest.mark.parametrize("flags, stored, output", [
    ((), "model.0.*", "0.*"),
    (("--optimizer",), "optimizer.state.0.*", "state.0.*"),
])
def test_diff_name_takes_the_stored_name_inspect_lists(merged, flags, stored, output):
    def compared(pattern):
        result = run("diff", CKPT, merged, "--json", "--name", pattern, *flags)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert not report["missing"] and not report["unexpected"], report
        return sorted(t["name"] for t in report["tensors"])

    assert compared(stored) == compared(output)
    assert compared(output)


def test_merge_no_match_names_the_output_and_the_stored_names(tmp_path):
    result = run("merge", CKPT, tmp_path / "out", "--include", "layers.0.*")
    assert_one_line_error(result, "no tensor left to merge",
                          "its 4 tensors are named '0.weight', '0.bias', '2.weight', '2.bias' "
                          "(stored as 'model.0.weight', 'model.0.bias', 'model.2.weight', "
                          "'model.2.bias')")
    assert not (tmp_path / "out").exists()


def test_inspect_no_match_says_both_names_are_tried():
    result = run("inspect", CKPT, "--name", "layers.0.*")
    assert result.exit_code == 0, result.output
    said = next(line for line in result.stdout.splitlines() if "No tensor" in line)
    assert "as stored" in said and "as merge writes it" in said, said


def test_diff_name_matching_nothing_is_an_error_naming_both_forms(merged):
    result = run("diff", CKPT, merged, "--name", "layers.0.*")
    assert_one_line_error(result, "'layers.0.*'",
                          "its 4 tensors are named '0.weight', '0.bias', '2.weight', '2.bias' "
                          "(stored as 'model.0.weight', 'model.0.bias', 'model.2.weight', "
                          "'model.2.bias')")
