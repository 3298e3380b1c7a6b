"""DCP folders written with ``FileSystemWriter(_extensions=[ZStandard()])``: every entry is a
zstd stream. inspect, verify, merge and load_full_state_dict read them, bit-exact to torch's
own reader, decoding in bounded blocks; damage, bombs and a missing zstandard are one error."""

from __future__ import annotations

import builtins
import pickle
import shutil
from pathlib import Path

import pytest

from fsdpckpt import _torch, inspect_checkpoint, load_full_state_dict, merge, verify_checkpoint
from fsdpckpt.dcp import _zstd
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError

from conftest import (
    FIXTURES,
    assert_one_line_error,
    reference_state_dict,
    run_cli,
    single_process,
)
from deep_compare import assert_same_state

#: What compares with torch's own reading of compressed entries needs a torch that decodes
#: them (its DCP ``_extension``; torch 2.6 has none): docs/torch-versions.md.
needs_torch_zstd = pytest.mark.skipif(not _torch.reads_transforms(),
                                      reason="this torch's DCP cannot decode zstd entries")


ZSTD = FIXTURES / "dcp_zstd"


def _save_compressed(folder: Path, state: dict) -> Path:
    """``dcp.save`` of ``state`` (one process) with torch's ZStandard extension."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    dcp.save(state, storage_writer=FileSystemWriter(str(folder), _extensions=[ZStandard()]),
             **single_process())
    return folder


def _rewrite_metadata(folder: Path, change) -> None:
    """Edit ``.metadata`` as anyone can: the test's own pickle, written by torch."""
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    change(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def test_the_fixture_is_compressed_in_every_entry():
    folder = read_dcp_folder(ZSTD)
    assert {c.transforms for t in folder.metadata.tensors for c in t.chunks} == \
        {("stream.zstd/1",)}
    assert {o.transforms for o in folder.metadata.objects} == {("stream.zstd/1",)}


def test_inspect_reads_a_compressed_folder():
    report = inspect_checkpoint(ZSTD)
    assert report.problems == ()


@needs_torch_zstd
def test_load_full_state_dict_equals_torchs_reader_byte_for_byte():
    assert_same_state(load_full_state_dict(ZSTD), reference_state_dict(ZSTD))


@needs_torch_zstd
def test_merge_equals_torchs_reader_byte_for_byte(tmp_path):
    from safetensors.torch import load_file

    merge(ZSTD, tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = reference_state_dict(ZSTD)
    for name, tensor in got.items():
        top, _, rest = name.partition(".")
        expected = want[top][rest] if top in ("model", "extra") else None
        if expected is not None:
            assert_same_state({name: tensor}, {name: expected})
    assert {n for n in got if n.startswith("model.")} == {f"model.{k}" for k in want["model"]}


def test_verify_passes_a_compressed_folder():
    report = verify_checkpoint(ZSTD)
    assert report.ok, report.problems


@needs_torch_zstd
def test_large_and_transposed_chunks_decode_in_blocks(tmp_path):
    """Chunks far larger than the kept ends are decoded again in blocks; a transposed one is
    read tile by tile, out of order, and still comes out exact, cast included."""
    import torch

    big = torch.arange(400_000, dtype=torch.float32).reshape(800, 500) * 0.5
    state = {"big": big, "t": torch.randn(300, 700, generator=torch.Generator().manual_seed(3)).t()}
    folder = _save_compressed(tmp_path / "ck", state)
    assert_same_state(load_full_state_dict(folder), {"big": big, "t": state["t"].contiguous()})
    merge(folder, tmp_path / "out", dtype="bfloat16")
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert_same_state(got, {"big": big.to(torch.bfloat16),
                            "t": state["t"].contiguous().to(torch.bfloat16)})


def test_a_damaged_compressed_chunk_is_one_verify_problem(tmp_path):
    folder = Path(shutil.copytree(ZSTD, tmp_path / "z"))
    chunk = read_dcp_folder(folder).metadata.tensors[0].chunks[0]
    data = bytearray((folder / chunk.file).read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0xFF
    (folder / chunk.file).write_bytes(bytes(data))
    report = verify_checkpoint(folder)
    assert not report.ok
    assert len(report.problems) == 1, report.problems
    assert "chunk at" in report.problems[0].message


def test_a_damaged_compressed_chunk_fails_the_load_with_one_error(tmp_path):
    folder = Path(shutil.copytree(ZSTD, tmp_path / "z"))
    chunk = read_dcp_folder(folder).metadata.tensors[0].chunks[0]
    data = bytearray((folder / chunk.file).read_bytes())
    data[chunk.offset + 4:chunk.offset + 40] = bytes(36)  # the frame's first block header
    (folder / chunk.file).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="zstd stream|archive"):
        load_full_state_dict(folder)


@needs_torch_zstd
def test_a_decompression_bomb_stops_at_the_declared_size(tmp_path):
    """A chunk of 4 floats whose stream decodes to 64 MiB of zeros: refused once decoding
    passes the chunk's 16 bytes plus an archive's overhead, never decoded in full."""
    import torch
    import zstandard

    folder = _save_compressed(tmp_path / "ck", {"w": torch.ones(4)})
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))
    name = read_dcp_folder(folder).metadata.tensors[0].chunks[0].file
    (folder / name).write_bytes(bomb)

    def point_at_bomb(meta):
        for info in meta.storage_data.values():
            info.offset, info.length = 0, len(bomb)

    _rewrite_metadata(folder, point_at_bomb)
    reads = []
    real = _zstd.ZstdEntry._read_block

    def counting(self, count):
        reads.append(count)
        return real(self, count)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_zstd.ZstdEntry, "_read_block", counting)
        with pytest.raises(CorruptCheckpointError, match="decompression bomb"):
            load_full_state_dict(folder)
    assert sum(reads) <= 2 * _zstd.ARCHIVE_SLACK + (1 << 20)


@pytest.mark.parametrize("value, fragment", [
    (["stream.xz/1"], "stream.xz/1"),
    (["stream.zstd/2"], "stream.zstd/2"),
    (["stream.zstd/1", "stream.zstd/1"], "stream.zstd/1"),
    (7, "not a list of strings"),
    ([b"stream.zstd/1"], "not a list of strings"),
])
def test_unknown_or_hostile_transforms_are_one_error_naming_them(tmp_path, value, fragment):
    folder = Path(shutil.copytree(ZSTD, tmp_path / "z"))

    def change(meta):
        next(iter(meta.storage_data.values())).transform_descriptors = value

    _rewrite_metadata(folder, change)
    with pytest.raises(NotACheckpointError, match="transform") as info:
        read_dcp_folder(folder)
    assert fragment in str(info.value)


@pytest.fixture
def no_zstandard(monkeypatch):
    """``import zstandard`` fails, as where the extra is not installed."""
    real_import = builtins.__import__

    def no_zstandard(name, *args, **kwargs):
        if name == "zstandard":
            raise ImportError("No module named 'zstandard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zstandard)
    return no_zstandard


def test_a_missing_zstandard_is_one_line_naming_the_extra(tmp_path, no_zstandard):
    result = run_cli("merge", ZSTD, tmp_path / "out")
    assert_one_line_error(result, "pip install 'fsdpckpt[zstd]'")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_verify_without_zstandard_names_the_extra(no_zstandard):
    report = verify_checkpoint(ZSTD)
    assert not report.ok
    assert all("pip install 'fsdpckpt[zstd]'" in p.message for p in report.problems)


@needs_torch_zstd
def test_torch_still_writes_zstd_as_fsdpckpt_reads_it():
    """The descriptor and field this reader relies on (torch 2.13's ZStandard extension):
    a change here needs fsdpckpt/dcp/_zstd.py updated."""
    import dataclasses

    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    assert ZStandard().get_descriptor() == "stream.zstd/1"
    assert "transform_descriptors" in {f.name for f in dataclasses.fields(_StorageInfo)}


@needs_torch_zstd
def test_the_training_load_path_reads_a_compressed_folder():
    """load_state's storage reader (metadata from fsdpckpt's parse) keeps each entry's
    transforms, so torch's reader decodes the chunks it loads."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fsdpckpt.training._dcp_io import safe_load_planner, safe_storage_reader

    want = reference_state_dict(ZSTD)

    def blank(value):
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        return {k: blank(v) for k, v in value.items()} if isinstance(value, dict) else value

    state = blank(want)
    dcp.load(state, storage_reader=safe_storage_reader(ZSTD), planner=safe_load_planner())
    assert_same_state(state, want)


def test_a_torch_that_cannot_decode_zstd_is_refused_in_one_line_naming_the_way_out(
        monkeypatch):
    from fsdpckpt.errors import NotACheckpointError
    from fsdpckpt.training._dcp_io import safe_storage_reader

    monkeypatch.setattr(_torch, "reads_transforms", lambda: False)
    with pytest.raises(NotACheckpointError, match=r"compressed.*cannot decode.*merge it with "
                       r"fsdpckpt"):
        safe_storage_reader(ZSTD)
