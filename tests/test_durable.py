"""Durable file writes: ``write_bytes`` writes exactly the bytes, fsyncs the file unless told
not to and returns its size and CRC-32; ``fsync_dir`` fsyncs the folder itself (so that new
names and renames in it survive a crash) and never leaks its descriptor.

Specifies ``fsdpckpt._io.durable`` directly. fsync is observed by recording the calls (which
file or folder each descriptor is), never by timing.
"""

from __future__ import annotations

import os
import zlib

import pytest

from fsdpckpt._io.durable import fsync_dir, write_bytes


@pytest.fixture
def fsyncs(monkeypatch):
    """The (device, inode) of everything os.fsync is called on, in order."""
    calls: list[tuple[int, int]] = []
    real = os.fsync

    def record(fd):
        st = os.fstat(fd)
        calls.append((st.st_dev, st.st_ino))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def _identity(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- write_bytes -----------------------------------------------------------------------------

@pytest.mark.parametrize("data", [b"", b"123456789", bytes(range(256)) * 1000],
                         ids=["empty", "check-string", "256-kB"])
def test_write_bytes_writes_exactly_the_bytes_and_returns_size_and_crc32(tmp_path, data):
    path = tmp_path / "f"
    assert write_bytes(path, data) == (len(data), zlib.crc32(data))
    assert path.read_bytes() == data


def test_the_crc_is_the_standard_crc32():
    # The CRC-32 check value of "123456789" (zip, PNG, ...), so manifests agree with other tools.
    assert zlib.crc32(b"123456789") == 0xCBF43926


def test_write_bytes_replaces_a_longer_file_whole(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    write_bytes(path, b"short")
    assert path.read_bytes() == b"short"


def test_write_bytes_fsyncs_the_file_it_wrote(tmp_path, fsyncs):
    path = tmp_path / "f"
    write_bytes(path, b"data")
    assert fsyncs == [_identity(path)]


def test_write_bytes_without_sync_fsyncs_nothing(tmp_path, fsyncs):
    path = tmp_path / "f"
    assert write_bytes(path, b"data", sync=False) == (4, zlib.crc32(b"data"))
    assert path.read_bytes() == b"data" and fsyncs == []


def test_write_bytes_into_a_missing_folder_raises_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_bytes(tmp_path / "no" / "f", b"data")
    assert not (tmp_path / "no").exists()


# --- fsync_dir -------------------------------------------------------------------------------

def test_fsync_dir_fsyncs_the_folder_itself(tmp_path, fsyncs):
    fsync_dir(tmp_path)
    assert fsyncs == [_identity(tmp_path)]


def test_fsync_dir_closes_its_descriptor(tmp_path):
    before = _open_descriptors()
    for _ in range(20):
        fsync_dir(tmp_path)
    assert _open_descriptors() == before


def test_fsync_dir_closes_its_descriptor_when_fsync_fails(tmp_path, monkeypatch):
    def fail(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    before = _open_descriptors()
    with pytest.raises(OSError, match="Input/output error"):
        fsync_dir(tmp_path)
    assert _open_descriptors() == before


def test_fsync_dir_of_a_missing_folder_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")


def test_every_file_a_save_writes_is_fsynced_whole(tmp_path, monkeypatch):
    """torch's DCP writer fsyncs ``.metadata.tmp`` before its buffered bytes are flushed (an
    fsync of an empty file): each file a save writes must be fsynced once all its bytes are
    in it, before the rename that publishes ``.metadata``."""
    import torch

    import fsdpckpt

    synced: dict[tuple[int, int], int] = {}  # (device, inode) -> the largest size fsynced
    real = os.fsync

    def record(fd):
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        synced[key] = max(synced.get(key, -1), st.st_size)
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    model = torch.nn.Linear(4, 3)
    fsdpckpt.save_state(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()))
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert any(p.name == ".metadata" for p in files)
    for path in files:
        st = path.stat()
        assert synced.get((st.st_dev, st.st_ino)) == st.st_size, path.name
