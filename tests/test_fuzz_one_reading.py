"""Differential fuzzing of the archive reader against torch's (issue 42).

Real ``torch.save`` archives (the fixtures' chunks) have their zip structure mutated: the
directory's declared offset and count, entries' header offsets, names (a case changed, a
name made another's), whole archives appended or prepended, bytes around the end records.
Whatever comes out, fsdpckpt refuses it with one of its errors, or what it reads (the
checked bytes of ``data/0`` and the pickle) is byte for byte what torch's reader (miniz)
loads; and the plain parser and the ``zipfile`` fallback give the same answer.
"""

from __future__ import annotations

import io
import struct
import warnings
import zipfile
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdpckpt.dcp import _ziparchive
from fsdpckpt.dcp._archive import locate_tensor
from fsdpckpt.dcp._ziparchive import entry_info, open_archive, read_entry
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import FsdpCkptError

from conftest import DCP_FOLDERS
from fuzzing import damaged, fuzz_settings

_FUZZ = fuzz_settings(0.5)


def _archives() -> list[bytes]:
    out = []
    for folder in (DCP_FOLDERS["dtensor"], DCP_FOLDERS["fsdp2-model"]):
        chunk = read_dcp_folder(folder).metadata.tensors[0].chunks[0]
        data = (folder / chunk.file).read_bytes()
        out.append(data[chunk.offset:chunk.offset + chunk.length])
    return out


_ARCHIVES = _archives()


def _centrals(data: bytearray) -> list[int]:
    return [i for i in range(len(data) - 46) if data[i:i + 4] == b"PK\x01\x02"]


def _ends(data: bytearray) -> list[tuple[int, int]]:
    """Where the end records' directory offset fields are (plain, zip64), and their sizes."""
    found = [(len(data) - 22 + 16, 4)] if len(data) >= 22 else []
    if len(data) >= 98 and data[-98:-94] == b"PK\x06\x06":
        found.append((len(data) - 98 + 48, 8))
    return found


@st.composite
def _shift_directory(draw, data: bytearray) -> None:
    for at, size in _ends(data):
        value = int.from_bytes(data[at:at + size], "little") + draw(st.integers(-128, 128))
        data[at:at + size] = min(max(0, value), 256 ** size - 1).to_bytes(size, "little")


@st.composite
def _shift_header(draw, data: bytearray) -> None:
    centrals = _centrals(data)
    if centrals:
        at = draw(st.sampled_from(centrals)) + 42
        value = int.from_bytes(data[at:at + 4], "little") + draw(st.integers(-64, 64))
        data[at:at + 4] = min(max(0, value), 2**32 - 1).to_bytes(4, "little")


@st.composite
def _rename(draw, data: bytearray) -> None:
    """A central (and maybe its local) name's letter's case changed, or a name made
    another's of the same length."""
    centrals = _centrals(data)
    if not centrals:
        return
    at = draw(st.sampled_from(centrals))
    length = struct.unpack_from("<H", data, at + 28)[0]
    name = data[at + 46:at + 46 + length]
    same = [c for c in centrals if c != at and struct.unpack_from("<H", data, c + 28)[0] == length]
    if same and draw(st.booleans()):
        other = draw(st.sampled_from(same))
        name = data[other + 46:other + 46 + length]
    elif length:
        name = bytearray(name)
        i = draw(st.integers(0, length - 1))
        name[i:i + 1] = bytes(name[i:i + 1]).swapcase()
    data[at + 46:at + 46 + length] = name


@st.composite
def _count(draw, data: bytearray) -> None:
    delta = draw(st.integers(-2, 2))
    if len(data) >= 22:
        end = len(data) - 22
        for off in (8, 10):
            value = max(0, struct.unpack_from("<H", data, end + off)[0] + delta) & 0xFFFF
            struct.pack_into("<H", data, end + off, value)
    if len(data) >= 98 and data[-98:-94] == b"PK\x06\x06":
        for off in (24, 32):
            at = len(data) - 98 + off
            struct.pack_into("<Q", data, at, max(0, struct.unpack_from("<Q", data, at)[0] + delta))


@st.composite
def _another_archive(draw, data: bytearray) -> None:
    """Another whole archive (the other fixture's, or this one again) before or after."""
    other = draw(st.sampled_from([*_ARCHIVES, bytes(data)]))
    if draw(st.booleans()):
        data[:0] = other
    else:
        data += other


@st.composite
def _bytes_around(draw, data: bytearray) -> None:
    junk = draw(st.binary(min_size=1, max_size=24))
    if draw(st.booleans()):
        data[:0] = junk
    else:
        data += junk


def _other_values(archive: bytes) -> bytes | None:
    """``archive`` with data/0's bytes changed and its CRC-32s fixed (same layout); None if
    zipfile cannot find data/0 in it."""
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    except (zipfile.BadZipFile, StopIteration, ValueError, OSError, EOFError):
        return None
    out = bytearray(archive)
    if info.header_offset + 30 > len(out):
        return None
    start = info.header_offset + 30 + sum(struct.unpack_from("<HH", out, info.header_offset + 26))
    values = bytes(b ^ 0x5A for b in out[start:start + info.file_size])
    out[start:start + len(values)] = values
    crc = zlib.crc32(values)
    for at in _centrals(out):
        if struct.unpack_from("<I", out, at + 42)[0] == info.header_offset:
            struct.pack_into("<I", out, at + 16, crc)
    if out[start + len(values):start + len(values) + 4] == b"PK\x07\x08":
        struct.pack_into("<I", out, start + len(values) + 4, crc)
    return bytes(out)


@st.composite
def _twin(draw, data: bytearray) -> None:
    """A copy holding other values before or after: zipfile and miniz each find one."""
    other = _other_values(bytes(data))
    if other is None:
        return
    if draw(st.booleans()):
        data[:0] = other
    else:
        data += other


@st.composite
def _duplicate(draw, data: bytearray) -> None:
    """The archive rewritten by zipfile with data/0 listed again, holding other values, at
    a drawn place in the directory."""
    try:
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as src:
            infos = src.infolist()
            entries = [(i.filename, src.read(i)) for i in infos]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError,
            NotImplementedError, struct.error, zlib.error):
        return
    named = [(n, d) for n, d in entries if n.endswith("/data/0")]
    if not named:
        return
    name, values = named[0]
    at = draw(st.integers(0, len(entries)))
    entries.insert(at, (name, bytes(b ^ 0x5A for b in values)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": the point
        for entry_name, entry in entries:
            z.writestr(entry_name, entry)
    data[:] = out.getvalue()


_CUSTOM = {"directory": _shift_directory, "header": _shift_header, "rename": _rename,
           "count": _count, "archive": _another_archive, "around": _bytes_around,
           "twin": _twin, "duplicate": _duplicate}
_KINDS = (*_CUSTOM, "byte", "flip")


def _tail(data: bytearray) -> st.SearchStrategy[int]:
    return st.integers(max(0, len(data) - 700), len(data) - 1)


def _fsdpckpt_reads(data: bytes, *, plain: bool) -> tuple[bytes, bytes] | str:
    """What fsdpckpt reads of ``data``: its pickle and the checked bytes of its storage;
    or its refusal's class."""
    with pytest.MonkeyPatch.context() as patch:
        if not plain:
            patch.setattr(_ziparchive, "plain_archive", lambda *_a, **_k: None)
        try:
            raw = locate_tensor(io.BytesIO(data), 0, len(data), source="chunk")
            with open_archive(io.BytesIO(data), 0, len(data), "chunk") as archive:
                pkl = read_entry(archive, entry_info(archive, "/data.pkl", "chunk"),
                                 source="chunk", start=0)
        except FsdpCkptError as exc:
            return type(exc).__name__
    stored = data[raw.storage_start:raw.storage_start + raw.storage_nbytes]
    if zlib.crc32(stored) != raw.crc32:
        return "ChecksumError"  # what the checked read refuses
    return pkl, stored


def _torch_reads(data: bytes) -> tuple[bytes, bytes] | None:
    """What torch's reader loads of ``data``: its pickle and its storage; None if it fails."""
    try:
        tensor = torch.load(io.BytesIO(data), weights_only=True)
        pkl = torch._C.PyTorchFileReader(io.BytesIO(data)).get_record("data.pkl")
    except Exception:  # noqa: BLE001 - torch refusing, however, is no second reading
        return None
    if not isinstance(tensor, torch.Tensor):
        return None
    return bytes(pkl), bytes(tensor.untyped_storage())


@_FUZZ
@given(data=st.data())
def test_fsdpckpt_refuses_or_reads_exactly_what_torch_loads(data):
    source = _ARCHIVES[data.draw(st.integers(0, len(_ARCHIVES) - 1))]
    mutated = data.draw(damaged(source, steps=3, kinds=_KINDS, where=_tail, custom=_CUSTOM))
    ours = _fsdpckpt_reads(mutated, plain=True)
    assert ours == _fsdpckpt_reads(mutated, plain=False)  # both parsers alike
    if isinstance(ours, str):
        return  # refused: nothing was read
    theirs = _torch_reads(mutated)
    if theirs is not None:
        assert ours == theirs


def test_the_unmutated_archives_read_as_torch_reads_them():
    for archive in _ARCHIVES:
        assert _fsdpckpt_reads(archive, plain=True) == _torch_reads(archive)
