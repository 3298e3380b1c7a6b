"""``fsdpckpt diff A B`` and ``fsdpckpt.diff``: two state sources compared tensor by tensor.

A merge equals its source; a change, a cast, a missing or extra name, a shape or dtype change
is found and measured; every kind of source lines up with every other; memory stays flat.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import fsdpckpt
from fsdpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from fsdpckpt.inspection import diff as diff_module
from fsdpckpt.merging._runs import boxes

from conftest import (
    DCP_FOLDERS,
    FIXTURES,
    assert_one_line_error,
    peak_rss_mib,
    reference_state_dict,
    skip_unless_torch_has_dtypes,
)
from conftest import run_cli as run

MODEL = FIXTURES / "fsdp2_accelerate" / "pytorch_model_fsdp_0"


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """The FSDP2 fixture's model merged to model.safetensors."""
    out = tmp_path_factory.mktemp("merged")
    fsdpckpt.merge(FIXTURES / "fsdp2_accelerate", out)
    return out / "model.safetensors"


def _changed(src, dst, name, index, value):
    state = load_file(str(src))
    state[name].view(-1)[index] = value
    save_file(state, str(dst))
    return dst


# ---- a merge equals its source -------------------------------------------------------------

def test_every_fixture_equals_its_merge(tmp_path, dcp_folder):
    fsdpckpt.merge(dcp_folder, tmp_path)
    (output,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    report = fsdpckpt.diff(dcp_folder, output)
    assert report.equal, report.to_json()
    assert report.tensors and all(t.identical for t in report.tensors)
    assert not report.missing and not report.unexpected


def test_a_compressed_dcp_folder_equals_its_merge(tmp_path):
    fsdpckpt.merge(FIXTURES / "dcp_zstd", tmp_path)
    report = fsdpckpt.diff(FIXTURES / "dcp_zstd", tmp_path / "model.safetensors")
    assert report.equal and report.tensors and all(t.identical for t in report.tensors)


def test_the_dtype_matrix_equals_its_bin_merge_bit_for_bit(tmp_path):
    skip_unless_torch_has_dtypes(FIXTURES / "dtypes")  # the .bin side is read by torch.load
    fsdpckpt.merge(FIXTURES / "dtypes", tmp_path, format="bin")
    report = fsdpckpt.diff(FIXTURES / "dtypes", tmp_path / "pytorch_model.bin")
    assert report.equal and all(t.identical for t in report.tensors)
    assert len(report.objects) > 0 and all(o.equal for o in report.objects)


def test_a_whole_checkpoint_means_its_model_and_exit_0_when_equal(merged):
    result = run("diff", FIXTURES / "fsdp2_accelerate", merged.parent)
    assert result.exit_code == 0, result.output
    assert "EQUAL: 4 tensors (4 bit-identical)" in result.stdout


def test_optimizer_compares_the_optimizer_state_and_its_objects(tmp_path):
    fsdpckpt.merge(FIXTURES / "fsdp2_accelerate", tmp_path, optimizer=True)
    report = fsdpckpt.diff(FIXTURES / "fsdp2_accelerate", tmp_path, optimizer=True)
    assert report.equal
    assert any(t.name.endswith("exp_avg") for t in report.tensors)
    assert any(o.name.startswith("param_groups.") for o in report.objects)


def test_torch_save_of_the_reference_equals_the_dcp_folder(tmp_path):
    # dcp_to_torch_save nests under "model", which the comparison drops as merge does.
    torch.save(reference_state_dict(MODEL), tmp_path / "ref.pt")
    assert fsdpckpt.diff(tmp_path / "ref.pt", MODEL).equal


# ---- differences found and measured --------------------------------------------------------

def test_a_changed_element_is_found_with_its_abs_and_rel_difference(merged, tmp_path):
    before = load_file(str(merged))["0.weight"].view(-1)[5].item()
    changed = _changed(merged, tmp_path / "x.safetensors", "0.weight", 5, before + 0.5)
    report = fsdpckpt.diff(MODEL, changed)
    assert not report.equal
    (bad,) = report.differing
    assert bad.name == "0.weight" and bad.mismatched == 1 and not bad.identical
    assert bad.max_abs == pytest.approx(0.5, rel=1e-6)
    assert bad.max_rel == pytest.approx(0.5 / abs(before + 0.5), rel=1e-5)


def test_a_change_is_exit_1_with_a_table_and_a_summary(merged, tmp_path):
    changed = _changed(merged, tmp_path / "x.safetensors", "2.bias", 0, 100.0)
    result = run("diff", MODEL, changed)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert any(line.split()[:1] == ["2.bias"] and "1/5" in line for line in lines)
    assert lines[-1].startswith("DIFFERENT: 1 of 4 tensors differ")


def test_a_tolerance_accepts_a_small_change(merged, tmp_path):
    before = load_file(str(merged))["0.bias"].view(-1)[0].item()
    changed = _changed(merged, tmp_path / "x.safetensors", "0.bias", 0, before + 1e-3)
    assert not fsdpckpt.diff(MODEL, changed).equal
    assert fsdpckpt.diff(MODEL, changed, atol=2e-3).equal
    assert run("diff", MODEL, changed, "--atol", "2e-3").exit_code == 0


def test_a_bf16_export_differs_exactly_and_passes_with_rtol(tmp_path):
    fsdpckpt.merge(MODEL, tmp_path, dtype="bf16")
    exact = fsdpckpt.diff(MODEL, tmp_path)
    assert not exact.equal
    assert all(t.dtype_differs for t in exact.differing)
    assert run("diff", MODEL, tmp_path).exit_code == 1
    loose = fsdpckpt.diff(MODEL, tmp_path, rtol=2**-8)  # bf16 rounds to 8 significant bits
    assert loose.equal, loose.to_json()
    assert all(t.dtype_a == "float32" and t.dtype_b == "bfloat16" for t in loose.tensors)
    assert run("diff", MODEL, tmp_path, "--rtol", "0.004").exit_code == 0


def test_a_dtype_change_with_equal_values_is_a_difference_when_exact(tmp_path):
    save_file({"w": torch.tensor([1.0, 2.0])}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}, str(tmp_path / "b.safetensors"))
    (t,) = fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors").tensors
    assert not t.equal and t.dtype_differs and t.max_abs == 0
    assert fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                         atol=1e-12).equal


def test_missing_and_unexpected_names(merged, tmp_path):
    state = load_file(str(merged))
    del state["2.bias"]
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "x.safetensors"))
    report = fsdpckpt.diff(MODEL, tmp_path / "x.safetensors")
    assert report.missing == ("2.bias",) and report.unexpected == ("extra.weight",)
    assert not report.equal and not report.differing
    result = run("diff", MODEL, tmp_path / "x.safetensors")
    assert result.exit_code == 1
    assert "missing (in A, not in B) (1): 2.bias" in result.stdout
    assert "unexpected (in B, not in A) (1): extra.weight" in result.stdout


def test_a_shape_mismatch_is_reported_without_values(tmp_path):
    save_file({"w": torch.zeros(2, 3)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(3, 2)}, str(tmp_path / "b.safetensors"))
    (t,) = fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors").tensors
    assert t.shape_differs and not t.equal and t.max_abs is None
    result = run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert "[2, 3] -> [3, 2]" in result.stdout and result.exit_code == 1


def test_nan_at_the_same_position_is_equal_and_nan_against_a_number_is_not(tmp_path):
    nan = float("nan")
    save_file({"w": torch.tensor([1.0, nan, -0.0])}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([1.0, nan, 0.0])}, str(tmp_path / "b.safetensors"))
    save_file({"w": torch.tensor([1.0, 2.0, 0.0])}, str(tmp_path / "c.safetensors"))
    same = fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    (t,) = same.tensors
    assert same.equal and not t.identical  # equal values, not equal bits (-0.0)
    (t,) = fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "c.safetensors").tensors
    assert not t.equal and t.mismatched == 1 and t.max_abs == math.inf


def test_opposite_infinities_differ_whatever_the_tolerance(tmp_path):
    save_file({"w": torch.tensor([math.inf])}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([-math.inf])}, str(tmp_path / "b.safetensors"))
    assert not fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                             rtol=10.0).equal


def test_objects_are_compared_by_value(tmp_path):
    from fsdpckpt.dcp._objects import dumps, loads
    from fsdpckpt.formats.safetensors import OBJECTS_KEY

    fsdpckpt.merge(FIXTURES / "dtensor", tmp_path)
    path = tmp_path / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    values = loads(meta[OBJECTS_KEY])
    values["step"] = 8
    save_file(load_file(str(path)), str(tmp_path / "x.safetensors"),
              metadata={**meta, OBJECTS_KEY: dumps(values)})
    report = fsdpckpt.diff(FIXTURES / "dtensor", tmp_path / "x.safetensors")
    assert [o.name for o in report.objects if not o.equal] == ["step"]
    assert not report.equal and not report.differing


# ---- every kind of source ------------------------------------------------------------------

def test_bin_and_safetensors_merges_are_equal(tmp_path):
    fsdpckpt.merge(MODEL, tmp_path / "st")
    fsdpckpt.merge(MODEL, tmp_path / "bin", format="bin")
    report = fsdpckpt.diff(tmp_path / "bin" / "pytorch_model.bin", tmp_path / "st")
    assert report.equal and len(report.tensors) == 4


def test_a_hugging_face_folder_with_an_index_equals_the_checkpoint(tmp_path):
    fsdpckpt.merge(FIXTURES / "fsdp1", tmp_path, max_shard_size="1KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    report = fsdpckpt.diff(tmp_path, FIXTURES / "fsdp1")
    assert report.equal and len(report.tensors) == 4
    assert report.a == str(tmp_path / "model.safetensors.index.json")


def test_chunks_cut_across_boxes_read_the_right_elements(tmp_path, monkeypatch):
    from chunked import split, write_dcp

    value = torch.arange(11 * 13, dtype=torch.float32).reshape(11, 13)
    folder = write_dcp(tmp_path / "ckpt", {
        "dim0": (value, split([0])), "dim1": (value, split([1], parts=3)),
        "grid": (value, split([0, 1])), "transposed": (value, split([0], transpose=True))})
    save_file({n: value.clone() for n in ("dim0", "dim1", "grid", "transposed")},
              str(tmp_path / "ref.safetensors"))
    monkeypatch.setattr(diff_module, "BOX_ELEMENTS", 5)  # boxes of part of a row
    report = fsdpckpt.diff(folder, tmp_path / "ref.safetensors")
    assert report.equal and all(t.identical for t in report.tensors), report.to_json()


def test_wrapper_segments_are_dropped_unless_keep_keys(tmp_path):
    save_file({"_orig_mod.w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    assert fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors").equal
    kept = fsdpckpt.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", keep_keys=True)
    assert kept.missing == ("_orig_mod.w",) and kept.unexpected == ("w",)


# ---- options and output --------------------------------------------------------------------

def test_name_filters_limit_what_is_compared(merged, tmp_path):
    changed = _changed(merged, tmp_path / "x.safetensors", "2.bias", 0, 100.0)
    report = fsdpckpt.diff(MODEL, changed, names=["0.*"])
    assert report.equal and [t.name for t in report.tensors] == ["0.weight", "0.bias"]
    assert run("diff", MODEL, changed, "--name", "*.weight", "--name", "0.").exit_code == 0
    assert run("diff", MODEL, changed, "--name", "2.").exit_code == 1


def test_json_is_one_document_with_the_verdict_and_every_tensor(merged, tmp_path):
    changed = _changed(merged, tmp_path / "x.safetensors", "2.bias", 0, 100.0)
    result = run("diff", MODEL, changed, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert set(doc) == {"a", "b", "atol", "rtol", "equal", "missing", "unexpected", "tensors",
                        "objects", "tied", "names", "summary"}
    assert doc["equal"] is False and doc["summary"]["differing"] == 1
    bad = next(t for t in doc["tensors"] if t["name"] == "2.bias")
    assert set(bad) == {"name", "dtype", "shape", "equal", "identical", "max_abs", "max_rel",
                        "mismatched", "numel", "rel_change"}
    assert bad["dtype"] == ["float32", "float32"] and bad["shape"] == [[5], [5]]
    assert bad["rel_change"] is None  # computed with --html (tests/test_reports.py)


def test_json_writes_infinity_as_a_string(tmp_path):
    save_file({"w": torch.tensor([0.0])}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([math.inf])}, str(tmp_path / "b.safetensors"))
    doc = json.loads(run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors",
                         "--json").stdout)
    assert doc["tensors"][0]["max_abs"] == "inf"


def test_a_negative_tolerance_is_refused():
    with pytest.raises(ValueError, match="atol"):
        fsdpckpt.diff(MODEL, MODEL, atol=-1)
    assert run("diff", MODEL, MODEL, "--rtol", "-1").exit_code == 2  # click's usage error


def test_a_missing_side_is_one_error_line(tmp_path):
    assert_one_line_error(run("diff", MODEL, tmp_path / "nope"), tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError):
        fsdpckpt.diff(MODEL, tmp_path / "nope")


def test_a_folder_that_holds_nothing_to_compare_is_one_error_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    assert_one_line_error(run("diff", MODEL, tmp_path), str(tmp_path), "merged model")


def test_a_safetensors_header_past_the_end_is_corrupt(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        fsdpckpt.diff(tmp_path / "bad.safetensors", MODEL)


def test_a_tensor_whose_bytes_lie_past_the_data_is_corrupt(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000],
                               "data_offsets": [0, 4000]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(header)) + header +
                                               bytes(16))
    result = run("diff", tmp_path / "bad.safetensors", MODEL)
    assert_one_line_error(result, "bad.safetensors", "'w'", "truncated")


def test_boxes_cover_every_element_once_in_order_and_stay_small():
    for shape, limit in [((11, 13), 5), ((3, 4, 5), 7), ((6,), 4), ((), 3), ((2, 9), 100),
                         ((4, 0), 3)]:
        seen = []
        for offsets, sizes in boxes(shape, limit):
            assert math.prod(sizes) <= max(limit, 1)
            index = torch.arange(math.prod(shape)).reshape(shape)
            seen += index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] \
                .reshape(-1).tolist()
        assert seen == list(range(math.prod(shape))), shape


# ---- memory --------------------------------------------------------------------------------

@pytest.mark.slow
def test_diff_memory_is_flat_for_a_large_tensor(tmp_path):
    from chunked import split, write_dcp

    value = torch.arange(8192 * 8192, dtype=torch.float32).reshape(8192, 8192)  # 256 MiB
    folder = write_dcp(tmp_path / "ckpt", {"dim1": (value, split([1])),
                                           "transposed": (value, split([0], transpose=True))})
    save_file({"dim1": value, "transposed": value.clone()}, str(tmp_path / "ref.safetensors"))
    del value
    imports = "import torch, fsdpckpt, fsdpckpt.inspection.diff\n"
    baseline = peak_rss_mib(imports)
    peak = peak_rss_mib(imports + f"report = fsdpckpt.diff({str(folder)!r}, "
                         f"{str(tmp_path / 'ref.safetensors')!r})\nassert report.equal")
    # Two 256 MiB tensors a side; holding one of them would add 256 MiB.
    assert peak - baseline < 64, (peak, baseline)
    assert peak < 300, peak


def test_the_fixture_folders_are_all_covered():
    # The "every fixture" test above runs over conftest's DCP_FOLDERS; dtypes and dcp_zstd
    # have tests of their own.
    assert set(DCP_FOLDERS.values()) | {FIXTURES / "dtypes", FIXTURES / "dcp_zstd"} >= \
        {p for p in FIXTURES.iterdir() if p.is_dir() and (p / ".metadata").is_file()}


def test_boxes_of_a_tensor_with_thousands_of_dims_do_not_recurse():
    # A crafted .metadata may declare any number of size-1 dims; the walk is a loop.
    shape = (1,) * 5000 + (3,)
    assert list(boxes(shape, 2)) == [((0,) * 5001, (1,) * 5000 + (2,)),
                                     ((0,) * 5000 + (2,), (1,) * 5000 + (1,))]
