"""What a full disk leaves behind (issue 17 §5): verify and inspect decode every side file
with the reader load_state uses and name stray temporary files; save_state into a full
disk raises DiskFullError naming the path and leaves nothing that latest(), restore() or
verify accepts.

The full disks are real: a small tmpfs, mounted in a private mount namespace
(``unshare --user --map-root-user --mount``, which needs no root where user namespaces are
enabled). Where that is not possible the tests that need one are skipped, saying so; the
damaged files they leave are also made by hand below, so the checks run everywhere.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fsdpckpt

from conftest import FIXTURES, ROOT, hostile_pickle
from conftest import run_cli as run

# --- the leftovers of a full disk, made by hand --------------------------------------------


class _Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value, "scale": torch.tensor([2.0])}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.Linear(17, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, optimizer


def _full_checkpoint(folder: Path, manifest: bool = False) -> Path:
    """Every side file load_state reads: RNG, scheduler, scaler, custom state. Without a
    manifest by default, as Accelerate saves (the case where verify had only the files)."""
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    fsdpckpt.save_state(
        folder,
        model,
        optimizer,
        scheduler,
        step=5,
        scaler=_Counter(4),
        extra={"counter": _Counter(9)},
        manifest=manifest,
    )
    return folder


def _load(folder: Path) -> None:
    model, optimizer = _model_and_optimizer()
    fsdpckpt.load_state(
        folder,
        model,
        optimizer,
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=2),
        scaler=_Counter(),
        extra={"counter": _Counter()},
    )


def _problems(folder: Path) -> dict[str, str]:
    return {p["path"]: p["message"] for p in fsdpckpt.inspect_checkpoint(folder)["problems"]}


def test_an_intact_checkpoint_with_every_side_file_passes_verify_and_inspect(tmp_path):
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    torch.save({"epoch": 1}, ckpt / "sampler.bin")
    assert _problems(ckpt) == {}
    assert fsdpckpt.verify_checkpoint(ckpt).ok


def test_an_empty_scheduler_file_fails_verify_and_inspect_names_it(tmp_path):
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    (ckpt / "scheduler.bin").write_bytes(b"")
    result = run("verify", ckpt)
    assert result.exit_code == 1
    assert f"{ckpt / 'scheduler.bin'}: is empty (0 bytes)" in result.stdout
    assert (
        "is empty (0 bytes), not a scheduler state file"
        in _problems(ckpt)[str(ckpt / "scheduler.bin")]
    )
    inspected = run("inspect", ckpt)
    assert inspected.exit_code == 1 and "scheduler.bin" in inspected.stdout
    assert "Structure: OK" not in inspected.stdout


def test_an_rng_file_cut_at_4096_bytes_fails_verify_and_inspect_names_it(tmp_path):
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    rng = ckpt / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:4096])
    result = run("verify", "--json", ckpt)
    assert result.exit_code == 1
    assert str(rng) in {p["path"] for p in json.loads(result.stdout)["problems"]}
    assert "not a readable RNG state file" in _problems(ckpt)[str(rng)]


def test_a_stray_manifest_tmp_without_a_manifest_fails_verify_and_inspect(tmp_path):
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    (ckpt / "fsdpckpt.json.tmp").write_bytes(b'{"files": {')
    result = run("verify", ckpt)
    assert result.exit_code == 1
    assert f"{ckpt / 'fsdpckpt.json.tmp'}: stray temporary file" in result.stdout
    assert "a save that did not finish" in _problems(ckpt)[str(ckpt / "fsdpckpt.json.tmp")]


_SIDE_FILES = ["scheduler.bin", "scaler.pt", "custom_checkpoint_0.pkl", "random_states_0.pkl"]


@pytest.mark.parametrize("name", _SIDE_FILES)
def test_verify_reports_a_cut_side_file_as_load_state_refuses_it(tmp_path, name):
    # One reader: what verify says of the file is, word for word, why load_state refuses it.
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    path = ckpt / name
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(fsdpckpt.NotACheckpointError) as refused:
        _load(ckpt)
    problems = {p.path: p.message for p in fsdpckpt.verify_checkpoint(ckpt).problems}
    assert str(refused.value) == f"{path}: {problems[str(path)]}"


def test_a_cut_sampler_file_is_reported_though_fsdpckpt_never_loads_it(tmp_path):
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    torch.save({"epoch": 1, "seed": 3}, ckpt / "sampler.bin")
    data = (ckpt / "sampler.bin").read_bytes()
    (ckpt / "sampler.bin").write_bytes(data[: len(data) // 2])
    assert str(ckpt / "sampler.bin") in _problems(ckpt)


def test_a_hostile_scheduler_file_is_reported_and_never_runs(tmp_path):
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    sentinel = tmp_path / "ran"
    # A torch.save archive whose data.pkl runs code when unpickled with plain pickle.
    torch.save({"x": 1}, ckpt / "scheduler.bin")
    _swap_data_pkl(ckpt / "scheduler.bin", hostile_pickle(sentinel))
    problems = _problems(ckpt)
    assert "global" in problems[str(ckpt / "scheduler.bin")]
    assert not fsdpckpt.verify_checkpoint(ckpt).ok
    assert not sentinel.exists()


def _swap_data_pkl(path: Path, data: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, content in entries:
            archive.writestr(name, data if name.endswith("/data.pkl") else content)


def test_a_full_disk_while_writing_a_side_file_raises_disk_full_error_and_leaves_nothing(
    tmp_path, monkeypatch
):
    # Simulated at fsdpckpt's write of side files: the file is cut at 4096 bytes and the
    # OS says ENOSPC, as a full disk does (the real full disk is below).
    import errno

    from fsdpckpt.training import state

    def short_write(path, data, *, sync=True):
        Path(path).write_bytes(data[:4096])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state, "put_bytes", short_write)
    model, optimizer = _model_and_optimizer()
    with pytest.raises(fsdpckpt.DiskFullError, match="random_states_0.pkl: no space left") as e:
        fsdpckpt.save_state(tmp_path / "ckpt", model, optimizer, step=1)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []
    with pytest.raises(fsdpckpt.NotACheckpointError):
        fsdpckpt.verify_checkpoint(tmp_path / "ckpt")


def test_disk_full_error_is_one_class_in_errors(tmp_path):
    from fsdpckpt import errors
    from fsdpckpt.merging import writer

    assert fsdpckpt.DiskFullError is errors.DiskFullError is writer.DiskFullError
    assert issubclass(errors.DiskFullError, OSError)


# --- a real full disk -------------------------------------------------------------------------

_SCENARIO = """
import json, os, subprocess, sys, torch
sys.path.insert(0, {tests!r})
import fsdpckpt
from fsdpckpt.training.manager import CheckpointManager

def model_and_optimizer(width):
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer

def mount(path, size):
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={{size}}", "tmpfs", path], check=True)

def files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder)
                  for d, _, names in os.walk(folder) for f in names)

def judged(folder):
    out = {{}}
    try:
        out["verify_ok"] = fsdpckpt.verify_checkpoint(folder).ok
    except fsdpckpt.FsdpCkptError as exc:
        out["verify_ok"], out["verify_error"] = False, str(exc)
    return out

def save(folder):
    model, optimizer = model_and_optimizer(256)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    fsdpckpt.save_state(folder, model, optimizer, scheduler, step=3)

work = {work!r}
# What the save takes on a tmpfs, then disks a little or a lot too small for it: full in
# the model's data, the optimizer's, the side files and the manifest.
mount(f"{{work}}/probe", "64m")
save(f"{{work}}/probe/ckpt")
stat = os.statvfs(f"{{work}}/probe")
used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
pages = used // 4096
sizes = sorted({{max(1, int(pages * f)) for f in (0.05, 0.3, 0.6, 0.9)}} |
               {{pages - k for k in (1, 2, 3, 5)}})
results = {{"saves": [], "used": used}}
for i, size in enumerate(sizes):
    disk = f"{{work}}/disk{{i}}"
    mount(disk, f"{{size * 4}}k")
    entry = {{"size": size * 4096}}
    try:
        save(f"{{disk}}/ckpt")
        entry["raised"] = None
    except BaseException as exc:
        entry["raised"], entry["message"] = type(exc).__name__, str(exc)
        entry["oserror"] = isinstance(exc, OSError)
    entry["left"] = files(f"{{disk}}/ckpt")
    entry.update(judged(f"{{disk}}/ckpt"))
    results["saves"].append(entry)

# An asynchronous save: the full disk surfaces in save_state or in wait().
disk = f"{{work}}/async"
mount(disk, "64k")
model, optimizer = model_and_optimizer(256)
try:
    fsdpckpt.save_state(f"{{disk}}/ckpt", model, optimizer, step=3, async_save=True).wait()
    results["async_raised"] = None
except BaseException as exc:
    results["async_raised"], results["async_message"] = type(exc).__name__, str(exc)
results["async_left"] = files(f"{{disk}}/ckpt")

# The manager: step 1 fits, step 2 does not.
disk = f"{{work}}/managed"
mount(disk, "400k")
manager = CheckpointManager(f"{{disk}}/run")
small, small_optimizer = model_and_optimizer(16)
manager.save(1, model=small, optimizer=small_optimizer)
big, big_optimizer = model_and_optimizer(256)
try:
    manager.save(2, model=big, optimizer=big_optimizer)
    results["manager_raised"] = None
except BaseException as exc:
    results["manager_raised"], results["manager_message"] = type(exc).__name__, str(exc)
results["latest"] = os.path.basename(str(manager.latest()))
fresh, fresh_optimizer = model_and_optimizer(16)
results["restored_step"] = CheckpointManager(f"{{disk}}/run").restore(
    model=fresh, optimizer=fresh_optimizer)
results["leftovers"] = {{name: judged(f"{{disk}}/run/{{name}}")
                        for name in os.listdir(f"{{disk}}/run") if name.startswith(".tmp")}}
print("RESULT" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def full_disk_runs(tmp_path_factory):
    """save_state and a CheckpointManager on real, small tmpfs disks (see the module doc)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: a real full disk (a tmpfs) cannot be mounted here")
    work = tmp_path_factory.mktemp("disks")
    code = textwrap.dedent(_SCENARIO).format(tests=str(ROOT / "tests"), work=str(work))
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    if "RESULT" not in proc.stdout:
        if "mount" in proc.stderr or "unshare" in proc.stderr:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[-300:]}")
        raise AssertionError(proc.stdout + proc.stderr)
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def test_save_state_into_a_full_disk_raises_disk_full_error_naming_the_path(full_disk_runs):
    for entry in full_disk_runs["saves"]:
        assert entry["raised"] == "DiskFullError", entry
        assert entry["oserror"]
        message = entry["message"]
        assert "\n" not in message and "CheckpointException" not in message
        assert "/ckpt/" in message and ": no space left on the device" in message


def test_a_full_disk_hits_every_stage_of_a_save(full_disk_runs):
    named = {e["message"].split("/ckpt/")[1].split(":")[0] for e in full_disk_runs["saves"]}
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= named
    assert named - {"pytorch_model_fsdp_0", "optimizer_0"}  # a side file or the manifest


def test_a_save_that_hit_a_full_disk_leaves_nothing_verify_accepts(full_disk_runs):
    for entry in full_disk_runs["saves"]:
        assert entry["left"] == [], entry
        assert entry["verify_ok"] is False, entry


def test_latest_and_restore_skip_a_save_that_hit_a_full_disk(full_disk_runs):
    assert full_disk_runs["manager_raised"] == "DiskFullError"
    assert full_disk_runs["latest"] == "checkpoint_1"
    assert full_disk_runs["restored_step"] == 1
    assert all(not judged["verify_ok"] for judged in full_disk_runs["leftovers"].values())


def test_the_fixture_rng_files_are_real_ones():
    # Checks decode RNG files now: fixtures must hold real ones, never stand-ins.
    from fsdpckpt.training._rng import load_rng_file

    for path in sorted(FIXTURES.glob("*/random_states_*.pkl")):
        assert "torch_manual_seed" in load_rng_file(path)


def test_a_cli_verify_of_a_full_disk_leftover_is_one_line(tmp_path):
    ckpt = _full_checkpoint(tmp_path / "ckpt")
    shutil.rmtree(ckpt / "optimizer_0")
    (ckpt / "scheduler.bin").write_bytes(b"")
    for name in _SIDE_FILES[1:]:
        (ckpt / name).unlink()
    (ckpt / "pytorch_model_fsdp_0" / ".metadata").unlink()
    result = run("verify", ckpt)
    assert result.exit_code == 1
    assert "scheduler.bin" in result.stdout and "never finished" in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_leaves_nothing(
    tmp_path, failing_rank
):
    import workers
    from multirank import run_ranks

    ckpt = tmp_path / "ckpt"
    raised = run_ranks(workers.save_into_a_full_disk, str(ckpt), failing_rank)
    name, message = raised[failing_rank]
    assert name == "DiskFullError"
    assert message.startswith(f"{ckpt / f'random_states_{failing_rank}.pkl'}: no space left")
    other = raised[1 - failing_rank]
    assert other and str(ckpt / f"random_states_{failing_rank}.pkl") in other[1]  # no hang
    assert list(ckpt.iterdir()) == []
    with pytest.raises(fsdpckpt.NotACheckpointError):
        fsdpckpt.verify_checkpoint(ckpt)


def test_an_async_save_into_a_full_disk_raises_disk_full_error_and_leaves_nothing(full_disk_runs):
    # From save_state (a side file) or from wait() (the background write), whichever the
    # full disk reaches first; the background write has ended before the files go.
    assert full_disk_runs["async_raised"] == "DiskFullError", full_disk_runs.get("async_message")
    assert "/ckpt/" in full_disk_runs["async_message"]
    assert ": no space left on the device" in full_disk_runs["async_message"]
    assert full_disk_runs["async_left"] == []
