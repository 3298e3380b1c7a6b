"""`fsdpckpt inspect`: what users see, and how bad input is answered."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import fsdpckpt

from conftest import DCP_FOLDERS, FIXTURES, assert_one_line_error
from conftest import run_cli as run

# --- what a user sees -------------------------------------------------------

def test_summary_names_parts_side_files_and_world_size():
    result = run("inspect", FIXTURES / "fsdp2_accelerate")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Accelerate checkpoint, world size 2" in out
    for name in ("pytorch_model_fsdp_0/", "optimizer_0/", "random_states_0.pkl",
                 "random_states_1.pkl", "scheduler.bin", "__0_0.distcp", "__1_0.distcp"):
        assert name in out
    assert "dtypes: float32" in out
    assert "Structure: OK" in out


def test_table_describes_sharding_in_words():
    out = run("inspect", DCP_FOLDERS["dtensor"]).stdout
    assert "dim1 x2 uneven" in out
    assert "dim0 x2 uneven" in out
    assert "replicated" in out
    assert "bfloat16" in out and "float16" in out


def test_name_filter_keeps_matching_tensors_only():
    doc = json.loads(run("inspect", FIXTURES / "fsdp2_accelerate", "--json", "--name", "*bias")
                     .stdout)
    names = [t["name"] for p in doc["parts"] for t in p["tensors"]]
    assert names and all(n.endswith("bias") for n in names)


def test_chunk_detail_lists_file_and_offset():
    out = run("inspect", DCP_FOLDERS["dtensor"], "--chunks").stdout
    assert "__0_0.distcp +" in out and "__1_0.distcp +" in out


def test_summary_only_has_no_table():
    out = run("inspect", DCP_FOLDERS["dtensor"], "--summary").stdout
    assert "sharding" not in out and "world size 2" in out


def test_json_is_one_document_with_the_documented_fields():
    result = run("inspect", FIXTURES / "fsdp2_accelerate", "--json")
    doc = json.loads(result.stdout)
    assert set(doc) >= {"path", "style", "ok", "world_size", "bytes", "parts", "side_files",
                        "other_files", "problems"}
    assert doc["ok"] is True and doc["world_size"] == 2 and doc["problems"] == []
    model = doc["parts"][0]
    assert set(model) >= {"name", "kind", "files", "dtypes", "num_tensors", "num_objects",
                          "tensors", "objects", "bytes", "world_size"}
    tensor = model["tensors"][0]
    assert tensor["name"].startswith("model.") and tensor["dtype"] == "float32"
    assert set(tensor["chunks"][0]) == {"offsets", "sizes", "file", "offset", "length"}


def test_inspect_checkpoint_returns_a_typed_report():
    from fsdpckpt import InspectReport, PartReport, TensorReport

    report = fsdpckpt.inspect_checkpoint(FIXTURES / "fsdp2_accelerate")
    assert isinstance(report, InspectReport) and report.ok and report.world_size == 2
    model = report.parts[0]
    assert isinstance(model, PartReport) and model.name == "pytorch_model_fsdp_0"
    assert model.num_tensors == len(model.tensors) > 0 and model.world_size == 2
    assert isinstance(model.tensors[0], TensorReport)
    assert model.tensors[0].dtype.name == "float32" and model.tensors[0].sharding


def test_json_prints_the_reports_to_json_byte_for_byte(accelerate_ckpt):
    from fsdpckpt._cli_common import json_document

    (accelerate_ckpt / "optimizer_0" / ".metadata").unlink()  # an incomplete part, a problem
    result = run("inspect", accelerate_ckpt, "--json")
    report = fsdpckpt.inspect_checkpoint(accelerate_ckpt)
    assert result.stdout == json_document(report) + "\n"
    assert json.loads(result.stdout) == report.to_json()


def test_json_lays_out_the_top_indented_and_a_long_list_one_element_per_line():
    from fsdpckpt._cli_common import json_document

    class Doc:
        def to_json(self):
            return {"a": 1, "parts": [{"tensors": [{"n": i, "c": [[i]]} for i in range(100)]}],
                    "deep": {"x": {"y": {"z": {"w": [1, {"v": 2}]}}}}}

    text = json_document(Doc())
    assert json.loads(text) == Doc().to_json()
    lines = text.splitlines()
    assert lines[0] == "{" and lines[1] == '  "a": 1,'
    assert '        {"n": 7, "c": [[7]]},' in lines  # one compact line per element
    assert any(line.strip() == '"z": {"w": [1, {"v": 2}]}' for line in lines)  # deeper: compact


def test_json_keys_keep_their_order():
    doc = fsdpckpt.inspect_checkpoint(FIXTURES / "fsdp2_accelerate").to_json()
    assert list(doc) == ["path", "style", "ok", "unfinished", "world_size", "world_size_exact",
                         "bytes", "parts", "side_files", "other_files", "problems"]
    assert list(doc["parts"][0]) == [
        "name", "kind", "index", "path", "complete", "version", "world_size",
        "world_size_exact", "bytes", "tensor_bytes", "num_tensors", "num_objects", "dtypes",
        "files", "tensors", "objects"]
    assert list(doc["parts"][0]["tensors"][0]) == ["name", "dtype", "shape", "bytes",
                                                   "sharding", "chunks"]
    assert list(doc["side_files"][0]) == ["name", "kind", "rank", "size"]
    assert list(doc["parts"][0]["files"][0]) == ["name", "size", "rank"]


def test_an_incomplete_part_has_only_its_identity_in_json(accelerate_ckpt):
    (accelerate_ckpt / "optimizer_0" / ".metadata").unlink()
    report = fsdpckpt.inspect_checkpoint(accelerate_ckpt)
    optimizer = report.parts[1]
    assert not optimizer.complete and optimizer.num_tensors == 0 and optimizer.tensors == ()
    assert list(optimizer.to_json()) == ["name", "kind", "index", "path", "complete"]


def test_the_report_is_still_read_by_key_as_the_dict_it_was():
    report = fsdpckpt.inspect_checkpoint(FIXTURES / "fsdp2_accelerate")
    assert report["ok"] is True and report["world_size"] == 2 and report["problems"] == []
    assert report["parts"][0]["tensors"][0]["name"] == report.parts[0].tensors[0].name
    with pytest.raises(KeyError):
        report["no_such_key"]
    with pytest.raises(TypeError):
        iter(report)


def test_python_dash_m_and_console_script_agree():
    args = ["inspect", str(DCP_FOLDERS["dtensor"]), "--json"]
    via_module = subprocess.run([sys.executable, "-m", "fsdpckpt", *args], capture_output=True,
                                text=True, check=True)
    assert json.loads(via_module.stdout) == json.loads(run(*args).stdout)


# --- bad input --------------------------------------------------------------

def test_missing_path(tmp_path):
    assert_one_line_error(run("inspect", tmp_path / "nope"), tmp_path / "nope",
                          "no such file")


def test_empty_folder(tmp_path):
    assert_one_line_error(run("inspect", tmp_path), tmp_path, "empty")


def test_folder_without_metadata(tmp_path, dtensor_copy):
    (dtensor_copy / ".metadata").unlink()
    assert_one_line_error(run("inspect", dtensor_copy), dtensor_copy, "no .metadata",
                          "never finished")


def test_garbage_metadata(dtensor_copy):
    (dtensor_copy / ".metadata").write_bytes(os.urandom(64))
    assert_one_line_error(run("inspect", dtensor_copy), dtensor_copy / ".metadata",
                          "not a readable pickle")



def test_missing_shard_is_a_problem_in_json_too(dtensor_copy):
    (dtensor_copy / "__1_0.distcp").unlink()
    result = run("inspect", dtensor_copy, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    assert [p["path"] for p in doc["problems"]] == [str(dtensor_copy / "__1_0.distcp")]


def test_unfinished_part_of_a_whole_checkpoint_is_a_problem(accelerate_ckpt):
    (accelerate_ckpt / "optimizer_0" / ".metadata").unlink()
    result = run("inspect", accelerate_ckpt)
    assert result.exit_code == 1
    assert "INCOMPLETE" in result.stdout and "optimizer_0: no .metadata" in result.stdout


def test_missing_rng_file_of_a_rank_is_a_problem(accelerate_ckpt):
    (accelerate_ckpt / "random_states_1.pkl").unlink()
    result = run("inspect", accelerate_ckpt)
    assert result.exit_code == 1 and "no RNG state file for rank 1" in result.stdout


def test_debug_shows_the_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fsdpckpt", "inspect", "--debug",
                             str(tmp_path / "nope")], capture_output=True, text=True)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "CheckpointNotFoundError" in result.stderr


def test_errors_without_debug_have_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fsdpckpt", "inspect", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [["--help"], ["inspect", "--help"], ["--version"]])
def test_help_and_version(args):
    result = run(*args)
    assert result.exit_code == 0 and result.stdout


# --- many ranks, and tensors smaller than the world -------------------------------------

def write_sharded(folder, tensors, world):
    """A DCP folder as ``world`` ranks of FSDP2 write it: each tensor split on dim 0 into
    ceil(n / world) rows per rank, the last ranks holding empty chunks at offset n."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from fsdpckpt._torch import dcp_metadata

    folder.mkdir(parents=True)
    handles = [open(folder / f"__{rank}_0.distcp", "wb")  # noqa: SIM115 - closed below
               for rank in range(world)]
    entries, storage, planner = {}, {}, {}
    for name, tensor in tensors.items():
        step, chunks = -(-tensor.shape[0] // world), []
        for rank, handle in enumerate(handles):
            start = min(rank * step, tensor.shape[0])
            piece = tensor[start:start + step].clone()
            offsets = torch.Size([start] + [0] * (tensor.dim() - 1))
            at = handle.tell()
            torch.save(piece, handle)
            chunks.append(ChunkStorageMetadata(offsets, piece.size()))
            storage[MetadataIndex(name, offsets)] = _StorageInfo(handle.name.rsplit("/", 1)[1],
                                                                 at, handle.tell() - at)
        entries[name] = TensorStorageMetadata(TensorProperties.create_from_tensor(tensor),
                                              tensor.size(), chunks)
        planner[name] = tuple(name.split("."))
    for handle in handles:
        handle.close()
    with open(folder / ".metadata", "wb") as meta:
        pickle.dump(dcp_metadata(entries, planner_data=planner, storage_data=storage,
                                 version="1.0.0"), meta)
    return folder


@pytest.fixture
def eight_ranks(tmp_path):
    """An Accelerate-style checkpoint of world size 8 with tensors smaller than the world."""
    import torch

    root = tmp_path / "ckpt"
    write_sharded(root / "pytorch_model_fsdp_0", {
        "model.tiny": torch.tensor([1.0, 2.0]),        # 2 rows: ranks 2-7 hold nothing
        "model.ten": torch.arange(10.0),                # 2 rows each on ranks 0-4
        "model.w": torch.arange(12.0).reshape(3, 4),    # 1 row each on ranks 0-2
        "model.big": torch.zeros(64, 16)}, world=8)
    for rank in range(8):
        shutil.copy(FIXTURES / "fsdp2_accelerate" / "random_states_0.pkl",
                    root / f"random_states_{rank}.pkl")  # a real RNG file: inspect decodes it
    return root


def test_summary_puts_the_rank_files_of_a_part_on_one_line(eight_ranks):
    result = run("inspect", eight_ranks, "--summary")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    (files,) = [line for line in lines if "rank files," in line]
    assert files.startswith("  8 rank files, ") and files.endswith(" each")
    assert "__3_0.distcp" not in result.stdout
    (rng,) = [line for line in lines if line.strip().startswith("rng")]
    assert "random_states_0.pkl .. random_states_7.pkl" in rng and "8 ranks" in rng
    assert "random_states_3.pkl" not in result.stdout
    assert len(lines) < 20


def test_without_summary_every_rank_file_is_still_listed(eight_ranks):
    out = run("inspect", eight_ranks).stdout
    assert all(f"__{rank}_0.distcp" in out and f"random_states_{rank}.pkl" in out
               for rank in range(8))
    doc = json.loads(run("inspect", eight_ranks, "--json").stdout)
    assert len(doc["parts"][0]["files"]) == 8 and len(doc["side_files"]) == 8


def test_empty_chunks_do_not_count_in_the_sharding_words(eight_ranks):
    result = run("inspect", eight_ranks, "--json")
    assert result.exit_code == 0, result.output
    sharding = {t["name"]: (t["sharding"], len(t["chunks"]))
                for t in json.loads(result.stdout)["parts"][0]["tensors"]}
    assert sharding == {"model.tiny": ("dim0 x2", 8), "model.ten": ("dim0 x5", 8),
                        "model.w": ("dim0 x3", 8), "model.big": ("dim0 x8", 8)}


def test_a_tensor_without_elements_is_called_empty():
    from fsdpckpt.dcp.dtypes import DTYPES
    from fsdpckpt.dcp.metadata import Chunk, TensorEntry
    from fsdpckpt.inspection.inspect import sharding_of

    chunks = tuple(Chunk((0,), (0,), f"__{r}_0.distcp", 0, 100) for r in range(8))
    assert sharding_of(TensorEntry("e", DTYPES["float32"], (0,), chunks, ("e",))) == "empty"


# --- a folder of checkpoints: the answer merge gives ---------------------------------------

def _lightning_ckpts(tmp_path):
    # Lightning's FSDP strategy: one DCP folder per checkpoint, named *.ckpt/.
    for name in ("epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt"):
        shutil.copytree(DCP_FOLDERS["dtensor"], tmp_path / "ckpts" / name)
    return tmp_path / "ckpts"


@pytest.mark.parametrize("command", ["inspect", "verify", "merge"])
def test_a_folder_of_dcp_checkpoints_is_listed_with_the_newest_named(tmp_path, command):
    ckpts = _lightning_ckpts(tmp_path)
    extra = [tmp_path / "out"] if command == "merge" else []
    result = run(command, ckpts, *extra)
    assert_one_line_error(result, "holds 2 checkpoints (epoch=0-step=10.ckpt, "
                          "epoch=1-step=20.ckpt)", f"the newest: {ckpts / 'epoch=1-step=20.ckpt'}")
    assert "Structure: OK" not in result.stdout


def test_inspect_json_of_a_folder_of_checkpoints_gives_the_same_answer(tmp_path):
    ckpts = _lightning_ckpts(tmp_path)
    result = run("inspect", "--json", ckpts)
    assert_one_line_error(result, "holds 2 checkpoints", "epoch=1-step=20.ckpt")
    assert result.stdout == ""  # no document that would call it one checkpoint


def test_inspect_of_an_accelerate_checkpoints_folder_names_the_newest(tmp_path):
    for step in (0, 1, 2):
        shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "checkpoints" /
                        f"checkpoint_{step}")
    result = run("inspect", tmp_path / "checkpoints")
    newest = tmp_path / "checkpoints" / "checkpoint_2"
    assert_one_line_error(result, "holds 3 checkpoints (checkpoint_0, checkpoint_1, "
                          "checkpoint_2)", f"the newest: {newest}")


def test_a_tensor_whose_other_shards_are_empty_is_sharded_not_replicated():
    # A [1, 6] tensor dim-0 sharded over 2 ranks: rank 1's shard is empty, as every big
    # run's small tensors are.
    from fsdpckpt.dcp.dtypes import DTYPES
    from fsdpckpt.dcp.metadata import Chunk, TensorEntry
    from fsdpckpt.inspection.inspect import sharding_of

    f32 = DTYPES["float32"]
    chunks = (Chunk((0, 0), (1, 6), "__0_0.distcp", 0, 100),
              Chunk((1, 0), (0, 6), "__1_0.distcp", 0, 100))
    assert sharding_of(TensorEntry("w", f32, (1, 6), chunks, ("w",))) == "dim0 x1 (1 empty)"
    over_4096 = chunks[:1] + tuple(Chunk((1, 0), (0, 6), f"__{r}_0.distcp", 0, 100)
                                   for r in range(1, 4096))
    assert sharding_of(TensorEntry("w", f32, (1, 6), over_4096, ("w",))) == \
        "dim0 x1 (4095 empty)"
    whole = (Chunk((0, 0), (1, 6), "__0_0.distcp", 0, 100),)
    assert sharding_of(TensorEntry("w", f32, (1, 6), whole, ("w",))) == "replicated"
