"""Fuzzing the chunk-archive reader: whatever the bytes, only fsdpckpt's errors come out.

Seeded hypothesis searches with a bounded budget (CI runs them in seconds) over every
public entry point that reads a ``torch.save`` zip archive: ``locate_tensor`` (merge and
verify), ``data_entry_crc`` (verify, the manifest), ``read_archive_pickle`` and
``read_archive_with_tensors`` (objects, ``.bin`` side files). The inputs are the real chunk
archives of ``fixtures/`` damaged by bit flips, byte overwrites, truncations, inserted and
dropped bytes, and crafted zip records (compression methods, the encryption flag, zip
versions, zip64 extras, huge counts and offsets). End to end, ``verify_checkpoint`` and
``merge`` run on a damaged copy of a fixture, and the CLI prints one ``fsdpckpt: error:``
line, never "unexpected".

A longer run by hand: see tests/fuzzing.py.
"""

from __future__ import annotations

import io
import re
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from fsdpckpt import merge, verify_checkpoint
from fsdpckpt.cli import main
from fsdpckpt.dcp._archive import locate_tensor, read_archive_pickle, read_archive_with_tensors
from fsdpckpt.dcp._safe_pickle import BUILTIN_GLOBALS
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import FsdpCkptError
from fsdpckpt.training.manifest import data_entry_crc

from conftest import DCP_FOLDERS, FIXTURES
from fuzzing import damaged, fuzz_settings

_FUZZ = fuzz_settings()
_FUZZ_E2E = fuzz_settings(0.1)  # end-to-end examples write files and merge


def _chunk_archives() -> list[bytes]:
    """The first tensor chunk's archive of each committed DCP folder."""
    out = []
    for folder in DCP_FOLDERS.values():
        meta = read_dcp_folder(folder).metadata
        chunk = meta.tensors[0].chunks[0]
        data = (folder / chunk.file).read_bytes()
        out.append(data[chunk.offset:chunk.offset + chunk.length])
    return out


_ARCHIVES = _chunk_archives()
_BIN = (FIXTURES / "fsdp2_accelerate" / "scheduler.bin").read_bytes()

# -- damage -------------------------------------------------------------------------------

_SIGNATURES = {b"PK\x01\x02": "central", b"PK\x03\x04": "local", b"PK\x05\x06": "end",
               b"PK\x06\x06": "end64", b"PK\x06\x07": "locator64"}
# (offset, size) of the fields a crafted record would change, by record kind.
_FIELDS = {
    "central": [(4, 2), (6, 2), (8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2),
                (32, 2), (34, 2), (42, 4)],
    "local": [(4, 2), (6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)],
    "end": [(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2)],
    "end64": [(4, 8), (12, 2), (14, 2), (16, 4), (20, 4), (24, 8), (32, 8), (40, 8), (48, 8)],
    "locator64": [(4, 4), (8, 8), (16, 4)],
}
# Compression methods (deflate, bzip2, lzma, unknown), flag bits (encryption, data
# descriptor, utf-8, strong encryption), versions zipfile refuses, zip64 markers, huge values.
_ODD_FIELD_VALUES = [0, 1, 8, 12, 14, 99, 0x41, 0x8, 0x800, 0x40, 63, 64, 0xFF, 0xFFFF,
                     0xFFFFFFFF, 2**31 - 1, 2**31, 2**63 - 1, 2**64 - 1]


def _records(data: bytes) -> list[tuple[int, str]]:
    return sorted((m.start(), kind) for sig, kind in _SIGNATURES.items()
                  for m in re.finditer(re.escape(sig), data))


@st.composite
def _crafted_field(draw, data: bytearray) -> None:
    """Overwrite one field of one zip record with an odd or random value."""
    records = _records(bytes(data))
    if not records:
        return
    at, kind = draw(st.sampled_from(records))
    offset, size = draw(st.sampled_from(_FIELDS[kind]))
    value = draw(st.one_of(st.sampled_from(_ODD_FIELD_VALUES), st.integers(0, 2**(8 * size) - 1)))
    if at + offset + size <= len(data):
        data[at + offset:at + offset + size] = (value % 2**(8 * size)).to_bytes(size, "little")


@st.composite
def _zip64_extra(draw, data: bytearray) -> None:
    """Give a central record a zip64 extra field (of any length), its sizes marked zip64."""
    central = [at for at, kind in _records(bytes(data)) if kind == "central"]
    if not central:
        return
    at = draw(st.sampled_from(central))
    if at + 46 > len(data):
        return
    name_len, extra_len = struct.unpack_from("<HH", data, at + 28)
    body = draw(st.one_of(st.binary(max_size=28),
                          st.lists(st.sampled_from([0, 1, 2**32, 2**63 - 1, 2**64 - 1]),
                                   max_size=3).map(lambda v: struct.pack(f"<{len(v)}Q", *v))))
    extra = struct.pack("<HH", 1, draw(st.sampled_from([len(body), len(body) + 8, 0, 0xFFFF])))
    extra += body
    where = at + 46 + name_len + extra_len
    data[where:where] = extra
    struct.pack_into("<H", data, at + 30, (extra_len + len(extra)) % 0x10000)
    for field in draw(st.lists(st.sampled_from([20, 24, 42]), max_size=3, unique=True)):
        struct.pack_into("<I", data, at + field, 0xFFFFFFFF)
    end = data.rfind(b"PK\x05\x06")
    if end > where:  # keep the directory's size honest, so zipfile reaches the extra
        size = struct.unpack_from("<I", data, end + 12)[0]
        struct.pack_into("<I", data, end + 12, (size + len(extra)) % 2**32)


def _damaged(source: bytes, max_steps: int = 4) -> st.SearchStrategy[bytes]:
    return damaged(source, steps=max_steps,
                   kinds=("flip", "byte", "cut", "insert", "drop", "field", "field", "zip64"),
                   custom={"field": _crafted_field, "zip64": _zip64_extra})


def _one_line_naming(exc: FsdpCkptError, name: str) -> None:
    message = str(exc)
    assert "\n" not in message and name in message, message


# -- the reader's entry points ------------------------------------------------------------

_PAD = b"\xa5" * 37  # the archive sits at an offset in its file, as in a rank file


def _file(archive: bytes) -> tuple[io.BytesIO, int, int]:
    return io.BytesIO(_PAD + archive + _PAD), len(_PAD), len(archive)


@_FUZZ
@given(data=st.sampled_from(_ARCHIVES).flatmap(_damaged))
def test_damaged_chunk_archive_locate_tensor_raises_only_fsdpckpt_errors(data):
    file, start, length = _file(data)
    try:
        raw = locate_tensor(file, start, length, source="chunk X")
    except FsdpCkptError as exc:
        _one_line_naming(exc, "chunk X")
        return
    # What it returns stays inside the archive's own bytes.
    assert start <= raw.storage_start <= raw.storage_start + raw.storage_nbytes <= start + length


@_FUZZ
@given(data=st.sampled_from(_ARCHIVES).flatmap(_damaged))
def test_damaged_chunk_archive_data_entry_crc_raises_only_fsdpckpt_errors(data):
    file, start, length = _file(data)
    try:
        data_entry_crc(file, start, length, source="chunk X")
    except FsdpCkptError as exc:
        _one_line_naming(exc, "chunk X")


@_FUZZ
@given(data=st.sampled_from(_ARCHIVES + [_BIN]).flatmap(_damaged))
def test_damaged_archive_read_archive_pickle_raises_only_fsdpckpt_errors(data):
    file, start, length = _file(data)
    try:
        read_archive_pickle(file, start, length, source="entry X", allowed=BUILTIN_GLOBALS,
                            persistent=lambda pid: pid)
    except FsdpCkptError as exc:
        _one_line_naming(exc, "entry X")


@_FUZZ
@given(data=st.sampled_from([_BIN] + _ARCHIVES).flatmap(_damaged))
def test_damaged_bin_read_archive_with_tensors_raises_only_fsdpckpt_errors(data):
    file, start, length = _file(data)
    try:
        read_archive_with_tensors(file, start, length, source="entry X", allowed=BUILTIN_GLOBALS,
                                  make_tensor=lambda *args: args)
    except FsdpCkptError as exc:
        _one_line_naming(exc, "entry X")


@_FUZZ
@given(data=st.binary(max_size=96))
def test_arbitrary_short_bytes_raise_only_fsdpckpt_errors(data):
    for call in (lambda f, s, n: locate_tensor(f, s, n, source="chunk X"),
                 lambda f, s, n: data_entry_crc(f, s, n, source="chunk X")):
        try:
            call(*_file(data))
        except FsdpCkptError as exc:
            _one_line_naming(exc, "chunk X")


@pytest.mark.parametrize("start, length", [(2**62, 100), (0, 2**62), (2**64, 2**64),
                                           (5, 0), (10**30, 1)])
def test_a_chunk_range_past_the_file_or_beyond_any_seek_is_one_error(start, length):
    with pytest.raises(FsdpCkptError, match="chunk X"):
        locate_tensor(io.BytesIO(_ARCHIVES[0]), start, length, source="chunk X")


# -- end to end on a damaged copy of a fixture --------------------------------------------

_E2E_FOLDER = DCP_FOLDERS["fsdp2-model"]
_E2E_FILE = "__0_0.distcp"


@pytest.fixture(scope="module")
def scratch():
    path = Path(tempfile.mkdtemp(prefix="fsdpckpt-fuzz-archive-"))
    yield path
    shutil.rmtree(path)


def _damaged_copy(scratch: Path, data: bytes) -> Path:
    folder = scratch / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(_E2E_FOLDER, folder)
    (folder / _E2E_FILE).write_bytes(data)
    return folder


@_FUZZ_E2E
@given(data=_damaged((_E2E_FOLDER / _E2E_FILE).read_bytes(), max_steps=2))
def test_damaged_rank_file_verify_and_merge_fail_as_one_error_or_succeed_exactly(scratch, data):
    from safetensors.torch import load_file

    from conftest import reference_state_dict
    from deep_compare import flatten, same_tensor

    folder = _damaged_copy(scratch, data)
    try:
        report = verify_checkpoint(folder)
    except FsdpCkptError as exc:
        _one_line_naming(exc, str(folder))
        report = None
    out = scratch / "out"
    shutil.rmtree(out, ignore_errors=True)
    try:
        merge(folder, out)
    except FsdpCkptError as exc:
        assert "\n" not in str(exc), str(exc)
        return
    if report is not None and report["ok"]:
        # verify said every byte is what was written: the merge must be exact.
        merged = load_file(out / "model.safetensors")
        expected = {".".join(map(str, k[1:])): v
                    for k, v in flatten(reference_state_dict(_E2E_FOLDER)).items()}
        assert merged.keys() == expected.keys()
        assert all(same_tensor(merged[k], expected[k]) for k in merged)



@_FUZZ_E2E
@given(data=_damaged((_E2E_FOLDER / _E2E_FILE).read_bytes(), max_steps=2))
def test_damaged_rank_file_cli_prints_one_error_line_never_unexpected(scratch, data):
    folder = _damaged_copy(scratch, data)
    runner = CliRunner()
    for args in (["verify", str(folder)], ["merge", str(folder), str(scratch / "cli-out"),
                                           "--overwrite", "--quiet"]):
        result = runner.invoke(main, args)
        assert result.exit_code in (0, 1), result.output
        errors = [line for line in result.stderr.splitlines() if line.startswith("fsdpckpt:")]
        # The CLI's boundary of last resort says "error: unexpected <type>"; a message may
        # quote a decoder's own words ("unexpected end of data") and be a fine one.
        assert "error: unexpected " not in result.stderr, result.stderr
        if result.exit_code:
            assert len(errors) == 1, result.stderr
