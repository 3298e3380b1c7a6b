"""No crash loses a committed checkpoint or leaves a half-written output that passes as one.

Each commit path runs for real under ``strace`` (tests/crashsim.py); every disk state a power
loss could leave after each of its file-system operations, under ext4's ``data=ordered``
rules taken harshly, is materialized, and the invariants are checked in each with the
public API:

- a restore finds the newest step reported committed, or a newer whole one, bit-exact, and
  no step older than the last reported one is lost to retention;
- an output is absent, or the previous output whole, or the new one whole;
- ``verify`` never says OK for anything that is not whole.

Each test prints how many operations it recorded and how many states it checked
(``pytest -s``), and asserts it checked some.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import fsdpckpt

import crashsim

pytestmark = pytest.mark.skipif(shutil.which("strace") is None,
                                reason="needs strace (apt-get install strace; .ci/run does)")

#: What every recorded program and the checks share: the weights of each step.
PRELUDE = """
import logging, warnings
import torch
import fsdpckpt
logging.getLogger("fsdpckpt").setLevel(logging.ERROR)
warnings.simplefilter("ignore")


def model_at(step):
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
"""
_shared: dict = {}
exec(PRELUDE, _shared)
model_at = _shared["model_at"]


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("fsdpckpt").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.getLogger("fsdpckpt").setLevel(logging.NOTSET)


def _explore(tmp_path: Path, root: Path, program: str, check) -> crashsim.Exploration:
    recording = crashsim.record(PRELUDE + program, root, cwd=tmp_path)
    result = crashsim.explore(recording, check, tmp_path / "states")
    print(f"{result.operations} operations, {result.states} crash states, "
          f"{result.checked} distinct checked")
    assert result.checked > 0 and not result.violations, "\n".join(result.violations[:10])
    return result


def _verify_ok(path: Path) -> bool:
    try:
        return fsdpckpt.verify_checkpoint(path)["ok"] is True
    except fsdpckpt.FsdpCkptError:
        return False


def _same_model(module: torch.nn.Module, step: int) -> bool:
    want = model_at(step).state_dict()
    got = module.state_dict()
    return all(torch.equal(got[k], want[k]) for k in want)


def _verified_steps_are_whole(root: Path, weights: dict[int, list[int]]) -> list[str]:
    """``verify`` says OK only of a folder whose model is one that step was saved with."""
    problems = []
    for folder in sorted(root.glob("checkpoint_*")):
        step = int(folder.name.split("_")[1])
        if not _verify_ok(folder):
            continue
        model = fsdpckpt.load_full_state_dict(folder / "pytorch_model_fsdp_0")["model"]
        if not any(all(torch.equal(model[k], v) for k, v in model_at(w).state_dict().items())
                   for w in weights.get(step, [step])):
            problems.append(f"verify says OK of {folder.name}, which is not whole")
    return problems


# -- CheckpointManager ----------------------------------------------------------------------


def _manager_with(root: Path, steps: list[int], keep_last: int = 2) -> None:
    manager = fsdpckpt.CheckpointManager(root, keep_last=keep_last)
    for step in steps:
        manager.save(step, model=model_at(step))


def _restores(copy: Path, allowed: dict[int, int]) -> list[str]:
    """The newest checkpoint restores, its step one of ``allowed``, bit-exact with the
    weights ``allowed[step]`` names."""
    target = model_at(0)
    try:
        step = fsdpckpt.CheckpointManager(copy, keep_last=2).restore(model=target)
    except fsdpckpt.FsdpCkptError as exc:
        return [f"restore failed: {exc}"]
    if step not in allowed:
        return [f"restored step {step}, expected one of {sorted(allowed)}"]
    if not _same_model(target, allowed[step]):
        return [f"step {step} restored, not bit-exact"]
    return []


def test_a_save_with_retention_keeps_the_last_committed_step_in_every_crash_state(tmp_path):
    root = tmp_path / "run"
    _manager_with(root, [1, 2])

    def check(copy: Path, reported: list[str]) -> list[str]:
        allowed = {3: 3} if "3" in reported else {2: 2, 3: 3}
        return _restores(copy, allowed) + _verified_steps_are_whole(copy, {})

    program = (f"m = fsdpckpt.CheckpointManager({str(root)!r}, keep_last=2)\n"
               "m.save(3, model=model_at(3))\n" + crashsim.report("3"))
    _explore(tmp_path, root, program, check)


def test_a_save_over_a_step_keeps_a_whole_copy_of_it_in_every_crash_state(tmp_path):
    root = tmp_path / "run"
    _manager_with(root, [1, 2])

    def check(copy: Path, reported: list[str]) -> list[str]:
        # Step 2 again, with the weights of "step 20": before the save returns, either copy.
        weights = {2: [20]} if "2" in reported else {2: [2, 20]}
        restored = [_restores(copy, {2: w}) for w in weights[2]]
        problems = [] if any(not r for r in restored) else restored[0]
        return problems + _verified_steps_are_whole(copy, weights)

    program = (f"m = fsdpckpt.CheckpointManager({str(root)!r}, keep_last=2)\n"
               "m.save(2, model=model_at(20), overwrite=True)\n" + crashsim.report("2"))
    _explore(tmp_path, root, program, check)


# -- save_state into a new folder -----------------------------------------------------------


def test_save_state_leaves_a_loadable_checkpoint_or_none_that_passes(tmp_path):
    root = tmp_path / "out"
    root.mkdir()

    def check(copy: Path, reported: list[str]) -> list[str]:
        folder = copy / "ckpt"
        target = model_at(0)
        try:
            fsdpckpt.load_state(folder, target)
        except fsdpckpt.FsdpCkptError:
            return ["the saved checkpoint does not load"] if reported else []
        problems = [] if _same_model(target, 5) else ["a checkpoint loads, not bit-exact"]
        if not _verify_ok(folder) and reported:
            problems.append("verify refuses the saved checkpoint")
        return problems

    program = (f"fsdpckpt.save_state({str(root / 'ckpt')!r}, model_at(5))\n" +
               crashsim.report("saved"))
    _explore(tmp_path, root, program, check)


# -- merge ----------------------------------------------------------------------------------


def _output(folder: Path) -> dict[str, bytes] | None:
    """The output in ``folder`` as a loader finds it: the single file if there is one (loaders
    prefer it), else the index and the shards it names; None: no output."""
    import json

    if (folder / "model.safetensors").is_file():
        return {"model.safetensors": (folder / "model.safetensors").read_bytes()}
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    data = index.read_bytes()
    try:
        names = set(json.loads(data)["weight_map"].values())
    except (ValueError, KeyError):
        return {index.name: data}  # a damaged index: compared whole, so never old nor new
    files = {n: (folder / n).read_bytes() if (folder / n).is_file() else b"" for n in names}
    return {index.name: data, **files}


@pytest.mark.parametrize("shard", [None, "600B"], ids=["one-file", "sharded-with-index"])
def test_merge_over_an_output_leaves_the_old_or_the_new_whole(tmp_path, shard):
    root = tmp_path / "work"
    for step in (1, 2):
        fsdpckpt.save_state(root / f"ckpt{step}", model_at(step))
    fsdpckpt.merge(root / "ckpt2", tmp_path / "new", max_shard_size=shard)
    fsdpckpt.merge(root / "ckpt1", root / "out", max_shard_size=shard)
    old, new = _output(root / "out"), _output(tmp_path / "new")
    assert old != new and len(new) == (1 if shard is None else 3)  # 2 shards and the index

    def check(copy: Path, reported: list[str]) -> list[str]:
        now = _output(copy / "out")
        allowed = [new] if reported else [old, new, None]
        problems = [] if now in allowed else [f"the output is neither old nor new: {sorted(now)}"]
        if now not in (old, new) and _verify_ok(copy / "out"):
            problems.append("verify says OK of an output that is not whole")
        return problems

    program = (f"fsdpckpt.merge({str(root / 'ckpt2')!r}, {str(root / 'out')!r}, overwrite=True, "
               f"max_shard_size={shard!r})\n" + crashsim.report("merged"))
    _explore(tmp_path, root, program, check)


def test_the_explorer_finds_a_commit_that_renames_without_an_fsync(tmp_path):
    # The merge's publish with its folder fsync taken out: the rename that commits the new
    # output may be undone by a power loss after the merge reported it written.
    root = tmp_path / "work"
    fsdpckpt.save_state(root / "ckpt", model_at(2))
    fsdpckpt.merge(root / "ckpt", tmp_path / "new")
    new = _output(tmp_path / "new")

    def check(copy: Path, reported: list[str]) -> list[str]:
        now = _output(copy / "out")
        return [] if now == new or not reported else ["the merged output was lost"]

    program = ("import fsdpckpt._io.publish as publish\n"
               "publish.fsync_dir = lambda path: None  # the bug\n"
               f"fsdpckpt.merge({str(root / 'ckpt')!r}, {str(root / 'out')!r})\n" +
               crashsim.report("merged"))
    recording = crashsim.record(PRELUDE + program, root, cwd=tmp_path)
    result = crashsim.explore(recording, check, tmp_path / "states")
    assert any("(all unsynced lost): the merged output was lost" in v
               for v in result.violations), result.violations
