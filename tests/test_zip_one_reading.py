"""One reading of every archive, torch's (issue 42).

A ``torch.save`` archive can be laid out so that Python's ``zipfile`` and torch's reader
(miniz) take different bytes from it: a central directory not where its end record says
(``zipfile`` infers prepended bytes, miniz uses the declared offset), a name listed twice
(``zipfile`` keeps the last, miniz the first), a chunk's range stretched over an archive
appended after it. Each is built here from a real fixture chunk, with the values of one
copy replaced by 666s, and every verb must refuse it with one error naming it, rather than
check one reading and load the other. Honest archives still read.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from fsdpckpt import diff, load_full_state_dict, merge, verify_checkpoint
from fsdpckpt.dcp._archive import read_archive_with_tensors
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError

from conftest import FIXTURES, assert_one_line_error, run_cli

_TWO_WAYS = "can be read two ways"


# -- building the hostile archives from an honest one ----------------------------------------

def _data_entry(archive: bytes) -> tuple[int, int, int]:
    """(where data/0's bytes start, their size, its central record's offset) in ``archive``."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack_from("<HH", archive, info.header_offset + 26)
    central = next(at for at in range(len(archive))
                   if archive[at:at + 4] == b"PK\x01\x02"
                   and archive[at + 46:at + 46 + len(info.filename)] == info.filename.encode())
    return info.header_offset + 30 + name_len + extra_len, info.file_size, central


def _sixes(archive: bytes) -> bytes:
    """The bytes 666.0 stands for in data/0's dtype, as many as data/0 holds."""
    loaded = torch.load(io.BytesIO(archive), weights_only=True)
    storage = torch.full((loaded.untyped_storage().nbytes() // loaded.element_size(),), 666,
                         dtype=loaded.dtype)
    return storage.view(torch.uint8).numpy().tobytes()


def evil_twin(archive: bytes) -> bytes:
    """``archive`` with data/0 holding 666s, its CRC-32s fixed: the same layout, byte for byte
    the same length."""
    start, size, central = _data_entry(archive)
    sixes = _sixes(archive)
    out = bytearray(archive)
    out[start:start + size] = sixes
    crc = zlib.crc32(sixes)
    struct.pack_into("<I", out, central + 16, crc)
    if out[start + size:start + size + 4] == b"PK\x07\x08":  # torch.save's data descriptor
        struct.pack_into("<I", out, start + size + 4, crc)
    return bytes(out)


def directory_moved(honest: bytes) -> bytes:
    """The 666s archive, then the honest one: the end records declare the directory at the
    honest archive's own offset, which miniz reads in the first copy; zipfile sees that the
    directory is not there and reads the honest one, inferring prepended bytes."""
    return evil_twin(honest) + honest


def appended(honest: bytes) -> bytes:
    """The honest archive with a 666s copy appended: a chunk length stretched over both
    gives torch the honest bytes and zipfile the 666s."""
    return honest + evil_twin(honest)


def duplicated(honest: bytes) -> bytes:
    """The honest archive's entries written again, data/0 listed twice: a 666s copy third in
    the directory, the honest one in its place after it. zipfile keeps the last; miniz's
    binary search over its sorted directory lands on the 666s copy."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(honest)) as src, zipfile.ZipFile(out, "w") as z, \
            pytest.warns(UserWarning, match="Duplicate name"):
        infos = src.infolist()
        name = next(i.filename for i in infos if i.filename.endswith("/data/0"))
        for index, info in enumerate(infos):
            if index == 2:
                z.writestr(name, _sixes(honest))
            z.writestr(info.filename, src.read(info))
    return out.getvalue()


HOSTILE = {"directory_moved": directory_moved, "duplicated": duplicated, "appended": appended}


def torch_reads(archive: bytes) -> bytes:
    """The storage bytes ``torch.load`` (miniz) gives for ``archive``."""
    tensor = torch.load(io.BytesIO(archive), weights_only=True)
    return bytes(tensor.untyped_storage())


def zipfile_reads(archive: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data/0")))


# -- the same in a DCP folder ----------------------------------------------------------------

def _metadata(folder: Path):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # safe: the committed fixture's own metadata


def _first_chunk(folder: Path):
    meta = _metadata(folder)
    index, info = min(meta.storage_data.items(),
                      key=lambda item: (item[1].relative_path, item[1].offset))
    return meta, index, info


def replace_chunk(folder: Path, make) -> tuple[bytes, bytes]:
    """Rewrite the first chunk of ``folder``'s first data file as ``make(chunk)``, later
    chunks' offsets shifted, the metadata patched and pickled as FileSystemWriter does.
    Returns the honest chunk and what replaced it."""
    meta, index, info = _first_chunk(folder)
    path = folder / info.relative_path
    data = path.read_bytes()
    honest = data[info.offset:info.offset + info.length]
    hostile = make(honest)
    path.write_bytes(data[:info.offset] + hostile + data[info.offset + info.length:])
    grown = len(hostile) - len(honest)
    for key, other in list(meta.storage_data.items()):
        if other.relative_path == info.relative_path and other.offset > info.offset:
            meta.storage_data[key] = dataclasses.replace(other, offset=other.offset + grown)
    meta.storage_data[index] = dataclasses.replace(info, length=len(hostile))
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return honest, hostile


@pytest.fixture(params=sorted(HOSTILE))
def hostile_folder(request, tmp_path) -> Path:
    folder = Path(shutil.copytree(FIXTURES / "dtensor", tmp_path / "dtensor"))
    replace_chunk(folder, HOSTILE[request.param])
    return folder


# -- the premise: the two readers differ on these bytes --------------------------------------

@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_torch_and_zipfile_read_other_bytes_from_each_hostile_archive(kind):
    _, _, info = _first_chunk(FIXTURES / "dtensor")
    data = (FIXTURES / "dtensor" / info.relative_path).read_bytes()
    hostile = HOSTILE[kind](data[info.offset:info.offset + info.length])
    assert torch_reads(hostile) != zipfile_reads(hostile)


def test_torchs_dcp_reader_takes_the_666s_where_zipfile_takes_the_honest_bytes(tmp_path):
    # What fsdpckpt checked before issue 42 (zipfile's reading) was not what dcp.load loads.
    folder = Path(shutil.copytree(FIXTURES / "dtensor", tmp_path / "dtensor"))
    replace_chunk(folder, directory_moved)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(tmp_path / "ref.pt"))
    loaded = torch.load(tmp_path / "ref.pt", weights_only=False)  # our own file
    assert (loaded["model"]["col_uneven"] == 666).any()


# -- every verb refuses them -----------------------------------------------------------------

def test_verify_refuses_a_chunk_that_can_be_read_two_ways(hostile_folder):
    report = verify_checkpoint(hostile_folder)
    assert not report.ok
    assert _TWO_WAYS in str(report.to_json())


def test_the_cli_verify_names_the_chunk_read_two_ways(hostile_folder):
    result = run_cli("verify", hostile_folder)
    assert result.exit_code != 0
    assert _TWO_WAYS in result.output + result.stderr


def test_merge_refuses_a_chunk_that_can_be_read_two_ways(hostile_folder, tmp_path):
    with pytest.raises(CorruptCheckpointError, match=_TWO_WAYS):
        merge(hostile_folder, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_load_full_state_dict_refuses_a_chunk_that_can_be_read_two_ways(hostile_folder):
    with pytest.raises(CorruptCheckpointError, match=_TWO_WAYS):
        load_full_state_dict(hostile_folder)


def test_diff_refuses_a_chunk_that_can_be_read_two_ways(hostile_folder):
    with pytest.raises(CorruptCheckpointError, match=_TWO_WAYS):
        diff(hostile_folder, FIXTURES / "dtensor")


# -- a whole torch.save file (.bin) ----------------------------------------------------------

@pytest.fixture(params=sorted(HOSTILE))
def hostile_bin(request, tmp_path) -> Path:
    honest = io.BytesIO()
    torch.save(torch.arange(64, dtype=torch.float32), honest)
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(HOSTILE[request.param](honest.getvalue()))
    return path


def test_read_archive_with_tensors_refuses_a_bin_read_two_ways(hostile_bin):
    with open(hostile_bin, "rb") as f, pytest.raises(CorruptCheckpointError, match=_TWO_WAYS):
        read_archive_with_tensors(f, 0, hostile_bin.stat().st_size, source=str(hostile_bin),
                                  allowed=BUILTIN_GLOBALS, make_tensor=lambda *a: a)


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_the_cli_refuses_a_bin_read_two_ways(hostile_bin, verb):
    result = run_cli(verb, hostile_bin)
    assert result.exit_code != 0
    assert _TWO_WAYS in result.output + result.stderr


def test_diff_refuses_a_bin_read_two_ways(hostile_bin, tmp_path):
    honest = tmp_path / "honest.bin"
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, honest)
    assert_one_line_error(run_cli("diff", honest, hostile_bin), _TWO_WAYS)


# -- what is still read ----------------------------------------------------------------------

def test_honest_chunks_and_files_still_read(tmp_path):
    assert verify_checkpoint(FIXTURES / "dtensor").ok
    _, _, info = _first_chunk(FIXTURES / "dtensor")
    data = (FIXTURES / "dtensor" / info.relative_path).read_bytes()
    honest = data[info.offset:info.offset + info.length]
    assert torch_reads(honest) == zipfile_reads(honest)


def test_a_huge_persistent_id_is_quoted_bounded(tmp_path):
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", "x" * 10_000_000) if obj == "here" else None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(["here"])
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("archive/data.pkl", buffer.getvalue())
        z.writestr("archive/byteorder", "little")
    raw = archive.getvalue()
    with pytest.raises(NotACheckpointError) as caught:
        read_archive_with_tensors(io.BytesIO(raw), 0, len(raw), source="f",
                                  allowed=BUILTIN_GLOBALS, make_tensor=lambda *a: a)
    assert len(str(caught.value)) < 600
