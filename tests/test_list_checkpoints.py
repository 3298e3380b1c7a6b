"""``fsdpckpt list`` (issue 33): a run's checkpoints with their step, state, time and size,
whichever trainer saved them; committed, complete and unfinished told apart by what each
folder holds; ``--json`` one document."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import fsdpckpt
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

from conftest import FIXTURES, run_cli

ACCELERATE = FIXTURES / "fsdp2_accelerate"


def _copy(to):
    shutil.copytree(ACCELERATE, to)
    return to


def _states(found):
    return [(c.name, c.step, c.state) for c in found.checkpoints]


def test_a_managers_root_lists_steps_in_order_and_its_unfinished_save(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=None)
    for step in (9, 10):
        manager.save(step, model=torch.nn.Linear(4, 4))
    staged = _copy(tmp_path / ".tmp-checkpoint_11")
    shutil.rmtree(staged / "optimizer_0")
    found = fsdpckpt.list_checkpoints(tmp_path)
    assert _states(found) == [("checkpoint_9", 9, "committed"),
                              ("checkpoint_10", 10, "committed"),
                              (".tmp-checkpoint_11", 11, "unfinished")]
    assert found.latest.name == "checkpoint_10"
    assert all(c.bytes > 0 and c.files > 0 and c.modified for c in found.checkpoints)


def test_an_hf_trainer_output_folder(tmp_path):
    for name in ("checkpoint-500", "checkpoint-1000", "tmp-checkpoint-1500"):
        _copy(tmp_path / name)
    found = fsdpckpt.list_checkpoints(tmp_path)
    assert _states(found) == [("checkpoint-500", 500, "complete"),
                              ("checkpoint-1000", 1000, "complete"),
                              ("tmp-checkpoint-1500", 1500, "unfinished")]
    assert found.latest.name == "checkpoint-1000"


def test_an_accelerate_project_folder_lists_its_checkpoints_folder(tmp_path):
    for step in (0, 1):
        _copy(tmp_path / "checkpoints" / f"checkpoint_{step}")
    found = fsdpckpt.list_checkpoints(tmp_path)
    assert [c.step for c in found.checkpoints] == [0, 1]
    assert found.root == tmp_path / "checkpoints"


def test_a_save_without_its_metadata_is_unfinished_and_says_why(tmp_path):
    cut = _copy(tmp_path / "checkpoint_3")
    os.remove(cut / "pytorch_model_fsdp_0" / ".metadata")
    (entry,) = fsdpckpt.list_checkpoints(tmp_path).checkpoints
    assert entry.state == "unfinished" and ".metadata" in entry.why
    assert fsdpckpt.list_checkpoints(tmp_path).latest is None


def test_unnamed_checkpoints_take_the_last_written_as_the_newest(tmp_path):
    older, newer = _copy(tmp_path / "b_run"), _copy(tmp_path / "a_run")
    os.utime(older, (1_000_000, 1_000_000))
    os.utime(newer, (2_000_000, 2_000_000))
    assert fsdpckpt.list_checkpoints(tmp_path).latest.name == "a_run"


def test_the_command_prints_a_line_each_and_the_newest(tmp_path):
    for name in ("checkpoint-5", "tmp-checkpoint-6"):
        _copy(tmp_path / name)
    result = run_cli("list", tmp_path)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{tmp_path}: 2 checkpoints (1 complete, 1 unfinished)"
    assert any(line.split()[:2] == ["5", "complete"] for line in lines)
    assert any(line.split()[:2] == ["6", "unfinished"] for line in lines)
    assert lines[-1] == f"newest to load: {tmp_path / 'checkpoint-5'}"


def test_json_is_one_document(tmp_path):
    _copy(tmp_path / "step-100")
    doc = json.loads(run_cli("list", tmp_path, "--json").stdout)
    assert list(doc) == ["root", "checkpoints", "latest"]
    (entry,) = doc["checkpoints"]
    assert list(entry) == ["name", "path", "step", "state", "modified", "bytes", "files", "why"]
    assert entry["step"] == 100 and entry["state"] == "complete"
    assert doc["latest"] == str(tmp_path / "step-100")


def test_a_single_checkpoint_is_not_a_run_folder(tmp_path):
    with pytest.raises(NotACheckpointError, match="is a checkpoint itself.*fsdpckpt inspect"):
        fsdpckpt.list_checkpoints(_copy(tmp_path / "ckpt"))


@pytest.mark.parametrize("make, error", [
    (lambda p: p.mkdir(), NotACheckpointError),
    (lambda p: p.write_text("x"), NotACheckpointError),
    (lambda p: None, CheckpointNotFoundError)])
def test_what_holds_no_checkpoint_is_one_line(tmp_path, make, error):
    make(tmp_path / "x")
    with pytest.raises(error):
        fsdpckpt.list_checkpoints(tmp_path / "x")
    result = run_cli("list", tmp_path / "x")
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.s3
def test_a_run_on_object_storage(s3):
    server, root = s3
    url = f"s3://{root}/run"
    manager = fsdpckpt.CheckpointManager(url, storage_options=server.options)
    manager.save(2, model=torch.nn.Linear(4, 4))
    found = fsdpckpt.list_checkpoints(url, storage_options=server.options)
    assert _states(found) == [("checkpoint_2", 2, "committed")]
    assert found.checkpoints[0].bytes > 0 and found.checkpoints[0].modified is None
