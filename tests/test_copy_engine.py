"""The tile engine: any stored layout, any chunk, any dtype cast, exact and in bounded pieces."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.dcp.metadata import Chunk
from fsdpckpt.merging import _casts, _gather
from fsdpckpt.merging import _copy as engine
from fsdpckpt.merging._copy import MemorySink, place_chunk, tiles
from fsdpckpt.merging.plan import chunk_runs

from chunked import place_stored, split, write_dcp
from conftest import run_fresh


@st.composite
def _strided(draw):
    """A shape and the strides of some permutation of a contiguous layout (maybe expanded)."""
    shape = draw(st.lists(st.integers(1, 6), min_size=0, max_size=4))
    order = draw(st.permutations(range(len(shape))))
    stride = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        stride[dim] = step
        step *= shape[dim]
    if shape and draw(st.booleans()):  # a broadcast dim, as expand() saves it
        stride[draw(st.integers(0, len(shape) - 1))] = 0
    return tuple(shape), tuple(stride)


@given(_strided(), st.integers(1, 40), st.integers(1, 40))
def test_tiles_cover_every_element_once_within_both_limits(layout, span_max, numel_max):
    shape, stride = layout
    seen = []
    for offsets, sizes in tiles(shape, stride, span_max, numel_max):
        assert math.prod(sizes) <= numel_max
        assert 1 + sum((s - 1) * abs(t) for s, t in zip(sizes, stride)) <= span_max
        ranges = [range(o, o + s) for o, s in zip(offsets, sizes)]
        seen += [tuple(i) for i in _product(ranges)]
    assert sorted(seen) == sorted(_product([range(s) for s in shape]))


def _product(ranges):
    out = [()]
    for r in ranges:
        out = [p + (i,) for p in out for i in r]
    return out


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_place_chunk_matches_torch_for_any_layout_chunk_and_cast(tmp_path, monkeypatch, data):
    """A chunk stored with any strides lands exactly where torch puts it, cast as .to() casts:
    reordered by numpy, or by torch where numpy is missing."""
    if not data.draw(st.booleans()):
        monkeypatch.setattr(_casts, "_numpy", lambda: None)
    # Runs of any length gathered into boxes of whole rows (another dim order), or tiles.
    monkeypatch.setattr(_gather, "_MIN_RUN", data.draw(st.sampled_from([1, 4096])))
    monkeypatch.setattr(engine, "_SPAN", data.draw(st.integers(8, 64)))
    monkeypatch.setattr(engine, "_TILE", data.draw(st.integers(8, 64) | st.integers(200, 2000)))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    offsets = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.float64]))
    out = data.draw(st.sampled_from([dtype, torch.bfloat16, torch.float16]
                                    if dtype.is_floating_point else [dtype]))
    chunk_value = torch.randn(sizes, dtype=torch.float64).mul(100).to(dtype)
    order = data.draw(st.permutations(range(len(sizes))))
    stored = chunk_value.permute(*order).contiguous().permute(*_inverse(order))
    pad = data.draw(st.integers(0, 3))  # elements before the tensor in its storage
    storage = torch.cat([torch.zeros(pad, dtype=dtype), stored.permute(*order).reshape(-1)])
    path = tmp_path / f"chunk-{os.getpid()}-{id(data)}"
    path.write_bytes(storage.view(torch.uint8).numpy().tobytes() if storage.numel() else b"")
    raw = RawTensor(0, storage.numel() * storage.element_size(), DTYPES[str(dtype)[6:]], pad,
                    sizes, tuple(stored.stride()))
    full = torch.zeros(shape, dtype=out)
    memory = place_stored(path, raw, offsets, shape, out)
    got = torch.frombuffer(memory, dtype=out).view(shape) if memory else full
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
    full[index] = chunk_value.to(out)
    assert torch.equal(got.view(-1).view(torch.uint8), full.view(-1).view(torch.uint8))


def _inverse(order):
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return inverse


def _specials(dtype):
    """Every value class a cast can get wrong: ties, NaN payloads, infinities, subnormals."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                         0x7F800000, 0xFF800000, 0x00000001, 0x80000001, 0x00800000, 0x7F7FFFFF,
                         0x477FF000, 0x477FE000, 0x33800000, 0x33000001, 0x80000000, 0x0],
                        dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits.view(torch.float32), torch.randn(200) * 1e4]).to(dtype)
    return values.reshape(2, -1)


@pytest.mark.parametrize("source", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("target", ["bf16", "fp16", "fp32"])
def test_dtype_export_is_bit_identical_to_torch_to(tmp_path, source, target):
    value = _specials(source)
    folder = write_dcp(tmp_path / "ckpt", {"dim0": (value, split([0])),
                                          "dim1": (value, split([1])),
                                          "transposed": (value, split([1], transpose=True))})
    (result,) = fsdpckpt.merge(folder, tmp_path / "out", dtype=target)
    want = value.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[target])
    for name, got in load_file(result.path).items():
        assert got.dtype == want.dtype, name
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name


def _eager_runs(shape, chunk):
    """The enumeration chunk_runs used to build as a list: every run start, in row-major order."""
    stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return sorted(sum((o + i) * s for o, i, s in zip(chunk.offsets, index, stride))
                  for index in _product([range(n) for n in chunk.sizes]))


@given(st.data())
def test_run_starts_are_every_run_start_in_order(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    offsets = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    chunk = Chunk(offsets, sizes, "f", 0, 0)
    run, starts = chunk_runs(shape, chunk)
    elements = [s + i for s in starts for i in range(run)]
    assert elements == _eager_runs(shape, chunk)
    assert list(starts[::-1]) == list(starts)[::-1] and starts[-1] == list(starts)[-1]


def test_run_starts_of_a_long_thin_chunk_take_no_memory():
    import tracemalloc

    tracemalloc.start()
    run, starts = chunk_runs((10**8, 4), Chunk((0, 1), (10**8, 1), "f", 0, 0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (run, len(starts), starts[10**8 - 1]) == (1, 10**8, 4 * (10**8 - 1) + 1)
    assert peak < 2**20, peak  # a list of the starts was 10^8 ints: gigabytes


def test_a_large_column_major_chunk_is_written_in_square_tiles(tmp_path, monkeypatch):
    """A transposed chunk larger than a span is read and written in pieces as long as a
    tile's side, not as many short pieces as stored rows fit in a span (issue 21: a 2.4 GB
    one took 75 s); the bytes are torch's."""
    monkeypatch.setattr(engine, "_SPAN", 4096)
    monkeypatch.setattr(engine, "_TILE", 64 * 64 * 4)  # square tiles of 64 x 64 float32
    value = torch.randn(200, 300)
    stored = value.t().contiguous().t()  # column-major, as torch.save keeps a transposed view
    path = tmp_path / "chunk"
    path.write_bytes(stored.t().contiguous().view(torch.uint8).numpy().tobytes())
    raw = RawTensor(0, value.numel() * 4, DTYPES["float32"], 0, (200, 300), (1, 200))
    assert engine.column_major_past_a_span(raw)
    out = bytearray(value.numel() * 4)
    sink, writes = MemorySink(memoryview(out)), []
    original = sink.write
    sink.write = lambda data, at: (writes.append(len(data)), original(data, at))  # type: ignore
    fd = os.open(path, os.O_RDONLY)
    try:
        chunk = Chunk((0, 0), (200, 300), None, 0, 0)
        place_chunk(fd, raw, chunk, chunk_runs((200, 300), chunk), DTYPES["float32"], sink, 0,
                    source="chunk")
    finally:
        os.close(fd)
    assert torch.equal(torch.frombuffer(out, dtype=torch.float32).view(200, 300), value)
    # One write per output row of each tile: 4 tile rows x 5 tile columns x 64 rows at most.
    assert len(writes) <= 4 * 5 * 64 and min(writes) >= (300 - 4 * 64) * 4


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, torch.float16])
def test_a_permuted_chunk_cast_is_torch_to_of_the_contiguous_tensor(tmp_path, monkeypatch,
                                                                     numpy, target):
    """NaN payloads, infinities, subnormals and ties in a 3-D chunk stored permuted: the same
    bits as .to() of the contiguous tensor torch loads, however it is reordered."""
    if not numpy:
        monkeypatch.setattr(_casts, "_numpy", lambda: None)
    monkeypatch.setattr(engine, "_SPAN", 64 * 4)
    monkeypatch.setattr(engine, "_TILE", 48 * 4)
    value = torch.cat([_specials(torch.float32).reshape(-1)] * 3)[:6 * 7 * 9].view(6, 7, 9)
    stored = value.permute(1, 0, 2).contiguous().permute(1, 0, 2)  # strides (9, 54, 1)
    pad = 2
    storage = torch.cat([torch.zeros(pad), stored.permute(1, 0, 2).reshape(-1)])
    path = tmp_path / "chunk"
    path.write_bytes(storage.view(torch.uint8).numpy().tobytes())
    raw = RawTensor(0, storage.numel() * 4, DTYPES["float32"], pad, (6, 7, 9),
                    tuple(stored.stride()))
    got = place_stored(path, raw, (0, 0, 0), (6, 7, 9), target)
    assert bytes(got) == value.to(target).contiguous().view(torch.uint8).numpy().tobytes()


def test_a_merge_of_permuted_chunks_does_not_import_torch(tmp_path):
    """A 3-D tensor stored permuted (a view torch.save kept with its strides), merged as is
    and cast, by numpy: torch's import alone costs more than merging 1.6 GB."""
    value = torch.randn(40, 6, 50)

    def permuted_halves(tensor):  # each chunk a view of a (6, 20, 50) storage
        pieces = [((o, 0, 0), tensor[o:o + 20].permute(1, 0, 2).contiguous().permute(1, 0, 2))
                  for o in (0, 20)]
        assert all(piece.stride() == (50, 1000, 1) for _, piece in pieces)
        return pieces

    folder2 = write_dcp(tmp_path / "ckpt", {"w": (value, permuted_halves)})
    code = ("import sys, fsdpckpt\n"
            f"fsdpckpt.merge({str(folder2)!r}, {str(tmp_path / 'a')!r})\n"
            f"fsdpckpt.merge({str(folder2)!r}, {str(tmp_path / 'b')!r}, dtype='bf16')\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    run_fresh(code)
    assert torch.equal(load_file(tmp_path / "a" / "model.safetensors")["w"], value)
    assert torch.equal(load_file(tmp_path / "b" / "model.safetensors")["w"],
                       value.to(torch.bfloat16))


def test_a_damaged_byte_in_a_chunk_placed_in_boxes_is_refused_before_anything_is_published(
        tmp_path, monkeypatch):
    """Boxes read the storage out of order: it is checked whole beside them."""
    from fsdpckpt import ChecksumError
    from fsdpckpt.dcp import _checked

    from chunked import flip_stored_byte

    value = torch.randn(40, 6, 50)
    pieces = [((o, 0, 0), value[o:o + 20].permute(1, 0, 2).contiguous().permute(1, 0, 2))
              for o in (0, 20)]
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, lambda _: pieces)})
    flip_stored_byte(folder, where=0.6)
    beside = []
    original = _checked.verify_entry_beside
    monkeypatch.setattr(_checked, "verify_entry_beside",
                        lambda *a, **k: (beside.append(a[1]), original(*a, **k))[1])
    boxes = []
    original_read = engine.read_box
    monkeypatch.setattr(engine, "read_box",
                        lambda *a, **k: (boxes.append(1), original_read(*a, **k))[1])
    with pytest.raises(ChecksumError, match="does not match the CRC-32"):
        fsdpckpt.merge(folder, tmp_path / "out")
    assert beside and boxes
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("order", [(1, 0, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0), (0, 2, 1),
                                   (3, 1, 0, 2), (1, 3, 2, 0)], ids=str)
@pytest.mark.parametrize("budget", [40 * 8, 10**6], ids=["boxes-of-rows", "one-box"])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_a_chunk_in_another_dim_order_lands_bit_for_bit_in_boxes_of_rows(tmp_path, monkeypatch,
                                                                          order, budget, out):
    """Stored in the dim order ``order`` (outermost first), placed at an offset of a larger
    tensor: boxes of whole rows of dim 0 (the last one short), their stored runs gathered."""
    monkeypatch.setattr(_gather, "_MIN_RUN", 1)
    monkeypatch.setattr(engine, "_TILE", budget)
    sizes = (7, 3, 5, 2)[:len(order)]
    shape = tuple(s + 2 for s in sizes)
    offsets = (1,) * len(sizes)
    value = _specials(torch.float32).reshape(-1)[:math.prod(sizes)].reshape(sizes)
    stored = value.permute(*order).contiguous().permute(*_inverse(order))
    pad = 3
    storage = torch.cat([torch.zeros(pad), stored.permute(*order).reshape(-1)])
    path = tmp_path / "chunk"
    path.write_bytes(storage.view(torch.uint8).numpy().tobytes())
    raw = RawTensor(0, storage.numel() * 4, DTYPES["float32"], pad, sizes, tuple(stored.stride()))
    expect_boxes = order[0] != 0
    assert (_gather.box_rows(raw, DTYPES[str(out)[6:]], budget) > 0) == expect_boxes
    full = torch.zeros(shape, dtype=out)
    full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = value.to(out)
    got = place_stored(path, raw, offsets, shape, out)
    assert bytes(got) == full.view(-1).view(torch.uint8).numpy().tobytes()


def test_a_box_is_read_run_by_run_from_a_file_that_is_not_local():
    """From a remote file or a decoder (anything with ``read_at``), one read per run."""
    data = bytes(range(256)) * 4
    reads = []

    class Remote:
        def read_at(self, view, offset):
            reads.append((offset, len(view)))
            view[:] = data[offset:offset + len(view)]

    raw = RawTensor(16, 1024, DTYPES["float32"], 2, (4, 3, 5), (5, 20, 1))
    order = _gather.dense_order(raw.shape, raw.stride)
    run, firsts = _gather.box_runs(raw.shape, raw.stride, 1, 2, order)
    assert (run, list(firsts)) == (10, [5, 25, 45])  # rows 1-2 of each of 3 stored blocks
    buffer = bytearray(3 * run * 4)
    _gather.read_box(Remote(), raw, memoryview(buffer), run, firsts, source="remote")
    assert reads == [(16 + (2 + f) * 4, 40) for f in (5, 25, 45)]
    assert bytes(buffer) == b"".join(data[16 + (2 + f) * 4:16 + (2 + f) * 4 + 40]
                                     for f in (5, 25, 45))


def test_an_empty_chunk_stored_permuted_is_not_placed_in_boxes():
    raw = RawTensor(0, 0, DTYPES["float32"], 0, (2, 0, 3), (1, 2, 2))  # empty(3,0,2).permute
    assert _gather.box_rows(raw, DTYPES["float32"], 2**24) == 0
    assert not engine._in_boxes(raw, DTYPES["float32"])


def test_deciding_against_boxes_builds_no_list_of_runs():
    """Runs of one element (dim 0 innermost in storage): boxes do not pay, and finding that
    out costs no memory whatever the chunk (a list of its runs would be 64 MB here)."""
    import tracemalloc

    raw = RawTensor(0, 3 * 1024 * 4096 * 4, DTYPES["float32"], 0, (3, 1024, 4096),
                    (1, 12288, 3))
    tracemalloc.start()
    try:
        assert _gather.box_rows(raw, DTYPES["float32"], 16 * 2**20) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20
