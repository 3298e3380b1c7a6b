"""Files every rank writes its own bytes of, on object storage (fsdpckpt/_io/spread_remote.py):
multipart uploads whose parts each rank uploads, against the real S3 server (SeaweedFS).

SeaweedFS refuses parts under 5 MiB but the last (as S3 does), so the tests lower the part
size to that and write files of a few parts.
"""

from __future__ import annotations

import os
import pickle
import random

import pytest

from fsdpckpt._io import multipart, spread_remote
from fsdpckpt._io.remote import location
from fsdpckpt._io.spread import spread_folder
from fsdpckpt.errors import FsdpCkptError, OptionError, OutputExistsError, RemoteStorageError

import s3server
from faultproxy import FaultProxy
from multirank import run_ranks, start_ranks

pytestmark = pytest.mark.s3
multirank = pytest.mark.multirank

PART = 5 << 20
BUCKET = s3server.BUCKET


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch):
    monkeypatch.setattr(multipart, "PART_SIZE", PART)


def _data(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _objects(server, root: str) -> dict[str, bytes]:
    # SeaweedFS keeps a folder whose last object was deleted, listed as a directory: no object.
    fs = server.filesystem()
    return {p.removeprefix(root + "/"): fs.cat_file(p)
            for p, info in sorted(fs.find(root, detail=True).items()) if info["type"] == "file"}


def _open_uploads(server, root: str) -> list[str]:
    key = root.split("/", 1)[1]
    return [u["Key"] for u in server.filesystem().list_multipart_uploads(BUCKET)
            if u["Key"].startswith(key + "/")]


def _windows(size: int, window: int, seed: int = 1) -> list[tuple[int, int]]:
    spans = [(at, min(size, at + window)) for at in range(0, size, window)]
    random.Random(seed).shuffle(spans)
    return spans


# -- one process ----------------------------------------------------------------------------

def test_a_file_written_out_of_order_in_windows_reads_back_byte_exact(s3):
    server, root = s3
    big, small = _data(2 * PART + 12345, seed=1), _data(1000, seed=2)
    out = location(f"s3://{root}/out", storage_options=server.options)
    with spread_folder(out, overwrite=False, commit="config.json") as target:
        f = target.open("model-00001-of-00002.safetensors", len(big))
        for lo, hi in _windows(len(big), (1 << 20) + 7):
            f.write(lo, big[lo:hi])
            f.step()
        f.finish()
        g = target.open("model-00002-of-00002.safetensors", len(small))
        g.write(0, memoryview(small))
        g.finish()
        target.put("model.safetensors.index.json", b"{}")
        target.put("config.json", b'{"a": 1}')
        assert _objects(server, root) == {}  # nothing visible before the block ends
    assert _objects(server, root) == {
        "out/config.json": b'{"a": 1}', "out/model-00001-of-00002.safetensors": big,
        "out/model-00002-of-00002.safetensors": small, "out/model.safetensors.index.json": b"{}"}
    assert _open_uploads(server, root) == []


def test_a_tensor_and_an_empty_file_are_written(s3):
    import torch

    server, root = s3
    data = _data(PART + 10, seed=3)
    out = location(f"s3://{root}/out", storage_options=server.options)
    with spread_folder(out, overwrite=False, commit="config.json") as target:
        f = target.open("weights", len(data))
        f.write(0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        f.finish()
        target.open("empty", 0).finish()
        target.put("config.json", b"{}")
    assert _objects(server, root) == {"out/weights": data, "out/empty": b"",
                                      "out/config.json": b"{}"}


def test_uploads_complete_in_order_then_the_small_files_then_the_commit_file(s3, monkeypatch):
    server, root = s3
    order: list[str] = []
    complete, put = multipart.Upload.complete, spread_remote.put_bytes

    def completed(self, etags):
        order.append(self.path.name)
        complete(self, etags)

    def puts(file, data, **kwargs):
        order.append(file.name)
        return put(file, data, **kwargs)

    monkeypatch.setattr(multipart.Upload, "complete", completed)
    monkeypatch.setattr(spread_remote, "put_bytes", puts)
    for commit, last in (("config.json", ["b.safetensors", "a.safetensors",
                                          "model.safetensors.index.json", "config.json"]),
                         ("b.safetensors", ["a.safetensors", "config.json",
                                            "model.safetensors.index.json", "b.safetensors"])):
        order.clear()
        out = location(f"s3://{root}/{commit}", storage_options=server.options)
        with spread_folder(out, overwrite=False, commit=commit) as target:
            target.put("config.json", b"{}")
            for name in ("b.safetensors", "a.safetensors"):
                f = target.open(name, 3)
                f.write(0, b"abc")
                f.finish()
            target.put("model.safetensors.index.json", b"{}")
            assert order == []
        assert order == last


def test_an_output_holding_files_is_refused_unless_overwrite(s3):
    server, root = s3
    server.filesystem().pipe(f"{root}/out/config.json", b"earlier")
    out = location(f"s3://{root}/out", storage_options=server.options)
    with pytest.raises(OutputExistsError, match="config.json.*overwrite=True"), \
            spread_folder(out, overwrite=False, commit="config.json"):
        pytest.fail("entered")
    with spread_folder(out, overwrite=True, commit="config.json") as target:
        target.put("config.json", b"new")
    assert _objects(server, root) == {"out/config.json": b"new"}


def test_a_failure_in_the_block_leaves_nothing_and_an_earlier_output_as_it_was(s3):
    server, root = s3
    server.filesystem().pipe(f"{root}/out/model.safetensors", b"earlier")
    data = _data(3 * PART, seed=4)
    out = location(f"s3://{root}/out", storage_options=server.options)
    with pytest.raises(ValueError, match="boom"), \
            spread_folder(out, overwrite=True, commit="config.json") as target:
        target.put("config.json", b"{}")
        f = target.open("model.safetensors", len(data))
        f.write(0, data[:2 * PART])
        f.step()  # two parts uploaded
        assert len(f.etags) == 2
        raise ValueError("boom")
    assert _objects(server, root) == {"out/model.safetensors": b"earlier"}
    assert _open_uploads(server, root) == []


@pytest.mark.parametrize("writes, match", [
    ([(0, 10), (20, 30)], r"bytes 10\.\.20 were never written"),
    ([(0, 20), (15, 30)], r"bytes 15\.\.20 written twice"),
    ([(0, 31)], r"bytes 0\.\.31 lie outside"),
], ids=["gap", "twice", "outside"])
def test_bytes_not_written_exactly_once_are_refused_naming_the_file(s3, writes, match):
    server, root = s3
    out = location(f"s3://{root}/out", storage_options=server.options)
    with pytest.raises(FsdpCkptError, match=f"{root}/out/weights: {match}"), \
            spread_folder(out, overwrite=False, commit="config.json") as target:
        f = target.open("weights", 30)
        for lo, hi in writes:
            f.write(lo, bytes(hi - lo))
        f.finish()
    assert _objects(server, root) == {}
    assert _open_uploads(server, root) == []


def test_the_part_size_grows_so_that_a_file_fits_in_ten_thousand_parts():
    assert multipart.part_size(0) == multipart.part_size(10_000 * PART) == PART
    assert multipart.part_size(10_000 * PART + 1) == 2 * PART


def test_a_file_never_finished_is_refused_and_its_upload_aborted(s3):
    server, root = s3
    out = location(f"s3://{root}/out", storage_options=server.options)
    with pytest.raises(FsdpCkptError, match="out/weights: finish.. was never called"), \
            spread_folder(out, overwrite=False, commit="config.json") as target:
        target.open("weights", 3).write(0, b"abc")
        target.put("config.json", b"{}")
    assert _objects(server, root) == {}
    assert _open_uploads(server, root) == []


def test_a_caller_that_swallows_a_failed_exchange_cannot_exchange_again(s3, monkeypatch):
    # The other ranks stopped at that exchange: another one would wait for them forever.
    from fsdpckpt._io import spread_rounds

    server, root = s3
    out = location(f"s3://{root}/out", storage_options=server.options)

    def failed(self, heads, send):
        raise FsdpCkptError("injected: the exchange failed")

    with pytest.raises(FsdpCkptError, match=r"the end of the block after a failed exchange"), \
            spread_folder(out, overwrite=False, commit="config.json") as target:
        f = target.open("weights", 3)
        f.write(0, b"abc")
        with monkeypatch.context() as patch, pytest.raises(FsdpCkptError, match="injected"):
            patch.setattr(spread_rounds.Ranks, "_move", failed)
            f.step()
        with pytest.raises(FsdpCkptError, match=r"step\(\) after a failed exchange"):
            f.step()
    assert _objects(server, root) == {}
    assert _open_uploads(server, root) == []


def test_a_store_without_multipart_uploads_is_refused():
    out = location("memory://fsdpckpt-spread/out")
    with pytest.raises(OptionError, match="s3://"), \
            spread_folder(out, overwrite=False, commit="config.json"):
        pytest.fail("entered")


def test_a_5xx_on_a_part_upload_raises_naming_the_object_and_leaves_nothing(s3):
    server, root = s3
    data = _data(2 * PART + 1, seed=5)
    with FaultProxy(server.endpoint) as proxy:
        out = location(f"s3://{root}/out", storage_options=proxy.storage_options())
        proxy.fault("error", when=lambda r: r.method == "PUT" and "partNumber=2" in r.target)
        with pytest.raises(RemoteStorageError, match=f"{root}/out/weights.*part 2"), \
                spread_folder(out, overwrite=False, commit="config.json") as target:
            f = target.open("weights", len(data))
            f.write(0, data)
            f.finish()
    assert _objects(server, root) == {}
    assert _open_uploads(server, root) == []


def test_a_part_upload_retried_after_a_5xx_sends_the_same_bytes_again(s3):
    # The part's body is a file over its buffer, read in pieces: a retry seeks back to 0.
    server, root = s3
    data = _data(2 * PART + 1, seed=8)
    with FaultProxy(server.endpoint) as proxy:
        out = location(f"s3://{root}/out", storage_options=proxy.storage_options())
        tried: set[str] = set()

        def first_try_of_a_part(r) -> bool:
            # Two parts faulted once each, whichever comes first: two faults on one part's
            # two attempts (the parts go up together; a busy machine orders them anyhow)
            # would end the upload, which is the retry limit working, not this test's point
            if r.method != "PUT" or "partNumber=" not in r.target:
                return False
            part = r.target.split("partNumber=", 1)[1].split("&", 1)[0]
            first = part not in tried
            tried.add(part)
            return first

        proxy.fault("error", when=first_try_of_a_part, times=2)
        with spread_folder(out, overwrite=False, commit="config.json") as target:
            f = target.open("weights", len(data))
            f.write(0, data)
            f.finish()
        assert proxy.faulted == 2
    assert _objects(server, root) == {"out/weights": data}


# -- two ranks ------------------------------------------------------------------------------

def _runs(size: int, run: int) -> list[tuple[int, int, int]]:
    """``(rank, start, end)``: runs of ``run`` bytes, owned by rank 0 and 1 in turn."""
    return [((at // run) % 2, at, min(size, at + run)) for at in range(0, size, run)]


def _interrupt_in_the_next_round():
    # Ctrl-C while the ranks are moving bytes: held until the round is over on this rank, so
    # the other rank's round completes too, then raised here.
    import signal

    from fsdpckpt._io import spread_rounds

    signal.signal(signal.SIGINT, signal.default_int_handler)
    moving = spread_rounds.Ranks._move

    def interrupted(self, heads, send):
        spread_rounds.Ranks._move = moving
        signal.raise_signal(signal.SIGINT)
        return moving(self, heads, send)

    spread_rounds.Ranks._move = interrupted


def _two_rank_save(rank, world, options, url, fail):
    import torch.distributed as dist

    multipart.PART_SIZE = PART
    big, small = _data(4 * PART + 999, seed=6), _data(3000, seed=7)
    out = location(url, storage_options=options)
    held = 0  # the most parts this rank held after a step
    uploaded = {}  # the part numbers this rank uploaded, per file
    try:
        with spread_folder(out, overwrite=False, commit="config.json") as target:
            for name, data, run in (("big", big, (3 << 20) + 1), ("small", small, 100)):
                f = target.open(name, len(data))
                windows = _windows(len(data), 8 << 20)
                for window, (lo, hi) in enumerate(sorted(windows) if fail == "ordered" else
                                                  windows):
                    for owner, a, b in _runs(len(data), run):
                        if owner == rank and a < hi and b > lo:
                            f.write(max(a, lo), data[max(a, lo):min(b, hi)])
                    if fail == "error" and rank == 1 and window == 1:
                        raise ValueError("rank 1 broke mid-file")
                    if fail == "die" and rank == 1 and window == 1:
                        os._exit(3)  # as SIGKILL: no exit path, no word to the others
                    if fail == "interrupt" and rank == 1 and window == 1:
                        _interrupt_in_the_next_round()
                    if fail == "upload" and rank == 1 and window == 1:
                        def broken(self, number, body):
                            raise RemoteStorageError(f"{self.path}: injected on part {number}")
                        multipart.Upload.part = broken
                    f.step()
                    held = max(held, len(f.parts))
                if fail == "steps" and rank == 1:
                    f.step()
                f.finish()
                uploaded[name] = sorted(f.etags)
            if rank == 0:
                target.put("config.json", b"{}")
            if fail == "commit" and rank == 0:  # "big" is completed, "small" is refused
                complete = multipart.Upload.complete

                def refused(self, etags):
                    if self.path.name == "small":
                        raise RemoteStorageError(f"{self.path}: injected on completing it")
                    complete(self, etags)
                multipart.Upload.complete = refused
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)
    dist.barrier()
    return held, uploaded


@multirank
@pytest.mark.parametrize("order", [None, "ordered"], ids=["shuffled", "ordered"])
def test_two_ranks_owning_alternating_runs_write_files_that_read_back_exact(s3, order):
    server, root = s3
    (held0, uploaded0), (held1, uploaded1) = run_ranks(_two_rank_save, server.options,
                                                       f"s3://{root}/out", order)
    # Part k of the i-th file is uploaded by rank (i + k) % 2: the second file, of one part,
    # by rank 1.
    assert uploaded0 == {"big": [1, 3, 5], "small": []}
    assert uploaded1 == {"big": [2, 4], "small": [1]}
    if order == "ordered":
        # Windows in file order: a part is uploaded and freed at the step that completes it,
        # so after a step a rank holds at most the part the window ends in (of 5 parts).
        assert max(held0, held1) == 1
    assert _objects(server, root) == {"out/big": _data(4 * PART + 999, seed=6),
                                      "out/small": _data(3000, seed=7),
                                      "out/config.json": b"{}"}
    assert _open_uploads(server, root) == []


@multirank
@pytest.mark.parametrize("fail, errors", [
    ("error", [("FsdpCkptError", "rank 1 failed.*rank 1 broke mid-file"),
               ("ValueError", "rank 1 broke mid-file")]),
    ("upload", [("RemoteStorageError", "out/big: injected on part [0-9]+"),
                ("RemoteStorageError", "out/big: injected on part [0-9]+")]),
    ("interrupt", [("FsdpCkptError", "out: rank 1 failed.*KeyboardInterrupt"),
                   ("KeyboardInterrupt", "")]),
    ("steps", [("FsdpCkptError", "out of step.*rank 0 at finish.*rank 1 at step")] * 2),
    ("commit", [("RemoteStorageError", "out/small: injected on completing it")] * 2),
], ids=["error", "upload", "interrupt", "steps", "commit"])
def test_a_failure_on_one_rank_raises_on_both_and_leaves_nothing(s3, fail, errors):
    import re

    server, root = s3
    results = run_ranks(_two_rank_save, server.options, f"s3://{root}/out", fail)
    for (kind, message), (want_kind, pattern) in zip(results, errors):
        assert kind == want_kind and re.search(pattern, message), (kind, message)
    if fail in ("upload", "steps", "commit"):
        assert results[0] == results[1]
    assert _objects(server, root) == {}
    assert _open_uploads(server, root) == []


@multirank
def test_a_rank_that_dies_mid_file_fails_the_other_and_its_uploads_are_aborted(s3, tmp_path):
    server, root = s3
    procs = start_ranks(_two_rank_save, server.options, f"s3://{root}/out", "die",
                        rendezvous_dir=str(tmp_path))
    try:
        rank, ok, value = procs[0].keep_alive.get(timeout=150)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert (rank, ok) == (0, True)
    kind, message = pickle.loads(value)
    assert kind == "FsdpCkptError" and "the ranks stopped answering each other" in message
    assert f"{root}/out" in message
    assert _objects(server, root) == {}
    assert _open_uploads(server, root) == []
