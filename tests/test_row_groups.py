"""Row groups (issue 21): chunks that share a dim-0 range and together make whole output rows
(dim-1 splits, each row band of a 2-D grid, inner-dim splits of 3-D tensors) are written a
band of rows per gathered ``pwritev``, bit for bit as ``torch.cat`` of the chunks makes the
tensor, for every element width and cast, each chunk checked against its CRC-32 before
anything is published; anything else still goes chunk by chunk."""

from __future__ import annotations

import errno
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from test_column_major import WIDTHS, _bytes, _values
from test_exact_io import _short_gathered

import fsdpckpt
from fsdpckpt import ChecksumError
from fsdpckpt._io.rawio import pwrite_gathered
from fsdpckpt.dcp._datafiles import DataFiles
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.dcp.metadata import Chunk
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.merging import _rows
from fsdpckpt.merging._runs import chunk_runs

from chunked import Layout, flip_stored_byte, split, write_dcp


def _chunks(shape, boxes) -> list[Chunk]:
    return [Chunk(tuple(o), tuple(s), "f", 0, 0) for o, s in boxes]


def _groups(shape, boxes, row_max=2**20):
    chunks = _chunks(shape, boxes)
    return _rows.row_groups(shape, chunks, [chunk_runs(shape, c) for c in chunks],
                            row_max=row_max)


def test_groups_are_found_from_offsets_and_sizes_alone():
    (dim1,) = _groups((4, 10), [((0, 0), (4, 4)), ((0, 4), (4, 6))])
    assert (dim1.members, dim1.first, dim1.rows) == ((0, 1), 0, 4)
    assert dim1.pieces == ((0, 0, 4), (1, 0, 6))
    grid = _groups((5, 6), [((0, 0), (3, 3)), ((0, 3), (3, 3)), ((3, 0), (2, 3)),
                            ((3, 3), (2, 3))])
    assert [(g.members, g.first, g.rows) for g in grid] == [((0, 1), 0, 3), ((2, 3), 3, 2)]
    # Listed out of order: the pieces come in the row's order.
    (back,) = _groups((2, 6), [((0, 3), (2, 3)), ((0, 0), (2, 3))])
    assert back.pieces == ((1, 0, 3), (0, 0, 3))
    # A 3-D tensor split on its last dim: each chunk is one piece per index of dim 1.
    (inner,) = _groups((2, 3, 4), [((0, 0, 0), (2, 3, 1)), ((0, 0, 1), (2, 3, 3))])
    assert inner.pieces == ((0, 0, 1), (1, 0, 3), (0, 1, 1), (1, 3, 3), (0, 2, 1), (1, 6, 3))


@pytest.mark.parametrize("shape, boxes", [
    ((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))]),  # dim-0 shards: already whole rows
    ((8,), [((0,), (4,)), ((4,), (4,))]),  # 1-D
    ((4, 10), [((0, 0), (4, 4)), ((0, 5), (4, 5))]),  # a gap
    ((4, 10), [((0, 0), (4, 6)), ((0, 4), (4, 6))]),  # an overlap
    ((4, 10), [((0, 0), (4, 5)), ((0, 5), (2, 5)), ((2, 5), (2, 5))]),  # bands differ
    ((4, 10), [((0, 0), (4, 5))]),  # a lone chunk
    ((4, 0), [((0, 0), (4, 0)), ((0, 0), (4, 0))]),  # no element
])
def test_chunks_that_do_not_tile_whole_rows_of_one_band_make_no_group(shape, boxes):
    assert _groups(shape, boxes) == []


def test_rows_longer_than_a_turn_make_no_group():
    assert _groups((4, 10), [((0, 0), (4, 5)), ((0, 5), (4, 5))], row_max=9) == []
    assert _groups((4, 10), [((0, 0), (4, 5)), ((0, 5), (4, 5))], row_max=10)


def _cat(tensor: torch.Tensor, layout: Layout, dims: list[int]) -> torch.Tensor:
    """The tensor as torch.cat makes it from the layout's chunks, innermost dim first."""
    pieces = dict(layout(tensor))
    for dim in reversed(dims):
        merged: dict[tuple, list] = {}
        for offsets, piece in sorted(pieces.items()):
            key = offsets[:dim] + (0,) + offsets[dim + 1:]
            merged.setdefault(key, []).append(piece)
        pieces = {k: torch.cat(v, dim) for k, v in merged.items()}
    (whole,) = pieces.values()
    return whole


def _place(folder, out_dtype: str | None = None) -> dict[str, bytes]:
    """Every tensor of the DCP folder placed by place_tensor into a file, as bytes."""
    meta = read_dcp_folder(folder).metadata
    got = {}
    with DataFiles(folder) as files:
        for tensor in meta.tensors:
            out = DTYPES[out_dtype] if out_dtype else tensor.dtype
            path = folder.parent / f"out-{tensor.name}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                nbytes = tensor.numel * out.itemsize
                os.ftruncate(fd, nbytes)
                written = []
                _rows.place_tensor(files, tensor, [chunk_runs(tensor.shape, c)
                                                   for c in tensor.chunks],
                                   out, fd, 0, progress=written.append)
                assert sum(written) == nbytes
            finally:
                os.close(fd)
            got[tensor.name.split(".", 1)[1]] = path.read_bytes()
    return got


@pytest.fixture
def spy(monkeypatch):
    """What went chunk by chunk, and which groups went a band of rows at a time."""
    seen: dict[str, list] = {"chunks": [], "groups": []}
    by_chunk, by_rows = _rows.place_stored_chunk, _rows.place_row_group

    def chunk(files, tensor, chunk, *a, **k):
        seen["chunks"].append((tensor.name, chunk.offsets))
        return by_chunk(files, tensor, chunk, *a, **k)

    def rows(files, tensor, group, *a, **k):
        done = by_rows(files, tensor, group, *a, **k)
        if done:
            seen["groups"].append((tensor.name, group.members))
        return done

    monkeypatch.setattr(_rows, "place_stored_chunk", chunk)
    monkeypatch.setattr(_rows, "place_row_group", rows)
    return seen


#: (shape, the dims split, parts): dim-1 splits of 2, 3 (uneven) and 8 chunks, 2-D grids,
#: 3-D tensors split on an inner dim or two.
LAYOUTS = [((6, 10), [1], 2), ((5, 11), [1], 3), ((4, 16), [1], 8), ((7, 9), [0, 1], 2),
           ((5, 9), [0, 1], 3), ((3, 4, 5), [1], 2), ((3, 4, 5), [2], 2),
           ((4, 3, 6), [1, 2], 2), ((4, 6, 5), [0, 2], 3)]


@pytest.mark.parametrize("dtype", WIDTHS, ids=str)
def test_every_layout_and_width_lands_as_torch_cat_makes_it(tmp_path, monkeypatch, spy, dtype):
    # Turns of 2 to 6 rows: many turns, both buffers, a short last turn.
    size = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setattr(_rows, "GROUP_BLOCK", 60 * size)
    tensors, want, bands = {}, {}, 0
    for i, (shape, dims, parts) in enumerate(LAYOUTS):
        value = _values(dtype, (shape[0], math.prod(shape[1:])), seed=i).view(shape)
        layout = split(dims, parts)
        tensors[f"t{i}"] = (value, layout)
        want[f"t{i}"] = _bytes(_cat(value, layout, dims))
        bands += len({offsets[0] for offsets, _ in layout(value)})
    folder = write_dcp(tmp_path / "ckpt", tensors)
    assert _place(folder) == want
    assert not spy["chunks"]  # every chunk went in a group, one per band of rows
    assert len(spy["groups"]) == bands


@pytest.mark.parametrize("source, target", [("float32", "bfloat16"), ("float32", "float16"),
                                            ("bfloat16", "float32"), ("float64", "bfloat16")])
def test_a_cast_is_torch_to_of_the_whole_tensor_nan_payloads_included(tmp_path, monkeypatch,
                                                                     spy, source, target):
    monkeypatch.setattr(_rows, "GROUP_BLOCK", 3 * 12 * 8)
    monkeypatch.setattr(_rows, "GROUP_CAST_BLOCK", 3 * 12 * 8)
    special = {"float32": [0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0x00000001,
                           0x3F808000, 0x3F818000, 0x477FF000, 0x80000000]}
    value = _values(getattr(torch, source), (9, 12), seed=3)
    if source in special:  # NaN payloads of both signs, infinities, subnormals, ties
        value.view(-1)[:9] = torch.tensor(special[source], dtype=torch.int64).to(
            torch.int32).view(torch.float32)
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split([1], 3)),
                                           "g": (value.clone(), split([0, 1], 2))})
    got = _place(folder, target)
    for name in ("w", "g"):
        assert got[name] == _bytes(value.to(getattr(torch, target))), name
    # A cast only torch makes goes chunk by chunk; the fast ones go in groups.
    assert bool(spy["chunks"]) == (source == "float64")


def test_rows_of_more_pieces_than_iov_max_are_written_in_several_calls(tmp_path, monkeypatch,
                                                                      spy):
    value = torch.randn(3, 700, 2)  # split on dim 2: 1,400 one-element pieces a row
    wide = torch.randn(4, 16)
    folder = write_dcp(tmp_path / "ckpt", {"deep": (value, split([2])),
                                           "wide": (wide, split([1], 8))})
    got = _place(folder)
    assert got["deep"] == _bytes(value)
    monkeypatch.setattr(os, "IOV_MAX", 3, raising=False)  # 8 pieces a row, 3 per call
    assert _place(folder)["wide"] == _bytes(wide)
    assert not spy["chunks"]


def test_other_chunks_go_chunk_by_chunk_and_land_the_same(tmp_path, spy):
    value = torch.randn(8, 10)

    def uneven(tensor):  # bands that differ on the right: no group there
        return [((0, 0), tensor[:, :5].clone()), ((0, 5), tensor[:4, 5:].clone()),
                ((4, 5), tensor[4:, 5:].clone())]

    folder = write_dcp(tmp_path / "ckpt", {
        "transposed": (value, split([1], transpose=True)), "uneven": (value, uneven),
        "rows": (value, split([0])), "flat": (torch.arange(10.0), split([0]))})
    got = _place(folder)
    for name in ("transposed", "uneven", "rows"):
        assert got[name] == _bytes(value), name
    assert got["flat"] == _bytes(torch.arange(10.0))
    assert not spy["groups"]
    assert len(spy["chunks"]) == 2 + 3 + 2 + 2


def test_buffers_stay_within_the_turn_however_large_the_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(_rows, "GROUP_BLOCK", 4096)
    monkeypatch.setattr(_rows, "GROUP_CAST_BLOCK", 4096)
    sizes = []
    original = _rows.scratch
    monkeypatch.setattr(_rows, "scratch", lambda n, slot=None: (sizes.append(n),
                                                                original(n, slot))[1])
    value = torch.randn(2048, 64)  # 512 KiB in two dim-1 chunks, 4 KiB a turn
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split([1]))})
    assert _place(folder, "bfloat16")["w"] == _bytes(value.to(torch.bfloat16))
    assert sizes and max(sizes) <= 2 * 4096 and sum(sizes) <= 3 * 4096


@pytest.mark.parametrize("member", [0, 1, 2])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_damaged_byte_in_any_chunk_is_refused_with_nothing_published(tmp_path, monkeypatch,
                                                                       spy, member, where):
    monkeypatch.setattr(_rows, "GROUP_BLOCK", 3 * 30 * 4)
    folder = write_dcp(tmp_path / "ckpt", {"a": (torch.randn(20, 30), split([0])),
                                           "w": (torch.randn(40, 30), split([1], 3))})
    flip_stored_byte(folder, 1, member, where=where)  # tensor "w", after "a"
    with pytest.raises(ChecksumError, match="does not match the CRC-32") as caught:
        fsdpckpt.merge(folder, tmp_path / "out")
    assert "tensor 'model.w' chunk at" in str(caught.value)
    assert not (tmp_path / "out").exists()
    assert not [c for c in spy["chunks"] if c[0].endswith("w")]  # refused by the group path


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_a_merge_of_dim1_and_grid_folders_is_bit_exact(tmp_path, spy, dtype):
    tensors = {f"l{i}": torch.randn(64, 96) for i in range(3)}
    tensors["nan"] = _values(torch.float32, (33, 40), seed=5)
    for name, layout in [("dim1", split([1])), ("grid", split([0, 1]))]:
        folder = write_dcp(tmp_path / name, {k: (v, layout) for k, v in tensors.items()})
        (result,) = fsdpckpt.merge(folder, tmp_path / f"{name}-out", dtype=dtype)
        got = load_file(result.path)
        for key, value in tensors.items():
            want = value.to(torch.bfloat16) if dtype else value
            assert _bytes(got[key]) == _bytes(want), (name, key)
    assert not spy["chunks"]


def test_gathered_writes_finish_after_short_writes_and_iov_max(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "IOV_MAX", 3, raising=False)
    calls = []
    five = _short_gathered(os.pwritev, 5)  # at most 5 bytes a call, as a signal might

    def short(fd, views, offset):
        calls.append(len(views))
        return five(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", short)
    data = os.urandom(64)
    cuts = [0, 7, 7, 8, 20, 21, 40, 64]  # one empty view among them
    views = [memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])]
    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, 70)
        pwrite_gathered(fd, views, 3)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0" * 3 + data + b"\0" * 3
    assert max(calls) <= 3

    monkeypatch.setattr(os, "pwritev", lambda fd, views, offset: 0)
    with pytest.raises(OSError) as caught:
        pwrite_gathered(-1, views, 0)
    assert caught.value.errno == errno.EIO
