"""Recognizing a checkpoint folder's parts, and refusing folders that are not one."""

from __future__ import annotations

import pytest

from fsdpckpt.dcp.layout import find_layout
from fsdpckpt.errors import CheckpointNotFoundError, NotACheckpointError

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


def _checkpoints(root, *names):
    import shutil

    for name in names:
        shutil.copytree(FIXTURES / "fsdp2_accelerate", root / name)


def _refusal(path) -> str:
    with pytest.raises(NotACheckpointError) as caught:
        find_layout(path)
    return str(caught.value)


def test_checkpoints_sort_by_their_number_and_the_newest_is_suggested(tmp_path):
    _checkpoints(tmp_path, "checkpoint-1000", "checkpoint-500")
    message = _refusal(tmp_path)
    assert "holds 2 checkpoints (checkpoint-500, checkpoint-1000)" in message
    assert message.endswith(f"e.g. the newest: {tmp_path / 'checkpoint-1000'}")


def test_one_checkpoint_is_called_one_and_suggested(tmp_path):
    _checkpoints(tmp_path, "checkpoint-500")
    message = _refusal(tmp_path)
    assert "holds one checkpoint (checkpoint-500)" in message and "several" not in message
    assert message.endswith(str(tmp_path / "checkpoint-500"))


def test_an_unfinished_newest_save_is_not_the_suggestion(tmp_path):
    _checkpoints(tmp_path, "checkpoint-500", "checkpoint-1000", "checkpoint-1500")
    (tmp_path / "checkpoint-1500" / "optimizer_0" / ".metadata").unlink()
    message = _refusal(tmp_path)
    assert "(checkpoint-500, checkpoint-1000, checkpoint-1500)" in message
    assert message.endswith(f"(checkpoint-1500 is not): {tmp_path / 'checkpoint-1000'}")


def test_many_checkpoints_show_the_oldest_and_the_newest(tmp_path):
    for step in range(100, 1300, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
    message = _refusal(tmp_path)
    assert ("holds 12 checkpoints (checkpoint-100, checkpoint-200, ..., checkpoint-1100, "
            "checkpoint-1200)") in message
    assert message.endswith(str(tmp_path / "checkpoint-1200"))


def test_a_lightning_folder_of_dcp_checkpoints_lists_them_and_names_the_newest(tmp_path):
    import shutil

    # Lightning's FSDP strategy saves each checkpoint as a DCP folder named *.ckpt/.
    for name in ("epoch=1-step=20.ckpt", "epoch=0-step=10.ckpt"):
        shutil.copytree(DCP_FOLDERS["dtensor"], tmp_path / "ckpts" / name)
    message = _refusal(tmp_path / "ckpts")
    assert "holds 2 checkpoints (epoch=0-step=10.ckpt, epoch=1-step=20.ckpt)" in message
    assert message.endswith(f"e.g. the newest: {tmp_path / 'ckpts' / 'epoch=1-step=20.ckpt'}")


def test_a_torchtune_output_of_epoch_folders_lists_them_and_names_the_newest(tmp_path):
    import shutil

    for epoch in range(3):
        shutil.copytree(DCP_FOLDERS["dtensor"], tmp_path / "output" / f"epoch_{epoch}")
    (tmp_path / "output" / "epoch_2" / ".metadata").unlink()  # its save never finished
    message = _refusal(tmp_path / "output")
    assert "holds 3 checkpoints (epoch_0, epoch_1, epoch_2)" in message
    assert message.endswith(f"(epoch_2 is not): {tmp_path / 'output' / 'epoch_1'}")


def test_one_dcp_folder_beside_a_model_folder_is_still_one_checkpoint(tmp_path):
    import shutil

    ckpt = shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "ckpt")
    shutil.copytree(DCP_FOLDERS["dtensor"], ckpt / "ema")
    layout = find_layout(ckpt)
    assert [p.name for p in layout.parts] == ["pytorch_model_fsdp_0", "optimizer_0", "ema"]
