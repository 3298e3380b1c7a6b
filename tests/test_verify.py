"""`fsdpckpt verify`: damage is found and named precisely; a whole checkpoint passes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import fsdpckpt

from conftest import FIXTURES, assert_one_line_error, run_cli as run


@pytest.fixture
def saved(tmp_path):
    """A checkpoint written by save_state (so with a manifest), large enough to damage."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    fsdpckpt.save_state(tmp_path / "ckpt", model, optimizer, step=1)
    return tmp_path / "ckpt"


def _flip_a_data_byte(folder, tensor_name):
    from fsdpckpt.archive import locate_tensor
    from fsdpckpt.reader import read_dcp_folder

    tensor = next(t for t in read_dcp_folder(folder).metadata.tensors if t.name == tensor_name)
    chunk = tensor.chunks[0]
    with open(folder / chunk.file, "r+b") as handle:
        raw = locate_tensor(handle, chunk.offset, chunk.length, source="x")
        handle.seek(raw.storage_start + 5)
        byte = handle.read(1)
        handle.seek(raw.storage_start + 5)
        handle.write(bytes([byte[0] ^ 0x01]))


def problems(result):
    return result.stdout


def test_a_whole_checkpoint_passes(saved):
    result = run("verify", saved)
    assert result.exit_code == 0, result.output
    assert "OK (every byte checked against the manifest)" in result.stdout


def test_one_flipped_byte_in_tensor_data_names_the_tensor(saved):
    _flip_a_data_byte(saved / "pytorch_model_fsdp_0", "model.0.weight")
    result = run("verify", saved)
    assert result.exit_code == 1
    assert f"{saved / 'pytorch_model_fsdp_0' / '__0_0.distcp'}: tensor 'model.0.weight'" in \
        result.stdout and "checksum" in result.stdout


def test_truncated_shard_is_named(saved):
    target = saved / "optimizer_0" / "__0_0.distcp"
    os.truncate(target, target.stat().st_size - 10)
    result = run("verify", saved)
    assert result.exit_code == 1 and f"{target}:" in result.stdout
    assert "truncated" in result.stdout


def test_missing_file_is_named(saved):
    (saved / "random_states_0.pkl").unlink()
    result = run("verify", saved)
    assert result.exit_code == 1
    assert f"{saved / 'random_states_0.pkl'}: missing file listed in the manifest" in result.stdout


def test_missing_metadata_is_named(saved):
    (saved / "pytorch_model_fsdp_0" / ".metadata").unlink()
    result = run("verify", saved)
    assert result.exit_code == 1
    assert "pytorch_model_fsdp_0: no .metadata" in result.stdout


def test_stray_file_is_named(saved):
    (saved / "optimizer_0" / "__7_0.distcp").write_bytes(b"junk")
    result = run("verify", saved)
    assert result.exit_code == 1
    assert f"{saved / 'optimizer_0' / '__7_0.distcp'}: stray file" in result.stdout


def test_json_report_lists_every_problem(saved):
    (saved / "random_states_0.pkl").unlink()
    (saved / "stray.txt").write_text("x")
    doc = json.loads(run("verify", saved, "--json").stdout)
    assert doc["ok"] is False and doc["manifest"] is True
    assert {p["path"] for p in doc["problems"]} >= {str(saved / "random_states_0.pkl"),
                                                    str(saved / "stray.txt")}


def test_without_manifest_the_fixtures_pass(tmp_path):
    for name in ("fsdp2_accelerate", "fsdp1", "dtensor"):
        result = run("verify", FIXTURES / name)
        assert result.exit_code == 0, result.output
        assert "no manifest" in result.stdout


def test_without_manifest_a_flipped_byte_is_still_found(tmp_path):
    ckpt = shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "ckpt")
    _flip_a_data_byte(ckpt / "pytorch_model_fsdp_0", "model.2.weight")
    result = run("verify", ckpt)
    assert result.exit_code == 1 and "tensor 'model.2.weight'" in result.stdout


def test_verify_of_a_missing_path(tmp_path):
    assert_one_line_error(run("verify", tmp_path / "nope"), "no such file")


def test_a_malformed_manifest_is_one_clear_error(saved):
    (saved / "fsdpckpt.json").write_text('{"format": "fsdpckpt-manifest", "files": {"x": 1}}')
    assert_one_line_error(run("verify", saved), "fsdpckpt.json", "malformed")
