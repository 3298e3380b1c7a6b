"""The output goes to disk while it is written (``fsdpckpt._io.durable.Writeback``): runs of
adjacent bytes are handed to the kernel's writeback a step at a time, on the writeback
thread, and only bytes already written whole and final: a region with holes is never handed
over before they are filled (its writeback would split the file's reserved extents). Every
call is done before the file is closed. What is handed over is observed by recording the
calls, never by timing (issue 21).
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt._io import background, durable
from fsdpckpt._io.durable import Writeback
from fsdpckpt.merging import _copy as engine
from fsdpckpt.merging import _transpose

from chunked import split, whole, write_dcp


@pytest.fixture
def handed(monkeypatch):
    """Every ``(fd, start, count)`` given to ``start_writeback``, in order, the real call
    made after it."""
    calls: list[tuple[int, int, int]] = []
    real = durable.start_writeback

    def record(fd, start, count):
        calls.append((fd, start, count))
        real(fd, start, count)

    monkeypatch.setattr(durable, "start_writeback", record)
    return calls


def _ranges(calls) -> list[tuple[int, int]]:
    return [(start, start + count) for _, start, count in calls]


P = mmap.PAGESIZE


@pytest.fixture
def fd(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    yield fd
    os.close(fd)


def test_adjacent_writes_are_handed_over_a_step_at_a_time(fd, handed):
    with Writeback(fd, step=2 * P) as writeback:
        for page in range(5):
            writeback.wrote(page * P, (page + 1) * P)
    assert _ranges(handed) == [(0, 2 * P), (2 * P, 4 * P)]  # the last page: with the file's end


def test_a_run_is_handed_over_up_to_a_page_boundary(fd, handed):
    # The page a run ends in is not whole yet: it waits for the next step.
    with Writeback(fd, step=2 * P) as writeback:
        writeback.wrote(0, 2 * P + 100)
        writeback.wrote(2 * P + 100, 4 * P + 50)
    assert _ranges(handed) == [(0, 2 * P), (2 * P, 4 * P)]


def test_scattered_writes_are_never_handed_over_on_their_own(fd, handed):
    # Half rows of a dim-1 chunk, a tile's rows: pieces apart, however many bytes in all.
    with Writeback(fd, step=P) as writeback:
        for row in range(50):
            writeback.wrote(row * 2 * P, row * 2 * P + P - 8)
    assert handed == []


def test_a_new_run_starts_over(fd, handed):
    with Writeback(fd, step=2 * P) as writeback:
        writeback.wrote(0, P + 90)
        writeback.wrote(10 * P, 11 * P)  # not after the first: its bytes are not counted
        writeback.wrote(11 * P, 12 * P)
    assert _ranges(handed) == [(10 * P, 12 * P)]


def test_bytes_reported_twice_do_not_restart_the_run(fd, handed):
    # A tile written in one piece is reported by the write, then again as its row of tiles.
    with Writeback(fd, step=2 * P) as writeback:
        for page in range(4):
            writeback.wrote(page * P, (page + 1) * P)
            writeback.wrote(page * P, (page + 1) * P)
    assert _ranges(handed) == [(0, 2 * P), (2 * P, 4 * P)]


def test_nothing_is_handed_over_for_no_bytes(fd, handed):
    # fadvise would take a count of 0 for "to the end of the file": holes and all.
    with Writeback(fd) as writeback:
        writeback.hand_over(P, 0)
    assert handed == []


def test_the_calls_run_on_the_writeback_thread_and_end_before_the_block_does(fd, monkeypatch):
    threads, finished = [], []

    def slow(fd, start, count):
        time.sleep(0.05)
        os.fstat(fd)  # the descriptor is still open
        threads.append(threading.current_thread().name)
        finished.append(start)

    monkeypatch.setattr(durable, "start_writeback", slow)
    with Writeback(fd, step=P) as writeback:
        for page in range(4):
            writeback.wrote(page * P, (page + 1) * P)
        writeback.hand_over(0, 4 * P)
    assert finished == [0, P, 2 * P, 3 * P, 0]
    assert threads and all("writeback" in name for name in threads)


def test_ctrl_c_while_waiting_still_waits_for_every_call(fd, monkeypatch):
    # The descriptor is closed (its number free for the next open) once the block ends:
    # no call may still be queued for it then. The interrupt is raised after.
    finished = []

    def slow(fd, start, count):
        time.sleep(0.1)
        finished.append(start)

    real_drain, interrupts = background.drain, [KeyboardInterrupt()]

    def interrupted_drain(name):
        if interrupts:
            raise interrupts.pop()
        real_drain(name)

    monkeypatch.setattr(durable, "start_writeback", slow)
    monkeypatch.setattr(background, "drain", interrupted_drain)
    with pytest.raises(KeyboardInterrupt), Writeback(fd, step=P) as writeback:
        for page in range(3):
            writeback.wrote(page * P, (page + 1) * P)
    assert finished == [0, P, 2 * P]


def test_a_failed_call_is_left_to_the_fsync(fd, monkeypatch):
    # fadvise refused (it is a hint): the file's own fsync reports what matters.
    def refuse(fd, start, count):
        raise OSError(5, "refused")

    monkeypatch.setattr(durable, "start_writeback", refuse)
    with Writeback(fd, step=P) as writeback:
        writeback.wrote(0, P)


def _values(shape, seed):
    # No zero byte: a byte not yet written (zero in the reserved file) shows.
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) + 1.0) * torch.where(
        torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)


LAYOUTS = {
    "dim0": split([0], 3),
    "dim1": split([1], 2),
    "grid": split([0, 1], 2),
    "whole": whole,
    "column-major": split([0], 2, transpose=True),
    "column-major dim1": split([1], 2, transpose=True),
    "permuted": lambda t: [((0, 0, 0), t.permute(1, 0, 2).contiguous().permute(1, 0, 2))],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [None, "bf16"])
@pytest.mark.parametrize("tiles", ["held-whole", "tiles", "tiles-wide"])
def test_what_is_handed_over_was_written_whole_and_final(tmp_path, monkeypatch, layout,
                                                         dtype, tiles):
    # Each range is read back when it is handed over: it must already hold what the
    # finished file holds there (no hole, nothing written again after).
    if tiles == "tiles-wide":  # as where torch is not in the process
        monkeypatch.setattr(_transpose, "_wide_tiles", lambda raw, out: True)
    if tiles != "held-whole":  # column-major chunks in tiles, other strided ones in boxes
        monkeypatch.setattr(_transpose, "WHOLE", 0)
        monkeypatch.setattr(_transpose, "_WHOLE_WITH_TORCH", 0)
        monkeypatch.setattr(engine, "_SPAN", 1024)
        monkeypatch.setattr(engine, "_TILE", 16 * 16 * 4)
    monkeypatch.setattr(durable, "WRITEBACK_STEP", 512)
    shape = (24, 16, 8) if layout == "permuted" else (96, 80)
    value = _values(shape, seed=3)
    src = write_dcp(tmp_path / "ckpt", {"w": (value, LAYOUTS[layout]),
                                        "b": (_values((40,), seed=4), whole)})
    seen: list[tuple[int, int, bytes]] = []
    real = Writeback.hand_over

    def read_back(self, start, count):
        seen.append((start, count, os.pread(self.fd, count, start)))
        real(self, start, count)

    monkeypatch.setattr(Writeback, "hand_over", read_back)
    fsdpckpt.merge(src, tmp_path / "out", dtype=dtype)
    files = list((tmp_path / "out").glob("*.safetensors"))
    final = files[0].read_bytes()
    for start, count, data in seen:
        assert data == final[start:start + count], (start, count)
    tensor = load_file(files[0])["w"]
    assert torch.equal(tensor, value.to(tensor.dtype))
    assert sum(count for _, count, _ in seen) >= value.numel() * tensor.element_size()


@pytest.mark.parametrize("layout", ["dim0", "whole", "column-major", "column-major narrow"])
def test_a_large_tensor_written_in_order_goes_to_disk_before_it_ends(tmp_path, monkeypatch,
                                                                     handed, layout):
    # Rows written whole and in order (a dim-0 chunk, rows of column-major tiles, tiles as
    # wide as the chunk: each one piece) are handed over a step at a time, not once the
    # tensor is done.
    monkeypatch.setattr(_transpose, "WHOLE", 0)
    monkeypatch.setattr(_transpose, "_WHOLE_WITH_TORCH", 0)
    monkeypatch.setattr(engine, "_SPAN", 1024)
    monkeypatch.setattr(engine, "_TILE", 16 * 16 * 4)
    monkeypatch.setattr(engine, "_LOCAL_BLOCK", 1024)
    monkeypatch.setattr(durable, "WRITEBACK_STEP", 4096)
    value = _values((400, 12) if "narrow" in layout else (96, 80), seed=5)
    src = write_dcp(tmp_path / "ckpt", {"w": (value, LAYOUTS[layout.replace(" narrow", "")])})
    fsdpckpt.merge(src, tmp_path / "out")
    tensor_bytes = value.numel() * 4
    steps = [count for _, _, count in handed if count < tensor_bytes]
    assert len(steps) >= 3 and all(count >= 4096 for count in steps)
    assert any(count == tensor_bytes for _, _, count in handed)  # and whole at its end


def test_a_dim1_tensor_is_handed_over_only_whole(tmp_path, monkeypatch, handed):
    # Each chunk writes half of every row: no run of its own is ever whole.
    monkeypatch.setattr(durable, "WRITEBACK_STEP", 256)
    value = _values((96, 80), seed=6)
    src = write_dcp(tmp_path / "ckpt", {"w": (value, split([1], 2))})
    monkeypatch.setattr("fsdpckpt.merging._rows.row_groups", lambda *a, **k: [])
    fsdpckpt.merge(src, tmp_path / "out")
    assert [count for _, _, count in handed] == [value.numel() * 4]


def test_convert_hands_over_what_it_wrote_whole_and_final(tmp_path, monkeypatch):
    # A state dict with objects between its tensors: each entry flushed before it is
    # reported, so no range handed over is still in Python's buffer.
    monkeypatch.setattr(durable, "WRITEBACK_STEP", 1)  # every entry handed over
    state = {f"layer{i}.weight": _values((40, 30), seed=i) for i in range(6)}
    state["step"] = 7
    state["config"] = {"lr": 0.1}
    state["last.weight"] = _values((5,), seed=9)
    torch.save(state, tmp_path / "full.pt")
    seen: list[tuple[int, int, bytes]] = []
    real = Writeback.hand_over

    def read_back(self, start, count):  # the file is open for writing only
        with open(os.readlink(f"/proc/self/fd/{self.fd}"), "rb") as file:
            file.seek(start)
            seen.append((start, count, file.read(count)))
        real(self, start, count)

    monkeypatch.setattr(Writeback, "hand_over", read_back)
    fsdpckpt.convert(tmp_path / "full.pt", tmp_path / "out")
    final = (tmp_path / "out" / "__0_0.distcp").read_bytes()
    assert len(seen) >= 3
    for start, count, data in seen:
        assert data == final[start:start + count], (start, count)
