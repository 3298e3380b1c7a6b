"""`fsdpckpt convert`: what it accepts, and one clear line for everything else."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import fsdpckpt
from fsdpckpt.errors import CorruptCheckpointError, NotACheckpointError, UnsafePickleError

from conftest import DCP_FOLDERS, FIXTURES, assert_one_line_error, hostile_pickle
from conftest import run_cli as run

ACCEPTS = "convert reads a .safetensors file, a .bin/.pt file written by torch.save"


@pytest.fixture
def weights():
    return {"layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "layer.bias": torch.tensor([1, 2, 3], dtype=torch.int64)}


def assert_nothing_written(tmp_path, out="dcp"):
    """No output folder and no staging folder left behind."""
    assert not (tmp_path / out).exists()
    assert not [p for p in tmp_path.iterdir() if ".fsdpckpt-tmp-" in p.name]


def converted(folder):
    """The model the DCP folder holds, through fsdpckpt's own reader."""
    return fsdpckpt.load_full_state_dict(folder)["model"]


# --- files that are not a state dict ------------------------------------------------

def test_a_text_file_says_it_holds_text_and_what_convert_reads(tmp_path):
    (tmp_path / "notes.txt").write_text("remember to merge\n")
    result = run("convert", tmp_path / "notes.txt", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "notes.txt", "holds text", ACCEPTS)
    assert "unexpected" not in result.stderr
    assert_nothing_written(tmp_path)


def test_random_bytes_in_a_bin_file_are_not_a_torch_save_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(os.urandom(4096).replace(b"\x80", b"\x81"))
    result = run("convert", tmp_path / "model.bin", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "model.bin", "not a safetensors or torch.save file",
                          ACCEPTS)
    assert_nothing_written(tmp_path)


def test_an_empty_file_says_so(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    assert_one_line_error(run("convert", tmp_path / "model.bin", tmp_path / "dcp"),
                          tmp_path / "model.bin", "empty")


@pytest.mark.parametrize("keep", [0.3, 0.9], ids=["in-the-header", "in-the-data"])
def test_a_truncated_safetensors_file_says_truncated(tmp_path, weights, keep):
    save_file(weights, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:int(len(data) * keep)])
    result = run("convert", tmp_path / "model.safetensors", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "model.safetensors", "truncated")
    assert_nothing_written(tmp_path)


def test_a_truncated_bin_file_says_truncated(tmp_path, weights):
    torch.save(weights, tmp_path / "model.bin")
    os.truncate(tmp_path / "model.bin", (tmp_path / "model.bin").stat().st_size - 100)
    result = run("convert", tmp_path / "model.bin", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "model.bin", "truncated")
    assert_nothing_written(tmp_path)


def test_a_zip_that_torch_did_not_write_is_one_clear_error(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "model.bin", "w") as archive:
        archive.writestr("readme.txt", "not a model")
    result = run("convert", tmp_path / "model.bin", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "model.bin", "not a readable torch.save file")
    assert "unexpected" not in result.stderr
    assert_nothing_written(tmp_path)


def test_a_torch_save_file_that_holds_no_dict_says_what_it_holds(tmp_path):
    torch.save([torch.ones(2)], tmp_path / "model.bin")
    with pytest.raises(NotACheckpointError, match="holds a list, not a state dict"):
        fsdpckpt.convert(tmp_path / "model.bin", tmp_path / "dcp")
    assert_nothing_written(tmp_path)


# --- hostile pickles never run -------------------------------------------------------

def test_a_hostile_pickle_named_bin_is_refused_and_never_runs(tmp_path):
    sentinel = tmp_path / "pwned"
    (tmp_path / "model.bin").write_bytes(hostile_pickle(sentinel))
    result = run("convert", tmp_path / "model.bin", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "model.bin", "not a safetensors or torch.save file")
    assert not sentinel.exists()
    assert_nothing_written(tmp_path)


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_torch_save_archive_with_a_hostile_pickle_is_refused_and_never_runs(tmp_path):
    sentinel = tmp_path / "pwned"
    torch.save({"weight": torch.ones(2), "payload": _RunsCommand(f"touch {sentinel}")},
               tmp_path / "pytorch_model.bin")
    result = run("convert", tmp_path / "pytorch_model.bin", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "pytorch_model.bin", "refused", "system",
                          "nothing in it was run")
    assert not sentinel.exists()
    assert_nothing_written(tmp_path)
    with pytest.raises(UnsafePickleError):
        fsdpckpt.convert(tmp_path / "pytorch_model.bin", tmp_path / "dcp")


# --- folders -------------------------------------------------------------------------

@pytest.mark.parametrize("folder", [FIXTURES / "fsdp2_accelerate", DCP_FOLDERS["fsdp2-model"]],
                         ids=["checkpoint", "dcp-folder"])
def test_a_dcp_checkpoint_folder_points_to_merge(tmp_path, folder):
    result = run("convert", folder, tmp_path / "dcp")
    assert_one_line_error(result, folder, "a DCP checkpoint already", f"fsdpckpt merge {folder}")
    assert "no such file" not in result.stderr
    assert_nothing_written(tmp_path)


def test_a_folder_holding_model_safetensors_converts_that_file(tmp_path, weights):
    (tmp_path / "hf").mkdir()
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text("{}")
    result = run("convert", tmp_path / "hf", tmp_path / "dcp")
    assert result.exit_code == 0, result.output
    assert f"converted {tmp_path / 'hf' / 'model.safetensors'} -> " in result.stdout
    got = converted(tmp_path / "dcp")
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], v) for k, v in weights.items())


def test_a_folder_prefers_safetensors_over_bin(tmp_path, weights):
    (tmp_path / "hf").mkdir()
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    torch.save({"other": torch.zeros(1)}, tmp_path / "hf" / "pytorch_model.bin")
    result = fsdpckpt.convert(tmp_path / "hf", tmp_path / "dcp")
    assert result.source == tmp_path / "hf" / "model.safetensors"
    assert converted(tmp_path / "dcp").keys() == weights.keys()


def test_a_folder_without_a_model_file_names_a_file_to_pass(tmp_path, weights):
    (tmp_path / "merged").mkdir()
    save_file(weights, tmp_path / "merged" / "optimizer.safetensors")
    result = run("convert", tmp_path / "merged", tmp_path / "dcp")
    assert_one_line_error(result, tmp_path / "merged", "without model.safetensors",
                          tmp_path / "merged" / "optimizer.safetensors")
    assert "no such file" not in result.stderr


def test_an_unrelated_folder_says_what_convert_reads(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    assert_one_line_error(run("convert", tmp_path / "notes", tmp_path / "dcp"),
                          tmp_path / "notes", ACCEPTS)


# --- what it accepts -------------------------------------------------------------------

def test_a_legacy_torch_save_file_converts(tmp_path, weights):
    torch.save(weights, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    assert run("convert", tmp_path / "old.bin", tmp_path / "dcp").exit_code == 0
    got = converted(tmp_path / "dcp")
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in weights.items())


def test_files_are_recognized_by_content_not_name(tmp_path, weights):
    save_file(weights, tmp_path / "weights.bin")  # safetensors bytes, a misleading name
    assert run("convert", tmp_path / "weights.bin", tmp_path / "dcp").exit_code == 0
    assert converted(tmp_path / "dcp").keys() == weights.keys()


# --- shard indexes ---------------------------------------------------------------------

def test_a_malformed_shard_index_is_one_clear_error(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    with pytest.raises(NotACheckpointError, match="not a shard index"):
        fsdpckpt.convert(tmp_path / "model.safetensors.index.json", tmp_path / "dcp")
    assert_nothing_written(tmp_path)


def test_a_shard_index_naming_a_missing_shard_names_it(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    assert_one_line_error(run("convert", tmp_path / "model.safetensors.index.json",
                              tmp_path / "dcp"),
                          tmp_path / "model-00001-of-00002.safetensors", "missing")
    assert_nothing_written(tmp_path)


def test_a_damaged_shard_is_found_before_anything_is_written(tmp_path):
    fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path / "m", max_shard_size=400)
    shards = sorted((tmp_path / "m").glob("model-*.safetensors"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:50])
    with pytest.raises(CorruptCheckpointError, match=shards[-1].name):
        fsdpckpt.convert(tmp_path / "m" / "model.safetensors.index.json", tmp_path / "dcp")
    assert_nothing_written(tmp_path)


def test_a_shard_index_may_not_name_files_outside_its_folder(tmp_path, weights):
    save_file(weights, tmp_path / "elsewhere.safetensors")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"layer.weight": "../elsewhere.safetensors"}}')
    assert_one_line_error(run("convert", tmp_path / "m", tmp_path / "dcp"),
                          "../elsewhere.safetensors", "outside the index's folder")
    assert_nothing_written(tmp_path)


def test_json_report_names_the_file_read(tmp_path, weights):
    import json

    (tmp_path / "hf").mkdir()
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    doc = json.loads(run("convert", tmp_path / "hf", tmp_path / "dcp", "--json").stdout)
    assert doc == {"source": str(tmp_path / "hf" / "model.safetensors"),
                   "output": str(tmp_path / "dcp"), "tensors": 2, "objects": 0, "bytes": 72}


def test_a_bin_merge_holding_sets_and_complex_values_converts_back(tmp_path):
    import fsdpckpt

    from conftest import FIXTURES, skip_unless_torch_has_dtypes

    skip_unless_torch_has_dtypes(FIXTURES / "dtypes")  # convert builds torch tensors
    (merged,) = fsdpckpt.merge(FIXTURES / "dtypes", tmp_path / "out", format="bin")
    result = fsdpckpt.convert(merged.path, tmp_path / "back", key=None)
    assert result.objects > 0
    assert fsdpckpt.load_full_state_dict(tmp_path / "back")


def test_progress_is_a_factory_told_the_total_first_and_given_all_of_it(tmp_path):
    """As for merge and verify: one call with the total before any byte, then byte counts
    that add up to it."""
    from safetensors.torch import save_file

    source = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(1000), "b": torch.ones(3, 7)}, str(source))
    calls: list = []

    def factory(total, files):
        calls.append(("start", total, files))
        return lambda nbytes: calls.append(("bytes", nbytes))

    fsdpckpt.convert(source, tmp_path / "dcp", progress=factory)
    assert calls[0] == ("start", source.stat().st_size, 1)
    assert all(kind == "bytes" for kind, *_ in calls[1:])
    assert sum(c[1] for c in calls[1:]) == source.stat().st_size
