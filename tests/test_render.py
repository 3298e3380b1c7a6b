"""``fsdpckpt._render``: byte sizes, aligned tables, and the human form of the typed reports.

Reports are built by hand here, so each behaviour of the drawing is pinned without a
checkpoint on disk; names from a checkpoint are always shown escaped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpckpt._render import human_bytes, render_inspect, render_verify, table
from fsdpckpt.dcp.checks import Problem
from fsdpckpt.dcp.dtypes import DType
from fsdpckpt.dcp.layout import SideFile
from fsdpckpt.dcp.metadata import Chunk, DataFile, ObjectEntry
from fsdpckpt.inspection.report import InspectReport, PartReport, TensorReport, VerifyReport

_EVIL = "w\n\x1b[2J\u202ex"
_SHOWN = "w\\n\\x1b[2J\\u202ex"
_F32 = DType("float32", 4, "F32", True, "FloatStorage")


def _tensor(name: str = "layer.weight") -> TensorReport:
    chunks = (Chunk((0, 0), (2, 4), "__0_0.distcp", 0, 100),
              Chunk((2, 0), (2, 4), "__1_0.distcp", 64, 100))
    return TensorReport(name, _F32, (4, 4), 64, "dim0 x2", chunks)


def _part(*, tensors: tuple[TensorReport, ...] = (), objects: tuple[ObjectEntry, ...] = (),
          name: str = "pytorch_model_fsdp_0") -> PartReport:
    return PartReport(name, "model", 0, Path("ck") / name, True, version="1.0.0",
                      world_size=2, world_size_exact=True, bytes=3000, tensor_bytes=64,
                      num_tensors=len(tensors), num_objects=len(objects),
                      dtypes={"float32": len(tensors)},
                      files=(DataFile("__0_0.distcp", 1500), DataFile("__1_0.distcp", 1500)),
                      tensors=tensors, objects=objects)


def _report(*parts: PartReport, problems: tuple[Problem, ...] = (),
            side_files: tuple[SideFile, ...] = (), other_files: tuple[str, ...] = (),
            exact: bool = True) -> InspectReport:
    return InspectReport(Path("ck"), "accelerate", 2, exact, 3000, parts, side_files,
                         other_files, problems)


# --- human_bytes ---------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "shown"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (5 * 1024**3, "5.0 GiB"), (3 * 1024**5, "3072.0 TiB"), (100.7, "100 B"),
])
def test_human_bytes_picks_the_largest_unit_below_1024(n, shown):
    assert human_bytes(n) == shown


# --- table ---------------------------------------------------------------------------------

def test_table_pads_each_column_to_its_widest_cell():
    assert table([["a", "bbb"], ["cc", "d"]]) == ["  a   bbb", "  cc  d"]


def test_table_right_aligns_the_columns_asked():
    assert table([["x", 5], ["yy", 100]], right=(1,)) == ["  x     5", "  yy  100"]


def test_table_puts_the_header_first_and_counts_it_in_the_widths():
    assert table([["a", "1"]], header=["name", "n"], indent="") == ["name  n", "a     1"]


def test_table_strips_trailing_spaces():
    assert table([["a", ""], ["bb", ""]]) == ["  a", "  bb"]


def test_table_of_nothing_is_no_lines():
    assert table([]) == []


# --- render_inspect ------------------------------------------------------------------------

def test_inspect_header_names_style_world_size_and_bytes():
    first = render_inspect(_report(_part())).splitlines()[0]
    assert first == "ck: Accelerate checkpoint, world size 2, 2.9 KiB"


def test_inspect_says_when_the_world_size_is_a_lower_bound():
    assert "world size at least 2," in render_inspect(_report(_part(), exact=False))


def test_inspect_lists_each_tensor_with_dtype_shape_chunks_sharding_and_bytes():
    out = render_inspect(_report(_part(tensors=(_tensor(),))))
    row = next(line for line in out.splitlines() if line.strip().startswith("layer.weight"))
    assert row.split() == ["layer.weight", "float32", "[4,", "4]", "2", "dim0", "x2", "64", "B"]


def test_inspect_chunks_lists_file_and_offset_of_each_chunk():
    out = render_inspect(_report(_part(tensors=(_tensor(),))), chunks=True)
    assert "@ [2, 0] size [2, 4]" in out and "__1_0.distcp +64" in out


def test_inspect_summary_has_no_tensor_table_and_one_line_of_rank_files():
    out = render_inspect(_report(_part(tensors=(_tensor(),))), tensors=False)
    assert "layer.weight" not in out and "sharding" not in out
    assert "  2 rank files, 2.9 KiB, 1.5 KiB each" in out.splitlines()


def test_inspect_summary_groups_per_rank_side_files_of_a_kind():
    sides = (SideFile("random_states_0.pkl", "rng", 0, 10),
             SideFile("random_states_1.pkl", "rng", 1, 10), SideFile("scheduler.bin", "scheduler",
                                                                      None, 5))
    out = render_inspect(_report(_part(), side_files=sides), tensors=False)
    assert "random_states_0.pkl .. random_states_1.pkl  2 ranks" in out
    assert "scheduler.bin" in out


def test_inspect_marks_a_part_without_metadata_incomplete():
    part = PartReport("optimizer_0", "optimizer", 0, Path("ck/optimizer_0"), False)
    out = render_inspect(_report(_part(), part,
                                 problems=(Problem("ck/optimizer_0", "no .metadata"),)))
    row = next(line for line in out.splitlines() if "optimizer_0/" in line)
    assert row.split() == ["optimizer", "optimizer_0/", "INCOMPLETE", "(no", ".metadata)"]
    assert "optimizer_0/ (optimizer)" not in out  # no section for a part that has no contents


def test_inspect_lists_problems_instead_of_structure_ok():
    problems = (Problem("ck/a", "gap"), Problem("ck/b", "truncated"))
    out = render_inspect(_report(_part(), problems=problems))
    assert "Problems (2):\n  ck/a: gap\n  ck/b: truncated" in out
    assert "Structure: OK" not in out


def test_inspect_without_problems_says_structure_ok():
    assert render_inspect(_report(_part())).endswith("Structure: OK (every chunk present, "
                                                     "every tensor fully covered)")


def test_inspect_says_when_no_name_matches_the_filter():
    out = render_inspect(_report(_part()), names="nope*")
    assert "No tensor or object name matches 'nope*'." in out


def test_inspect_lists_object_names():
    obj = ObjectEntry("optimizer.param_groups.0.lr", "__0_0.distcp", 0, 10, ("optimizer",))
    assert "  objects: optimizer.param_groups.0.lr" in render_inspect(_report(_part(
        objects=(obj,))))


def _report_named(name: str) -> InspectReport:
    obj = ObjectEntry(name, name, 0, 10, (name,))
    part = _part(tensors=(_tensor(name),), objects=(obj,), name=name)
    return InspectReport(Path(name), "dcp", 2, True, 3000, (part,),
                         (SideFile(name, "custom", None, 1),), (name,), (Problem(name, name),))


def test_inspect_escapes_every_name_from_the_checkpoint():
    out = render_inspect(_report_named(_EVIL), chunks=True)
    assert "\x1b" not in out and "\u202e" not in out and _SHOWN in out
    # a crafted name adds no line: the report has the lines it has with a plain name
    plain = render_inspect(_report_named("plain"), chunks=True)
    assert len(out.splitlines()) == len(plain.splitlines())
    assert out.replace(_SHOWN, "plain").split() == plain.split()


# --- render_verify -------------------------------------------------------------------------

def test_verify_of_a_whole_checkpoint_without_manifest_is_one_ok_line():
    report = VerifyReport(Path("ck"), False, None, None, ())
    assert render_verify(report, "ck") == ("ck: OK (no manifest: chunk headers and data "
                                           "checked against their own checksums)")


def test_verify_lists_each_problem_then_damaged():
    report = VerifyReport(Path("ck"), True, "sha256:ab", None, (Problem("ck/a", "bad byte"),))
    lines = render_verify(report, "ck").splitlines()
    assert lines[0] == "ck/a: bad byte"
    assert lines[1] == "ck: DAMAGED (every byte checked against the manifest)"


def test_verify_shows_the_manifest_digest_and_what_the_files_carry():
    crc_only = render_verify(VerifyReport(Path("ck"), True, "sha256:ab", None, ()), "ck")
    assert "manifest digest: sha256:ab (files carry CRC-32 only" in crc_only
    hashed = render_verify(VerifyReport(Path("ck"), True, "sha256:ab", "sha256", ()), "ck")
    assert hashed.endswith("manifest digest: sha256:ab (files carry sha256)")


def test_verify_escapes_paths_and_messages():
    report = VerifyReport(Path("ck"), False, None, None, (Problem(_EVIL, _EVIL),))
    out = render_verify(report, _EVIL)
    assert out.splitlines()[0] == f"{_SHOWN}: {_SHOWN}" and len(out.splitlines()) == 2
