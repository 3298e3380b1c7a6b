"""What inspect and verify say of what is not a checkpoint (issue 33): a run folder's
staging folder is not counted as a checkpoint; inspect and verify of an unfinished save say
UNFINISHED, not DAMAGED or "world size 0"; a text file is refused in fsdpckpt's words, not
convert's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import fsdpckpt

from conftest import FIXTURES, run_cli


@pytest.fixture
def run(tmp_path):
    """A CheckpointManager's folder: checkpoint_3 committed, .tmp-checkpoint_7 cut short
    (no manifest, no .metadata: what a killed save leaves)."""
    root = tmp_path / "run"
    fsdpckpt.CheckpointManager(root).save(3, model=torch.nn.Linear(4, 4))
    staged = root / ".tmp-checkpoint_7"
    shutil.copytree(root / "checkpoint_3", staged)
    (staged / "fsdpckpt.json").unlink()
    (staged / "pytorch_model_fsdp_0" / ".metadata").unlink()
    return root


def test_a_run_folder_counts_only_finished_checkpoints(run):
    result = run_cli("inspect", run)
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert "holds one checkpoint (checkpoint_3) and 1 unfinished save (.tmp-checkpoint_7" in line
    assert line.endswith(f"pass it: {run / 'checkpoint_3'}")


def test_a_folder_of_only_unfinished_saves_says_so(run):
    shutil.rmtree(run / "checkpoint_3")
    result = run_cli("inspect", run)
    assert "holds no finished checkpoint, only 1 unfinished save (.tmp-checkpoint_7)" in \
        result.stderr


def test_verify_of_an_unfinished_save_says_unfinished_not_damaged(run):
    result = run_cli("verify", run / ".tmp-checkpoint_7")
    assert result.exit_code == 1
    assert "UNFINISHED (a save that never completed" in result.stdout
    assert "DAMAGED" not in result.stdout
    doc = json.loads(run_cli("verify", run / ".tmp-checkpoint_7", "--json").stdout)
    assert doc["unfinished"] is True and doc["ok"] is False


def test_verify_of_a_damaged_checkpoint_still_says_damaged(run):
    data = run / "checkpoint_3" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0xFF
    data.write_bytes(bytes(raw))
    result = run_cli("verify", run / "checkpoint_3")
    assert "DAMAGED" in result.stdout and "UNFINISHED" not in result.stdout


def test_inspect_of_an_unfinished_save_heads_with_it_and_no_world_size_of_zero(tmp_path):
    folder = tmp_path / "cut"
    (folder / "pytorch_model_fsdp_0").mkdir(parents=True)  # its rank files, no .metadata
    for data in (FIXTURES / "fsdp2_accelerate" / "pytorch_model_fsdp_0").glob("*.distcp"):
        shutil.copy(data, folder / "pytorch_model_fsdp_0" / data.name)
    result = run_cli("inspect", folder)
    head = result.stdout.splitlines()[0]
    assert head.startswith(f"{folder}: UNFINISHED save (it never completed)")
    assert "world size 0" not in head
    doc = json.loads(run_cli("inspect", folder, "--json").stdout)
    assert doc["unfinished"] is True


def test_inspect_of_a_text_file_says_what_fsdpckpt_reads_not_what_convert_reads(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    result = run_cli("inspect", tmp_path / "notes.txt")
    assert result.exit_code == 1
    assert "it holds text" in result.stderr and "convert" not in result.stderr
    assert "fsdpckpt reads a .safetensors file" in result.stderr


@pytest.mark.parametrize("what", ["data without .metadata", "only staging folders",
                                  "intent marker without manifest"])
def test_every_kind_of_unfinished_save_is_an_unfinished_save_error(run, what):
    from fsdpckpt.dcp.layout import INCOMPLETE, find_layout

    if what == "data without .metadata":
        target = run / ".tmp-checkpoint_7" / "pytorch_model_fsdp_0"
    elif what == "only staging folders":
        shutil.rmtree(run / "checkpoint_3")
        target = run
    else:
        target = run / "checkpoint_3"
        (target / "fsdpckpt.json").unlink()
        (target / INCOMPLETE).write_bytes(b"")
    with pytest.raises(fsdpckpt.UnfinishedSaveError):
        find_layout(target)
    assert issubclass(fsdpckpt.UnfinishedSaveError, fsdpckpt.NotACheckpointError)


def test_a_damaged_checkpoint_is_no_unfinished_save(run):
    model = run / "checkpoint_3" / "pytorch_model_fsdp_0"
    (model / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(fsdpckpt.FsdpCkptError) as caught:
        fsdpckpt.load_full_state_dict(model)
    assert not isinstance(caught.value, fsdpckpt.UnfinishedSaveError)
