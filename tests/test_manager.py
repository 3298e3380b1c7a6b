"""CheckpointManager: atomic commits, latest, retention, and surviving SIGKILL mid-save."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import time
import warnings

import pytest
import torch

import fsdpckpt
from fsdpckpt._io.publish import exchange

import workers
from multirank import run_ranks, start_ranks


def _parts():
    model = workers.make_model()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.05)}


def _steps(manager):
    return [int(p.name.split("_")[1]) for p in manager.checkpoints()]


def test_layout_is_one_accelerate_folder_per_step(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=None)
    manager.save(7, **_parts())
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_7"]
    assert {"pytorch_model_fsdp_0", "optimizer_0", "random_states_0.pkl", "fsdpckpt.json"} <= \
        set(os.listdir(tmp_path / "checkpoint_7"))


def test_keep_last_keeps_the_newest(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=2)
    for step in range(5):
        manager.save(step, **_parts())
    assert _steps(manager) == [3, 4]
    assert manager.latest() == tmp_path / "checkpoint_4"


def test_keep_every_also_keeps_milestones(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=1, keep_every=3)
    for step in range(8):
        manager.save(step, **_parts())
    assert _steps(manager) == [0, 3, 6, 7]


def test_old_checkpoints_are_deleted_only_after_the_new_one_commits(tmp_path, monkeypatch):
    import fsdpckpt.training.manager as manager_module

    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=1)
    manager.save(0, **_parts())

    def crash(*_a, **_k):
        raise RuntimeError("disk died")

    monkeypatch.setattr(manager_module, "save_state", crash)
    with pytest.raises(RuntimeError):
        manager.save(1, **_parts())
    assert _steps(manager) == [0]


def test_async_saves_count_only_once_complete_and_are_never_deleted_early(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=1, async_save=True)
    manager.save(0, **_parts())
    assert manager.checkpoints() == []                  # still being written
    manager.save(1, **_parts())                          # completes and commits step 0
    assert _steps(manager) == [0]
    assert (tmp_path / ".tmp-checkpoint_1").exists()     # pending, not deleted
    manager.wait()
    assert _steps(manager) == [1]


def test_restore_loads_the_latest_and_returns_its_step(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path)
    parts = _parts()
    manager.save(3, **parts)
    fresh = _parts()
    assert manager.restore(**fresh) == 3
    for name, value in parts["model"].state_dict().items():
        assert torch.equal(fresh["model"].state_dict()[name], value)


def test_restore_warns_what_load_state_reports(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path)
    manager.save(4, **_parts())
    latest = manager.latest()
    # As if saved on 2 ranks: this single process applies the RNG policy and must say so.
    shutil.copy(latest / "random_states_0.pkl", latest / "random_states_1.pkl")
    with pytest.warns(fsdpckpt.ResumeWarning, match="RNG states saved for 2 ranks, this run has 1"):
        assert manager.restore(**_parts()) == 4
    assert manager.last_restore.step == 4
    assert "saved for 2 ranks" in manager.last_restore.warnings[0]


def test_a_plain_restore_issues_no_warning_and_keeps_its_result(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path)
    manager.save(2, **_parts())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.restore(**_parts()) == 2
    assert [str(w.message) for w in caught] == []
    assert manager.last_restore.restored == ("model", "optimizer", "rng")
    assert manager.last_restore.warnings == ()


def test_restore_without_checkpoints_returns_none(tmp_path):
    assert fsdpckpt.CheckpointManager(tmp_path).restore(**_parts()) is None


def test_leftovers_of_a_crashed_save_are_removed_with_a_log_line(tmp_path, caplog):
    (tmp_path / ".tmp-checkpoint_9").mkdir()
    with caplog.at_level(logging.WARNING, logger="fsdpckpt"):
        manager = fsdpckpt.CheckpointManager(tmp_path)
    assert not (tmp_path / ".tmp-checkpoint_9").exists()
    assert "did not finish" in caplog.text and manager.latest() is None


def test_a_folder_without_manifest_is_not_a_committed_checkpoint(tmp_path):
    (tmp_path / "checkpoint_5").mkdir()
    assert fsdpckpt.CheckpointManager(tmp_path).latest() is None


# --- SIGKILL at random moments --------------------------------------------------

TRIALS = 20


def _wait_for(log, count, seconds=60):
    deadline = time.monotonic() + seconds
    while not log.exists() or log.read_text().count("started") < count:
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.02)


def _wait_for_commit(log, seconds=120):
    deadline = time.monotonic() + seconds
    while not any(line.isdigit() for line in log.read_text().split()):
        assert time.monotonic() < deadline, "the first save did not commit"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.multirank
def test_sigkill_during_saves_never_loses_or_damages_a_committed_checkpoint(tmp_path):
    rng = random.Random(1234)
    root, log = tmp_path / "ckpts", tmp_path / "committed.log"
    killed_mid_save = 0
    for trial in range(TRIALS):
        rendezvous = tmp_path / f"rdzv{trial}"
        rendezvous.mkdir()
        procs = start_ranks(workers.save_forever, str(root), str(log),
                            rendezvous_dir=str(rendezvous))
        _wait_for(log, 2 * (trial + 1))      # both ranks of this trial are saving
        if trial == 0:  # the check below needs one commit to protect, however busy the machine
            _wait_for_commit(log)
        time.sleep(rng.uniform(0.05, 0.6))   # then die anywhere in a save, or between saves
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.join()

        killed_mid_save += bool(list(root.glob(".tmp-*")))
        manager = fsdpckpt.CheckpointManager(root, keep_last=3)  # as the next run would
        newest = manager.latest()
        assert newest is not None, f"trial {trial}: no committed checkpoint"
        assert not list(root.glob(".tmp-*")), "leftovers of the killed save remain"
        for path in manager.checkpoints():  # every committed checkpoint is whole
            report = fsdpckpt.verify_checkpoint(path)
            assert report["ok"], (trial, path, report["problems"])
        # Every step the run reported committed is still there, unless retention (keep 3)
        # dropped it for 3 newer commits. Newer commits the run never reported exist: one
        # between its commit and its log line, and one promoted at the next start (complete
        # in its .tmp folder, killed before the rename).
        committed = [int(x) for x in log.read_text().split() if x.isdigit()]
        steps = _steps(manager)
        for reported in committed:
            assert reported in steps or sum(s > reported for s in steps) >= 3, \
                (trial, reported, committed[-3:], steps)
        assert committed[-1] in steps, (trial, committed[-3:], steps)
        # It loads: on one process every trial, on two ranks every fifth.
        step = int(newest.name.split("_")[1])
        assert fsdpckpt.load_state(newest, workers.make_model()).step == step
        if trial % 5 == 4:
            assert run_ranks(workers.restore_latest, str(root)) == [step, step]
    assert killed_mid_save >= TRIALS // 4, killed_mid_save  # the kills did land inside saves


def test_saving_an_existing_step_again_replaces_it(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=2)
    manager.save(3, **_parts())
    manager.save(3, overwrite=True, **_parts())
    assert _steps(manager) == [3] and not list(tmp_path.glob(".tmp-*"))


def test_saving_an_existing_step_without_overwrite_is_refused_and_keeps_it(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=3)
    manager.save(3, **_parts())
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(fsdpckpt.OutputExistsError, match=r"checkpoint_3: step 3 is saved "
                       r"already; nothing was written.*overwrite=True"):
        manager.save(3, **_parts())
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_a_replacing_save_swaps_the_copies_in_one_step(tmp_path, monkeypatch):
    import fsdpckpt._io.publish as publish

    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=3)
    manager.save(30, **_parts())
    swaps = []

    def swapped_then_crash(a, b):
        swaps.append(exchange(a, b))
        raise KeyboardInterrupt  # the job dies right after the swap, before any cleanup

    monkeypatch.setattr(publish, "exchange", swapped_then_crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(30, overwrite=True, **_parts())
    assert swaps == [True]  # this file system swaps (ext4, tmpfs, xfs, btrfs do)
    # The new copy is committed; the old one, under the hidden name, goes at the next start.
    assert _steps(fsdpckpt.CheckpointManager(tmp_path)) == [30]
    assert not list(tmp_path.glob(".tmp-*"))


def test_exchange_swaps_two_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    assert exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b" / "x").read_text() == "a" and not list((tmp_path / "a").iterdir())


def test_exchange_of_a_missing_name_raises_naming_it(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError, match="nowhere"):
        exchange(tmp_path / "a", tmp_path / "nowhere")


def test_a_crash_before_the_rename_of_a_replacing_save_loses_nothing(tmp_path, monkeypatch):
    # Where the system cannot swap (an old kernel, a file system without RENAME_EXCHANGE),
    # the old copy is renamed out of sight first: a crash then leaves the new copy whole
    # under the hidden name, and the next start commits it.
    import fsdpckpt._io.publish as publish
    import fsdpckpt.training.manager as manager_module

    monkeypatch.setattr(publish, "exchange", lambda a, b: False)
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=3)
    manager.save(30, **_parts())
    real_rename = os.rename

    def crash_on_commit(src, dst):
        if str(src).endswith(".tmp-checkpoint_30"):
            raise KeyboardInterrupt  # the job dies between uncommitting the old and renaming
        return real_rename(src, dst)

    monkeypatch.setattr(manager_module.os, "rename", crash_on_commit)
    with pytest.raises(KeyboardInterrupt):
        manager.save(30, overwrite=True, **_parts())
    monkeypatch.setattr(manager_module.os, "rename", real_rename)
    assert _steps(fsdpckpt.CheckpointManager(tmp_path)) == [30]  # the complete copy is committed


def test_a_rewind_keeps_the_checkpoint_just_saved(tmp_path):
    manager = fsdpckpt.CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 15):
        manager.save(step, **_parts())
    assert 15 in _steps(manager)
