"""Every input layout read from object storage as from local disk: per-rank ``torch.save``
files (Accelerate ``use_dcp=False``, FSDP1 ShardedTensors, VeRL), the file sides of a diff
(safetensors, ``.bin``, Hugging Face folders) and convert's input.

The server is SeaweedFS on loopback (tests/s3server.py); each test uploads a committed
fixture into its own folder and compares the remote result with the local one, byte for byte.
"""

from __future__ import annotations

import json
import shutil

import pytest

import fsdpckpt
from fsdpckpt.errors import CorruptCheckpointError

from conftest import FIXTURES, run_cli, upload

PER_RANK = {
    "accelerate": FIXTURES / "accelerate_rank_bin",
    "fsdp1": FIXTURES / "accelerate_rank_bin_fsdp1",
    "verl": FIXTURES / "verl",
}


def _options(server) -> dict:
    return {"key": "any", "secret": "any", "endpoint_url": server.endpoint}


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# -- per-rank torch.save files -------------------------------------------------------------

@pytest.mark.s3
@pytest.mark.parametrize("which", sorted(PER_RANK))
@pytest.mark.parametrize("optimizer", [False, True], ids=["model", "optimizer"])
def test_a_merge_of_remote_rank_files_is_byte_identical_to_the_local_merge(s3, tmp_path, which,
                                                                           optimizer):
    server, root = s3
    url = upload(server, PER_RANK[which], f"s3://{root}/{which}")
    fsdpckpt.merge(url, tmp_path / "remote", optimizer=optimizer, storage_options=_options(server))
    fsdpckpt.merge(PER_RANK[which], tmp_path / "local", optimizer=optimizer)
    remote, local = _files(tmp_path / "remote"), _files(tmp_path / "local")
    assert remote.keys() == local.keys() and len(remote) >= 1
    assert remote == local


@pytest.mark.s3
@pytest.mark.parametrize("which", sorted(PER_RANK))
def test_inspect_and_verify_of_remote_rank_files_say_what_the_local_ones_say(s3, which):
    server, root = s3
    url = upload(server, PER_RANK[which], f"s3://{root}/{which}")
    options = _options(server)
    remote = fsdpckpt.inspect_checkpoint(url, storage_options=options).to_json()
    local = fsdpckpt.inspect_checkpoint(PER_RANK[which]).to_json()
    assert json.dumps(remote, sort_keys=True).replace(url, "") == \
        json.dumps(local, sort_keys=True).replace(str(PER_RANK[which]), "")
    assert fsdpckpt.verify_checkpoint(url, storage_options=options).ok


@pytest.mark.s3
def test_load_full_state_dict_of_remote_rank_files_equals_the_local_one(s3):
    import torch

    server, root = s3
    url = upload(server, PER_RANK["verl"], f"s3://{root}/verl")
    remote = fsdpckpt.load_full_state_dict(url, storage_options=_options(server))
    local = fsdpckpt.load_full_state_dict(PER_RANK["verl"])
    flat_r, flat_l = remote["model"], local["model"]
    assert flat_r.keys() == flat_l.keys() and flat_l
    for key in flat_l:
        assert torch.equal(flat_r[key].view(torch.uint8), flat_l[key].view(torch.uint8)), key


@pytest.mark.s3
def test_verify_of_a_remote_rank_file_finds_its_damage(s3, tmp_path):
    server, root = s3
    copy = shutil.copytree(PER_RANK["accelerate"], tmp_path / "ckpt")
    data = copy / "pytorch_model_fsdp_0_rank1.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    url = upload(server, copy, f"s3://{root}/damaged")
    report = fsdpckpt.verify_checkpoint(url, storage_options=_options(server))
    assert not report.ok
    assert any("pytorch_model_fsdp_0_rank1.bin" in p.path for p in report.problems)


@pytest.mark.s3
def test_a_truncated_remote_rank_file_is_an_error_naming_it(s3, tmp_path):
    server, root = s3
    copy = shutil.copytree(PER_RANK["verl"], tmp_path / "ckpt")
    data = copy / "model_world_size_2_rank_1.pt"
    data.write_bytes(data.read_bytes()[:-100])
    url = upload(server, copy, f"s3://{root}/truncated")
    with pytest.raises(CorruptCheckpointError, match="model_world_size_2_rank_1.pt"):
        fsdpckpt.merge(url, tmp_path / "out", storage_options=_options(server))
    assert not (tmp_path / "out").exists()
