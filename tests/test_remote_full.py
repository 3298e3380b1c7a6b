"""load_full_state_dict of merged outputs on object storage: what the local files give.

A merged ``.safetensors`` / ``.bin`` file, a shard index, or a folder holding one, read from
a real S3 server (SeaweedFS on loopback, tests/s3server.py) equals the same output read from
local disk, tensor bytes and non-tensor values alike; the downloaded copies are removed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fsdpckpt

from conftest import FIXTURES, upload
from deep_compare import assert_same_deep

CKPT = FIXTURES / "fsdp2_accelerate"

_OUTPUTS = {
    "safetensors": ({}, "model.safetensors"),
    "safetensors-sharded": ({"max_shard_size": "1KB"}, "model.safetensors.index.json"),
    "bin": ({"format": "bin"}, "pytorch_model.bin"),
    "bin-sharded": ({"format": "bin", "max_shard_size": "1KB"}, "pytorch_model.bin.index.json"),
}


@pytest.fixture
def merged(tmp_path, request) -> tuple[Path, str]:
    options, name = _OUTPUTS[request.param]
    out = tmp_path / "merged"
    fsdpckpt.merge(CKPT, out, **options)
    assert (out / name).is_file()
    return out, name


@pytest.mark.s3
@pytest.mark.parametrize("merged", sorted(_OUTPUTS), indirect=True)
def test_a_remote_merged_file_loads_as_the_local_one(s3, merged, tmp_path, monkeypatch):
    server, root = s3
    out, name = merged
    url = upload(server, out, f"s3://{root}/merged")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    got = fsdpckpt.load_full_state_dict(f"{url}/{name}", storage_options=server.options)
    assert_same_deep(got, fsdpckpt.load_full_state_dict(out / name), dicts_only=True, ordered=True)
    assert os.listdir(scratch) == []  # the downloaded copy is gone


@pytest.mark.s3
@pytest.mark.parametrize("merged", ["safetensors-sharded", "bin"], indirect=True)
def test_a_remote_folder_holding_a_merged_output_loads_as_the_local_one(s3, merged):
    server, root = s3
    out, _ = merged
    url = upload(server, out, f"s3://{root}/merged")
    got = fsdpckpt.load_full_state_dict(url, storage_options=server.options)
    assert_same_deep(got, fsdpckpt.load_full_state_dict(out), dicts_only=True, ordered=True)


@pytest.mark.s3
def test_a_remote_folder_without_a_merged_output_is_one_error(s3, tmp_path):
    server, root = s3
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a model")
    url = upload(server, tmp_path / "other", f"s3://{root}/other")
    with pytest.raises(fsdpckpt.errors.NotACheckpointError, match="neither a DCP folder"):
        fsdpckpt.load_full_state_dict(url, storage_options=server.options)
