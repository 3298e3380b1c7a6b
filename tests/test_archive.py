"""Each chunk's raw bytes are found inside its torch.save archive without torch.

The located bytes, dtype, shape and strides equal what torch loads (uint16/32/64 included);
a view the archive's pickle declares outside its storage is corrupt and named, as torch's
own loader also refuses it; a windowed file reads only its window, despite short reads.
"""

from __future__ import annotations

import io

import pytest
import torch

from fsdpckpt.dcp._archive import SliceFile, locate_tensor
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import CorruptCheckpointError

from conftest import single_process


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
             **single_process())
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


# ----------------------------------------------------------------------------- uint16/32/64

@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_untyped_storage_sizes_count_bytes_not_elements(tmp_path, dtype):
    # torch.save records an UntypedStorage's size in bytes (a typed one's in elements).
    import torch.distributed.checkpoint as dcp

    tensor = torch.tensor([0, 1, 2**16 - 1, 7, 3], dtype=torch.int64).to(dtype)
    dcp.save({"u": tensor}, checkpoint_id=tmp_path, **single_process())
    ((_, chunk),) = _chunks(tmp_path)
    with open(tmp_path / chunk.file, "rb") as f:
        raw = locate_tensor(f, chunk.offset, chunk.length, source="u")
        f.seek(raw.data_start)
        data = f.read(raw.nbytes)
    assert raw.dtype.name == str(dtype).removeprefix("torch.") and raw.shape == (5,)
    assert data == tensor.view(torch.uint8).numpy().tobytes()


# ----------------------------------------------------------------------------- hostile views

class _View:
    """Pickles as torch.save pickles a float32 tensor on storage "0" of 12 elements."""

    _STORAGE = object()

    def __init__(self, offset, shape, stride) -> None:
        self.args = (offset, shape, stride)

    def __reduce__(self):
        import collections

        return (torch._utils._rebuild_tensor_v2,
                (self._STORAGE, *self.args, False, collections.OrderedDict()))

    def pickled(self) -> bytes:
        import pickle

        storage = self._STORAGE

        class _Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                return ("storage", torch.FloatStorage, "0", "cpu", 12) if obj is storage else None

        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(self)
        return buffer.getvalue()


def _doctored_folder(folder, *, offset=None, shape=None, stride=None):
    """A one-tensor DCP folder whose chunk's data.pkl gives another offset, shape or strides.

    The archive is rewritten whole (so every zip CRC is right) and .metadata points at it:
    only the pickle lies, as a damaged or hostile file's would.
    """
    import pickle
    import zipfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dcp.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, checkpoint_id=folder,
             **single_process())
    (data_file,) = folder.glob("*.distcp")
    with zipfile.ZipFile(data_file) as old:
        entries = {info.filename: old.read(info) for info in old.infolist()}
    pkl_name = next(n for n in entries if n.endswith("/data.pkl"))
    view = _View(0 if offset is None else offset, shape or (3, 4), stride or (4, 1))
    entries[pkl_name] = view.pickled()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
        for name, data in entries.items():
            new.writestr(name, data)
    data_file.write_bytes(out.getvalue())
    meta = FileSystemReader(str(folder)).read_metadata()
    for info in meta.storage_data.values():
        info.offset, info.length = 0, len(out.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return folder


def _locate_only_chunk(folder):
    ((_, chunk),) = _chunks(folder)
    with open(folder / chunk.file, "rb") as f:
        return locate_tensor(f, chunk.offset, chunk.length, source="tensor 'w'")


def test_the_doctored_folder_is_sound_when_nothing_is_changed(tmp_path):
    raw = _locate_only_chunk(_doctored_folder(tmp_path))
    assert (raw.storage_offset, raw.shape, raw.stride) == (0, (3, 4), (4, 1))


@pytest.mark.parametrize("change, words", [
    ({"offset": -4}, "negative"),
    ({"offset": 1}, "reaches past its storage"),
    ({"offset": 13}, "reaches past its storage"),
    ({"stride": (4, -1)}, "negative"),
    ({"stride": (5, 1)}, "reaches past its storage"),
    ({"shape": (3, 5), "stride": (4, 1)}, "reaches past its storage"),
    ({"shape": (2**40, 2**40), "stride": (2**40, 1)}, "reaches past its storage"),
    ({"shape": (-3, 4)}, "negative"),
    ({"shape": (3, 4, 1), "stride": (4, 1)}, "3 dims but 2 strides"),
    ({"offset": 2.5}, "not integers"),
])
def test_a_view_outside_its_storage_is_corrupt_and_named(tmp_path, change, words):
    folder = _doctored_folder(tmp_path, **change)
    with pytest.raises(CorruptCheckpointError, match=words) as caught:
        _locate_only_chunk(folder)
    assert "tensor 'w'" in str(caught.value)


def test_torch_refuses_a_negative_storage_offset_too(tmp_path):
    # The rule above follows torch's own loader of the chunk's archive, it is not stricter.
    folder = _doctored_folder(tmp_path, offset=-4)
    (data_file,) = folder.glob("*.distcp")
    with pytest.raises(RuntimeError, match="storage offset"):
        torch.load(io.BytesIO(data_file.read_bytes()), weights_only=True)


def test_verify_and_merge_refuse_a_negative_storage_offset(tmp_path):
    from fsdpckpt import load_full_state_dict
    from fsdpckpt.inspection.verify import verify_checkpoint

    from conftest import run_cli

    folder = _doctored_folder(tmp_path / "ckpt", offset=-4)
    report = verify_checkpoint(folder)
    assert not report["ok"] and any("'w'" in p["message"] and "negative" in p["message"]
                                     for p in report["problems"])
    result = run_cli("merge", folder, tmp_path / "out")
    assert result.exit_code == 1 and "'w'" in result.stderr and "negative" in result.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(CorruptCheckpointError, match="negative"):
        load_full_state_dict(folder)


# ----------------------------------------------------------------------------- short reads

class _Trickle(io.RawIOBase):
    """A file whose ``read`` returns at most 3 bytes, as pipes and network files may."""

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        data = self._data[self._pos:self._pos + min(size, 3)]
        self._pos += len(data)
        return data


def test_slice_file_readinto_fills_the_buffer_despite_short_reads():
    view = SliceFile(_Trickle(b"0123456789"), 1, 8)
    buffer = bytearray(6)
    assert view.readinto(buffer) == 6 and bytes(buffer) == b"123456"
    assert view.readinto(buffer) == 2 and bytes(buffer[:2]) == b"78"
    assert view.readinto(buffer) == 0


def test_slice_file_stops_at_the_real_end_of_the_file():
    view = SliceFile(_Trickle(b"0123"), 1, 10)  # the window claims more than the file has
    assert view.read() == b"123"
