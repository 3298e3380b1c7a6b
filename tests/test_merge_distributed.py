"""A merge spread over ranks: the balance of files among ranks, outputs byte for byte the
single-process merge's, all-or-nothing across ranks, and the CLI under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpckpt
from fsdpckpt.errors import FsdpCkptError
from fsdpckpt.merging._distributed import assign_files, balance
from fsdpckpt.merging.plan import plan_merge
from fsdpckpt.merging.writer import STAGING_PREFIX

from conftest import DCP_FOLDERS, FIXTURES, run_cli

CKPT = FIXTURES / "fsdp2_accelerate"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# -- the balance: a pure function of the plan ------------------------------------------------


def test_balance_gives_the_largest_file_first_to_the_least_loaded_rank():
    # 5 -> rank 0; 3 -> 1; 3 -> 1 (3 < 5); 2 -> 0 (5 < 6); 1 -> 1 (6 < 7): 7 bytes each.
    assert balance([5, 3, 3, 2, 1], 2) == [0, 1, 1, 0, 1]


def test_balance_breaks_ties_by_order_and_lowest_rank():
    assert balance([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    assert balance([0, 0, 0], 3) == [0, 1, 2]


def test_balance_leaves_ranks_idle_when_there_are_fewer_files():
    assert balance([7], 3) == [0]
    assert balance([], 2) == []


def test_balance_refuses_a_world_without_ranks():
    with pytest.raises(ValueError, match="world_size"):
        balance([1], 0)


def test_assign_files_shares_every_file_of_every_plan_once_balanced_by_bytes():
    plans = [plan_merge(DCP_FOLDERS["fsdp2-model"], max_shard_size=600),
             plan_merge(DCP_FOLDERS["fsdp2-optimizer"], max_shard_size=600, stem="optimizer")]
    shares = assign_files(plans, 2)
    refs = sorted((r.plan, r.file) for share in shares for r in share)
    assert refs == sorted({(p, f) for p, plan in enumerate(plans)
                           for f in range(len(plan.files))})
    loads = [sum(plans[r.plan].files[r.file].nbytes for r in share) for share in shares]
    largest = max(f.nbytes for plan in plans for f in plan.files)
    assert abs(loads[0] - loads[1]) <= largest
    assert shares == assign_files(plans, 2)  # every rank computes the same


def test_a_process_group_without_torch_distributed_initialized_is_refused(tmp_path):
    with pytest.raises(FsdpCkptError, match="init_process_group"):
        fsdpckpt.merge(CKPT, tmp_path / "out", process_group=object())
    assert not (tmp_path / "out").exists()


def test_merge_help_says_how_to_spread_over_ranks():
    result = run_cli("merge", "--help")
    assert result.exit_code == 0
    assert "torchrun" in result.output and "gloo" in result.output


def test_cli_under_a_partial_torchrun_environment_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    result = run_cli("merge", CKPT, tmp_path / "out")
    assert result.exit_code == 1
    assert result.stderr.startswith("fsdpckpt: error: WORLD_SIZE is 2 but RANK")
    assert not (tmp_path / "out").exists()


# -- on 2 ranks (gloo, CPU) ------------------------------------------------------------------


def _spread_merge(rank: int, world: int, out: str, options: dict) -> list:
    import torch.distributed as dist

    results = fsdpckpt.merge(CKPT, out, process_group=dist.group.WORLD, **options)
    return [(str(r.path), r.tensors, r.bytes) for r in results]


_OPTIONS = {
    "safetensors-sharded": dict(max_shard_size=600),
    "safetensors-sharded-bf16": dict(max_shard_size=600, dtype="bf16"),
    "bin-sharded-with-optimizer": dict(format="bin", max_shard_size=600, optimizer=True),
    "safetensors-one-file": dict(),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(_OPTIONS))
def test_spread_merge_is_byte_identical_to_the_single_process_merge(name, tmp_path):
    from multirank import run_ranks

    options = _OPTIONS[name]
    single = fsdpckpt.merge(CKPT, tmp_path / "single", **options)
    per_rank = run_ranks(_spread_merge, str(tmp_path / "spread"), options)
    assert per_rank[0] == per_rank[1]  # every rank returns the results
    assert [(p.split("/")[-1], t, b) for p, t, b in per_rank[0]] == \
        [(r.path.name, r.tensors, r.bytes) for r in single]
    assert _files(tmp_path / "spread") == _files(tmp_path / "single")  # index included


def _fail_on_rank_1(rank: int, world: int, out: str) -> str:
    import torch.distributed as dist

    from fsdpckpt.merging import writer

    if rank == 1:
        def no_space(fd, size, path):
            raise writer.DiskFullError(28, f"{path.parent}: injected: no space left")

        writer._reserve = no_space
    try:
        fsdpckpt.merge(CKPT, out, max_shard_size=600, process_group=dist.group.WORLD)
    except FsdpCkptError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multirank
def test_a_failure_on_one_rank_fails_every_rank_and_leaves_nothing(tmp_path):
    from multirank import run_ranks

    out = tmp_path / "new" / "out"
    errors = run_ranks(_fail_on_rank_1, str(out))
    assert "injected: no space left" in errors[1]
    assert errors[0].startswith("rank 1 failed, so rank 0 stops too: ")
    assert "injected" in errors[0]
    assert not (tmp_path / "new").exists()  # the folders the merge created went too


@pytest.mark.multirank
def test_a_failure_on_one_rank_leaves_an_existing_output_folder_as_it_was(tmp_path):
    from multirank import run_ranks

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    run_ranks(_fail_on_rank_1, str(out))
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not any(p.name.startswith(STAGING_PREFIX) for p in out.iterdir())


def _merge_other_options_on_rank_1(rank: int, world: int, out: str) -> str:
    import torch.distributed as dist

    try:
        # bf16 and fp16: the same file names and sizes, other bytes.
        fsdpckpt.merge(CKPT, out, max_shard_size=600, dtype="fp16" if rank else "bf16",
                       process_group=dist.group.WORLD)
    except FsdpCkptError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multirank
def test_ranks_that_plan_different_merges_are_refused_before_writing(tmp_path):
    from multirank import run_ranks

    errors = run_ranks(_merge_other_options_on_rank_1, str(tmp_path / "out"))
    assert all("every rank must call merge with the same checkpoint and options" in e
               for e in errors), errors
    assert not (tmp_path / "out").exists()


def _merge_from_own_folder(rank: int, world: int, root: str) -> list:
    import torch.distributed as dist

    # Each rank in its own working folder, the output given relative to rank 0's.
    os.chdir(root if rank == 0 else Path(root) / "elsewhere")
    out = "out" if rank == 0 else "../out"
    return [r.path.name for r in fsdpckpt.merge(CKPT, out, max_shard_size=600,
                                                 process_group=dist.group.WORLD)]


@pytest.mark.multirank
def test_ranks_in_different_working_folders_write_into_the_same_staging_folder(tmp_path):
    from multirank import run_ranks

    (tmp_path / "elsewhere").mkdir()
    run_ranks(_merge_from_own_folder, str(tmp_path))
    fsdpckpt.merge(CKPT, tmp_path / "single", max_shard_size=600)
    assert _files(tmp_path / "out") == _files(tmp_path / "single")
    assert list((tmp_path / "elsewhere").iterdir()) == []


_INJECT = """
import os
if os.environ["RANK"] == "1":
    from fsdpckpt.merging import writer
    def no_space(fd, size, path):
        raise writer.DiskFullError(28, f"{path.parent}: injected: no space left")
    writer._reserve = no_space
from fsdpckpt.__main__ import run
run()
"""


def _torchrun(*args: object, script: Path | None = None) -> subprocess.CompletedProcess:
    target = [str(script)] if script else ["-m", "fsdpckpt"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *target, *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.multirank
def test_torchrun_merge_matches_the_single_process_merge_and_only_rank_0_reports(tmp_path):
    run = _torchrun("merge", CKPT, tmp_path / "spread", "--max-shard-size", "600",
                    "--dtype", "bf16", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)  # one document: rank 1 prints nothing
    assert [Path(f).name for f in report["outputs"][0]["files"]][-1] == \
        "model.safetensors.index.json"
    fsdpckpt.merge(CKPT, tmp_path / "single", max_shard_size=600, dtype="bf16")
    assert _files(tmp_path / "spread") == _files(tmp_path / "single")


@pytest.mark.multirank
def test_torchrun_merge_failing_on_rank_1_exits_non_zero_with_one_error_line_per_rank(tmp_path):
    script = tmp_path / "inject.py"
    script.write_text(_INJECT)
    run = _torchrun("merge", CKPT, tmp_path / "out", "--max-shard-size", "600", script=script)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("fsdpckpt: error: ")]
    assert len(errors) == 2, run.stderr
    assert any("injected: no space left" in e and "stops too" not in e for e in errors)
    assert any(e.startswith("fsdpckpt: error: rank 1 failed, so rank 0 stops too") for e in errors)
    assert not (tmp_path / "out").exists()


@pytest.mark.multirank
@pytest.mark.slow
def test_torchrun_merge_into_an_existing_output_prints_the_error_once_and_exits_1(tmp_path):
    """Every rank refuses the existing output; the lowest prints it, and no rank dies of
    gloo's abort at exit (SIGABRT, 'terminate called without an active exception')."""
    fsdpckpt.merge(CKPT, tmp_path / "out")
    before = _files(tmp_path / "out")
    for _ in range(2):  # the abort came about 1 exit in 6 per rank before
        run = _torchrun("merge", CKPT, tmp_path / "out")
        assert run.returncode == 1, run.stderr
        errors = [line for line in run.stderr.splitlines() if line.startswith("fsdpckpt: error")]
        assert len(errors) == 1, run.stderr
        assert "already exists" in errors[0] and "--overwrite" in errors[0], run.stderr
        assert "terminate called" not in run.stderr and "SIGABRT" not in run.stderr, run.stderr
    assert _files(tmp_path / "out") == before
