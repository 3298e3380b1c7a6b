"""Training checkpoints on object storage: save_state, load_state and CheckpointManager on a
real S3 server (tests/s3server.py), and the commit protocol of docs/remote-training.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

import fsdpckpt
from fsdpckpt.errors import NotACheckpointError
from fsdpckpt.training import _remote

import workers
from deep_compare import assert_same_tensors
from multirank import run_ranks, start_ranks

pytestmark = pytest.mark.s3



def _parts(seed: int = 0):
    model = workers.make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def _names(server, url: str) -> set[str]:
    fs = server.filesystem()
    target = url.removeprefix("s3://")
    found = fs.ls(target, detail=False, refresh=True) if fs.exists(target) else []
    return {p.rstrip("/").rsplit("/", 1)[1] for p in found if p.rstrip("/") != target}


def _manager(s3, **kwargs):
    server, root = s3
    return fsdpckpt.CheckpointManager(f"s3://{root}/run", storage_options=server.options,
                                      **kwargs)


def _steps(manager) -> list[int]:
    return [int(p.name.split("_")[1]) for p in manager.checkpoints()]


def _same_state(a: dict, b: dict) -> None:
    # a's tensors, each of the same dtype and bytes in b.
    assert_same_tensors(b["model"].state_dict(), a["model"].state_dict(), keys="expected",
                        shape=False)
    assert json.dumps(str(a["optimizer"].state_dict())) == \
        json.dumps(str(b["optimizer"].state_dict()))


# -- save_state / load_state -----------------------------------------------------------------

def test_save_state_to_s3_loads_back_bit_exact(s3):
    server, root = s3
    url, saved = f"s3://{root}/ckpt", _parts(seed=1)
    scheduler = torch.optim.lr_scheduler.StepLR(saved["optimizer"], 3)
    scheduler.step()
    fsdpckpt.save_state(url, **saved, scheduler=scheduler, step=5,
                        storage_options=server.options)
    fresh = _parts()
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh["optimizer"], 3)
    result = fsdpckpt.load_state(url, **fresh, scheduler=fresh_scheduler,
                                 storage_options=server.options)
    assert result.step == 5 and result.restored == ("model", "optimizer", "scheduler", "rng")
    _same_state(saved, fresh)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_a_remote_save_ends_with_the_manifest_and_no_intent_marker(s3):
    server, root = s3
    fsdpckpt.save_state(f"s3://{root}/ckpt", **_parts(), step=1, storage_options=server.options)
    names = _names(server, f"s3://{root}/ckpt")
    assert {"fsdpckpt.json", "pytorch_model_fsdp_0", "optimizer_0", "random_states_0.pkl"} <= names
    assert _remote.INCOMPLETE not in names


def test_a_remote_save_checks_against_its_manifest(s3):
    server, root = s3
    url = f"s3://{root}/ckpt"
    fsdpckpt.save_state(url, **_parts(), step=1, storage_options=server.options)
    manifest = json.loads(server.filesystem().cat_file(f"{root}/ckpt/fsdpckpt.json"))
    local = {n: info["size"] for n, info in manifest["files"].items()}
    fs = server.filesystem()
    assert {n: fs.info(f"{root}/ckpt/{n}")["size"] for n in local} == local


def test_saving_to_s3_without_manifest_is_refused(s3):
    server, root = s3
    with pytest.raises(ValueError, match="commit marker"):
        fsdpckpt.save_state(f"s3://{root}/ckpt", **_parts(), manifest=False,
                            storage_options=server.options)


def test_a_remote_folder_whose_save_did_not_finish_is_refused_by_load_state(s3):
    server, root = s3
    url = f"s3://{root}/ckpt"
    fsdpckpt.save_state(url, **_parts(), step=1, storage_options=server.options)
    fs = server.filesystem()
    fs.pipe_file(f"{root}/ckpt/{_remote.INCOMPLETE}", b"")
    fs.rm_file(f"{root}/ckpt/fsdpckpt.json")
    with pytest.raises(NotACheckpointError, match="did not finish"):
        fsdpckpt.load_state(url, **_parts(), storage_options=server.options)


def test_saving_again_into_a_remote_folder_leaves_nothing_of_the_old_save(s3):
    server, root = s3
    url = f"s3://{root}/ckpt"
    fsdpckpt.save_state(url, **_parts(), scheduler=torch.optim.lr_scheduler.StepLR(
        _parts()["optimizer"], 3), step=1, storage_options=server.options)
    fsdpckpt.save_state(url, model=workers.make_model(), step=2, overwrite=True,
                        storage_options=server.options)
    names = _names(server, url)
    assert "optimizer_0" not in names and "scheduler.bin" not in names


# -- CheckpointManager ---------------------------------------------------------------------

def test_saving_into_a_remote_checkpoint_without_overwrite_is_refused(s3):
    server, root = s3
    url = f"s3://{root}/again"
    fsdpckpt.save_state(url, model=workers.make_model(), step=1, storage_options=server.options)
    with pytest.raises(fsdpckpt.OutputExistsError, match="holds a checkpoint already"):
        fsdpckpt.save_state(url, model=workers.make_model(), step=2,
                            storage_options=server.options)
    assert fsdpckpt.load_state(url, model=workers.make_model(),
                               storage_options=server.options).step == 1


def test_the_manager_refuses_a_remote_step_saved_before_unless_overwrite(s3):
    manager = _manager(s3, keep_last=None)
    manager.save(4, **_parts(seed=1))
    with pytest.raises(fsdpckpt.OutputExistsError, match="step 4 is saved already"):
        manager.save(4, **_parts(seed=2))
    assert _steps(manager) == [4]
    manager.save(4, overwrite=True, **_parts(seed=2))
    assert _steps(manager) == [4]


def test_manager_saves_restores_bit_exact_and_finds_the_latest(s3):
    manager = _manager(s3, keep_last=None)
    for step in (1, 2):
        saved = _parts(seed=step)
        manager.save(step, **saved)
    assert _steps(manager) == [1, 2]
    assert str(manager.latest()).endswith("/run/checkpoint_2")
    fresh = _parts()
    assert _manager(s3).restore(**fresh) == 2
    _same_state(saved, fresh)


def test_manager_keep_last_keeps_the_newest_on_s3(s3):
    manager = _manager(s3, keep_last=2)
    for step in range(4):
        manager.save(step, **_parts())
    assert _steps(manager) == [2, 3]
    server, root = s3
    assert _names(server, f"s3://{root}/run") == {"checkpoint_2", "checkpoint_3"}


def test_manager_keep_every_also_keeps_milestones_on_s3(s3):
    manager = _manager(s3, keep_last=1, keep_every=2)
    for step in range(5):
        manager.save(step, **_parts())
    assert _steps(manager) == [0, 2, 4]


def test_async_saves_count_only_once_complete_on_s3(s3):
    manager = _manager(s3, keep_last=1, async_save=True)
    manager.save(0, **_parts())
    manager.save(1, **_parts())          # completes and commits step 0
    assert _steps(manager) == [0]        # step 1 is not committed before wait()
    manager.wait()
    assert _steps(manager) == [1]
    assert manager.last_digest is not None


def test_restore_without_checkpoints_returns_none_on_s3(s3):
    assert _manager(s3).restore(**_parts()) is None


def test_a_folder_without_manifest_is_not_committed_and_is_left_alone(s3):
    # Accelerate names its folders checkpoint_{n} too: without the intent marker a folder
    # is not ours to delete.
    server, root = s3
    server.filesystem().pipe_file(f"{root}/run/checkpoint_5/scheduler.bin", b"x")
    manager = _manager(s3)
    assert manager.latest() is None
    assert "checkpoint_5" in _names(server, f"s3://{root}/run")


def test_leftovers_of_an_unfinished_remote_save_are_swept_by_the_next_manager(s3, caplog):
    server, root = s3
    fs = server.filesystem()
    fs.pipe_file(f"{root}/run/checkpoint_9/{_remote.INCOMPLETE}", b"")
    fs.pipe_file(f"{root}/run/checkpoint_9/random_states_0.pkl", b"partial")
    with caplog.at_level("WARNING", logger="fsdpckpt"):
        manager = _manager(s3)
    assert manager.latest() is None and "did not finish" in caplog.text
    assert _names(server, f"s3://{root}/run") == set()


def test_old_checkpoints_are_deleted_only_after_the_new_one_commits_on_s3(s3, monkeypatch):
    import fsdpckpt.training._commit as commit_module  # where a save writes its manifest

    manager = _manager(s3, keep_last=1)
    manager.save(0, **_parts())

    def crash(*_a, **_k):
        raise RuntimeError("network died")

    monkeypatch.setattr(commit_module, "write_manifest", crash)  # killed before the commit
    with pytest.raises(RuntimeError):
        manager.save(1, **_parts())
    monkeypatch.undo()
    fresh = _manager(s3, keep_last=1)
    assert _steps(fresh) == [0]
    assert fresh.restore(**_parts()) == 0


def test_a_deletion_cut_short_never_leaves_a_checkpoint_that_looks_whole(s3, monkeypatch):
    manager = _manager(s3, keep_last=1)
    manager.save(0, **_parts())
    real_remove = _remote._remove
    removed: list[str] = []

    def die_after_the_manifest(path):
        real_remove(path)
        if path.parent.name == "checkpoint_0":
            removed.append(path.name)
        if path.name == "fsdpckpt.json" and path.parent.name == "checkpoint_0":
            raise KeyboardInterrupt  # killed in the middle of the deletion

    monkeypatch.setattr(_remote, "_remove", die_after_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        manager.save(1, **_parts())
    monkeypatch.undo()
    assert removed == ["fsdpckpt.json"]                       # the manifest went first
    assert _steps(manager) == [1]                             # 0 is no longer committed
    server, root = s3
    _manager(s3, keep_last=1)                                 # the next start sweeps it
    assert _names(server, f"s3://{root}/run") == {"checkpoint_1"}


# -- two ranks, and SIGKILL at random moments --------------------------------------------------

def save_forever_remote(rank: int, world: int, url: str, options: str, log: str) -> None:
    """As workers.save_forever, into a CheckpointManager on the S3 server."""
    model = workers.wrap(workers.make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    manager = fsdpckpt.CheckpointManager(url, keep_last=3, storage_options=json.loads(options))
    last = manager.restore(model=model, optimizer=optimizer)
    step = 0 if last is None else last + 1  # a restored step 0 is resumed, not saved again
    with open(log, "a") as out:
        out.write("started\n")
        out.flush()
        while True:
            x, y = workers._batch()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.save(step, model=model, optimizer=optimizer)
            if rank == 0:
                out.write(f"{step}\n")
                out.flush()
                os.fsync(out.fileno())
            step += 1


def save_and_restore_remote(rank: int, world: int, url: str, options: str) -> tuple:
    model = workers.wrap(workers.make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    manager = fsdpckpt.CheckpointManager(url, keep_last=2, storage_options=json.loads(options))
    x, y = workers._batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    manager.save(3, model=model, optimizer=optimizer)
    expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    fresh = workers.wrap(workers.make_model(), "fsdp2")
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    step = manager.restore(model=fresh, optimizer=fresh_optimizer)
    same = all(torch.equal(expected[k], v.full_tensor()) for k, v in fresh.state_dict().items())
    return step, same


def restore_latest_remote(rank: int, world: int, url: str, options: str) -> int | None:
    model = workers.wrap(workers.make_model(), "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    manager = fsdpckpt.CheckpointManager(url, keep_last=3, storage_options=json.loads(options))
    return manager.restore(model=model, optimizer=optimizer)


@pytest.mark.multirank
def test_two_ranks_save_and_restore_through_s3(s3):
    server, root = s3
    url, options = f"s3://{root}/run", json.dumps(server.options)
    assert run_ranks(save_and_restore_remote, url, options) == [(3, True), (3, True)]
    names = _names(server, f"{url}/checkpoint_3")
    assert {"random_states_0.pkl", "random_states_1.pkl", "fsdpckpt.json"} <= names


TRIALS = 8


def _wait_for(log, count, seconds=90):
    deadline = time.monotonic() + seconds
    while not log.exists() or log.read_text().count("started") < count:
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.02)


def _wait_for_commit(log, seconds=180):
    deadline = time.monotonic() + seconds
    while not any(line.isdigit() for line in log.read_text().split()):
        assert time.monotonic() < deadline, "the first save did not commit"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.multirank
def test_sigkill_during_remote_saves_never_loses_or_damages_a_committed_checkpoint(s3,
                                                                                 tmp_path):
    server, root = s3
    url, options, log = f"s3://{root}/run", json.dumps(server.options), tmp_path / "log"
    rng = random.Random(4321)
    killed_mid_save = 0
    for trial in range(TRIALS):
        rendezvous = tmp_path / f"rdzv{trial}"
        rendezvous.mkdir()
        procs = start_ranks(save_forever_remote, url, options, str(log),
                            rendezvous_dir=str(rendezvous))
        _wait_for(log, 2 * (trial + 1))
        if trial == 0:
            _wait_for_commit(log)
        time.sleep(rng.uniform(0.05, 1.0))  # then die anywhere in a save, or between saves
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.join()

        fs = server.filesystem()
        leftovers = [p for p in fs.find(root, withdirs=False) if p.endswith(_remote.INCOMPLETE)]
        killed_mid_save += bool(leftovers)
        manager = fsdpckpt.CheckpointManager(url, keep_last=3,
                                             storage_options=json.loads(options))
        newest = manager.latest()
        assert newest is not None, f"trial {trial}: no committed checkpoint"
        assert not [p for p in fs.find(root, withdirs=False) if p.endswith(_remote.INCOMPLETE)
                    and not fs.exists(p.rsplit("/", 1)[0] + "/fsdpckpt.json")], \
            "leftovers of the killed save remain"
        committed = [int(x) for x in log.read_text().split() if x.isdigit()]
        steps = _steps(manager)
        for reported in committed:
            assert reported in steps or sum(s > reported for s in steps) >= 3, \
                (trial, reported, committed[-3:], steps)
        # The newest checkpoint is never older than the last step reported committed. (Not
        # "the last reported step is kept": a kill between a save's commit and its report,
        # three trials running, commits three newer steps unreported, and keep_last=3 then
        # rightly deletes the reported one; the loop above checks exactly that rule.)
        assert max(steps) >= committed[-1], (trial, committed[-3:], steps)
        for path in manager.checkpoints():  # every committed checkpoint is whole: it loads
            assert fsdpckpt.load_state(path, workers.make_model()).step == \
                int(path.name.split("_")[1])
        step = int(newest.name.split("_")[1])
        assert fsdpckpt.load_state(newest, workers.make_model()).step == step
        if trial % 4 == 3:
            assert run_ranks(restore_latest_remote, url, options) == [step, step]
    assert killed_mid_save >= 1, killed_mid_save  # the kills did land inside saves
