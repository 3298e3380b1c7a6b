"""Reads and writes of many pieces at scattered offsets (``fsdpckpt._io.batched``): each piece
whole, in a few ``io_submit`` calls where Linux AIO is there and one call each where it is
not, with the same errors either way (issue 21)."""

from __future__ import annotations

import contextlib
import errno
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpckpt import CorruptCheckpointError
from fsdpckpt._io import batched


@pytest.fixture(params=["batched", "one-call-each"])
def mode(request, monkeypatch):
    if request.param == "batched" and not batched.available():
        pytest.skip("no Linux AIO here: the one-call-each case covers this system")
    if request.param == "one-call-each":
        monkeypatch.setattr(batched, "available", lambda: False)
    return request.param


def _file(path, size: int, seed: int = 0) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


def _pieces(count: int, size: int, seed: int = 1) -> tuple[list[int], list[int], list[int]]:
    # Pieces of 0 to 300 bytes from anywhere in a file of ``size`` bytes, put one after
    # another in the buffer: more than one batch's worth of 1,024.
    rng = random.Random(seed)
    lengths = [rng.randrange(0, 300) for _ in range(count)]
    offsets = [rng.randrange(0, size - length + 1) for length in lengths]
    starts = [sum(lengths[:k]) for k in range(count)]
    return starts, lengths, offsets


def test_read_pieces_fills_every_piece_from_its_offset(tmp_path, mode):
    data = _file(tmp_path / "f", 1 << 20)
    starts, lengths, offsets = _pieces(2500, len(data))
    buffer = bytearray(sum(lengths))
    with open(tmp_path / "f", "rb") as f:
        batched.read_pieces(f.fileno(), memoryview(buffer), np.array(starts), lengths,
                            offsets, source="f")
    assert bytes(buffer) == b"".join(data[o:o + n] for o, n in zip(offsets, lengths))


def test_write_pieces_puts_every_piece_at_its_offset(tmp_path, mode):
    source = random.Random(2).randbytes(4000 * 64)
    offsets = random.Random(3).sample(range(0, 8000 * 64, 64), 4000)  # no two overlap
    with open(tmp_path / "out", "wb") as f:
        batched.write_pieces(f.fileno(), memoryview(source), range(0, len(source), 64),
                             [64] * 4000, offsets)
    written = (tmp_path / "out").read_bytes()
    for k, offset in enumerate(offsets):
        assert written[offset:offset + 64] == source[k * 64:(k + 1) * 64]


def test_a_write_piece_past_the_write_cap_goes_out_in_capped_calls(tmp_path, monkeypatch):
    """rawio writes at most 256 KiB a call (measured faster than larger writes); a large
    piece handed to write_pieces is written the same way, batched or not."""
    if not batched.available():
        pytest.skip("no Linux AIO here")
    from fsdpckpt._io import rawio

    sizes = []
    original = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: (sizes.append(len(data)),
                                                             original(fd, data, at))[1])
    source = random.Random(4).randbytes(rawio._WRITE_MAX * 3 + 64 * 4)
    large = rawio._WRITE_MAX * 3
    with open(tmp_path / "out", "wb") as f:
        batched.write_pieces(f.fileno(), memoryview(source), [0, large, large + 64, large + 128],
                             [large, 64, 64, 128], [0, large, large + 64, large + 128])
    assert (tmp_path / "out").read_bytes() == source[:large + 256]
    assert sizes == [rawio._WRITE_MAX] * 3  # the large piece; the small ones in one batch


def test_batched_calls_do_every_piece_in_the_batch(tmp_path, monkeypatch):
    """Where AIO is there it does the work: no piece falls back to a call of its own (a
    wrong control block would leave every piece to the fallback, correct but slow)."""
    if not batched.available():
        pytest.skip("no Linux AIO here")
    by_hand = []
    monkeypatch.setattr(batched, "_finish", lambda *args: by_hand.append(args))
    data = _file(tmp_path / "f", 1 << 16)
    buffer = bytearray(2048 * 16)
    with open(tmp_path / "f", "rb") as f:
        batched.read_pieces(f.fileno(), memoryview(buffer), range(0, len(buffer), 16),
                            [16] * 2048, range(0, 2048 * 32, 32), source="f")
    assert by_hand == []
    assert bytes(buffer) == b"".join(data[k * 32:k * 32 + 16] for k in range(2048))


@pytest.mark.parametrize("short", [False, True], ids=["past-the-end", "ends-inside"])
def test_a_piece_past_the_end_of_the_file_is_refused_naming_it(tmp_path, mode, short):
    data = _file(tmp_path / "f", 10_000)
    offsets = [0, 100, 9_990 if short else 20_000, 200]
    buffer = bytearray(4 * 64)
    with open(tmp_path / "f", "rb") as f, \
            pytest.raises(CorruptCheckpointError, match="ckpt/f"):
        batched.read_pieces(f.fileno(), memoryview(buffer), [0, 64, 128, 192], [64] * 4,
                            offsets, source="ckpt/f")
    assert buffer[:64] == data[:64] or mode == "one-call-each"


def test_a_piece_outside_its_buffer_is_refused_before_any_call(tmp_path, mode):
    _file(tmp_path / "f", 4096)
    buffer = bytearray(128)
    with open(tmp_path / "f", "rb") as f:
        for starts, lengths, offsets in ([[0, 100], [64, 64], [0, 0]],
                                         [[-1, 0], [1, 1], [0, 0]],
                                         [[0, 0], [1, 1], [0, -5]]):
            if mode == "one-call-each" and starts[1] == 100:
                continue  # a slice of the buffer: refused by memoryview, not by the kernel
            with pytest.raises(ValueError):
                batched.read_pieces(f.fileno(), memoryview(buffer), starts, lengths, offsets,
                                    source="f")
    assert buffer == bytearray(128)


def test_every_context_taken_is_given_back_or_destroyed_whatever_the_call_raises(
        tmp_path, monkeypatch):
    """An AIO context holds a share of the system-wide aio-max-nr until it is destroyed: one
    lost to a bad argument or an error would be lost until the process ends."""
    if not batched.available():
        pytest.skip("no Linux AIO here")
    taken, returned = [], []
    take, give, destroy = batched._context, batched._release, batched._destroy
    monkeypatch.setattr(batched, "_context", lambda: taken.append(1) or take())
    monkeypatch.setattr(batched, "_release", lambda c: returned.append(1) or give(c))
    monkeypatch.setattr(batched, "_destroy", lambda c: returned.append(1) or destroy(c))
    _file(tmp_path / "f", 4096)
    buffer = bytearray(128)
    with open(tmp_path / "f", "rb") as f:
        for lengths in (["x", 1], [64, 64], [64, 9999]):
            with contextlib.suppress(ValueError, TypeError, CorruptCheckpointError):
                batched.read_pieces(f.fileno(), memoryview(buffer), [0, 64], lengths,
                                    [0, 4090], source="f")
    assert len(taken) == len(returned) > 0


def test_a_read_into_a_read_only_buffer_is_refused(tmp_path, mode):
    _file(tmp_path / "f", 4096)
    held = bytes(128)
    with open(tmp_path / "f", "rb") as f, pytest.raises(ValueError, match="writable"):
        batched.read_pieces(f.fileno(), memoryview(held), [0, 64], [64, 64], [0, 512],
                            source="f")
    assert held == bytes(128)


def test_a_refused_write_raises_the_systems_error(tmp_path, mode):
    _file(tmp_path / "f", 4096)
    with open(tmp_path / "f", "rb") as f, pytest.raises(OSError) as raised:
        batched.write_pieces(f.fileno(), memoryview(b"x" * 128), [0, 64], [64, 64], [0, 512])
    assert raised.value.errno == errno.EBADF


def test_an_interrupted_batch_leaves_no_context_in_flight(tmp_path, monkeypatch):
    """Ctrl-C while a batch's events are reaped: its context is destroyed (io_destroy waits
    for what it has in flight), not handed to the next caller with stale events in it."""
    if not batched.available():
        pytest.skip("no Linux AIO here")
    data = _file(tmp_path / "f", 1 << 16)
    original = batched._reap
    monkeypatch.setattr(batched, "_reap", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    free_before = list(batched._free)
    buffer = bytearray(64 * 8)
    with open(tmp_path / "f", "rb") as f:
        with pytest.raises(KeyboardInterrupt):
            batched.read_pieces(f.fileno(), memoryview(buffer), range(0, 512, 64), [64] * 8,
                                range(0, 8 * 128, 128), source="f")
        assert all(c in free_before for c in batched._free)  # that one was not given back
        monkeypatch.setattr(batched, "_reap", original)
        batched.read_pieces(f.fileno(), memoryview(buffer), range(0, 512, 64), [64] * 8,
                            range(0, 8 * 128, 128), source="f")
    assert bytes(buffer) == b"".join(data[k * 128:k * 128 + 64] for k in range(8))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_reads_with_its_own_contexts(tmp_path):
    data = _file(tmp_path / "f", 1 << 16)
    buffer = bytearray(64 * 8)
    with open(tmp_path / "f", "rb") as f:
        batched.read_pieces(f.fileno(), memoryview(buffer), range(0, 512, 64), [64] * 8,
                            range(0, 1024, 128), source="f")  # the parent holds a context
        pid = os.fork()
        if pid == 0:  # the child: its parent's contexts are not its own
            try:
                mine = bytearray(64 * 8)
                batched.read_pieces(f.fileno(), memoryview(mine), range(0, 512, 64),
                                    [64] * 8, range(64, 1088, 128), source="f")
                os._exit(0 if bytes(mine) == b"".join(
                    data[64 + k * 128:128 + k * 128] for k in range(8)) else 1)
            finally:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 700)), max_size=1500),
       aio=st.booleans())
def test_reads_of_any_pieces_match_slices_of_the_file(tmp_path_factory, pieces, aio):
    path = tmp_path_factory.mktemp("fuzz") / "f"
    data = _file(path, 5000, seed=len(pieces))
    lengths = [n for _, n in pieces]
    starts = [sum(lengths[:k]) for k in range(len(pieces))]
    buffer = bytearray(sum(lengths))
    want = [data[o:o + n] for o, n in pieces]
    with open(path, "rb") as f:
        available = batched.available
        try:
            if not aio:
                batched.available = lambda: False  # type: ignore[assignment]
            if all(len(w) == n for w, (_, n) in zip(want, pieces)):
                batched.read_pieces(f.fileno(), memoryview(buffer), starts, lengths,
                                    [o for o, _ in pieces], source="f")
                assert bytes(buffer) == b"".join(want)
            else:
                with pytest.raises(CorruptCheckpointError):
                    batched.read_pieces(f.fileno(), memoryview(buffer), starts, lengths,
                                        [o for o, _ in pieces], source="f")
        finally:
            batched.available = available  # type: ignore[assignment]
