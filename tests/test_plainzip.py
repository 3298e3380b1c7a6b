"""The plain reading of a chunk's archive agrees with zipfile's, or leaves it to zipfile.

``fsdpckpt.dcp._plainzip`` reads the archives ``torch.save`` writes without ``zipfile``
(a tensor in 4,096 chunks is 4,096 archives). Whatever the bytes, locating a chunk's
tensor must give what the ``zipfile`` reading gives: the same record, or the same
refusal, word for word.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdpckpt.dcp import _ziparchive
from fsdpckpt.dcp._archive import locate_tensor
from fsdpckpt.dcp._plainzip import plain_archive
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import FsdpCkptError

from conftest import FIXTURES


def _archives(folder: Path, count: int = 6) -> list[bytes]:
    meta = read_dcp_folder(folder).metadata
    found = []
    for tensor in meta.tensors:
        for chunk in tensor.chunks[:1]:
            with open(folder / str(chunk.file), "rb") as f:
                f.seek(chunk.offset)
                found.append(f.read(chunk.length))
    return found[:count]


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


ARCHIVES = [*_archives(FIXTURES / "dtensor"), *_archives(FIXTURES / "fsdp2_accelerate"
                                                         / "pytorch_model_fsdp_0"),
            _saved(torch.arange(6, dtype=torch.bfloat16)), _saved(torch.zeros(2, 3)[:, 1])]


def _plain(data: bytes, start: int = 0, length: int | None = None):
    length = len(data) - start if length is None else length
    file = io.BytesIO(data)
    return plain_archive(file, start, length, 32,
                         lambda: zipfile.ZipFile(_ziparchive.SliceFile(file, start, length)))


def _located(data: bytes, *, plain: bool) -> str:
    """``locate_tensor`` of the archive ``data`` as a string: its record, or its refusal."""
    with pytest.MonkeyPatch.context() as m:
        if not plain:
            m.setattr(_ziparchive, "plain_archive", lambda *_a, **_k: None)
        try:
            return repr(locate_tensor(io.BytesIO(data), 0, len(data), source="chunk"))
        except FsdpCkptError as exc:
            return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("data", ARCHIVES, ids=range(len(ARCHIVES)))
def test_torch_saves_archives_are_read_plainly(data):
    assert _plain(data) is not None


@pytest.mark.parametrize("data", ARCHIVES, ids=range(len(ARCHIVES)))
def test_the_plain_directory_is_zipfiles(data):
    plain = _plain(data)
    fields = ("filename", "orig_filename", "header_offset", "file_size", "compress_size", "CRC",
              "compress_type", "flag_bits", "extract_version")
    got = [tuple(getattr(i, f) for f in fields) for i in plain.infolist()]
    want = [tuple(getattr(i, f) for f in fields) for i in zipfile.ZipFile(io.BytesIO(data))
            .infolist()]
    assert got == want
    for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
        assert plain.read(plain.getinfo(info.filename)) == \
            zipfile.ZipFile(io.BytesIO(data)).read(info)


@pytest.mark.parametrize("data", ARCHIVES, ids=range(len(ARCHIVES)))
def test_both_readings_locate_the_same_tensor(data):
    plain = _located(data, plain=True)
    assert plain.startswith("RawTensor(")
    assert plain == _located(data, plain=False)


def test_an_archive_zipfile_wrote_without_zip64_records_is_read_plainly_too():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z, zipfile.ZipFile(io.BytesIO(ARCHIVES[-2])) as src:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info))
    data = buffer.getvalue()
    assert b"PK\x06\x07" not in data
    assert _plain(data) is not None
    assert _located(data, plain=True) == \
        _located(data, plain=False)


@pytest.mark.parametrize("change", ["comment", "duplicate", "count", "extra"])
def test_an_archive_torch_does_not_write_is_left_to_zipfile(change):
    data = bytearray(ARCHIVES[-2])
    end = len(data) - 22
    if change == "comment":
        data[end + 20:end + 22] = struct.pack("<H", 2)
        data += b"hi"
    elif change == "duplicate":  # written again under a name it already has
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z, zipfile.ZipFile(io.BytesIO(bytes(data))) as src:
            for info in src.infolist():
                z.writestr(info.filename, src.read(info))
            with pytest.warns(UserWarning, match="Duplicate name"):
                z.writestr(info.filename, b"other")
        data = bytearray(buffer.getvalue())
    elif change == "count":
        zip64 = end - 20 - 56
        data[zip64 + 24:zip64 + 40] = struct.pack("<QQ", 6, 6)
    else:  # an extra field's length in the first central entry
        directory = data.index(b"PK\x01\x02")
        data[directory + 30:directory + 32] = struct.pack("<H", 4)
    assert _plain(bytes(data)) is None


def test_a_flipped_data_byte_is_refused_as_zipfile_refuses_it():
    data = bytearray(ARCHIVES[0])
    pkl = zipfile.ZipFile(io.BytesIO(bytes(data))).infolist()[0]
    extra = struct.unpack_from("<H", data, pkl.header_offset + 28)[0]
    data[pkl.header_offset + 30 + len(pkl.filename) + extra + 3] ^= 0x40  # inside data.pkl
    plain = _located(bytes(data), plain=True)
    assert plain.startswith("ChecksumError")
    assert plain == _located(bytes(data), plain=False)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(ARCHIVES) - 1), data=st.data())
def test_any_damage_reads_the_same_both_ways(which, data):
    archive = bytearray(ARCHIVES[which])
    size = len(archive)
    # Most damage where the readings differ: the end records, the directory, the headers.
    tail = max(0, size - 600)
    edits = data.draw(st.lists(st.tuples(
        st.one_of(st.integers(tail, size - 1), st.integers(0, size - 1)),
        st.integers(0, 255)), min_size=1, max_size=4))
    for at, value in edits:
        archive[at] = value
    cut = data.draw(st.one_of(st.just(0), st.integers(0, 120)))
    damaged = bytes(archive[:size - cut] if cut else archive)
    assert _located(damaged, plain=True) == \
        _located(damaged, plain=False)


def test_a_window_into_a_larger_file_reads_only_its_own_bytes():
    data = ARCHIVES[0]
    padded = b"x" * 100 + data + b"PK\x05\x06" + b"\0" * 40
    got = repr(locate_tensor(io.BytesIO(padded), 100, len(data), source="chunk"))
    want = _located(data, plain=True)
    assert got.replace("storage_start=", "") != ""  # both located
    assert _plain(padded, 100, len(data)) is not None
    assert got.split("storage_nbytes")[1] == want.split("storage_nbytes")[1]


def test_bytes_before_the_archive_in_its_window_read_the_same_both_ways():
    # zipfile finds an archive behind prepended bytes (its offsets shifted): read the same.
    data = b"\0" * 48 + ARCHIVES[0]
    assert _located(data, plain=True) == _located(data, plain=False)


def test_an_entry_whose_header_lies_past_the_window_is_left_to_zipfile_unread():
    data = bytearray(ARCHIVES[-2])
    central = [i for i in range(len(data)) if data[i:i + 4] == b"PK\x01\x02"][1]
    data[central + 42:central + 46] = (len(data) - 10).to_bytes(4, "little")
    reads = []

    class Spy(io.BytesIO):
        def read(self, n=-1):
            reads.append((self.tell(), n))
            return super().read(n)

    file = Spy(bytes(data))
    assert plain_archive(file, 0, len(data), 32,
                         lambda: zipfile.ZipFile(_ziparchive.SliceFile(file, 0, len(data)))) is None
    assert all(at + n <= len(data) for at, n in reads if n >= 0 and at < len(data))


def _central_records(data: bytes) -> list[int]:
    return [i for i in range(len(data)) if data[i:i + 4] == b"PK\x01\x02"]


def test_a_directory_read_before_gives_each_archive_its_own_crcs():
    # Two saves of one shape differ only in their CRC-32s: the second is read through the
    # first's layout, and must still carry its own.
    first, second = _saved(torch.zeros(64)), _saved(torch.ones(64))
    for data in (first, second, first):
        plain = _plain(data)
        want = {i.filename: i.CRC for i in zipfile.ZipFile(io.BytesIO(data)).infolist()}
        assert {i.filename: i.CRC for i in plain.infolist()} == want
    assert _located(second, plain=True) == _located(second, plain=False)


def test_a_wrong_crc_in_a_directory_read_before_is_refused_as_zipfile_refuses_it():
    data = bytearray(_saved(torch.arange(64, dtype=torch.float32)))
    _located(bytes(data), plain=True)  # its layout is now known
    pkl = _central_records(data)[0]
    data[pkl + 16] ^= 0x01  # data.pkl's CRC-32, only
    plain = _located(bytes(data), plain=True)
    assert plain.startswith("ChecksumError")
    assert plain == _located(bytes(data), plain=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(ARCHIVES) - 1), data=st.data())
def test_damage_to_a_directory_read_before_reads_the_same_both_ways(which, data):
    clean = ARCHIVES[which]
    _located(clean, plain=True)  # the layout every damaged copy is first compared with
    archive = bytearray(clean)
    records = _central_records(clean)
    spots = [r + k for r in records for k in range(14, 24)] + list(range(records[0],
                                                                         len(clean)))
    edits = data.draw(st.lists(st.tuples(st.sampled_from(spots), st.integers(0, 255)),
                               min_size=1, max_size=3))
    for at, value in edits:
        archive[at] = value
    assert _located(bytes(archive), plain=True) == _located(bytes(archive), plain=False)


@pytest.mark.parametrize("which", range(len(ARCHIVES)))
def test_an_archive_is_located_alike_through_its_descriptor(tmp_path, which):
    path = tmp_path / "rank.distcp"
    path.write_bytes(b"\0" * 24 + ARCHIVES[which] + b"\0" * 8)
    size = len(ARCHIVES[which])
    with open(path, "rb") as file:
        by_file = repr(locate_tensor(file, 24, size, source="chunk"))
        by_fd = repr(locate_tensor(file.fileno(), 24, size, source="chunk"))
    assert by_fd == by_file


def test_a_chunk_past_the_end_of_its_file_is_refused_alike_through_its_descriptor(tmp_path):
    path = tmp_path / "rank.distcp"
    path.write_bytes(ARCHIVES[0][:-40])  # cut short: its end records are gone
    refusals = []
    with open(path, "rb") as file:
        for handle in (file, file.fileno()):
            with pytest.raises(FsdpCkptError) as caught:
                locate_tensor(handle, 0, len(ARCHIVES[0]), source="chunk")
            refusals.append(f"{type(caught.value).__name__}: {caught.value}")
    assert refusals[0] == refusals[1]


def test_too_many_entries_in_the_plain_end_record_are_refused_as_before_even_with_zip64():
    # Found by the fuzz above: the count in the plain end record, which a zip64 archive's
    # reader otherwise ignores, is what open_archive refuses before it parses.
    data = bytearray(ARCHIVES[0])
    end = len(data) - 22
    data[end + 10:end + 12] = (33).to_bytes(2, "little")
    plain = _located(bytes(data), plain=True)
    assert plain.startswith("CorruptCheckpointError") and "declares 33 entries" in plain
    assert plain == _located(bytes(data), plain=False)
