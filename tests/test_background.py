"""The named background threads and ``alternate``: read here, work on another core, write
here while the next turn is read and worked on (issue 21: a cast beside the I/O)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import fsdpckpt
from fsdpckpt._io import background
from fsdpckpt.merging import _casts

from chunked import split, write_dcp


def _recording(events: list[tuple[str, int, str]], slow: float = 0.0):
    def step(kind: str):
        def call(turn: int) -> None:
            if kind == "work" and slow:
                time.sleep(slow)
            events.append((kind, turn, threading.current_thread().name))
        return call
    return step("read"), step("work"), step("write")


def test_alternate_reads_works_and_writes_every_turn_in_order():
    events: list[tuple[str, int, str]] = []
    background.alternate(5, *_recording(events), name="test-work")
    for kind in ("read", "work", "write"):
        assert [turn for k, turn, _ in events if k == kind] == list(range(5))
    here = threading.current_thread().name
    assert {name for kind, _, name in events if kind != "work"} == {here}
    assert all(name.startswith("fsdpckpt-test-work") for kind, _, name in events
               if kind == "work")
    for turn in range(5):  # a turn is written after its work, and two at most are in flight
        order = [(k, t) for k, t, _ in events]
        assert order.index(("work", turn)) < order.index(("write", turn))
        if turn >= 2:
            assert order.index(("write", turn - 2)) < order.index(("read", turn))


def test_alternate_works_on_one_turn_while_the_next_is_read():
    events: list[tuple[str, int, str]] = []
    background.alternate(3, *_recording(events, slow=0.05), name="test-work")
    order = [(k, t) for k, t, _ in events]
    assert order.index(("read", 1)) < order.index(("work", 0))  # read while turn 0 worked


@pytest.mark.parametrize("failing", ["work", "write", "read"])
def test_alternate_raises_the_first_error_and_leaves_no_work_running(failing):
    running = threading.Event()
    writes: list[int] = []

    def read(turn: int) -> None:
        if failing == "read" and turn == 2:
            raise OSError("read failed")

    def work(turn: int) -> None:
        running.set()
        time.sleep(0.05)
        if failing == "work" and turn == 1:
            raise MemoryError("work failed")
        running.clear()

    def write(turn: int) -> None:
        if failing == "write" and turn == 1:
            raise OSError("write failed")
        writes.append(turn)

    with pytest.raises((OSError, MemoryError), match=f"{failing} failed"):
        background.alternate(4, read, work, write, name="test-work")
    assert not running.is_set() or failing == "work"  # nothing still working on a buffer
    assert 1 not in writes  # the failed turn (or the one after a failed read) never written


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", [[0], [1]], ids=["dim0", "dim1"])
def test_a_cast_merge_casts_on_the_cast_thread_bit_for_bit(tmp_path, monkeypatch, dtype, layout):
    threads: set[str] = set()
    original = _casts.cast_block

    def recording(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(_casts, "cast_block", recording)
    from fsdpckpt.merging import _copy, _rows

    monkeypatch.setattr(_copy, "cast_block", recording)
    monkeypatch.setattr(_rows, "cast_block", recording)
    value = torch.randn(96, 80)
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split(layout))})
    (result,) = fsdpckpt.merge(folder, tmp_path / "out", dtype=dtype)
    want = value.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    assert torch.equal(load_file(result.path)["w"].view(torch.int16), want.view(torch.int16))
    assert threads and all(name.startswith("fsdpckpt-cast") for name in threads)


@pytest.mark.parametrize("layout", [[0], [1]], ids=["dim0", "dim1"])
def test_a_block_torch_must_cast_is_cast_on_the_main_thread(tmp_path, monkeypatch, layout):
    """A block holding NaN needs torch's cast; torch is imported where the kept buffers it
    would stack on are given back first, the main thread's, never on the cast thread."""
    importing: list[str] = []
    original = _casts.import_torch

    def recording():
        importing.append(threading.current_thread().name)
        return original()

    monkeypatch.setattr(_casts, "import_torch", recording)
    value = torch.randn(96, 80)
    value[50, 7] = float("nan")
    folder = write_dcp(tmp_path / "ckpt", {"w": (value, split(layout))})
    (result,) = fsdpckpt.merge(folder, tmp_path / "out", dtype="fp16")
    assert torch.equal(load_file(result.path)["w"].view(torch.int16),
                       value.to(torch.float16).view(torch.int16))
    assert importing and set(importing) == {threading.current_thread().name}


def test_drain_waits_for_a_job_whose_future_was_dropped():
    done = threading.Event()
    background.submit("test-work", lambda: (time.sleep(0.05), done.set()))
    background.drain("test-work")
    assert done.is_set()
