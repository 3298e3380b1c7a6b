"""A column-major chunk held whole and cast: cast in storage order a group of stored columns
at a time, each group cast here or on the transpose thread and transposed there while the next
is read (issue 21). Bit for bit as ``.to()`` of the contiguous tensor torch loads, wherever
each group is cast and transposed, checked as read, and nothing left running on an error."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt import ChecksumError
from fsdpckpt._io import background
from fsdpckpt.dcp._archive import RawTensor
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.merging import _casts, _transpose_cast
from fsdpckpt.merging import _copy as engine

from chunked import flip_stored_byte, place_stored, split, write_dcp
from conftest import run_fresh

# NaN payloads of both signs, infinities, subnormals, ties, overflow to infinity (fp16).
_SPECIAL = [0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001,
            0x80000001, 0x3F808000, 0x3F818000, 0x477FF000, 0x477FEFFF, 0x33000001, 0x80000000]


def _values(dtype: torch.dtype, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor(_SPECIAL, dtype=torch.int64).to(torch.int32).view(torch.float32)
    value = torch.cat([special, torch.randn(rows * cols - len(special), generator=g) * 1e3])
    return value.view(rows, cols).to(dtype)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _place(tmp_path, value: torch.Tensor, shape, offsets, out: torch.dtype) -> bytes:
    """Place ``value``, stored column-major after a few other elements, at ``offsets`` of a
    zero tensor of ``shape`` cast to ``out``."""
    rows, cols = value.shape
    path = tmp_path / f"chunk-{threading.get_ident()}-{id(value)}"
    pad = 3
    storage = torch.cat([torch.zeros(pad, dtype=value.dtype), value.t().reshape(-1)])
    path.write_bytes(_bytes(storage))
    raw = RawTensor(0, storage.numel() * value.element_size(), DTYPES[str(value.dtype)[6:]],
                    pad, (rows, cols), (1, rows))
    assert _transpose_cast.in_groups(raw, DTYPES[str(out)[6:]])
    return bytes(place_stored(path, raw, offsets, shape, out))


@pytest.fixture(params=["default", "here", "beside", "ring-2", "blocked"])
def groups(request, monkeypatch):
    """Small groups (a few columns each, the last one short), each cast: by the default rule,
    all here, all on the transpose thread, with two groups in flight, or all here while
    the transpose thread is held up by other work (every group then taken back from it)."""
    monkeypatch.setattr(_transpose_cast, "_GROUP", 4 * 37 * 8)
    if request.param == "here":
        monkeypatch.setattr(_transpose_cast, "_QUEUE", 0)
    elif request.param == "beside":
        monkeypatch.setattr(_transpose_cast, "_QUEUE", 10**9)
    elif request.param == "ring-2":
        monkeypatch.setattr(_transpose_cast, "_RING", 2)
    elif request.param == "blocked":
        release = threading.Event()
        background.submit("transpose", release.wait, 30)
        threads = []
        original = _transpose_cast.transpose_tile

        def here_only(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return original(*args, **kwargs)

        monkeypatch.setattr(_transpose_cast, "transpose_tile", here_only)
        yield request.param
        release.set()
        background.drain("transpose")
        assert threads and set(threads) == {threading.main_thread().name}
        return
    yield request.param


@pytest.mark.parametrize(("source", "out"), [(torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float16),
                                             (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float32),
                                             (torch.float16, torch.bfloat16),
                                             (torch.float32, torch.float64)], ids=str)
@pytest.mark.parametrize("where", ["whole", "rows", "columns"])
def test_a_chunk_cast_in_groups_is_torch_to_of_the_contiguous_tensor(tmp_path, groups, source,
                                                                      out, where):
    value = _values(source, 37, 29, seed=1)
    shape, offsets = {"whole": ((37, 29), (0, 0)), "rows": ((50, 29), (13, 0)),
                      "columns": ((40, 41), (2, 7))}[where]
    want = torch.zeros(shape, dtype=out)
    want[offsets[0]:offsets[0] + 37, offsets[1]:offsets[1] + 29] = value.to(out)
    assert _place(tmp_path, value, shape, offsets, out) == _bytes(want)


def test_a_merge_cast_in_groups_is_bit_exact_and_never_imports_torch_without_nan(tmp_path):
    """The whole CLI's path: fp32 to bf16 and fp16 in groups, torch-free (numpy casts it)."""
    tensors = {"a": torch.randn(1030, 70), "b": torch.randn(2048, 24), "c": torch.randn(7, 3)}
    folder = write_dcp(tmp_path / "ckpt", {k: (v, split([0], transpose=True))
                                           for k, v in tensors.items()})
    code = ("import sys; from fsdpckpt.merging import _transpose_cast as t; "
            "t._GROUP = 64 * 1024; import fsdpckpt\n"
            f"for d in ('bf16', 'fp16'): fsdpckpt.merge({str(folder)!r}, "
            f"{str(tmp_path)!r} + '/' + d, dtype=d)\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    run_fresh(code)
    for name, kind in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        got = load_file(tmp_path / name / "model.safetensors")
        for key, value in tensors.items():
            assert _bytes(got[key]) == _bytes(value.to(kind)), (name, key)


def test_groups_are_taken_only_where_they_help():
    def raw(dtype: str, rows: int, cols: int = 8) -> RawTensor:
        size = DTYPES[dtype].itemsize
        return RawTensor(0, rows * cols * size, DTYPES[dtype], 0, (rows, cols), (1, rows))

    assert _transpose_cast.in_groups(raw("float32", 2048), DTYPES["bfloat16"])
    assert not _transpose_cast.in_groups(raw("float32", 2048), DTYPES["float32"])  # no cast
    tall = _transpose_cast._GROUP // 4 + 1  # one stored column over a group
    assert not _transpose_cast.in_groups(raw("float32", tall), DTYPES["bfloat16"])
    assert not _transpose_cast.in_groups(raw("bfloat16", tall), DTYPES["float32"])  # made: wider


def test_groups_need_numpy(monkeypatch):
    monkeypatch.setattr(_casts, "_numpy", lambda: None)
    raw = RawTensor(0, 64 * 8 * 4, DTYPES["float32"], 0, (64, 8), (1, 64))
    assert not _transpose_cast.in_groups(raw, DTYPES["bfloat16"])


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_damaged_byte_cast_in_groups_is_refused_before_anything_is_published(
        tmp_path, monkeypatch, groups, where):
    monkeypatch.setattr(_transpose_cast, "_GROUP", 4096)
    folder = write_dcp(tmp_path / "ckpt", {"w": (torch.randn(130, 70), split([0], transpose=True))})
    flip_stored_byte(folder, where=where)
    checked_whole = []
    original = engine._checked.verify_entry_once
    monkeypatch.setattr(engine._checked, "verify_entry_once",
                        lambda *a, **k: (checked_whole.append(a), original(*a, **k))[1])
    with pytest.raises(ChecksumError, match="does not match the CRC-32"):
        fsdpckpt.merge(folder, tmp_path / "out", dtype="bf16")
    assert not checked_whole  # checked as read, in storage order: not in a pass of its own
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fails", ["cast", "transpose"])
def test_a_group_that_fails_on_the_transpose_thread_fails_the_merge(tmp_path, monkeypatch,
                                                                    fails):
    """The error reaches the merge, which publishes nothing, and no cast or transpose is left
    running into a buffer the next chunk takes."""
    monkeypatch.setattr(_transpose_cast, "_GROUP", 4096)
    monkeypatch.setattr(_transpose_cast, "_QUEUE", 10**9)  # every cast on that thread
    running = threading.Event()
    calls = []
    target = _casts if fails == "cast" else _transpose_cast
    name = "cast_block" if fails == "cast" else "transpose_tile"
    original = getattr(target, name)

    def fails_third(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise MemoryError(f"the third {fails}")
        running.set()
        try:
            return original(*args, **kwargs)
        finally:
            running.clear()

    monkeypatch.setattr(target, name, fails_third)
    folder = write_dcp(tmp_path / "ckpt", {"w": (torch.randn(200, 90),
                                                 split([0], transpose=True))})
    with pytest.raises(MemoryError, match=f"the third {fails}"):
        fsdpckpt.merge(folder, tmp_path / "out", dtype="fp16")
    assert not running.is_set()
    assert not (tmp_path / "out").exists()
    assert "fsdpckpt-transpose_0" in calls


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16])
def test_a_group_holding_nan_is_cast_by_torch_on_this_thread_only(tmp_path, monkeypatch, out):
    """torch's first import gives back only the kept buffers of the thread it runs on: a
    group the transpose thread cannot cast without torch is left to this one."""
    monkeypatch.setattr(_transpose_cast, "_GROUP", 4 * 37 * 8)
    monkeypatch.setattr(_transpose_cast, "_QUEUE", 10**9)  # every cast offered to that thread
    threads = []
    original = _casts.import_torch

    def recording():
        threads.append(threading.current_thread().name)
        return original()

    monkeypatch.setattr(_casts, "import_torch", recording)
    value = _values(torch.float32, 37, 29, seed=3)  # NaN payloads in its first column
    assert _place(tmp_path, value, (37, 29), (0, 0), out) == _bytes(value.to(out))
    assert threads and set(threads) == {threading.main_thread().name}
