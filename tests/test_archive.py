"""Each chunk's raw bytes are found inside its torch.save archive without torch."""

from __future__ import annotations

import io

import pytest
import torch

from fsdpckpt.archive import SliceFile, locate_tensor
from fsdpckpt.errors import CorruptCheckpointError
from fsdpckpt.reader import read_dcp_folder


def _chunks(folder):
    for tensor in read_dcp_folder(folder).metadata.tensors:
        for chunk in tensor.chunks:
            yield tensor, chunk


def test_located_bytes_equal_what_torch_loads(dcp_folder):
    count = 0
    for tensor, chunk in _chunks(dcp_folder):
        with open(dcp_folder / chunk.file, "rb") as f:
            raw = locate_tensor(f, chunk.offset, chunk.length, source=tensor.name)
            f.seek(chunk.offset)
            expected = torch.load(io.BytesIO(f.read(chunk.length)), weights_only=True)
            f.seek(raw.storage_start)
            storage = bytearray(f.read(raw.storage_nbytes))
        assert raw.dtype.name == str(expected.dtype).removeprefix("torch.") == tensor.dtype.name
        assert raw.shape == tuple(expected.shape) == chunk.sizes
        if storage:
            flat = torch.frombuffer(storage, dtype=expected.dtype)
            got = torch.as_strided(flat, raw.shape, raw.stride, raw.storage_offset)
            assert torch.equal(got, expected)
        count += 1
    assert count


def test_non_contiguous_chunks_report_their_strides(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"t": torch.arange(12.0).reshape(3, 4).t()}, checkpoint_id=tmp_path,
             no_dist=True)
    ((tensor, chunk),) = _chunks(tmp_path)
    with open(tmp_path / chunk.file, "rb") as f:
        raw = locate_tensor(f, chunk.offset, chunk.length, source="t")
    assert raw.shape == (4, 3) and raw.stride == (1, 4) and not raw.is_contiguous


def test_bytes_that_are_not_an_archive_are_corrupt(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\x00" * 4096)
    with open(path, "rb") as f, pytest.raises(CorruptCheckpointError, match="not a torch.save"):
        locate_tensor(f, 100, 2000, source="w")


def test_slice_file_reads_only_its_window():
    view = SliceFile(io.BytesIO(b"0123456789"), 2, 5)
    assert view.read() == b"23456"
    view.seek(-2, io.SEEK_END)
    assert view.read(10) == b"56"
