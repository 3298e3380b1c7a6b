"""Output the merge must refuse or protect: reserved and conflicting names, data files
outside the checkpoint, other people's files, interrupted merges, unwritable folders."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import fsdpckpt
from fsdpckpt.merging.plan import MergePlanError

from conftest import DCP_FOLDERS, assert_one_line_error, reseal, single_process
from conftest import run_cli as run
from deep_compare import assert_same_state


def _save(folder: Path, state: dict) -> Path:
    dcp.save(state, checkpoint_id=str(folder), **single_process())
    return folder


def _rewrite_metadata(folder: Path, change) -> None:
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own file, just written by dcp.save
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# --- names safetensors reserves ------------------------------------------------

def test_a_tensor_named_metadata_is_refused_for_safetensors_before_writing(tmp_path):
    ckpt = _save(tmp_path / "ckpt", {"model": {"__metadata__": torch.ones(2), "w": torch.ones(3)}})
    with pytest.raises(MergePlanError, match=r"'model\.__metadata__'.*--exclude.*--format bin"):
        fsdpckpt.merge(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tensor_named_metadata_merges_to_bin_or_when_excluded(tmp_path):
    state = {"__metadata__": torch.ones(2), "w": torch.arange(3.0)}
    ckpt = _save(tmp_path / "ckpt", {"model": state})
    (as_bin,) = fsdpckpt.merge(ckpt, tmp_path / "bin", format="bin")
    assert_same_state(torch.load(as_bin.path, weights_only=True), state)
    (excluded,) = fsdpckpt.merge(ckpt, tmp_path / "st", exclude=["__metadata__"])
    with safe_open(str(excluded.path), "pt") as handle:
        assert list(handle.keys()) == ["w"]


def test_an_object_named_metadata_is_kept_in_safetensors(tmp_path):
    # Objects live inside the header's metadata, not beside it: the name is free for them.
    ckpt = _save(tmp_path / "ckpt", {"model": {"__metadata__": 5, "w": torch.ones(3)}})
    (result,) = fsdpckpt.merge(ckpt, tmp_path / "out")
    assert fsdpckpt.load_full_state_dict(result.path)["__metadata__"] == 5


# --- key paths that nest into each other -----------------------------------------

def _leaf_and_parent(tmp_path, second="a.b", value=None) -> Path:
    # Without planner_data, key paths come from the dotted names: ("a",) and ("a", "b").
    ckpt = _save(tmp_path / "ckpt", {"model": {"a": torch.ones(2),
                                               second: torch.zeros(3) if value is None else value}})
    _rewrite_metadata(ckpt, lambda md: setattr(md, "planner_data", {}))
    return ckpt


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_a_leaf_that_is_also_a_parent_is_refused_naming_both_keys(tmp_path, fmt):
    ckpt = _leaf_and_parent(tmp_path)
    with pytest.raises(MergePlanError, match=r"'a' and 'a\.b' conflict.*--exclude|"
                                             r"'a' and 'a\.b' conflict"):
        fsdpckpt.merge(ckpt, tmp_path / "out", format=fmt)
    assert not (tmp_path / "out").exists()


def test_an_object_under_a_tensor_is_a_conflict_too(tmp_path):
    ckpt = _leaf_and_parent(tmp_path, value=7)
    with pytest.raises(MergePlanError, match=r"'a' and 'a\.b' conflict"):
        fsdpckpt.merge(ckpt, tmp_path / "out", format="bin")


def test_excluding_one_side_of_a_conflict_merges_the_other(tmp_path):
    ckpt = _leaf_and_parent(tmp_path)
    (result,) = fsdpckpt.merge(ckpt, tmp_path / "out", format="bin", exclude=["a.b"])
    assert list(torch.load(result.path, weights_only=True)) == ["a"]


def test_a_list_index_and_a_key_under_one_parent_are_refused(tmp_path):
    ckpt = _save(tmp_path / "ckpt", {"model": {"x": torch.ones(1), "y": torch.ones(1)}})
    _rewrite_metadata(ckpt, lambda md: md.planner_data.update(
        {"model.x": ("model", "p", 0), "model.y": ("model", "p", "k")}))
    with pytest.raises(MergePlanError, match="both a list index and a key"):
        fsdpckpt.merge(ckpt, tmp_path / "out", format="bin")


def test_bin_output_drops_wrapper_segments_like_the_names_say(tmp_path):
    ckpt = _save(tmp_path / "ckpt", {"model": {"_fsdp_wrapped_module.w": torch.ones(3)}})
    (result,) = fsdpckpt.merge(ckpt, tmp_path / "out", format="bin")
    assert list(torch.load(result.path, weights_only=True)) == ["w"]


# --- data files only from inside the checkpoint folder ---------------------------

@pytest.fixture
def two_checkpoints(tmp_path):
    """``ckpt`` (zeros) and, beside it, ``other`` (ones): the file a hostile path would reach."""
    ckpt = _save(tmp_path / "ckpt", {"model": {"w": torch.zeros(4)}})
    _save(tmp_path / "other", {"model": {"w": torch.ones(4)}})
    return ckpt, tmp_path / "other"


def _absolute(ckpt: Path, other: Path) -> None:
    _point_at(ckpt, str(other / "__0_0.distcp"))


def _dotdot(ckpt: Path, other: Path) -> None:
    _point_at(ckpt, "../other/__0_0.distcp")


def _symlink(ckpt: Path, other: Path) -> None:
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(other / "__0_0.distcp")


def _point_at(ckpt: Path, path: str) -> None:
    def change(md):
        for info in md.storage_data.values():
            info.relative_path = path
    _rewrite_metadata(ckpt, change)


_ATTACKS = {"absolute": _absolute, "dotdot": _dotdot, "symlink": _symlink}


@pytest.mark.parametrize("attack", sorted(_ATTACKS))
def test_inspect_refuses_a_data_file_outside_the_folder(two_checkpoints, attack):
    ckpt, other = two_checkpoints
    _ATTACKS[attack](ckpt, other)
    assert_one_line_error(run("inspect", ckpt), "outside the checkpoint folder")


@pytest.mark.parametrize("attack", sorted(_ATTACKS))
def test_verify_refuses_a_data_file_outside_the_folder(two_checkpoints, attack):
    ckpt, other = two_checkpoints
    _ATTACKS[attack](ckpt, other)
    result = run("verify", ckpt)
    assert result.exit_code == 1 and "outside the checkpoint folder" in result.output
    assert "OK" not in result.stdout


@pytest.mark.parametrize("attack", sorted(_ATTACKS))
def test_merge_refuses_a_data_file_outside_the_folder(two_checkpoints, tmp_path, attack):
    ckpt, other = two_checkpoints
    _ATTACKS[attack](ckpt, other)
    assert_one_line_error(run("merge", ckpt, tmp_path / "out"), "outside the checkpoint folder",
                          "only from inside")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attack", sorted(_ATTACKS))
def test_load_full_state_dict_refuses_a_data_file_outside_the_folder(two_checkpoints, attack):
    ckpt, other = two_checkpoints
    _ATTACKS[attack](ckpt, other)
    with pytest.raises(fsdpckpt.NotACheckpointError, match="outside the checkpoint folder"):
        fsdpckpt.load_full_state_dict(ckpt)


def test_a_data_file_swapped_for_an_outside_link_after_reading_is_refused(two_checkpoints,
                                                                          tmp_path):
    # The rule holds where the file is opened too, not only when the folder is listed.
    ckpt, other = two_checkpoints
    folder = fsdpckpt.read_dcp_folder(ckpt)
    _symlink(ckpt, other)
    plan = fsdpckpt.plan_merge(folder)
    from fsdpckpt.merging.writer import write_plan

    (tmp_path / "stage").mkdir()
    with pytest.raises(fsdpckpt.NotACheckpointError, match="outside the checkpoint folder"):
        write_plan(plan, tmp_path / "stage")


def test_a_symlink_to_a_file_inside_the_folder_is_followed(tmp_path):
    ckpt = _save(tmp_path / "ckpt", {"model": {"w": torch.arange(4.0)}})
    (ckpt / "data").mkdir()
    (ckpt / "__0_0.distcp").rename(ckpt / "data" / "rank0.bin")
    (ckpt / "__0_0.distcp").symlink_to(Path("data") / "rank0.bin")
    assert run("inspect", ckpt).exit_code == 0
    (result,) = fsdpckpt.merge(ckpt, tmp_path / "out")
    assert_same_state(fsdpckpt.load_full_state_dict(result.path), {"w": torch.arange(4.0)})


def test_a_checkpoint_folder_reached_through_a_symlink_is_fine(tmp_path):
    (tmp_path / "link").symlink_to(DCP_FOLDERS["dtensor"])
    assert run("inspect", tmp_path / "link").exit_code == 0
    assert fsdpckpt.merge(tmp_path / "link", tmp_path / "out")


def test_a_manifest_cannot_send_verify_outside_the_checkpoint(tmp_path):
    import json

    from fsdpckpt.training.state import save_state

    model = torch.nn.Linear(2, 2)
    save_state(tmp_path / "ckpt", model=model)
    manifest = tmp_path / "ckpt" / "fsdpckpt.json"
    doc = json.loads(manifest.read_text())
    (tmp_path / "secret").write_text("x")
    doc["files"]["../secret"] = {"size": 1, "crc32": 0}
    manifest.write_text(json.dumps(reseal(doc)))  # as a hostile writer would: its own checksum
    report = fsdpckpt.verify_checkpoint(tmp_path / "ckpt")
    assert any("outside the checkpoint folder" in p["message"] for p in report["problems"])


# --- --overwrite replaces only what an earlier merge wrote -----------------------

def test_files_that_only_look_like_shards_are_not_outputs(tmp_path):
    (tmp_path / "model-v2-of-llama.safetensors").write_text("someone else's")
    (tmp_path / "model-00001-of-00002.safetensors").write_text("no index names it")
    fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path)  # no --overwrite needed
    fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, overwrite=True)
    assert (tmp_path / "model-v2-of-llama.safetensors").read_text() == "someone else's"
    assert (tmp_path / "model-00001-of-00002.safetensors").read_text() == "no index names it"


def test_overwrite_replaces_the_shards_the_earlier_index_names(tmp_path):
    (first,) = fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, max_shard_size=300)
    assert len(first.files) > 3
    (second,) = fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, max_shard_size=2000,
                               overwrite=True)
    assert _listing(tmp_path) == sorted(p.name for p in second.files)


def test_overwrite_never_deletes_what_a_foreign_index_names(tmp_path):
    import json

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "config.json", "v": "../outside.safetensors"}}))
    (tmp_path.parent / "outside.safetensors").write_text("keep")
    fsdpckpt.merge(DCP_FOLDERS["fsdp2-model"], tmp_path, overwrite=True)
    assert _listing(tmp_path) == ["config.json", "model.safetensors"]
    assert (tmp_path.parent / "outside.safetensors").read_text() == "keep"


# --- SIGTERM and staging folders left behind -------------------------------------

def _stages(folder: Path) -> list[str]:
    return [n for n in _listing(folder) if n.startswith(".fsdpckpt-tmp-")]


def test_sigterm_during_a_merge_cleans_up_and_restores_the_handler(tmp_path, monkeypatch):
    import fsdpckpt.merging.merger as merger
    from fsdpckpt.merging.writer import Terminated

    real = merger.write_plan

    def killed(plan, stage, **kwargs):
        (stage / "partial").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGTERM)
        return real(plan, stage, **kwargs)

    monkeypatch.setattr(merger, "write_plan", killed)
    before = signal.getsignal(signal.SIGTERM)
    (tmp_path / "out").mkdir()
    with pytest.raises(Terminated):
        fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path / "out")
    assert _listing(tmp_path / "out") == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_applications_own_sigterm_handler_is_left_to_run(tmp_path, monkeypatch):
    import fsdpckpt.merging.merger as merger

    calls = []
    real = merger.write_plan

    def signalled(plan, stage, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(plan, stage, **kwargs)

    monkeypatch.setattr(merger, "write_plan", signalled)
    def app(*_args):
        calls.append("app")

    previous = signal.signal(signal.SIGTERM, app)
    try:
        (result,) = fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path)
        assert calls == ["app"] and result.path.is_file()
        assert signal.getsignal(signal.SIGTERM) is app
    finally:
        signal.signal(signal.SIGTERM, previous)


_SLOW_MERGE = """
import sys, time
import fsdpckpt.merging.merger as merger, fsdpckpt.cli as cli
real = merger.write_plan
def slow(plan, stage, **kwargs):
    (stage / "partial").write_bytes(b"x" * 10**6)
    print("staged", flush=True)
    time.sleep(60)
    return real(plan, stage, **kwargs)
merger.write_plan = slow
cli.main(["merge", sys.argv[1], sys.argv[2]])
"""


def test_sigterm_to_a_real_merge_leaves_nothing_and_says_so(tmp_path):
    (tmp_path / "out").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_MERGE, str(DCP_FOLDERS["dtensor"]),
                             str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    assert len(_stages(tmp_path / "out")) == 1
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err  # 128 + SIGTERM, as shells report it
    assert err.strip() == "fsdpckpt: error: interrupted by SIGTERM"
    assert _listing(tmp_path / "out") == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_staging_folder_of_a_dead_merge_is_removed_with_a_log_line(tmp_path):
    from fsdpckpt._io.publish import host as _host

    stale = tmp_path / "out" / f".fsdpckpt-tmp-{_host()}-{_dead_pid()}-abc_12"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    result = subprocess.run([sys.executable, "-m", "fsdpckpt", "merge", "-q",
                             DCP_FOLDERS["dtensor"], tmp_path / "out"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not stale.exists()
    assert str(stale) in result.stderr and "interrupted merge" in result.stderr
    assert _listing(tmp_path / "out") == ["model.safetensors"]


def test_staging_folders_of_live_or_unknown_merges_are_kept(tmp_path, caplog):
    from fsdpckpt._io.publish import host as _host

    out = tmp_path / "out"
    kept = [f".fsdpckpt-tmp-{_host()}-{os.getppid()}-live",       # a process that runs
            f".fsdpckpt-tmp-otherhost-{_dead_pid()}-remote",     # maybe alive over there
            ".fsdpckpt-tmp-k3j_x9a1"]                            # no pid to check
    for name in kept:
        (out / name).mkdir(parents=True)
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], out)
    assert _listing(out) == sorted(kept + ["model.safetensors"])
    assert "removed" not in caplog.text


def test_the_staging_folder_names_this_host_and_process(tmp_path, monkeypatch):
    import fsdpckpt.merging.merger as merger
    from fsdpckpt._io.publish import host as _host

    seen = []
    real = merger.write_plan
    monkeypatch.setattr(merger, "write_plan",
                        lambda plan, stage, **k: seen.append(stage.name) or real(plan, stage, **k))
    fsdpckpt.merge(DCP_FOLDERS["dtensor"], tmp_path)
    assert seen[0].startswith(f".fsdpckpt-tmp-{_host()}-{os.getpid()}-")


# --- unwritable output locations -------------------------------------------------

@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no merge may write into, for root too.

    Permission bits do not bind root (CAP_DAC_OVERRIDE), and these tests run as root on
    the build machines. The immutable attribute does: the kernel refuses every change
    inside an immutable folder to every user (EPERM). For other users, mode 0o555.
    """
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or \
            subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root, and this file system has no immutable attribute (chattr +i)")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_read_only_output_folder_is_named_with_what_to_do(read_only_folder):
    result = run("merge", DCP_FOLDERS["dtensor"], read_only_folder)
    assert_one_line_error(result, f"{read_only_folder}: cannot write the output there",
                          "choose")
    assert ".fsdpckpt-tmp" not in result.stderr


def test_an_output_below_a_read_only_folder_is_named_with_what_to_do(read_only_folder):
    result = run("merge", DCP_FOLDERS["dtensor"], read_only_folder / "merged")
    assert_one_line_error(result, f"{read_only_folder / 'merged'}: cannot write the output there")


def test_an_output_below_a_file_says_which_part_is_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path / "notes.txt" / "merged")
    assert_one_line_error(result, f"{tmp_path / 'notes.txt'} is a file, not a folder",
                          "choose another output folder")
    assert (tmp_path / "notes.txt").read_text() == "x"


def test_a_read_only_file_system_is_named_as_such(tmp_path, monkeypatch):
    import errno
    import tempfile

    def read_only(*_a, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(kwargs.get("dir")) + "/.x")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    result = run("merge", DCP_FOLDERS["dtensor"], tmp_path / "out")
    assert_one_line_error(result, f"{tmp_path / 'out'}: cannot write the output there",
                          "read-only")
    assert not (tmp_path / "out").exists()
