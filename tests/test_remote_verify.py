"""verify against the manifest on object storage: every file's size and CRC-32 (and digest)
by ranged reads, strays from one listing, the damaged tensor named, --expect-digest."""

from __future__ import annotations

import json

import pytest

import fsdpckpt

from conftest import run_cli, save_small_checkpoint, upload

pytestmark = pytest.mark.s3



@pytest.fixture
def remote_ckpt(s3, tmp_path):
    """A checkpoint saved with a sha256 manifest, uploaded: ``(server, root key, url)``."""
    server, root = s3
    local = save_small_checkpoint(tmp_path / "ckpt", digest="sha256")
    return server, f"{root}/ckpt", upload(server, local, f"s3://{root}/ckpt")


def test_a_whole_remote_checkpoint_verifies_against_its_manifest(remote_ckpt):
    server, _, url = remote_ckpt
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
    assert report.ok and report.manifest and report.digest == "sha256"


def test_a_flipped_byte_in_remote_tensor_data_names_the_tensor(remote_ckpt):
    server, key, url = remote_ckpt
    fs = server.filesystem()
    data_key = sorted(k for k in fs.find(key) if k.endswith(".distcp"))[0]
    raw = bytearray(fs.cat_file(data_key))
    raw[-200] ^= 0x01  # inside the last tensor's data, before the zip directory
    fs.pipe(data_key, bytes(raw))
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
    assert not report.ok
    assert any(data_key.rsplit("/", 1)[-1] in p.path for p in report.problems)


def test_a_stray_remote_file_is_reported(remote_ckpt):
    server, key, url = remote_ckpt
    server.filesystem().pipe(f"{key}/notes.txt", b"added later")
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
    assert [p.path for p in report.problems] == [f"{url}/notes.txt"]
    assert "stray file" in report.problems[0].message


def test_expect_digest_pins_a_remote_checkpoint(remote_ckpt):
    server, key, url = remote_ckpt
    options = json.dumps(server.options)
    first = run_cli("verify", url, "--storage-options", options, "--json")
    assert first.exit_code == 0, first.output
    digest = json.loads(first.stdout)["manifest_digest"]
    assert run_cli("verify", url, "--storage-options", options,
                   "--expect-digest", digest).exit_code == 0
    wrong = "sha256:" + "0" * 64
    assert run_cli("verify", url, "--storage-options", options,
                   "--expect-digest", wrong).exit_code == 1
