"""``verify`` of what ``inspect`` and ``diff`` read besides checkpoints (issue 20 §6): the
output folder of ``export-hf`` or ``merge``, a shard index, a single weight file. And a
folder holding several checkpoints: ``diff`` and ``load_full_state_dict`` list them and name
the newest, with the message ``inspect``, ``verify``, ``merge`` and ``export-hf`` give.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

import fsdpckpt
from fsdpckpt.training._pretrained_source import read_weights

from conftest import FIXTURES, ROOT, assert_one_line_error, run_cli, upload

TIED = FIXTURES / "tiny_llama" / "tied" / "checkpoint-3"
ACCELERATE = FIXTURES / "fsdp2_accelerate"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The tied tiny Llama exported: config, tokenizer, one model.safetensors."""
    out = tmp_path_factory.mktemp("export") / "out"
    fsdpckpt.export_hf(TIED, out)
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The same export in several shards with their index."""
    out = tmp_path_factory.mktemp("sharded") / "out"
    fsdpckpt.export_hf(TIED, out, max_shard_size="100KB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    return out


@pytest.fixture(scope="module")
def merged_bin(tmp_path_factory):
    """The Accelerate checkpoint merged to pytorch_model.bin and optimizer.bin."""
    out = tmp_path_factory.mktemp("bin") / "out"
    fsdpckpt.merge(ACCELERATE, out, optimizer=True, format="bin")
    return out


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / folder.name)


def _flip(file, at):
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(data)


# --- every layout of an output verifies -------------------------------------------------

def test_verify_of_an_export_folder_reads_every_byte_and_says_safetensors_are_unchecked(export):
    report = fsdpckpt.verify_checkpoint(export)
    assert report.ok and report.style == "model-folder" and not report.manifest
    assert report.unchecked == (str(export / "model.safetensors"),)
    result = run_cli("verify", export, "--quiet")
    assert result.exit_code == 0, result.output
    assert f"{export}: OK (model files: structure checked" in result.stdout
    assert "unchecked: 1 file record no checksums (safetensors)" in result.stdout


def test_verify_of_a_sharded_export_reads_every_shard(sharded):
    report = fsdpckpt.verify_checkpoint(sharded)
    assert report.ok, report.problems
    assert sorted(report.unchecked) == sorted(str(f) for f in
                                              sharded.glob("model-*-of-*.safetensors"))
    # The index given itself: the same files.
    index = fsdpckpt.verify_checkpoint(sharded / "model.safetensors.index.json")
    assert index.ok and index.style == "model-file" and index.unchecked == report.unchecked


def test_verify_of_a_merged_bin_folder_checks_model_and_optimizer_against_their_crcs(merged_bin):
    sizes = []
    report = fsdpckpt.verify_checkpoint(merged_bin, progress=lambda total, files: (
        sizes.append((total, files)) or (lambda n: None)))
    assert report.ok and report.unchecked == ()  # every .bin byte has its zip CRC-32
    tensors = {**read_weights(merged_bin / "pytorch_model.bin"),
               **read_weights(merged_bin / "optimizer.bin")}
    assert sizes == [(sum(s.raw.storage_nbytes for s in tensors.values()), 2)]


@pytest.mark.parametrize("name", ["pytorch_model.bin", "optimizer.bin"])
def test_verify_of_a_single_bin_file(merged_bin, name):
    report = fsdpckpt.verify_checkpoint(merged_bin / name)
    assert report.ok and report.style == "model-file"


def test_verify_of_a_single_safetensors_file(export):
    report = fsdpckpt.verify_checkpoint(export / "model.safetensors")
    assert report.ok and report.style == "model-file" and len(report.unchecked) == 1


def test_verify_of_model_files_does_not_import_torch(export, merged_bin):
    # .bin files through fsdpckpt's restricted unpickler and zip reader, never torch.load.
    code = ("import sys, fsdpckpt\n"
            f"for path in ({str(export)!r}, {str(merged_bin)!r}):\n"
            "    assert fsdpckpt.verify_checkpoint(path).ok\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_verify_json_of_an_export_is_the_report(export):
    result = run_cli("verify", export, "--json", "--quiet")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc == fsdpckpt.verify_checkpoint(export).to_json()
    assert doc["ok"] is True and doc["style"] == "model-folder" and doc["manifest"] is False
    assert doc["problems"] == [] and doc["unchecked"] == [str(export / "model.safetensors")]


# --- damage -----------------------------------------------------------------------------

def test_a_flipped_byte_in_a_bin_fails_its_crc_naming_the_tensor(merged_bin, tmp_path):
    out = _copy(merged_bin, tmp_path)
    name, stored = next(iter(read_weights(out / "pytorch_model.bin").items()))
    _flip(out / "pytorch_model.bin", stored.raw.storage_start + stored.raw.storage_nbytes // 2)
    report = fsdpckpt.verify_checkpoint(out)
    assert not report.ok
    (problem,) = report.problems
    assert problem.path == str(out / "pytorch_model.bin")
    assert f"tensor '{name}'" in problem.message and "CRC-32" in problem.message
    result = run_cli("verify", out, "--json", "--quiet")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["problems"] == [problem.to_json()]


def test_a_flipped_byte_in_safetensors_data_passes_as_structure_only(export, tmp_path):
    """safetensors records no checksum of its data, and fsdpckpt writes no manifest for an
    export or a merge: a changed data byte leaves a file exactly as valid as before, so
    verify cannot see it. It says so (the file is listed as unchecked); ``diff`` against the
    source checkpoint is what finds it."""
    out = _copy(export, tmp_path)
    file = out / "model.safetensors"
    _flip(file, file.stat().st_size - 10)  # inside the last tensor's data
    report = fsdpckpt.verify_checkpoint(out)
    assert report.ok and report.unchecked == (str(file),)
    assert not fsdpckpt.diff(TIED, out).equal


def test_a_cut_short_safetensors_file_fails_naming_it(export, tmp_path):
    out = _copy(export, tmp_path)
    file = out / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    report = fsdpckpt.verify_checkpoint(out)
    (problem,) = report.problems
    assert problem.path == str(file) and "truncated" in problem.message
    result = run_cli("verify", out, "--quiet")
    assert result.exit_code == 1 and f"{file}: " in result.stdout
    assert "1 problem found" in result.stderr


def test_a_missing_shard_fails_naming_it(sharded, tmp_path):
    out = _copy(sharded, tmp_path)
    gone = sorted(out.glob("model-*-of-*.safetensors"))[1]
    gone.unlink()
    report = fsdpckpt.verify_checkpoint(out)
    (problem,) = report.problems
    assert problem.path == str(gone)
    assert "listed in model.safetensors.index.json but missing" in problem.message


def test_an_index_naming_a_tensor_its_file_lacks_fails_naming_the_file(sharded, tmp_path):
    out = _copy(sharded, tmp_path)
    index = out / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = sorted(set(doc["weight_map"].values()))[0]
    doc["weight_map"]["model.ghost.weight"] = first
    index.write_text(json.dumps(doc))
    (problem,) = fsdpckpt.verify_checkpoint(out).problems
    assert problem.path == str(out / first)
    assert "lists tensor 'model.ghost.weight' in this file, which lacks it" in problem.message


def test_a_tensor_the_index_does_not_list_fails_naming_its_file(sharded, tmp_path):
    out = _copy(sharded, tmp_path)
    index = out / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    name, file = next(iter(doc["weight_map"].items()))
    del doc["weight_map"][name]
    index.write_text(json.dumps(doc))
    (problem,) = fsdpckpt.verify_checkpoint(out).problems
    assert problem.path == str(out / file)
    assert f"holds tensor '{name}', which model.safetensors.index.json does not list" \
        in problem.message


def test_a_tensor_in_two_shards_fails_naming_both(sharded, tmp_path):
    from safetensors.torch import save_file

    out = _copy(sharded, tmp_path)
    index = out / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    name, file = next(iter(doc["weight_map"].items()))
    save_file({name: torch.zeros(2), "extra.weight": torch.zeros(2)}, out / "extra.safetensors")
    doc["weight_map"]["extra.weight"] = "extra.safetensors"
    index.write_text(json.dumps(doc))
    (problem,) = fsdpckpt.verify_checkpoint(out).problems
    assert problem.path == str(out / "extra.safetensors")
    assert f"holds tensor '{name}', which {file} holds too" in problem.message


def test_an_unreadable_index_fails_naming_it(sharded, tmp_path):
    out = _copy(sharded, tmp_path)
    (out / "model.safetensors.index.json").write_text("{not json")
    (problem,) = fsdpckpt.verify_checkpoint(out).problems
    assert problem.path == str(out / "model.safetensors.index.json")


def test_an_expected_digest_of_an_output_without_a_manifest_is_a_problem(export):
    report = fsdpckpt.verify_checkpoint(export, expect_digest="sha256:" + "0" * 64)
    assert not report.ok and "needs a checkpoint saved with a manifest" in \
        report.problems[0].message


@pytest.mark.s3
def test_verify_of_a_remote_export_reads_it_as_a_local_one(s3, export):
    server, root = s3
    url = upload(server, export, f"s3://{root}/verify-export")
    report = fsdpckpt.verify_checkpoint(url, storage_options=server.options)
    assert report.ok and report.style == "model-folder"
    assert report.unchecked == (f"{url}/model.safetensors",)


# --- a folder of several checkpoints: one message for every verb --------------------------

@pytest.fixture
def runs(tmp_path):
    """A run folder holding two checkpoints, named as HF Trainer names them."""
    for step in (500, 1000):
        shutil.copytree(ACCELERATE, tmp_path / "run" / f"checkpoint-{step}")
    return tmp_path / "run"


def _listed(runs):
    return (f"{runs}: holds 2 checkpoints (checkpoint-500, checkpoint-1000); pass one of "
            f"them, e.g. the newest: {runs / 'checkpoint-1000'}")


def test_diff_of_a_folder_of_checkpoints_lists_them_as_inspect_does(runs):
    message = _listed(runs)
    assert_one_line_error(run_cli("inspect", runs), message)
    assert_one_line_error(run_cli("diff", runs, ACCELERATE), message)
    assert_one_line_error(run_cli("diff", ACCELERATE, runs), message)
    with pytest.raises(fsdpckpt.NotACheckpointError) as caught:
        fsdpckpt.diff(runs, ACCELERATE)
    assert str(caught.value) == message
    assert caught.value.checkpoints == ("checkpoint-500", "checkpoint-1000")


def test_load_full_state_dict_of_a_folder_of_checkpoints_lists_them(runs):
    with pytest.raises(fsdpckpt.NotACheckpointError) as caught:
        fsdpckpt.load_full_state_dict(runs)
    assert str(caught.value) == _listed(runs)


def test_a_folder_of_checkpoints_beside_a_merged_output_still_loads_the_output(runs):
    fsdpckpt.merge(runs / "checkpoint-500", runs)  # runs/model.safetensors
    state = fsdpckpt.load_full_state_dict(runs)
    assert set(state) == set(fsdpckpt.load_full_state_dict(runs / "model.safetensors"))


def test_a_folder_of_nothing_is_still_neither(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(fsdpckpt.NotACheckpointError, match="neither a DCP folder") as caught:
        fsdpckpt.load_full_state_dict(tmp_path)
    assert caught.value.checkpoints == ()
