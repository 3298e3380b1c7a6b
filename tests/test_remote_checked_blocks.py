"""A merge from S3 sums each 16 MiB block on the CRC thread while the next is fetched and
the block written (two buffers taking turns, as the local merge does; issue 21): a flipped
bit in any block still fails the merge and commits nothing, and an untouched checkpoint
merges bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt import ChecksumError

from chunked import flip_stored_byte, split, write_dcp
from conftest import upload

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    # Two chunks of 20 MiB each: two blocks a chunk, the second one short.
    value = torch.randn(2560, 4096, generator=torch.Generator().manual_seed(0))
    return write_dcp(tmp_path_factory.mktemp("blocks") / "ckpt", {"w": (value, split([0]))}), \
        value


def test_an_untouched_checkpoint_merges_from_s3_bit_for_bit(s3, folder, tmp_path):
    server, root = s3
    path, value = folder
    url = upload(server, path, f"s3://{root}/ckpt")
    fsdpckpt.merge(url, tmp_path / "out", storage_options=server.options)
    merged = load_file(tmp_path / "out" / "model.safetensors")["w"]
    assert torch.equal(merged.view(torch.int32), value.view(torch.int32))


@pytest.mark.parametrize("where", [0.01, 0.5, 0.9])
def test_a_flipped_bit_in_any_block_fails_a_merge_from_s3(s3, folder, where, tmp_path):
    server, root = s3
    path, _ = folder
    damaged = tmp_path / "ckpt"
    damaged.mkdir()
    for file in path.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    flip_stored_byte(damaged, chunk=1, where=where, mask=0x04)
    url = upload(server, damaged, f"s3://{root}/ckpt")
    with pytest.raises(ChecksumError, match="CRC-32"):
        fsdpckpt.merge(url, tmp_path / "out", storage_options=server.options)
    assert not (tmp_path / "out").exists()
