"""Recognizing a checkpoint folder's parts, and refusing folders that are not one."""

from __future__ import annotations

import pytest

from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError
from fsdpckpt.layout import find_layout

from conftest import DCP_FOLDERS, FIXTURES


def test_accelerate_layout_parts_and_side_files():
    layout = find_layout(FIXTURES / "fsdp2_accelerate")
    assert layout.style == "accelerate"
    assert [(p.name, p.kind, p.index) for p in layout.parts] == [
        ("pytorch_model_fsdp_0", "model", 0), ("optimizer_0", "optimizer", 0)]
    assert sorted((f.name, f.kind, f.rank) for f in layout.side_files) == [
        ("random_states_0.pkl", "rng", 0), ("random_states_1.pkl", "rng", 1),
        ("scheduler.bin", "scheduler", None)]


def test_single_dcp_folder():
    layout = find_layout(DCP_FOLDERS["dtensor"])
    assert layout.style == "dcp" and [p.kind for p in layout.parts] == ["dcp"]


def test_hf_trainer_layout(tmp_path):
    import shutil

    shutil.copytree(DCP_FOLDERS["fsdp2-model"], tmp_path / "pytorch_model_fsdp_0")
    for name in ("rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"):
        (tmp_path / name).write_bytes(b"x")
    layout = find_layout(tmp_path)
    assert layout.style == "hf-trainer"
    assert sorted(f.rank for f in layout.files_of("rng")) == [0, 1]
    assert [f.name for f in layout.files_of("scheduler")] == ["scheduler.pt"]


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        find_layout(tmp_path / "nope")


def test_empty_folder(tmp_path):
    with pytest.raises(NotACheckpointError, match="empty"):
        find_layout(tmp_path)


def test_a_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match="is a file"):
        find_layout(tmp_path / "model.safetensors")


def test_parent_of_checkpoints_lists_them(tmp_path):
    for step in (100, 200):
        (tmp_path / f"checkpoint_{step}").mkdir()
    with pytest.raises(NotACheckpointError, match="checkpoint_100, checkpoint_200") as caught:
        find_layout(tmp_path)
    assert "pass one of them" in str(caught.value)


def test_data_files_without_metadata_mean_an_unfinished_save(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match="never finished"):
        find_layout(tmp_path)


def test_unrelated_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(NotACheckpointError, match="no checkpoint here"):
        find_layout(tmp_path)


def test_folder_of_checkpoints_with_any_names_lists_them(tmp_path):
    import shutil

    for name in ("ckA", "ckB"):
        shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / name)
    shutil.copytree(DCP_FOLDERS["dtensor"], tmp_path / "loose_dcp")
    with pytest.raises(NotACheckpointError, match="ckA, ckB, loose_dcp"):
        find_layout(tmp_path)
