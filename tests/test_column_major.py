"""Large column-major chunks (a transposed view ``torch.save`` kept with its strides): their
tiles are transposed without torch (numpy, or torch without numpy), bit for bit for every
element width, and their storage is checked beside the tiles, before anything is published
(issue 21)."""

from __future__ import annotations

import os
import sys
import threading
import zlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt import ChecksumError
from fsdpckpt._io import batched
from fsdpckpt.dcp import _checked
from fsdpckpt.dcp._archive import RawTensor, locate_tensor
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.merging import _blocks, _casts, _transpose
from fsdpckpt.merging import _copy as engine

from chunked import flip_stored_byte, place_stored, split, write_dcp

# One dtype of every element width, the float ones with NaN payloads among their values.
WIDTHS = [torch.uint8, torch.bool, torch.float8_e4m3fn, torch.int16, torch.bfloat16,
          torch.float32, torch.int32, torch.float64, torch.complex64, torch.complex128]
_UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _values(dtype: torch.dtype, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (every bit pattern, NaN payloads included); bools 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (shape[0] * shape[1] * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(params=["numpy", "numpy-narrow", "torch"])
def transposer(request, monkeypatch):
    """Every way of transposing a tile: numpy's blocks, twice as wide as tall where a core's
    first-level cache holds them, square where it is smaller or unknown; or torch where
    numpy is missing."""
    if request.param == "torch":
        monkeypatch.setattr(_casts, "_numpy", lambda: None)
    monkeypatch.setattr(_blocks, "_l1_data_bytes", lambda: 0 if request.param ==
                        "numpy-narrow" else _blocks._WIDE_BLOCK_L1)
    monkeypatch.setattr(_blocks, "_BLOCK", 3)  # blocks that do not divide the tiles
    return request.param


@pytest.fixture(params=["tiles", "tiles-wide", "tiles-unbatched", "whole"])
def column_path(request, monkeypatch):
    """Every way of placing a column-major chunk: square tiles read out of storage order (a
    chunk too large to hold whole), or tiles six times as wide (where torch is not in the
    process) read in groups of stored columns, their reads and writes batched (Linux AIO,
    the reads beside) or one call each (where AIO is missing); or held whole and read in
    storage order, here in bands of a few rows (several bands, the last one short)."""
    if request.param.startswith("tiles"):
        monkeypatch.setattr(_transpose, "WHOLE", 0)
        if request.param == "tiles-wide":  # as where torch is not in the process
            monkeypatch.setattr(_transpose, "_wide_tiles", lambda raw, out: True)
            # Stored columns read in groups of a few (1 to 5, by width): the last one short.
            monkeypatch.setattr(_transpose, "_GROUP", 40)
        if request.param == "tiles-unbatched":
            monkeypatch.setattr(batched, "available", lambda: False)
    else:
        monkeypatch.setattr(_transpose, "_BAND", 64)
        monkeypatch.setattr(_transpose, "_BAND_ROWS", 5)
    return request.param


@pytest.mark.parametrize("dtype", WIDTHS, ids=str)
@pytest.mark.parametrize("shape", [(7, 5), (1, 9), (9, 1), (1, 1), (16, 16)])
def test_a_tile_is_transposed_bit_for_bit(transposer, dtype, shape):
    height, width = shape
    value = _values(dtype, (width, height))  # the stored columns, one per row here
    size = value.element_size()
    pitch = height + 2  # columns apart by more than their length, as in a padded buffer
    stored = bytearray(width * pitch * size)
    for k in range(width):
        stored[k * pitch * size:(k * pitch + height) * size] = _bytes(value[k])
    target = bytearray(width * height * size)
    _blocks.transpose_tile(memoryview(stored), pitch, width, height,
                              DTYPES[str(dtype)[6:]], memoryview(target))
    assert bytes(target) == _bytes(value.t())


def _fake_cpu(root, cpu: int, l1_data: str) -> None:
    for index, (level, kind, size) in enumerate([("1", "Instruction", "64K"),
                                                  ("1", "Data", l1_data), ("2", "Unified", "2M")]):
        folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
        folder.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(text + "\n")


def test_the_first_level_data_cache_is_read_from_sysfs(tmp_path):
    _fake_cpu(tmp_path, 0, "48K")
    (tmp_path / "cpufreq").mkdir()  # not a core
    assert _blocks._l1_data_bytes.__wrapped__(str(tmp_path)) == 48 * 2**10


def test_the_smallest_cores_cache_decides(tmp_path):
    _fake_cpu(tmp_path, 0, "48K")
    _fake_cpu(tmp_path, 1, "32768")  # an efficiency core, in bytes
    assert _blocks._l1_data_bytes.__wrapped__(str(tmp_path)) == 32 * 2**10


@pytest.mark.parametrize("odd", ["lots", ""])
def test_a_cache_size_that_cannot_be_read_is_not_known(tmp_path, odd):
    _fake_cpu(tmp_path, 0, "48K")
    _fake_cpu(tmp_path, 1, odd)
    assert _blocks._l1_data_bytes.__wrapped__(str(tmp_path)) == 0
    assert _blocks._l1_data_bytes.__wrapped__(str(tmp_path / "missing")) == 0


def test_columns_a_multiple_of_4_kib_apart_are_padded_by_a_cache_line():
    assert _blocks.column_pitch(2048, 4) == 2048 + 16
    assert _blocks.column_pitch(4096, 1) == 4096 + 64
    assert _blocks.column_pitch(1024, 16) == 1024 + 4
    assert _blocks.column_pitch(2896, 2) == 2896  # not a multiple of 4 KiB: as it is


def _place(tmp_path, value: torch.Tensor, shape, offsets, out: torch.dtype) -> bytes:
    """Place ``value``, stored column-major, at ``offsets`` of a zero tensor of ``shape``."""
    rows, cols = value.shape
    path = tmp_path / f"chunk-{os.getpid()}-{threading.get_ident()}-{id(value)}"
    pad = 3  # elements before the chunk in its storage
    storage = torch.cat([torch.zeros(pad, dtype=value.dtype), value.t().reshape(-1)])
    path.write_bytes(_bytes(storage))
    raw = RawTensor(0, storage.numel() * value.element_size(), DTYPES[str(value.dtype)[6:]],
                    pad, (rows, cols), (1, rows))
    assert engine.column_major_past_a_span(raw)
    return bytes(place_stored(path, raw, offsets, shape, out))


@pytest.mark.parametrize("dtype", WIDTHS, ids=str)
@pytest.mark.parametrize("where", ["whole", "rows", "columns", "short"])
def test_a_column_major_chunk_lands_bit_for_bit(tmp_path, monkeypatch, transposer, column_path,
                                                dtype, where):
    # Tiles of 8 x 8 over 37 x 29 elements: partial tiles on both edges; a chunk of 7 rows
    # (short) is read in whole stored columns, one preadv for many.
    size = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setattr(engine, "_SPAN", 64)
    monkeypatch.setattr(engine, "_TILE", 64 * max(size, 1))
    height = 7 if where == "short" else 37
    value = _values(dtype, (height, 29), seed=1)
    shape, offsets = {"whole": ((37, 29), (0, 0)), "rows": ((50, 29), (13, 0)),
                      "columns": ((40, 41), (2, 7)), "short": ((9, 31), (1, 2))}[where]
    want = torch.zeros(shape, dtype=dtype)
    want[offsets[0]:offsets[0] + height, offsets[1]:offsets[1] + 29] = value
    assert _place(tmp_path, value, shape, offsets, dtype) == _bytes(want)


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float64])
def test_a_column_major_chunk_cast_is_torch_to_of_the_contiguous_tensor(tmp_path, monkeypatch,
                                                                         transposer, column_path,
                                                                         out):
    # NaN payloads of both signs, infinities, subnormals, ties: cast as .to() casts the
    # contiguous tensor torch loads.
    monkeypatch.setattr(engine, "_SPAN", 64)
    monkeypatch.setattr(engine, "_TILE", 64 * 8)
    bits = torch.tensor([0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0x00000001,
                         0x3F808000, 0x3F818000, 0x477FF000, 0x80000000], dtype=torch.int64)
    value = torch.cat([bits.to(torch.int32).view(torch.float32),
                       torch.randn(23 * 19 - len(bits)) * 1e4]).view(23, 19)
    assert _place(tmp_path, value, (23, 19), (0, 0), out) == _bytes(value.to(out))


@pytest.mark.parametrize("whole", [_transpose.WHOLE, 0], ids=["held-whole", "tiles"])
def test_a_numpy_transpose_never_imports_torch(tmp_path, whole):
    """The whole merge of a large column-major tensor, torch-free where numpy is installed
    (``import torch`` costs more than merging 1.6 GB), either way it is placed."""
    value = torch.randn(300, 200)
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split([], transpose=True))})
    code = ("import sys; from fsdpckpt.merging import _copy, _transpose; _copy._SPAN = 4096; "
            f"_copy._TILE = 4096; _transpose.WHOLE = {whole}; "
            "import fsdpckpt; "
            f"fsdpckpt.merge({str(folder)!r}, {str(tmp_path / 'out')!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root,
                   env=dict(os.environ, PYTHONPATH=root))
    (got,) = load_file(tmp_path / "out" / "model.safetensors").values()
    assert torch.equal(got, value)


def _damage(folder, where: float) -> None:
    meta = read_dcp_folder(folder).metadata
    chunk = meta.tensors[0].chunks[0]
    path = folder / chunk.file
    with path.open("rb") as file:
        raw = locate_tensor(file, chunk.offset, chunk.length, source=str(path))
    assert raw.stride == (1, raw.shape[0])  # column-major, as stored
    flip_stored_byte(folder, where=where)


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_damaged_byte_in_a_column_major_chunk_is_refused_before_anything_is_published(
        tmp_path, monkeypatch, column_path, where):
    monkeypatch.setattr(engine, "_SPAN", 4096)
    monkeypatch.setattr(engine, "_TILE", 32 * 32 * 4)
    folder = write_dcp(tmp_path / "ckpt", {"w": (torch.randn(130, 70), split([0], transpose=True))})
    _damage(folder, where)
    beside = []
    original = _checked.verify_entry_beside
    monkeypatch.setattr(_checked, "verify_entry_beside",
                        lambda *a, **k: (beside.append(a[1]), original(*a, **k))[1])
    with pytest.raises(ChecksumError, match="does not match the CRC-32"):
        fsdpckpt.merge(folder, tmp_path / "out")
    # Tiles: checked beside them, not before; held whole: checked as read, in storage order.
    assert bool(beside) == column_path.startswith("tiles")
    assert not (tmp_path / "out").exists()


def test_the_check_beside_the_tiles_passes_once_per_entry_and_lets_the_reader_error_win(
        tmp_path):
    data = os.urandom(3 * 2**20 + 5)
    path = tmp_path / "entry"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        done: set = set()
        with _checked.verify_entry_beside(done, "k", fd, 0, len(data), zlib.crc32(data),
                                          source="entry"):
            pass
        assert done == {"k"}
        with _checked.verify_entry_beside(done, "k", fd, 0, len(data), 0, source="entry"):
            pass  # already checked: not read again
        with pytest.raises(ChecksumError), _checked.verify_entry_beside(
                set(), "k", fd, 0, len(data), zlib.crc32(data) ^ 1, source="entry"):
            pass
        with pytest.raises(KeyError), _checked.verify_entry_beside(
                set(), "k", fd, 0, len(data), zlib.crc32(data) ^ 1, source="entry"):
            raise KeyError("the reader's own error")
    finally:
        os.close(fd)


def test_a_merge_of_a_large_column_major_folder_is_bit_exact(tmp_path, monkeypatch,
                                                             column_path):
    monkeypatch.setattr(engine, "_SPAN", 4096)
    monkeypatch.setattr(engine, "_TILE", 32 * 32 * 4)
    tensors = {"a": torch.randn(130, 70), "b": torch.randn(1, 300), "c": torch.randn(300, 1),
               "d": _values(torch.float32, (65, 97), seed=2),  # NaN payloads included
               "e": torch.randn(40, 300)}  # chunks of 20 rows: whole stored columns per tile
    folder = write_dcp(tmp_path / "ckpt", {k: (v, split([0], transpose=True))
                                           for k, v in tensors.items()})
    (result,) = fsdpckpt.merge(folder, tmp_path / "out")
    got = load_file(result.path)
    for name, value in tensors.items():
        assert np.array_equal(got[f"{name}"].view(torch.int32).numpy(),
                              value.view(torch.int32).numpy()), name


def test_scattered_reads_fill_each_view_in_order_whatever_iov_max(tmp_path, monkeypatch):
    from fsdpckpt._io.rawio import pread_scattered

    monkeypatch.setattr(os, "IOV_MAX", 3, raising=False)
    data = os.urandom(1000)
    path = tmp_path / "data"
    path.write_bytes(data)
    buffer = bytearray(2000)
    views = [memoryview(buffer)[at:at + n] for at, n in [(0, 7), (100, 0), (200, 93), (400, 1),
                                                          (500, 300), (900, 99)]]
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_scattered(fd, views, 500, source="data")
        assert b"".join(bytes(v) for v in views) == data[500:]
        with pytest.raises(fsdpckpt.CorruptCheckpointError):
            pread_scattered(fd, [memoryview(bytearray(10))], 995, source="data")
    finally:
        os.close(fd)


@pytest.mark.parametrize("rows", [1024, 33], ids=["padded-columns", "contiguous"])
@pytest.mark.parametrize("out", [None, "bfloat16"])
def test_a_column_major_chunk_held_whole_is_read_once_and_checked_as_read(
        tmp_path, monkeypatch, rows, out):
    """Read in storage order, its CRC-32 computed on the way: no second pass over its bytes
    (1024 float32 rows: 4 KiB columns, read into a buffer a cache line apart each)."""
    monkeypatch.setattr(_transpose, "_BAND", 4096)  # several bands
    value = _values(torch.float32, (2 * rows, 40), seed=4).nan_to_num()
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split([0], transpose=True))})
    passes = []
    original = _checked.crc32_range
    monkeypatch.setattr(_checked, "crc32_range",
                        lambda src, at, count, *a, **k: (passes.append(count),
                                                         original(src, at, count, *a, **k))[1])
    (result,) = fsdpckpt.merge(folder, tmp_path / "out", dtype=out)
    assert sum(passes) == 0, passes  # every byte summed as read: nothing read again
    got = load_file(result.path)["w"]
    want = value if out is None else value.to(torch.bfloat16)
    assert _bytes(got) == _bytes(want)


def test_a_damaged_byte_in_padded_columns_held_whole_is_refused(tmp_path):
    value = torch.randn(2048, 24)  # chunks of 1024 rows: 4 KiB columns, read scattered
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split([0], transpose=True))})
    _damage(folder, 0.7)
    with pytest.raises(ChecksumError, match="does not match the CRC-32"):
        fsdpckpt.merge(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ["whole", "tiles"])
def test_a_transpose_that_fails_on_its_thread_fails_the_merge(tmp_path, monkeypatch, path):
    """The transpose thread's error reaches the merge, which publishes nothing; no transpose
    is left running into a buffer the next chunk takes."""
    if path == "tiles":
        monkeypatch.setattr(_transpose, "WHOLE", 0)
        monkeypatch.setattr(engine, "_SPAN", 4096)
        monkeypatch.setattr(engine, "_TILE", 32 * 32 * 4)
    else:
        monkeypatch.setattr(_transpose, "_BAND", 1024)
    calls = []
    original = _transpose.transpose_tile

    def fails_third(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise MemoryError("the third transpose")
        return original(*args, **kwargs)

    monkeypatch.setattr(_transpose, "transpose_tile", fails_third)
    folder = write_dcp(tmp_path / "ckpt", {"w": (torch.randn(200, 90),
                                                 split([0], transpose=True))})
    with pytest.raises(MemoryError, match="the third transpose"):
        fsdpckpt.merge(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert all(name.startswith("fsdpckpt-transpose") for name in calls)  # beside this thread


def _column_major_raw(dtype: str, rows: int = 8192, cols: int = 8192) -> RawTensor:
    return RawTensor(0, rows * cols * DTYPES[dtype].itemsize, DTYPES[dtype], 0, (rows, cols),
                     (1, rows))


def test_chunks_held_whole_stay_smaller_where_placing_them_may_import_torch(monkeypatch):
    """A cast (torch casts what numpy does not, and pieces holding NaN) or a transpose numpy
    cannot do may import torch (220 MB) after the chunk was read."""
    monkeypatch.delitem(sys.modules, "torch")  # as in the CLI, which never imported it
    assert not _transpose.fits_whole(_column_major_raw("float16", 4096, 4096),
                                     DTYPES["bfloat16"])  # 64 MiB: held whole without a cast
    assert _transpose.fits_whole(_column_major_raw("float16", 4096, 4096), DTYPES["float16"])
    assert _transpose.fits_whole(_column_major_raw("float32", 2048, 4096), DTYPES["bfloat16"])
    monkeypatch.setattr(_casts, "_numpy", lambda: None)
    assert not _transpose.fits_whole(_column_major_raw("float16", 4096, 4096),
                                     DTYPES["float16"])


def test_tiles_are_wider_only_where_torch_is_not_in_the_process(monkeypatch):
    """Twice as wide, a large chunk's tiles hold twice the bytes: not beside torch's 220 MB,
    nor where placing the chunk may import it (a cast)."""
    raw = _column_major_raw("float32", 8192, 8192)
    assert not _transpose._wide_tiles(raw, DTYPES["float32"])  # this process holds torch
    monkeypatch.delitem(sys.modules, "torch")  # as in the CLI, which never imported it
    assert _transpose._wide_tiles(raw, DTYPES["float32"])
    assert not _transpose._wide_tiles(raw, DTYPES["bfloat16"])
    monkeypatch.setattr(_casts, "_numpy", lambda: None)
    assert not _transpose._wide_tiles(raw, DTYPES["float32"])


def test_a_failed_write_leaves_no_transpose_running(tmp_path, monkeypatch):
    """The write of one tile fails while the next is transposed: the merge waits for that
    transpose before it raises, so none fills a buffer the caller hands out again."""
    import errno
    import time

    monkeypatch.setattr(_transpose, "WHOLE", 0)
    monkeypatch.setattr(engine, "_SPAN", 4096)
    monkeypatch.setattr(engine, "_TILE", 32 * 32 * 4)
    running, ran = threading.Event(), threading.Event()
    original = _transpose.transpose_tile

    def slow_transpose(*args, **kwargs):
        running.set()
        ran.set()
        time.sleep(0.2)
        original(*args, **kwargs)
        running.clear()

    monkeypatch.setattr(_transpose, "transpose_tile", slow_transpose)
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine.FileSink, "write", full)
    monkeypatch.setattr(engine.FileSink, "write_pieces", full)
    folder = write_dcp(tmp_path / "ckpt", {"w": (torch.randn(200, 90),
                                                 split([0], transpose=True))})
    with pytest.raises(OSError, match="No space left"):
        fsdpckpt.merge(folder, tmp_path / "out")
    assert ran.is_set() and not running.is_set()
    assert not (tmp_path / "out").exists()


def test_the_first_torch_import_gives_kept_buffers_back(tmp_path):
    import subprocess

    code = ("import sys\n"
            "from fsdpckpt._io import rawio\n"
            "from fsdpckpt.merging import _casts\n"
            "with rawio.reusing_scratch():\n"
            "    held = rawio.scratch(4 * 2**20, 'made')\n"
            "    assert rawio.scratch(4 * 2**20, 'made').obj is held.obj  # kept\n"
            "    assert 'torch' not in sys.modules\n"
            "    _casts.import_torch()\n"
            "    assert rawio.scratch(4 * 2**20, 'made').obj is not held.obj  # a new one\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root,
                   env=dict(os.environ, PYTHONPATH=root))


def test_rows_that_follow_each_other_in_the_output_are_one_write():
    assert [list(x) for x in _transpose._row_pieces([0, 5, 10], 5, 0, 4, 100)] == \
        [[0], [60], [100]]
    starts, lengths, offsets = _transpose._row_pieces([0, 5, 20], 5, 0, 4, 100)
    assert list(starts) == [0, 40] and list(lengths) == [40, 20]
    assert list(offsets) == [100, 180]
    starts, lengths, offsets = _transpose._row_pieces([0, 8, 16], 4, 2, 4, 0)  # a part
    assert list(offsets) == [8, 40, 72] and list(lengths) == [16] * 3


def test_row_pieces_are_the_same_without_numpy(monkeypatch):
    cases = [([0, 5, 10], 5, 0), ([0, 5, 20, 25, 40], 5, 1), ([0, 8, 16], 4, 2), ([7], 3, 0)]
    with_numpy = [[list(x) for x in _transpose._row_pieces(lines, width, first, 4, 100)]
                  for lines, width, first in cases]
    monkeypatch.setattr(_casts, "_numpy", lambda: None)
    assert with_numpy == [[list(x) for x in _transpose._row_pieces(lines, width, first, 4, 100)]
                          for lines, width, first in cases]
