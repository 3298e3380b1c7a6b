"""Bounded work for any input: numbers a file declares never drive a loop or an allocation.

Each hostile input runs in a child process under a wall-clock limit and reports its peak
memory (VmHWM) beyond what it held once imports were done, so a regression shows as a
timeout or a memory figure, never as a hung test run. The limits are generous (the inputs
took from 18 s to 10 minutes and gigabytes before); they bound, they do not time.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpckpt.dcp._archive import locate_tensor
from fsdpckpt.dcp.checks import check_folder, check_tensor_chunks
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.dcp.metadata import Chunk, TensorEntry
from fsdpckpt.dcp.reader import read_dcp_folder
from fsdpckpt.errors import CorruptCheckpointError

from multirank import _context

LIMIT_S = 120
EXTRA_MB = 300


def _child(script: str, cwd: str, out: str, err: str) -> None:
    """Run ``script`` with its stdout in ``out``; a failure's traceback goes to ``err``."""
    import traceback

    os.chdir(cwd)
    with open(out, "w") as stream:
        sys.stdout = stream
        try:
            exec(compile(script, "<bounded>", "exec"), {"__name__": "__main__"})
        except BaseException:  # noqa: BLE001 - handed to the test, which fails on it
            Path(err).write_text(traceback.format_exc())
            stream.flush()
            os._exit(1)
        finally:
            sys.stdout = sys.__stdout__


def _bounded(code: str, tmp_path: Path) -> str:
    """Run ``code`` in a child; fail if it overruns LIMIT_S or EXTRA_MB. Returns its stdout.

    The child comes from the multirank forkserver, torch already imported (a fresh
    interpreter pays about a second for that); its peak-memory mark is reset once its
    imports are done, so the figure is what the code itself took."""
    script = textwrap.dedent("""
        import re, sys
        import torch, fsdpckpt, fsdpckpt.merging.full, fsdpckpt.merging.merger
        import fsdpckpt.inspection.inspect
        def _mb(field):
            text = open("/proc/self/status").read()
            return int(re.search(field + r":\\s+(\\d+)", text).group(1)) // 1024
        with open("/proc/self/clear_refs", "w") as _marks:
            _marks.write("5")  # VmHWM := VmRSS: a forked child starts with its parent's peak
        _base = _mb("VmRSS")
        try:
        {body}
        finally:
            print("EXTRA_MB", _mb("VmHWM") - _base)
    """).format(body=textwrap.indent(textwrap.dedent(code), "    "))
    out, err = tmp_path / "bounded.out", tmp_path / "bounded.err"
    proc = _context().Process(target=_child, args=(script, str(tmp_path), str(out), str(err)))
    proc.start()
    proc.join(LIMIT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"still running after {LIMIT_S} s")
    stderr = err.read_text() if err.exists() else f"exit code {proc.exitcode}"
    assert proc.exitcode == 0, stderr[-3000:]
    stdout = out.read_text()
    extra = int(stdout.rsplit("EXTRA_MB", 1)[1])
    assert extra <= EXTRA_MB, f"used {extra} MB beyond its imports"
    return stdout


def _metadata(folder: Path):
    return pickle.loads((folder / ".metadata").read_bytes())  # our own fixture: trusted


def _write_metadata(folder: Path, meta) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


# --- world size and RNG ranks come from names, never from a loop up to them -------------

@pytest.mark.parametrize("rank", ["9999999", "99999999999"])
def test_inspect_of_a_huge_rank_file_name_is_bounded(accelerate_ckpt, tmp_path, rank):
    model = accelerate_ckpt / "pytorch_model_fsdp_0"
    shutil.copy(model / "__1_0.distcp", model / f"__{rank}_0.distcp")
    out = _bounded(f"""
        doc = fsdpckpt.inspect_checkpoint({str(accelerate_ckpt)!r})
        print("PROBLEMS", len(doc["problems"]))
    """, tmp_path)
    assert int(out.split("PROBLEMS")[1].split()[0]) <= 10


def test_inspect_of_a_huge_rng_rank_is_bounded(accelerate_ckpt, tmp_path):
    shutil.copy(accelerate_ckpt / "random_states_0.pkl",
                accelerate_ckpt / "random_states_10000000.pkl")
    out = _bounded(f"""
        doc = fsdpckpt.inspect_checkpoint({str(accelerate_ckpt)!r})
        print("PROBLEMS", len(doc["problems"]), doc["problems"][-1]["message"])
    """, tmp_path)
    assert "more ranks below" in out


def test_missing_rng_ranks_are_named_then_counted(accelerate_ckpt):
    from fsdpckpt.inspection.inspect import inspect_checkpoint

    shutil.copy(accelerate_ckpt / "random_states_0.pkl", accelerate_ckpt / "random_states_9.pkl")
    messages = [p["message"] for p in inspect_checkpoint(accelerate_ckpt)["problems"]]
    assert messages == [f"no RNG state file for rank {r}" for r in range(2, 7)] + \
        ["no RNG state file for 2 more ranks below 10"]


# --- .metadata ---------------------------------------------------------------------------

def test_a_sparse_huge_metadata_is_refused_unread(dtensor_copy, tmp_path):
    os.truncate(dtensor_copy / ".metadata", 6 * 10**9)
    out = _bounded(f"""
        try:
            fsdpckpt.inspect_checkpoint({str(dtensor_copy)!r})
        except fsdpckpt.NotACheckpointError as exc:
            print("REFUSED", exc)
    """, tmp_path)
    assert "REFUSED" in out and "bytes of metadata for" in out


# --- chunk tiling: exact and N log N ------------------------------------------------------

def _tensor(shape, boxes):
    chunks = tuple(Chunk(tuple(o), tuple(s), "__0_0.distcp", 0, 1) for o, s in boxes)
    return TensorEntry("w", DTYPES["float32"], tuple(shape), chunks, ("w",))


def test_the_overlap_check_of_many_chunks_is_bounded(tmp_path):
    # 30,000 chunks with gaps between them: the old check compared every pair (about 40 s
    # for 10,000, growing with the square).
    out = _bounded("""
        from fsdpckpt.dcp.checks import check_tensor_chunks
        from fsdpckpt.dcp.dtypes import DTYPES
        from fsdpckpt.dcp.metadata import Chunk, TensorEntry
        chunks = tuple(Chunk((2 * i, 0), (1, 3), "__0_0.distcp", 0, 1) for i in range(30000))
        print(check_tensor_chunks(TensorEntry("w", DTYPES["float32"], (60000, 3), chunks, ("w",))))
    """, tmp_path)
    assert "there is a gap" in out


def test_an_overlap_between_far_apart_chunks_is_found():
    # Sorted by offsets, the overlapping pair ([0, 0] and [1, 0]) is not adjacent.
    boxes = [((0, 0), (2, 2)), ((0, 2), (4, 2)), ((1, 0), (1, 1)), ((3, 0), (1, 2))]
    (message,) = check_tensor_chunks(_tensor((4, 4), boxes))
    assert "overlap" in message and "[0, 0]" in message and "[1, 0]" in message


def test_a_three_dim_grid_is_whole_and_an_overlap_in_it_is_found():
    grid = [((a, b, c), (1, 1, 1)) for a in range(3) for b in range(3) for c in range(3)]
    assert check_tensor_chunks(_tensor((3, 3, 3), grid)) == []
    (message,) = check_tensor_chunks(_tensor((3, 3, 3), grid[:-1] + [((1, 1, 1), (2, 2, 2))]))
    assert "overlap" in message


def test_identical_chunks_overlap():
    (message,) = check_tensor_chunks(_tensor((4,), [((0,), (4,)), ((0,), (4,))]))
    assert "overlap" in message


# --- empty tensors, list indices, declared sizes -----------------------------------------

def test_runs_of_an_empty_chunk_are_not_enumerated(tmp_path):
    out = _bounded("""
        from fsdpckpt.dcp.metadata import Chunk
        from fsdpckpt.merging.plan import chunk_runs
        chunk = Chunk((0, 0, 0), (200000000, 1, 0), None, 0, 0)
        print("RUNS", chunk_runs((200000000, 2, 0), chunk))
    """, tmp_path)
    assert "RUNS (0, [])" in out


def test_a_huge_list_index_is_refused_not_built(tmp_path):
    out = _bounded("""
        from fsdpckpt.dcp._nesting import unflatten
        try:
            unflatten([(("state", 10**12), 1), (("state", 0), 2)])
        except fsdpckpt.NotACheckpointError as exc:
            print("REFUSED", exc)
    """, tmp_path)
    assert "REFUSED" in out and "list index 1000000000000" in out


def test_list_indices_below_the_entry_count_still_make_lists():
    from fsdpckpt.dcp._nesting import unflatten

    assert unflatten([(("g", 1, "lr"), 2), (("g", 0, "lr"), 1)]) == {"g": [{"lr": 1}, {"lr": 2}]}


def test_merge_planning_refuses_a_huge_list_index(dtensor_copy):
    from fsdpckpt.merging.plan import MergePlanError, plan_merge

    meta = _metadata(dtensor_copy)
    fqn = next(iter(meta.state_dict_metadata))
    meta.planner_data = {fqn: ("model", 10**12)}
    _write_metadata(dtensor_copy, meta)
    with pytest.raises(MergePlanError, match="list index 1000000000000"):
        plan_merge(dtensor_copy, format="bin")


def _huge_shape(folder: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    meta = _metadata(folder)
    fqn, entry = next(iter(meta.state_dict_metadata.items()))
    old = entry.chunks[0]
    entry.size = torch.Size([10**15])
    entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([10**15]))]
    info = meta.storage_data.pop(MetadataIndex(fqn, old.offsets))
    for key in [k for k in meta.storage_data if k.fqn == fqn]:
        del meta.storage_data[key]
    meta.storage_data[MetadataIndex(fqn, torch.Size([0]))] = info
    _write_metadata(folder, meta)


def test_a_declared_size_beyond_the_bytes_present_is_refused_before_allocating(dtensor_copy,
                                                                                 tmp_path):
    _huge_shape(dtensor_copy)
    out = _bounded(f"""
        try:
            fsdpckpt.merging.full.load_full_state_dict({str(dtensor_copy)!r})
        except fsdpckpt.CorruptCheckpointError as exc:
            print("REFUSED", exc)
    """, tmp_path)
    assert "REFUSED" in out and "its archive holds only" in out


def test_check_folder_names_a_chunk_larger_than_its_archive(dtensor_copy):
    _huge_shape(dtensor_copy)
    messages = [p.message for p in check_folder(read_dcp_folder(dtensor_copy))]
    assert any("declares 4000000000000000 bytes" in m for m in messages)


def test_chunks_sharing_bytes_in_a_file_are_a_problem(dtensor_copy):
    meta = _metadata(dtensor_copy)
    infos = [i for i in meta.storage_data.values() if i.relative_path == "__0_0.distcp"]
    first, second = infos[0], infos[1]
    second.offset, second.length = first.offset, first.length
    _write_metadata(dtensor_copy, meta)
    messages = [p.message for p in check_folder(read_dcp_folder(dtensor_copy))]
    assert any("share bytes" in m for m in messages)


# --- chunk archives: what torch.save never writes is refused before it is read ------------

def _archive(*, compress: int = zipfile.ZIP_STORED, extra_entries: int = 0) -> bytes:
    saved = io.BytesIO()
    torch.save(torch.arange(4, dtype=torch.float32), saved)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            kind = compress if info.filename.endswith("data.pkl") else zipfile.ZIP_STORED
            dst.writestr(info.filename, data, compress_type=kind)
        for i in range(extra_entries):
            dst.writestr(f"archive/extra/{i}", b"")
    return out.getvalue()


def test_a_stored_rebuilt_archive_is_still_located():
    data = _archive()
    assert locate_tensor(io.BytesIO(data), 0, len(data), source="x").shape == (4,)


def test_a_compressed_data_pkl_is_refused_before_decompressing():
    data = _archive(compress=zipfile.ZIP_DEFLATED)
    with pytest.raises(CorruptCheckpointError, match="is compressed"):
        locate_tensor(io.BytesIO(data), 0, len(data), source="x")


def test_an_archive_of_many_entries_is_refused():
    data = _archive(extra_entries=200)
    with pytest.raises(CorruptCheckpointError, match="declares 20[0-9] entries"):
        locate_tensor(io.BytesIO(data), 0, len(data), source="x")


def test_an_encrypted_entry_is_refused():
    data = bytearray(_archive())
    central = data.rindex(b"PK\x01\x02", 0, data.index(b"PK\x05\x06"))
    data[central + 8] |= 1  # general purpose flag bit 0: encrypted
    with pytest.raises(CorruptCheckpointError, match="encrypted"):
        locate_tensor(io.BytesIO(bytes(data)), 0, len(data), source="x")



@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_the_rows_fast_path_accepts_only_what_the_full_check_accepts(data):
    from fsdpckpt.dcp import checks

    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    rows = data.draw(st.lists(st.tuples(st.integers(-1, 7), st.integers(-1, 7)),
                              min_size=1, max_size=6))
    boxes = []
    for start, count in rows:  # mostly FSDP2's layout, sometimes a dim off by one
        rest_o = [0] * (ndim - 1)
        rest_s = list(shape[1:])
        if ndim > 1 and data.draw(st.booleans()) and data.draw(st.booleans()):
            d = data.draw(st.integers(0, ndim - 2))
            rest_s[d] += data.draw(st.sampled_from([-1, 1]))
        boxes.append(([start, *rest_o], [count, *rest_s]))
    tensor = _tensor(shape, boxes)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(checks, "_rows_tile", lambda *_: False)
        full = check_tensor_chunks(tensor)
    if checks._rows_tile(tensor.shape, tensor.chunks):
        assert full == []
    assert check_tensor_chunks(tensor) == full


def test_fsdp2s_rows_with_empty_trailing_shards_tile_by_the_fast_path():
    from fsdpckpt.dcp import checks

    boxes = [([0, 0], [2, 6]), ([2, 0], [1, 6]), ([3, 0], [0, 6]), ([3, 0], [0, 6])]
    assert checks._rows_tile((3, 6), _tensor((3, 6), boxes).chunks)
    assert check_tensor_chunks(_tensor((3, 6), boxes)) == []
