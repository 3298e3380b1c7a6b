"""Folders written with ``FileSystemWriter(single_file_per_rank=False)`` are whole.

Each rank then writes one file per item (``__{rank}_0.distcp``, ``__{rank}_1.distcp``...)
and a rank with nothing to write writes no file at all. That is not an incomplete copy,
and since ``.metadata`` does not record the world size, the files only give a lower bound.
"""

from __future__ import annotations

import pytest
import torch

from fsdpckpt import inspect_checkpoint, load_full_state_dict
from fsdpckpt.dcp.checks import check_folder, known_world_size
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.inspection.verify import verify_checkpoint

from conftest import reference_state_dict, run_cli, single_process
from deep_compare import assert_same_state


def _state(owner: bool) -> dict:
    if not owner:
        return {}
    return {"model": {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                      "b": torch.tensor([1, 2, 3], dtype=torch.int64)}, "step": 5}


def save_per_item(rank: int, world_size: int, path: str, owner: int) -> list[str]:
    """On each rank: only rank ``owner`` has anything; one file per item."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(_state(rank == owner),
             storage_writer=FileSystemWriter(path, single_file_per_rank=False))
    return []


def _accepted_everywhere(folder, tmp_path) -> None:
    assert check_folder(read_dcp_folder(folder)) == []
    assert inspect_checkpoint(folder)["ok"] is True
    assert verify_checkpoint(folder)["ok"] is True
    result = run_cli("merge", folder, tmp_path / "merged")
    assert result.exit_code == 0, result.output
    assert_same_state(load_full_state_dict(folder), reference_state_dict(folder))


def test_single_process_per_item_folder_is_whole_and_its_world_size_a_lower_bound(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    folder = tmp_path / "ckpt"
    dcp.save(_state(True), storage_writer=FileSystemWriter(folder, single_file_per_rank=False),
             **single_process())
    assert sorted(p.name for p in folder.glob("*.distcp")) == \
        ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    _accepted_everywhere(folder, tmp_path)
    # One rank with three files could be a world of 1, or more ranks that had nothing.
    assert known_world_size(read_dcp_folder(folder)) == (1, False)
    doc = inspect_checkpoint(folder)
    assert doc["world_size"] == 1 and doc["world_size_exact"] is False
    assert "world size at least 1" in run_cli("inspect", folder).stdout


def test_default_one_file_per_rank_gives_an_exact_world_size(dcp_folder):
    assert known_world_size(read_dcp_folder(dcp_folder)) == (2, True)


@pytest.mark.multirank
@pytest.mark.parametrize("owner", [0, 1])
def test_a_rank_with_nothing_to_write_leaves_no_file_and_the_folder_is_whole(tmp_path, owner):
    from multirank import run_ranks

    folder = tmp_path / "ckpt"
    run_ranks(save_per_item, str(folder), owner)
    assert {p.name.split("_")[2] for p in folder.glob("*.distcp")} == {str(owner)}
    _accepted_everywhere(folder, tmp_path)
    world, exact = known_world_size(read_dcp_folder(folder))
    assert not exact and world == owner + 1  # never stated as exact when it may be more
    assert inspect_checkpoint(folder)["world_size_exact"] is False
