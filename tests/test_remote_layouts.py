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
from fsdpckpt.errors import CorruptCheckpointError, FsdpCkptError

from conftest import FIXTURES, damaged_copy, run_cli, upload

PER_RANK = {
    "accelerate": FIXTURES / "accelerate_rank_bin",
    "fsdp1": FIXTURES / "accelerate_rank_bin_fsdp1",
    "verl": FIXTURES / "verl",
}



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
    fsdpckpt.merge(url, tmp_path / "remote", optimizer=optimizer, storage_options=server.options)
    fsdpckpt.merge(PER_RANK[which], tmp_path / "local", optimizer=optimizer)
    remote, local = _files(tmp_path / "remote"), _files(tmp_path / "local")
    assert remote.keys() == local.keys() and len(remote) >= 1
    assert remote == local


@pytest.mark.s3
@pytest.mark.parametrize("which", sorted(PER_RANK))
def test_inspect_and_verify_of_remote_rank_files_say_what_the_local_ones_say(s3, which):
    server, root = s3
    url = upload(server, PER_RANK[which], f"s3://{root}/{which}")
    options = server.options
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
    remote = fsdpckpt.load_full_state_dict(url, storage_options=server.options)
    local = fsdpckpt.load_full_state_dict(PER_RANK["verl"])
    flat_r, flat_l = remote["model"], local["model"]
    assert flat_r.keys() == flat_l.keys() and flat_l
    for key in flat_l:
        assert torch.equal(flat_r[key].view(torch.uint8), flat_l[key].view(torch.uint8)), key


@pytest.mark.s3
def test_verify_of_a_remote_rank_file_finds_its_damage(s3, tmp_path):
    server, root = s3
    copy = damaged_copy(PER_RANK["accelerate"], "pytorch_model_fsdp_0_rank1.bin", tmp_path / "ckpt")
    url = upload(server, copy, f"s3://{root}/damaged")
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
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
        fsdpckpt.merge(url, tmp_path / "out", storage_options=server.options)
    assert not (tmp_path / "out").exists()


# -- diff: file sides on object storage ---------------------------------------------------

DCP_CKPT = FIXTURES / "fsdp2_accelerate"


def _merged(tmp_path, **options):
    out = tmp_path / ("merged-" + "-".join(f"{k}{v}" for k, v in options.items()))
    fsdpckpt.merge(DCP_CKPT, out, **options)
    return out


def _report(report, *paths) -> str:
    text = json.dumps(report.to_json(), sort_keys=True)
    for path in paths:
        text = text.replace(str(path), "SIDE")
    return text


@pytest.mark.s3
@pytest.mark.parametrize("options, name", [
    ({}, "model.safetensors"),
    ({"max_shard_size": "1KB"}, "model.safetensors.index.json"),
    ({"format": "bin"}, "pytorch_model.bin"),
    ({}, ""),  # the merged folder, as Hugging Face folders are read
], ids=["safetensors", "safetensors-index", "bin", "hf-folder"])
def test_a_diff_with_a_remote_file_side_says_what_the_local_diff_says(s3, tmp_path, options,
                                                                      name):
    server, root = s3
    merged = _merged(tmp_path, **options)
    url = upload(server, merged, f"s3://{root}/merged")
    remote_side, local_side = (f"{url}/{name}" if name else url), (merged / name if name
                                                                  else merged)
    remote = fsdpckpt.diff(DCP_CKPT, remote_side, storage_options=server.options)
    local = fsdpckpt.diff(DCP_CKPT, local_side)
    assert remote.equal and local.equal
    assert [t.name for t in remote.tensors] == [t.name for t in local.tensors] != []
    assert _report(remote, remote_side) == _report(local, local_side)


@pytest.mark.s3
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_diff_reads_the_remote_bytes_and_finds_a_changed_value(s3, tmp_path, fmt):
    import torch

    server, root = s3
    merged = _merged(tmp_path, format=fmt)
    name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    if fmt == "safetensors":
        from safetensors.torch import load_file, save_file

        tensors = load_file(merged / name)
        first = sorted(tensors)[0]
        tensors[first] = tensors[first].clone()
        tensors[first].view(-1)[0] += 1
        save_file(tensors, merged / name, metadata={"format": "pt"})
    else:
        state = torch.load(merged / name, weights_only=True)
        first = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))[0]
        state[first] = state[first].clone()
        state[first].view(-1)[0] += 1
        torch.save(state, merged / name)
    url = upload(server, merged, f"s3://{root}/changed")
    report = fsdpckpt.diff(DCP_CKPT, f"{url}/{name}", storage_options=server.options)
    assert not report.equal
    assert [t.name for t in report.tensors if not t.equal] == [first]


@pytest.mark.s3
def test_the_cli_diffs_two_remote_sides_with_storage_options(s3, tmp_path):
    server, root = s3
    ckpt = upload(server, DCP_CKPT, f"s3://{root}/ckpt")
    merged = upload(server, _merged(tmp_path), f"s3://{root}/merged")
    result = run_cli("diff", ckpt, merged, "--storage-options", json.dumps(server.options),
                     "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["equal"] is True and report["tensors"]


# -- convert: its input on object storage --------------------------------------------------

@pytest.mark.s3
@pytest.mark.parametrize("options, name", [
    ({}, "model.safetensors"),
    ({"max_shard_size": "1KB"}, "model.safetensors.index.json"),
    ({"format": "bin"}, "pytorch_model.bin"),
    ({}, ""),
], ids=["safetensors", "safetensors-index", "bin", "folder"])
def test_convert_of_a_remote_file_writes_the_dcp_folder_the_local_file_gives(s3, tmp_path,
                                                                            options, name):
    server, root = s3
    merged = _merged(tmp_path, **options)
    url = upload(server, merged, f"s3://{root}/merged")
    result = fsdpckpt.convert(f"{url}/{name}" if name else url, tmp_path / "remote",
                              storage_options=server.options)
    fsdpckpt.convert(merged / name if name else merged, tmp_path / "local")
    assert str(result.source).startswith("s3://")
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["local", "remote", merged.name])  # no staging or download left behind


@pytest.mark.s3
def test_convert_names_the_remote_file_when_it_is_damaged(s3, tmp_path):
    server, root = s3
    merged = _merged(tmp_path, format="bin")
    data = merged / "pytorch_model.bin"
    raw = bytearray(data.read_bytes())
    at = raw.index(b"data.pkl") + 40  # inside the pickle: torch's loader cannot read it
    raw[at:at + 8] = b"\xff" * 8
    data.write_bytes(bytes(raw))
    url = upload(server, merged, f"s3://{root}/damaged")
    with pytest.raises(FsdpCkptError) as caught:
        fsdpckpt.convert(f"{url}/pytorch_model.bin", tmp_path / "out",
                         storage_options=server.options)
    assert f"{url}/pytorch_model.bin" in str(caught.value)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [merged.name]


@pytest.mark.s3
def test_the_cli_converts_a_remote_file_with_storage_options(s3, tmp_path):
    server, root = s3
    url = upload(server, _merged(tmp_path), f"s3://{root}/merged")
    result = run_cli("convert", f"{url}/model.safetensors", tmp_path / "out",
                     "--storage-options", json.dumps(server.options), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source"] == f"{url}/model.safetensors"
    assert (tmp_path / "out" / ".metadata").is_file()


# -- HuggingFaceStorageWriter saves ------------------------------------------------------

HF_STORAGE = {"shards": FIXTURES / "hf_storage" / "shards",
              "consolidated": FIXTURES / "hf_storage" / "consolidated"}


@pytest.mark.s3
@pytest.mark.parametrize("which", sorted(HF_STORAGE))
def test_a_remote_hf_storage_save_merges_inspects_and_verifies_as_the_local_one(s3, tmp_path,
                                                                              which):
    server, root = s3
    url = upload(server, HF_STORAGE[which], f"s3://{root}/{which}")
    options = server.options
    fsdpckpt.merge(url, tmp_path / "remote", storage_options=options)
    fsdpckpt.merge(HF_STORAGE[which], tmp_path / "local")
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")
    remote = fsdpckpt.inspect_checkpoint(url, storage_options=options).to_json()
    local = fsdpckpt.inspect_checkpoint(HF_STORAGE[which]).to_json()
    assert json.dumps(remote, sort_keys=True).replace(url, "") == \
        json.dumps(local, sort_keys=True).replace(str(HF_STORAGE[which]), "")
    assert fsdpckpt.verify_checkpoint(url, storage_options=options).ok


@pytest.mark.s3
def test_load_full_state_dict_of_a_remote_hf_storage_save_equals_the_local_one(s3):
    import torch

    server, root = s3
    url = upload(server, HF_STORAGE["shards"], f"s3://{root}/shards")
    remote = fsdpckpt.load_full_state_dict(url, storage_options=server.options)
    local = fsdpckpt.load_full_state_dict(HF_STORAGE["shards"])
    assert remote.keys() == local.keys() and local
    for key in local:
        assert torch.equal(remote[key].view(torch.uint8), local[key].view(torch.uint8)), key


@pytest.mark.s3
def test_verify_of_a_remote_hf_storage_save_finds_bytes_no_tensor_owns(s3, tmp_path):
    server, root = s3
    copy = shutil.copytree(HF_STORAGE["shards"], tmp_path / "save")
    data = copy / "shard-00002-model-00001-of-00001.safetensors"
    data.write_bytes(data.read_bytes() + b"\0" * 16)
    url = upload(server, copy, f"s3://{root}/padded")
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
    assert not report.ok
    assert any("shard-00002" in p.path for p in report.problems)
