"""`fsdpckpt verify`: damage is found and named precisely; a whole checkpoint passes."""

from __future__ import annotations

import json
import shutil

import pytest

import fsdpckpt

from conftest import FIXTURES, assert_one_line_error, save_small_checkpoint
from conftest import run_cli as run


@pytest.fixture
def saved(tmp_path):
    """A checkpoint written by save_state (so with a manifest), large enough to damage."""
    return save_small_checkpoint(tmp_path / "ckpt")


def _flip_a_data_byte(folder, tensor_name):
    from fsdpckpt.dcp._archive import locate_tensor
    from fsdpckpt.dcp.reader import read_dcp_folder

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


def test_verify_checkpoint_returns_a_typed_report_of_problems(saved):
    from fsdpckpt import Problem, VerifyReport

    (saved / "random_states_0.pkl").unlink()
    report = fsdpckpt.verify_checkpoint(saved)
    assert isinstance(report, VerifyReport) and not report.ok and report.manifest
    assert report.manifest_digest.startswith("sha256:") and report.digest is None
    assert Problem(str(saved / "random_states_0.pkl"), "missing file listed in the manifest") \
        in report.problems
    assert all(type(p) is Problem for p in report.problems)


def test_verify_json_prints_the_reports_to_json_byte_for_byte(saved):
    (saved / "stray.txt").write_text("x")
    result = run("verify", saved, "--json")
    report = fsdpckpt.verify_checkpoint(saved)
    assert result.stdout == json.dumps(report.to_json(), indent=2) + "\n"
    assert list(report.to_json()) == ["path", "ok", "manifest", "manifest_digest", "digest",
                                      "problems", "unchecked", "style", "unfinished"]


def test_the_verify_report_is_still_read_by_key_as_the_dict_it_was(saved):
    (saved / "stray.txt").write_text("x")
    report = fsdpckpt.verify_checkpoint(saved)
    assert report["ok"] is False and report["manifest"] is True
    assert report["problems"] == [{"path": str(saved / "stray.txt"), "message": "stray file: "
                                   "not in the manifest, so not part of this checkpoint as it "
                                   "was written"}]


def test_each_problem_is_reported_once(saved):
    (saved / "pytorch_model_fsdp_0" / "__0_0.distcp").unlink()  # inspect and verify both see it
    report = fsdpckpt.verify_checkpoint(saved)
    assert len(report.problems) == len(set(report.problems)) > 0


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


# --- messages and progress ------------------------------------------------------------

def _chunk_of(folder, tensor_name):
    from fsdpckpt.dcp.reader import read_dcp_folder

    tensor = next(t for t in read_dcp_folder(folder).metadata.tensors if t.name == tensor_name)
    return tensor.chunks[0]


def test_a_damaged_chunk_archive_names_the_chunk_once(tmp_path):
    ckpt = shutil.copytree(FIXTURES / "fsdp2_accelerate", tmp_path / "ckpt")
    folder = ckpt / "pytorch_model_fsdp_0"
    chunk = _chunk_of(folder, "model.0.weight")
    with open(folder / chunk.file, "r+b") as handle:  # the zip directory at the archive's end
        handle.seek(chunk.offset + chunk.length - 30)
        handle.write(b"\0" * 30)
    result = run("verify", ckpt)
    assert result.exit_code == 1
    (line,) = [text for text in result.stdout.splitlines() if "model.0.weight" in text]
    assert line.startswith(f"{folder / chunk.file}: tensor 'model.0.weight' chunk at [0, 0]: ")
    assert line.count("chunk at") == 1 and "not a torch.save archive" in line


class _Recorder:
    """A progress factory that remembers what it was told and what it was given."""

    def __init__(self):
        self.calls, self.done = [], 0

    def __call__(self, total, files):
        assert self.done == 0, "the total must come before any byte is read"
        self.calls.append((total, files))
        return self.update

    def update(self, count):
        self.done += count


@pytest.mark.parametrize("name", ["fsdp2_accelerate", "fsdp1", "dtensor"])
def test_without_manifest_progress_is_told_the_bytes_it_will_read(name):
    from fsdpckpt.inspection.verify import verify_checkpoint

    recorder = _Recorder()
    assert verify_checkpoint(FIXTURES / name, progress=recorder)["ok"]
    ((total, files),) = recorder.calls
    assert total > 0 and files >= 2 and recorder.done == total


def test_with_a_manifest_progress_is_told_the_bytes_it_will_read(saved):
    from fsdpckpt.inspection.verify import verify_checkpoint

    recorder = _Recorder()
    assert verify_checkpoint(saved, progress=recorder)["ok"]
    listed = json.loads((saved / "fsdpckpt.json").read_text())["files"]
    assert recorder.calls == [(sum(f["size"] for f in listed.values()), len(listed))]
    assert recorder.done == recorder.calls[0][0]


def test_the_cli_bar_of_verify_gets_a_total(monkeypatch):
    from fsdpckpt import cli

    recorder = _Recorder()
    monkeypatch.setattr(cli, "_progress", lambda quiet, *_args: None if quiet else recorder)
    assert run("verify", FIXTURES / "dtensor").exit_code == 0
    assert recorder.calls and recorder.calls[0][0] > 0 and recorder.done == recorder.calls[0][0]


@pytest.mark.parametrize("manifest", [False, True], ids=["no manifest", "manifest"])
def test_verify_parses_each_metadata_once(tmp_path, manifest):
    from fsdpckpt.dcp import reader

    ckpt = save_small_checkpoint(tmp_path / "ckpt", manifest=manifest)
    data = ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # so that the chunks are read too, with the manifest
    data.write_bytes(bytes(raw))
    before = reader.parse_count
    fsdpckpt.verify_checkpoint(ckpt)
    assert reader.parse_count - before == 2  # the model folder's and the optimizer's
