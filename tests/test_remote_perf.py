"""Remote reads that are cheap: few requests, fetched ahead in parallel, bounded in memory.

Requests are counted at the S3 client (every call s3fs makes to the server goes through
``S3FileSystem._call_s3``), so the counts are the server's, and deterministic. No timings
here: ``benchmarks/remote.py`` measures them.
"""

from __future__ import annotations

import collections
import threading

import pytest

import fsdpckpt
from fsdpckpt._io import prefetch as prefetch_module
from fsdpckpt._io.prefetch import Prefetcher
from fsdpckpt.errors import CorruptCheckpointError, RemoteStorageError

from conftest import FIXTURES, damaged_copy, peak_rss_mib, single_process, upload

CKPT = FIXTURES / "fsdp2_accelerate"



@pytest.fixture
def requests(monkeypatch):
    """A Counter of the S3 operations made (``list_objects_v2``, ``get_object``...)."""
    import s3fs

    counts: collections.Counter[str] = collections.Counter()
    original = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        counts[method] += 1
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    return counts


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# -- inspect: listings, .metadata and the side files it decodes -----------------------------

@pytest.mark.s3
def test_a_remote_inspect_lists_each_folder_once_and_gets_each_small_file_once(s3, requests):
    server, root = s3
    url = upload(server, CKPT, f"s3://{root}/run/checkpoint-1")
    requests.clear()
    report = fsdpckpt.inspect_checkpoint(url, storage_options=server.options)
    assert report.ok
    # The checkpoint folder and its two DCP folders listed once each (never the run folder
    # above it, which may hold a thousand checkpoints); each .metadata, and each side file
    # inspect decodes (scheduler.bin, two RNG files), in one GET; no HEAD.
    assert dict(requests) == {"list_objects_v2": 3, "get_object": 2 + 3}


@pytest.mark.s3
def test_a_remote_inspect_of_a_dcp_folder_is_one_listing_and_one_get(s3, requests):
    server, root = s3
    url = upload(server, CKPT / "pytorch_model_fsdp_0", f"s3://{root}/run/model")
    requests.clear()
    assert fsdpckpt.inspect_checkpoint(url, storage_options=server.options).ok
    assert dict(requests) == {"list_objects_v2": 1, "get_object": 1}


# -- the prefetcher, alone ---------------------------------------------------------------------

class _FakeFile:
    """Bytes served by ``fetch``, counting requests and the bytes held at once."""

    def __init__(self, size: int, fail: tuple[int, int] | None = None) -> None:
        self.data = bytes((i * 7 + i // 251) % 256 for i in range(size))
        self.fail, self.requests = fail, []
        self.lock = threading.Lock()

    def fetch(self, key, start: int, end: int) -> bytes:
        with self.lock:
            self.requests.append((start, end))
        if self.fail and start < self.fail[1] and self.fail[0] < end:
            raise CorruptCheckpointError(f"{key}: reading bytes {start}..{end} failed")
        return self.data[start:end]

    def direct(self, key, view: memoryview, offset: int) -> None:
        view[:] = self.fetch(key, offset, offset + len(view))


def _chunks(sizes: list[int]) -> list[tuple[str, int, int]]:
    ranges, at = [], 0
    for size in sizes:
        ranges.append(("f", at, size))
        at += size
    return ranges


def _read_like_a_merge(ahead: Prefetcher, ranges, block: int, watch=None) -> bytes:
    """Each range as the merge reads it: its tail, its head, then its data in blocks."""
    out = bytearray()
    for key, offset, length in ranges:
        for probe in (offset + max(0, length - 22), offset):
            view = memoryview(bytearray(min(22, length)))
            ahead.read(key, view, probe)
        done = 0
        while done < length:
            view = memoryview(bytearray(min(block, length - done)))
            ahead.read(key, view, offset + done)
            out += view
            done += len(view)
            if watch:
                watch()
    return bytes(out)


def test_prefetched_reads_give_exactly_the_bytes_of_the_file():
    sizes = [100, 5000, 30, 70_000, 1, 12_345, 3000]
    file = _FakeFile(sum(sizes))
    ahead = Prefetcher(_chunks(sizes), file.fetch, file.direct, budget=40_000, piece=8_000,
                       workers=3)
    try:
        assert _read_like_a_merge(ahead, _chunks(sizes), 4096) == file.data
    finally:
        ahead.close()


def test_prefetch_never_holds_more_than_its_budget():
    sizes = [50_000] * 6 + [700] * 40
    file = _FakeFile(sum(sizes))
    ahead = Prefetcher(_chunks(sizes), file.fetch, file.direct, budget=24_000, piece=8_000,
                       workers=4)
    held: list[int] = []
    try:
        _read_like_a_merge(ahead, _chunks(sizes), 3000, watch=lambda: held.append(ahead.held))
    finally:
        ahead.close()
    assert held and max(held) <= 24_000


def test_small_neighbouring_chunks_share_one_request_header_included():
    sizes = [700] * 10
    file = _FakeFile(sum(sizes))
    ahead = Prefetcher(_chunks(sizes), file.fetch, file.direct, piece=8_000)
    try:
        assert _read_like_a_merge(ahead, _chunks(sizes), 4096) == file.data
    finally:
        ahead.close()
    assert file.requests == [(0, 7000)]


def test_small_chunks_of_alternating_files_share_one_request_per_file():
    files = {"a": _FakeFile(3500), "b": _FakeFile(3500)}
    ranges = [(key, (i // 2) * 700, 700) for i, key in enumerate("ab" * 5)]
    ahead = Prefetcher(ranges, lambda key, start, end: files[key].fetch(key, start, end),
                       lambda key, view, offset: files[key].direct(key, view, offset),
                       piece=8_000, budget=64_000)
    try:
        for key, offset, length in ranges:
            view = memoryview(bytearray(length))
            ahead.read(key, view, offset)
            assert bytes(view) == files[key].data[offset:offset + length]
    finally:
        ahead.close()
    assert files["a"].requests == [(0, 3500)] and files["b"].requests == [(0, 3500)]


def test_a_large_chunk_costs_no_request_beyond_its_pieces():
    file = _FakeFile(100_000)
    ahead = Prefetcher([("f", 0, 100_000)], file.fetch, file.direct, budget=40_000,
                       piece=10_000, workers=2)
    try:
        assert _read_like_a_merge(ahead, [("f", 0, 100_000)], 6000) == file.data
    finally:
        ahead.close()
    fetched = sorted(file.requests)
    # Every byte once: the header and directory reads came from the head and tail pieces.
    assert sum(end - start for start, end in fetched) == 100_000
    assert all(a[1] == b[0] for a, b in zip(fetched, fetched[1:]))


def test_a_failing_range_raises_its_error_when_its_bytes_are_read():
    sizes = [1000] * 5
    file = _FakeFile(sum(sizes), fail=(2500, 2501))
    ahead = Prefetcher(_chunks(sizes), file.fetch, file.direct, piece=1000)
    try:
        view = memoryview(bytearray(1000))
        ahead.read("f", view, 0)  # before the failing range: fine
        with pytest.raises(CorruptCheckpointError, match="failed"):
            ahead.read("f", view, 2000)
    finally:
        ahead.close()


def test_reads_outside_the_announced_ranges_are_fetched_directly():
    file = _FakeFile(10_000)
    ahead = Prefetcher([("f", 0, 1000)], file.fetch, file.direct, piece=1000)
    try:
        view = memoryview(bytearray(3000))
        ahead.read("f", view, 500)
    finally:
        ahead.close()
    assert bytes(view) == file.data[500:3500]


# -- remote merges and verifies ----------------------------------------------------------------

@pytest.fixture
def tiny_pieces(monkeypatch):
    """Pieces of 4 KiB and a 32 KiB budget: the fixture's chunks are cut, coalesced and
    held back by the budget, as a large checkpoint's are with the real limits."""
    monkeypatch.setattr(prefetch_module, "PIECE", 4096)
    monkeypatch.setattr(prefetch_module, "BUDGET", 32768)


@pytest.mark.s3
@pytest.mark.parametrize("options", [{}, {"max_shard_size": "1KB", "dtype": "bf16"},
                                     {"optimizer": True, "format": "bin"}],
                         ids=["plain", "sharded-bf16", "optimizer-bin"])
def test_a_prefetched_merge_from_s3_is_byte_identical_to_the_local_merge(s3, tmp_path,
                                                                        tiny_pieces, options):
    server, root = s3
    url = upload(server, CKPT, f"s3://{root}/ckpt")
    fsdpckpt.merge(url, tmp_path / "remote", storage_options=server.options, **options)
    fsdpckpt.merge(CKPT, tmp_path / "local", **options)
    assert _files(tmp_path / "remote") == _files(tmp_path / "local")


@pytest.mark.s3
def test_a_remote_merge_reads_each_chunk_header_and_data_in_at_most_one_request(s3, tmp_path,
                                                                              requests):
    from fsdpckpt.dcp.reader import read_dcp_folder

    server, root = s3
    url = upload(server, CKPT, f"s3://{root}/ckpt")
    chunks = sum(len(t.chunks) for t in
                 read_dcp_folder(CKPT / "pytorch_model_fsdp_0").metadata.tensors)
    requests.clear()
    fsdpckpt.merge(url, tmp_path / "out", storage_options=server.options)
    # .metadata files, then at most one GET per chunk (small neighbours share one).
    assert requests["get_object"] <= 2 + chunks
    assert requests["head_object"] == 0


@pytest.mark.s3
def test_a_failing_ranged_read_fails_the_merge_with_one_error_and_no_output(s3, tmp_path,
                                                                          monkeypatch):
    import s3fs

    server, root = s3
    url = upload(server, CKPT, f"s3://{root}/ckpt")
    original = s3fs.S3FileSystem._cat_file

    async def failing(self, path, start=None, end=None, **kwargs):
        if path.endswith("pytorch_model_fsdp_0/__1_0.distcp"):
            raise OSError("connection reset")
        return await original(self, path, start=start, end=end, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", failing)
    # A client made now (fsspec binds the sync methods of a client when it makes it).
    options = {**server.options, "skip_instance_cache": True}
    # A network fault, not a damaged checkpoint: the store's error, naming the object.
    with pytest.raises(RemoteStorageError, match=r"__1_0\.distcp: the object store failed "
                                                 "while reading it .*connection reset"):
        fsdpckpt.merge(url, tmp_path / "out", storage_options=options)
    assert not (tmp_path / "out").exists()


@pytest.mark.s3
def test_a_prefetched_verify_still_names_a_damaged_chunk(s3, tmp_path, tiny_pieces):
    server, root = s3
    copy = damaged_copy(CKPT, "pytorch_model_fsdp_0/__0_0.distcp", tmp_path / "ckpt")
    url = upload(server, copy, f"s3://{root}/damaged")
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
    local = fsdpckpt.verify_checkpoint(copy)
    assert [p.message for p in report.problems] == [p.message for p in local.problems]
    assert len(report.problems) == 1 and "__0_0.distcp" in report.problems[0].path


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    """A 192 MiB DCP folder (six 32 MiB tensors): twice the prefetch budget."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("large") / "ckpt"
    state = {"model": {f"layers.{i}.weight": torch.full((2048, 4096), float(i))
                       for i in range(6)}}
    dcp.save(state, checkpoint_id=str(path), **single_process())
    return path


@pytest.mark.s3
@pytest.mark.slow
def test_a_remote_merge_larger_than_the_prefetch_budget_stays_bounded(s3, tmp_path,
                                                                      large_checkpoint):
    server, root = s3
    url = upload(server, large_checkpoint, f"s3://{root}/large")
    setup = ("import fsdpckpt, fsdpckpt.merging.merger, s3fs\n"
             f"options = {server.options!r}\n")
    baseline = peak_rss_mib(setup + f"fsdpckpt.inspect_checkpoint({url!r}, "
                            "storage_options=options)")
    peak = peak_rss_mib(setup + f"fsdpckpt.merge({url!r}, {str(tmp_path / 'out')!r}, "
                        "storage_options=options)")
    budget = prefetch_module.BUDGET / 2**20
    joining = prefetch_module.WORKERS * prefetch_module.PIECE / 2**20
    # The bytes fetched ahead (the budget; measured here: about 135 MiB over the imports in
    # all), a second copy of each piece in flight while the client joins its body, and one
    # 16 MiB block being written. A merge that held the checkpoint would add 192 MiB more.
    assert peak - baseline < budget + joining + 32, (peak, baseline)
    assert peak < 300, peak
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 192 * 2**20
