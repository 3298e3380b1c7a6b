"""The one publish helper (fsdpckpt/_io/publish.py) on a local file system: an output appears
whole or not at all, stale stages of dead processes go, and a published folder gets the
umask's mode. (Its object-storage side is exercised by the s3 tests of merge, convert and
export, which run a real SeaweedFS server.)"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from fsdpckpt._io import publish
from fsdpckpt._io.publish_folders import RenameCommits, commits
from fsdpckpt._io.staging import output_mode


def _names(folder):
    return sorted(os.listdir(folder))


# --- files staged inside a folder, renamed in -------------------------------------------------

def test_files_staged_inside_a_folder_appear_only_when_renamed_in(tmp_path):
    out = tmp_path / "out"
    with publish.stage_in(out) as stage:
        assert stage.parent == out and stage.name.startswith(publish.STAGING_PREFIX)
        (stage / "a.bin").write_bytes(b"a")
        (stage / "index.json").write_bytes(b"{}")
        assert _names(out) == [stage.name]  # nothing of the output is visible yet
        final = publish.rename_into([stage / "a.bin", stage / "index.json"], out)
    assert final == [out / "a.bin", out / "index.json"]
    assert _names(out) == ["a.bin", "index.json"]  # the stage is gone


def test_a_failure_inside_the_stage_leaves_an_existing_folder_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.bin").write_bytes(b"earlier")
    with pytest.raises(RuntimeError, match="boom"), publish.stage_in(out) as stage:
        (stage / "model.bin").write_bytes(b"new")
        raise RuntimeError("boom")
    assert _names(out) == ["model.bin"] and (out / "model.bin").read_bytes() == b"earlier"


def test_a_failure_removes_the_folders_the_stage_created(tmp_path):
    with pytest.raises(KeyboardInterrupt), publish.stage_in(tmp_path / "a" / "b" / "out"):
        raise KeyboardInterrupt
    assert _names(tmp_path) == []


def test_a_file_in_the_way_is_one_clear_error(tmp_path):
    (tmp_path / "taken").write_bytes(b"x")
    with pytest.raises(OSError, match="is a file, not a folder"), \
            publish.stage_in(tmp_path / "taken" / "out"):
        pass
    assert _names(tmp_path) == ["taken"]


# --- stale stages -----------------------------------------------------------------------------

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_stage_of_a_dead_process_on_this_host_is_cleared(tmp_path):
    dead = tmp_path / f"{publish.STAGING_PREFIX}{publish.host()}-{_dead_pid()}-x1"
    alive = tmp_path / f"{publish.STAGING_PREFIX}{publish.host()}-{os.getppid()}-x2"
    other_host = tmp_path / f"{publish.STAGING_PREFIX}elsewhere-{_dead_pid()}-x3"
    foreign = tmp_path / f"{publish.STAGING_PREFIX}not-ours"
    for folder in (dead, alive, other_host, foreign):
        folder.mkdir()
    assert publish.clear_stale_stages(tmp_path) == [dead]
    assert _names(tmp_path) == sorted(p.name for p in (alive, other_host, foreign))


def test_a_new_stage_clears_a_stale_one_first(tmp_path):
    stale = tmp_path / f"{publish.STAGING_PREFIX}{publish.host()}-{_dead_pid()}-old"
    stale.mkdir()
    with publish.stage_in(tmp_path) as stage:
        assert _names(tmp_path) == [stage.name]


# --- a whole folder, replaced -----------------------------------------------------------------

def test_a_new_folder_replaces_the_old_one_whole(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_bytes(b"old")
    with publish.new_folder(out) as stage:
        (stage / "new").write_bytes(b"new")
        assert (out / "old").exists()  # the old folder is whole until the end
    assert _names(out) == ["new"] and _names(tmp_path) == ["out"]


def test_a_failed_new_folder_leaves_the_old_one_and_no_stage(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), publish.new_folder(out) as stage:
        (stage / "new").write_bytes(b"new")
        raise KeyboardInterrupt
    assert _names(out) == ["old"] and _names(tmp_path) == ["out"]


def test_a_new_folder_swaps_in_one_step_so_a_crash_leaves_old_or_new(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_bytes(b"old")
    real = publish.exchange
    seen = []

    def swap_then_crash(a, b):
        seen.append(sorted(p.name for p in b.iterdir()))  # the old folder, whole, until now
        assert real(a, b)
        raise KeyboardInterrupt  # dies right after the swap: nothing else ran

    monkeypatch.setattr(publish, "exchange", swap_then_crash)
    with pytest.raises(KeyboardInterrupt), publish.new_folder(out) as stage:
        (stage / "new").write_bytes(b"new")
    assert seen == [["old"]]
    assert _names(out) == ["new"] and _names(tmp_path) == ["out"]


def test_without_exchange_a_new_folder_takes_the_old_one_out_of_sight_first(tmp_path,
                                                                            monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_bytes(b"old")
    monkeypatch.setattr(publish, "exchange", lambda a, b: False)
    with publish.new_folder(out) as stage:
        (stage / "new").write_bytes(b"new")
    assert _names(out) == ["new"] and _names(tmp_path) == ["out"]


def test_a_published_folder_gets_the_mode_the_umask_gives(tmp_path):
    old = os.umask(0o027)
    try:
        out = publish.folder(tmp_path / "out", lambda stage: stage.name, overwrite=False)
        assert re.match(r"\.out\.fsdpckpt-tmp-", out)
        mode = stat.S_IMODE((tmp_path / "out").stat().st_mode)
        assert mode == output_mode("dir") == 0o750
    finally:
        os.umask(old)


def test_folder_runs_the_callers_checks_before_anything_is_made(tmp_path):
    def refuse(target):
        raise FileExistsError(f"{target}: no")

    with pytest.raises(FileExistsError, match="no"):
        publish.folder(tmp_path / "sub" / "out", lambda stage: None, overwrite=False,
                       prepare=refuse)
    assert _names(tmp_path) == []


# --- files staged beside their targets --------------------------------------------------------

def test_files_staged_beside_their_targets_replace_them_together(tmp_path):
    targets = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    targets[0].write_bytes(b"old")
    with publish.beside(targets) as staged:
        assert [p.name for p in staged] == [".a.safetensors.tmp", ".b.safetensors.tmp"]
        for path in staged:
            path.write_bytes(b"new")
    assert [p.read_bytes() for p in targets] == [b"new", b"new"]
    assert _names(tmp_path) == ["a.safetensors", "b.safetensors"]


def test_a_failure_beside_the_targets_touches_none_of_them(tmp_path):
    targets = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    targets[0].write_bytes(b"old")
    with pytest.raises(ValueError), publish.beside(targets) as staged:
        staged[0].write_bytes(b"new")
        raise ValueError
    assert _names(tmp_path) == ["a.safetensors"] and targets[0].read_bytes() == b"old"


# --- files into a folder, and folders under final names ---------------------------------------

def test_files_into_a_local_folder_are_published_where_they_were_renamed(tmp_path):
    (tmp_path / "stale").write_bytes(b"x")
    with publish.files_into(tmp_path, commit="the index") as target:
        assert target.workdir == tmp_path
        assert target.publish([tmp_path / "a"]) == [tmp_path / "a"]
        target.drop([tmp_path / "stale", tmp_path / "gone"])
    assert _names(tmp_path) == []


def _complete(folder) -> bool:
    return (folder / "done").is_file()


def test_a_folder_is_committed_by_a_rename_and_replaced_whole(tmp_path):
    folders = commits(tmp_path, hidden=".tmp-f_", final="f_", in_place=lambda *a: None)
    assert isinstance(folders, RenameCommits)
    for content in (b"first", b"second"):
        folders.start(3)
        written = folders.writing(3)
        written.mkdir()
        (written / "done").write_bytes(content)
        assert folders.commit(3) == tmp_path / "f_3"
    assert _names(tmp_path) == ["f_3"] and (tmp_path / "f_3" / "done").read_bytes() == b"second"
    folders.delete(tmp_path / "f_3")
    assert _names(tmp_path) == []


def test_recovery_commits_a_complete_leftover_and_removes_the_rest(tmp_path):
    (tmp_path / ".tmp-f_1").mkdir()
    (tmp_path / ".tmp-f_1" / "done").write_bytes(b"")
    (tmp_path / ".tmp-f_2").mkdir()  # unfinished
    (tmp_path / ".tmp-f_deleting-f_0-abc").mkdir()  # a deletion cut short
    RenameCommits(tmp_path, ".tmp-f_", "f_").recover(_complete, re.compile(r"^f_(\d+)$"))
    assert _names(tmp_path) == ["f_1"]
