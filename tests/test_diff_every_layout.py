"""``diff`` reads every layout the other verbs read.

Per-rank ``torch.save`` files (VeRL's ``model_world_size_*_rank_*.pt``, Accelerate's
``use_dcp=False``) and the safetensors shards of torch's ``HuggingFaceStorageWriter`` are
opened through the one part reader (:mod:`fsdpckpt.dcp.parts`) that inspect, verify and merge
use: each equals itself and its own merge, and a copy with one tensor changed differs there.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # registers DTensor for weights_only loading

import fsdpckpt

from conftest import FIXTURES, run_cli, torch_loads_fixture, upload

# torch's DTensor unpickling warns that it runs in one process, as the tests mean it to.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: fixture -> (its folder, the file of rank 1 that the change goes into)
LAYOUTS = {
    "verl": (FIXTURES / "verl", "model_world_size_2_rank_1.pt"),
    "accelerate-rank-bin": (FIXTURES / "accelerate_rank_bin", "pytorch_model_fsdp_0_rank1.bin"),
    "hf-storage-shards": (FIXTURES / "hf_storage" / "shards",
                          "shard-00002-model-00001-of-00001.safetensors"),
    "hf-storage-sharded": (FIXTURES / "hf_storage" / "consolidated" / "sharded",
                           "shard-00002-model-00001-of-00002.safetensors"),
}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each fixture's model merged to model.safetensors, once for the module."""
    out = {}
    for which, (folder, _) in LAYOUTS.items():
        out[which] = tmp_path_factory.mktemp(which)
        fsdpckpt.merge(folder, out[which])
    return out


def _change_rank_file(file: Path) -> str:
    """Add 1 to the first element of the first tensor of a ``torch.save`` rank file (its
    DTensors' local shards are plain tensors under the wrapper); returns the tensor's key."""
    state = torch_loads_fixture(file)
    key, value = next((k, v) for k, v in state.items() if isinstance(v, torch.Tensor))
    local = value._local_tensor if isinstance(value, torch.distributed.tensor.DTensor) else value
    local.view(-1)[0] += 1
    torch.save(state, file)
    return key


def _change_safetensors(file: Path) -> str:
    """Flip the lowest bit of the first element of the first tensor with elements (a
    safetensors file records no checksum, so the change reads as data); returns its name."""
    data = bytearray(file.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name, info = next((n, i) for n, i in header.items()
                      if n != "__metadata__" and i["data_offsets"][1] > i["data_offsets"][0])
    data[8 + length + info["data_offsets"][0]] ^= 0x01
    file.write_bytes(bytes(data))
    return name


def _changed_copy(which: str, tmp_path: Path) -> Path:
    folder, file = LAYOUTS[which]
    copy = tmp_path / which
    shutil.copytree(folder, copy)
    (_change_safetensors if file.endswith(".safetensors") else _change_rank_file)(copy / file)
    return copy


@pytest.mark.parametrize("which", sorted(LAYOUTS))
def test_each_layout_equals_itself(which):
    folder, _ = LAYOUTS[which]
    report = fsdpckpt.diff(folder, folder)
    assert report.equal and report.tensors, report.to_json()
    assert all(t.identical for t in report.tensors)


@pytest.mark.parametrize("which", sorted(LAYOUTS))
def test_each_layout_equals_its_merge(which, merged):
    folder, _ = LAYOUTS[which]
    report = fsdpckpt.diff(folder, merged[which])
    assert report.equal and report.tensors, report.to_json()
    assert all(t.identical for t in report.tensors)
    assert not report.missing and not report.unexpected


@pytest.mark.parametrize("which", sorted(LAYOUTS))
def test_a_copy_with_one_tensor_changed_differs_in_that_tensor(which, merged, tmp_path):
    copy = _changed_copy(which, tmp_path)
    report = fsdpckpt.diff(copy, merged[which])
    assert not report.equal
    (bad,) = report.differing
    assert bad.mismatched == 1 and not bad.identical
    assert fsdpckpt.diff(LAYOUTS[which][0], copy).differing[0].name == bad.name


def test_the_optimizer_of_per_rank_files_equals_its_merge(tmp_path):
    fsdpckpt.merge(FIXTURES / "accelerate_rank_bin", tmp_path, optimizer=True)
    report = fsdpckpt.diff(FIXTURES / "accelerate_rank_bin", tmp_path, optimizer=True)
    assert report.equal and any(t.name.endswith("exp_avg") for t in report.tensors)


def test_the_cli_diffs_a_verl_folder_exit_0_when_equal_and_1_when_not(merged, tmp_path):
    result = run_cli("diff", FIXTURES / "verl", merged["verl"])
    assert result.exit_code == 0, result.output
    assert "EQUAL: 4 tensors (4 bit-identical)" in result.stdout
    result = run_cli("diff", _changed_copy("verl", tmp_path), merged["verl"])
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-1].startswith("DIFFERENT: 1 of 4 tensors differ")


@pytest.mark.s3
@pytest.mark.parametrize("which", ["verl", "hf-storage-shards"])
def test_a_remote_layout_equals_the_local_one(s3, which):
    server, root = s3
    folder, _ = LAYOUTS[which]
    url = upload(server, folder, f"s3://{root}/{which}")
    report = fsdpckpt.diff(url, folder, storage_options=server.options)
    assert report.equal and report.tensors, report.to_json()
