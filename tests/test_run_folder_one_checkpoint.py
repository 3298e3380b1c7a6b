"""A run folder holding exactly one finished checkpoint stands for it: every verb reads it and
says so once (stderr, or the --json document's "note"); list keeps listing the run."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import FIXTURES, assert_one_line_error, run_cli


@pytest.fixture
def run(tmp_path):
    shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "run" / "step-2")
    return tmp_path / "run"


def _note(run) -> str:
    return f"{run}: holds one checkpoint, step-2; using {run / 'step-2'}"


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_a_run_folder_with_one_checkpoint_is_read_as_it(verb, run):
    result = run_cli(verb, run)
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == f"fsdpckpt: note: {_note(run)}"


def test_merge_of_a_run_folder_with_one_checkpoint_merges_it(run, tmp_path):
    result = run_cli("merge", run, tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert f"merged {run / 'step-2' / 'pytorch_model_fsdp_0'} ->" in result.stdout
    assert result.stderr.strip() == f"fsdpckpt: note: {_note(run)}"


@pytest.mark.parametrize("verb", ["inspect", "verify", "merge"])
def test_json_of_a_run_folder_carries_the_note(verb, run, tmp_path):
    args = [verb, run] + ([tmp_path / "out", "-q"] if verb == "merge" else []) + ["--json"]
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["note"] == _note(run)
    assert "note" not in result.stderr


def test_diff_of_a_run_folder_with_one_checkpoint_reads_it(run):
    result = run_cli("diff", run, FIXTURES / "fsdp2_accelerate")
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == f"fsdpckpt: note: {_note(run)}"


def test_an_unfinished_single_save_is_still_refused(run):
    (run / "step-2" / "pytorch_model_fsdp_0" / ".metadata").unlink()
    assert_one_line_error(run_cli("inspect", run), f"{run}: holds one checkpoint (step-2)")


def test_list_still_lists_a_run_folder_with_one_checkpoint(run):
    result = run_cli("list", run)
    assert result.exit_code == 0, result.output
    assert "1 checkpoint" in result.stdout and "note" not in result.stderr
