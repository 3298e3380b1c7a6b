"""Checkpoints on object storage: read from a real S3 server exactly as from local disk.

The server is SeaweedFS on loopback (tests/s3server.py), started once per session; each
test uploads a committed fixture into its own folder.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import fsdpckpt
from fsdpckpt._io.remote import RemoteFile, RemotePath, is_url, location
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError

from conftest import FIXTURES, assert_one_line_error, damaged_copy, run_cli, upload

CKPT = FIXTURES / "fsdp2_accelerate"



def _remote_ckpt(s3) -> tuple[str, dict]:
    server, root = s3
    return upload(server, CKPT, f"s3://{root}/run/checkpoint-1"), server.options


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# -- paths and URLs (no server) ------------------------------------------------------------

@pytest.mark.parametrize("path", ["ckpt", "/abs/ckpt", "file:///abs/ckpt", "C:ckpt"])
def test_local_paths_and_file_urls_stay_local(path):
    assert not is_url(path)
    assert not isinstance(location(path), RemotePath)


def test_a_file_url_is_its_local_path():
    assert str(location("file:///abs/ckpt")) == "/abs/ckpt"


def test_a_remote_path_cannot_reach_a_local_file_api():
    # No __fspath__: code not ported to RemotePath fails loudly instead of reading a local file.
    remote = location("s3://bucket/ckpt", storage_options={"anon": True})
    assert isinstance(remote, RemotePath)
    with pytest.raises(TypeError):
        os.stat(remote)  # type: ignore[call-overload]


def test_a_remote_name_with_dotdot_is_refused():
    remote = location("s3://bucket/ckpt", storage_options={"anon": True})
    with pytest.raises(NotACheckpointError, match="outside"):
        remote / "../other"


def test_an_unknown_scheme_is_one_line_error_naming_the_url():
    result = run_cli("inspect", "nosuchscheme://bucket/ckpt")
    assert_one_line_error(result, "nosuchscheme://bucket/ckpt")


def test_without_fsspec_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec -> ImportError
    result = run_cli("inspect", "s3://bucket/ckpt")
    assert_one_line_error(result, "s3://bucket/ckpt", "pip install 'fsdpckpt[remote]'")


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", '"text"'])
def test_storage_options_must_be_a_json_object(value):
    result = run_cli("inspect", "s3://bucket/ckpt", "--storage-options", value)
    assert result.exit_code == 2 and "--storage-options" in result.output


# -- against the S3 server -----------------------------------------------------------------

@pytest.mark.s3
def test_inspect_of_a_remote_checkpoint_says_what_the_local_one_says(s3):
    url, options = _remote_ckpt(s3)
    remote = fsdpckpt.inspect_checkpoint(url, storage_options=options).to_json()
    local = fsdpckpt.inspect_checkpoint(CKPT).to_json()
    assert remote.pop("path") == url
    local.pop("path")
    assert json.dumps(remote, sort_keys=True).replace(url, "") == \
        json.dumps(local, sort_keys=True).replace(str(CKPT), "")


@pytest.mark.s3
def test_the_cli_inspects_a_remote_checkpoint_with_storage_options(s3):
    url, options = _remote_ckpt(s3)
    result = run_cli("inspect", url, "--storage-options", json.dumps(options), "--summary")
    assert result.exit_code == 0, result.output
    assert "pytorch_model_fsdp_0/" in result.stdout and "world size 2" in result.stdout


@pytest.mark.s3
def test_credentials_and_endpoint_come_from_the_aws_environment(s3, monkeypatch):
    url, _ = _remote_ckpt(s3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3[0].endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "any")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "any")
    result = run_cli("verify", url, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ok"] is True


@pytest.mark.s3
@pytest.mark.parametrize("options", [
    {},
    {"max_shard_size": "1KB"},
    {"format": "bin"},
    {"dtype": "bf16"},
    {"optimizer": True},
], ids=["safetensors", "sharded", "bin", "bf16", "optimizer"])
def test_a_merge_from_s3_is_byte_identical_to_the_local_merge(s3, tmp_path, options):
    url, storage = _remote_ckpt(s3)
    fsdpckpt.merge(url, tmp_path / "remote", storage_options=storage, **options)
    fsdpckpt.merge(CKPT, tmp_path / "local", **options)
    remote, local = _files(tmp_path / "remote"), _files(tmp_path / "local")
    assert remote.keys() == local.keys() and len(remote) >= 1
    assert remote == local


@pytest.mark.s3
def test_load_full_state_dict_from_s3_equals_the_local_one(s3):
    import torch

    url, options = _remote_ckpt(s3)
    remote = fsdpckpt.load_full_state_dict(url + "/pytorch_model_fsdp_0", storage_options=options)
    local = fsdpckpt.load_full_state_dict(CKPT / "pytorch_model_fsdp_0")
    flat_r, flat_l = remote["model"], local["model"]
    assert flat_r.keys() == flat_l.keys()
    for key in flat_l:
        assert torch.equal(flat_r[key].view(torch.uint8), flat_l[key].view(torch.uint8)), key


@pytest.mark.s3
def test_verify_of_a_remote_checkpoint_finds_a_damaged_chunk(s3, tmp_path):
    server, root = s3
    copy = damaged_copy(CKPT, "pytorch_model_fsdp_0/__0_0.distcp", tmp_path / "ckpt")
    url = upload(server, copy, f"s3://{root}/damaged")
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
    assert not report.ok
    assert any("__0_0.distcp" in p.path for p in report.problems)


@pytest.mark.s3
def test_a_missing_remote_data_file_is_named(s3):
    url, options = _remote_ckpt(s3)
    s3[0].filesystem().rm(url.removeprefix("s3://") + "/pytorch_model_fsdp_0/__1_0.distcp")
    report = fsdpckpt.inspect_checkpoint(url, storage_options=options)
    assert not report.ok
    assert any("__1_0.distcp" in p.path or "__1_0.distcp" in p.message for p in report.problems)


@pytest.mark.s3
def test_a_missing_remote_checkpoint_is_not_found(s3):
    _, root = s3
    with pytest.raises(CheckpointNotFoundError, match=f"s3://{root}/nothing"):
        fsdpckpt.inspect_checkpoint(f"s3://{root}/nothing", storage_options=s3[0].options)


@pytest.mark.s3
def test_a_remote_object_shorter_than_its_listing_is_an_error_never_zeros(s3):
    server, root = s3
    server.filesystem().pipe(f"{root}/file", b"x" * 100)
    path = location(f"s3://{root}/file", storage_options=server.options)
    assert isinstance(path, RemotePath)
    lying = RemoteFile(path, 200)  # as if the object shrank after it was listed
    view = memoryview(bytearray(150))
    with pytest.raises(CorruptCheckpointError, match="returned 100 bytes"):
        lying.read_at(view, 0)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        path.open_file().read_at(memoryview(bytearray(10)), 95)


@pytest.mark.s3
def test_a_zstd_compressed_dcp_folder_on_s3_merges_as_the_local_one(s3, tmp_path):
    # The decoder reads its compressed range by offset: from a remote file, by ranged reads.
    server, root = s3
    url = upload(server, FIXTURES / "dcp_zstd", f"s3://{root}/zstd")
    fsdpckpt.merge(url, tmp_path / "remote", storage_options=server.options)
    fsdpckpt.merge(FIXTURES / "dcp_zstd", tmp_path / "local")
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")
    assert fsdpckpt.verify_checkpoint(url, storage_options=server.options).ok
