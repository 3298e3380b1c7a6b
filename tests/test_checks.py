"""Structural checks: chunks tile each tensor exactly; every byte they need exists."""

from __future__ import annotations

from fsdpckpt.dcp.checks import check_folder, check_tensor_chunks
from fsdpckpt.dcp.dtypes import DTYPES
from fsdpckpt.dcp.metadata import Chunk, TensorEntry
from fsdpckpt.dcp.reader import read_dcp_folder


def _tensor(shape, *boxes):
    chunks = tuple(Chunk(tuple(o), tuple(s), "__0_0.distcp", 0, 1) for o, s in boxes)
    return TensorEntry("w", DTYPES["float32"], tuple(shape), chunks, ("w",))


def test_exact_dim0_split_is_whole():
    assert check_tensor_chunks(_tensor((5, 3), ((0, 0), (3, 3)), ((3, 0), (2, 3)))) == []


def test_exact_two_dim_grid_is_whole():
    grid = [((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]
    assert check_tensor_chunks(_tensor((4, 4), *grid)) == []


def test_zero_dim_tensor_with_one_chunk_is_whole():
    assert check_tensor_chunks(_tensor((), ((), ()))) == []


def test_gap_is_reported():
    (message,) = check_tensor_chunks(_tensor((5, 3), ((0, 0), (2, 3)), ((3, 0), (2, 3))))
    assert "gap" in message and "12 of 15" in message


def test_overlap_is_reported():
    (message,) = check_tensor_chunks(_tensor((4, 3), ((0, 0), (3, 3)), ((2, 0), (2, 3))))
    assert "overlap" in message


def test_overlap_hidden_by_a_matching_gap_is_reported():
    # Volumes add up (8 + 8 = 16) but the chunks overlap and leave a hole.
    boxes = [((0, 0), (2, 4)), ((1, 0), (2, 4))]
    (message,) = check_tensor_chunks(_tensor((4, 4), *boxes))
    assert "overlap" in message


def test_chunk_outside_the_shape_is_reported():
    (message,) = check_tensor_chunks(_tensor((4,), ((0,), (2,)), ((2,), (3,))))
    assert "outside the shape" in message


def test_tensor_without_chunks_is_reported():
    assert check_tensor_chunks(_tensor((4,))) == ["has no chunks"]


def test_every_fixture_is_whole(dcp_folder):
    assert check_folder(read_dcp_folder(dcp_folder)) == []



def test_missing_rank_file_is_reported_once(dtensor_copy):
    (dtensor_copy / "__1_0.distcp").unlink()
    (problem,) = check_folder(read_dcp_folder(dtensor_copy))
    assert problem.path == str(dtensor_copy / "__1_0.distcp")
    assert "missing file" in problem.message and "more" in problem.message


# --- Problem: the one problem type -----------------------------------------------------------

def test_a_problem_reads_as_path_colon_message():
    from fsdpckpt.dcp.checks import Problem

    assert str(Problem("ck/a", "gap")) == "ck/a: gap"


def test_a_problem_to_json_is_path_and_message_in_that_order():
    from fsdpckpt.dcp.checks import Problem

    assert list(Problem("ck/a", "gap").to_json().items()) == [("path", "ck/a"),
                                                             ("message", "gap")]


def test_a_problem_is_still_read_by_key_as_when_it_was_a_dict():
    import pytest

    from fsdpckpt.dcp.checks import Problem

    problem = Problem("ck/a", "gap")
    assert (problem["path"], problem["message"]) == ("ck/a", "gap")
    with pytest.raises(KeyError):
        problem["detail"]
    with pytest.raises(TypeError):
        iter(problem)


def test_inspect_and_check_folder_report_the_same_problem_type(dtensor_copy):
    from fsdpckpt.dcp.checks import Problem
    from fsdpckpt.inspection.inspect import inspect_checkpoint

    (dtensor_copy / "__1_0.distcp").unlink()
    found = check_folder(read_dcp_folder(dtensor_copy))
    report = inspect_checkpoint(dtensor_copy)
    assert report.problems == tuple(found) and all(type(p) is Problem for p in found)
