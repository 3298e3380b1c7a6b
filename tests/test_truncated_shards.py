"""A truncated rank file (a crash mid-copy, a full disk) is caught by every entry point, which
names the file and says it is truncated; a merge refuses it before writing anything.

One parametrized test over entry points and over how much of the file is left, in place of
one copy per command.
"""

from __future__ import annotations

import os
import shutil

import pytest

import fsdpckpt
from fsdpckpt.dcp.checks import check_folder
from fsdpckpt.dcp.reader import read_dcp_folder

from conftest import FIXTURES, run_cli, save_small_checkpoint


def _saved(root):
    return save_small_checkpoint(root / "ckpt")


# How much of the file is left (of its ``size`` bytes), and which rank file of the DTensor
# fixture loses it.
_CUTS = {
    "rank 0 cut to 100 bytes": ("__0_0.distcp", lambda size: 100),
    "rank 1 cut to half": ("__1_0.distcp", lambda size: size // 2),
    "rank 1 50 bytes short": ("__1_0.distcp", lambda size: size - 50),
    "rank 1 10 bytes short": ("__1_0.distcp", lambda size: size - 10),
}


def _check_folder(folder, target, tmp_path, monkeypatch):
    problems = check_folder(read_dcp_folder(folder))
    assert problems and all(p.path == str(target) and "truncated" in p.message
                            for p in problems)


def _inspect_checkpoint(folder, target, tmp_path, monkeypatch):
    report = fsdpckpt.inspect_checkpoint(folder)
    assert report["ok"] is False and report["problems"]
    assert all(p["path"] == str(target) and "truncated" in p["message"]
               for p in report["problems"])


def _cli_inspect(folder, target, tmp_path, monkeypatch):
    result = run_cli("inspect", folder)
    assert result.exit_code == 1
    assert f"{target}:" in result.stdout and "truncated" in result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "not whole" in line


def _cli_verify(folder, target, tmp_path, monkeypatch):
    result = run_cli("verify", folder)
    assert result.exit_code == 1
    assert f"{target}:" in result.stdout and "truncated" in result.stdout


def _cli_merge(folder, target, tmp_path, monkeypatch):
    # Where the merge calls it from (imported first: a module first imported while the
    # patch is on would keep the patched function after it is undone).
    import fsdpckpt.merging.merger as merger

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    # Refused by the size check of the plan, before the writer is ever called.
    monkeypatch.setattr(merger, "write_plan", lambda *a, **k: pytest.fail("started writing"))
    result = run_cli("merge", folder, out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"fsdpckpt: error: {target}: ")
    assert "truncated" in line and "fsdpckpt inspect" in line
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def _load_full_state_dict(folder, target, tmp_path, monkeypatch):
    with pytest.raises(fsdpckpt.CorruptCheckpointError) as caught:
        fsdpckpt.load_full_state_dict(folder)
    assert str(caught.value).startswith(f"{target}: ") and "truncated" in str(caught.value)


# Each entry point, and the folder it is given: the DTensor fixture, or a checkpoint that
# save_state wrote (verify then checks the bytes against the manifest too).
_ENTRY_POINTS = {
    "check_folder": ("dcp", _check_folder),
    "inspect_checkpoint": ("dcp", _inspect_checkpoint),
    "cli inspect": ("dcp", _cli_inspect),
    "cli verify": ("dcp", _cli_verify),
    "cli verify with a manifest": ("saved", _cli_verify),
    "cli merge": ("dcp", _cli_merge),
    "load_full_state_dict": ("dcp", _load_full_state_dict),
}


@pytest.mark.parametrize("cut", sorted(_CUTS))
@pytest.mark.parametrize("entry_point", sorted(_ENTRY_POINTS))
def test_a_truncated_rank_file_is_named_as_truncated(tmp_path, dtensor_copy, monkeypatch,
                                                     entry_point, cut):
    kind, check = _ENTRY_POINTS[entry_point]
    name, left = _CUTS[cut]
    if kind == "dcp":
        folder, target = dtensor_copy, dtensor_copy / name
    else:  # one process saved it: rank 0's file is the only one
        folder = _saved(tmp_path)
        target = folder / "optimizer_0" / "__0_0.distcp"
    os.truncate(target, left(target.stat().st_size))
    check(folder, target, tmp_path, monkeypatch)


def _cut_optimizer(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "fsdp2_accelerate", ckpt)
    target = ckpt / "optimizer_0" / "__1_0.distcp"
    os.truncate(target, 3000)  # 22 of its chunks and objects now lie past its end
    return ckpt, target


def test_a_truncated_file_is_one_problem_however_many_chunks_it_cut(tmp_path):
    ckpt, target = _cut_optimizer(tmp_path)
    (problem,) = check_folder(read_dcp_folder(ckpt / "optimizer_0"))
    assert problem.path == str(target)
    assert problem.message.startswith("the file is truncated: it has 3000 bytes, but ")
    assert "21 more chunks and objects lie past it too, the last ending at byte" in \
        problem.message and "copy it again" in problem.message


@pytest.mark.parametrize("command", [("inspect", "--summary"), ("verify",)])
def test_inspect_and_verify_say_a_truncated_file_once(tmp_path, command):
    ckpt, target = _cut_optimizer(tmp_path)
    result = run_cli(*command[:1], ckpt, *command[1:])
    assert result.exit_code == 1
    lines = [line for line in result.stdout.splitlines() if str(target) in line]
    assert len(lines) == 1 and "the file is truncated" in lines[0], result.stdout
